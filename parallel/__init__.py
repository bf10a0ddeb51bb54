"""Parallel strategies, applied to model.py's GPT from outside (model.py imports nothing from here).

One device mesh, built once by the run's Layout (parallel/layout.py) from the degrees in `parallel.*`:
("pp", "dp_replicate", "dp_shard", "cp", "tp"), tensor parallel inside each group of `tp` neighbouring ranks (one
node's GPUs, on NVLink), context parallel across cp such groups, data parallel across the rest (HSDP's replicas of
FSDP shard groups; 1 x dp otherwise, flattened into "dp"), pipeline stages outermost (only activations cross between
them). Every strategy takes its process groups from it, by name, so the whole mesh composes: any degrees above 1
at once, pp x dp_replicate x dp_shard x cp x tp (tests/test_mesh.py: each combination at world 8 equal to one
process, all five at world 32 in the dry run). `parallelize` composes them in one fixed order (torchtitan's):

  0. pipeline stages              parallel/pp.py          over "pp", when pp > 1: this rank keeps its stages only
  1. tensor / sequence parallel   parallel/tp.py          over "tp", when tp > 1
  2. context parallel             parallel/cp.py          over "cp", when cp > 1
     expert parallel              parallel/ep.py          over ep of the dp x cp ranks, when ep > 1
  3. activation checkpointing     torch.utils.checkpoint  train.activation_checkpointing
  4. compile                      torch.compile           train.compile
  5. data parallel + optimizer    parallel/ddp.py, zero.py, fsdp.py over "dp" (dp x cp under context parallel):
     parallel.data (HSDP: fsdp.py over "dp_shard" (x cp), replicas across "dp_replicate", on each tp slice and
     each pipeline stage as plain FSDP is; ZeRO and FSDP own the optimizer step, so this step builds the optimizer)

Each strategy has two implementations, side by side in its file, chosen with `parallel.impl`: scratch (ours) and
torch (PyTorch's: DistributedDataParallel; DDP + ZeroRedundancyOptimizer; FSDP2 fully_shard; DTensor
parallelize_module + loss_parallel), so each is checked and timed against a reference. Both answer the same small
interface (parallel/strategy.py). parallel=single is plain one-process training, what tests/ compares every
strategy with, numerically.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import cp, ddp, ep, fsdp, pp, tp, zero, zero_deepspeed
from parallel.strategy import (DataParallel, ExpertParallel, TensorParallel, clip_grad_norm, dp_mesh, materialize,
                               state_bytes)



def _materialized(apply, **kw):
    """A strategy that takes the model whole: materialize it on the device first (only our FSDP materializes one
    shard at a time, itself)."""
    def applied(model, mesh, p, make_optimizer, device, init_param, **extra):
        materialize(model, init_param, device)
        return apply(model, mesh, p, make_optimizer, **kw, **extra)
    return applied


# (layout.strategy, layout.impl) -> the function that applies it over "dp" and builds the optimizer:
# f(model, data mesh, parallel settings, make_optimizer, device, init_param)
DATA_PARALLEL = {
    ("ddp", "scratch"): _materialized(ddp.apply_ddp), ("ddp", "torch"): _materialized(ddp.apply_torch_ddp),
    ("zero1", "scratch"): _materialized(zero.apply_zero, stage=1),
    ("zero1", "torch"): _materialized(zero.apply_torch_zero1),
    ("zero2", "scratch"): _materialized(zero.apply_zero, stage=2),
    ("zero2", "torch"): _materialized(zero.apply_torch_zero2),
    ("fsdp", "scratch"): fsdp.apply_fsdp, ("fsdp", "torch"): _materialized(fsdp.apply_torch_fsdp),
    # DeepSpeed's ZeRO stages 1, 2 and 3 (parallel/zero_deepspeed.py)
    **{(data, "deepspeed"): _materialized(zero_deepspeed.apply_deepspeed, stage=stage)
       for data, stage in (("zero1", 1), ("zero2", 2), ("fsdp", 3))},
}


@dataclass
class Parallelized:
    """What the training loop holds: the model to call and its optimizer, and the strategies that act on them."""
    model: torch.nn.Module  # call this: model(idx, targets) -> loss
    module: torch.nn.Module  # the GPT inside any wrapper (sampling, names)
    optimizer: object
    data: DataParallel
    tp: TensorParallel
    mesh: object  # None for one process without a process group
    layout: object  # parallel/layout.py's Layout: the degrees, the data strategy, the implementation
    device: str
    dp_rank: int = 0  # this rank's coordinate on "dp": which slice of the global batch it takes
    pipeline: object = None  # parallel/pp.py's Pipeline of this rank's stages, when pp > 1
    param_dtype: str = "float32"  # the working weights' dtype, parallel.param_dtype resolved
    ep: ExpertParallel = ExpertParallel()
    data_group: object = None  # every data-parallel rank (dp x cp): the router's statistics are summed over it

    @property
    def dims(self):
        return self.layout.dims

    def global_loss(self, loss_sum, accum):
        """The step's mean loss over the global batch, from each rank's summed micro-batch losses (on every rank):
        summed over all ranks, each tp and cp rank of a replica holding its replica's loss and each pipeline's loss
        held by its last stage alone, so divided by the accum x (world / pp) micro-batch losses in that sum."""
        if self.mesh is not None:
            dist.all_reduce(loss_sum)
        return loss_sum.item() / (accum * self.layout.stage_world)

    def generate(self, idx, max_new_tokens):
        """model.generate, on every rank (a sharded model needs all of them): through the stages under a pipeline."""
        return (self.pipeline or self.module).generate(idx, max_new_tokens)

    def no_sync(self):
        return self.data.no_sync()

    def loss_context(self):
        return self.tp.loss_context()

    def sync_grads(self):
        self.tp.sync_grads(self.data)
        self.ep.sync_grads()

    def clip_grad_norm(self, max_norm):
        return clip_grad_norm(self.data, self.tp, self.mesh, max_norm, self.device, self.ep)

    def router_stats(self):
        """The step's router statistics of every MoE block (model.py's MoE), summed over the data-parallel ranks:
        (blocks, n_experts + 2), each row the tokens given to each expert, then the dropped assignments and the
        summed balancing losses; None for a dense model. Moves router=bias's biases (the same on every rank, from
        the same sums) and starts the next step's statistics. Left on the device: nothing waits for it.
        Under a pipeline a rank holds its stages' blocks only: it puts their rows at their places among the whole
        model's MoE blocks (zeros elsewhere), sums them over its stage's data-parallel ranks (each block's once: they
        all hold it), then over pp, which only brings in the other stages' rows; every rank then has all of them."""
        cfg = self.module.cfg
        if not cfg.n_moe:
            return None
        layers = self.module.moe_layers()
        moe = [i for i in range(cfg.n_layer) if cfg.is_moe(i)]  # the model's MoE blocks, in block order
        # this rank's MoE blocks (single's names: blocks.5 stays 5 in a stage), in the order moe_layers gives them
        rows = [moe.index(i) for i in sorted(int(k) for k in self.module.blocks._modules) if cfg.is_moe(i)]
        stats = torch.zeros(len(moe), cfg.n_experts + 2, device=self.device)
        if layers:
            stats[rows] = torch.stack([torch.cat([m.load, m.dropped[None], m.aux[None]]) for m in layers])
        if self.data_group is not None and self.data_group.size() > 1:
            dist.all_reduce(stats, group=self.data_group)
        if self.pipeline is not None:
            dist.all_reduce(stats, group=self.pipeline.group)
        for m, row in zip(layers, stats[rows]):
            if m.rule == "bias":
                m.update_bias(row[:m.n])
            m.reset_stats()
        return stats

    def state_bytes(self):
        return state_bytes(self.data)


