"""parallel=auto's pick against the candidates it ranked, measured on this machine's CPU: the planner ranks every
candidate for `--world` CPU ranks (tools/plan.py auto_rows, this CPU's measured profile); the pick (run as
`parallel=auto` itself, so the run picks for itself) and a spread of the others (the best-predicted setting of each
layout, evenly over the predicted order) train side by side in one launch (tools/jobs.py); the measured tokens/s of
each sit beside the prediction, and the pick's against the best measured.

    python -m tools.auto_bench --out /tmp/ab                              # gpt_125m on 4 ranks, 6 x 2 runs, ~20 min
    python -m tools.auto_bench --out /tmp/ab --runs 4 model=gpt_tiny      # any train.py override after the flags

A run's measured step is the median of its logged steps after the first (warm-up) one (tools/step_bench.py). Every
candidate runs once per round, the rounds in turn forward and backward through the list, and keeps its fastest
round: this project's VMs slow down by 30-60% for minutes at a time, and a slowdown only ever makes a run slower.
(One round on 2026-12-07 read the pick at 0.814 of the best; the two run again side by side, twice each, were
level: 234 against 231 tokens/s.) Writes auto_bench.json and .md to --out.
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
    ap.add_argument("--runs", type=int, default=6, help="candidates measured, the pick included (6)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each candidate, keeping its fastest (2)")
    a, overrides = ap.parse_known_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if min(a.world, a.runs, a.rounds) < 1:
        sys.exit(f"error: --world {a.world}, --runs {a.runs} and --rounds {a.rounds} must be at least 1")
    return run(a.out, a.world, a.runs, overrides or ["model=gpt_125m"], rounds=a.rounds)


def order(n, rounds):
    """(round, candidate) in the order they run: forward through the candidates, then backward, and so on, so that
    no candidate always runs at the same point of the launch."""
    return [(k, i) for k in range(rounds) for i in (range(n) if k % 2 == 0 else reversed(range(n)))]


def run(out, world, n, overrides, log=print, rounds=1):
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
    settings = [[*overrides, *RUN, "parallel=auto"]] + [[*overrides, *RUN, *plan.auto_overrides(r)] for r in chosen[1:]]
    names = ["auto"] + [r["layout"].name for r in chosen[1:]]
    runs = order(len(chosen), rounds)
    jobs = [(os.path.join(root, f"r{k}-{i}-{names[i]}"), settings[i]) for k, i in runs]
    log(f"{len(rows)} candidates fit on {world} CPU ranks; measuring {len(chosen)} of them, {rounds} round(s) of "
        f"{STEPS} steps each, in one launch of {len(jobs)} runs ...")
    t0, limit = time.time(), 3600 * rounds
    started, seen = launcher.start(world, jobs), []

    def progress():  # a line per run as it ends
        for d in started.done()[len(seen):]:
            seen.append(d)
            log(f"  {len(seen)}/{len(jobs)} {os.path.basename(d)} ({time.time() - t0:.0f} s)")
    while started.proc.poll() is None and time.time() - t0 < limit:
        time.sleep(1)
        progress()
    progress()
    p = started.finish(timeout=max(1.0, limit - (time.time() - t0)))
    if p.returncode:
        sys.exit(f"error: the launch failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(jobs[0][0], "metrics.jsonl")) as f:
        picked = json.loads(f.readline())
    rates = [[0.0] * rounds for _ in chosen]
    for (k, i), (run_dir, _) in zip(runs, jobs):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            tokens = json.loads(f.readline())["tokens_per_step"]
        rates[i][k] = tokens / measured(run_dir)
    results = [{**plan.row_record(r), "measured_tok_per_s": max(rs), "rounds_tok_per_s": rs}
               for r, rs in zip(chosen, rates)]
    best = max(x["measured_tok_per_s"] for x in results)
    for x in results:
        x["of_best"] = x["measured_tok_per_s"] / best
    summary = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "world": world, "overrides": overrides,
               "candidates_fit": len(rows), "picked": picked["parallel"],
               "picked_overrides": picked["auto"]["overrides"], "pick_of_best": results[0]["of_best"], "rounds": rounds,
               "rows": results, "seconds": time.time() - t0}
    with open(os.path.join(out, "auto_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(os.path.join(out, "auto_bench.md"), "w") as f:
        f.write(text)
    log(text)
    return summary


def markdown(s):
    lines = [f"parallel=auto on {s['world']} CPU ranks ({' '.join(s['overrides'])}), {s['date']}, {s['cores']} cores: "
             f"{s['candidates_fit']} candidates fit; the pick's measured tokens/s (the fastest of {s['rounds']} "
             f"round(s)) is {s['pick_of_best']:.3f} of the best measured", "",
             "| # | parallel | layout | micro | AC | schedule | predicted tok/s | measured tok/s (each round) | "
             "of best measured |",
             "|---|---|---|---:|---|---|---:|---:|---:|"]
    for i, r in enumerate(s["rows"]):
        lines.append(f"| {'pick' if i == 0 else i} | {r['parallel']} | {r['layout']} | {r['micro_batch_size']} | "
                     f"{r['activation_checkpointing']} | {r['pp_schedule'] or '-'} | {r['tok_per_s']:,.0f} | "
                     f"{r['measured_tok_per_s']:,.0f} ({', '.join(f'{x:,.0f}' for x in r['rounds_tok_per_s'])}) | "
                     f"{r['of_best']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
