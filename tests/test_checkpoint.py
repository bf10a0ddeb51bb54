"""Distributed checkpoints (checkpoint.py and train.py's loop): exact resume, resharding across every
strategy and world size, a killed rank, preemption, divergence, damaged checkpoints, export and sampling."""
import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

import config
import torch

import sample
import train
from conftest import ROOT, assert_same_weights, forked, launch_jobs, make_cfg, read_metrics, small_run, torchrun
from data import prepare, shards
import checkpoint

S = 20
BASE = small_run(f"train.max_steps={S}", "checkpoint.every=5", "checkpoint.keep=3", "train.eval_every=10")


def step_losses(run_dir, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def assert_identical(run_dir, ref_dir):
    assert_same_weights(run_dir, ref_dir, atol=0, rtol=0)  # bit for bit


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """20 uninterrupted steps in one process, a checkpoint every 5 (the newest 3 kept)."""
    run_dir = str(tmp_path_factory.mktemp("ref") / "run")
    train.run(make_cfg(*BASE), run_dir)
    return run_dir


def test_checkpoints_kept_and_their_contents(ref):
    root = os.path.join(ref, "checkpoints")
    assert sorted(os.listdir(root)) == ["step_0000010", "step_0000015", "step_0000020"]  # keep=3, every=5
    last = os.path.join(root, "step_0000020")
    assert sorted(os.listdir(last)) == [".metadata", "__0_0.distcp", "manifest.json", "state.json", "tokenizer.json"]
    state = json.load(open(os.path.join(last, "state.json")))
    assert state["step"] == 20 and state["world_size"] == 1 and state["data"]["next_batch"] == 20
    assert state["config"]["train"]["max_steps"] == S and not state["preempted"]
    # model and optimizer, every parameter, under single-process names
    md = checkpoint._Reader(last).read_metadata().state_dict_metadata
    names = [n for n, _ in train.GPT(config.model_config(make_cfg(*BASE), 512)).named_parameters()]
    for n in names:
        assert {f"model.{n}", f"optim.{n}.exp_avg", f"optim.{n}.exp_avg_sq", f"optim.{n}.step"} <= md.keys()


def test_resume_is_bit_identical(ref, tmp_path):
    """Steps 11-20 from the step-10 checkpoint: the same losses and weights, to the bit, as the uninterrupted run."""
    run_dir = str(tmp_path / "resumed")
    train.run(make_cfg(*BASE, f"train.resume={ref}/checkpoints/step_0000010"), run_dir)
    got, want = step_losses(run_dir), step_losses(ref)
    assert sorted(got) == list(range(11, S + 1))
    assert all(got[s] == want[s] for s in got), [(s, got[s], want[s]) for s in got]
    assert_identical(run_dir, ref)
    assert read_metrics(run_dir)[1]["resumed_from"].endswith("step_0000010")


def test_sigterm_saves_then_auto_resume_finishes(ref, tmp_path, monkeypatch):
    """A SIGTERM during step 13: a checkpoint at 13, a clean return; the same command again goes on from 13."""
    run_dir = str(tmp_path / "run")
    lr_at = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda step, o, n: (step == 12 and os.kill(os.getpid(), signal.SIGTERM))
                        or lr_at(step, o, n))
    train.run(make_cfg(*BASE), run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_0000005", "step_0000010",
                                                                        "step_0000013"]
    assert json.load(open(os.path.join(run_dir, "checkpoints", "step_0000013", "state.json")))["preempted"]
    assert max(step_losses(run_dir)) == 13
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the run
    monkeypatch.setattr(train, "lr_at", lr_at)
    train.run(make_cfg(*BASE), run_dir)  # train.resume=auto
    assert [r["resumed_from"] for r in read_metrics(run_dir) if "resumed_from" in r][0].endswith("step_0000013")
    assert_identical(run_dir, ref)


