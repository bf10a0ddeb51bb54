"""FSDP (ZeRO-3) from scratch: parameters, gradients and optimizer state all sharded over the ranks; each unit's
parameters are gathered just before they are needed and freed right after.

Zhao et al., 2023, "PyTorch FSDP"; Rajbhandari et al., 2020 (ZeRO stage 3). P parameters, N ranks, fp32 Adam:
  model state per rank   16P/N bytes (fp32 shard 4P/N + gradient shard 4P/N + Adam moments 8P/N), plus the
                         transient: at most 1 + prefetch units gathered, the gradients of the unit in backward,
                         and 2 units' flattened gradients in reduction, and under gradient accumulation the
                         local gradient sums, P x bytes of reduce_dtype (`peak_gathered` measures it all)
  communication per step all-gather in forward (Psi) + all-gather again in backward (Psi) + reduce-scatter of the
                         gradients (Psi) = 3 Psi; 2 Psi with reshard_after_forward=false, which keeps each unit
                         gathered from its forward to its backward (ZeRO-2's traffic, with more memory held)

HSDP (parallel.dp_replicate > 1; Zhao et al., 2023, sec. 3.2.2, "hybrid sharding"): the N = dp_replicate x dp_shard
data-parallel ranks form dp_replicate replicas of dp_shard ranks each (a shard group is one node's GPUs, so its
all-gathers and reduce-scatters stay on the node's links). Everything above runs within the shard group (N there
is dp_shard: state 16P/dp_shard); each rank's reduced gradient slice is then all-reduced across the replicas (the
ranks holding the same slice), each reduction's all-reduce started as its reduce-scatter lands, and gradients
are divided by all N ranks: the mean over every data-parallel rank, as plain FSDP. Per rank per step: 3 Psi within
the shard group as above, plus an all-reduce of Psi / dp_shard across the replicas, 2 Psi / dp_shard counted, which
is all that crosses the network between nodes.

Units (parallel.blocks_per_unit): the embedding, every k transformer blocks, the final norm + head. A unit's
parameters are flattened into one flat space padded to a multiple of N; rank r keeps slice r of it as an fp32 master
shard. All parameters become views into the unit's gathered buffer, whose storage is resized to 0 when the unit is
freed and back when it is gathered again: the views autograd saved in forward point into that storage, so backward
sees the refilled values (the trick torch's first FSDP used).
- forward:  a pre-hook gathers the unit (in param_dtype) and starts gathering the next `prefetch` units; a post-hook
            frees it (reshard_after_forward) and hooks the unit's output gradient.
- backward: that output-gradient hook runs just before the unit's backward: it gathers the unit again and starts
            gathering the `prefetch` units before it. When the unit's last parameter gradient has been accumulated,
            the gradients are flattened, reduce-scattered (in reduce_dtype) and the unit freed; at the end of
            backward each rank adds its reduced slice into its fp32 gradient shard.
- step:     the optimizer only ever sees shards (the caller's optimizer class and groups, over this rank's pieces).
- no_sync:  non-final micro-steps communicate no gradient: as each unit's backward ends its gradients are added into
            a flat local sum in reduce_dtype (fp32 by default, whatever param_dtype: bf16 sums over micro-steps lose
            bits), which the last micro-step reduce-scatters; units are still freed.
- cpu_offload: shards, gradient shards and optimizer state live in CPU memory and the step runs there.
- meta-device init: given a model built on the meta device, each unit is materialized one parameter at a time from
            model.init_param (same RNG order as a whole-model init) and only this rank's slice is kept: no rank
            ever holds more than one full parameter besides its shards.
- expert parallelism (parallel/ep.py): a rank's E/ep experts of an MoE block differ within its ep group, so they
            are sharded over what is left of dp x cp, the ep_replicate group (R = dp x cp / ep ranks that hold the
            same experts), as a unit of their own inside their block's: gathered when the experts run, freed
            after, reduce-scattered over R and divided by all dp x cp ranks (their gradient already sums the ep
            group's tokens, which the all-to-all brought). State 16 (E/ep) / R = 16 E / (dp x cp) bytes a
            parameter: the same 16P/N as without ep; traffic per step over ep_replicate, 3 x their bytes. With
            R = 1 the unit is whole on its rank and nothing is communicated for it.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import buckets, comm
from parallel.layout import DTYPES
from parallel.strategy import DataParallel, Sharded, dp_mesh, owned_segments, sharded_optimizer


def units_of(model, blocks_per_unit):
    """[(name, [modules in forward order])]: embedding, blocks in groups of blocks_per_unit, norm + head."""
    blocks = list(model.blocks)
    groups = [("wte", [model.wte])] if model.wte is not None else []  # a pipeline stage may lack either end
    for i in range(0, len(blocks), blocks_per_unit):
        groups.append((f"blocks.{i}-{min(i + blocks_per_unit, len(blocks)) - 1}", blocks[i: i + blocks_per_unit]))
    return groups + ([("head", [model.norm, model.head])] if model.head is not None else [])


@dataclass(eq=False)
class UnitState:
    """What FSDP keeps per unit (unit.state): made at wrap time; the last three change as it is gathered and freed."""
    # the unit's name: wte, blocks.i-j or head (an MoE block's experts under ep: blocks.i-j.experts)
    name: str
    # its modules in forward order: a pre-hook on the first gathers the unit, a hook on the last frees it again
    modules: list
    # this rank's fp32 master shard, slice [lo, hi) of the unit's flat space (on the CPU under cpu_offload)
    master: torch.Tensor
    lo: int
    hi: int
    # the full parameters in param_dtype, each a view into it; its storage is resized to 0 while the unit is freed
    gathered: torch.Tensor
    # this rank's fp32 gradient shard, which every backward's reduced slice is added into; zeroed by zero_grad
    grad_shard: torch.Tensor
    # the ranks that shard the unit (FSDP's group; for experts ep_replicate) and how many they are
    group: object = None
    world: int = 1
    # an expert unit no other rank holds (ep = dp x cp): whole here, gathered by a copy, reduced by nobody
    alone: bool = False
    # gathered holds the full parameters: set once its all-gather is waited on, cleared by _free
    is_gathered: bool = True
    # (work, src) of the all-gather in flight, src kept alive until it lands: set in _gather, cleared once waited on
    gather: tuple | None = None
    # the flat local gradient sum in reduce_dtype: set at its first backward of a step, cleared when reduce-scattered
    acc: torch.Tensor | None = None


class FSDP(Sharded):
    """The strategy and its optimizer in one: the loop steps this object, which steps this rank's shards."""
    shards_experts = True

    def __init__(self, model, make_optimizer, device, blocks_per_unit=1, reshard_after_forward=True, prefetch=1,
                 param_dtype=torch.float32, reduce_dtype=torch.float32, cpu_offload=False, group=None,
                 init_param=None, replicate_group=None, experts=None):
        # init_param(name, tensor) fills a parameter from the meta device (default: model.init_param); tensor
        # parallelism passes one that fills the local tp shard. group: the ranks that shard; replicate_group (HSDP):
        # the ranks that hold the same shard, across which reduced gradients are all-reduced; experts (parallel/ep.py's
        # ExpertParallel, under ep > 1): its MoE blocks' experts modules become units over its replicate group
        init_param = init_param or model.init_param
        self.model = self.module = model
        self.optimizer = self
        self.group, self.device, self.prefetch = group, torch.device(device), prefetch
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.reshard_after_forward, self.param_dtype, self.reduce_dtype = reshard_after_forward, param_dtype, \
            reduce_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_device = torch.device("cpu") if cpu_offload else self.device
        names = {p: n for n, p in model.named_parameters()}
        on_meta = any(p.is_meta for p in model.parameters())
        self.units, segments = [], {}
        self.pending_reduce, self.pending_replicate = [], []
        self.peak_gathered = 0  # most bytes of gathered units (and their gradients in flight) held at once
        self.local_grads = 0  # bytes of the units' gradients accumulated locally between micro-steps (no_sync)
        expert_modules = set(experts.modules) if experts is not None else set()
        for name, modules in units_of(model, blocks_per_unit):
            inner = [e for m in modules for e in m.modules() if e in expert_modules]
            skip = {p for e in inner for p in e.parameters()}
            segments = self._add_unit(name, modules, group, self.world, self.rank, skip, names, on_meta, init_param,
                                      param_dtype, cpu_offload, segments)
            r = experts.replicate if inner else None  # the experts' own units, after their block's
            for e in inner:
                segments = self._add_unit(f"{name}.experts", [e], r, r.size(), r.rank(), set(), names, on_meta,
                                          init_param, param_dtype, cpu_offload, segments)
        if on_meta:  # buffers (RoPE tables) are small: materialize and fill them whole
            model.init_buffers(self.device)
        template = make_optimizer(model)  # over the new parameters; it holds no state until a step, so costs nothing
        self.segments = segments  # {parameter: [views of this rank's shard]}, each .grad a view of the grad shard
        self.local_optimizer = sharded_optimizer(template, segments)
        self.param_groups, self.state = self.local_optimizer.param_groups, self.local_optimizer.state
        for i, u in enumerate(self.units):
            u.state.modules[0].register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i))
            u.state.modules[-1].register_forward_hook(lambda m, args, out, i=i: self._post_forward(i, out))
        self.hooks = buckets.ReadyHooks(self.units, self._reduce_scatter, self._end_of_backward, always=True)

    def _add_unit(self, name, modules, group, world, rank, skip, names, on_meta, init_param, param_dtype,
                  cpu_offload, segments):
        """One unit: `modules`' parameters (but those in `skip`) flattened, this rank's slice of them kept as its
        fp32 master shard, each parameter a view into the gathered buffer. Returns segments, with the unit's."""
        owned = [(mod, k, p) for m in modules for mod in m.modules() for k, p in mod._parameters.items()
                 if p is not None and p not in skip]
        params = [p for _, _, p in owned]
        u = buckets.layout(params, pad=world)
        shard = u.numel // world
        lo, hi = rank * shard, (rank + 1) * shard
        # offloaded shards in pinned memory where there is a GPU to copy to: a copy from pageable memory is
        # synchronous, and each unit's gather would wait for it instead of overlapping (torch's offload pins too)
        pin = cpu_offload and self.device.type == "cuda"
        master = torch.zeros(shard, dtype=torch.float32, device=self.shard_device, pin_memory=pin)
        for p, o in zip(params, u.offsets):  # fill this rank's slice, one full parameter at a time
            full = torch.empty(p.shape, dtype=torch.float32, device=self.device)
            if on_meta:
                init_param(names[p], full)
            else:
                full.copy_(p.data)
            a, z = max(o, lo), min(o + p.numel(), hi)
            if a < z:
                master[a - lo: z - lo].copy_(full.view(-1)[a - o: z - o])
        # the module's parameters become views into the unit's gathered buffer (new Parameter objects: a
        # meta tensor can't be pointed at real memory)
        gathered = torch.empty(u.numel, dtype=param_dtype, device=self.device)
        u.params = []
        for (mod, k, p), o in zip(owned, u.offsets):
            setattr(mod, k, nn.Parameter(gathered[o: o + p.numel()].view(p.shape), p.requires_grad))
            u.params.append(getattr(mod, k))
        u.state = UnitState(name, modules, master, lo, hi, gathered,
                            torch.zeros(shard, dtype=torch.float32, device=self.shard_device, pin_memory=pin),
                            group, world, group is not self.group and world == 1)
        self._free(u)
        self.units.append(u)
        return owned_segments(u.params, u.offsets, lo, hi, master, u.state.grad_shard, segments)

    # --- gathering and freeing a unit's full parameters
    def _gather(self, u, wait=True):
        s = u.state
        if not s.is_gathered and s.gather is None:
            s.gathered.untyped_storage().resize_(u.numel * s.gathered.element_size())
            # a copy unless fp32 and on the device; from pinned memory the copy is queued on the stream the
            # all-gather then runs on, and the host goes on (then the cast, on the device)
            src = s.master.to(self.device, non_blocking=True).to(self.param_dtype)
            # write through .data, an alias with a version counter of its own: the views autograd saved in forward
            # must not look modified when backward finds them refilled with the same values
            if s.alone:
                s.gathered.data.copy_(src)
                s.is_gathered = True
                self._track()
                return
            work = comm.all_gather_single(s.gathered.data, src, group=s.group, async_op=True)
            s.gather = (work, src)
            self._track()
        if wait and s.gather is not None:
            work, s.gather = s.gather[0], None
            work.wait()
            s.is_gathered = True

    def _free(self, u):
        s = u.state
        if s.gather is not None:  # a prefetch still in flight must land before its memory goes
            work, s.gather = s.gather[0], None
            work.wait()
        s.gathered.untyped_storage().resize_(0)
        s.is_gathered = False

    def _track(self):
        held = sum(u.numel * u.state.gathered.element_size() for u in self.units
                   if u.state.is_gathered or u.state.gather is not None)
        held += sum(flat.numel() * flat.element_size() for _, _, flat, _ in self.pending_reduce)
        self.peak_gathered = max(self.peak_gathered, held + self.local_grads)

    def reshard(self):
        for u in self.units:
            self._free(u)

    # --- hooks
    def _pre_forward(self, i):
        self._gather(self.units[i])
        for j in range(i + 1, min(i + 1 + self.prefetch, len(self.units))):
            self._gather(self.units[j], wait=False)

    def _post_forward(self, i, out):
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward (activation checkpointing): the unit is still needed
        if self.reshard_after_forward:
            self._free(self.units[i])
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._pre_backward(i))

    def _pre_backward(self, i):
        self._gather(self.units[i])
        for j in range(i - 1, max(i - 1 - self.prefetch, -1), -1):
            self._gather(self.units[j], wait=False)

    def _reduce_scatter(self, u):
        # this micro-step's gradients of the unit, added into its flat accumulation buffer in reduce_dtype (bf16
        # .grad tensors summed over micro-steps in bf16 would lose their low bits), and dropped
        acc = u.state.acc
        if acc is None:
            acc = u.state.acc = torch.zeros(u.numel, dtype=self.reduce_dtype, device=self.device)
            self.local_grads += acc.numel() * acc.element_size()
        for p, o in zip(u.params, u.offsets):
            if p.grad is not None:  # None: added already, as a backward under no_sync ended (reduce_grads)
                acc[o: o + p.numel()].add_(p.grad.view(-1))
                p.grad = None
        if self.hooks.sync:  # the last micro-step: reduce-scatter the sum (non-final ones keep it local)
            flat, u.state.acc = u.state.acc, None
            self.local_grads -= flat.numel() * flat.element_size()
            # the mean over every data-parallel rank, replicas included (experts too: their gradient sums their
            # ep group's tokens, and their unit's ranks hold the other ep groups' sums)
            flat.div_(self.world * self.replicas)
            if u.state.alone:  # its whole gradient is this rank's
                self._accumulate(u, flat)
            else:
                out = torch.empty(u.numel // u.state.world, dtype=self.reduce_dtype, device=self.device)
                work = comm.reduce_scatter_single(out, flat, group=u.state.group, async_op=True)
                self.pending_reduce.append((u, work, flat, out))
            # at most one reduction in flight besides this one: each holds a full-size gradient buffer. Settled at
            # fixed points, never when a poll says it is done: under HSDP settling issues the replicas' all-reduce,
            # and NCCL needs every rank to issue it at the same place among the shard group's reduce-scatters
            while len(self.pending_reduce) > 2:
                self._settle(self.pending_reduce.pop(0))
        self._track()
        self._free(u)  # this unit's backward is over

    def _settle(self, pending):
        u, work, flat, out = pending
        work.wait()
        if self.replicate_group is None:
            self._accumulate(u, out)
            return
        # HSDP: the slice, summed within the shard group, summed again across the replicas that hold it; at most
        # two in flight, as above (each holds only a slice)
        self.pending_replicate.append((u, dist.all_reduce(out, group=self.replicate_group, async_op=True), out))
        while len(self.pending_replicate) > 2:
            self._settle_replica(self.pending_replicate.pop(0))

    def _settle_replica(self, pending):
        u, work, out = pending
        work.wait()
        self._accumulate(u, out)

    def _accumulate(self, u, out):
        # synchronous when offloaded: the host waits here for the device's stream, so every gather queued from the
        # pinned shards has read them before the step on the CPU writes them
        u.state.grad_shard.add_(out.to(self.shard_device, torch.float32))

    def _end_of_backward(self):
        for pending in self.pending_reduce:
            self._settle(pending)
        for pending in self.pending_replicate:
            self._settle_replica(pending)
        self.pending_reduce, self.pending_replicate = [], []

    # --- the optimizer's interface
    def no_sync(self):
        return self.hooks.no_sync()

    def reduce_grads(self):
        self.hooks.reduce_all()

    def holders(self, p):  # the parameter itself is a view into a freed buffer: the shards are the truth
        segs = [(s, s.param_offset) for s in self.segments.get(p, [])]
        return segs, segs

    @property
    def transient_bytes(self):
        return self.peak_gathered

    @torch.no_grad()
    def step(self):
        self.local_optimizer.step()  # on the shards only, wherever they live (CPU with offload)

    def zero_grad(self, set_to_none=True):
        for u in self.units:
            u.state.grad_shard.zero_()


def apply_fsdp(model, mesh, p, make_optimizer, device, init_param, experts=None):
    """Ours over the mesh's dp group, or under HSDP over dp_shard with replicas across dp_replicate: materializes
    only this rank's shards of a model on the meta device. `experts`: expert parallelism's (parallel/ep.py), whose
    experts are sharded over its replicate group."""
    hsdp = mesh.get_group("dp_replicate").size() > 1
    return FSDP(model, make_optimizer, device, p.blocks_per_unit, p.reshard_after_forward, p.prefetch,
                DTYPES[p.param_dtype], DTYPES[p.reduce_dtype], p.cpu_offload,
                group=mesh.get_group("dp_shard" if hsdp else "dp"), init_param=init_param,
                replicate_group=mesh.get_group("dp_replicate") if hsdp else None, experts=experts)


# --- torch's twin
class TorchFSDP(DataParallel):
    """FSDP2 (fully_shard): DTensor parameters sharded over dp; torch's clipping reduces their norms itself."""
    grads_sharded = True

    def no_sync(self):
        return _fsdp2_no_sync(self.model)

    def reshard(self):
        from torch.distributed.fsdp import FSDPModule
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def apply_torch_fsdp(model, mesh, p, make_optimizer, blocks_per_unit=None, reshard_after_forward=None,
                     param_dtype=None):
    """FSDP2 on the same units as ours (each group of blocks, then the root: embedding, final norm, head), over the
    mesh's dp dimension; under HSDP over the 2D (dp_replicate, dp_shard) mesh, which FSDP2 takes as replicas of
    shards (parameters Replicate() x Shard(0)). CPU offload pins its buffers only where there is an accelerator to
    copy to."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype or p.param_dtype], reduce_dtype=DTYPES[p.reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if p.cpu_offload else OffloadPolicy()
    hsdp = mesh.get_group("dp_replicate").size() > 1
    kw = dict(mesh=mesh["dp_replicate", "dp_shard"] if hsdp else dp_mesh(mesh), mp_policy=mp,
              offload_policy=offload,
              reshard_after_forward=p.reshard_after_forward if reshard_after_forward is None else reshard_after_forward)
    for name, modules in units_of(model, blocks_per_unit or p.blocks_per_unit):
        if name.startswith("blocks"):
            fully_shard(modules, **kw)
    return TorchFSDP(fully_shard(model, **kw), make_optimizer)


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    # keep gradients local and the parameters gathered between micro-steps: without the second switch FSDP2
    # reshards after every backward and all-gathers again in the next forward, one extra Psi per micro-step
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
