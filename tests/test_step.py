"""The training step's own cost: steps between log steps never wait for the host and issue only the strategy's own
collectives; a profiler trace shows DDP's first bucket all-reduce running while backward still runs."""
import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from conftest import forked, launch_jobs, make_cfg, read_metrics, small_run
from data import shards
from parallel.comm import CommCounter

LOG_EVERY = 3
PROBE_RUN = ("train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6", f"train.log_every={LOG_EVERY}",
             "train.eval_every=100", "checkpoint.keep=0")


class Probe(TorchDispatchMode):
    """Per training step (from one train batch to the next): reads of tensor values on the host (`.item()`,
    `bool()`: aten._local_scalar_dense, what waits for a GPU), and the collectives by (mesh dimension, kind). Reads
    inside torch's optimizer step are left out: they are Adam's `step` counters, which torch keeps on the host so
    that reading them never waits for the device."""

    def __init__(self):
        super().__init__()
        self.steps, self.comm, self.in_optimizer = [], CommCounter(), 0

    def next_step(self):
        self.close()
        self.steps.append({"reads": 0})
        self.comm.reset()

    def close(self):
        if self.steps:
            self.steps[-1]["comm"] = sorted(f"{dim}/{kind}" for dim, kind in self.comm.by_dim)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and self.steps and not self.in_optimizer:
            self.steps[-1]["reads"] += 1
        return func(*args, **(kwargs or {}))


def probed_run(overrides, run_dir, out):
    """train.run under a Probe; rank 0 writes its per-step record to `out` (JSON)."""
    probe = Probe()
    get_batch, adamw_step = shards.get_batch, torch.optim.AdamW.step

    def batch(tokens, split, *args):
        if split == "train":  # the first thing each step does
            probe.next_step()
        return get_batch(tokens, split, *args)

    def step(self, *args, **kwargs):
        probe.in_optimizer += 1
        try:
            return adamw_step(self, *args, **kwargs)
        finally:
            probe.in_optimizer -= 1
    shards.get_batch, torch.optim.AdamW.step = batch, step
    try:
        with probe.comm, probe:
            train.run(make_cfg(*overrides), run_dir)
    finally:
        shards.get_batch, torch.optim.AdamW.step = get_batch, adamw_step
    probe.close()
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(probe.steps, f)


@pytest.mark.parametrize("strategy,world,own", [("single", 1, []), ("ddp", 2, ["dp/all_reduce"]),
                                                ("zero2", 2, ["dp/all_gather", "dp/reduce_scatter"])])
