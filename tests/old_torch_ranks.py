"""One torchrun rank of tests/test_nccl.py: train.py jobs (tools/jobs.py) as a torch before 2.13 runs them, each
under CommCounter(log=True).

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single / reduce_scatter_single and
made the old names aliases that call the new ones. Here the implementations go back under their old names and the new
names are deleted, as torch 2.11 and 2.12 have them. Each rank writes the collectives it issued, in order, to
<run dir>/comm_order_rank<r>.json, for comm.order_problem to check across ranks.

    python -m torch.distributed.run --nproc_per_node=4 tests/old_torch_ranks.py JOBS.json
"""
import contextlib
import json
import os
import sys

import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  torch's own modules bind the new names at import:
import torch.distributed.checkpoint  # noqa: F401  they keep them (their torch has them); what changes is what
import torch.distributed.device_mesh  # noqa: F401  `dist.<name>` means to the code that looks it up, ours
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401  (imported for its bindings)
import torch.distributed.distributed_c10d as c10d

for new, old in (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")):
    implementation = getattr(c10d, new)
    for module in (c10d, dist):
        setattr(module, old, implementation)
        delattr(module, new)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.comm import CommCounter  # noqa: E402
from tools import jobs  # noqa: E402


@contextlib.contextmanager
def logged(run_dir):
    with CommCounter(log=True) as counter:
        yield
    with open(os.path.join(run_dir, f"comm_order_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(counter.log, f)


if __name__ == "__main__":
    assert not hasattr(dist, "all_gather_single") and not hasattr(c10d, "reduce_scatter_single")
    jobs.main(sys.argv[1], around=logged)
