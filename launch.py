"""How train.py's ranks come to exist, and the few things every launch path must agree on.

    torchrun --nproc_per_node=N train.py ...                  torchrun starts N ranks; each runs Hydra and train.py
    torchrun --nnodes=M --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT ...   the same on M machines
    python train.py launcher.nproc_per_node=N ...             train.py starts its own N ranks through torch's elastic
                                                              launch API (what torchrun runs on), so each job of a
                                                              Hydra sweep (-m) is an N-rank job
    python train.py -m hydra/launcher=submitit_slurm ...      one SLURM task per rank, ranks from the SLURM environment

Choices:
- One run dir per job. Under torchrun every rank runs Hydra, so the dir's timestamp is `${launch_time:...}`: rank 0's
  clock, formatted by rank 0 and handed to the others through torchrun's rendezvous store (no per-rank dirs, even
  across machines and time zones), and the same again after torchrun restarts the ranks. Self-launched ranks get
  the dir from the process that started them, SLURM tasks from the config the sweep resolved before submitting.
- Rank 0 keeps the console. Rank k > 0 sends its stdout and stderr, at the file-descriptor level so that C++ warnings
  follow, to rank<k>.log in the run dir; only rank 0 writes the config, metrics.jsonl and the W&B run.
- A failed rank fails its job with one line: which ranks ended, how, and where their output is.
"""
import contextlib
import datetime
import functools
import multiprocessing
import os
import socket
import sys
import uuid

import torch
from omegaconf import OmegaConf

# CPU ranks are processes that mostly wait on each other at collectives; past this many per core a typo'd
# nproc_per_node only thrashes the machine. On a GPU the bound is one rank per device.
CPU_RANKS_PER_CORE = 4
_store = None  # rank 0's handle on the rendezvous store, kept open until the other ranks have read from it


class LaunchError(RuntimeError):
    """A launch that can't work, or ranks that failed; reported as one line."""


def launch_time(pattern):
    """`${launch_time:%H-%M-%S}` in hydra.run.dir: the start of this launch by rank 0's clock, formatted by rank 0."""
    return _rank0_string(f"launch_time/{pattern}", _now().strftime(pattern))


@functools.cache
def _now():
    return datetime.datetime.now()  # once per process, so a date and a time read separately never straddle midnight


@functools.cache
def _rank0_string(key, value):
    """Rank 0's `value` for `key`, on every rank that a torch elastic agent (torchrun, or several on several
    machines) started; `value` itself anywhere else. Cached: Hydra resolves the run dir more than once."""
    return rank0_value(key, lambda: value)


