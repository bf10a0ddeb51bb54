"""Shared test helpers: configs composed as `python train.py ...` would, a token cache shared by the session,
a small real corpus, and a reader for W&B's offline run files."""
import glob
import json
import os
import struct
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# inductor compiles in the process that compiles, not in a pool of worker processes it would start (one per core)
# in each rank that compiles: on 2 busy cores the pools' start cost more than they saved (the matrix's 11 compiled
# world-2 jobs: 77 CPU-s with the pools, 70 without, warm cache, 2026-12-07)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def needs_shared(*paths):
    """Skip unless every one of `paths` (relative to ../shared) is there, naming those that are not."""
    missing = [p for p in paths if not os.path.exists(os.path.join(SHARED, p))]
    return pytest.mark.skipif(bool(missing), reason=f"needs ../shared/{' and ../shared/'.join(missing)}")


os.environ.setdefault("WANDB_SILENT", "true")


# the rule book refuses bf16 compute on a CPU without it (AVX2 alone: bf16 matmuls 27x slower than float32, measured
# on an AMD EPYC, 2026-12-03), so only what computes in bf16 skips there, and its launch jobs are not planned
import config  # noqa: E402 (torch comes with it: after OMP_NUM_THREADS is set above)

BF16 = config.bf16_supported("cpu")
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU can't compute in bfloat16")


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One data cache for the session (all its xdist workers and launches: data/prepare.py writes each corpus whole,
    atomically), so each corpus is tokenized once, never in the user's ~/.cache."""
    path = str(session_dir(tmp_path_factory, "cache"))
    os.environ["NANOPARALLEL_CACHE"] = path
    return path


def make_cfg(*overrides):
    from tools import plan
    return plan.compose(overrides, "config")


def small_corpus():
    """A few hundred KB of real Python, present wherever Python is: the stdlib's json and email packages."""
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, "json", "*.py"), os.path.join(root, "email", "*.py")]


def small_run(*overrides):
    """Overrides for a fast run of the tiny model on the small corpus (a 512-token BPE, 64-token sequences)."""
    paths = "[" + ",".join(small_corpus()) + "]"
    return ["data=text", f"data.paths={paths}", "data.vocab_size=512", "data.num_proc=1", "train.seq_len=64",
            "model.block_size=64", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
            "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6", "train.eval_every=3",
            "train.eval_steps=1", "train.log_every=1", "train.sample_tokens=0", "logger.mode=disabled",
            *overrides]


def fake_cpu_profile():
    """A made-up CPU profile (tools/step_time.py cpu_profile's keys, rates of this order) where cpu_profile looks for
    this machine's, in the session's cache: the planner's CPU path (plan.gpu=cpu, parallel=auto on a CPU) without
    its 15 s measurement. Returns it."""
    import json
    from tools import step_time
    rates = lambda r: [[m, n, k, r * (1 + (m * n * k) ** (1 / 3) / 512)] for m in (64, 1024) for n in (64, 1024)  # noqa
                       for k in (64, 1024)]
    per = {kind: 2e-9 for kind in step_time.ELEMENTWISE}
    gloo = {"all_reduce": [1e-3, 2e9], "all_gather": [5e-4, 7e8], "reduce_scatter": [1e-3, 5e8]}
    profile = {"cores": 2, "host_op_s": 3e-6, "shared": {"2": 1.1, "4": 2.2},
               "matmul": {"4": rates(20e9), "2": rates(10e9)},
               "attention": {a: [[128, 32, 30e9, 30e9], [1024, 64, 40e9, 40e9]] for a in ("4", "2")},
               "elementwise": {"4": per, "2": per}, "gloo": {"2": gloo, "4": gloo}}
    path = step_time.profile_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{os.getpid()}", "w") as f:  # whole, at once: another xdist worker may be reading it
        json.dump(profile, f)
    os.replace(f"{path}.{os.getpid()}", path)
    step_time._PROFILES.pop(path, None)
    return profile


REFUSED = {}  # {run dir: line}: the launches' jobs whose settings train.py refused (tools/jobs.py main)


