"""Distributed data parallel from scratch: bucketed gradient all-reduce, overlapped with backward.

Every rank holds the whole model and optimizer and runs forward/backward on its own slice of the global batch; one
all-reduce averages the gradients, so every rank takes the identical step.

  memory per rank (fp32 Adam):  params 4P + grads 4P + Adam moments 8P = 16P bytes
  communication per step:       all-reduce of the gradients = 2 Psi (Psi = P x bytes of parallel.reduce_dtype)

How (Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"):
- Parameters are packed into buckets of ~bucket_mb in reverse registration order (parallel/buckets.py). Each bucket
  is one flat buffer and each parameter's .grad is a view into it, so autograd accumulates straight into the bucket
  and the averaged result is, with no copy, what .grad holds (torch's `gradient_as_bucket_view`). A version that
  flattens gradients into a scratch buffer must copy the reduced values back; forgetting to is a classic bug.
- When a bucket's last gradient is accumulated, its all-reduce is launched asynchronously and backward continues;
  when backward ends, every handle is waited on.
- `no_sync()`: non-final micro-steps of gradient accumulation communicate nothing; gradients keep summing in place.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.layout import DTYPES
from parallel import buckets
from parallel.strategy import DataParallel, dp_mesh


@dataclass(eq=False)
class BucketState:
    """What DDP keeps per bucket (bucket.state)."""
    # the flat gradients, each parameter's .grad a view into them: made at wrap time, kept for good
    grad: torch.Tensor
    # what is all-reduced, grad itself or its reduce_dtype copy: set when the bucket is ready, cleared in _wait
    comm: torch.Tensor | None = None
    # that all-reduce's handle: set when the bucket is ready, cleared in _wait once waited on
    work: dist.Work | None = None


class DDP(nn.Module):
    def __init__(self, module, bucket_mb=25, reduce_dtype=torch.float32, group=None, exclude=()):
        super().__init__()
        self.module, self.group, self.reduce_dtype = module, group, reduce_dtype
        self.world = dist.get_world_size(group)
        # `exclude`: names of parameters another strategy reduces (expert parallelism's experts, parallel/ep.py)
        params = [p for n, p in module.named_parameters() if p.requires_grad and n not in exclude]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for p in params:  # every rank starts from the same weights, whatever its own init did
            dist.broadcast(p.data, src=src, group=group)
        self.buckets = buckets.pack(params, bucket_mb)
        self.views = {}
        for b in self.buckets:
            b.state = BucketState(torch.zeros(b.numel, dtype=params[0].dtype, device=params[0].device))
            for p, o in zip(b.params, b.offsets):
                self.views[p] = b.state.grad[o: o + p.numel()].view_as(p)
                p.grad = self.views[p]
        self.hooks = buckets.ReadyHooks(self.buckets, self._all_reduce, self._wait)

    def forward(self, *args, **kwargs):
        # zero_grad(set_to_none=True) drops .grad; point it back into the (zeroed) bucket before autograd writes
        for p, view in self.views.items():
            if p.grad is None:
                p.grad = view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                p.grad = view.copy_(p.grad)
        return self.module(*args, **kwargs)

    def no_sync(self):
        return self.hooks.no_sync()

    def reduce_grads(self):
        self.hooks.reduce_all()

    def _all_reduce(self, b):
        grad = b.state.grad
        comm = grad if self.reduce_dtype == grad.dtype else grad.to(self.reduce_dtype)
        comm.div_(self.world)  # gloo has no AVG; dividing first keeps the sum in range for low precision too
        b.state.work = dist.all_reduce(comm, group=self.group, async_op=True)
        b.state.comm = comm

    def _wait(self):
        for b in self.buckets:
            s = b.state
            s.work.wait()
            comm, s.work, s.comm = s.comm, None, None
            if comm is not s.grad:
                s.grad.copy_(comm)


class Replicated(DataParallel):
    """Every rank holds the whole model, in a wrapper that all-reduces the gradients: ours or torch's."""

    def no_sync(self):
        return self.model.no_sync()

    def reduce_grads(self):  # ours only: torch's DistributedDataParallel reduces in backward alone
        self.model.reduce_grads()


def apply_ddp(model, mesh, p, make_optimizer, exclude=()):
    """Ours: the module wrapped in DDP over the mesh's dp group (all but the parameters named in `exclude`)."""
    return Replicated(DDP(model, p.bucket_mb, DTYPES[p.reduce_dtype], group=mesh.get_group("dp"), exclude=exclude),
                      make_optimizer, module=model)


# --- torch's twin
def torch_ddp(model, mesh, p):
    """torch's DistributedDataParallel over the dp group. Its C++ reducer all-reduces each bucket through a
    communication hook: torch's own all-reduce hook (or its bf16 one), Python functions that call dist.all_reduce,
    so that parallel/comm.py counts them. forward_sync_buffers=False: the only buffers are RoPE tables, equal
    everywhere; broadcasting them each forward would add traffic that says nothing about the strategy."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel
    group = mesh.get_group("dp")
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=p.bucket_mb,
                                  gradient_as_bucket_view=True, forward_sync_buffers=False)
    ddp.register_comm_hook(group, bf16_compress_hook if p.reduce_dtype == "bfloat16" else allreduce_hook)
    return ddp


def apply_torch_ddp(model, mesh, p, make_optimizer):
    if mesh["tp"].size() > 1:
        # DistributedDataParallel can't take DTensor parameters (torch's tensor parallel); its composable
        # replicate(), built on FSDP2's machinery, all-reduces their gradients over the dp mesh
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from parallel.fsdp import TorchFSDP
        return TorchFSDP(replicate(model, mesh=dp_mesh(mesh)), make_optimizer)
    return Replicated(torch_ddp(model, mesh, p), make_optimizer, module=model)