@pytest.mark.parametrize("nan_from,message", [
    (4, "step 5: the weights or optimizer state are not finite"),  # nan lr in step 5: its update ruins the weights
    (5, "step 7: the loss or gradient norm is not finite"),        # ... in step 6: step 7's loss is nan
])
def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, nan_from, message):
    run_dir = str(tmp_path / "run")
    lr_at = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda step, o, n: float("nan") if step >= nan_from else lr_at(step, o, n))
    with pytest.raises((train.Diverged, checkpoint.CheckpointError), match=message) as e:
        train.run(make_cfg(*small_run("train.max_steps=20", "checkpoint.every=5", "checkpoint.keep=5",
                                      "train.log_every=7")), run_dir)
    assert ("the last checkpoint" if nan_from == 5 else "no checkpoint written") in str(e.value)
    kept = sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) if nan_from == 5 else []
    assert nan_from == 5 or not os.path.exists(os.path.join(run_dir, "checkpoints"))
    assert kept == (["step_0000005"] if nan_from == 5 else [])  # no .tmp left, nothing after the divergence
    for c in kept:
        w = checkpoint.consolidate(os.path.join(run_dir, "checkpoints", c))[0]
        assert all(torch.isfinite(v).all() for v in w.values())


def damaged(src, tmp_path, how):
    """A copy of checkpoint src, damaged in one way."""
    c = str(tmp_path / "damaged" / "step_0000020")
    shutil.copytree(src, c)
    data = os.path.join(c, "__0_0.distcp")
    if how == "missing":
        os.remove(data)
    elif how == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
    elif how == "corrupt":
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "no manifest":
        os.remove(os.path.join(c, "manifest.json"))
    elif how == "pickle":  # metadata that would run a command, with a manifest that vouches for it
        class Evil:
            def __reduce__(self):
                return os.system, (f"touch {tmp_path}/pwned",)
        with open(os.path.join(c, ".metadata"), "wb") as f:
            pickle.dump(Evil(), f)
        manifest = json.load(open(os.path.join(c, "manifest.json")))
        manifest["files"][".metadata"] = checkpoint._digest(os.path.join(c, ".metadata"))
        json.dump(manifest, open(os.path.join(c, "manifest.json"), "w"))
    return c


def snapshot(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}


@pytest.mark.parametrize("how,message", [
    ("missing", "__0_0.distcp is missing"),
    ("truncated", "(truncated?)"),
    ("corrupt", "is corrupt"),
    ("no manifest", "is not a complete checkpoint"),
    ("pickle", "system is not part of a checkpoint's metadata"),
])
def test_damaged_checkpoint_is_refused(ref, tmp_path, how, message):
    c = damaged(os.path.join(ref, "checkpoints", "step_0000020"), tmp_path, how)
    before = snapshot(c)
    run_dir = tmp_path / "run"
    with pytest.raises((train.ConfigError, checkpoint.CheckpointError)) as e:
        train.run(make_cfg(*BASE, f"train.resume={c}", "train.max_steps=30"), str(run_dir))
    assert message in str(e.value), str(e.value)
    assert not run_dir.exists() or not os.listdir(run_dir)  # the new run wrote nothing
    assert snapshot(c) == before and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("overrides,message", [
    (["model.n_embd=32"], "holds wte.weight of shape [512, 64], this model's is [512, 32]"),
    (["model.n_layer=3"], "is a checkpoint of another model: 6 parameters differ, e.g. blocks.2.attn.proj.weight"),
    (["data.vocab_size=600"], "holds wte.weight of shape [512, 64], this model's is [640, 64]"),
    (["data.vocab_size=500"], "was trained with another tokenizer or vocab (512 tokens)"),  # same padded shapes
    (["optim=sgd"], "holds AdamW's state, this run's optimizer is SGD"),
])
def test_checkpoint_of_another_model_is_refused(ref, tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.run(make_cfg(*BASE, f"train.resume={ref}", *overrides), str(run_dir))
    assert message in str(e.value), str(e.value)
    assert not run_dir.exists() or not os.listdir(run_dir)


def test_unfinished_save_is_never_picked(ref, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    os.rename(run_dir / "checkpoints" / "step_0000020", run_dir / "checkpoints" / "step_0000020.tmp")  # a crash
    assert checkpoint.find(str(run_dir)).endswith("step_0000015")
    with pytest.raises(train.ConfigError, match="unfinished save"):
        train.run(make_cfg(*BASE, f"train.resume={run_dir}/checkpoints/step_0000020.tmp"), str(tmp_path / "new"))


def test_export_and_sample(ref, tmp_path):
    out = str(tmp_path / "model.safetensors")
    checkpoint.main([ref, out])  # the run dir: its newest checkpoint
    model, enc, meta = sample.load(out)
    assert meta["step"] == S and enc.n_vocab == 512
    # the exported model is the trained one: its loss on the run's validation batches is the run's last val loss
    cfg = make_cfg(*BASE)
    t = cfg.train
    val = prepare.load(prepare.prepare(cfg.data, cfg.data.cache_dir))[1]
    with torch.no_grad():
        batch = t.eval_batch_size or t.global_batch_size  # the validation set: eval_steps batches of this many
        loss = sum(model(*shards.get_batch(val, "val", t.seed, i, batch, t.seq_len)).item()
                   for i in range(t.eval_steps)) / t.eval_steps
    assert loss == pytest.approx(read_metrics(ref)[-1]["val_loss"], abs=1e-6)
    with pytest.raises(SystemExit, match="already exists"):  # never overwritten
        checkpoint.main([ref, out])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), out, "--prompt", "def ", "--tokens", "20",
                        "--samples", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("--- sample") == 2 and "def " in p.stdout
    p = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), os.path.join(ref, "config.yaml")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.quick
