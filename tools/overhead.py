"""What train.py's loop costs beyond the arithmetic: its training step beside a bare loop over the same model,
batch and optimizer (forward, backward, clipping, AdamW: no logging, counting, checks or schedule), side by side in
one process, eager and compiled, rounds interleaved so that a noisy machine slows every contender alike.

    python -m tools.overhead                               # gpt_tiny, batch 16 x 256, default corpus, 3 rounds
    python -m tools.overhead --rounds 5 --steps 40 -- model.n_layer=2

train.py's figure is its own tokens/s (metrics.jsonl, log windows of `--steps / 4` steps, the first one left out:
it holds warm-up and compilation); the bare loop's is timed the same way over the same windows. Compiled, both
compile what parallel.apply_compile compiles (each block, and the head with the loss); "bare, whole model" compiles
the whole GPT in one graph, for reference. Printed as a markdown table and written into a new folder under --out.
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from data import prepare, shards  # noqa: E402
from model import GPT  # noqa: E402
from tools.bench import markdown  # noqa: E402
from tools.plan import compose  # noqa: E402


def train_py(overrides, steps, run_dir):
    """train.run's median tokens/s over its log windows after the first."""
    cfg = compose([*overrides, "train.eval_every=100000", "train.eval_steps=1", "train.sample_tokens=0",
                   "checkpoint.keep=0", "logger.mode=disabled", f"train.max_steps={steps}",
                   f"train.log_every={steps // 4}"], config_name="config")
    train.run(cfg, run_dir)
    records = [r for r in train_records(run_dir) if "tok_per_s" in r][1:]
    return statistics.median(r["tok_per_s"] for r in records)


def train_records(run_dir):
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def bare(overrides, steps, compile_mode):
    """The same model, batches and AdamW in a plain loop; median tokens/s over the same windows."""
    cfg = compose(overrides, config_name="config")
    t, o = cfg.train, cfg.optim
    data_dir = prepare.prepare(cfg.data, cfg.data.cache_dir, log=lambda *a: None)
    tokens, _, _, meta = prepare.load(data_dir)
    with torch.device("meta"):
        model = GPT(config.model_config(cfg, meta["vocab_size"]))
    torch.manual_seed(t.seed)
    model.to_empty(device="cpu")
    model.init_weights()
    if compile_mode == "blocks":
        parallel.apply_compile(model)
    elif compile_mode == "whole":
        model.compile()
    opt = train.make_optimizer(model, o)
    accum = t.global_batch_size // t.micro_batch_size
    window, rates = steps // 4, []
    t0 = time.time()
    for step in range(1, steps + 1):
        x, y = shards.get_batch(tokens, "train", t.seed, step - 1, t.global_batch_size, t.seq_len, 0, 1)
        for micro in range(accum):
            sl = slice(micro * t.micro_batch_size, (micro + 1) * t.micro_batch_size)
            (model(x[sl], y[sl]) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % window == 0:
            rates.append(window * t.global_batch_size * t.seq_len / (time.time() - t0))
            t0 = time.time()
    return statistics.median(rates[1:])


def counter_cost(calls=20000):
    """Microseconds parallel/comm.py adds to each collective: its wrapper around a function that does nothing but
    has dist.all_reduce's signature, with a counter open, against that function bare; median of 5 interleaved
    rounds. (What a collective itself costs comes on top, counted or not.)"""
    from parallel import comm

    def noop(tensor, op=None, group=None, async_op=False):
        return None
    counted, t = comm._wrap(noop, "all_reduce", "tensor", 2), torch.ones(1)
    costs = []
    with comm.CommCounter():
        for _ in range(5):
            times = []
            for fn in (counted, noop):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(t)
                times.append((time.perf_counter() - t0) / calls)
            costs.append((times[0] - times[1]) * 1e6)
    return statistics.median(costs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per job, in 4 windows (the first is warm-up)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "overhead"), help="results go in a new folder here")
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job (one process: parallel=single)")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 8 or a.steps % 4:
        sys.exit("error: --rounds must be at least 1 and --steps a multiple of 4, at least 8")
    out = os.path.join(a.out, time.strftime("%Y-%m-%d_%H-%M-%S"))
    os.makedirs(out)  # a new folder: never overwrites an earlier measurement
    jobs = {("train.py", "eager"): lambda d: train_py(a.overrides, a.steps, d),
            ("bare", "eager"): lambda d: bare(a.overrides, a.steps, None),
            ("train.py", "compiled"): lambda d: train_py([*a.overrides, "train.compile=true"], a.steps, d),
            ("bare", "compiled"): lambda d: bare(a.overrides, a.steps, "blocks"),
            ("bare, whole model", "compiled"): lambda d: bare(a.overrides, a.steps, "whole")}
    results = {k: [] for k in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for k, fn in jobs.items():
                torch._dynamo.reset()  # every compiled job compiles afresh, as a new run would
                with contextlib.redirect_stdout(open(os.devnull, "w")):
                    results[k].append(fn(os.path.join(tmp, f"{r}-{'-'.join(k).replace(' ', '_')}")))
                print(f"[round {r + 1}/{a.rounds}] {k[0]:18s} {k[1]:9s} {results[k][-1]:10,.0f} tok/s", flush=True)
    def ratio(a, b):  # the median over rounds of each round's ratio: both ran in the same stretch of the round
        return f"{statistics.median(x / y for x, y in zip(results[a], results[b])):.3f}"
    rows = [{"loop": k[0], "mode": k[1], "tok_per_s": round(statistics.median(v)),
             "vs_bare": ratio(k, ("bare", k[1])) if k[0] == "train.py" else "",
             "vs_eager": ratio(k, ("train.py" if k[0] == "train.py" else "bare", "eager")) if k[1] == "compiled"
             else ""} for k, v in results.items()]
    cost = counter_cost()
    text = markdown(rows) + (
        f"\n\nThe communication counter adds {cost:.1f} us of Python to each collective (its wrapper on a no-op with "
        f"a collective's signature, counted vs bare). Overrides: {' '.join(a.overrides) or '(none)'}; {a.rounds} "
        f"round(s) of {a.steps} steps; tok_per_s: the median over rounds of each job's median window; ratios: the "
        f"median of each round's ratio.")
    print("\n" + text)
    with open(os.path.join(out, "overhead.md"), "w") as f:
        f.write(text + "\n")
    print(f"\nwritten: {out}/overhead.md")
    return rows


if __name__ == "__main__":
    main()
