"""Count every collective this rank takes part in, and the bytes it moves, whoever launched it, at one Python call
per collective.

Our strategies, torch's FSDP2 and ZeroRedundancyOptimizer call torch.distributed's Python functions
(`dist.all_reduce`, `dist.reduce_scatter_single`, ...); DTensor calls the functional collectives
(`torch.distributed._functional_collectives.all_reduce`, ...); torch's C++ DistributedDataParallel reducer reaches
Python only through its communication hook, so parallel/ddp.py gives it torch's own all-reduce hook, which calls
`dist.all_reduce`. `install()` wraps those functions once, in place: each call adds its bytes to the counters that are
open, then runs the original. Nothing sits on the path of ordinary ops (a TorchDispatchMode would see every aten op
of every step, and makes torch.compile fall back to eager).

Volume is counted by the full tensor, the convention of the ZeRO paper (Rajbhandari et al., 2020, sec. 7):
  all-reduce of t = 2 * bytes(t)      (a reduce-scatter then an all-gather of t)
  reduce-scatter  = bytes of its input   all-gather = bytes of its output   broadcast = reduce = bytes(t)
With Psi = bytes of all parameters in the communicated dtype: DDP moves 2 Psi per step (one all-reduce), ZeRO-1/2
2 Psi (reduce-scatter + all-gather), ZeRO-3 3 Psi (two all-gathers + one reduce-scatter). Point-to-point sends and
receives count the bytes of their tensor, as kind "p2p". Each count is also filed under the mesh dimension its
process group belongs to (`name_groups`), "world" for the default group.

`CommCounter(log=True)` also keeps the order: every call as (group ranks, kind, shape, dtype). NCCL needs every
rank of a group to issue the same collectives in the same order, and ranks that share two groups to interleave
them the same way; gloo forgives what NCCL hangs on. `order_problem` checks logs from every rank against that rule.

Torch versions: torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (pytorch#186123, 2026-06), keeping the old names as deprecated aliases. The strategies call
`all_gather_single` and `reduce_scatter_single` below, which take whichever name this torch has, and `install()`
wraps the names that exist: torch 2.11 and 2.12 (old names only) run as 2.13 does.
"""
import functools
import inspect
import threading
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d


def _nbytes(ts):
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(_nbytes(t) for t in ts)  # lists (of lists) of tensors


def _group_size(group):
    return dist.get_world_size(_resolve(group))


# function name -> (kind, the argument whose bytes it moves, how many times they count); "size": x the group's size
C10D = {
    "all_reduce": ("all_reduce", "tensor", 2), "all_reduce_coalesced": ("all_reduce", "tensors", 2),
    "reduce_scatter_single": ("reduce_scatter", "input", 1), "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "all_gather_single": ("all_gather", "output_tensor", 1), "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "all_gather": ("all_gather", "tensor_list", 1),
    "broadcast": ("broadcast", "tensor", 1), "all_to_all_single": ("all_to_all", "input", 1),
    "reduce": ("reduce", "tensor", 1),  # to one rank (DeepSpeed's ZeRO-1/2 can reduce each partition to its owner)
    "send": ("p2p", "tensor", 1), "recv": ("p2p", "tensor", 1), "isend": ("p2p", "tensor", 1),
    "irecv": ("p2p", "tensor", 1),
}
FUNCOL = {
    "all_reduce": ("all_reduce", "self", 2), "all_reduce_coalesced": ("all_reduce", "self", 2),
    "reduce_scatter_tensor": ("reduce_scatter", "self", 1), "reduce_scatter_single": ("reduce_scatter", "self", 1),
    "all_gather_tensor": ("all_gather", "self", "size"), "all_gather_single": ("all_gather", "self", "size"),
    "broadcast": ("broadcast", "self", 1), "all_to_all_single": ("all_to_all", "self", 1),
}

_open = []  # the counters inside whose `with` block this process is
_names = {}  # process group -> mesh dimension name
_inside = threading.local()  # a counted call that calls another (all_gather_single -> all_gather_into_tensor) counts once


def name_groups(names, replace=False):
    """{process group: dimension name} for the mesh's groups, so that bytes are filed by dimension. `replace`: forget
    the names given before (a run's mesh names its groups afresh: one process may run several layouts, and the
    default group is tp in one, dp in another, and in a third none of the mesh's)."""
    if replace:
        _names.clear()
    _names.update(names)


def _resolve(group):
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    return c10d._resolve_process_group(funcol._resolve_group_name(group))  # (mesh, dim), a mesh, a group name


def _dim(group):
    group = _resolve(group)
    return _names.get(group, "world" if group is None or group == dist.group.WORLD else "other")


