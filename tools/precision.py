"""bf16 against float32, every strategy, ours beside torch's: model state, communication and loss, measured.

    python -m tools.precision                         # world 2, gpt_tiny on the default corpus, 60 steps
    python -m tools.precision --steps 200 -- model=gpt_125m data=text data.paths=[my.txt]

Every strategy trains twice from the same seed: train.dtype=float32, and train.dtype=bfloat16 with the default
parallel.param_dtype=auto (bf16 working weights where the strategy keeps a working copy: ZeRO and FSDP, ours; FSDP2's
MixedPrecisionPolicy, torch's; everyone else computes under autocast from its fp32 weights). All jobs of one world
size run in one torchrun launch (tools/jobs.py). Two markdown tables, printed and written under --out:
- state and communication per rank, in bytes per parameter, measured (state_bytes_max, comm_bytes of the last
  step), beside the planner's for the bf16 run's own config;
- loss: the last step's loss in each dtype and the largest relative difference of the per-step loss and grad_norm.
"""
import argparse
import json
import os
import sys
import time

from tools import bench, jobs, plan

STRATEGIES = [("single", None)] + [(s, i) for s in ("ddp", "zero1", "zero2", "fsdp", "tp") for i in ("scratch", "torch")]


def overrides(strategy, impl, dtype, steps, extra):
    return [*bench.DEFAULTS, f"train.max_steps={steps}", "train.log_every=1", f"parallel={strategy}",
            *([f"parallel.impl={impl}"] if impl else []), f"train.dtype={dtype}", *extra]


def read(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return records[0], [r for r in records if "loss" in r and "grad_norm" in r]


def max_rel(a, b, key):
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=os.path.join("outputs", "precision"))
    ap.add_argument("extra", nargs="*", help="train.py overrides for every job (after --)")
    a = ap.parse_args(argv)
    if a.world < 2 or a.steps < 1:
        sys.exit("error: --world must be at least 2 (the strategies need several ranks) and --steps at least 1")
    out = os.path.abspath(os.path.join(a.out, time.strftime("%Y-%m-%d_%H-%M-%S")))
    if os.path.exists(out):
        sys.exit(f"error: {out} exists; nothing written")
    dirs = {(s, i, d): os.path.join(out, "runs", f"{s}-{i or 'single'}-{d}")
            for s, i in STRATEGIES for d in ("float32", "bfloat16")}
    for world in (1, a.world):
        batch = [(dirs[k], overrides(*k, a.steps, a.extra)) for k in dirs if (k[0] == "single") == (world == 1)]
        print(f"{len(batch)} jobs on {world} rank(s) ...", flush=True)
        p = jobs.launch(world, batch)
        if p.returncode:
            sys.exit(f"error: the launch on {world} rank(s) failed:\n{p.stderr[-3000:]}")
    state_rows = ["| strategy | impl | working weights (bf16 run) | state B/param fp32 | bf16 | planned bf16 | "
                  "comm B/param fp32 | bf16 | planned bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    loss_rows = ["| strategy | impl | final loss fp32 | bf16 | max rel. diff loss | max rel. diff grad_norm |",
                 "|---|---|---|---|---|---|"]
    for s, i in STRATEGIES:
        (start32, steps32), (start16, steps16) = (read(dirs[s, i, d]) for d in ("float32", "bfloat16"))
        P, last32, last16 = start16["n_params"], steps32[-1], steps16[-1]
        planned = plan.predict_run(dirs[s, i, "bfloat16"])
        state_rows.append(f"| {s} | {i or '-'} | {start16['param_dtype']} | {last32['state_bytes_max'] / P:.2f} | "
                          f"{last16['state_bytes_max'] / P:.2f} | {planned['state'] / P:.2f} | "
                          f"{last32['comm_bytes'] / P:.2f} | {last16['comm_bytes'] / P:.2f} | "
                          f"{planned['comm_total'] / P:.2f} |")
        loss_rows.append(f"| {s} | {i or '-'} | {last32['loss']:.4f} | {last16['loss']:.4f} | "
                         f"{max_rel(steps16, steps32, 'loss'):.1e} | {max_rel(steps16, steps32, 'grad_norm'):.1e} |")
    head = (f"{a.steps} steps, world {a.world}, {start16['device']}, {P / 1e6:.2f}M parameters, "
            f"{time.strftime('%Y-%m-%d')} (planned: tools/plan.py for the bf16 run's config; the planner models ours)")
    text = "\n".join([head, "", *state_rows, "", *loss_rows])
    print(text)
    with open(os.path.join(out, "precision.md"), "w") as f:
        f.write(text + "\n")
    print(f"written: {os.path.join(out, 'precision.md')}")


if __name__ == "__main__":
    main(sys.argv[1:])
