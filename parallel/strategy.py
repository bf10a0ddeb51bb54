"""The small interface every strategy answers, ours and torch's alike, and what the strategies share.

A data-parallel strategy (parallel/ddp.py, zero.py, fsdp.py; parallel.data) is a `DataParallel`:
  model            what the loop calls: the module itself, or a wrapper around it (DDP)
  module           the GPT inside (names, sampling)
  optimizer        what the loop steps (param_groups, step, zero_grad): ZeRO and FSDP step their shards themselves
  local_optimizer  the torch optimizer that holds this rank's state (checkpoints, state accounting)
  no_sync()        the context of a non-final micro-step of gradient accumulation: no gradient communication
  reduce_grads()   reduce now what the backwards under no_sync accumulated (a pipeline runs its whole schedule
                   under no_sync, then this once)
  grads_sharded    true where each data-parallel rank holds a disjoint piece of every gradient (ZeRO-2, FSDP)
  replicas         how many data-parallel ranks hold each such piece: 1, or HSDP's dp_replicate
  shards_experts   under expert parallelism, whether the strategy shards the experts over their replicas (FSDP)
                   or leaves them whole for parallel/ep.py to reduce (DDP, ZeRO)
  grad_pieces()    [(parameter name, gradient piece)] on this rank, for the global norm
  holders(p)       the tensors a checkpoint writes for parameter p: ([(weights, offset)], [(optimizer key, offset)])
  optimizer_state()  {optimizer key: {state name: tensor}} for those keys (the local optimizer's own state)
  shape(p)         p's whole (tp-local) shape: its own, unless p is an empty stand-in (DeepSpeed's ZeRO-3)
  reshard()        free what a forward without backward left gathered
  after_load()     make what derives from the holders agree with them once a checkpoint is read (ZeRO's bf16 copy)
  state_tensors()  model state the strategy keeps that no parameter or optimizer state points at (state_bytes)
  transient_bytes  the most bytes held at once beyond the model state, where the strategy measures it (FSDP's
                   gathered units; ZeRO's full gradients between micro-steps)
This base class is itself the strategy of one replica (parallel.data=none, or DDP over a dp of 1).

Tensor parallelism (parallel/tp.py) is a `TensorParallel`: its degree, the context forward and backward run in
(torch's loss_parallel), which parameters are whole on every tp rank, and where this rank's piece of each parameter
sits in the full one. This base class is tp = 1.
"""
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


class DataParallel:
    grads_sharded = False
    replicas = 1
    shards_experts = False
    transient_bytes = None

    def __init__(self, model, make_optimizer=None, module=None):
        self.model, self.module = model, module if module is not None else model
        self.optimizer = self.local_optimizer = make_optimizer(self.module) if make_optimizer else None

    def no_sync(self):
        return contextlib.nullcontext()

    def reduce_grads(self):
        pass

    def grad_pieces(self):
        return [(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None]

    def holders(self, p):
        return [(p, 0)], [(p, 0)]

    def optimizer_state(self):
        return self.local_optimizer.state

    def shape(self, p):
        return tuple(p.shape)

    def reshard(self):
        pass

    def after_load(self):
        pass

    def state_tensors(self):
        return []


class TensorParallel:
    size = 1
    init_param = None  # fills a local parameter from the meta device; None: the model's own init_param

    def sync_grads(self, data):
        """Any sum over tp the gradients still need after backward (ours, under sequence parallel)."""

    def loss_context(self):
        return contextlib.nullcontext()

    def replicated(self, name):
        """Whole on every tp rank (counted 1/tp in the global gradient norm)."""
        return True

    def global_layout(self, name, p):
        """(the full parameter's shape, where this rank's piece starts in it)."""
        return tuple(p.shape), (0,) * p.dim()


class ExpertParallel:
    """Expert parallelism (parallel/ep.py): its degree, which parameters are experts (split over the ep group, left
    alone by the data strategy), how it fills them from single's draw, and the reduction their gradients still need
    after backward. This base class is ep = 1: every expert on every rank, reduced as any parameter."""
    size = 1
    group = None

    def init_param(self, inner):
        return inner

    def expert(self, name):
        return False

    def sync_grads(self):
        pass


def dp_mesh(mesh):
    """The mesh of all data-parallel ranks, one dimension: Layout.build_mesh's ("dp_replicate", "dp_shard")
    flattened (flattening again returns that one; slicing "dp" off the root mesh works too, but torch deprecates
    it)."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


@torch.no_grad()
def materialize(model, init_param, device):
    """Allocate and fill, one parameter at a time, every parameter still on the meta device (and the RoPE buffers):
    init_param(name, tensor) draws in named_parameters() order, so the values are parallel=single's."""
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        local = torch.empty(p.shape, dtype=p.dtype, device=device)
        init_param(name, local)
        setattr(module, name.rsplit(".", 1)[-1], nn.Parameter(local, p.requires_grad))
    model.init_buffers(device)


def owned_segments(params, offsets, lo, hi, shard, grad_shard, out):
    """For params laid out at `offsets` in a flat space, the views of `shard` (which holds [lo, hi) of that space)
    that belong to each; each view's .grad is the matching view of grad_shard (unless that is None), its
    .param_offset where in the flattened parameter it starts (for checkpoints) and its .shard_offset where in the
    shard. Adds {param: [views]} to `out`."""
    for p, o in zip(params, offsets):
        a, z = max(o, lo), min(o + p.numel(), hi)
        if a < z:  # this parameter overlaps the slice: that piece is one segment
            seg = shard[a - lo: z - lo]
            if grad_shard is not None:
                seg.grad = grad_shard[a - lo: z - lo]
            seg.param_offset, seg.shard_offset = a - o, a - lo
            out.setdefault(p, []).append(seg)
    return out


def sharded_optimizer(template, segments):
    """The template optimizer's class and param groups, each group over its parameters' segments."""
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [s for p in g["params"] for s in segments.get(p, [])]} for g in template.param_groups]
    return type(template)(groups)  # each group carries all its hyper-parameters