def parallelize(model, layout, p, mesh, make_optimizer, device, train):
    """Apply the strategies of `layout` (parallel/layout.py; `p` the parallel settings, their knobs) to `model` (a GPT
    on the meta device), in the order above; returns Parallelized. The global RNG must be seeded: every layout draws
    the same initial weights as parallel=single."""
    dims = layout.dims
    dp_rank = dp_mesh(mesh).get_local_rank() if mesh is not None else 0
    # 0. pipeline: keep this rank's stages only (still on the meta device), with single's names
    pipeline = pp.split(model, mesh, p, device) if dims["pp"] > 1 else None
    # 1. tensor parallel: ours shards the meta model in place; torch's materializes it whole and distributes it
    par_tp = TensorParallel()
    if dims["tp"] > 1:
        par_tp = tp.apply_tp(model, mesh, p) if layout.impl == "scratch" else tp.apply_torch_tp(model, mesh, p, device)
    # 2. context parallel: each sequence split over cp, attention by ring or all-gather
    data_mesh = mesh
    if dims["cp"] > 1:
        cp.apply_cp(model, mesh, p)
        data_mesh = cp.data_mesh(mesh)  # gradients are reduced over dp x cp
    # expert parallel: each MoE block's experts split over ep of the dp x cp ranks, tokens sent by all-to-all
    par_ep = ep.apply_ep(model, mesh, layout) if layout.ep > 1 else ExpertParallel()
    # 3. activation checkpointing, 4. compile: inside the blocks, so the strategies' hooks on them stay outside
    apply_activation_checkpointing(model, train.activation_checkpointing, train.ac_every, train.selective_matmuls)
    if train.compile:
        apply_compile(model, tensor_parallel=dims["tp"] > 1,
                      split_backward=dims["pp"] > 1 and p.pp_schedule == "zero_bubble")
    # 5. data parallel: ours FSDP materializes one shard at a time; everything else materializes here first. One
    # replica (parallel=single, or tensor parallel alone) needs no strategy; FSDP runs on one rank too, to be timed
    init_param = par_ep.init_param(par_tp.init_param or model.init_param)
    if pipeline is not None:  # each parameter drawn where single's RNG stream has it
        init_param = pipeline.init_param(init_param)
    if layout.strategy == "none":  # one replica: nothing to reduce
        materialize(model, init_param, device)
        data = DataParallel(model, make_optimizer)
    else:
        # the experts: ZeRO and DDP leave them to parallel/ep.py, FSDP shards them over ep's replicate group
        extra = {} if layout.ep == 1 else {"experts": par_ep} if layout.strategy == "fsdp" else \
            {"exclude": par_ep.names}
        data = DATA_PARALLEL[layout.strategy, layout.impl](model, data_mesh, p, make_optimizer, device, init_param,
                                                           **extra)
    if pipeline is not None:  # the schedule calls the stages through the data strategy's wrapper and hooks
        pipeline.call, pipeline.no_sync, pipeline.reduce_grads = data.model, data.no_sync, data.reduce_grads
    data_group = dp_mesh(data_mesh).get_group() if mesh is not None else None
    return Parallelized(data.model, data.module, data.optimizer, data, par_tp, mesh, layout, device, dp_rank,
                        pipeline, p.param_dtype, par_ep, data_group)


