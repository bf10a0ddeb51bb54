"""Measure one CUDA GPU in one short, unattended run (under 5 minutes): its bf16 matmul rate, then tokens/s and MFU
of gpt_125m and gpt_350m training, eager and torch.compile, with parallel=single and a one-rank parallel=fsdp
(FSDP's machinery with nothing to shard: what it costs by itself). Prints one table.

    python -m tools.gpu_bench                                # on a machine with one CUDA GPU
    python -m tools.gpu_bench --device cpu --tiny -- data=text data.paths=[my.txt] data.vocab_size=512

Each training row is a real `torchrun --nproc_per_node=1 train.py` job (tools/bench.py's run_one) on the default
corpus, bf16 autocast, sequences of 1024 and the GPT-2 vocab (50257), its tokens/s the median of its timing windows
after the first (warm-up and compilation). MFU is the model's FLOPs per token (model.flops_per_token) x tokens/s over
the datasheet's dense bf16 peak (tools/plan.py GPUS), and also over the matmul rate measured here. Rows run eager
first; each job gets what is left of --budget seconds, and a job that fails or runs out of time says so in its row
instead of stopping the rest. --tiny checks the same logic on a CPU in seconds: a tiny model, eager only, float32.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from tools import bench, plan

MODELS = ("gpt_125m", "gpt_350m")
# (parallel, compile): every model runs all four, eager ones first
RUNS = [("single", False), ("fsdp", False), ("single", True), ("fsdp", True)]
GPU_TRAIN = ["model.vocab_size=50257", "train.seq_len=1024", "train.micro_batch_size=16",
             "train.global_batch_size=16", "train.max_steps=40", "train.log_every=10"]
TINY_TRAIN = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64", "train.seq_len=64",
              "train.micro_batch_size=4", "train.global_batch_size=4", "train.max_steps=6", "train.log_every=2",
              "train.dtype=float32"]


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
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def row(model, strategy, compiled, result, peak, measured_peak):
    """One table row from run_one's (first record, tokens/s, last record), or the reason it has no numbers."""
    base = {"model": model, "parallel": strategy + (" (1 rank)" if strategy == "fsdp" else ""),
            "compile": "yes" if compiled else "no"}
    if isinstance(result, str):
        return {**base, "tok_per_s": result, "MFU": "", "MFU_vs_matmul": "", "peak_mem_GB": "", "step_ms": ""}
    start, tok_s, last = result
    flops = start["flops_per_token"] * tok_s
    return {**base, "tok_per_s": f"{tok_s:,.0f}", "MFU": f"{flops / peak:.1%}" if peak else "-",
            "MFU_vs_matmul": f"{flops / measured_peak:.1%}",
            "peak_mem_GB": f"{last['peak_mem_mb'] * 2**20 / 1e9:.1f}",
            "step_ms": f"{start['tokens_per_step'] / tok_s * 1e3:.1f}"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model, eager only, float32: the logic, on a CPU")
    ap.add_argument("--budget", type=float, default=285, help="seconds for the whole run (default 285)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device; `--device cpu --tiny` checks the logic on a CPU")
    deadline = time.time() + a.budget
    device = "cuda:0" if a.device == "cuda" else "cpu"
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    if a.tiny:
        dtype, models, runs, train = torch.float32, ("gpt_tiny",), [r for r in RUNS if not r[1]], TINY_TRAIN
        measured = matmul_flops(device, dtype, n=256, iters=20)
    else:
        dtype, models, runs, train = torch.bfloat16, MODELS, RUNS, GPU_TRAIN
        measured = matmul_flops(device, dtype)
    peak = plan.peak_flops(name)  # None on a CPU or an unlisted GPU
    print(f"{name}: {str(dtype)[6:]} matmul {measured / 1e12:.1f} TFLOP/s measured"
          + (f", {peak / 1e12:.0f} datasheet" if peak else ""), flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for compiled in (False, True):  # eager rows first: compilation is what may run out of time
            for model in models:
                for strategy, c in runs:
                    if c != compiled:
                        continue
                    left = deadline - time.time()
                    overrides = [f"model={model}", f"train.device={a.device}", *train, *a.overrides,
                                 f"train.compile={str(compiled).lower()}"]
                    t0 = time.time()
                    try:
                        if left < 10:
                            raise TimeoutError
                        result = bench.run_one(strategy, "scratch" if strategy != "single" else None, 1, overrides,
                                               os.path.join(tmp, f"{model}-{strategy}-{compiled}"), timeout=left)
                    except (TimeoutError, subprocess.TimeoutExpired):
                        result = "out of time"
                    except (SystemExit, OSError, ValueError, statistics.StatisticsError) as e:
                        result = "failed: " + str(e).strip().splitlines()[-1][:80]
                    rows.append(row(model, strategy, compiled, result, peak, measured))
                    print(f"  {model} {strategy} compile={compiled}: {rows[-1]['tok_per_s']} tok/s "
                          f"({time.time() - t0:.0f}s)", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}, overrides: "
          f"{' '.join(train + a.overrides)}\n")
    print(bench.markdown(rows))
    return rows


if __name__ == "__main__":
    main()