class Sharded(DataParallel):
    """What ZeRO and FSDP share: the optimizer steps `segments`, this rank's views of each parameter."""
    grads_sharded = True
    segments = {}

    def grad_pieces(self):
        return [(n, s.grad) for n, p in self.module.named_parameters() for s in self.segments.get(p, [])
                if s.grad is not None]


@torch.no_grad()
def clip_shards(grad_shards, max_norm, group=None, device=None, weights=None):
    """The global gradient norm from every rank's pieces (one all-reduce of a scalar over `group`; none without
    one), then torch's clipping rule (scale by max_norm / (norm + 1e-6) where that is below 1). Padding is zero, so
    it adds nothing. `weights`: how much each piece's squares count, for pieces several ranks of `group` hold (tensor
    parallel's replicated norm gains count 1/tp on each of the tp ranks)."""
    weights = weights or [1.0] * len(grad_shards)
    sq = sum(w * g.float().pow(2).sum() for g, w in zip(grad_shards, weights))
    sq = sq.to(device) if device is not None else sq  # shards offloaded to CPU; nccl reduces device tensors
    for g in group if isinstance(group, tuple) else (group,):  # a tuple of groups: summed over each in turn
        dist.all_reduce(sq, group=g)
    norm = sq.sqrt()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grad_shards:
            g.mul_(coef.to(g.device))
    return norm


def clip_grad_norm(data, tp, mesh, max_norm, device, ep=ExpertParallel()):
    """Clip to max_norm (inf: don't) and return the global gradient norm, wherever the gradients live.

    DTensor gradients (torch's FSDP2, HSDP included, and tensor parallel): torch's clipping reduces over their
    mesh. Whole gradients
    on one replica: torch's clipping. Otherwise every rank holds pieces: ZeRO's and FSDP's are disjoint over the
    whole mesh, tensor parallel's over tp only (dp replicas hold the same ones after DDP); the tp-replicated norm
    gains weigh 1/tp, so that summed over the tp ranks they count once."""
    params = list(data.module.parameters())
    # pipeline stages hold disjoint parameters: their squared norms add up over the pp group
    # (get_group, not mesh["pp"]: slicing a mesh reads its rank tensor, a host read on every step)
    pp = mesh.get_group("pp") if mesh is not None and "pp" in mesh.mesh_dim_names else None
    pp = pp if pp is not None and pp.size() > 1 else None
    if any(isinstance(p, DTensor) for p in params):
        if pp is None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        sq = (norm.full_tensor() if isinstance(norm, DTensor) else norm).pow(2)
        dist.all_reduce(sq, group=pp)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())
        return sq.sqrt()
    if ep.size > 1:  # the experts disjoint within the ep group (parallel/ep.py, step 5)
        pieces = data.grad_pieces()
        # beside tensor parallelism (ours: the routed experts whole on every tp rank) a piece tp replicates counts
        # 1/tp on each tp rank
        over_tp = [1 / tp.size if tp.replicated(n) else 1.0 for n, _ in pieces]
        if data.grads_sharded:  # ZeRO's and FSDP's dense pieces disjoint over every rank (the default group: every
            # stage's too under a pipeline, each holding its own blocks); each expert whole on its ep_replicate ranks
            # (ZeRO) or sharded over them (FSDP)
            copies = 1 if data.shards_experts else ep.replicate.size()
            return clip_shards([g for _, g in pieces], max_norm, None, device,
                               weights=[w / copies if ep.expert(n) else w for (n, _), w in zip(pieces, over_tp)])
        # DDP: the dense gradients equal on every rank of a stage: summed over the ep group, then over tp and pp
        groups = (ep.group, *([mesh.get_group("tp")] if tp.size > 1 else []), *([pp] if pp is not None else []))
        return clip_shards([g for _, g in pieces], max_norm, groups, device,
                           weights=[w if ep.expert(n) else w / ep.size for (n, _), w in zip(pieces, over_tp)])
    if not data.grads_sharded and tp.size == 1:
        if pp is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return clip_shards([p.grad for p in params if p.grad is not None], max_norm, pp, device)
    pieces = data.grad_pieces()
    # None: the default group, the whole mesh (every stage too); HSDP's replicas hold the same pieces: each counts
    # 1/replicas on each of them
    group = None if data.grads_sharded else mesh.get_group("tp") if pp is None else (mesh.get_group("tp"), pp)
    return clip_shards([g for _, g in pieces], max_norm, group, device,
                       weights=[(1 / tp.size if tp.replicated(n) else 1.0) / data.replicas for n, _ in pieces])


def state_bytes(data):
    """Model state resident on this rank: parameters (working copies and fp32 masters), gradients and optimizer
    state, in bytes, padding included.

    Counted by storage, each at its own dtype's size, so a flat buffer that many views share counts once, and so
    does its padding. Sizes only: the same under fake tensors (tools/dry_run.py)."""
    inner = data.local_optimizer
    tensors = []
    for p in list(data.module.parameters()) + [p for g in inner.param_groups for p in g["params"]]:
        tensors += [p, p.grad]
    tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += data.state_tensors()
    storages = {}
    for t in tensors:
        if t is not None:
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[st._cdata] = st.nbytes()  # the storage itself, not its address: fake tensors have none
    return sum(storages.values())