# What selective checkpointing keeps: the outputs of the ops that cost FLOPs (matmuls, attention kernels); the rest
# of a block (norms, activations, RoPE, residual adds: memory-bound) is recomputed in backward (Korthikanti et al.,
# 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4: recompute what is cheap)
SELECTIVE_SAVE = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))


# the linear layers' matmuls (with and without a bias), which selective_matmuls=alternate counts
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _selective_policy(alternate):
    """The policy of one checkpointed call of a block: keep SELECTIVE_SAVE's outputs; with `alternate`, recompute
    every second of the block's matmuls too (the 2nd, 4th, ... in the order the block runs them: proj, and the MLP's
    second; torchtitan's per-op policy). torch 2.13 asks the policy in forward alone and replays its answers in the
    recomputation; earlier versions ask again there (ctx.is_recompute), so each pass keeps a count of its own and
    both pick the same matmuls."""
    from torch.utils.checkpoint import CheckpointPolicy
    count = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        # only an op of the autograd graph: the kernels context parallelism runs inside its autograd.Function's
        # forward (no grad there) are pieces of one attention, whose output nothing keeps; saved, every block's
        # partial output would stay, cp x a rank's tokens on the ring's last rank (tools/act_memory.py, 2026-12-03);
        # the Function runs again whole in backward, its communication too, as under full checkpointing
        keep = op in SELECTIVE_SAVE and torch.is_grad_enabled()
        if keep and alternate and op in MATMULS:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def apply_activation_checkpointing(model, mode, every=1, matmuls="all"):
    """Recompute blocks' activations in backward instead of storing them (torch.utils.checkpoint, non-reentrant):
    mode full = every block, every_n = every `every`-th block, none = off: each checkpointed block keeps only its
    input for backward, and costs one more forward. selective = every block keeps its matmuls' and attention's
    outputs and recomputes the rest (torch.utils.checkpoint's selective checkpoint contexts, SELECTIVE_SAVE);
    matmuls=alternate (train.selective_matmuls) keeps only every other matmul's output of a block."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    if mode == "none":
        return model
    kw = {"context_fn": lambda: create_selective_checkpoint_contexts(_selective_policy(matmuls == "alternate"))} \
        if mode == "selective" else {}
    for i, block in enumerate(model.blocks):
        if mode in ("full", "selective") or i % every == 0:
            # patch the instance's forward, not __call__: module hooks (FSDP's gathers) still run around it
            block.forward = (lambda fwd: lambda *a: checkpoint(fwd, *a, use_reentrant=False, **kw))(block.forward)
    return model


def apply_compile(model, tensor_parallel=False, split_backward=False):
    """torch.compile the largest pieces of the model that hold none of the strategies' communication, so that every
    collective stays outside the graphs, where the strategies overlap it and parallel/comm.py counts it:
    - each block's forward and the head's (with the loss: model.Head, LinearCrossEntropy). The instance's forward,
      not the module's __call__: hooks on a block (FSDP's gathers, DDP's and ZeRO's bucket hooks on its
      parameters) stay outside, so each block's backward is a graph of its own and its buckets start reducing while
      earlier blocks' backward runs. Compiling the whole model puts all of backward in one graph: every bucket is
      ready only at its end, and nothing overlaps; under our FSDP, dynamo traces into the gathers and breaks on
      them.
    - under our tensor parallel, whose f and g sit at the attention's and MLP's boundaries (and in the loss):
      their forwards, the hooks outside.
    `split_backward`: the zero-bubble schedules, ours and torch's (ScheduleInterleavedZeroBubble), whose B pass takes
    the input gradient alone and keeps the graph for the W pass (retain_graph=True). AOT autograd frees ("donates") a
    compiled backward's saved activations as it runs, which a kept graph forbids (a RuntimeError at the first B
    pass, seen under both): this process compiles
    without donation from here on, and drops graphs an earlier run in it compiled with donation (a process of
    tools/jobs.py runs many jobs, and dynamo would reuse them). It reads nothing from the on-disk caches either
    (AOT autograd's and inductor's FX graph cache, under /tmp/torchinductor_$USER): their keys leave the
    donation out, so a backward cached by any earlier compiled run of the same block (1F1B, or parallel=single)
    came back with donation and overwrote what the W pass reads, silently (grad_norm 3e-4 off from step 0,
    found by tests/test_matrix.py). Compiled against eager for every strategy: docs/compile.md, from
    `python -m tools.bench --compile`."""
    if split_backward:
        from torch._inductor import config as inductor  # not loaded until something compiles
        torch._functorch.config.donated_buffer = False
        torch._functorch.config.enable_autograd_cache = False
        inductor.fx_graph_cache = False
        torch._dynamo.reset()
    if tensor_parallel:
        for block in model.blocks:
            block.attn.forward = torch.compile(block.attn.forward)
            block.mlp.forward = torch.compile(block.mlp.forward)
        return model
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
    if model.head is not None:  # a pipeline stage but the last has none
        model.head.forward = torch.compile(model.head.forward)  # the head with the loss (model.LinearCrossEntropy)
    return model
