"""The planner's step time against measured steps on this machine's CPU: model shapes x layouts, each run for real
(train.py on gloo, the layouts of one world size in one launch: tools/jobs.py) and predicted by tools/plan.py with
plan.gpu=cpu (tools/step_time.py's model on this CPU's measured constants). Prints predicted / measured per run.

    python -m tools.step_bench --out /tmp/sb              # 5 shapes x 4 layouts (single, ddp, fsdp, tp), ~3 min
    python -m tools.step_bench --out /tmp/sb --shapes 2   # the first two shapes only
    python -m tools.step_bench --out /tmp/sb --retries 2  # runs outside 0.85-1.15 again, keeping the fastest

A run's measured step is the median of its logged steps after the first (warm-up) one. This VM's speed moves by
10-35% over minutes (other tenants), so each launch is priced on the profile relevelled to the speed probed
around it (tools/step_time.py probe, relevel), and each launch opens with a short unmeasured run (the first run
of a process read slow). tests/test_step_time.py test_step_time_on_this_cpu is this at world 1 and 2 with
--retries 2.
Writes step_bench.json and .md to --out.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, model overrides, sequence length, micro-batch): GELU and SwiGLU, MHA and GQA, widths 128-384, 64-512 tokens
SHAPES = [("d128-L4", ["model.n_embd=128", "model.n_head=4", "model.n_layer=4"], 256, 8),
          ("d256-L2-swiglu-gqa", ["model.n_embd=256", "model.n_head=8", "model.n_kv_head=4", "model.n_layer=2",
                                  "model.mlp=swiglu"], 128, 8),
          ("d192-L3", ["model.n_embd=192", "model.n_head=6", "model.n_layer=3"], 512, 2),
          ("d384-L2", ["model.n_embd=384", "model.n_head=4", "model.n_layer=2"], 64, 16),
          ("d128-L6-swiglu", ["model.n_embd=128", "model.n_head=2", "model.n_layer=6", "model.mlp=swiglu"], 256, 4)]
# (layout name, world, overrides): every layout at world 2 and again at 4 where the shape's index is odd
LAYOUTS = [("single", 1, ["parallel=single"]), ("ddp", 2, ["parallel=ddp"]), ("fsdp", 2, ["parallel=fsdp"]),
           ("tp", 2, ["parallel=tp", "parallel.tp=2"])]
STEPS = 6


def corpus():
    """A few hundred KB of real Python (the standard library's json and email packages): no download."""
    import sysconfig
    stdlib = sysconfig.get_paths()["stdlib"]
    return "[" + ",".join(os.path.join(stdlib, p, "*.py") for p in ("json", "email")) + "]"


def overrides(shape, layout, world, steps=STEPS):
    name, model, seq, micro = shape
    return ["data=text", f"data.paths={corpus()}", "data.vocab_size=512", "data.num_proc=1",
            f"train.seq_len={seq}", f"model.block_size={seq}", *model, f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * world}", f"train.max_steps={steps}", "train.log_every=1",
            "train.eval_every=1000", "train.eval_steps=1", "train.sample_tokens=0", "checkpoint.keep=0",
            "logger.mode=disabled", *layout]


def measured(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "step_time_s" in r]
    return statistics.median(r["step_time_s"] for r in steps[1:])


def predicted(run_dir, world):
    from omegaconf import OmegaConf
    from tools import plan
    cluster = OmegaConf.create({"world": world, "gpu": "cpu", "gpus_per_node": world, "link": "pcie",
                                "network": "infiniband", "compute_efficiency": None, "link_efficiency": 1.0,
                                "usable_memory": 0.9, "rank": False})
    return plan.predict_run(run_dir, cluster)["step_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new (or empty) folder for step_bench.json and .md")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help=f"the first N shapes (1-{len(SHAPES)})")
    ap.add_argument("--retries", type=int, default=0,
                    help="run a run outside 0.85-1.15 again up to N times, keeping its fastest (the test's: 2)")
    a = ap.parse_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if not 1 <= a.shapes <= len(SHAPES):
        sys.exit(f"error: --shapes {a.shapes}: expected 1 to {len(SHAPES)}")
    if a.retries < 0:
        sys.exit(f"error: --retries {a.retries}: expected 0 or more")
    return run(a.out, SHAPES[:a.shapes], retries=a.retries)


def jobs(root, shapes, worlds=(1, 2, 4)):
    """{world: [(run dir, overrides, shape name, layout name)]}: each shape under every layout, the odd shapes'
    ddp, fsdp and tp at world 4 too (where `worlds` has 4)."""
    out = {}
    for i, shape in enumerate(shapes):
        for name, world, layout in LAYOUTS:
            for w in ((world, 4) if i % 2 and world > 1 else (world,)):
                if w not in worlds:
                    continue
                run_dir = os.path.join(root, f"{shape[0]}-{name}-{w}")
                lay = [o.replace("parallel.tp=2", f"parallel.tp={w}") for o in layout]
                out.setdefault(w, []).append((run_dir, overrides(shape, lay, w), shape[0], name))
    return out


