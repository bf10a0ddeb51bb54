"""Parallel strategies, applied to model.py's GPT from outside (model.py imports nothing from here).

Each strategy has two implementations, chosen with `parallel.impl`:
  scratch  our own, one readable file each: ddp.py (bucketed, overlapped all-reduce), zero.py (ZeRO-1 and ZeRO-2),
           fsdp.py (ZeRO-3), tp.py (Megatron tensor parallel, sequence parallel, vocab-parallel loss)
  torch    PyTorch's: DistributedDataParallel; DDP + ZeroRedundancyOptimizer; FSDP2 fully_shard (with
           reshard_after_forward=False: ZeRO-2's communication pattern); DTensor parallelize_module + loss_parallel
so every strategy has a reference to be checked and timed against. parallel=single is plain one-process training,
the reference that tests/ compares every strategy with, numerically.

tp and fsdp_tp lay the ranks out as a 2D ("dp", "tp") mesh from init_device_mesh: tensor parallel inside each group
of `tp` neighbouring ranks, data parallel (DDP for tp, FSDP for fsdp_tp) across the groups.

This file is the small surface train.py uses: apply() wraps the model and builds the optimizer; no_sync(),
loss_parallel() and clip_grad_norm() hide which wrapper holds what; all_ranks() is a flag every rank agrees on;
theory() (from plan.py) and state_bytes() are the accounting.
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from parallel import tp as tensor_parallel
from parallel.ddp import DDP
from parallel.fsdp import FSDP, units_of
from parallel.zero import ZeroOptimizer, clip_shards

STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp")
IMPLS = ("scratch", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def degrees(p, world):
    """(data-parallel degree, tensor-parallel degree). Ranks form a (dp, tp) grid, row-major: rank = i_dp * tp + i_tp,
    so the ranks of a tp group are neighbours (one node's GPUs, on NVLink)."""
    if p.name in ("tp", "fsdp_tp"):
        tp = world if p.tp is None else p.tp
        return world // tp, tp
    return world, 1


def check(p, world, model, seq_len, cpu_bf16=True):
    """The error message for parallel settings that can't work on `world` processes, or None. `model`: the GPTConfig
    (layers, heads, widths, padded vocab) the run will build."""
    if p.name not in STRATEGIES:
        return f"parallel={p.name!r}: expected one of {', '.join(STRATEGIES)}"
    if p.name == "single":
        return None if world == 1 else \
            f"parallel=single runs in one process, but {world} were launched; pick a parallel strategy"
    if world < 2 and p.name != "fsdp":  # FSDP on one rank: no sharding, all its machinery, to time it alone
        return (f"parallel={p.name} needs several processes, but this is one; launch it with "
                f"`torchrun --nproc_per_node=N train.py parallel={p.name}` (N >= 2)")
    if p.impl not in IMPLS:
        return f"parallel.impl={p.impl!r}: expected scratch or torch"
    if "bucket_mb" in p and not p.bucket_mb > 0:
        return f"parallel.bucket_mb={p.bucket_mb} must be positive"
    for key in ("reduce_dtype", "param_dtype"):
        if key in p and p[key] not in DTYPES:
            return f"parallel.{key}={p[key]!r}: expected float32 or bfloat16"
    if p.name in ("tp", "fsdp_tp"):
        tp = world if p.tp is None else p.tp
        if not (isinstance(tp, int) and tp >= 1 and world % tp == 0):
            return f"parallel.tp={tp} must divide the number of ranks ({world})"
        for n, what in ((model.n_head, "attention heads (model.n_head)"),
                        (4 * model.n_embd, "MLP hidden units (4 x model.n_embd)"),
                        (model.padded_vocab_size, "padded vocabulary entries")):
            if n % tp:
                return f"parallel.tp={tp} must divide the model's {n} {what}: each tp rank holds an equal share"
        for length, key in ((seq_len, "train.seq_len"), (model.block_size, "model.block_size")):
            if p.sequence_parallel and length % tp:
                return (f"parallel.sequence_parallel=true splits each sequence over the {tp} tp ranks, but "
                        f"{key}={length} is not divisible by {tp}")
    n_layer = model.n_layer
    if p.name in ("fsdp", "fsdp_tp"):
        k = p.blocks_per_unit
        if not (isinstance(k, int) and 1 <= k <= n_layer and n_layer % k == 0):
            return (f"parallel.blocks_per_unit={k} can't split the model's {n_layer} blocks into equal units; "
                    f"use a divisor of {n_layer}")
        n_units = n_layer // k + 2  # + the embedding and the norm + head
        if not 0 <= p.prefetch < n_units:
            return (f"parallel.prefetch={p.prefetch}: there are {n_units} units, so at most {n_units - 1} can be "
                    f"gathered ahead of the current one")
        if p.get("cpu_offload") and p.param_dtype == "bfloat16" and not cpu_bf16:
            return ("parallel.cpu_offload=true casts the CPU-held shards to param_dtype=bfloat16 on the CPU, which "
                    "this CPU can't do; use parallel.param_dtype=float32")
    return None


def apply(model, p, make_optimizer, device):
    """Materialize the model (built on the meta device) on `device` and apply the strategy; returns (model to call,
    optimizer). make_optimizer(model) builds the plain optimizer. The global RNG must be seeded: every strategy
    draws the same initial weights as parallel=single."""
    if p.name in ("tp", "fsdp_tp"):
        return _apply_tp(model, p, make_optimizer, device)
    if p.name == "fsdp" and p.impl == "scratch":  # materializes only this rank's shards
        return model, FSDP(model, make_optimizer, device, p.blocks_per_unit, p.reshard_after_forward, p.prefetch,
                           DTYPES[p.param_dtype], DTYPES[p.reduce_dtype], p.cpu_offload)
    model.to_empty(device=device)
    model.init_weights()
    if p.name == "single":
        return model, make_optimizer(model)
    reduce_dtype = DTYPES[p.reduce_dtype]
    if p.name == "fsdp":  # torch's FSDP2, unit for unit like ours
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[p.param_dtype], reduce_dtype=reduce_dtype)
        kw = dict(reshard_after_forward=p.reshard_after_forward, mp_policy=mp,
                  offload_policy=CPUOffloadPolicy(pin_memory=str(device) != "cpu") if p.cpu_offload
                  else OffloadPolicy())  # pinned memory needs an accelerator
        return _fully_shard(model, p.blocks_per_unit, **kw), make_optimizer(model)
    if p.impl == "scratch":
        if p.name == "ddp":
            return DDP(model, p.bucket_mb, reduce_dtype), make_optimizer(model)
        return model, ZeroOptimizer(model, make_optimizer, int(p.name[-1]), p.bucket_mb, reduce_dtype)
    if p.name == "zero2":  # FSDP2 that keeps parameters gathered from forward to backward: ZeRO-2's traffic
        mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        return _fully_shard(model, 1, reshard_after_forward=False, mp_policy=mp), make_optimizer(model)
    # forward_sync_buffers=False: the only buffers are RoPE tables, equal everywhere; broadcasting them each forward
    # would add traffic that says nothing about the strategy
    ddp = DistributedDataParallel(model, bucket_cap_mb=p.bucket_mb, gradient_as_bucket_view=True,
                                  forward_sync_buffers=False)
    if reduce_dtype == torch.bfloat16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        ddp.register_comm_hook(None, bf16_compress_hook)
    if p.name == "ddp":
        return ddp, make_optimizer(model)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    template = make_optimizer(model)
    return ddp, ZeroRedundancyOptimizer(template.param_groups, optimizer_class=type(template))


