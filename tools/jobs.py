"""Run several train.py jobs in one torchrun launch: `python -m torch.distributed.run --nproc_per_node=N
-m tools.jobs JOBS.json`, JOBS a list of [run dir, [overrides]]. One process group and one start of torch, Hydra,
W&B and datasets per rank serve them all (each rank spends seconds importing them); train.run leaves a process
group it did not create in place, and a layout's mesh (its groups) is built once in it and reused by every job of
that layout (parallel/layout.py once_per_group says why). What lives across jobs (the modules, their caches) is frozen
out of the garbage collector: each train.run ends in a full collection, which would walk it all again (0.2-0.6 s a
job on each rank, on 2 CPU cores). The tests' launches
(tests/conftest.py torchrun_jobs) and tools/precision.py go through here."""
import contextlib
import gc
import json
import os
import sys
import time

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFUSED = "layouts: refused "  # a job whose settings were refused: rank 0 prints this, its run dir and the line
DONE = "layouts: done "  # a job that ran to its end: rank 0 prints this and its run dir


def refusals(stdout):
    """{run dir: the refusal's line} from a launch's output."""
    return dict(line[len(REFUSED):].split(": ", 1) for line in stdout.splitlines() if line.startswith(REFUSED))


def composed(overrides, compose):
    """Every job's config, each composed once in the launch: rank r composes jobs r, r + world, ... and all ranks
    get them all (all_gather_object). Hydra's composition (override parsing, YAML loading) took 0.12 s of CPU a job,
    and every rank repeated it: 13% of a world-4 launch's work. A composition that fails stands in for its config
    as one line saying what failed, raised at that job's turn on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for i in range(rank, len(overrides), world):
        try:
            mine[i] = compose(overrides[i])
        except Exception as e:  # Hydra's and OmegaConf's errors need not pickle: their line does
            mine[i] = RuntimeError(f"composing {' '.join(overrides[i])}: {type(e).__name__}: {e}")
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    every = {i: cfg for part in gathered for i, cfg in part.items()}
    return [every[i] for i in range(len(overrides))]


def main(path, around=lambda run_dir: contextlib.nullcontext()):
    """Run the jobs in JOBS.json on this rank, each inside `around(run_dir)` (a context manager: tests wrap each job
    in what they measure)."""
    sys.path.insert(0, ROOT)
    import train
    from config import ConfigError
    from tools.plan import compose
    with open(path) as f:
        jobs = json.load(f)
    dist.init_process_group("gloo")
    configs = composed([overrides for _, overrides in jobs], lambda o: compose(o, "config"))
    gc.freeze()
    for (run_dir, _), cfg in zip(jobs, configs):
        if dist.get_rank() == 0:  # markers around each job's console output, for tests that read it
            print(f"layouts: start {run_dir}", flush=True)
        start = time.time()
        try:
            if isinstance(cfg, Exception):  # its composition failed, on the rank that composed it: here, on all
                raise cfg
            with around(run_dir):
                train.run(cfg, run_dir)
        except ConfigError as e:  # a job's settings refused: the same line on every rank (the same settings and
            if dist.get_rank() == 0:  # files); the launch's other jobs run (REFUSED, above)
                print(f"{REFUSED}{run_dir}: {e}", flush=True)
            continue
        if dist.get_rank() == 0:
            print(f"{DONE}{run_dir}", flush=True)
            print(f"layouts: {time.time() - start:.1f} s for {run_dir}", flush=True)  # where a launch's time goes
        # what the job left in cycles (its model, its optimizer) goes first: frozen, it would stay for good; then
        # what it left behind on purpose (lazily imported modules, the layouts' meshes) joins the rest
        gc.collect()
        gc.freeze()
    dist.barrier()
    dist.destroy_process_group()


def start(nproc, jobs, env=None, script=("-m", "tools.jobs")):
    """Start `jobs` [(run dir, [overrides])] on nproc local ranks in one torchrun launch, without waiting; a Started
    whose finish() waits for it and returns the CompletedProcess. `script`: what each rank runs with the jobs file
    (a test's own, which calls main)."""
    import subprocess
    import tempfile
    spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    with spec as f:
        json.dump([[d, list(o)] for d, o in jobs], f)
    out, err = (tempfile.TemporaryFile("w+") for _ in range(2))  # files, not pipes: nobody reads while it runs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *script, spec.name]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return Started(proc, cmd, spec.name, out, err)


class Started:
    """A launch under way (start)."""

    def __init__(self, proc, cmd, spec, out, err):
        self.proc, self.cmd, self.spec, self.out, self.err = proc, cmd, spec, out, err

    def pause(self, stop=True):
        """Stop (or continue) the whole launch, its agent and ranks."""
        import signal
        self._signal(signal.SIGSTOP if stop else signal.SIGCONT)

    def kill(self):
        """Kill the whole launch, its agent and every rank (a killed agent alone leaves its ranks running)."""
        import signal
        self._signal(signal.SIGKILL)

    def _signal(self, sig):
        """`sig` to the agent and every process under it. Not its process group alone: torchrun starts each rank
        in a session of its own (torch.distributed.elastic's subprocess handler), so a signal to the agent's group
        never reached the ranks, and the tests that measure speed ran beside a launch that went on computing."""
        if self.proc.poll() is not None:
            return
        for pid in process_tree(self.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # ended meanwhile
                pass

    def done(self):
        """The run dirs of the jobs finished so far, from rank 0's "layouts: done" lines. Read with pread: the file's
        offset is the launch's own write position (the same open file), which a seek here would move."""
        fd = self.out.fileno()
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        return [line[len(DONE):] for line in text.splitlines() if line.startswith(DONE)]

    def finish(self, timeout=None):
        """Wait for the launch (killing it past `timeout` seconds: subprocess.TimeoutExpired); its
        CompletedProcess."""
        import subprocess
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise
        finally:
            os.unlink(self.spec)
        text = []
        for f in (self.out, self.err):
            f.seek(0)
            text.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, *text)


def process_tree(pid):
    """pid and every process under it, parents first (from /proc: Linux), found before any is signalled."""
    out = [pid]
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in map(int, f.read().split()):
                    out += process_tree(child)
    return out


def running(pid):
    """Whether process `pid` runs (from /proc: Linux); one that has ended but that its parent has not reaped yet (a
    zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def launch(nproc, jobs, timeout=None, env=None, script=("-m", "tools.jobs")):
    """Run `jobs` [(run dir, [overrides])] on nproc local ranks in one torchrun launch; the CompletedProcess."""
    return start(nproc, jobs, env, script).finish(timeout)


if __name__ == "__main__":
    main(sys.argv[1])
