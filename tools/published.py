"""The planner against published runs: each bf16 row of tools/published_runs.py (Megatron-LM, its selective
recompute paper, torchtitan, llm-foundry, Llama 3) rebuilt as a config, predicted by tools/plan.py, and its
tokens/s per GPU set beside the measured one.

    python -m tools.published              # the table (markdown), about 10 s
    python -m tools.published --out FILE   # also written to FILE

Measured tokens/s per GPU: the source's own where it gives one; else from its MFU or HFU with its own FLOP count
(Narayanan et al.: 96 l h^2 (1 + s / 6h + V / 16 l h) FLOPs per token, recompute included; Llama 3: PaLM's
6N + 12 l d s). What the planner is told: the model's shape, the batch, the micro-batch (1 where the source does not
give it, stated in the row), the layout (tensor, pipeline and context parallel degrees; the data strategy, as
`data` maps it: Megatron's DDP with 16-bit working weights is our ZeRO-1 in bf16 where it has data parallelism), the
activation checkpointing mode (torchtitan's per-op and per-layer policies as ours of the same policy), the attention
kernel (Megatron-LM's 2021-2022 rows: the scores in memory, plan.attention=unfused; the rest flash-style), and the
GPU; 8 GPUs per node over NVLink, InfiniBand between. Tied embeddings are
planned untied (the head's matmul is the same; our rule book refuses a tie under FSDP and pipelines). A row the rule
book refuses is listed with its line.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measured_tokens(row, flops_per_token):
    """(tokens/s per GPU as the source measured it, how it was read)."""
    from tools.plan import GPUS
    if row["tokens_per_s_per_gpu"]:
        return row["tokens_per_s_per_gpu"], "tokens/s"
    l, h, s, V = row["n_layer"], row["n_embd"], row["seq_len"], row["vocab_size"]
    if row["tflops_per_gpu"] and row["source"].startswith("Megatron-LM"):
        per_token = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return row["tflops_per_gpu"] * 1e12 / per_token, "TFLOP/s (recompute counted)"
    if row["mfu"]:
        return row["mfu"] * GPUS[row["gpu"]]["peak"] / flops_per_token, "MFU"
    return None, "nothing measured"


def data(row):
    """Our data strategy for the row's. Megatron's "ddp" is mixed precision with 16-bit working weights and float32
    master weights in the optimizer (its Float16Module and Float16OptimizerWithFloat16Params), its gradients
    all-reduced in float32: over more than one data-parallel rank that is our ZeRO-1 with bf16 working weights
    (param_dtype=auto under bf16; a reduce-scatter and an all-gather where Megatron all-reduces: 6 bytes a
    parameter for 8), and without data parallelism (tp x pp alone) ZeRO-1 over one rank: the same bf16 working copy
    beside float32 master weights, nothing sharded. Our DDP instead keeps float32 weights that autocast casts at
    every micro-step's matmuls (and again in recomputation): 10-12% of the blocks' compute of Megatron's 18B to 1T
    rows at 2,048 tokens a micro-batch (step_time.block_ops with and without autocast's casts, full recompute),
    and its sequence-parallel all-gathers move a float32 residual stream. HSDP is planned as FSDP."""
    return {"hsdp": "fsdp", "ddp": "zero1"}.get(row["data"], row["data"])


def overrides(row):
    micro = row["micro_batch_size"] or 1
    ac, _, how = (row["activation_checkpointing"] or "none").partition("-")
    if ac == "every_2":  # tools/published_runs.py: torchtitan's per-layer SAC
        ac, how = "every_n", "train.ac_every=2"
    elif how:  # selective-alternate: torchtitan's per-op SAC
        how = f"train.selective_matmuls={how}"
    out = [f"model.n_layer={row['n_layer']}", f"model.n_embd={row['n_embd']}", f"model.n_head={row['n_head']}",
           f"model.n_kv_head={row['n_kv_head']}", f"model.ffn_hidden={row['ffn_hidden']}", f"model.mlp={row['mlp']}",
           f"model.vocab_size={row['vocab_size']}", f"model.block_size={row['seq_len']}",
           # a tokenizer of the row's vocabulary (the planner reads its size only; nothing is read or trained)
           "data=text", f"data.vocab_size={row['vocab_size']}",
           f"train.seq_len={row['seq_len']}", f"train.global_batch_size={row['global_batch_size']}",
           f"train.micro_batch_size={micro}", f"train.activation_checkpointing={ac}",
           f"parallel.tp={row['tp']}", f"parallel.pp={row['pp']}", f"parallel.cp={row['cp'] or 1}",
           f"parallel.data={data(row)}", "parallel.dp=null",
           f"plan.world={row['gpus']}", f"plan.gpu={row['gpu']}", "plan.rank=false", *([how] if how else [])]
    if row["pp"] > 1:
        schedule = row["pp_schedule"] or "1f1b"
        out += [f"parallel.pp_schedule={schedule}"]
        if schedule == "interleaved_1f1b":
            out += [f"parallel.pp_virtual={row['pp_virtual'] or 2}"]
    if row["tp"] > 1 and row["sequence_parallel"]:
        out += ["parallel.sequence_parallel=true"]
    if row["compile"]:
        out += ["train.compile=true"]
    if row["source"].startswith(("Megatron", "Korthikanti")):  # before FlashAttention: the scores in memory
        out += ["plan.attention=unfused"]
    return out


def compare(rows=None, log=lambda *a: None):
    """[{row, predicted, measured, ratio, how, problem, mfu, flops_per_token}] for every bf16 (or unstated 16-bit)
    row."""
    sys.path.insert(0, ROOT)
    import config
    from tools import plan
    from tools.published_runs import RUNS
    out = []
    for row in rows or RUNS:
        if row["dtype"] == "float8":
            continue
        log(row["name"])
        r = {"row": row, "predicted": None, "measured": None, "ratio": None, "how": "", "problem": None}
        out.append(r)
        try:
            cfg = plan.compose(overrides(row))
            layout = plan.check(cfg)
        except config.ConfigError as e:
            r["problem"] = str(e)
            continue
        shape = plan.model_shape(cfg)
        p = plan.predict(cfg, layout, shape=shape, plan=cfg.plan)
        r["flops_per_token"] = shape["flops_per_token"]
        r["measured"], r["how"] = measured_tokens(row, shape["flops_per_token"])
        r["predicted"] = p["tok_per_s"] / row["gpus"]
        r["mfu"] = p["mfu"]
        if r["measured"]:
            r["ratio"] = r["predicted"] / r["measured"]
    return out


def markdown(results):
    lines = ["| run | GPUs | layout | AC | measured tokens/s/GPU (from) | planner | planner / measured |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        row = r["row"]
        planned = "" if data(row) == row["data"] else f" (as {data(row)})"
        layout = f"{row['data']}{planned} tp={row['tp']} pp={row['pp']}" + \
            (f" cp={row['cp']}" if (row["cp"] or 1) > 1 else "")
        if r["problem"]:
            lines.append(f"| {row['name']} | {row['gpus']} x {row['gpu']} | {layout} | "
                         f"{row['activation_checkpointing']} | refused: {r['problem']} | | |")
            continue
        m = f"{r['measured']:,.0f} ({r['how']})" if r["measured"] else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        lines.append(f"| {row['name']} | {row['gpus']} x {row['gpu']} | {layout} | {row['activation_checkpointing']} "
                     f"| {m} | {r['predicted']:,.0f} | {ratio} |")
    ratios = [r["ratio"] for r in results if r["ratio"]]
    within = sum(0.85 <= x <= 1.15 for x in ratios)
    lines += ["", f"{within} of {len(ratios)} rows within 15% (planner / measured from {min(ratios):.2f} to "
                  f"{max(ratios):.2f})" if ratios else "no rows"]
    if ratios:  # by source and GPU: the sources disagree by their software more than the planner by its GPUs
        groups = {}
        for r in results:
            if r["ratio"]:
                groups.setdefault((r["row"]["source"], r["row"]["gpu"]), []).append(r["ratio"])
        lines += ["", "| source | GPU | rows within 15% | planner / measured |", "|---|---|---|---|"]
        lines += [f"| {src} | {gpu} | {sum(0.85 <= x <= 1.15 for x in xs)} of {len(xs)} | {min(xs):.2f}-{max(xs):.2f} |"
                  for (src, gpu), xs in groups.items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the table here (a new file)")
    a = ap.parse_args(argv)
    if a.out and os.path.exists(a.out):
        sys.exit(f"error: --out {a.out} exists; name a new file")
    text = markdown(compare())
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
