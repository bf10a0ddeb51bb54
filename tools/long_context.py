"""Long context on this machine: tokens/s and peak memory per rank of one long sequence per step, for parallel=single
and context parallelism at cp = 2 and 4 (ring and all-gather), at 4k to 32k tokens, each beside the planner's
memory for the same run and with its losses held against single's. One command, the docs' long-context table:

    python -m tools.long_context                          # 4k, 8k, 16k, 32k tokens; single, cp=2, cp=4
    python -m tools.long_context --seq 4096 16384 --cp 1 2 -- model=llama_tiny

Each row is a real `torchrun train.py` job (tools/bench.py's run_one: gloo on CPU, nccl on GPU), 3 steps of one
sequence (global batch 1); tokens/s is the median of steps 2 and 3. Peak memory per rank is rank 0's peak
(train.py's peak_mem_mb: the process's peak RSS on a CPU, the allocator's peak on a GPU) above what the process
held before the model existed (mem_mb_before_model): the interpreter and torch's libraries left out, as the
planner leaves them out. The planner's column is tools/plan.py's total for the run (state, transient,
activations, backward buffers). Losses: the largest relative gap of any step's loss to single's at that length.
Printed as markdown and written into a new folder under --out.

Two settings make the rows comparable on a CPU (both measured 2026-12-06, gpt_tiny at 16,384 tokens):
- Every job runs one thread per process (OMP_NUM_THREADS=1): single is one device against cp's cp devices, as on
  GPUs. torchrun leaves a one-process job every core: single then ran at 2,050 tokens/s on 2 threads against
  1,120 on one, and cp=2 on the same 2 cores at 1,630-2,020.
- glibc's malloc serves every allocation over 128 KiB by its own mmap (MALLOC_MMAP_THRESHOLD_), so that a freed
  activation leaves the process at once. By default the threshold grows to the largest block freed (up to 32 MiB)
  and the heap keeps what it served, fragmented: the peak RSS then measured the heap's high-water mark, not the
  tensors (single 1,036 MiB, cp=2 ring 656; with the setting 894 and 487, beside the planner's 838 and 435). It
  costs a few percent of speed (page faults on fresh memory), alike for every row.
"""
import argparse
import json
import os
import sys
import tempfile
import time

from tools.bench import ROOT, run_one

LAYOUTS = [(1, None), (2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather")]  # (cp, method); 1: single


JOB_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # the module docstring: why


def rows(seqs, cps, overrides, log=print, data="ddp"):
    """One dict per (tokens, layout), single first at each length. `data`: the cp rows' data-parallel strategy over
    dp x cp (fsdp: the weights, gradients and optimizer state sharded over the cp ranks too)."""
    os.environ.update(JOB_ENV)  # inherited by every torchrun job below
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            base = None
            for cp, method in (x for x in LAYOUTS if x[0] in cps):
                run = ["model.block_size=%d" % seq, f"train.seq_len={seq}", "train.global_batch_size=1",
                       "train.micro_batch_size=1", "train.max_steps=3", "train.log_every=1", *overrides]
                if cp > 1:
                    run += [f"parallel.cp={cp}", f"parallel.cp_method={method}", f"parallel.data={data}"]
                run_dir = os.path.join(tmp, f"{seq}-{cp}-{method}")
                t0 = time.time()
                start, tok_s, last = run_one("single" if cp == 1 else "cp", None, cp, run, run_dir)
                with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r and "tok_per_s" in r]
                from tools import plan
                predicted = plan.predict_run(run_dir)
                name = "single" if cp == 1 else f"cp={cp} {method}" + ("" if data == "ddp" else f" {data}")
                row = {"tokens": seq, "layout": name, "tok_per_s": tok_s,
                       "peak_mib": last["peak_mem_mb"] - start["mem_mb_before_model"],
                       "planner_mib": predicted["total_memory"] / 2**20, "losses": losses}
                base = base or row
                row["x_tok"] = tok_s / base["tok_per_s"]
                # a short run may never pass the RSS the imports reached: no growth to compare
                row["x_peak"] = row["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else float("nan")
                row["loss_gap"] = max(abs(a / b - 1) for a, b in zip(losses, base["losses"]))
                out.append(row)
                log(f"{seq:6d} {row['layout']:14s} {tok_s:8,.0f} tok/s  peak {row['peak_mib']:8,.0f} MiB "
                    f"(planner {row['planner_mib']:8,.0f})  ({time.time() - t0:.0f}s)", flush=True)
    return out


def markdown(table):
    lines = ["| tokens | layout | tokens/s | x single | peak MiB per rank | x single | planner MiB | "
             "loss gap to single |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['tokens']} | {r['layout']} | {r['tok_per_s']:,.0f} | {r['x_tok']:.2f} | "
                     f"{r['peak_mib']:,.0f} | {r['x_peak']:.2f} | {r['planner_mib']:,.0f} | {r['loss_gap']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="degrees (1: single, always first)")
    ap.add_argument("--data", default="ddp", choices=["ddp", "zero1", "zero2", "fsdp"],
                    help="the cp rows' data-parallel strategy (fsdp also shards the state over the cp ranks)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "long_context"))
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job, e.g. model=llama_tiny")
    a = ap.parse_args()
    bad = [c for c in a.cp if c not in (1, 2, 4)]
    if bad or 1 not in a.cp or any(s < 64 for s in a.seq):
        sys.exit("error: --cp takes 1 (single, needed as the baseline), 2 and 4; --seq at least 64 tokens")
    out = os.path.join(a.out, time.strftime("%Y-%m-%d_%H-%M-%S"))
    os.makedirs(out)  # a new folder: never overwrites an earlier table
    table = markdown(rows(a.seq, set(a.cp), a.overrides, data=a.data))
    print(table)
    with open(os.path.join(out, "long_context.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