def rank0_value(key, compute):
    """The string compute() returns on rank 0, on every rank that a torch elastic agent started (the others wait for
    it, computing nothing); compute() itself anywhere else (one process; SLURM's tasks, which share no agent)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return compute()
    global _store
    rank = int(os.environ["RANK"])
    # the agent's rendezvous store, which every worker can reach; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0
    # hosts it instead, multi-tenant so that init_process_group later shares the server on the same port
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                       is_master=rank == 0 and not agent_store, multi_tenant=True,
                                       wait_for_workers=False, timeout=datetime.timedelta(minutes=10))
    key = f"nanoparallel/{key}"
    if rank == 0:
        # the first launch's value, also after torchrun restarts the workers (--max-restarts): the agent's store
        # outlives them, so a restarted run finds its run dir, and train.resume=auto its checkpoints
        value = store.compare_set(key, "", compute()).decode()
        _store = store
        return value
    return store.get(key).decode()


OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)


def process_group_store():
    """init_process_group's keyword arguments for the store its ranks meet through. Usually none: torchrun's (or
    SLURM's) environment says where (env://). One process launched by nobody gets a local store. Ranks that torchrun
    restarted (--max-restarts) get the agent's store under a prefix of their own: the agent keeps one store for all
    attempts, and without the prefix the new ranks read the old ranks' addresses and gloo connects to dead ones."""
    if "MASTER_ADDR" not in os.environ:
        return {"store": torch.distributed.HashStore(), "rank": 0, "world_size": 1}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world = int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                       is_master=False, timeout=datetime.timedelta(minutes=10))
    return {"store": torch.distributed.PrefixStore(f"nanoparallel/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": world}


def in_submitit_job():
    return "SUBMITIT_EXECUTOR" in os.environ


def check(lc, device, under_torchrun):
    """The error message for launcher settings (cfg.launcher) that can't work here, or None."""
    n = lc.nproc_per_node
    if under_torchrun and in_submitit_job():
        return "a submitit (SLURM) job started from under torchrun: run `python train.py -m hydra/launcher=...` alone"
    if n is None:
        return None
    if under_torchrun:
        return (f"launcher.nproc_per_node={n} asks train.py to start its own ranks, but it is already one of "
                f"torchrun's {os.environ.get('WORLD_SIZE')} ranks; drop launcher.nproc_per_node or run with python")
    if in_submitit_job() and _submitit_tasks() > 1:
        return (f"launcher.nproc_per_node={n} inside a SLURM job of {_submitit_tasks()} tasks: each task is already "
                f"a rank; use hydra.launcher.tasks_per_node for the ranks, or one task and launcher.nproc_per_node")
    if not isinstance(n, int) or n < 1:
        return f"launcher.nproc_per_node={n!r} must be a whole number >= 1"
    limit, what = max_local_ranks(device)
    if n > limit:
        return f"launcher.nproc_per_node={n} is more than this machine can run: at most {limit} ({what})"
    if not isinstance(lc.nnodes, int) or lc.nnodes < 1:
        return f"launcher.nnodes={lc.nnodes!r} must be a whole number >= 1"
    if lc.nnodes > 1 and not (lc.rdzv_endpoint and lc.rdzv_id):
        return (f"launcher.nnodes={lc.nnodes} needs the rendezvous every node joins: launcher.rdzv_endpoint=HOST:PORT "
                f"(a host all nodes reach) and launcher.rdzv_id=NAME, the same on every node")
    return None


def max_local_ranks(device):
    """(how many ranks one machine may run, why): one per GPU, or CPU_RANKS_PER_CORE per usable CPU core."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count(), "one rank per GPU; this machine has that many"
    cores = len(os.sched_getaffinity(0))
    return CPU_RANKS_PER_CORE * cores, f"{CPU_RANKS_PER_CORE} CPU ranks per core, {cores} cores"


def _submitit_tasks():
    import submitit
    return submitit.JobEnvironment().num_tasks


def ranks_from_submitit():
    """In a SLURM (or submitit local) job of several tasks, each task is a rank: export RANK, WORLD_SIZE,
    MASTER_ADDR/PORT (first node, a port drawn from the job id) and LOCAL_RANK for init_process_group."""
    if not in_submitit_job() or _submitit_tasks() < 2:
        return
    import submitit
    # keep every GPU visible: train.py picks cuda:LOCAL_RANK itself
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def process_group(layout, device, run_dir, rank):
    """(whether this call created the process group, the device mesh) for a run of `layout` (parallel/layout.py):
    none for one process that calls no collective; a one-rank FSDP still calls them (on itself). A caller that runs
    several jobs in one process group (tools/jobs.py) keeps its own. NCCL on a GPU, gloo on a CPU."""
    import torch.distributed as dist
    if layout.world == 1 and layout.strategy == "none":
        return False, None
    owns = not dist.is_initialized()
    if owns:
        cuda = device.startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None,
                                **process_group_store())
    # every rank has checked the run dir before rank 0 writes into it (this waits for all), and every rank builds the
    # same mesh: ranks that planned parallel=auto apart (SLURM's tasks on machines measured differently) or were given
    # different settings would otherwise wait forever on each other's groups
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout.record())
    other = next((r for r, got in enumerate(layouts) if got != layouts[0]), None)
    if other is not None:
        said = [f"{r['parallel']} (pp={r['pp']} dp={r['dp']} cp={r['cp']} tp={r['tp']})" for r in layouts]
        raise LaunchError(f"the ranks disagree on the layout: rank 0 would train {said[0]}, rank {other} "
                          f"{said[other]} (different settings, or parallel=auto planned apart); set the layout "
                          f"explicitly")
    if rank > 0 and owns:  # one console: the other ranks print to rank<k>.log in the run dir
        log_to_file(run_dir, rank)
    return owns, layout.build_mesh(device.split(":")[0])


def multi_node():
    """Whether this run spans machines (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


def log_to_file(run_dir, rank):
    """Send this process's stdout and stderr (the file descriptors: C++ output too) to rank<k>.log in run_dir."""
    os.makedirs(run_dir, exist_ok=True)  # on a node that doesn't share rank 0's file system
    path = os.path.join(run_dir, f"rank{rank}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"rank {rank} of {os.environ.get('WORLD_SIZE')}, pid {os.getpid()} on {socket.gethostname()}", flush=True)


def launch(fn, cfg, run_dir, lc):
    """Run fn(cfg, run_dir) on lc.nproc_per_node local ranks (x lc.nnodes machines) through torch's elastic agent;
    raise LaunchError naming the failed ranks if any fails (the agent then stops the others)."""
    import logging
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)  # the agent narrates every step
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)  # we report failures
    single = lc.nnodes == 1
    config = LaunchConfig(min_nodes=lc.nnodes, max_nodes=lc.nnodes, nproc_per_node=lc.nproc_per_node,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0" if single else lc.rdzv_endpoint,
                          run_id=str(uuid.uuid4()) if single else lc.rdzv_id, max_restarts=0,
                          start_method="forkserver")
    # forkserver: each rank is forked from a fresh interpreter (not from this process: whatever it holds, a CUDA
    # context included, stays here) that has imported train.py and torch once, where spawn imported them again in
    # every rank of every job: 3-5 s of CPU a rank, 309 of the test suite's 2,068 CPU-seconds (py-spy, 2026-12-07).
    # The server starts at the first launch and keeps that moment's environment for every later job's ranks
    multiprocessing.set_forkserver_preload(["__main__", "train"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks each on all cores would thrash
    try:
        elastic_launch(config, _rank_main)(fn, cfg, run_dir)
    except ChildFailedError as e:
        raise LaunchError(describe_failures(e.failures, run_dir)) from None
    finally:
        if not single:  # the dir Hydra made on this node (and its date folder) is unused where rank 0 is elsewhere
            for d in (run_dir, os.path.dirname(run_dir)):
                with contextlib.suppress(OSError):
                    os.rmdir(d)  # only if empty


def _rank_main(fn, cfg, run_dir):
    # ranks on other machines take rank 0's run dir: one dir per job, whichever node's clock named it
    run_dir = _rank0_string("run_dir", run_dir)
    return fn(cfg, run_dir)


def describe_failures(failures, run_dir):
    """One line for ChildFailedError.failures ({rank: ProcessFailure}): first failure first."""
    parts = []
    for rank, f in sorted(failures.items(), key=lambda kv: kv[1].timestamp):
        how = f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        msg = f.message.get("message", "") if isinstance(f.message, dict) else ""
        where = f"; output in {os.path.join(run_dir, f'rank{rank}.log')}" if rank > 0 else ""
        parts.append(f"rank {rank} {how}" + (f" ({msg.splitlines()[0][:300]})" if msg else "") + where)
    return "; ".join(parts)
