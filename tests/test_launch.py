"""Every launch path runs real ranks of train.py: torchrun on two agents (two "nodes" on localhost), train.py
starting its own ranks, a Hydra sweep of multi-rank jobs, submitit's local executor; one run dir per job, per-rank
logs, the same losses as parallel=single, a killed rank failing only its own job, and the sweep report read back
against the metrics files."""
import glob
import os
import signal
import statistics
import subprocess
import sys
import time

import matplotlib.image
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, RUN, STEPS, free_port, losses, make_cfg, read_metrics, small_run
import launch
from tools import report

QUICK = small_run("train.max_steps=2", "train.eval_every=2")  # evaluates at steps 0 and 2


def train_py(*args, env=None, timeout=300):
    """`python train.py *args` from the repo root; returns the CompletedProcess (any exit code)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def ok(p):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def assert_rank_logs(run_dir, world):
    for rank in range(1, world):
        with open(os.path.join(run_dir, f"rank{rank}.log")) as f:
            assert f.readline().startswith(f"rank {rank} of {world}, pid ")
    assert not os.path.exists(os.path.join(run_dir, "rank0.log"))  # rank 0 keeps the console


def test_torchrun_two_agents_share_one_run_dir(tmp_path):
    """Two torchrun agents, --nnodes=2, c10d rendezvous on localhost; their clocks in different time zones, so
    only rank 0's timestamp, shared through the rendezvous store, can give them one run dir."""
    out = tmp_path / "out"
    port = free_port()
    agents = []
    for node, tz in ((0, "UTC"), (1, "Asia/Tokyo")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=two-agents",
               os.path.join(ROOT, "train.py"), *QUICK, "parallel=ddp", f"train.out_dir={out}"]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1", "TZ": tz}))
    for a in agents:
        output = a.communicate(timeout=300)[0]
        assert a.returncode == 0, output[-5000:]
    (run_dir,) = glob.glob(str(out / "*" / "*"))  # one dir, no stray per-rank ones
    assert os.path.isdir(run_dir) and len(os.listdir(out)) == 1
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "metrics.jsonl", "rank1.log"]
    assert read_metrics(run_dir)[0]["world_size"] == 2
    assert_rank_logs(run_dir, 2)


