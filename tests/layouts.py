"""Run several train.py jobs in one torchrun launch: `python -m torch.distributed.run --nproc_per_node=N
tests/layouts.py JOBS.json`, JOBS a list of [run dir, [overrides]]. One process group and one start of torch, Hydra,
W&B and datasets per rank serve them all (each rank spends seconds importing them); train.run leaves a process
group it did not create in place, and builds its own mesh inside it each time."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from conftest import make_cfg  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    dist.init_process_group("gloo")
    for run_dir, overrides in jobs:
        if dist.get_rank() == 0:  # markers around each job's console output, for tests that read it
            print(f"layouts: start {run_dir}", flush=True)
        train.run(make_cfg(*overrides), run_dir)
        if dist.get_rank() == 0:
            print(f"layouts: done {run_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
