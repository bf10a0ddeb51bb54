"""One rank of the test session's shared launches (tests/launches.py starts them under torchrun): tools/jobs.py's
jobs, each inside what its test measures, named by its run dir after an `@` (none: the job as train.py runs it).

- `@old_torch` (tests/test_nccl.py): torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to
  all_gather_single / reduce_scatter_single and made the old names aliases that call the new ones. For the job, the
  implementations go back under their old names and the new names are deleted, as torch 2.11 and 2.12 have them;
  every collective the rank issues is logged, in order, to <run dir>/comm_order_rank<r>.json, for
  comm.order_problem to check across ranks. torch's own modules bound the new names at import and keep them (their
  torch has them); what changes is what `dist.<name>` means to the code that looks it up at the call, ours.
- `@compiled` (tests/test_step.py): from a fresh dynamo; rank 0 writes dynamo's counters and, at every backward of
  a training step, how many compiled graphs the loss came through, to <run dir>/compiled.json.

Their own launches cost a torchrun agent and every rank's imports again (test_nccl.py's world-4 launch 30 CPU-s,
test_step.py's compiled world-2 one 35, 2026-12-07); here they ride in the launches the session runs anyway.

    python -m torch.distributed.run --nproc_per_node=N tests/launch_ranks.py JOBS.json
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from parallel import comm  # noqa: E402
from tools import jobs  # noqa: E402

RENAMED = (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"))


@contextlib.contextmanager
def old_torch(run_dir):
    comm.install()  # counting wrappers first: what goes under the old names, and back under the new ones after
    saved = [(module, new, old, getattr(module, new), getattr(module, old))
             for new, old in RENAMED for module in (c10d, dist)]
    for module, new, old, implementation, _ in saved:
        setattr(module, old, implementation)
        delattr(module, new)
    assert not hasattr(dist, "all_gather_single") and not hasattr(c10d, "reduce_scatter_single")
    try:
        with comm.CommCounter(log=True) as counter:
            yield
    finally:
        for module, new, old, implementation, alias in saved:
            setattr(module, new, implementation)
            setattr(module, old, alias)
    with open(os.path.join(run_dir, f"comm_order_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(counter.log, f)


def compiled_nodes(grad_fn):
    """How many compiled graphs (AOTAutograd's CompiledFunction nodes) the autograd graph of a loss runs through."""
    seen, todo, n = set(), [grad_fn], 0
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        n += "CompiledFunction" in f.name()
        todo += [g for g, _ in f.next_functions]
    return n


@contextlib.contextmanager
def compiled(run_dir):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    seen, backward = [], torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: (seen.append(compiled_nodes(self.grad_fn)),
                                                   backward(self, *a, **k))[1]
    try:
        yield
    finally:
        torch.Tensor.backward = backward
    if not dist.is_initialized() or dist.get_rank() == 0:  # (test_step.py runs single's in its own process)
        with open(os.path.join(run_dir, "compiled.json"), "w") as f:
            json.dump({"backward": seen, "frames": dict(counters["frames"]),
                       "graph_breaks": sum(counters["graph_break"].values())}, f)


AROUND = {"old_torch": old_torch, "compiled": compiled}


def around(run_dir):
    name = os.path.basename(run_dir)
    return AROUND[name.split("@", 1)[1]](run_dir) if "@" in name else contextlib.nullcontext()


if __name__ == "__main__":
    jobs.main(sys.argv[1], around=around)