def test_non_log_steps_wait_for_nothing(tmp_path, strategy, world, own):
    """Between log steps: no read of a tensor's value, and no collective but the strategy's own (the gradient
    norm's scalar all-reduce, on the whole mesh, is ZeRO's own too: its gradients are sharded). Log steps do read
    and agree (loss, norm, finiteness, SIGTERM, state accounting): the probe sees them, so it can fail."""
    overrides = small_run(*PROBE_RUN, f"parallel={strategy}")
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "probe.json")
    if world == 1:
        probed_run(overrides, run_dir, out)
    else:
        forked(world, lambda: probed_run(overrides, run_dir, out))
    steps = json.load(open(out))
    assert len(steps) == 6 and [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [3, 6]
    own = own + (["world/all_reduce"] if strategy == "zero2" else [])
    for i, s in enumerate(steps, start=1):
        if i % LOG_EVERY:
            assert s == {"reads": 0, "comm": own}, (i, s)
        else:
            assert s["reads"] > 0 and (world == 1 or "world/all_reduce" in s["comm"]), (i, s)


def test_profile_trace_shows_overlap(tmp_path):
    """train.profile=true writes a Chrome trace of steps 3-5 per rank. In it, on CPU with gloo, our DDP's first
    bucket all-reduce of a step (on gloo's worker thread) runs while backward ops run on the main thread:
    communication overlaps backward in time, not only in launch order."""
    run_dir = str(tmp_path / "run")
    overrides = small_run("train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6",
                          "train.profile=true", "parallel=ddp", "parallel.bucket_mb=0.02", "model.n_layer=4",
                          "model.n_embd=128", "checkpoint.keep=0")
    forked(2, lambda: train.run(make_cfg(*overrides), run_dir))
    assert os.path.exists(os.path.join(run_dir, "trace_rank1.json"))
    events = [e for e in json.load(open(os.path.join(run_dir, "trace.json")))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert len(steps) == 3, [e["name"] for e in steps]
    backward = [e for e in events if e["name"].startswith("autograd::engine::evaluate_function")]
    overlapped = 0
    for step in steps:
        inside = lambda e: step["ts"] <= e["ts"] < step["ts"] + step["dur"]  # noqa: E731
        bwd = sorted((e for e in backward if inside(e)), key=lambda e: e["ts"])
        # the step's first all-reduce after backward began: the first bucket's (the head's gradients)
        first = min((e for e in events if e["name"] == "gloo:all_reduce" and inside(e) and e["ts"] > bwd[0]["ts"]),
                    key=lambda e: e["ts"])
        # backward ops on another thread whose time intersects the all-reduce's
        running = [b for b in bwd if b["ts"] < first["ts"] + first["dur"] and b["ts"] + b["dur"] > first["ts"]
                   and b["tid"] != first["tid"]]
        overlapped += bool(running)
        print(f"{step['name']}: first bucket all-reduce {first['dur']:.0f} us, {len(running)} backward ops ran "
              f"while it ran")
    assert overlapped == len(steps)


COMPILED = ["ddp", "zero2", "fsdp", "tp"]


@launch_jobs(2)
def jobs(root, request):
    """Each compiled strategy on test_matrix.py's model at world 2, in the session's world-2 launch, its graphs and
    dynamo's counters recorded (tests/launch_ranks.py, `@compiled`)."""
    from test_matrix import base
    return {s: (str(root / f"{s}@compiled"), [*base(2), f"parallel={s}", "train.compile=true"]) for s in COMPILED}


def test_training_steps_run_compiled(tmp_path, launch2):
    """train.compile=true: every micro-step's loss comes through n_layer + 1 compiled graphs (each block and the
    head with the loss; under tensor parallel, each block's attention and MLP: 2 n_layer), every frame dynamo saw
    compiled (none fell back to eager) with no graph break, and the losses and gradient norms track eager
    parallel=single's within 1e-5 relative (inductor fuses, so the float32 rounding differs: up to 2e-7 seen), for
    single and, at world 2, our ddp, zero2, fsdp and tp. On tests/test_matrix.py's model (its compiled cases prove
    every strategy equal to single): most of these graphs are in inductor's cache by then."""
    from conftest import assert_same_steps, losses
    from launch_ranks import compiled
    from test_matrix import STEPS, base
    model = base(2)
    runs = {"eager": str(tmp_path / "eager"), "single": str(tmp_path / "single"), **launch2[__name__][0]}
    train.run(make_cfg(*model), runs["eager"])
    with compiled(runs["single"]):
        train.run(make_cfg(*model, "train.compile=true"), runs["single"])
    assert sorted(runs) == sorted(["eager", "single", *COMPILED])
    for name, run_dir in runs.items():
        if name == "eager":
            continue
        with open(os.path.join(run_dir, "compiled.json")) as f:
            r = json.load(f)
        accum = read_metrics(run_dir)[0]["grad_accum"]
        assert len(losses(run_dir)) == STEPS, name
        # every micro-step: 2 blocks + the loss; under tensor parallel 2 attentions + 2 MLPs
        assert r["backward"] == [2 + 1 if name != "tp" else 4] * (STEPS * accum), (name, r["backward"])
        assert r["frames"]["total"] == r["frames"]["ok"] > 0 and r["graph_breaks"] == 0, (name, r)
        assert_same_steps(run_dir, runs["eager"], rtol=1e-5)
        print(f"{name}: {r['frames']['ok']} frames compiled, largest loss gap to eager single "
              f"{float(((losses(run_dir) - losses(runs['eager'])).abs() / losses(runs['eager'])).max()):.1e}")