def _apply_tp(model, p, make_optimizer, device):
    """Tensor parallel over the "tp" dimension of a (dp, tp) mesh; over "dp": DDP (parallel=tp) or FSDP
    (parallel=fsdp_tp). The scratch code runs on the mesh's process groups."""
    from torch.distributed.device_mesh import init_device_mesh
    dp, tp = degrees(p, dist.get_world_size())
    mesh = init_device_mesh(torch.device(device).type, (dp, tp), mesh_dim_names=("dp", "tp"))
    if p.impl == "scratch":
        init_param = tensor_parallel.shard(model, mesh.get_group("tp"), p.sequence_parallel)
        model.mesh, model.sequence_parallel = mesh, p.sequence_parallel  # for clipping and gathering
        if p.name == "fsdp_tp":
            return model, FSDP(model, make_optimizer, device, p.blocks_per_unit, p.reshard_after_forward,
                               p.prefetch, DTYPES[p.param_dtype], DTYPES[p.reduce_dtype], group=mesh.get_group("dp"),
                               init_param=init_param)
        tensor_parallel.materialize(model, init_param, device)
        if dp > 1:
            model = DDP(model, p.bucket_mb, DTYPES[p.reduce_dtype], group=mesh.get_group("dp"))
        return model, make_optimizer(model)
    model.to_empty(device=device)
    model.init_weights()
    _torch_tp(model, mesh["tp"], p.sequence_parallel)
    if p.name == "fsdp_tp":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[p.param_dtype], reduce_dtype=DTYPES[p.reduce_dtype])
        model = _fully_shard(model, p.blocks_per_unit, mesh=mesh["dp"], mp_policy=mp,
                             reshard_after_forward=p.reshard_after_forward)
    elif dp > 1:
        # torch's DistributedDataParallel can't take DTensor parameters; its composable replicate() (built on
        # FSDP2's machinery, gradients all-reduced over the dp mesh) can
        from torch.distributed._composable.replicate_with_fsdp import replicate
        model = replicate(model, mesh=mesh["dp"])
    return model, make_optimizer(model)