def test_self_launch_on_two_nodes_shares_one_run_dir(tmp_path):
    """launcher.nnodes=2: two `python train.py` processes, a rank each, in different time zones again."""
    out = tmp_path / "out"
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *QUICK, "parallel=ddp",
                               f"train.out_dir={out}", "launcher.nproc_per_node=1", "launcher.nnodes=2",
                               f"launcher.rdzv_endpoint=localhost:{port}", "launcher.rdzv_id=two-nodes"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "TZ": tz}) for tz in ("UTC", "Asia/Tokyo")]
    for n in nodes:
        output = n.communicate(timeout=300)[0]
        assert n.returncode == 0, output[-5000:]
    (run_dir,) = glob.glob(str(out / "*" / "*"))  # the other node's unused dir is gone
    assert len(os.listdir(out)) == 1
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "metrics.jsonl", "rank1.log"]
    assert read_metrics(run_dir)[0]["world_size"] == 2


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real sweep: two jobs, each a 2-rank job that train.py launches itself (6 steps, accumulation 4)."""
    sweep_dir = str(tmp_path_factory.mktemp("sweep") / "s")
    ok(train_py("-m", *small_run(*RUN), "parallel=ddp,fsdp", "launcher.nproc_per_node=2",
                f"hydra.sweep.dir={sweep_dir}"))
    return sweep_dir


def test_sweep_of_multi_rank_jobs(sweep, single):
    names = []
    for num, strategy in enumerate(("ddp", "fsdp")):
        job = os.path.join(sweep, str(num))
        records = read_metrics(job)
        assert (records[0]["parallel"], records[0]["world_size"]) == (strategy, 2)
        # self-launched ranks train exactly as parallel=single does
        torch.testing.assert_close(losses(job), losses(single), rtol=1e-5, atol=0)
        assert_rank_logs(job, 2)
        logger = OmegaConf.load(os.path.join(job, "config.yaml")).logger
        assert logger.group == sweep  # the jobs of a sweep share a W&B group
        assert f"parallel={strategy}" in logger.name and "launcher.nproc_per_node=2" in logger.name
        names.append(logger.name)
    assert names[0] != names[1]


def test_parallel_auto_trains_its_pick(tmp_path, single):
    """`python train.py parallel=auto launcher.nproc_per_node=2`: the launcher checks (silently), rank 0 of the
    launched ranks plans on this CPU (a made-up profile here) and prints the top 5 once, both ranks train its pick
    (the one tools/plan.py choose makes in this process), metrics.jsonl holds the pick's name and the candidates, the
    saved config the concrete layout, and the losses are parallel=single's."""
    from tools import plan
    from conftest import fake_cpu_profile
    fake_cpu_profile()
    run_dir = str(tmp_path / "run")
    p = ok(train_py(*small_run(*RUN), "parallel=auto", "launcher.nproc_per_node=2", f"hydra.run.dir={run_dir}"))
    assert p.stdout.count("parallel=auto picks") == 1
    cfg = make_cfg(*small_run(*RUN), "parallel=auto", "launcher.nproc_per_node=2", "train.dtype=float32")
    expected = plan.choose(cfg, plan.cluster(cfg, 2, "cpu"), log=lambda *a: None)
    first = read_metrics(run_dir)[0]
    assert first["auto"]["overrides"] == expected["overrides"] and first["auto"]["candidates"] == \
        expected["candidates"]
    assert first["parallel"] == expected["candidates"][0]["parallel"] and first["world_size"] == 2
    saved = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    assert not saved.parallel.auto and saved.train.micro_batch_size == expected["candidates"][0]["micro_batch_size"]
    torch.testing.assert_close(losses(run_dir), losses(single), rtol=1e-4, atol=0)
    assert_rank_logs(run_dir, 2)


def test_killed_rank_fails_only_its_job(tmp_path):
    """Job 0 would run for minutes: kill its rank 1 (pid from its log) and the job fails, saying so; job 1 runs."""
    sweep_dir = str(tmp_path / "s")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", *QUICK, "parallel=ddp", "train.max_steps=5000,2",
           "launcher.nproc_per_node=2", f"hydra.sweep.dir={sweep_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    log, deadline = os.path.join(sweep_dir, "0", "rank1.log"), time.time() + 120
    while not (os.path.exists(log) and "pid" in open(log).read()):
        assert p.poll() is None and time.time() < deadline, "job 0's rank 1 never started"
        time.sleep(0.2)
    pid = int(open(log).read().split("pid ")[1].split()[0])
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode != 0  # a sweep with a failed job fails, at its end
    assert "error: job #0 (" in stderr and "rank 1 killed by SIGKILL" in stderr, stderr[-3000:]
    assert "job #1" not in stderr
    assert [r["step"] for r in read_metrics(os.path.join(sweep_dir, "1")) if "loss" in r] == [1, 2]
    rows = report.main([sweep_dir])  # job 0 may have died before or after writing its first files
    assert rows[0]["status"] != "done" and rows[1]["status"] == "done"


def test_submitit_local_job(tmp_path):
    """hydra/launcher=submitit_local, two tasks: the path a SLURM job takes, ranks from submitit's environment."""
    sweep_dir = str(tmp_path / "s")
    ok(train_py("-m", *QUICK, "parallel=zero1", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                f"hydra.sweep.dir={sweep_dir}"))
    job = os.path.join(sweep_dir, "0")
    assert read_metrics(job)[0]["world_size"] == 2
    assert [r["step"] for r in read_metrics(job) if "loss" in r] == [1, 2]
    assert_rank_logs(job, 2)
    assert OmegaConf.load(os.path.join(job, "config.yaml")).logger.group == sweep_dir


