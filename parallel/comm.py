"""Count every collective this rank takes part in, and the bytes it moves, whoever launched it.

Python code that calls torch.distributed, torch's DistributedDataParallel reducer (C++), FSDP2 and DTensor all reach
the process group through the dispatcher's c10d ops (`c10d::allreduce_`, `c10d::_reduce_scatter_base_`, ...) or the
functional collectives (`_c10d_functional::all_reduce`, ...). A TorchDispatchMode sees each of them, on every thread
that autograd runs, so the count does not depend on which implementation made the call.

Volume is counted by the full tensor, the convention of the ZeRO paper (Rajbhandari et al., 2020, sec. 7):
  all-reduce of t = 2 * bytes(t)      (a reduce-scatter then an all-gather of t)
  reduce-scatter  = bytes of its input   all-gather = bytes of its output   broadcast = bytes(t)
With Psi = bytes of all parameters in the communicated dtype: DDP moves 2 Psi per step (one all-reduce), ZeRO-1/2
2 Psi (reduce-scatter + all-gather), ZeRO-3 3 Psi (two all-gathers + one reduce-scatter).
"""
from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(ts):
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(_nbytes(t) for t in ts)  # lists (of lists) of tensors


# op name -> (kind, bytes it moves); args as the c10d / functional schemas order them
VOLUME = {
    "allreduce_": ("all_reduce", lambda a: 2 * _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: 2 * _nbytes(a[0])),
    "all_reduce": ("all_reduce", lambda a: 2 * _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: 2 * _nbytes(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),  # (input, group_size, group)
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
}
# not collectives of their own: synchronization, point-to-point, and the wrapper that gives a functional result autograd
IGNORED = {"barrier", "monitored_barrier_", "wait_tensor", "send", "recv_", "recv_any_source_", "isend", "irecv",
           "batch_p2p_ops", "_wrap_tensor_autograd"}


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as c: ...` -> c.bytes, c.by_kind {kind: bytes}, c.calls {kind: n}, c.log [(kind, bytes)]."""

    def __init__(self):
        super().__init__()
        self.bytes, self.by_kind, self.calls, self.log = 0, Counter(), Counter(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # a DTensor op: let DTensor run it with this mode still active, so that the collectives it issues
            # inside (loss_parallel's reductions, redistributions) are counted here too
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._schema.name.split("::")[1]
            if name in VOLUME:
                kind, volume = VOLUME[name]
                n = volume(args)
                self.bytes += n
                self.by_kind[kind] += n
                self.calls[kind] += 1
                self.log.append((kind, n))
            elif name not in IGNORED:
                raise NotImplementedError(f"CommCounter does not know how much {func} moves")
        return func(*args, **(kwargs or {}))