def _torch_tp(model, mesh, sequence_parallel):
    """The same sharding through DTensor: torch's column/row-parallel styles, its vocab-parallel loss
    (loss_parallel, entered by train.py) and its sequence-parallel norms."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between layers
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        # one DTensor input per attention / MLP, so q, k and v's input gradients are summed before one all-reduce
        plan[b + "attn"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                              desired_input_layouts=(Replicate(), None, None))
        plan[b + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan.update({b + f"attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({b + "attn.proj": RowwiseParallel(output_layouts=seq), b + "mlp.up": ColwiseParallel(),
                     b + "mlp.down": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            plan.update({b + "norm1": SequenceParallel(), b + "norm2": SequenceParallel()})
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    if not sequence_parallel:
        # the norm gains are replicated; as DTensors (Replicate) too, so that every gradient is a DTensor on the same
        # mesh, as torch's gradient clipping needs, with the norm's input and output plain local tensors as before
        from torch.distributed.tensor import DTensor, distribute_module
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.RMSNorm):
                distribute_module(m, mesh, input_fn=lambda m, args, mesh: tuple(
                    DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args),
                    output_fn=lambda m, out, mesh: out.to_local())
    # the loss comes back as a replicated DTensor: hand train.py a plain tensor (its gradient flows through
    # to_local); called without targets (sampling), the model returns the full logits, not a vocab-sharded DTensor
    model.register_forward_hook(lambda m, args, kwargs, out: out.to_local() if tensor_parallel.has_targets(args, kwargs)
                                else out.full_tensor(), with_kwargs=True)
    if sequence_parallel:
        tensor_parallel.pad_sequence_for_sampling(model, mesh.size())


def loss_parallel(p):
    """Context for forward and backward: torch's tensor parallel computes the loss on vocab-sharded logits only
    inside torch's loss_parallel()."""
    if p.name in ("tp", "fsdp_tp") and p.impl == "torch":
        from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
        return torch_loss_parallel()
    return contextlib.nullcontext()


def _fully_shard(model, blocks_per_unit, **kw):
    """FSDP2 on the same units as our FSDP: each group of blocks, then the root (embedding, final norm, head)."""
    for _, modules in units_of(model, blocks_per_unit)[1:-1]:
        fully_shard(modules, **kw)
    return fully_shard(model, **kw)