def _arg(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs.get(name)


def _ranks(group):
    group = _resolve(group)
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else [_shape(x) for x in t]


def _dtype(t):
    return str(t.dtype) if isinstance(t, torch.Tensor) else _dtype(t[0]) if len(t) else None


def _wrap(fn, kind, tensor, factor):
    params = list(inspect.signature(fn).parameters)
    at, group_at = params.index(tensor), params.index("group")

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if not _open or getattr(_inside, "depth", 0) or torch.compiler.is_compiling():
            return fn(*args, **kwargs)  # (a collective dynamo traces into a graph runs as a graph op: uncounted)
        group, t = _arg(args, kwargs, group_at, "group"), _arg(args, kwargs, at, tensor)
        n = _nbytes(t) * (_group_size(group) if factor == "size" else factor)
        dim = _dim(group)
        for c in _open:
            c.add(kind, n, dim)
            if c.log is not None and kind != "p2p":  # (p2p pairs are matched by pp's own order check)
                c.log.append((_ranks(group), kind, _shape(t), _dtype(t)))
        _inside.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth = 0
    return counted


@functools.cache
def install():
    """Wrap torch.distributed's collectives and the functional ones, once per process."""
    for module, table, functional in ((c10d, C10D, False), (funcol, FUNCOL, True)):
        for name, (kind, tensor, factor) in table.items():
            fn = getattr(module, name, None)
            if fn is None:  # a name this torch doesn't have (the _single names before 2.13)
                continue
            wrapped = _wrap(fn, kind, tensor, factor)
            setattr(module, name, wrapped)
            if not functional and getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)  # `dist.all_reduce` is the same function, bound at import


class CommCounter:
    """`with CommCounter() as c: ...` -> c.bytes, c.by_kind {kind: bytes}, c.calls {kind: n}, c.by_dim
    {(dim, kind): bytes}. p2p bytes are in by_kind["p2p"] and by_dim, not in c.bytes (collectives only).
    `reset()` starts the count again without leaving the block (train.py: one counter, reset every step)."""

    def __init__(self, log=False):
        install()
        self.log = [] if log else None
        self.reset()

    def reset(self):
        self.bytes, self.by_kind, self.calls, self.by_dim = 0, Counter(), Counter(), Counter()

    def add(self, kind, n, dim):
        if kind != "p2p":
            self.bytes += n
        self.by_kind[kind] += n
        self.calls[kind] += 1
        self.by_dim[dim, kind] += n

    def __enter__(self):
        _open.append(self)
        return self

    def __exit__(self, *exc):
        _open.remove(self)


def all_gather_single(output, input, group=None, async_op=False):
    """dist.all_gather_single (torch >= 2.13), or all_gather_into_tensor, its name before: looked up at each call,
    so that the counting wrapper install() put in its place runs."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op=False):
    """dist.reduce_scatter_single (torch >= 2.13), or reduce_scatter_tensor, its name before."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def order_problem(logs):
    """Where collectives from several ranks would hang NCCL, in one line, or None. `logs`: {rank: [(group ranks,
    kind, shape, dtype), ...]} from CommCounter(log=True), one per rank. NCCL's model, played out: each rank issues
    its collectives in its order, and a collective completes only when every rank of its group has reached it, with
    the same kind, shape and dtype; a rank waits on it before its next one (the conservative reading: one stream). A
    rank left waiting is a hang: two ranks' groups issued in different orders, or one rank's extra collective."""
    pos = {r: 0 for r in logs}

    def head(r):
        return logs[r][pos[r]] if pos[r] < len(logs[r]) else None
    moved = True
    while moved:
        moved = False
        for r in sorted(logs):
            c = head(r)
            members = [m for m in c[0] if m in logs] if c else []
            if not c or any(head(m) is None or head(m)[0] != c[0] for m in members):
                continue
            other = next((m for m in members if head(m)[1:] != c[1:]), None)
            if other is not None:
                return (f"group {list(c[0])}: rank {r}'s collective #{pos[r]} is {c[1:]}, rank {other}'s "
                        f"#{pos[other]} {head(other)[1:]}")
            for m in members:
                pos[m] += 1
            moved = True
    stuck = [r for r in sorted(logs) if head(r) is not None]
    if stuck:
        r = stuck[0]
        waits = [m for m in head(r)[0] if m in logs and (head(m) is None or head(m)[0] != head(r)[0])]
        at = {m: head(m)[:2] if head(m) else "done" for m in waits}
        return (f"rank {r} waits forever in collective #{pos[r]} {head(r)[1:]} on group {list(head(r)[0])}: "
                f"ranks {waits} are at {at}")
    return None


def all_ranks(flag, op):
    """A boolean every rank agrees on (op dist.ReduceOp.MIN: true on all of them; MAX: true on any). One process
    without a process group: the flag itself."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return bool(t.item())