def read_metrics(run_dir):
    assert str(run_dir) not in REFUSED, f"{run_dir}: refused in its launch: {REFUSED[str(run_dir)]}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_wandb_history(run_dir, wait_s=60):
    """The history rows of the offline W&B run in run_dir, decoded from its .wandb file.

    The file is W&B's 7-byte header ("W&B", version) then LevelDB-log framing: 32 KiB blocks of records, each
    a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a protobuf Record.
    W&B's own process writes it and may still be flushing after wandb.finish() returns (a CI run once read it
    before the history was there), so this waits for the run's closing `exit` record."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.time() + wait_s
    while True:
        data = open(path, "rb").read()
        assert data[:3] == b":W&" or data[:4] == b":W&B", data[:8]
        pos, block, records, pending = 7, 32768, [], b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # block trailer: padding
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                pos += left
                continue
            if pos + 7 + length > len(data):  # a record still being written
                break
            pending += data[pos + 7: pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(pending)
                pending = b""
                records.append(rec)
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.time() < deadline, f"{path}: no exit record after {wait_s} s (the W&B run never finished)"
        time.sleep(0.2)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            for rec in records if rec.WhichOneof("record_type") == "history"]


def torchrun(nproc, run_dir, *overrides, timeout=240, env=None):
    """Run train.py on nproc local ranks (gloo) through torchrun; returns the CompletedProcess."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def free_port():
    """A TCP port free on this machine now, for a rendezvous that two processes started later must agree on (not
    one made from the pid: two xdist workers' tests may run at once). Drawn below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range), from which every bind to port 0 and every outgoing connection (gloo's
    many, the launches' stores) takes its port: a port from that range, free when chosen, could be handed to one of
    them before the agent that was to listen on it started."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux: the conventional start of the dynamic range
        low = 49152
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: draw again
                continue
            return port
    raise RuntimeError(f"no free port below {low} in 100 draws")


def forked(world, fn, timeout=300):
    """fn() on `world` ranks forked from this process, with the variables torchrun would set. Each rank then starts
    with torch and train.py imported: 2-4 s a job here instead of torchrun's 13-30 s (fresh interpreters). The ranks
    meet at a store this process serves, as torchrun's agent serves its workers (TORCHELASTIC_USE_AGENT_STORE): its
    port is bound here before any rank starts. (A port chosen free and bound later by rank 0 was taken in between
    once, 2026-12-07: rank 0 died, the others waited at the rendezvous, and the suite stalled.) A rank that fails
    ends the others at once; past `timeout` s, all of them, after each has written its threads' stacks to the
    captured stderr (a run that hung at its end once, 2026-12-07, in a fresh clone's CI run, and said nothing)."""
    import faulthandler
    import gc
    import multiprocessing
    import signal
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)

    def rank_main(rank):
        # what this process held at the fork is its parent's: the rank's collections never walk it, and never run
        # the finalizers of the parent's garbage (pytest-xdist's channels, sockets) in a copy without its threads
        gc.freeze()
        faulthandler.register(signal.SIGUSR1, file=os.fdopen(os.dup(2), "w"), all_threads=True)  # the test's stderr
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
        fn()
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=rank_main, args=(r,)) for r in range(world)]
    for p in ranks:
        p.start()
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.is_alive() for p in ranks) and \
            not any(p.exitcode for p in ranks if not p.is_alive()):
        time.sleep(0.1)
    hung = [p for p in ranks if p.is_alive()] if time.time() >= deadline else []
    for p in hung:
        os.kill(p.pid, signal.SIGUSR1)
    if hung:  # time to write the stacks
        time.sleep(2)
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    del store
    assert not hung, f"ranks {[ranks.index(p) for p in hung]} still ran after {timeout} s: their stacks are in the " \
        f"captured stderr"
    assert [p.exitcode for p in ranks] == [0] * world, "a rank failed: its traceback is in the captured stderr"


