"""Parallel strategies, applied to model.py's GPT from outside (model.py imports nothing from here).

Each strategy has two implementations, chosen with `parallel.impl`:
  scratch  our own, one readable file each: ddp.py (bucketed, overlapped all-reduce), zero.py (ZeRO-1 and ZeRO-2)
  torch    PyTorch's: DistributedDataParallel; DDP + ZeroRedundancyOptimizer; FSDP2 fully_shard with
           reshard_after_forward=False (ZeRO-2's communication pattern)
so every strategy has a reference to be checked and timed against. parallel=single is plain one-process training,
the reference that tests/ compares every strategy with, numerically.

This file is the small surface train.py uses: apply() wraps the model and builds the optimizer; no_sync(),
clip_grad_norm() and full_state_dict() hide which wrapper holds what; theory() (from plan.py) and state_bytes() are
the accounting.
"""
import contextlib

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from parallel.ddp import DDP
from parallel.fsdp import FSDP, units_of
from parallel.zero import ZeroOptimizer

STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")
IMPLS = ("scratch", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check(p, world, n_layer, cpu_bf16=True):
    """The error message for parallel settings that can't work on `world` processes, or None."""
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
    if p.name == "fsdp":
        k = p.blocks_per_unit
        if not (isinstance(k, int) and 1 <= k <= n_layer and n_layer % k == 0):
            return (f"parallel.blocks_per_unit={k} can't split the model's {n_layer} blocks into equal units; "
                    f"use a divisor of {n_layer}")
        n_units = n_layer // k + 2  # + the embedding and the norm + head
        if not 0 <= p.prefetch < n_units:
            return (f"parallel.prefetch={p.prefetch}: there are {n_units} units, so at most {n_units - 1} can be "
                    f"gathered ahead of the current one")
        if p.cpu_offload and p.param_dtype == "bfloat16" and not cpu_bf16:
            return ("parallel.cpu_offload=true casts the CPU-held shards to param_dtype=bfloat16 on the CPU, which "
                    "this CPU can't do; use parallel.param_dtype=float32")
    return None


def apply(model, p, make_optimizer, device):
    """Materialize the model (built on the meta device) on `device` and apply the strategy; returns (model to call,
    optimizer). make_optimizer(model) builds the plain optimizer. The global RNG must be seeded: every strategy
    draws the same initial weights as parallel=single."""
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
    if hasattr(opt, "clip_grad_norm_"):
        return opt.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state_dict(model, opt):
    """The whole model's weights as plain CPU tensors. A collective under FSDP: every rank must call it."""
    if isinstance(opt, FSDP):
        return opt.full_state_dict(model)
    model = unwrap(model)
    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = model.state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()}  # clone: views would save whole flat buffers


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
