"""parallel=auto's pick against the candidates it ranked, measured on this machine's CPU: the planner ranks every
candidate for `--world` CPU ranks (tools/plan.py auto_rows, this CPU's measured profile); the pick (run as
`parallel=auto` itself, so the run picks for itself) and a spread of the others (the best-predicted setting of each
layout, evenly over the predicted order) train side by side in one launch (tools/jobs.py); the measured tokens/s of
each sit beside the prediction, and the pick's against the best measured.

    python -m tools.auto_bench --out /tmp/ab                              # gpt_125m on 4 ranks, 8 runs, ~10 min
    python -m tools.auto_bench --out /tmp/ab --runs 4 model=gpt_tiny      # any train.py override after the flags

A run's measured step is the median of its logged steps after the first (warm-up) one (tools/step_bench.py).
Writes auto_bench.json and .md to --out.
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
RUN = [f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=1000", "train.eval_steps=1",
       "train.sample_tokens=0", "checkpoint.keep=0", "logger.mode=disabled", "train.device=cpu"]


def spread(rows, n):
    """The rows to measure: rows[0] (the pick), then the best-predicted row of each other layout, n - 1 of them
    evenly over their predicted order (the first and the last included)."""
    best, seen = [], {(rows[0]["layout"].name, rows[0]["layout"].describe())}
    for r in rows[1:]:
        key = (r["layout"].name, r["layout"].describe())
        if key not in seen:
            seen.add(key)
            best.append(r)
    k = min(n - 1, len(best))
    return [rows[0]] + ([best[round(i * (len(best) - 1) / max(1, k - 1))] for i in range(k)] if k else [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new (or empty) folder for auto_bench.json and .md")
    ap.add_argument("--world", type=int, default=4, help="CPU ranks (4)")
    ap.add_argument("--runs", type=int, default=8, help="candidates measured, the pick included (8)")
    a, overrides = ap.parse_known_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if a.world < 1 or a.runs < 1:
        sys.exit(f"error: --world {a.world} and --runs {a.runs} must be at least 1")
    return run(a.out, a.world, a.runs, overrides or ["model=gpt_125m"])


def run(out, world, n, overrides, log=print):
    sys.path.insert(0, ROOT)
    import config
    from tools import jobs as launcher
    from tools import plan
    from tools.step_bench import measured
    cfg = plan.compose([*overrides, *RUN, "parallel=auto"], "config")
    try:
        config.validate(cfg)
        config.run_rules(cfg)
        cfg.train.dtype = config.device_and_dtype(cfg.train)[1]
        cluster = plan.cluster(cfg, world, "cpu")
        rows = [r for r in plan.auto_rows(cfg, plan.model_shape(cfg), cluster)[0] if r["fits"]]
    except config.ConfigError as e:
        sys.exit(f"error: {e}")
    if not rows:
        sys.exit(f"error: no candidate fits on {world} CPU ranks")
    chosen = spread(rows, n)
    os.makedirs(out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="auto_bench-")
    jobs = [(os.path.join(root, "0-auto"), [*overrides, *RUN, "parallel=auto"])]
    jobs += [(os.path.join(root, f"{i}-{r['layout'].name}"), [*overrides, *RUN, *plan.auto_overrides(r)])
             for i, r in enumerate(chosen[1:], 1)]
    log(f"{len(rows)} candidates fit on {world} CPU ranks; measuring {len(jobs)} of them, {STEPS} steps each, in one "
        f"launch ...")
    t0 = time.time()
    p = launcher.launch(world, jobs, timeout=3600)
    if p.returncode:
        sys.exit(f"error: the launch failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(jobs[0][0], "metrics.jsonl")) as f:
        picked = json.loads(f.readline())
    results = []
    for (run_dir, _), r in zip(jobs, chosen):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            tokens = json.loads(f.readline())["tokens_per_step"]
        results.append({**plan.row_record(r), "measured_tok_per_s": tokens / measured(run_dir)})
    best = max(x["measured_tok_per_s"] for x in results)
    for x in results:
        x["of_best"] = x["measured_tok_per_s"] / best
    summary = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "world": world, "overrides": overrides,
               "candidates_fit": len(rows), "picked": picked["parallel"], "picked_overrides": picked["auto"]["overrides"],
               "pick_of_best": results[0]["of_best"], "rows": results, "seconds": time.time() - t0}
    with open(os.path.join(out, "auto_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(os.path.join(out, "auto_bench.md"), "w") as f:
        f.write(text)
    log(text)
    return summary


def markdown(s):
    lines = [f"parallel=auto on {s['world']} CPU ranks ({' '.join(s['overrides'])}), {s['date']}, {s['cores']} cores: "
             f"{s['candidates_fit']} candidates fit; the pick's measured tokens/s is {s['pick_of_best']:.3f} of the "
             f"best measured", "",
             "| # | parallel | layout | micro | AC | schedule | predicted tok/s | measured tok/s | of best measured |",
             "|---|---|---|---:|---|---|---:|---:|---:|"]
    for i, r in enumerate(s["rows"]):
        lines.append(f"| {'pick' if i == 0 else i} | {r['parallel']} | {r['layout']} | {r['micro_batch_size']} | "
                     f"{r['activation_checkpointing']} | {r['pp_schedule'] or '-'} | {r['tok_per_s']:,.0f} | "
                     f"{r['measured_tok_per_s']:,.0f} | {r['of_best']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
