"""Measure one CUDA GPU in one short, unattended run (under 8 minutes with the default --budget): its bf16 matmul
rate, then tokens/s, MFU, peak memory and the share of step time outside the model's kernels for gpt_125m and
gpt_350m training in six modes: parallel=single, a one-rank parallel=fsdp (ours) and a one-rank FSDP2
(parallel.impl=torch), each eager and torch.compile. One-rank FSDP has nothing to shard: its rows are what the
machinery costs by itself. Writes gpu_bench.md and gpu_bench.json into --out, after every job.

    python -m tools.gpu_bench --out results/                 # on a machine with one CUDA GPU
    python -m tools.gpu_bench --device cpu --tiny --out /tmp/gb   # the same logic on a CPU, in under a minute

Design choices:
- Each row is a real `torchrun --nproc_per_node=1 train.py` job (tools/bench.py's run_one), bf16 autocast,
  sequences of 1024, the GPT-2 vocab, no gradient accumulation. Its tokens/s is the median of its timing windows
  after the first (warm-up, compilation and the profiler's export all fall in the first).
- MFU is the model's FLOPs per token (model.flops_per_token) x tokens/s, over the datasheet's dense bf16 peak
  (tools/plan.py GPUS) and over the 8192^3 matmul rate measured here first.
- Peak memory is the CUDA caching allocator's: max allocated and max reserved, GB (on a CPU: peak RSS, no reserved).
- Overhead: every job runs with train.profile=true, a torch.profiler trace of steps 2-4 (metrics.py). Over
  those steps' wall time: `outside_kernels` is the share when no kernel ran on the GPU; `launch`, `sync` and
  `python` are shares of the host's time in kernel launch calls, in synchronize calls, and outside any torch op
  (the interpreter, hooks, the loop). They say where the host's time goes, not which of it the GPU waited for: a
  GPU that is the bottleneck fills the launch queue, and launches then block on it. On a CPU there are no kernels:
  the ops run on the host, so `outside_kernels` is the time outside any op, the same as `python`.
- Time: each job is given its share of what is left of --budget (compiled jobs weigh COMPILE_WEIGHT eager ones);
  eager rows run first, since compilation is what may run out of time. A job that fails or overruns its share says
  so in its row (an overrun keeps the timing windows it had logged), and the rest still run.
- Data: offline. tinyshakespeare tokenized with GPT-2's BPE from `<shared>/tiktoken_cache` (--shared, else shared/
  in the checkout, else ../shared beside it), before the jobs, into the data cache every job then reads.
- --tiny: a 2-layer model, float32, fewer steps, eager rows only (compiling on a CPU takes minutes): the logic.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from metrics import peak_flops
from tools import bench

ROOT = bench.ROOT
# Micro-batch per model, sequences of 1024 (= the global batch: no accumulation). The planner (python -m tools.plan
# model=... plan.gpu=h200 train.seq_len=1024) gives 39 GB for gpt_125m at 64 and 44 GB for gpt_350m at 32, Adam
# state included; a count by hand that keeps eager's fp32 layer-norm outputs and fp32 logits (50304 x 4 bytes per
# token, again for their gradient) gives about 66 and 57 GB. Either way under half of the H200's 141 GB, room for
# FSDP's copies and the allocator's fragmentation; doubling passes the planner (75-85 GB) but not the count by
# hand (115-130 GB). The peak columns say whether the next run can double.
MODELS = {"gpt_125m": 64, "gpt_350m": 32}
# (parallel, impl, compile): eager first
MODES = [(p, i, c) for c in (False, True) for p, i in (("single", None), ("fsdp", "scratch"), ("fsdp", "torch"))]
# A compiled job's share of the budget, in eager jobs'. Guessed, not yet measured: an eager job ~20 s (start, CUDA
# and the model, 25 steps of 0.2-0.4 s, the trace); compiling adds one block's and the loss's graphs, training and
# step 0's no-grad evaluation: ~30-60 s cold, less once Inductor's on-disk cache holds them (a model's later modes).
COMPILE_WEIGHT = 2.5
MIN_SHARE = 10  # seconds: less than a job needs to start (torchrun, imports, the model, step 0's evaluation)
# 25 steps: the first window of 5 holds warm-up, compilation and the profiler (steps 2-4, written at 5); 4 after it
STEPS = ["train.seq_len=1024", "train.max_steps=25", "train.log_every=5"]
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32", "train.seq_len=32",
        "train.max_steps=6", "train.log_every=2", "train.dtype=float32"]
CORPUS, TIKTOKEN = os.path.join("data", "tinyshakespeare.txt"), "tiktoken_cache"
NEEDS = ("hydra", "omegaconf", "wandb", "datasets", "tiktoken", "tqdm")  # what train.py and the data step import


def matmul_flops(device, dtype, n=8192, iters=50):
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs each), after a warm-up, timed over `iters` back to back."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    rate = 2 * n ** 3 * iters / (time.perf_counter() - t0)
    del a, b
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the jobs are other processes: hand them this one's cached blocks
    return rate


def find_shared(given):
    """The folder holding data/tinyshakespeare.txt and tiktoken_cache/, or None."""
    for d in [given] if given else [os.path.join(ROOT, "shared"), os.path.join(os.path.dirname(ROOT), "shared")]:
        if os.path.isfile(os.path.join(d, CORPUS)) and os.path.isdir(os.path.join(d, TIKTOKEN)):
            return os.path.abspath(d)
    return None


def prepare_data(shared):
    """Tokenize the corpus, offline, in this process, into data.cache_dir ($NANOPARALLEL_CACHE or
    ~/.cache/nanoparallel; once per machine); the overrides that make every job read that cache."""
    from hydra import compose, initialize_config_dir

    from data import prepare
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(shared, TIKTOKEN)  # the jobs inherit it
    data = ["data=text", f"data.paths=[{os.path.join(shared, CORPUS)}]", "data.tokenizer=gpt2",
            "data.num_proc=1"]  # one process: 1 MB of text takes seconds
    with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):  # composed as train.py's would be
        dcfg = compose("config", overrides=data).data
    prepare.prepare(dcfg, dcfg.cache_dir, log=lambda *a: None)
    return data


def union(intervals, lo, hi):
    """Length of the union of (start, end) intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def trace_shares(path):
    """From a torch.profiler Chrome trace: shares of the profiled steps' wall time (see the module's docstring)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]  # host
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    wall = hi - lo

    def spans(keep):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if keep(e)]

    def runtime(word):
        return lambda e: e.get("cat") in ("cuda_runtime", "cuda_driver") and word in e["name"]

    kernels = spans(lambda e: e.get("cat") == "kernel")
    host_ops = spans(lambda e: e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"))  # every thread's
    busy = kernels if kernels else host_ops  # a CPU: the ops are the device's work
    return {"outside_kernels": 1 - union(busy, lo, hi) / wall,
            "launch": union(spans(runtime("Launch")), lo, hi) / wall,
            "sync": union(spans(runtime("Synchronize")), lo, hi) / wall,
            "python": 1 - union(host_ops, lo, hi) / wall}


def cut_short(run_dir):
    """A job stopped at its share: run_one's (first record, median tokens/s, last record) from the timing windows it
    had logged after the first, and how many; None if it logged none."""
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:  # the line it was writing when it was stopped
                pass
    windows = [r for r in records if "tok_per_s" in r][1:]
    return ((records[0], statistics.median(r["tok_per_s"] for r in windows), windows[-1]), len(windows)) \
        if windows else None


def measure(result, run_dir, peak, measured):
    """A row's numbers from run_one's (first record, median tokens/s, last record) and the job's trace (none if it
    was stopped before writing it)."""
    start, tok_s, last = result
    try:
        shares = trace_shares(os.path.join(run_dir, "trace.json"))
    except (OSError, ValueError):
        shares = dict.fromkeys(("outside_kernels", "launch", "sync", "python"))
    flops = start["flops_per_token"] * tok_s
    gb = lambda mb: None if mb is None else mb * 2**20 / 1e9  # noqa: E731
    return {"tok_per_s": tok_s, "mfu": flops / peak if peak else None, "mfu_vs_matmul": flops / measured,
            "step_ms": start["tokens_per_step"] / tok_s * 1e3, "peak_alloc_gb": gb(last["peak_mem_mb"]),
            "peak_reserved_gb": gb(last.get("peak_reserved_mb")), **shares}


def markdown(rows):
    """One table; a row without numbers shows why in its tok/s column."""
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    table = []
    for r in rows:
        base = {"model": r["model"], "micro": r["micro"], "parallel": r["parallel"], "compile": r["compile"]}
        if not r.get("tok_per_s"):
            table.append({**base, "tok_per_s": r["status"], **{k: "" for k in
                          ("MFU", "MFU_vs_matmul", "step_ms", "alloc_GB", "reserved_GB", "outside_kernels",
                           "launch", "sync", "python")}})
            continue
        table.append({**base, "tok_per_s": f"{r['tok_per_s']:,.0f}" + ("" if r["status"] == "ok" else
                      f" ({r['status']})"), "MFU": pct(r["mfu"]),
                      "MFU_vs_matmul": pct(r["mfu_vs_matmul"]), "step_ms": num(r["step_ms"], ".1f"),
                      "alloc_GB": num(r["peak_alloc_gb"], ".1f"), "reserved_GB": num(r["peak_reserved_gb"], ".1f"),
                      **{k: pct(r[k]) for k in ("outside_kernels", "launch", "sync", "python")}})
    return bench.markdown(table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="a new (or empty) folder for gpu_bench.md and gpu_bench.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model, eager only, float32: the logic, on a CPU")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450)")
    ap.add_argument("--shared", help="the folder with data/tinyshakespeare.txt and tiktoken_cache/ "
                                     "(default: shared/ in the checkout, else ../shared)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job")
    a = ap.parse_args(argv)
    # every check before any work
    if not a.out:
        sys.exit("error: --out DIR is required: the folder gpu_bench.md and gpu_bench.json go in")
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if a.budget <= 0:
        sys.exit(f"error: --budget {a.budget:g}: expected a positive number of seconds")
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # a GPU image may carry torch and little else
        sys.exit(f"error: train.py's packages are missing here: {', '.join(missing)} (requirements.txt)")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device; `--device cpu --tiny --out DIR` checks the logic on a CPU")
    shared = find_shared(a.shared)
    if not shared:
        sys.exit(f"error: no {CORPUS} and {TIKTOKEN}/ in {a.shared or 'shared/ or ../shared'}; on a machine "
                 f"without ../shared, copy them into a folder that travels and name it with --shared")
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    deadline = t_start + a.budget
    device = "cuda:0" if a.device == "cuda" else "cpu"
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    if a.tiny:
        dtype, models, modes, train = torch.float32, {"gpt_tiny": 4}, [m for m in MODES if not m[2]], TINY
        measured = matmul_flops(device, dtype, n=256, iters=20)
    else:
        dtype, models, modes, train = torch.bfloat16, MODELS, MODES, STEPS
        measured = matmul_flops(device, dtype)
    peak = peak_flops(name)  # None on a CPU or an unlisted GPU
    print(f"{name}: {str(dtype)[6:]} matmul {measured / 1e12:.1f} TFLOP/s measured"
          + (f", {peak / 1e12:.0f} datasheet" if peak else ""), flush=True)

    rows, jobs = [], [(m, micro, *mode) for mode in modes for m, micro in models.items()]
    weights = [COMPILE_WEIGHT if c else 1 for *_, c in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(shared)
        print(f"data: {shared}/{CORPUS}, GPT-2 tokens ({time.time() - t_start:.0f}s so far)", flush=True)
        for k, (model, micro, strategy, impl, compiled) in enumerate(jobs):
            share = (deadline - time.time()) * weights[k] / sum(weights[k:])  # an early finish leaves time to the rest
            run_dir = os.path.join(tmp, f"{k}")
            overrides = [f"model={model}", f"train.device={a.device}", *data, *train,
                         f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                         "train.profile=true", *a.overrides, f"train.compile={str(compiled).lower()}"]
            t0 = time.time()
            try:
                if share < MIN_SHARE:
                    raise TimeoutError
                numbers, status = measure(bench.run_one(strategy, impl, 1, overrides, run_dir, timeout=share),
                                          run_dir, peak, measured), "ok"
            except (TimeoutError, subprocess.TimeoutExpired):
                numbers, status = {}, f"out of time ({max(share, 0):.0f}s share)"
                cut = cut_short(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else None
                if cut:  # what it measured before its time ran out still counts
                    numbers, status = measure(cut[0], run_dir, peak, measured), f"{status}, {cut[1]} windows"
            except (SystemExit, OSError, ValueError, KeyError, statistics.StatisticsError) as e:
                numbers, status = {}, "failed: " + (str(e).strip().splitlines() or ["?"])[-1][:100]
            rows.append({"model": model, "micro": micro, "parallel": {"single": "single", "scratch": "fsdp (ours)",
                         "torch": "FSDP2"}[impl or "single"] + ("" if strategy == "single" else ", 1 rank"),
                         "compile": "yes" if compiled else "no", "status": status,
                         "seconds": round(time.time() - t0, 1), **numbers})
            print(f"  {model} {rows[-1]['parallel']} compile={compiled}: {status}"
                  + (f", {numbers['tok_per_s']:,.0f} tok/s" if numbers else "") + f" ({time.time() - t0:.0f}s)",
                  flush=True)
            write(a.out, rows, name, dtype, measured, peak, train + a.overrides, a.budget)  # kept if we are killed
    text = write(a.out, rows, name, dtype, measured, peak, train + a.overrides, a.budget)
    print("\n" + text + f"\nwritten: {a.out}/gpu_bench.md, gpu_bench.json")
    return rows


def write(out, rows, name, dtype, measured, peak, overrides, budget):
    head = (f"{time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}: {str(dtype)[6:]} matmul 8192^3 "
            f"{measured / 1e12:.1f} TFLOP/s measured" + (f", {peak / 1e12:.0f} datasheet" if peak else "") +
            f". Jobs: one rank, seq x micro tokens per step, overrides {' '.join(overrides)}; --budget {budget:g}s. "
            f"outside_kernels, launch, sync, python: shares of steps 2-4's wall time (tools/gpu_bench.py).")
    text = head + "\n\n" + markdown(rows) + "\n"
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "dtype": str(dtype)[6:], "matmul_flops": measured, "datasheet_flops": peak,
                   "overrides": overrides, "budget_s": budget, "rows": rows}, f, indent=1)
    return text


if __name__ == "__main__":
    main()
