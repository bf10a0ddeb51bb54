"""Benchmark every strategy, ours beside torch's (and DeepSpeed's ZeRO, where it is installed), in one run:
throughput, memory and communication, and then FSDP's knobs (prefetch, reshard_after_forward, wrap granularity, activation checkpointing).

    python -m tools.bench                          # world size 2, gpt_tiny on the default corpus, 2 rounds
    python -m tools.bench --world 4 --rounds 3 -- model=gpt_125m train.seq_len=512

Each configuration is a real `torchrun train.py` job (gloo on CPU, nccl on GPU). Rounds interleave all
configurations, so slow spells of a noisy machine hit every competitor alike; a configuration's tokens/s is the
median over its rounds of each job's median step. Printed as a markdown table and written as markdown and CSV
into a new folder under --out, with the ratio of each scratch implementation's tokens/s to torch's, and of the
measured bytes to the ZeRO paper's.
"""
import argparse
import contextlib
import csv
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [("single", None)] + [(s, i) for s in ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp_tp")
                                 for i in ("scratch", "torch")]
# DeepSpeed's ZeRO-1, -2 and -3 (parallel/zero_deepspeed.py), the third twin, where it is installed
DEEPSPEED = [(s, "deepspeed") for s in ("zero1", "zero2", "fsdp")]
# (label, overrides) for our FSDP, each against the default fsdp row above
KNOBS = [("prefetch=0", ["parallel.prefetch=0"]),
         ("reshard_after_forward=false", ["parallel.reshard_after_forward=false"]),
         ("blocks_per_unit=2", ["parallel.blocks_per_unit=2"]),
         ("activation_checkpointing=full", ["train.activation_checkpointing=full"])]
# pipeline rows (--strategies pp): every schedule, ours beside torch.distributed.pipelining's, on all ranks with no
# data strategy (torch's twin runs without one here); 8 blocks, so that interleaving has 2 chunks per rank at pp=4,
# and single on the same 8 blocks for reference
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PP_MODEL = ["model.n_layer=8"]
PP_JOBS = [("single", None, PP_MODEL)] + [("pp", i, [*PP_MODEL, "parallel.data=none", f"parallel.pp_schedule={s}"])
                                          for s in PP_SCHEDULES for i in ("scratch", "torch")]
# context parallel at one long sequence (--strategies ...,cp): ring and all-gather attention over cp = world, and DDP
# over the same ranks at that sequence (each rank whole sequences) as their baseline. torch's context_parallel is
# GPU-only (Layout.problem): no twin row on CPU
CP_RUN = ["model.block_size=2048", "train.seq_len=2048", "train.global_batch_size=4", "train.micro_batch_size=1",
          "train.max_steps=8", "train.log_every=2"]
CP_ROWS = [("ddp (whole sequences)", "ddp", []), ("ring", "cp", ["parallel.cp_method=ring"]),
           ("allgather", "cp", ["parallel.cp_method=allgather"])]
DEFAULTS = ["train.global_batch_size=32", "train.micro_batch_size=8", "train.max_steps=25", "train.log_every=5",
            "train.eval_every=1000", "train.eval_steps=1", "train.sample_tokens=0", "checkpoint.keep=0",
            "logger.mode=disabled"]