def test_report(sweep):
    rows = report.main([sweep])
    assert [(r["label"], r["status"], r["world"], r["steps"]) for r in rows] == [("ddp", "done", 2, STEPS),
                                                                                 ("fsdp", "done", 2, STEPS)]
    for num, row in enumerate(rows):
        records = read_metrics(os.path.join(sweep, str(num)))
        steps = [r for r in records if "loss" in r]
        assert row["loss"] == f"{steps[-1]['loss']:.4f}"
        assert row["val_loss"] == f"{[r['val_loss'] for r in records if 'val_loss' in r][-1]:.4f}"
        assert row["tok_per_s"] == round(statistics.median(r["tok_per_s"] for r in steps[1:]))
        assert row["comm_MiB_per_step"] == f"{steps[-1]['comm_bytes'] / 2**20:.2f}"
        assert row["state_MiB_per_rank"] == f"{steps[-1]['state_bytes_max'] / 2**20:.2f}"
        # the strategies match the theory exactly here (tests/test_data_parallel.py): so must the report
        assert float(row["comm_vs_theory"]) == pytest.approx(1, abs=0.02)
        assert float(row["state_vs_theory"]) == pytest.approx(1, abs=0.05)
    text = open(os.path.join(sweep, "report", "report.md")).read()
    assert all(f"| {r['job']} | {r['label']} | done | 2 | {STEPS} | {r['loss']} |" in text for r in rows)
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png"):
        path = os.path.join(sweep, "report", name)
        assert os.path.getsize(path) > 10_000, name
        pixels = matplotlib.image.imread(path)[..., :3].reshape(-1, 3)
        assert (pixels.min(axis=1) < 0.9).mean() > 0.02, f"{name} is nearly blank"
        assert len(np.unique(pixels.round(2), axis=0)) > 20, f"{name} has almost no colors"


@pytest.mark.quick
@pytest.mark.parametrize("overrides,message", [
    (["launcher.nproc_per_node=0"], "must be a whole number >= 1"),
    ([f"launcher.nproc_per_node={launch.max_local_ranks('cpu')[0] + 1}"], "more than this machine can run"),
    (["launcher.nproc_per_node=2", "launcher.nnodes=2"], "needs the rendezvous every node joins"),
    (["launcher.nproc_per_node=2", "launcher.nnodes=2", "launcher.rdzv_endpoint=h:1"], "launcher.rdzv_id=NAME"),
])
def test_bad_launcher_settings(overrides, message):
    problem = launch.check(make_cfg(*overrides).launcher, "cpu", under_torchrun=False)
    assert problem and message in problem


def test_bad_launches_stop_before_any_work(tmp_path):
    """A launcher inside torchrun, and settings that can't work on the ranks asked for: one line, nothing written."""
    run_dir = tmp_path / "run"
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    for args, env, message in (
            (["launcher.nproc_per_node=2"], torchrun_env, "it is already one of torchrun's 1 ranks"),
            (["parallel=ddp", "launcher.nproc_per_node=2", "train.micro_batch_size=8"], None,
             "not divisible by micro_batch_size (8) x data-parallel ranks (2)")):
        p = train_py(*QUICK, *args, f"hydra.run.dir={run_dir}", env=env)
        assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("error: "), p.stderr[-3000:]
        assert message in p.stderr
        assert not run_dir.exists() or not os.listdir(run_dir)


def _threads(name):
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == name for t in os.listdir("/proc/self/task"))