def test_rects_cut_any_flat_range_of_any_tensor():
    """checkpoint.rects: a flat range of a row-major tensor (a ZeRO or FSDP shard's piece of a parameter) as the
    rectangles of the global tensor it covers, for vectors, matrices and the experts' stacks (E, d, f), at any origin
    (a tensor-parallel block, an ep rank's experts). The rectangles' values, read from the global tensor in order,
    are the range's own."""
    import math
    import random
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        full = tuple(s + rng.randint(0, 3) for s in shape)
        origin = tuple(rng.randint(0, f - s) for f, s in zip(full, shape))
        start = rng.randint(0, math.prod(shape) - 1)
        n = rng.randint(1, math.prod(shape) - start)
        g = torch.arange(math.prod(full)).view(full)
        want = g[tuple(slice(o, o + s) for o, s in zip(origin, shape))].reshape(-1)[start: start + n]
        got = torch.full((n,), -1)
        for offsets, sizes, pos in checkpoint.rects(shape, origin, start, n):
            piece = g[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            got[pos: pos + piece.numel()] = piece
        assert torch.equal(got, want), (shape, origin, start, n)


# --- resharding: a chain of runs, each resuming from the one before at the next step, that crosses every strategy
# and every world size, as the saver and as the loader, and every layout checkpoint.py knows: whole tensors (single;
# ddp and zero2 under torch are laid out as ddp and zero1 are), flat ranges (our zero, our fsdp), row/column blocks
# (our tp), both at once (our fsdp_tp), torch's ZeroRedundancyOptimizer, DTensors (torch's fsdp, tp, fsdp_tp), and
# a pipeline's stages (each rank writes its own blocks under single's names)
CHAIN = [("ddp", "scratch", 2), ("zero1", "torch", 4), ("fsdp", "scratch", 1), ("tp", "torch", 2),
         ("fsdp_tp", "scratch", 4), ("zero2", "scratch", 2), ("fsdp", "torch", 2), ("pp", "scratch", 2),
         ("tp", "scratch", 2), ("fsdp_tp", "torch", 4), ("single", None, 1)]


# the gradient norm of each resumed step against single's: about 10x the largest gap measured over the chain
# (2.9e-7, 2026-12-03)
GRAD_NORM_RTOL = 3e-6


def test_resharding_chain_across_strategies_and_world_sizes(tmp_path):
    steps = len(CHAIN) + 1
    base = small_run(f"train.max_steps={steps}", "checkpoint.every=1", f"checkpoint.keep={steps}",
                     "train.eval_every=100", "train.global_batch_size=8", "train.micro_batch_size=2")
    prev = str(tmp_path / "single")
    train.run(make_cfg(*base), prev)
    want, want_norm = step_losses(prev), step_losses(prev, "grad_norm")
    saver = "single, 1 rank"
    for i, (name, impl, world) in enumerate(CHAIN):
        run_dir = str(tmp_path / f"{i}-{name}-{impl}-{world}")
        # the next link resumes from step i + 2: saves at its multiples (and at the end) serve it, and cost less
        # than one every step
        overrides = [*base, f"parallel={name}", f"train.resume={prev}/checkpoints/step_{i + 1:07d}",
                     *([f"parallel.impl={impl}"] if impl else []), f"checkpoint.every={i + 2}"]
        cfg = make_cfg(*overrides)
        if world == 1:
            train.run(cfg, run_dir)
        else:  # ranks forked from this process: torchrun's fresh interpreters cost CI a minute over the chain
            forked(world, lambda: train.run(cfg, run_dir))
        got = step_losses(run_dir)
        assert min(got) == i + 2, (name, sorted(got))
        norms = step_losses(run_dir, "grad_norm")
        for s in got:  # float32 sums in another order: equal to ~1e-6
            assert got[s] == pytest.approx(want[s], abs=2e-5), (name, impl, world, s, got[s], want[s])
            # the resumed weights' and Adam moments' gradient: a shard loaded into the wrong place shows here first
            assert norms[s] == pytest.approx(want_norm[s], rel=GRAD_NORM_RTOL), (name, impl, world, s, norms[s])
        sizes = [os.path.getsize(f) for f in sorted(glob.glob(f"{run_dir}/checkpoints/step_{steps:07d}/*.distcp"))]
        if world > 1:  # every rank wrote its own part; none gathered the model (the largest file is not the lot)
            assert len(sizes) == world and max(sizes) < 0.75 * sum(sizes), (name, impl, sizes)
        here = f"{name}{' ' + impl if impl else ''}, {world} rank{'s' * (world > 1)}"
        worst = max(abs(got[s] - want[s]) for s in got)
        worst_norm = max(abs(norms[s] - want_norm[s]) / want_norm[s] for s in norms)
        print(f"step {i + 1:>2}: {saver:>24} -> {here:<24} max |loss - single| {worst:.1e}, grad_norm "
              f"{worst_norm:.1e} relative   its files (KiB): "
              f"{[round(x / 1024) for x in sizes]}")
        prev, saver = run_dir, here
    # and the chain ends where one process alone would: weights within the cross-strategy tolerance
    assert_same_weights(prev, str(tmp_path / "single"), atol=1e-5, rtol=1e-5)


# --- faults under torchrun: a rank killed with SIGKILL, the job preempted with SIGTERM
# 36 steps: a kill at step 12 lands with 24 to go (60 took these two tests 95 CPU-s against 73, 2026-12-07)
FAULT = small_run("train.max_steps=36", "checkpoint.every=5", "checkpoint.keep=20", "train.eval_every=100",
                  "train.global_batch_size=16", "train.micro_batch_size=2", "parallel=fsdp")


@launch_jobs(2)
def jobs(root, request):
    """The faults' reference, 36 uninterrupted steps on 2 ranks, in the session's world-2 launch."""
    return {"ref2": (str(root / "ref2"), FAULT)}


@pytest.fixture(scope="module")
def ref2(launch2):
    return launch2[__name__][0]["ref2"]


def agent(*args, restarts=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.1", os.path.join(ROOT, "train.py"), *FAULT, *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_step(pattern, step, proc, timeout=180):
    """Poll metrics.jsonl until it records `step`; returns the run dir."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        for path in glob.glob(pattern):
            if max(step_losses(os.path.dirname(path)) or [0]) >= step:
                return os.path.dirname(path)
        time.sleep(0.01)
    raise AssertionError(f"step {step} never came: {proc.communicate()[0][-3000:]}")


def worker(agent_pid, rank):
    """The pid of torchrun's worker process of this rank."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == agent_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} under {agent_pid}")


def test_killed_rank_restarts_from_the_last_checkpoint(ref2, tmp_path):
    """kill -9 of rank 1 at step >= 12 under torchrun --max-restarts=1: the restarted job finds its run dir (the
    same launch time), resumes from the newest checkpoint, and ends with the uninterrupted run's weights."""
    out = tmp_path / "out"
    proc = agent(f"train.out_dir={out}", restarts=1)
    run_dir = wait_for_step(f"{out}/*/*/metrics.jsonl", 12, proc)
    os.kill(worker(proc.pid, 1), signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-5000:]
    assert glob.glob(f"{out}/*/*") == [run_dir]  # one run dir across the restart
    resumed = [r["resumed_from"] for r in read_metrics(run_dir) if "resumed_from" in r]
    assert len(resumed) == 1 and int(resumed[0][-7:]) >= 10, resumed  # from a checkpoint at or after step 10
    assert_identical(run_dir, ref2)


def test_sigterm_under_torchrun_checkpoints_and_resumes(ref2, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = agent(f"hydra.run.dir={run_dir}")
    wait_for_step(f"{run_dir}/metrics.jsonl", 12, proc)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to every worker
    output = proc.communicate(timeout=120)[0]
    last = checkpoint.find(run_dir)
    state = json.load(open(os.path.join(last, "state.json")))
    assert state["preempted"] and state["step"] == max(step_losses(run_dir)) >= 12, output[-3000:]
    assert "SIGTERM: stopped after step" in output
    torchrun(2, run_dir, *FAULT)  # train.resume=auto
    assert_identical(run_dir, ref2)