def assert_refused(tmp_path, overrides, world, message):
    """train.check_config on small_run(*overrides) at `world` ranks stops with a one-line ConfigError that says
    `message`, before anything is written (the run dir is never made)."""
    import train
    with pytest.raises(train.ConfigError) as err:
        train.check_config(make_cfg(*small_run(*overrides)), str(tmp_path / "run"), world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


# --- one launch per world size for the whole session, run while the in-process tests run. Each rank spends seconds
# importing torch, Hydra and W&B, and the agent does too: the test files' equivalence runs of one world size share a
# single launch (tools/jobs.py: several train.py jobs in one torchrun launch and one process group). A test module
# registers its jobs with @launch_jobs(world); the launches hold the jobs of every module whose selected tests use
# the fixture launch<world> (`pytest -m quick`: the quick tier's alone; one file: that file's), module by module.
# They start with the session, one after another (2, 4, 8: a world-4 job may resume a world-2 job's checkpoint),
# and the tests that read them run last: meanwhile the in-process tests run, which use one core each and would
# leave the other idle.
LAUNCHES = {}
WORLDS = (2, 4, 8)


def launch_jobs(world):
    """Registers fn(root, request) -> {key: (run dir, overrides)} as its module's jobs in the session's launch of
    `world` ranks; they run in that order. fn may ask request.getfixturevalue for session fixtures (single; and
    launch2, which gives a world-4 job the world-2 jobs' run dirs: it may resume one's checkpoint)."""
    def register(fn):
        LAUNCHES.setdefault(world, {})[fn.__module__] = fn
        return fn
    return register


def reads(item, world):
    """Whether a test uses the shared launch of `world` ranks."""
    return f"launch{world}" in getattr(item, "fixturenames", ())


def launch_users(items, world):
    return {item.module.__name__ for item in items if reads(item, world) and getattr(item, "module", None)}


def check_groups(session):
    """Under xdist's loadgroup, each grouped test's id carries its group (`@name`), which is how the scheduler keeps
    a group on one worker; pytest-xdist 3.8 writes it where pytest 9 no longer reads it (requirements.txt), and the
    groups were then dropped without a word. Stop the session in one line if that happens again."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        lost = [item.nodeid for item in session.items
                if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:  # a worker's error reaches the controller as an internal error: the line goes to stderr first
            line = (f"error: pytest-xdist's --dist loadgroup is not honored with pytest {pytest.__version__} ({len(lost)} "
                    f"grouped tests without a group in their id, e.g. {lost[0]}): install requirements.txt's pytest")
            sys.stderr.write(line + "\n")
            raise pytest.UsageError(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The tests that read a launch go last, in their order: the launches run while the others do. Under pytest-xdist
    (pytest.ini: `-n logical --dist loadgroup`) a test goes to whichever worker is free, but for those marked with an
    xdist_group (test_auto.py's two tests of one ranking), which share one: a module-scoped fixture is made once
    on each worker that gets one of its tests. Grouping every module with such a fixture (2026-12-07, once pytest 8
    honored the groups) took 13 min 24 s in a fresh clone, against 11 min 49 s to 12 min 34 s without groups under
    pytest 9.2 (and 13 min 26 s with test_nccl.py's launch grouped: docs/tests.md)."""
    users = [item for item in items if any(reads(item, w) for w in WORLDS)]
    ids = {id(item) for item in users}
    items[:] = [item for item in items if id(item) not in ids] + users


def session_dir(tmp_path_factory, name):
    """A folder of this session's that every pytest-xdist worker shares (each worker's basetemp lies under one
    root; without xdist, the basetemp)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class Background:
    """The session's launches: planned at its start (each module's jobs and run dirs, the same on every xdist worker),
    and run one after another by tests/launches.py, a process of their own that the first worker to get here starts
    (the owner). Every worker reads a launch's result from the file it leaves (`wait`): the chain needs nobody to
    drive it, so a worker that has run out of tests, or never had one, holds nothing up."""

    def __init__(self, request, tmp_path_factory):
        import json
        import subprocess
        import sys
        self.plans, queue, self.done, self.owned = {}, [], {}, None  # owned: the chain's process, on its owner
        self.dir = session_dir(tmp_path_factory, "launches")
        for world in WORLDS:
            users = launch_users(request.session.items, world) & LAUNCHES.get(world, {}).keys()
            if not users:
                continue
            root, dirs, jobs = session_dir(tmp_path_factory, f"launch{world}"), {}, []
            for module in sorted(users):
                these = LAUNCHES[world][module](root / module, _Planned(request, self))
                dirs[module] = {key: run_dir for key, (run_dir, _) in these.items()}
                jobs += [(str(d), list(o)) for d, o in these.values()]
            self.plans[world] = dirs
            queue.append((world, jobs))
        if not queue:
            return
        try:  # the owner: the first worker here
            os.close(os.open(self.dir / "owner", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        with open(self.dir / "plan.json", "w") as f:
            json.dump(queue, f)
        # the pytest process the session belongs to: xdist's controller, the parent of its workers
        session_pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "launches.py"),
                                 str(self.dir / "plan.json"), str(self.dir), str(session_pid)],
                                cwd=ROOT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.owned = proc
        (self.dir / "pid.tmp").write_text(str(proc.pid))
        os.replace(self.dir / "pid.tmp", self.dir / "pid")

    def pid(self, wait_s=0):
        """The chain's process id, once its owner has started it (waiting up to wait_s for that); else None."""
        deadline = time.time() + wait_s
        while not (self.dir / "pid").exists():
            if time.time() >= deadline:
                return None
            time.sleep(0.2)
        return int((self.dir / "pid").read_text())

    def signal(self, sig):
        """`sig` to the chain and every process under it (tools/jobs.py process_tree: torchrun's ranks each run in a
        session of their own, out of reach of a process group's signal)."""
        from tools import jobs as job_runner
        pid = self.pid()
        for p in job_runner.process_tree(pid) if pid and not self.finished() else ():
            try:
                os.kill(p, sig)
            except ProcessLookupError:  # ended meanwhile
                pass

    def finished(self):
        return all((self.dir / f"launch{world}.json").exists() for world in self.plans)

    def wait(self, world):
        """{module name: ({key: run dir}, the launch's CompletedProcess)} once the launch of `world` has run."""
        import json
        import subprocess
        from tools import jobs as job_runner
        assert world in self.plans, f"no test selected uses launch{world}"
        if world not in self.done:
            path = self.dir / f"launch{world}.json"
            pid = self.pid(wait_s=600)
            assert pid, "the launches never started: no worker took them on"
            while not path.exists():
                assert job_runner.running(pid) or path.exists(), f"the launches' process {pid} ended without a " \
                    f"result for launch{world} (its output: pytest -n 0 shows it)"
                time.sleep(0.2)
            r = json.loads(path.read_text())
            self.done[world] = subprocess.CompletedProcess("launch", r["returncode"], r["stdout"],
                                                           r["stderr"] + r["note"])
            REFUSED.update(job_runner.refusals(r["stdout"]))
        p = self.done[world]
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        return {module: (d, p) for module, d in self.plans[world].items()}