def test_jobs_in_one_launch_leave_nothing_behind(tmp_path, capfd):
    """tools/jobs.py runs many train.py jobs in one process group (the tests' launches): a layout seen before reuses
    its mesh and gloo groups (parallel/layout.py once_per_group). Each gloo group
    keeps three threads: new groups per job piled up hundreds of threads per rank, and a launch's last jobs ran
    several times slower. A job whose settings are refused is reported and skipped, and the rest run (a CPU without
    bf16 once refused a launch's bf16 jobs: every job after the first refusal was lost)."""
    import contextlib
    import json
    from conftest import forked
    from tools import jobs
    layouts = [("tp", "parallel.tp=2"), ("cp", "parallel.cp=2"), ("tp", "parallel.tp=3")] + \
        [("tp", "parallel.tp=2"), ("cp", "parallel.cp=2"), ("zero2", "parallel.impl=scratch")]
    overrides = [small_run("train.max_steps=1", "train.eval_every=1", f"parallel={s}", extra) for s, extra in layouts]
    path = tmp_path / "jobs.json"
    dirs = [str(tmp_path / f"job{i}") for i in range(len(overrides))]
    path.write_text(json.dumps([[d, o] for d, o in zip(dirs, overrides)]))
    counts = str(tmp_path / "threads")

    def rank():
        seen = []

        @contextlib.contextmanager
        def around(run_dir):
            seen.append(_threads("pt_gloo_runloop"))  # what the jobs before this one left running
            yield
        jobs.main(str(path), around)
        with open(f"{counts}.{os.environ['RANK']}", "w") as f:
            json.dump(seen, f)
    forked(2, rank)
    refused = jobs.refusals(capfd.readouterr().out)
    assert list(refused) == [dirs[2]] and "parallel.tp=3" in refused[dirs[2]], refused
    assert [os.path.exists(os.path.join(d, "metrics.jsonl")) for d in dirs] == [True, True, False, True, True, True]
    for r in range(2):
        seen = json.load(open(f"{counts}.{r}"))
        # the fourth and fifth jobs repeat the first two's layouts; the sixth's start shows what the fifth left
        assert seen[1] < seen[3] == seen[4] == seen[5], f"rank {r}: gloo threads at each job's start {seen}"


def test_a_launch_composes_each_job_once(tmp_path):
    """tools/jobs.py composed: rank r composes jobs r, r + world, ... and every rank gets every config in order; a
    composition that fails comes back as one line naming the job's overrides and the error, for every rank to
    raise at that job's turn."""
    import json
    import torch.distributed as dist
    from conftest import forked
    from tools import jobs

    def compose(overrides):
        if overrides == ["train.nope=1"]:
            raise KeyError("train.nope")
        return {"overrides": overrides, "by": dist.get_rank()}

    def rank():
        dist.init_process_group("gloo")
        got = jobs.composed([[f"job{i}"] for i in range(5)] + [["train.nope=1"]], compose)
        with open(tmp_path / f"rank{dist.get_rank()}.json", "w") as f:
            json.dump([c if isinstance(c, dict) else str(c) for c in got], f)
        dist.destroy_process_group()
    forked(2, rank)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got[:5] == [{"overrides": [f"job{i}"], "by": i % 2} for i in range(5)], got
        assert got[5] == "composing train.nope=1: KeyError: 'train.nope'", got[5]


def test_a_launch_in_progress_says_which_jobs_are_done(tmp_path):
    """tools/jobs.py Started.done: the jobs rank 0 has marked done so far, read while the launch writes; the reading
    leaves the launch's own output whole and in order (its file offset is shared with the process writing it)."""
    import tempfile
    from tools import jobs
    out, err = (tempfile.TemporaryFile("w+") for _ in range(2))
    script = f"print('{jobs.DONE}a', flush=True); import sys; sys.stdin.readline(); print('tail'); " \
             f"print('{jobs.DONE}b')"
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=out, stderr=err, text=True)
    spec = tmp_path / "spec.json"
    spec.write_text("[]")
    started = jobs.Started(proc, ["x"], str(spec), out, err)
    deadline = time.time() + 30
    while not started.done() and time.time() < deadline:
        time.sleep(0.05)
    assert started.done() == ["a"]
    proc.stdin.write("\n")
    proc.stdin.flush()
    p = started.finish(timeout=30)
    assert p.stdout == f"{jobs.DONE}a\ntail\n{jobs.DONE}b\n"
