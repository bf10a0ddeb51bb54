"""ZeRO stages 1 and 2 from scratch: optimizer state (stage 1) and gradients too (stage 2) sharded over ranks, in
float32 or in mixed precision (bf16 working weights, fp32 master weights in the shards).

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models". P parameters,
N ranks, Adam; model state per rank in bytes (`tools/plan.py state_bytes`; tests/test_data_parallel.py measures it):
  float32 (parallel.param_dtype=float32, the default)
    DDP      16P         params 4P + grads 4P  + Adam moments 8P
    ZeRO-1   8P + 8P/N   params 4P + grads 4P  + moments 8P/N
    ZeRO-2   4P + 12P/N  params 4P + grads 4P/N + moments 8P/N
  mixed precision (parallel.param_dtype=bfloat16): every rank computes with bf16 working weights (2P); each shard
  holds the fp32 master weights and the moments (12P/N); gradients are held in reduce_dtype
    reduce_dtype=bfloat16: ZeRO-1 2P + 2P + 12P/N, ZeRO-2 2P + 14P/N (the paper's Figure 1, K = 12)
    reduce_dtype=float32:  ZeRO-1 2P + 4P + 12P/N (Megatron's distributed optimizer), ZeRO-2 2P + 16P/N
  (with float32 weights gradients stay float32 whatever reduce_dtype: held in the wider of the two dtypes)
Communication per step: reduce-scatter of the gradients (P x reduce_dtype bytes) + all-gather of the updated
working weights (P x param_dtype bytes) = 2 Psi in float32, the same as DDP's one all-reduce. A "ZeRO-1" that
all-reduces the gradients and then broadcasts each rank's updated parameters pays 3 Psi: torch's
ZeroRedundancyOptimizer behind DDP does exactly that.

Layout: the parameters are packed into buckets in reverse registration order (parallel/buckets.py); each bucket is
one flat buffer of working weights (param_dtype) padded to a multiple of N, and every parameter becomes a view into
it. Rank r owns slice r of every bucket: only for that slice does it keep the master weights (in float32 the slice
of the flat buffer itself; in mixed precision a float32 copy of it) and Adam moments, receive reduced gradients and
compute the update. The step updates the master, casts it into the flat buffer's own slice, and all-gathers every
bucket in place, so each rank again holds the full, identical working weights.

Stage 1: gradients accumulate in full flat buffers (each .grad a view; with bf16 weights and float32 gradients a
  hook adds each bf16 .grad into the float32 buffer and drops it). When a bucket's last gradient of the final
  micro-step arrives it is reduce-scattered in place, overlapping the rest of backward: slice r of rank r's buffer
  receives the average of everyone's slice r. The rest of the buffer keeps this rank's own, unreduced gradient.
Stage 2: the hook copies each gradient into its bucket's transient buffer and drops .grad; the complete bucket is
  reduce-scattered (async) into this rank's persistent gradient shard, and the transient buffer is freed as soon
  as that collective has completed. Gradient accumulation, parallel.accumulate:
    local    (the default, torch's no_sync) non-final micro-steps keep full local gradients and communicate nothing:
             P x gradient bytes held between micro-steps, on top of the formula (the planner's transient)
    sharded  (DeepSpeed's choice) every micro-step reduce-scatters and adds into the gradient shard: memory stays
             at the formula, for accumulation x P x reduce_dtype bytes of reduce-scatter per step
bf16 gradients: the fp32 step needs fp32 gradients; at the end of the last backward each gradient shard is copied to
  float32 (4P/N, transient: freed by the step), which the norm, the clipping and the step then read.

The optimizer the caller builds (any torch optimizer, any param groups) is used as a template: the same class and
hyper-parameters step views of this rank's master slices ("segments"), each in the group of the parameter it
belongs to. Checkpoints store the master (`holders`), so a mixed-precision checkpoint holds float32 weights and
loads under any layout.

Expert parallelism (parallel/ep.py): the experts named in `exclude` differ from rank to rank of the ep group, so they
stay out of the buckets, whole on this rank (E/ep of each block's experts), their gradients summed by ep.py over
the ranks that hold the same ones; the local optimizer steps them beside the shards (their state unsharded: the
dense parameters are ZeRO's, the experts are already divided by ep).
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel import buckets, comm
from parallel.layout import DTYPES
from parallel.ddp import Replicated, torch_ddp
from parallel.fsdp import apply_torch_fsdp
from parallel.strategy import Sharded, owned_segments, sharded_optimizer


def _nbytes(t):
    return t.numel() * t.element_size()


@dataclass(eq=False)
class BucketState:
    """What ZeRO keeps per bucket (bucket.state): all made at wrap time and kept, but acc and pending (transient)."""
    # the flat working weights (param_dtype), each parameter's .data a view into them; all-gathered after each step
    param: torch.Tensor
    # this rank's fp32 master weights: in float32 param[lo:hi] itself, in mixed precision a float32 copy of it
    master: torch.Tensor
    # the slice [lo, hi) of the bucket's flat space that this rank owns
    lo: int
    hi: int
    # this rank's slice of the averaged gradients: stage 1 a view of grad[lo:hi], stage 2 a buffer of its own
    grad_shard: torch.Tensor
    # stage 1 only: the full flat gradients, each .grad a view into them (unless the sink adds bf16 ones in)
    grad: torch.Tensor | None = None
    # the views of master that the local optimizer steps, each in its parameter's group
    segments: list = field(default_factory=list)
    # stage 2 with the sink: the fp32 sum of the bf16 .grads; set at the first one, cleared by its reduce-scatter
    acc: torch.Tensor | None = None
    # (work, sent, out) of the reduce-scatter in flight: set in _reduce_scatter, cleared by _settle
    pending: tuple | None = None


class ZeroOptimizer(Sharded):
    """The strategy and its optimizer in one: the loop steps this object, which steps this rank's segments."""

    def __init__(self, model, make_optimizer, stage, bucket_mb=25, reduce_dtype=torch.float32,
                 param_dtype=torch.float32, accumulate="local", group=None, exclude=()):
        assert stage in (1, 2) and accumulate in ("local", "sharded") and (stage == 2 or accumulate == "local")
        self.model = self.module = model
        self.optimizer = self
        self.stage, self.group, self.reduce_dtype, self.param_dtype = stage, group, reduce_dtype, param_dtype
        self.mixed = param_dtype != torch.float32  # working weights apart from the fp32 master
        self.sharded_accumulation = accumulate == "sharded"
        # gradients are held in the wider of the two dtypes: bf16 only where both are, as the ZeRO paper counts
        self.grad_dtype = torch.promote_types(param_dtype, reduce_dtype)
        # bf16 weights with fp32 gradients: autograd's bf16 .grad can't be a view of the fp32 buffers; a hook moves it
        self.sink = self.grad_dtype != param_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        template = make_optimizer(model)  # holds no state until its first step, so it costs nothing
        params = [p for n, p in model.named_parameters() if p.requires_grad and n not in exclude]
        # the experts, whole: the local optimizer steps them as they are, their .grad from autograd (and ep.py)
        self.whole = {p for n, p in model.named_parameters() if p.requires_grad and n in exclude}
        self.buckets = buckets.pack(params, bucket_mb, pad=self.world)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        segments = {p: [p] for p in self.whole}  # parameter -> the views of it that this rank owns
        for b in self.buckets:
            full = torch.zeros(b.numel, dtype=params[0].dtype, device=params[0].device)  # the fp32 initial weights
            for p, o in zip(b.params, b.offsets):
                full[o: o + p.numel()].copy_(p.data.view(-1))
            dist.broadcast(full, src=src, group=group)  # every rank starts from the same weights
            shard = b.numel // self.world
            lo, hi = self.rank * shard, (self.rank + 1) * shard
            flat = full.to(param_dtype)  # the working weights (in float32, `full` itself)
            master = full[lo:hi].clone() if self.mixed else flat[lo:hi]
            if stage == 1:
                grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=flat.device)
                grad_shard = grad[lo:hi]
            else:
                grad, grad_shard = None, torch.zeros(shard, dtype=self.grad_dtype, device=flat.device)
            b.state = BucketState(flat, master, lo, hi, grad_shard, grad)
            for p, o in zip(b.params, b.offsets):
                p.data = flat[o: o + p.numel()].view_as(p)
                if stage == 1 and not self.sink:
                    p.grad = grad[o: o + p.numel()].view_as(p)
                if self.sink:  # registered before ReadyHooks' own hook, so it runs first
                    p.register_post_accumulate_grad_hook(buckets.weak_hook(self._sink, b, o))
            # the fp32 master segments' .grad: views of the fp32 gradient shard, or (bf16 gradients) of the float32
            # copy the end of backward makes (_grads_for_step)
            mine = owned_segments(b.params, b.offsets, lo, hi, master,
                                  grad_shard if self.grad_dtype == torch.float32 else None, {})
            b.state.segments = [s for ss in mine.values() for s in ss]
            segments.update(mine)
        self.segments = segments
        self.local_optimizer = sharded_optimizer(template, segments)
        self.param_groups, self.state = self.local_optimizer.param_groups, self.local_optimizer.state
        self.peak_transient = 0  # most bytes held beyond the model state (see transient_bytes)
        # always: the end of every backward is seen (sharded accumulation reduces there; local measures what it holds)
        self.hooks = buckets.ReadyHooks(self.buckets, self._reduce_scatter, self._end_of_backward, always=True)

    def no_sync(self):
        return self.hooks.no_sync()

    def reduce_grads(self):
        self.hooks.reduce_all()

    def _sink(self, p, b, o):
        """bf16 weights, fp32 gradients: add this micro-step's bf16 .grad into the bucket's fp32 buffer (stage 1's
        full buffer; stage 2's accumulation buffer, which the bucket's reduce-scatter then consumes)."""
        if self.stage == 1:
            acc = b.state.grad
        else:
            if b.state.acc is None:
                b.state.acc = torch.zeros(b.numel, dtype=self.grad_dtype, device=p.device)
            acc = b.state.acc
        acc[o: o + p.numel()].add_(p.grad.view(-1))
        p.grad = None

    def _reduce_scatter(self, b):
        if not (self.hooks.sync or self.sharded_accumulation):
            return  # a non-final micro-step of local accumulation: nothing to communicate
        for other in self.buckets:  # free the transient buffers of reductions that have already completed
            if other.state.pending is not None and other.state.pending[0].is_completed():
                self._settle(other)
        if self.stage == 1:
            full = b.state.grad
            for p, o in zip(b.params, b.offsets):  # .grad replaced by someone (set_to_none): copy it into place
                if p.grad is not None and p.grad.data_ptr() != full[o:].data_ptr():
                    full[o: o + p.numel()].copy_(p.grad.view(-1))
                    p.grad = full[o: o + p.numel()].view_as(p)
        elif b.state.acc is not None:  # the sink has gathered this bucket's gradients already
            full, b.state.acc = b.state.acc, None
        else:
            full = torch.zeros(b.numel, dtype=self.grad_dtype, device=b.state.param.device)
            for p, o in zip(b.params, b.offsets):
                full[o: o + p.numel()].copy_(p.grad.view(-1))
                p.grad = None  # the full gradient lives only until its bucket is reduced
        sent = full if self.reduce_dtype == full.dtype else full.to(self.reduce_dtype)
        sent.div_(self.world)
        out = sent[b.state.lo: b.state.hi] if self.stage == 1 else b.state.grad_shard
        if out.dtype != sent.dtype or self.sharded_accumulation:  # the shard adds each micro-step's reduction
            out = torch.empty_like(out, dtype=sent.dtype)
        b.state.pending = (comm.reduce_scatter_single(out, sent, group=self.group, async_op=True), sent, out)

    def _settle(self, b):
        # stage 2: dropping `sent`, the transient full buffer, frees it
        (work, _sent, out), b.state.pending = b.state.pending, None
        work.wait()
        if self.sharded_accumulation:
            b.state.grad_shard.add_(out)
        elif out.data_ptr() != b.state.grad_shard.data_ptr():  # reduced in another dtype
            b.state.grad_shard.copy_(out)

    def _end_of_backward(self):
        for b in self.buckets:
            if b.state.pending is not None:
                self._settle(b)
        if not self.hooks.sync:  # between micro-steps: the full local gradients stage 2 holds until the last one
            if self.stage == 2:
                held = sum(_nbytes(p.grad) for b in self.buckets for p in b.params if p.grad is not None)
                self._track(held + sum(_nbytes(b.state.acc) for b in self.buckets if b.state.acc is not None))
        elif self.grad_dtype != torch.float32:
            self._grads_for_step()

    def _grads_for_step(self):
        """bf16 gradient shards -> float32 copies, the .grad of the master segments until the step frees them."""
        held = 0
        for b in self.buckets:
            g32 = b.state.grad_shard.float()
            held += _nbytes(g32)
            for s in b.state.segments:
                s.grad = g32[s.shard_offset: s.shard_offset + s.numel()]
        self._track(held)

    def _track(self, held):
        self.peak_transient = max(self.peak_transient, held)

    @property
    def transient_bytes(self):
        """The most bytes held at once beyond the model state: stage 2's full local gradients between micro-steps
        (local accumulation), and bf16 gradients' float32 copies for the step. Buffers of reductions in flight (a
        bucket or two) are not counted."""
        return self.peak_transient

    def holders(self, p):
        # sharded optimizer state; the weights: whole parameters in float32, the fp32 master segments in mixed
        # precision (a checkpoint stores fp32 weights; after_load rebuilds the working copy from them)
        if p in self.whole:
            return [(p, 0)], [(p, 0)]
        segs = [(s, s.param_offset) for s in self.segments.get(p, [])]
        return ([(p, 0)] if not self.mixed else segs), segs

    def state_tensors(self):
        return [t for b in self.buckets for t in (b.state.param, b.state.master, b.state.grad, b.state.grad_shard)
                if t is not None]

    @torch.no_grad()
    def _gather(self):
        """Every bucket's working weights from each rank's master slice: cast into the own slice, all-gather."""
        for b in self.buckets:
            if self.mixed:
                b.state.param[b.state.lo: b.state.hi].copy_(b.state.master)
        works = [comm.all_gather_single(b.state.param, b.state.param[b.state.lo: b.state.hi],
                                        group=self.group, async_op=True) for b in self.buckets]
        for w in works:
            w.wait()

    @torch.no_grad()
    def step(self):
        self.local_optimizer.step()  # updates this rank's master segments, in place
        if self.grad_dtype != torch.float32:  # free the float32 copies of the bf16 gradients
            for b in self.buckets:
                for s in b.state.segments:
                    s.grad = None
        self._gather()

    def after_load(self):
        if self.mixed:  # a checkpoint wrote the master segments: rebuild the working weights from them
            self._gather()

    def zero_grad(self, set_to_none=True):
        # stage 1 keeps its views (zeroed in place); stage 2 has no .grad outside backward, and its shards are
        # overwritten by the next reduction, unless every micro-step adds into them; the experts' are autograd's
        for p in self.whole:
            p.grad = None
        if self.stage == 1:
            for b in self.buckets:
                b.state.grad.zero_()
        elif self.sharded_accumulation:
            for b in self.buckets:
                b.state.grad_shard.zero_()