class _Planned:
    """The request a module's jobs function sees while the launches are planned: launch<world> gives the planned
    run dirs ({module: ({key: run dir}, None)}) of an earlier launch, everything else is the session's fixture."""

    def __init__(self, request, background):
        self.request, self.background = request, background

    def getfixturevalue(self, name):
        if name.startswith("launch") and name[6:].isdigit():
            return {module: (d, None) for module, d in self.background.plans[int(name[6:])].items()}
        return self.request.getfixturevalue(name)


BACKGROUND = []  # this worker's Background, once its first test has started


@pytest.fixture(scope="session", autouse=True)
def background_launches(request, tmp_path_factory, token_cache):
    import signal
    BACKGROUND.append(Background(request, tmp_path_factory))
    yield
    owned = BACKGROUND[0].owned
    # a session that ends early (-x, a ^C) leaves no launch behind; under xdist the chain outlives its owner (the
    # other workers may still read it) and ends itself when the session's process does
    if owned and owned.poll() is None and not os.environ.get("PYTEST_XDIST_WORKER"):
        BACKGROUND[0].signal(signal.SIGKILL)
    BACKGROUND.clear()


@pytest.fixture(autouse=True)
def quiet(request):
    """@pytest.mark.quiet: a test that measures speed runs with the background launch stopped (SIGSTOP to its
    process and every one under it, SIGCONT after): sharing the cores, its rates came out of step with each other (a
    step's FLOP rate over a matmul's 1.1, seen in a clean clone). (The other xdist worker's tests go on.)"""
    import signal
    background = BACKGROUND[0] if BACKGROUND and request.node.get_closest_marker("quiet") else None
    if background:
        background.signal(signal.SIGSTOP)
    yield
    if background:
        background.signal(signal.SIGCONT)


def shared_launch(world):
    @pytest.fixture(scope="session", name=f"launch{world}")
    def launch(background_launches):
        """{module name: ({key: run dir}, the launch)} for the modules whose selected tests use this fixture."""
        return BACKGROUND[0].wait(world)
    return launch


launch2, launch4, launch8 = (shared_launch(world) for world in WORLDS)