def run(out, shapes, log=print, worlds=(1, 2, 4), profile_path=None, retries=0):
    """Measures this CPU's profile (at `profile_path`, default the cache's, where it is read if there), then each
    world's runs (measure). Writes step_bench.json and .md to `out`; returns the rows."""
    sys.path.insert(0, ROOT)
    from tools import step_time
    os.makedirs(out, exist_ok=True)
    multi = tuple(w for w in worlds if w > 1)
    if profile_path:  # a profile of its own: float32 (every run here) and the worlds run, measured now
        profile = step_time.cpu_profile(profile_path, refresh=True, log=log, dtypes=("float32",), worlds=multi)
    else:
        profile = step_time.cpu_profile(log=log)  # measured before the runs, once per machine
    rows = measure(jobs(tempfile.mkdtemp(prefix="step_bench-"), shapes, worlds), profile, log, retries=retries)
    with open(os.path.join(out, "step_bench.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "rows": rows}, f, indent=1)
    with open(os.path.join(out, "step_bench.md"), "w") as f:
        f.write(markdown(rows))
    return rows


def measure(runs, profile, log=print, band=(0.85, 1.15), retries=0):
    """Each world's runs ({world: [(run dir, overrides, shape, layout)]}, as jobs() gives them) in one launch, the
    machine's speed probed before and after it (tools/step_time.py probe); the launch's runs priced on `profile`
    relevelled to the mean of its two probes. A run whose predicted / measured lies outside `band` runs again, up to
    `retries` times, and keeps its fastest measurement: other tenants' load only ever slows a run. Returns a row
    per run."""
    rows = {r["run_dir"]: r for r in _measure(runs, profile, log)}
    for attempt in range(1, retries + 1):
        outside = {d for d, r in rows.items() if not band[0] <= r["ratio"] <= band[1]}
        if not outside:
            break
        log(f"again ({attempt} of {retries}): {len(outside)} runs outside {band[0]}-{band[1]}")
        again = {w: [(f"{d}-again{attempt}", *rest) for d, *rest in these if d in outside] for w, these in runs.items()}
        for r in _measure({w: t for w, t in again.items() if t}, profile, log):
            first = r["run_dir"].rsplit("-again", 1)[0]
            if r["measured_s"] < rows[first]["measured_s"]:
                rows[first] = r
    return list(rows.values())


def _measure(runs, profile, log):
    from tools import jobs as launcher
    from tools import step_time
    rows, multi = [], tuple(w for w in runs if w > 1)
    for world, these in sorted(runs.items()):
        t0 = time.time()
        log(f"world {world}: {len(these)} runs in one launch ...")
        before = step_time.probe(multi)
        # a short run first, unmeasured: the first run of a launch read up to 35% slow (2026-12-07, d128-L4 single
        # and DDP, each first in its launch: 312 and 338 ms against 233-241 and 255-265 measured elsewhere)
        warmup = (os.path.join(os.path.dirname(these[0][0]), f"warmup-{world}-{os.path.basename(these[0][0])}"),
                  [o if not o.startswith("train.max_steps=") else "train.max_steps=2" for o in these[0][1]])
        p = launcher.launch(world, [warmup] + [(d, o) for d, o, _, _ in these], timeout=900)
        if p.returncode:
            sys.exit(f"error: the world-{world} launch failed:\n{p.stderr[-3000:]}")
        now = {k: (before[k] * v) ** 0.5 for k, v in step_time.probe(multi).items()}
        level = profile["probe"]["1"] / now["1"]
        # what the planner reads in this process (step_time.device: the cache's path) while these runs are priced
        step_time._PROFILES[step_time.profile_path()] = step_time.relevel(profile, now)
        try:
            for run_dir, _, shape, layout in these:
                m, pr = measured(run_dir), predicted(run_dir, world)
                rows.append({"shape": shape, "layout": layout, "world": world, "measured_s": m, "predicted_s": pr,
                             "ratio": pr / m, "level": level, "run_dir": run_dir})
                log(f"  {shape:22s} {layout:6s} world {world}: measured {m * 1e3:7.1f} ms, predicted "
                    f"{pr * 1e3:7.1f} ms, ratio {pr / m:.3f}")
        finally:
            step_time._PROFILES.pop(step_time.profile_path())  # read from its file again
        log(f"world {world}: {time.time() - t0:.0f} s, the machine at {level:.2f} of its speed in the profile")
    return rows


def markdown(rows):
    lines = ["| shape | layout | world | measured ms | predicted ms | predicted / measured |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['layout']} | {r['world']} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['predicted_s'] * 1e3:.1f} | {r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
