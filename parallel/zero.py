"""ZeRO stages 1 and 2 from scratch: optimizer state (stage 1) and gradients too (stage 2) sharded over ranks.

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models". P parameters,
N ranks, fp32 Adam; model state per rank in bytes:
  DDP      16P         params 4P + grads 4P  + Adam moments 8P
  ZeRO-1   8P + 8P/N   params 4P + grads 4P  + moments 8P/N
  ZeRO-2   4P + 12P/N  params 4P + grads 4P/N + moments 8P/N
Communication per step for both: reduce-scatter of the gradients (Psi) + all-gather of the updated parameters (Psi)
= 2 Psi, the same as DDP's one all-reduce. A "ZeRO-1" that all-reduces the gradients and then broadcasts each
rank's updated parameters pays 3 Psi: torch's ZeroRedundancyOptimizer behind DDP does exactly that. (With
parallel.reduce_dtype=bfloat16 the gradients travel in bf16 while the all-gathered parameters stay fp32: 2P + 4P
bytes.)

Layout: the parameters are packed into buckets in reverse registration order (parallel/buckets.py); each bucket is
one flat fp32 buffer padded to a multiple of N, and every parameter becomes a view into it. Rank r owns slice r of
every bucket: only for that slice does it keep Adam moments, receive reduced gradients and compute the update.
After the step every bucket is all-gathered in place, so each rank again holds the full, identical parameters.

Stage 1: gradients accumulate in full flat buffers (each .grad a view). When a bucket's last gradient of the final
  micro-step arrives it is reduce-scattered in place, overlapping the rest of backward: slice r of rank r's buffer
  receives the average of everyone's slice r. The rest of the buffer keeps this rank's own, unreduced gradient.
Stage 2: the hook copies each gradient into its bucket's transient buffer and drops .grad; the complete bucket is
  reduce-scattered (async) into this rank's persistent gradient shard, and the transient buffer is freed as soon
  as that collective has completed. Non-final micro-steps of gradient accumulation keep ordinary local .grad tensors
  and communicate nothing (as torch's no_sync does), so full-size gradients exist between micro-steps; reducing every
  micro-step instead would keep them sharded at the price of (accum + 1) Psi per step.

The optimizer the caller builds (any torch optimizer, any param groups) is used as a template: the same class and
hyper-parameters step views of this rank's slices ("segments"), each in the group of the parameter it belongs to.
"""
import torch
import torch.distributed as dist

from config import DTYPES
from parallel import buckets
from parallel.ddp import Replicated, torch_ddp
from parallel.fsdp import apply_torch_fsdp
from parallel.strategy import Sharded, owned_segments, sharded_optimizer


class ZeroOptimizer(Sharded):
    """The strategy and its optimizer in one: the loop steps this object, which steps this rank's segments."""

    def __init__(self, model, make_optimizer, stage, bucket_mb=25, reduce_dtype=torch.float32, group=None):
        assert stage in (1, 2)
        self.model = self.module = model
        self.optimizer = self
        self.stage, self.group, self.reduce_dtype = stage, group, reduce_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        template = make_optimizer(model)  # holds no state until its first step, so it costs nothing
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = buckets.pack(params, bucket_mb, pad=self.world)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        segments = {}  # parameter -> the views of it that this rank owns
        for b in self.buckets:
            flat = torch.zeros(b.numel, dtype=params[0].dtype, device=params[0].device)
            shard = b.numel // self.world
            lo, hi = self.rank * shard, (self.rank + 1) * shard
            b.state.update(param=flat, lo=lo, hi=hi)
            if stage == 1:
                b.state["grad"] = torch.zeros_like(flat)
                b.state["grad_shard"] = b.state["grad"][lo:hi]
            else:
                b.state["grad_shard"] = torch.zeros(shard, dtype=flat.dtype, device=flat.device)
            for p, o in zip(b.params, b.offsets):
                flat[o: o + p.numel()].copy_(p.data.view(-1))
                p.data = flat[o: o + p.numel()].view_as(p)
                if stage == 1:
                    p.grad = b.state["grad"][o: o + p.numel()].view_as(p)
            owned_segments(b.params, b.offsets, lo, hi, flat[lo:hi], b.state["grad_shard"], segments)
            dist.broadcast(flat, src=src, group=group)  # every rank starts from the same weights
        self.segments = segments
        self.local_optimizer = sharded_optimizer(template, segments)
        self.param_groups, self.state = self.local_optimizer.param_groups, self.local_optimizer.state
        self.hooks = buckets.ReadyHooks(self.buckets, self._reduce_scatter, self._wait)

    def no_sync(self):
        return self.hooks.no_sync()

    def _reduce_scatter(self, b):
        for other in self.buckets:  # free the transient buffers of reductions that have already completed
            if "pending" in other.state and other.state["pending"][0].is_completed():
                self._settle(other)
        if self.stage == 1:
            full = b.state["grad"]
            for p, o in zip(b.params, b.offsets):  # .grad replaced by someone (set_to_none): copy it into place
                if p.grad.data_ptr() != full[o:].data_ptr():
                    full[o: o + p.numel()].copy_(p.grad.view(-1))
                    p.grad = full[o: o + p.numel()].view_as(p)
        else:
            full = torch.zeros(b.numel, dtype=b.state["param"].dtype, device=b.state["param"].device)
            for p, o in zip(b.params, b.offsets):
                full[o: o + p.numel()].copy_(p.grad.view(-1))
                p.grad = None  # the full gradient lives only until its bucket is reduced
        comm = full if self.reduce_dtype == full.dtype else full.to(self.reduce_dtype)
        comm.div_(self.world)
        out = comm[b.state["lo"]: b.state["hi"]] if self.stage == 1 else b.state["grad_shard"]
        if out.dtype != comm.dtype:
            out = torch.empty_like(out, dtype=comm.dtype)
        b.state["pending"] = (dist.reduce_scatter_single(out, comm, group=self.group, async_op=True), comm, out)

    def _settle(self, b):
        work, comm, out = b.state.pop("pending")  # stage 2: dropping `comm`, the transient full buffer, frees it
        work.wait()
        if out.data_ptr() != b.state["grad_shard"].data_ptr():  # reduced in another dtype
            b.state["grad_shard"].copy_(out)

    def _wait(self):
        for b in self.buckets:
            if "pending" in b.state:
                self._settle(b)

    def holders(self, p):  # whole parameters, sharded optimizer state
        return [(p, 0)], [(s, s.param_offset) for s in self.segments.get(p, [])]

    @torch.no_grad()
    def step(self):
        self.local_optimizer.step()  # updates this rank's segments of the flat buffers, in place
        works = [dist.all_gather_single(b.state["param"], b.state["param"][b.state["lo"]: b.state["hi"]],
                                             group=self.group, async_op=True) for b in self.buckets]
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none=True):
        # stage 1 keeps its views (zeroed in place); stage 2 has no .grad outside backward. Shards are overwritten.
        if self.stage == 1:
            for b in self.buckets:
                b.state["grad"].zero_()


def apply_zero(model, mesh, p, make_optimizer, stage):
    """Ours: ZeRO-`stage` over the mesh's dp group."""
    return ZeroOptimizer(model, make_optimizer, stage, p.bucket_mb, DTYPES[p.reduce_dtype], group=mesh.get_group("dp"))


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
    gradients, one all-gather of the parameters per step), parameters sharded between steps too."""
    return apply_torch_fsdp(model, mesh, p, make_optimizer, blocks_per_unit=1, reshard_after_forward=False,
                            param_dtype="float32")
