"""The planner's step time against measured steps on this machine's CPU: model shapes x layouts, each run for real
(train.py on gloo, the layouts of one world size in one launch: tools/jobs.py) and predicted by tools/plan.py with
plan.gpu=cpu (tools/step_time.py's model on this CPU's measured constants). Prints predicted / measured per run.

    python -m tools.step_bench --out /tmp/sb              # 5 shapes x 4 layouts (single, ddp, fsdp, tp), ~2.5 min
    python -m tools.step_bench --out /tmp/sb --shapes 2   # the first two shapes only

A run's measured step is the median of its logged steps after the first (warm-up) one; the ratio of medians is what
noise leaves steady. Not a test yet: the issue's band of 0.85-1.15 holds for most runs, not all, and a profile's
level moves by up to 8% from one measurement to the next (docs/planning.md).
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
    a = ap.parse_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if not 1 <= a.shapes <= len(SHAPES):
        sys.exit(f"error: --shapes {a.shapes}: expected 1 to {len(SHAPES)}")
    return run(a.out, SHAPES[:a.shapes])


def jobs(root, shapes):
    """{world: [(run dir, overrides, shape name, layout name)]}: each shape under every layout, the odd shapes'
    ddp, fsdp and tp at world 4 too."""
    out = {}
    for i, shape in enumerate(shapes):
        for name, world, layout in LAYOUTS:
            for w in ((world, 4) if i % 2 and world > 1 else (world,)):
                run_dir = os.path.join(root, f"{shape[0]}-{name}-{w}")
                lay = [o.replace("parallel.tp=2", f"parallel.tp={w}") for o in layout]
                out.setdefault(w, []).append((run_dir, overrides(shape, lay, w), shape[0], name))
    return out


def run(out, shapes, log=print):
    sys.path.insert(0, ROOT)
    from tools import jobs as launcher
    from tools.step_time import cpu_profile
    os.makedirs(out, exist_ok=True)
    cpu_profile(log=log)  # measured before the runs, once per machine
    rows, root = [], tempfile.mkdtemp(prefix="step_bench-")
    for world, runs in sorted(jobs(root, shapes).items()):
        t0 = time.time()
        log(f"world {world}: {len(runs)} runs in one launch ...")
        p = launcher.launch(world, [(d, o) for d, o, _, _ in runs], timeout=900)
        if p.returncode:
            sys.exit(f"error: the world-{world} launch failed:\n{p.stderr[-3000:]}")
        for run_dir, _, shape, layout in runs:
            m, pr = measured(run_dir), predicted(run_dir, world)
            rows.append({"shape": shape, "layout": layout, "world": world, "measured_s": m, "predicted_s": pr,
                         "ratio": pr / m})
            log(f"  {shape:22s} {layout:6s} world {world}: measured {m * 1e3:7.1f} ms, predicted {pr * 1e3:7.1f} ms, "
                f"ratio {pr / m:.3f}")
        log(f"world {world}: {time.time() - t0:.0f} s")
    with open(os.path.join(out, "step_bench.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "rows": rows}, f, indent=1)
    with open(os.path.join(out, "step_bench.md"), "w") as f:
        f.write(markdown(rows))
    return rows


def markdown(rows):
    lines = ["| shape | layout | world | measured ms | predicted ms | predicted / measured |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['layout']} | {r['world']} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['predicted_s'] * 1e3:.1f} | {r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