def run_one(strategy, impl, world, overrides, run_dir, timeout=None):
    # hsdp: two replicas of world / 2 ranks each, as if the ranks were two nodes (its preset shards over a node's)
    hsdp = [f"parallel.dp_shard={max(1, world // 2)}"] if strategy == "hsdp" else []
    args = [*DEFAULTS, f"parallel={strategy}", *hsdp, *overrides, f"hydra.run.dir={run_dir}"]
    if impl:
        args.append(f"parallel.impl={impl}")
    n = 1 if strategy == "single" else world
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           os.path.join(ROOT, "train.py"), *args]
    # a session of its own, so that running out of time ends torchrun's ranks too, not only torchrun
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        _, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's ranks may sit in sessions of their own: kill every descendant, found before any dies (an orphan
        # rank would keep the pipes open, and communicate() would wait for it forever)
        from tools.jobs import process_tree
        for pid in reversed(process_tree(p.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    if p.returncode:
        sys.exit(f"error: {strategy}/{impl} failed:\n{stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "tok_per_s" in r][1:]  # the first window includes warm-up
    from tools import plan  # here, not at the top: importing bench must not need omegaconf (tools/gpu_bench.py)
    predicted = plan.predict_run(run_dir)  # the theory for this very config
    records[0].update(comm_theory=predicted["comm_total"], state_theory=predicted["state"],
                      **({"p2p_theory": predicted["p2p_pipeline"], "bubble": predicted["bubble"],
                          "in_flight": max(predicted["in_flight"])} if predicted["pp"] > 1 else {}))
    return records[0], statistics.median(r["tok_per_s"] for r in steps), steps[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="ranks per multi-rank job (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    ap.add_argument("--strategies", default=",".join(s for s, _ in CONFIGS[::2]) + ",pp",
                    help="comma-separated subset to run (default: all; single is always run, FSDP's knobs with fsdp)")
    ap.add_argument("--compile", action="store_true",
                    help="also run every configuration with train.compile=true: compiled tok/s and compiled/eager")
    ap.add_argument("--no-knobs", action="store_true", help="leave out FSDP's knob rows (run with fsdp otherwise)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench"), help="results go in a new folder here")
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job, e.g. model=gpt_125m")
    a = ap.parse_args()
    if a.world < 2 or a.rounds < 1:
        sys.exit("error: --world must be at least 2 and --rounds at least 1")
    chosen = {"single", *a.strategies.split(",")}
    presets = [s for s, _ in CONFIGS[::2]] + ["pp", "cp"]
    unknown = chosen - set(presets)
    if unknown:
        sys.exit(f"error: --strategies {','.join(sorted(unknown))}: expected some of {','.join(presets)}")
    configs = [(s, i) for s, i in CONFIGS if s in chosen]
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed: not installed, its rows left out (pip install deepspeed==0.19.8)")
    else:
        configs += [(s, i) for s, i in DEEPSPEED if s in chosen]
    knobs = KNOBS if "fsdp" in chosen and not a.no_knobs else []
    out = os.path.join(a.out, time.strftime("%Y-%m-%d_%H-%M-%S"))
    os.makedirs(out)  # a new folder: never overwrites an earlier benchmark

    jobs = [(s, i, []) for s, i in configs] + [("fsdp", "scratch", o) for _, o in knobs]
    first_pp = len(jobs)
    jobs += PP_JOBS if "pp" in chosen else []
    cp_rows = CP_ROWS if "cp" in chosen else []
    first_cp = len(jobs)
    jobs += [(s, "scratch", [*CP_RUN, *o]) for _, s, o in cp_rows]
    # compiled twins of each configuration (torch's tensor parallel refuses compile: its collectives would run
    # inside the graphs, uncounted)
    compiled = {c: len(jobs) + n for n, c in enumerate(c for c in configs
                                                       if not (c[1] == "torch" and "tp" in c[0]) and c[1] != "deepspeed")}
    if a.compile:
        jobs += [(s, i, ["train.compile=true"]) for s, i in compiled]
    results = {k: [] for k in range(len(jobs))}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for k, (strategy, impl, knob) in enumerate(jobs):
                t0 = time.time()
                start, tok_s, last = run_one(strategy, impl, a.world, [*a.overrides, *knob],
                                             os.path.join(tmp, f"{r}-{k}"))
                results[k].append((start, tok_s, last))
                print(f"[round {r + 1}/{a.rounds}] {strategy:6s} {impl or '':7s} {' '.join(knob)[-38:]:38s} "
                      f"{tok_s:10,.0f} tok/s ({time.time() - t0:.0f}s)", flush=True)

    def tok_s(k):
        return statistics.median(t for _, t, _ in results[k])

    def ratio(k, base):  # the median of each round's ratio: the two ran in the same stretch of that round
        return f"{statistics.median(a[1] / b[1] for a, b in zip(results[k], results[base])):.2f}"

    def peak_mib(k):  # rank 0's peak memory above what it held before the model existed
        start, _, last = results[k][-1]
        return last["peak_mem_mb"] - start["mem_mb_before_model"]

    rows = []
    for k, (strategy, impl) in enumerate(configs):
        start, _, last = results[k][-1]
        world = start["world_size"]
        comm_theory, state_theory = start["comm_theory"], start["state_theory"]
        torch_tok_s = tok_s(configs.index((strategy, "torch"))) if impl in ("scratch", "deepspeed") else None
        rows.append({
            "strategy": strategy, "impl": impl or "-", "world": world,
            "dp x tp": f"{start['dp']}{dp_split(start)} x {start['tp']}",
            "tok_per_s": round(tok_s(k)),
            "vs_torch": ratio(k, configs.index((strategy, "torch"))) if torch_tok_s else "",
            **({"compiled_tok_per_s": round(tok_s(compiled[strategy, impl])) if (strategy, impl) in compiled else "-",
                "compiled_vs_eager": ratio(compiled[strategy, impl], k) if (strategy, impl) in compiled
                else "refused"} if a.compile else {}),
            "peak_MiB": f"{peak_mib(k):.0f}",
            "state_MiB_per_rank": f"{last['state_bytes_max'] / 2**20:.2f}",
            "state_B_per_param": f"{last['state_bytes_max'] / start['n_params']:.2f}",
            # DeepSpeed: the gradients it holds at the step (its step frees them); our FSDP: gathered units
            "transient_B_per_param": f"{last['transient_bytes'] / start['n_params']:.2f}" if "transient_bytes" in last
            else "",
            "state_vs_theory": f"{last['state_bytes_max'] / state_theory:.3f}" if state_theory else "",
            "comm_MiB_per_step": f"{last['comm_bytes'] / 2**20:.2f}",
            "comm_in_psi": f"{last['comm_bytes'] / start['param_bytes']:.3f}",
            "comm_MiB_by_dim": by_dim(last),
            "comm_vs_theory": f"{last['comm_bytes'] / comm_theory:.3f}" if comm_theory else "",
        })
    knob_rows = []
    if knobs:
        base = configs.index(("fsdp", "scratch"))
        knob_jobs = [("default", base)] + [(label, len(configs) + i) for i, (label, _) in enumerate(knobs)]
        knob_rows = [{"fsdp (scratch) knob": label, "tok_per_s": round(tok_s(k)),
                      "vs_default": ratio(k, base), "peak_MiB": f"{peak_mib(k):.0f}",
                      "comm_in_psi": f"{results[k][-1][2]['comm_bytes'] / results[k][-1][0]['param_bytes']:.3f}"}
                     for label, k in knob_jobs]
    pp_rows = pipeline_rows(results, jobs, first_pp, tok_s, ratio, peak_mib) if "pp" in chosen else []
    cp_table = []
    for n, (label, _, _) in enumerate(cp_rows):
        k = first_cp + n
        start, _, last = results[k][-1]
        cp_table.append({"cp row": label, "dp x cp": f"{start['dp']} x {start['cp']}", "tok_per_s": round(tok_s(k)),
                         "vs_ddp": ratio(k, first_cp),
                         "vs_ring": ratio(k, first_cp + 1) if n else "", "peak_MiB": f"{peak_mib(k):.0f}",
                         "comm_MiB_per_step": f"{last['comm_bytes'] / 2**20:.2f}", "comm_MiB_by_dim": by_dim(last),
                         "comm_vs_theory": f"{last['comm_bytes'] / start['comm_theory']:.3f}"
                         if start["comm_theory"] else ""})
    P = results[0][0][0]["n_params"]
    note = (f"{P:,} parameters; theory (ZeRO paper, fp32 Adam): comm 2 Psi for ddp/zero1/zero2, (2 x accumulation "
            f"+ 1) Psi for fsdp (within dp_shard for hsdp, and 2 Psi / dp_shard across dp_replicate); state 16P, "
            f"8P+8P/N, 4P+12P/N, 16P/N (16P/dp_shard); tp and fsdp_tp: the planner's activation "
            f"volumes and 16 P_local (/dp). deepspeed rows: state is what it keeps across steps, weights + its fp32 "
            f"master partition + moments (4P + 12P/N; 16P/N for ZeRO-3, fsdp), transient the gradients it holds at the "
            f"step (4P/N; ZeRO-1 holds 4P through backward); vs_torch is against the same strategy's torch row. peak_MiB: rank 0's "
            f"peak RSS above what it held before the model was built. Overrides: {' '.join(a.overrides) or '(none)'}; "
            f"{a.rounds} round(s).")
    pp_note = ("pipeline rows: model.n_layer=8, parallel=pp over all ranks, parallel.data=none; p2p: what one "
               "pipeline's stages send each other per step; bubble: the schedule's idle share, forward 1 and backward "
               "2 (parallel/pp.py's bubble, the planner's); in_flight: the most micro-batches whose activations a rank "
               "holds. vs_single: against single on the same 8 blocks.")
    text = markdown(rows) + ("\n\n" + markdown(knob_rows) if knob_rows else "") + \
        ("\n\n" + markdown(pp_rows) if pp_rows else "") + \
        ("\n\n" + markdown(cp_table) + f"\n\ncp rows: {' '.join(CP_RUN)}" if cp_table else "") + "\n\n" + note + \
        (" " + pp_note if pp_rows else "")
    print("\n" + text)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(text + "\n")
    tables = [("bench.csv", rows)] + ([("bench_knobs.csv", knob_rows)] if knob_rows else []) + \
        ([("bench_pp.csv", pp_rows)] if pp_rows else []) + ([("bench_cp.csv", cp_table)] if cp_table else [])
    for name, table in tables:
        with open(os.path.join(out, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    print(f"\nwritten: {out}/bench.md, " + ", ".join(name for name, _ in tables))


def pipeline_rows(results, jobs, first, tok_s, ratio, peak_mib):
    """One row per pipeline job: each schedule's tokens/s beside torch's, peak memory, p2p bytes (measured, and
    against the planner's), the schedule's bubble."""
    base = first  # single on the same blocks
    index = {(j[1], j[2][-1]): k for k, j in enumerate(jobs) if k > first}
    rows = []
    for k in range(first + 1, len(jobs)):
        _, impl, knob = jobs[k]
        start, _, last = results[k][-1]
        torch_k = index["torch", knob[-1]]
        rows.append({"schedule": knob[-1].split("=")[1], "impl": impl, "pp x dp": f"{start['pp']} x {start['dp']}",
                     "tok_per_s": round(tok_s(k)), "vs_torch": ratio(k, torch_k) if impl == "scratch" else "",
                     "vs_single": ratio(k, base), "peak_MiB": f"{peak_mib(k):.0f}",
                     "p2p_MiB_per_step": f"{last['p2p_bytes_pipeline'] / 2**20:.2f}",
                     "p2p_vs_theory": f"{last['p2p_bytes_pipeline'] / start['p2p_theory']:.3f}",
                     "bubble": f"{start['bubble']:.3f}", "in_flight": start["in_flight"]})
    return rows


def dp_split(start):
    """ "(dp_replicate x dp_shard)" for an HSDP run, else nothing."""
    return f" ({start['dp_replicate']} x {start['dp_shard']})" if start.get("dp_replicate", 1) > 1 else ""


def by_dim(record):
    """A log step's collective bytes summed by mesh dimension, in MiB: "dp_shard 1.25, dp_replicate 0.31"."""
    from parallel.comm import C10D
    dims = {}
    kinds = sorted({k for k, _, _ in C10D.values()}, key=len, reverse=True)  # all_reduce matched before reduce
    for key, v in record.items():
        kind = next((k for k in kinds if key.endswith(f"_{k}")), None) if key.startswith("comm_") else None
        if kind:  # comm_<dim>_<kind>, as train.py logs them
            dim = key[len("comm_"): -len(kind) - 1]
            dims[dim] = dims.get(dim, 0) + v
    return ", ".join(f"{d} {v / 2**20:.2f}" for d, v in dims.items())


def markdown(rows):
    head = list(rows[0])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows])


if __name__ == "__main__":
    main()