def apply_activation_checkpointing(model, mode, every=1):
    """Recompute blocks' activations in backward instead of storing them (torch.utils.checkpoint, non-reentrant):
    mode full = every block, every_n = every `every`-th block, none = off. Each checkpointed block keeps only its
    input for backward; the cost is one more forward of it."""
    from torch.utils.checkpoint import checkpoint
    if mode == "none":
        return model
    for i, block in enumerate(unwrap(model).blocks):
        if mode == "full" or i % every == 0:
            # patch the instance's forward, not __call__: module hooks (FSDP's gathers) still run around it
            block.forward = (lambda fwd: lambda *a: checkpoint(fwd, *a, use_reentrant=False))(block.forward)
    return model


def unwrap(model):
    return model.module if isinstance(model, (DDP, DistributedDataParallel)) else model


def no_sync(model, opt):
    """Context for a non-final micro-step of gradient accumulation: no gradient communication."""
    for owner in (opt, model):
        if hasattr(owner, "no_sync"):
            return owner.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    # keep gradients local and the parameters gathered between micro-steps: without the second switch FSDP2
    # reshards after every backward and all-gathers again in the next forward, one extra Psi per micro-step
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def reshard(model, opt):
    """Free the parameters a forward without backward left gathered (FSDP with reshard_after_forward=False)."""
    if isinstance(opt, FSDP):
        opt.reshard()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def clip_grad_norm(model, opt, max_norm):
    """Clip to max_norm (inf: don't) and return the global gradient norm, wherever the gradients live."""
    inner = unwrap(model)
    if hasattr(inner, "mesh"):  # our tensor parallel
        return _clip_tp(inner, opt, max_norm)
    if hasattr(opt, "clip_grad_norm_"):
        return opt.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _clip_tp(model, opt, max_norm):
    """Our tensor parallel's gradient norm over the whole mesh. Gradients: .grad (parallel=tp: identical across dp
    after DDP's all-reduce, so summed over tp only) or FSDP's shard segments (fsdp_tp: disjoint across dp too, so
    summed over every rank). Under sequence parallel the norm gains' gradients are first summed over tp."""
    tp_group, tp = model.mesh.get_group("tp"), model.mesh["tp"].size()
    named = list(model.named_parameters())
    if isinstance(opt, FSDP):
        pieces = [(s.grad, tensor_parallel.shard_dim(n) is None) for n, p in named for s in opt.segments.get(p, [])]
        group = None
    else:
        pieces, group = [(p.grad, tensor_parallel.shard_dim(n) is None) for n, p in named], tp_group
    if model.sequence_parallel:
        tensor_parallel.sync_replicated_grads([g for g, replicated in pieces if replicated], tp_group)
    return clip_shards([g for g, _ in pieces], max_norm, group, model.mesh.device_type,
                       weights=[1 / tp if replicated else 1.0 for _, replicated in pieces])


def all_ranks(flag, op):
    """A boolean every rank agrees on (op dist.ReduceOp.MIN: true on all of them; MAX: true on any). One process
    without a process group: the flag itself."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return bool(t.item())


def state_bytes(model, opt):
    """Model state resident on this rank: parameters, gradients and optimizer state, in bytes, padding included.

    Counted by storage, so a flat buffer that many views share counts once, and so does its padding."""
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    tensors = []
    for p in list(model.parameters()) + [p for g in inner.param_groups for p in g["params"]]:
        tensors += [p, p.grad]
    tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        if t is not None:
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def theory(name, n_params, world, reduce_bytes=4, accum=1):
    """(comm bytes per step, model-state bytes per rank) that the ZeRO paper predicts for fp32 Adam. The formulas
    live in the planner, parallel/plan.py, with the rest of each strategy's theory."""
    from parallel import plan  # imported here: `python -m parallel.plan` must find it not yet imported
    return plan.theory(name, n_params, world, reduce_bytes, accum)