def apply_zero(model, mesh, p, make_optimizer, stage, exclude=()):
    """Ours: ZeRO-`stage` over the mesh's dp group (all but the parameters named in `exclude`: the experts)."""
    return ZeroOptimizer(model, make_optimizer, stage, p.bucket_mb, DTYPES[p.reduce_dtype], DTYPES[p.param_dtype],
                         p.accumulate, group=mesh.get_group("dp"), exclude=exclude)


# --- torch's twins
def apply_torch_zero1(model, mesh, p, make_optimizer):
    """torch's DistributedDataParallel + ZeroRedundancyOptimizer: the optimizer state sharded by whole parameters.
    The gradients are all-reduced (2 Psi), then each rank broadcasts the parameters it updated (Psi more): 3 Psi."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    data = TorchZero1(torch_ddp(model, mesh, p), module=model)
    template = make_optimizer(model)
    data.optimizer = ZeroRedundancyOptimizer(template.param_groups, optimizer_class=type(template),
                                             process_group=mesh.get_group("dp"))
    data.local_optimizer = data.optimizer.optim  # the optimizer over the parameters this rank owns
    return data


class TorchZero1(Replicated):
    def holders(self, p):  # whole parameters; optimizer state only for the parameters this rank updates
        owned = {q for g in self.local_optimizer.param_groups for q in g["params"]}
        return [(p, 0)], [(p, 0)] if p in owned else []


def apply_torch_zero2(model, mesh, p, make_optimizer):
    """torch's FSDP2 with every unit kept gathered from forward to backward: ZeRO-2's traffic (reduce-scatter of the
    gradients, one all-gather of the parameters per step), parameters sharded between steps too. Its
    MixedPrecisionPolicy is the twin of our mixed precision: parameters gathered in param_dtype, gradients reduced in
    reduce_dtype, fp32 shards."""
    return apply_torch_fsdp(model, mesh, p, make_optimizer, blocks_per_unit=1, reshard_after_forward=False)