def pytest_collection_finish(session):
    """Python's full collections walk every live object (torch's, Hydra's, W&B's: 0.2-0.6 s each here, and every
    in-process train.run ends with one): what exists once the tests are collected is left out of them for good.
    And the xdist groups checked (check_groups)."""
    check_groups(session)
    import gc
    gc.collect()
    gc.freeze()


def job_output(p, run_dir):
    """What rank 0 printed during one job of launch p (a shared launch's CompletedProcess)."""
    return p.stdout.split(f"layouts: start {run_dir}\n", 1)[1].split(f"layouts: done {run_dir}\n", 1)[0]


STEPS = 6
# global batch 16 in micro-batches of 2: accumulation 8 alone, 4 on 2 ranks, 2 on 4 ranks
RUN = ("train.global_batch_size=16", "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.eval_every=100",
       "train.log_every=1")


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """The reference: parallel=single on RUN's settings, in this process."""
    import train
    run_dir = str(tmp_path_factory.mktemp("single") / "run")
    train.run(make_cfg(*small_run(*RUN)), run_dir)
    return run_dir


def losses(run_dir, key="loss"):
    import torch
    return torch.tensor([r[key] for r in read_metrics(run_dir) if key in r], dtype=torch.float64)


def assert_same_steps(run_dir, ref_dir, rtol=1e-5):
    """Per-step loss and gradient norm equal to the reference run's, and the validation loss at each evaluation
    (one validation set whatever the layout: train.eval_batch_size), within rtol (or rtol[key]). The norm is what
    sees a gradient scaled wrong (a sum where a mean belongs): AdamW with clipping makes the losses nearly blind to
    it."""
    import torch
    for key in ("loss", "grad_norm", "val_loss"):
        got, ref = losses(run_dir, key), losses(ref_dir, key)
        assert len(got) == len(ref) > 0, (key, len(got), len(ref))
        torch.testing.assert_close(got, ref, rtol=rtol[key] if isinstance(rtol, dict) else rtol, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")


def final_weights(run_dir):
    """The run's weights at its last checkpoint, consolidated from whatever shards its ranks wrote."""
    import checkpoint
    return checkpoint.consolidate(checkpoint.find(run_dir))[0]


def assert_same_weights(run_dir, ref_dir, atol=1e-6, rtol=1e-5):
    """Final weights (the last checkpoint's) equal to the reference run's (rtol=atol=0: bit for bit)."""
    import torch
    got, ref = final_weights(run_dir), final_weights(ref_dir)
    assert got.keys() == ref.keys()
    # atol 1e-6 (weights are ~2e-2): Adam divides by sqrt(v), so in embedding rows of rare tokens, whose gradients
    # are tiny, the rounding of a different summation order grows to a few 1e-7 (5e-7 seen after 6 steps)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "broadcast", "all_to_all")


def record_measured(r):
    """A real run's metrics record in the dry run's form (tools/dry_run.py measure): state, comm total, and comm
    by (mesh dimension, collective) from its comm_<dim>_<kind> keys."""
    comm = {(k[5:-len(kind) - 1], kind): v for k, v in r.items() for kind in COLLECTIVES
            if k.startswith("comm_") and k.endswith("_" + kind)}
    return {"state_bytes": r["state_bytes"], "comm_bytes": r["comm_bytes"], "comm": comm}


def assert_planner_equals(m, predicted, state=None, every=False):
    """tools/plan.py's numbers equal measured ones (`m` as tools/dry_run.py measure returns them, or a real run's
    record through record_measured): state and communication within 1%, the total and each (mesh dimension,
    collective) the planner names, give or take what the planner says is a mean over ranks (predicted["spread"]:
    each rank's ZeRO or FSDP shard holds its own piece of the norm gains, whose gradients sequence parallel sums over
    tp). `every`: no collective measured that the planner doesn't name."""
    spread = predicted.get("spread", {})
    assert m["state_bytes"] == pytest.approx(state or predicted["state"], rel=0.01)
    assert abs(m["comm_bytes"] - predicted["comm_total"]) <= 0.01 * predicted["comm_total"] + sum(spread.values())
    for key, b in predicted["comm"].items():
        assert abs(m["comm"].get(key, 0) - b) <= 0.01 * b + spread.get(key, 0), (key, m["comm"].get(key, 0), b)
    if every:
        assert {k for k, v in m["comm"].items() if v} <= set(predicted["comm"]), set(m["comm"]) - set(predicted["comm"])
