"""Published, measured training throughput of well-known LLM runs, for checking the step-time planner.

Each entry of RUNS is one measured configuration taken from a primary source (a paper's table or a framework's
benchmark page): the model's shape, the cluster, the parallel layout, the batch, and what the authors measured
(tokens/s per GPU, achieved TFLOP/s per GPU, MFU, HFU). A planner check predicts each row's tokens/s and MFU from the
configuration alone and compares the prediction with the measured numbers; a row's fields are what the planner
needs to rebuild the run.

Fields (None wherever neither the source nor the code and configs it cites give the value; the few values
inferred rather than read, e.g. a default from the framework's config of the day, say so in the row's notes):
  source, url, name            where the row comes from and a short label
  gpu, gpus                    GPU kind (tools/plan.py's GPUS keys) and the total GPU count
  n_layer, n_embd, n_head, n_kv_head, ffn_hidden, mlp ("gelu" | "swiglu"), vocab_size, seq_len, tie_embeddings
  global_batch_size, micro_batch_size        in sequences
  tp, pp, pp_virtual, pp_schedule, cp        pp_schedule is None where pp == 1; pp_virtual None where the source
                                             says the schedule is interleaved but not by how many chunks
  data                         "ddp" | "zero1" | "zero2" | "fsdp" | "hsdp"
  activation_checkpointing     as train.activation_checkpointing: "none" | "selective" | "full", or "every_2" (whole
                               blocks, every second one: torchtitan's per-layer SAC at its default stride) or
                               "selective-alternate" (train.selective_matmuls=alternate: torchtitan's per-op SAC,
                               each block's every second matmul recomputed); None for the one row whose source is
                               silent
  sequence_parallel, compile   bool or None
  dtype                        "bfloat16" | "float16" | "float8" (float8 rows: filter them out for a bf16 planner);
                               None where a paper only says "mixed precision" (16-bit: same A100 peak either way)
  tokens_per_s_per_gpu         measured; a few rows carry a value derived by unit conversion from a measured
                               iteration time, and their notes say so
  tflops_per_gpu               achieved TFLOP/s per GPU as the source reports it (its own FLOP convention)
  mfu, hfu                     fractions as reported (hfu counts recomputation)
  flops_convention             how the source counts FLOPs, and the peak it divides by
  notes                        what else reproducing the run needs, and the table the row came from

The sources do not share one FLOP convention. Before comparing a planner's MFU (6N + attention, no recompute) with
a row, read its flops_convention: Narayanan et al. (2021) report TFLOP/s and % of peak that include the recompute
pass (stored here as hfu, mfu None); torchtitan's 2024-04 A100 numbers count 6x all parameters, both embedding
matrices included, and its later ones leave out the input embedding only; llm-foundry counts the tied embedding and
a learned positional embedding; every source that states its attention term counts full (non-causal) attention,
12*n_layer*n_embd*seq_len per token; torchtitan's 2024 H100s are 500 W HBM2e parts running below the H100 SXM peak
its MFU divides by.
"""

_KEYS = ("source", "url", "name", "gpu", "gpus", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "mlp",
         "vocab_size", "seq_len", "tie_embeddings", "global_batch_size", "micro_batch_size", "tp", "pp", "pp_virtual",
         "pp_schedule", "cp", "data", "activation_checkpointing", "sequence_parallel", "compile", "dtype",
         "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "hfu", "flops_convention", "notes")


def _row(**fields):
    """One run: every key of _KEYS, given explicitly (shapes come in through the _SHAPE dicts below)."""
    missing, extra = set(_KEYS) - set(fields), set(fields) - set(_KEYS)
    assert not missing and not extra, (fields.get("name"), sorted(missing), sorted(extra))
    return {k: fields[k] for k in _KEYS}


# Model shapes. Llama: torchtitan's model args at the commits cited (ffn from ffn_dim_multiplier and multiple_of),
# the same as Meta's released configs; vocab from the tokenizer (Llama 2: 32000, Llama 3: 128256).
_LLAMA2_13B = dict(n_layer=40, n_embd=5120, n_head=40, n_kv_head=40, ffn_hidden=13824, mlp="swiglu",
                   vocab_size=32000, tie_embeddings=False)
_LLAMA2_70B = dict(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn_hidden=28672, mlp="swiglu",
                   vocab_size=32000, tie_embeddings=False)
_LLAMA3_8B = dict(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, mlp="swiglu",
                  vocab_size=128256, tie_embeddings=False)
_LLAMA3_70B = dict(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn_hidden=28672, mlp="swiglu",
                   vocab_size=128256, tie_embeddings=False)
_LLAMA3_405B = dict(n_layer=126, n_embd=16384, n_head=128, n_kv_head=8, ffn_hidden=53248, mlp="swiglu",
                    vocab_size=128256, tie_embeddings=False)


def _gpt(n_layer, n_embd, n_head):
    """Megatron's GPT of the 2021/2022 papers: 4h GELU MLP, multi-head attention, vocab 51200 (padded GPT-2 BPE),
    embeddings tied (the papers' parameter count, Eq. 2 of Narayanan et al., counts V*h once)."""
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_head, ffn_hidden=4 * n_embd, mlp="gelu",
                vocab_size=51200, tie_embeddings=True)


def _mpt(n_layer, n_embd, n_head):
    """llm-foundry's MPT yamls (scripts/train/yamls/pretrain/mpt-*.yaml): expansion_ratio 4 GELU MLP, multi-head
    attention, vocab 50368, embeddings tied (MPT always shares them)."""
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_head, ffn_hidden=4 * n_embd, mlp="gelu",
                vocab_size=50368, tie_embeddings=True)


_MPT_1B, _MPT_3B, _MPT_7B = _mpt(24, 2048, 16), _mpt(32, 2560, 20), _mpt(32, 4096, 32)
_MPT_13B, _MPT_30B, _MPT_70B = _mpt(40, 5120, 40), _mpt(48, 7168, 56), _mpt(80, 8192, 64)



# ---- torchtitan --------------------------------------------------------------------------------------------------
_TT_PERF_URL = ("https://github.com/pytorch/torchtitan/blob/3faaa1a0dee68ce028400e3dafd1735d152cb4f8/"
                "docs/performance.md")
_TT_PERF = "torchtitan docs/performance.md (2024-04 .. 2024-08)"
_TT_FLOPS_TOTAL = ("torchtitan utils.get_num_flop_per_token as of 2024-04: 6 x all parameters (both embedding "
                   "matrices included) + 12*n_layer*n_head*head_dim*seq_len per token (full, non-causal attention; "
                   "recompute not counted); peak 312 TFLOP/s (A100 bf16)")
_TT_FLOPS = ("torchtitan: 6 x parameters without the input embedding (output projection included) + "
             "12*n_layer*n_head*head_dim*seq_len per token (full, non-causal attention; recompute not counted); "
             "divided by 989 TFLOP/s (H100 SXM bf16) even on these lower-power H100s")
_TT_DEC24_URL = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
_TT_DEC24 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12)"
_TT_ATP_URL = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_TT_ATP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (2025-06)"
_TT_H200_URL = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
                "llama3-8b_h200_202506_trainy-whitefiber.md")
_TT_H200 = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (2025-06, Trainy)"
_TT_NO_MFU = ("no per-row MFU reported (the page skips MFU because float8 mixes tensor-core peaks); torchtitan's "
              "counter is 6 x params without input embedding + 12*l*h*q*t per token, vs 989 TFLOP/s")
_TT_GT = ("Meta Grand Teton: 8x H100 per host over NVLink, 96 GB HBM2e, 2.4 TB/s, run at the default 500 W limit "
          "(not a 700 W 80 GB SXM5), 400 Gb/s RDMA per GPU between hosts")

# ---- llm-foundry -------------------------------------------------------------------------------------------------
_FOUNDRY_URL = ("https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d/"
                "scripts/train/benchmarking/README.md")
_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
_FOUNDRY_FLOPS = ("llm-foundry collect_results.py: MFU = (6*n_params*seq + 12*n_layer*d_model*seq^2) per sequence "
                  "x seq/s / (gpus x peak); n_params is the full count (tied embedding once, learned positional "
                  "embedding, biases); attention full (non-causal); HFU multiplies both terms by 4/3 when "
                  "activation checkpointing is on (flash-attention's own recompute not counted); 'Model TFLOP' is "
                  "the MFU numerator per GPU; peaks 312 (A100) and 989 (H100 SXM) TFLOP/s bf16")

# ---- Megatron ----------------------------------------------------------------------------------------------------
_MEG21_URL = "https://arxiv.org/abs/2104.04473"
_MEG21 = "Megatron-LM (Narayanan et al., 2021), Table 1"
_MEG21_FLOPS = ("Narayanan et al. Eq. 3: F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per iteration: GEMMs only, "
                "full (non-causal) attention, logits included, and the extra forward of full recompute INCLUDED, "
                "so the % of peak is an HFU; the same count without recompute (72 instead of 96) gives an MFU of "
                "0.75x; peak 312 TFLOP/s (A100, 16-bit)")
_MEG21_HW = ("Selene: DGX A100, 8x A100 80GB per node over NVLink/NVSwitch, 8x 200 Gb/s HDR InfiniBand per node, "
             "fat tree; end-to-end iteration (data loading, optimizer, logging included)")
_MEG22_URL = "https://arxiv.org/abs/2205.05198"
_MEG22 = "Korthikanti et al., 2022 (selective recompute + sequence parallel), Tables 3 and 5"
_MEG22_FLOPS = ("Korthikanti et al. Eq. 7 (model FLOPs, no recompute): 72*B*L*s*h^2*(1 + s/(6h) + V/(12*h*L)) per "
                "iteration, GEMMs only, full (non-causal) attention, logits included; HFU (Eq. 8) adds selective "
                "recompute's two attention matmuls: s/(3h) in place of s/(6h); peak 312 TFLOP/s (A100)")
_MEG22_HW = ("Selene: 8x A100 80GB per node over NVLink/NVSwitch, 8x 200 Gb/s HDR InfiniBand per node; no data "
             "parallelism (model-parallel group only)")

# ---- Llama 3 -----------------------------------------------------------------------------------------------------
_LLAMA3_URL = "https://arxiv.org/abs/2407.21783"
_LLAMA3 = "The Llama 3 Herd of Models (Llama Team, 2024), Table 4"
_LLAMA3_FLOPS = ("'BF16 MFU' after Chowdhery et al. (PaLM): 6N + attention FLOPs per token, no recompute; the exact "
                 "attention term (causal or not) and peak are not spelled out (TFLOPs/MFU ~ 1000 TFLOP/s, i.e. the "
                 "H100 SXM dense bf16 peak)")
_LLAMA3_HW = ("Meta Grand Teton, H100 SXM 80GB HBM3 at 700 W, 8 per server over NVLink; RoCE 400 Gb/s per GPU, "
              "3-layer Clos (full bisection within 3072-GPU pods, 1:7 oversubscribed above)")


RUNS = [
    # ---- torchtitan (PyTorch-native: FSDP2, TP, PP, CP, torch.compile, float8) ---------------------------------------
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 3 8B, 64x A100, FSDP, selective op AC", gpu="a100", gpus=64,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=64, micro_batch_size=1, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False,
        compile=False, dtype="bfloat16", tokens_per_s_per_gpu=2973.0, tflops_per_gpu=None, mfu=0.582, hfu=None,
        flops_convention=_TT_FLOPS_TOTAL,
        notes=("64x A100 80GB, FSDP2 1D over all 64 ranks; local batch 1 per rank; seq_len 8192 and compile off from"
               " the train config of commit 504e7641 (when the table was written); bf16 compute via FSDP2 mixed "
               "precision (fp32 reduce). Llama 3 table, row '8B | 1 | selective op (per-op SAC)': at 504e7641 "
               "(parallelize_llama.py) it keeps the outputs of mm and the attention kernels but recomputes every "
               "second mm of a block, as torchtitan's per-op policy still does.")),
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 3 8B, 64x A100, FSDP, selective layer AC", gpu="a100", gpus=64,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=64, micro_batch_size=1, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="every_2", sequence_parallel=False,
        compile=False, dtype="bfloat16", tokens_per_s_per_gpu=2904.0, tflops_per_gpu=None, mfu=0.568, hfu=None,
        flops_convention=_TT_FLOPS_TOTAL,
        notes=("64x A100 80GB, FSDP2 1D over all 64 ranks; local batch 1 per rank; seq_len 8192 and compile off from"
               " the train config of commit 504e7641 (when the table was written); bf16 compute via FSDP2 mixed "
               "precision (fp32 reduce). Llama 3 table, row '8B | 1 | selective layer (per-layer SAC: whole blocks "
               "checkpointed at a stride the doc does not give)'; every second block, inferred: the stride "
               "config_manager.py defaulted to at 504e7641 (selective_ac_option '2').")),
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 3 70B, 64x A100, FSDP, full AC", gpu="a100", gpus=64,
        **_LLAMA3_70B, seq_len=8192, global_batch_size=64, micro_batch_size=1, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=False,
        dtype="bfloat16", tokens_per_s_per_gpu=331.0, tflops_per_gpu=None, mfu=0.517, hfu=None,
        flops_convention=_TT_FLOPS_TOTAL,
        notes=("64x A100 80GB, FSDP2 1D over all 64 ranks; local batch 1 per rank; seq_len 8192 and compile off from"
               " the train config of commit 504e7641 (when the table was written); bf16 compute via FSDP2 mixed "
               "precision (fp32 reduce). Llama 3 table, row '70B | 1 | full'.")),
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 2 13B, 64x A100, FSDP, no AC", gpu="a100", gpus=64,
        **_LLAMA2_13B, seq_len=4096, global_batch_size=128, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=False,
        dtype="bfloat16", tokens_per_s_per_gpu=2162.0, tflops_per_gpu=None, mfu=0.611, hfu=None,
        flops_convention=_TT_FLOPS_TOTAL,
        notes=("64x A100 80GB, FSDP2 1D over all 64 ranks; local batch 2 per rank; seq_len 4096 and compile off from"
               " the train config of commit 504e7641 (when the table was written); bf16 compute via FSDP2 mixed "
               "precision (fp32 reduce). Llama 2 table, row '13B | 2 | no'.")),
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 2 70B, 64x A100, FSDP, full AC", gpu="a100", gpus=64,
        **_LLAMA2_70B, seq_len=4096, global_batch_size=128, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=False,
        dtype="bfloat16", tokens_per_s_per_gpu=353.0, tflops_per_gpu=None, mfu=0.505, hfu=None,
        flops_convention=_TT_FLOPS_TOTAL,
        notes=("64x A100 80GB, FSDP2 1D over all 64 ranks; local batch 2 per rank; seq_len 4096 and compile off from"
               " the train config of commit 504e7641 (when the table was written); bf16 compute via FSDP2 mixed "
               "precision (fp32 reduce). Llama 2 table, row '70B | 2 | full'.")),
    _row(
        source=_TT_PERF, url=_TT_PERF_URL, name="Llama 3.1 405B, 128x H100, FSDP 16 x TP 8, bf16", gpu="h100", gpus=128,
        **_LLAMA3_405B, seq_len=8192, global_batch_size=32, micro_batch_size=2, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=True, compile=None,
        dtype="bfloat16", tokens_per_s_per_gpu=109.0, tflops_per_gpu=None, mfu=0.29, hfu=None,
        flops_convention=_TT_FLOPS,
        notes=("Llama 3.1 table (added 2024-08), row '405B | 2 | full | 109 | 29.0% | None' (no float8, no async "
               "TP). 128 H100 with 94-95 GB HBM2e at lower TDP than SXM5; the doc warns its MFU is understated "
               "because it divides by the SXM peak. FSDP 16 x TP 8, local batch 2, global 32; seq_len 8192 from the "
               "405B train config; whether torch.compile was on is not stated (the config of the day had compile = "
               "true). TP uses torchtitan's plan with sequence-parallel norms.")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 8B, 8x H100, FSDP", gpu="h100", gpus=8, **_LLAMA3_8B,
        seq_len=8192, global_batch_size=16, micro_batch_size=2, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False, compile=False, dtype="bfloat16",
        tokens_per_s_per_gpu=5762.0, tflops_per_gpu=None, mfu=None, hfu=None, flops_convention=_TT_NO_MFU,
        notes=("Table 1 row 'FSDP': 8 GPUs, local batch 2, global 16, selective AC (per-op SAC in the config). "
               "Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it). The page's text puts the 1D bf16 8B runs (8 or 128 GPUs) at 33% to 39% MFU, understated by the "
               "SXM peak; the throughputs make the compiled runs the 39% end (its 'respectively' reads the other "
               "way).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 8B, 8x H100, FSDP + compile", gpu="h100", gpus=8,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=16, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False,
        compile=True, dtype="bfloat16", tokens_per_s_per_gpu=6667.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 1 row 'FSDP + torch.compile'. Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it). The page's text puts the 1D bf16 8B runs (8 or 128 GPUs) at 33% to 39% MFU, understated by the "
               "SXM peak; the throughputs make the compiled runs the 39% end (its 'respectively' reads the other "
               "way).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 8B, 128x H100, FSDP", gpu="h100", gpus=128, **_LLAMA3_8B,
        seq_len=8192, global_batch_size=256, micro_batch_size=2, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False, compile=False, dtype="bfloat16",
        tokens_per_s_per_gpu=5605.0, tflops_per_gpu=None, mfu=None, hfu=None, flops_convention=_TT_NO_MFU,
        notes=("Table 3 row 'FSDP': 128 GPUs, local batch 2, global 256, selective AC. Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it). The page's text puts the 1D bf16 8B runs (8 or 128 GPUs) at 33% to 39% MFU, understated by the "
               "SXM peak; the throughputs make the compiled runs the 39% end (its 'respectively' reads the other "
               "way).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 8B, 128x H100, FSDP + compile", gpu="h100", gpus=128,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=256, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False,
        compile=True, dtype="bfloat16", tokens_per_s_per_gpu=6514.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 3 row 'FSDP + torch.compile'. Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it). The page's text puts the 1D bf16 8B runs (8 or 128 GPUs) at 33% to 39% MFU, understated by the "
               "SXM peak; the throughputs make the compiled runs the 39% end (its 'respectively' reads the other "
               "way).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 70B, 256x H100, FSDP 32 x TP 8, float8", gpu="h100",
        gpus=256, **_LLAMA3_70B, seq_len=8192, global_batch_size=512, micro_batch_size=16, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=True, compile=True,
        dtype="float8", tokens_per_s_per_gpu=829.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 4 row '2D': FSDP 32 x TP 8, local batch 16, global 512, full AC, compile, float8 linears "
               "(attention stays bf16). TP with sequence-parallel norms (torchtitan's TP plan). Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 70B, 256x H100, FSDP 32 x async TP 8, float8", gpu="h100",
        gpus=256, **_LLAMA3_70B, seq_len=8192, global_batch_size=512, micro_batch_size=16, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=True, compile=True,
        dtype="float8", tokens_per_s_per_gpu=876.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 4 row '2D + AsyncTP': as the '2D' row plus async TP (micro-pipelined TP collectives overlapped"
               " with the matmuls). Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL, name="Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x PP 8 (1F1B), float8",
        gpu="h100", gpus=512, **_LLAMA3_405B, seq_len=8192, global_batch_size=256, micro_batch_size=None, tp=8, pp=8,
        pp_virtual=1, pp_schedule="1f1b", cp=1, data="zero2", activation_checkpointing="full", sequence_parallel=True,
        compile=True, dtype="float8", tokens_per_s_per_gpu=100.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 5 row '1F1B': FSDP 8 x TP 8 x PP 8, local batch 32, global 256, full AC, compile, float8, "
               "async TP; micro-batch count not given. data='zero2' because torchtitan sets "
               "reshard_after_forward=False on FSDP when PP is on (parameters stay gathered from forward to "
               "backward, SHARD_GRAD_OP-like). Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it).")),
    _row(
        source=_TT_DEC24, url=_TT_DEC24_URL,
        name="Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x PP 8 (interleaved 1F1B), float8", gpu="h100", gpus=512,
        **_LLAMA3_405B, seq_len=8192, global_batch_size=256, micro_batch_size=None, tp=8, pp=8, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="zero2", activation_checkpointing="full", sequence_parallel=True,
        compile=True, dtype="float8", tokens_per_s_per_gpu=128.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Table 5 row 'Interleaved 1F1B': as the 1F1B row with torchtitan's interleaved schedule; stages per "
               "rank not given. data='zero2': see the 1F1B row. Hardware: " +
               _TT_GT +
               ". seq_len 8192 is the llama3 train config default at torchtitan 9dec370 (the page does not restate "
               "it).")),
    _row(
        source=_TT_ATP, url=_TT_ATP_URL, name="Llama 3 70B, 256x H100, FSDP 32 x TP 8, bf16", gpu="h100", gpus=256,
        **_LLAMA3_70B, seq_len=8192, global_batch_size=512, micro_batch_size=16, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=True, compile=True,
        dtype="bfloat16", tokens_per_s_per_gpu=597.3, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Row 'None (bfloat16)', column 'Vanilla TP'. FSDP 32 x TP 8, compile, local batch 16 (global 512 = "
               "local x FSDP degree, derived); the column says tokens/sec, taken as per GPU as torchtitan logs it "
               "(consistent with the 2024-12 page). seq_len 8192 from the llama3 train config at torchtitan 820504e."
               " TP with sequence-parallel norms. Hardware: " +
               _TT_GT +
               ".")),
    _row(
        source=_TT_ATP, url=_TT_ATP_URL, name="Llama 3 70B, 256x H100, FSDP 32 x async TP 8, bf16", gpu="h100",
        gpus=256, **_LLAMA3_70B, seq_len=8192, global_batch_size=512, micro_batch_size=16, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=True, compile=True,
        dtype="bfloat16", tokens_per_s_per_gpu=652.4, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Row 'None (bfloat16)', column 'Async TP'. FSDP 32 x TP 8, compile, local batch 16 (global 512 = "
               "local x FSDP degree, derived); the column says tokens/sec, taken as per GPU as torchtitan logs it "
               "(consistent with the 2024-12 page). seq_len 8192 from the llama3 train config at torchtitan 820504e."
               " TP with sequence-parallel norms. Hardware: " +
               _TT_GT +
               ".")),
    _row(
        source=_TT_ATP, url=_TT_ATP_URL, name="Llama 3 8B, 64x H100, FSDP 8 x TP 8, bf16", gpu="h100", gpus=64,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=96, micro_batch_size=12, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=True, compile=True,
        dtype="bfloat16", tokens_per_s_per_gpu=4378.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Row 'None (bfloat16)', column 'Vanilla TP'. FSDP 8 x TP 8, compile, local batch 12 (global 96 = "
               "local x FSDP degree, derived); the column says tokens/sec, taken as per GPU as torchtitan logs it "
               "(consistent with the 2024-12 page). seq_len 8192 from the llama3 train config at torchtitan 820504e."
               " TP with sequence-parallel norms. Hardware: " +
               _TT_GT +
               ".")),
    _row(
        source=_TT_ATP, url=_TT_ATP_URL, name="Llama 3 8B, 64x H100, FSDP 8 x async TP 8, bf16", gpu="h100", gpus=64,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=96, micro_batch_size=12, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=True, compile=True,
        dtype="bfloat16", tokens_per_s_per_gpu=4809.4, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("Row 'None (bfloat16)', column 'Async TP'. FSDP 8 x TP 8, compile, local batch 12 (global 96 = local "
               "x FSDP degree, derived); the column says tokens/sec, taken as per GPU as torchtitan logs it "
               "(consistent with the 2024-12 page). seq_len 8192 from the llama3 train config at torchtitan 820504e."
               " TP with sequence-parallel norms. Hardware: " +
               _TT_GT +
               ".")),
    _row(
        source=_TT_H200, url=_TT_H200_URL, name="Llama 3.1 8B, 32x H200, FSDP, float8", gpu="h200", gpus=32,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=64, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False,
        compile=True, dtype="float8", tokens_per_s_per_gpu=10938.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("NUM_NODES=4 row, TPS sampled at step 100. 4 hosts x 8 H200 over NVLink, 400 Gb/s CX-7 RDMA per GPU. "
               "llama3_8b.toml at torchtitan e7c0cae (seq_len 8192, per-op selective AC, FSDP over all ranks) with "
               "local batch 2, compile, float8 linears with float8 FSDP all-gather and precomputed scales.")),
    _row(
        source=_TT_H200, url=_TT_H200_URL, name="Llama 3.1 8B, 64x H200, FSDP, float8", gpu="h200", gpus=64,
        **_LLAMA3_8B, seq_len=8192, global_batch_size=128, micro_batch_size=2, tp=1, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="fsdp", activation_checkpointing="selective-alternate", sequence_parallel=False,
        compile=True, dtype="float8", tokens_per_s_per_gpu=10753.0, tflops_per_gpu=None, mfu=None, hfu=None,
        flops_convention=_TT_NO_MFU,
        notes=("NUM_NODES=8 row, TPS sampled at step 100. 8 hosts x 8 H200 over NVLink, 400 Gb/s CX-7 RDMA per GPU. "
               "llama3_8b.toml at torchtitan e7c0cae (seq_len 8192, per-op selective AC, FSDP over all ranks) with "
               "local batch 2, compile, float8 linears with float8 FSDP all-gather and precomputed scales.")),
    # ---- mosaicml/llm-foundry MPT benchmarks (Composer + PyTorch FSDP, flash attention) ------------------------------
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-70B, seq 2048, 512x H100 80GB", gpu="h100", gpus=512, **_MPT_70B,
        seq_len=2048, global_batch_size=4096, micro_batch_size=8, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=1007.0, tflops_per_gpu=408.0, mfu=0.4125, hfu=0.55, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. Composer FSDP FULL_SHARD, precision amp_bf16, "
               "FSDP mixed_precision DEFAULT; grad accum 1; block-level activation checkpointing; reported 251 "
               "seq/s, 515636 tok/s total, NumParams 64862437376 (MPT default config: learned positional embedding "
               "of max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-13B, seq 2048, 512x H100 80GB", gpu="h100", gpus=512, **_MPT_13B,
        seq_len=2048, global_batch_size=8192, micro_batch_size=16, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=4952.0, tflops_per_gpu=406.0, mfu=0.4112, hfu=0.5483, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. Composer FSDP FULL_SHARD, precision amp_bf16, "
               "FSDP mixed_precision DEFAULT; grad accum 1; block-level activation checkpointing; reported 1238 "
               "seq/s, 2535811 tok/s total, NumParams 12853954560 (MPT default config: learned positional embedding "
               "of max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-7B, seq 2048, 512x H100 80GB", gpu="h100", gpus=512, **_MPT_7B,
        seq_len=2048, global_batch_size=3072, micro_batch_size=6, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=9670.0, tflops_per_gpu=417.0, mfu=0.422, hfu=0.422, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. Composer FSDP FULL_SHARD, precision amp_bf16, "
               "FSDP mixed_precision DEFAULT; grad accum 1; no activation checkpointing; reported 2417 seq/s, "
               "4951479 tok/s total, NumParams 6658859008 (MPT default config: learned positional embedding of "
               "max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-3B, seq 2048, 512x H100 80GB", gpu="h100", gpus=512, **_MPT_3B,
        seq_len=2048, global_batch_size=4096, micro_batch_size=8, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="zero2", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=21664.0, tflops_per_gpu=388.0, mfu=0.3924, hfu=0.3924, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. Composer FSDP SHARD_GRAD_OP, precision amp_bf16, "
               "FSDP mixed_precision DEFAULT; grad accum 1; no activation checkpointing; reported 5416 seq/s, "
               "11092218 tok/s total, NumParams 2651837440 (MPT default config: learned positional embedding of "
               "max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-70B, seq 2048, 64x H100 80GB", gpu="h100", gpus=64, **_MPT_70B,
        seq_len=2048, global_batch_size=2048, micro_batch_size=8, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=1039.0, tflops_per_gpu=421.0, mfu=0.4257, hfu=0.5676, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16'. Composer FSDP FULL_SHARD, precision amp_bf16, FSDP mixed_precision DEFAULT; "
               "grad accum 4; block-level activation checkpointing; reported 32 seq/s, 66523 tok/s total, NumParams "
               "64862437376 (MPT default config: learned positional embedding of max_seq_len x d_model, biases, "
               "LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-30B, seq 2048, 32x H100 80GB", gpu="h100", gpus=32, **_MPT_30B,
        seq_len=2048, global_batch_size=1344, micro_batch_size=14, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=2308.0, tflops_per_gpu=434.0, mfu=0.4392, hfu=0.5857, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16'. Composer FSDP FULL_SHARD, precision amp_bf16, FSDP mixed_precision DEFAULT; "
               "grad accum 3; block-level activation checkpointing; reported 36 seq/s, 73860 tok/s total, NumParams "
               "29975214080 (MPT default config: learned positional embedding of max_seq_len x d_model, biases, "
               "LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-7B, seq 8192, 8x H100 80GB", gpu="h100", gpus=8, **_MPT_7B,
        seq_len=8192, global_batch_size=128, micro_batch_size=8, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=6935.0, tflops_per_gpu=367.0, mfu=0.3714, hfu=0.4952, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16'. Composer FSDP FULL_SHARD, precision amp_bf16, FSDP mixed_precision DEFAULT; "
               "grad accum 2; block-level activation checkpointing; reported 6 seq/s, 55481 tok/s total, NumParams "
               "6684024832 (MPT default config: learned positional embedding of max_seq_len x d_model, biases, "
               "LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-7B, seq 2048, 8x H100 80GB", gpu="h100", gpus=8, **_MPT_7B,
        seq_len=2048, global_batch_size=48, micro_batch_size=6, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=10643.0, tflops_per_gpu=459.0, mfu=0.4644, hfu=0.4644, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16'. Composer FSDP FULL_SHARD, precision amp_bf16, FSDP mixed_precision DEFAULT; "
               "grad accum 1; no activation checkpointing; reported 41 seq/s, 85144 tok/s total, NumParams "
               "6658859008 (MPT default config: learned positional embedding of max_seq_len x d_model, biases, "
               "LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-1B, seq 32768, 8x H100 80GB", gpu="h100", gpus=8, **_MPT_1B,
        seq_len=32768, global_batch_size=32, micro_batch_size=1, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=12025.0, tflops_per_gpu=331.0, mfu=0.3354, hfu=0.3354, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'H100 80GB BF16'. Composer FSDP FULL_SHARD, precision amp_bf16, FSDP mixed_precision DEFAULT; "
               "grad accum 4; no activation checkpointing; reported 2 seq/s, 96203 tok/s total, NumParams 1378865152"
               " (MPT default config: learned positional embedding of max_seq_len x d_model, biases, LayerNorm, GELU"
               " MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-70B, seq 2048, 64x A100 80GB", gpu="a100", gpus=64, **_MPT_70B,
        seq_len=2048, global_batch_size=2048, micro_batch_size=8, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=410.0, tflops_per_gpu=166.0, mfu=0.5333, hfu=0.711, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'. Composer FSDP FULL_SHARD, precision "
               "bf16, FSDP mixed_precision PURE; grad accum 4; block-level activation checkpointing; reported 12 "
               "seq/s, 26274 tok/s total, NumParams 64862437376 (MPT default config: learned positional embedding of"
               " max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-13B, seq 2048, 8x A100 80GB", gpu="a100", gpus=8, **_MPT_13B,
        seq_len=2048, global_batch_size=48, micro_batch_size=2, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=2262.0, tflops_per_gpu=185.0, mfu=0.5957, hfu=0.5957, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'. Composer FSDP FULL_SHARD, precision "
               "amp_bf16, FSDP mixed_precision DEFAULT; grad accum 3; no activation checkpointing; reported 8 seq/s,"
               " 18097 tok/s total, NumParams 12853954560 (MPT default config: learned positional embedding of "
               "max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-7B, seq 2048, 8x A100 80GB", gpu="a100", gpus=8, **_MPT_7B,
        seq_len=2048, global_batch_size=96, micro_batch_size=6, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="none", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=4641.0, tflops_per_gpu=200.0, mfu=0.6423, hfu=0.6423, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'. Composer FSDP FULL_SHARD, precision "
               "amp_bf16, FSDP mixed_precision DEFAULT; grad accum 2; no activation checkpointing; reported 18 "
               "seq/s, 37130 tok/s total, NumParams 6658859008 (MPT default config: learned positional embedding of "
               "max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-70B, seq 2048, 128x A100 40GB", gpu="a100_40gb", gpus=128,
        **_MPT_70B, seq_len=2048, global_batch_size=512, micro_batch_size=4, tp=1, pp=1, pp_virtual=1, pp_schedule=None,
        cp=1, data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=376.0, tflops_per_gpu=152.0, mfu=0.4891, hfu=0.6521, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'. Composer FSDP FULL_SHARD, precision "
               "bf16, FSDP mixed_precision PURE; grad accum 1; block-level activation checkpointing; reported 23 "
               "seq/s, 48194 tok/s total, NumParams 64862437376 (MPT default config: learned positional embedding of"
               " max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    _row(
        source=_FOUNDRY, url=_FOUNDRY_URL, name="MPT-7B, seq 2048, 64x A100 40GB", gpu="a100_40gb", gpus=64, **_MPT_7B,
        seq_len=2048, global_batch_size=1152, micro_batch_size=18, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="fsdp", activation_checkpointing="full", sequence_parallel=False, compile=None, dtype="bfloat16",
        tokens_per_s_per_gpu=3665.0, tflops_per_gpu=158.0, mfu=0.5073, hfu=0.6764, flops_convention=_FOUNDRY_FLOPS,
        notes=("Table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'. Composer FSDP FULL_SHARD, precision "
               "bf16, FSDP mixed_precision PURE; grad accum 1; block-level activation checkpointing; reported 114 "
               "seq/s, 234614 tok/s total, NumParams 6658859008 (MPT default config: learned positional embedding of"
               " max_seq_len x d_model, biases, LayerNorm, GELU MLP 4x, tied embeddings, flash attention).")),
    # ---- Megatron-LM, Narayanan et al. 2021, Table 1 (weak scaling on Selene, A100 80GB) -----------------------------
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 1.7B, 32x A100", gpu="a100", gpus=32, **_gpt(24, 2304, 24),
        seq_len=2048, global_batch_size=512, micro_batch_size=None, tp=1, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False, dtype=None,
        tokens_per_s_per_gpu=None, tflops_per_gpu=137.0, mfu=None, hfu=0.44, flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 1.7B params, 24 heads, hidden 2304, 24 layers, TP 1, PP 1, 32 GPUs, batch 512, 137 "
               "TFLOP/s per GPU, 44% of peak, 4.4 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). No "
               "pipeline; full activation recomputation (Eq. 3 assumes it); micro-batch size not given; '16-bit "
               "mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~9288 tokens/s per GPU (a derived "
               "figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 3.6B, 64x A100", gpu="a100", gpus=64, **_gpt(30, 3072, 32),
        seq_len=2048, global_batch_size=512, micro_batch_size=None, tp=2, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False, dtype=None,
        tokens_per_s_per_gpu=None, tflops_per_gpu=138.0, mfu=None, hfu=0.44, flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 3.6B params, 32 heads, hidden 3072, 30 layers, TP 2, PP 1, 64 GPUs, batch 512, 138 "
               "TFLOP/s per GPU, 44% of peak, 8.8 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). No "
               "pipeline; full activation recomputation (Eq. 3 assumes it); micro-batch size not given; '16-bit "
               "mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~4431 tokens/s per GPU (a derived "
               "figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 7.5B, 128x A100", gpu="a100", gpus=128, **_gpt(36, 4096, 32),
        seq_len=2048, global_batch_size=512, micro_batch_size=None, tp=4, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False, dtype=None,
        tokens_per_s_per_gpu=None, tflops_per_gpu=142.0, mfu=None, hfu=0.46, flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 7.5B params, 32 heads, hidden 4096, 36 layers, TP 4, PP 1, 128 GPUs, batch 512, 142 "
               "TFLOP/s per GPU, 46% of peak, 18.2 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). No "
               "pipeline; full activation recomputation (Eq. 3 assumes it); micro-batch size not given; '16-bit "
               "mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~2216 tokens/s per GPU (a derived "
               "figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 18.4B, 256x A100", gpu="a100", gpus=256, **_gpt(40, 6144, 48),
        seq_len=2048, global_batch_size=1024, micro_batch_size=None, tp=8, pp=1, pp_virtual=1, pp_schedule=None, cp=1,
        data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False, dtype=None,
        tokens_per_s_per_gpu=None, tflops_per_gpu=135.0, mfu=None, hfu=0.43, flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 18.4B params, 48 heads, hidden 6144, 40 layers, TP 8, PP 1, 256 GPUs, batch 1024, 135 "
               "TFLOP/s per GPU, 43% of peak, 34.6 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). No "
               "pipeline; full activation recomputation (Eq. 3 assumes it); micro-batch size not given; '16-bit "
               "mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~872 tokens/s per GPU (a derived "
               "figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 39.1B, 512x A100", gpu="a100", gpus=512, **_gpt(48, 8192, 64),
        seq_len=2048, global_batch_size=1536, micro_batch_size=None, tp=8, pp=2, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=138.0, mfu=None, hfu=0.44,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 39.1B params, 64 heads, hidden 8192, 48 layers, TP 8, PP 2, 512 GPUs, batch 1536, 138 "
               "TFLOP/s per GPU, 44% of peak, 70.8 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). The "
               "section says the Table 1 runs use the interleaved schedule with the scatter/gather optimization "
               "(chunks per rank not given); full activation recomputation (Eq. 3 assumes it); micro-batch size not "
               "given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~425 tokens/s per "
               "GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 76.1B, 1024x A100", gpu="a100", gpus=1024, **_gpt(60, 10240, 80),
        seq_len=2048, global_batch_size=1792, micro_batch_size=None, tp=8, pp=4, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=140.0, mfu=None, hfu=0.45,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 76.1B params, 80 heads, hidden 10240, 60 layers, TP 8, PP 4, 1024 GPUs, batch 1792, 140"
               " TFLOP/s per GPU, 45% of peak, 143.8 PFLOP/s aggregate. Data parallel 32 (plain DDP all-reduce). The"
               " section says the Table 1 runs use the interleaved schedule with the scatter/gather optimization "
               "(chunks per rank not given); full activation recomputation (Eq. 3 assumes it); micro-batch size not "
               "given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~223 tokens/s per "
               "GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 145.6B, 1536x A100", gpu="a100", gpus=1536, **_gpt(80, 12288, 96),
        seq_len=2048, global_batch_size=2304, micro_batch_size=None, tp=8, pp=8, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=148.0, mfu=None, hfu=0.47,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 145.6B params, 96 heads, hidden 12288, 80 layers, TP 8, PP 8, 1536 GPUs, batch 2304, "
               "148 TFLOP/s per GPU, 47% of peak, 227.1 PFLOP/s aggregate. Data parallel 24 (plain DDP all-reduce). "
               "The section says the Table 1 runs use the interleaved schedule with the scatter/gather optimization "
               "(chunks per rank not given); full activation recomputation (Eq. 3 assumes it); micro-batch size not "
               "given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~124 tokens/s per "
               "GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 310.1B, 1920x A100", gpu="a100", gpus=1920, **_gpt(96, 16384, 128),
        seq_len=2048, global_batch_size=2160, micro_batch_size=None, tp=8, pp=16, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=155.0, mfu=None, hfu=0.5,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 310.1B params, 128 heads, hidden 16384, 96 layers, TP 8, PP 16, 1920 GPUs, batch 2160, "
               "155 TFLOP/s per GPU, 50% of peak, 297.4 PFLOP/s aggregate. Data parallel 15 (plain DDP all-reduce). "
               "The section says the Table 1 runs use the interleaved schedule with the scatter/gather optimization "
               "(chunks per rank not given); full activation recomputation (Eq. 3 assumes it); micro-batch size not "
               "given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~61 tokens/s per "
               "GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 529.6B, 2520x A100", gpu="a100", gpus=2520, **_gpt(105, 20480, 128),
        seq_len=2048, global_batch_size=2520, micro_batch_size=None, tp=8, pp=35, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=163.0, mfu=None, hfu=0.52,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 529.6B params, 128 heads, hidden 20480, 105 layers, TP 8, PP 35, 2520 GPUs, batch 2520,"
               " 163 TFLOP/s per GPU, 52% of peak, 410.2 PFLOP/s aggregate. Data parallel 9 (plain DDP all-reduce). "
               "The section says the Table 1 runs use the interleaved schedule with the scatter/gather optimization "
               "(chunks per rank not given); full activation recomputation (Eq. 3 assumes it); micro-batch size not "
               "given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. 3: ~38 tokens/s per "
               "GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    _row(
        source=_MEG21, url=_MEG21_URL, name="GPT 1008.0B, 3072x A100", gpu="a100", gpus=3072, **_gpt(128, 25600, 160),
        seq_len=2048, global_batch_size=3072, micro_batch_size=None, tp=8, pp=64, pp_virtual=None,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False,
        compile=False, dtype=None, tokens_per_s_per_gpu=None, tflops_per_gpu=163.0, mfu=None, hfu=0.52,
        flops_convention=_MEG21_FLOPS,
        notes=("Table 1 row: 1008.0B params, 160 heads, hidden 25600, 128 layers, TP 8, PP 64, 3072 GPUs, batch "
               "3072, 163 TFLOP/s per GPU, 52% of peak, 502.0 PFLOP/s aggregate. Data parallel 6 (plain DDP "
               "all-reduce). The section says the Table 1 runs use the interleaved schedule with the scatter/gather "
               "optimization (chunks per rank not given); full activation recomputation (Eq. 3 assumes it); "
               "micro-batch size not given; '16-bit mixed precision' only (fp16 vs bf16 not stated). Inverting Eq. "
               "3: ~20 tokens/s per GPU (a derived figure, not reported). " +
               _MEG21_HW +
               ".")),
    # ---- Korthikanti et al. 2022, Tables 3 and 5 (selective recompute and sequence parallelism) ----------------------
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 22B, 8x A100, TP 8 x PP 1, full recompute", gpu="a100", gpus=8,
        **_gpt(48, 6144, 64), seq_len=2048, global_batch_size=4, micro_batch_size=4, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False,
        dtype=None, tokens_per_s_per_gpu=721.13, tflops_per_gpu=None, mfu=None, hfu=None, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Full Recompute' column: 1.42 s per iteration (baseline: full activation recomputation, no "
               "sequence parallelism); MFU/HFU are given only for the present-work column. tokens_per_s_per_gpu "
               "derived = global_batch*seq/(iteration time*GPUs). Table 3 config: 64 heads, hidden 6144, 48 layers, "
               "TP 8, PP 1, 8 GPUs, global batch 4, micro-batch 4; no pipeline; '16-bit mixed precision' (fp16 vs "
               "bf16 not stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 22B, 8x A100, TP 8 x PP 1, selective recompute + SP", gpu="a100",
        gpus=8, **_gpt(48, 6144, 64), seq_len=2048, global_batch_size=4, micro_batch_size=4, tp=8, pp=1, pp_virtual=1,
        pp_schedule=None, cp=1, data="ddp", activation_checkpointing="selective", sequence_parallel=True, compile=False,
        dtype=None, tokens_per_s_per_gpu=930.91, tflops_per_gpu=None, mfu=0.415, hfu=0.437,
        flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Present Work' column: 1.10 s per iteration with sequence parallelism and selective "
               "activation recomputation; MFU 41.5%, HFU 43.7%. tokens_per_s_per_gpu derived = "
               "global_batch*seq/(iteration time*GPUs). Table 3 config: 64 heads, hidden 6144, 48 layers, TP 8, PP "
               "1, 8 GPUs, global batch 4, micro-batch 4; no pipeline; '16-bit mixed precision' (fp16 vs bf16 not "
               "stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 175B (GPT-3), 64x A100, TP 8 x PP 8, full recompute", gpu="a100",
        gpus=64, **_gpt(96, 12288, 96), seq_len=2048, global_batch_size=64, micro_batch_size=1, tp=8, pp=8,
        pp_virtual=3, pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full",
        sequence_parallel=False, compile=False, dtype=None, tokens_per_s_per_gpu=112.96, tflops_per_gpu=None, mfu=None,
        hfu=None, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Full Recompute' column: 18.13 s per iteration (baseline: full activation recomputation, no "
               "sequence parallelism); MFU/HFU are given only for the present-work column. tokens_per_s_per_gpu "
               "derived = global_batch*seq/(iteration time*GPUs). Table 3 config: 96 heads, hidden 12288, 96 layers,"
               " TP 8, PP 8, 64 GPUs, global batch 64, micro-batch 1; interleaved schedule with 3 chunks per rank "
               "(Section 6); '16-bit mixed precision' (fp16 vs bf16 not stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 175B (GPT-3), 64x A100, TP 8 x PP 8, selective recompute + SP",
        gpu="a100", gpus=64, **_gpt(96, 12288, 96), seq_len=2048, global_batch_size=64, micro_batch_size=1, tp=8, pp=8,
        pp_virtual=3, pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="selective",
        sequence_parallel=True, compile=False, dtype=None, tokens_per_s_per_gpu=148.95, tflops_per_gpu=None, mfu=0.514,
        hfu=0.528, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Present Work' column: 13.75 s per iteration with sequence parallelism and selective "
               "activation recomputation; MFU 51.4%, HFU 52.8%. tokens_per_s_per_gpu derived = "
               "global_batch*seq/(iteration time*GPUs). Table 3 config: 96 heads, hidden 12288, 96 layers, TP 8, PP "
               "8, 64 GPUs, global batch 64, micro-batch 1; interleaved schedule with 3 chunks per rank (Section 6);"
               " '16-bit mixed precision' (fp16 vs bf16 not stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 530B (MT-NLG), 280x A100, TP 8 x PP 35, full recompute", gpu="a100",
        gpus=280, **_gpt(105, 20480, 128), seq_len=2048, global_batch_size=280, micro_batch_size=1, tp=8, pp=35,
        pp_virtual=3, pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="full",
        sequence_parallel=False, compile=False, dtype=None, tokens_per_s_per_gpu=41.75, tflops_per_gpu=None, mfu=None,
        hfu=None, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Full Recompute' column: 49.05 s per iteration (baseline: full activation recomputation, no "
               "sequence parallelism); MFU/HFU are given only for the present-work column. tokens_per_s_per_gpu "
               "derived = global_batch*seq/(iteration time*GPUs). Table 3 config: 128 heads, hidden 20480, 105 "
               "layers, TP 8, PP 35, 280 GPUs, global batch 280, micro-batch 1; interleaved schedule with 3 chunks "
               "per rank (Section 6); '16-bit mixed precision' (fp16 vs bf16 not stated); output-tensor deallocation"
               " on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 530B (MT-NLG), 280x A100, TP 8 x PP 35, selective recompute + SP",
        gpu="a100", gpus=280, **_gpt(105, 20480, 128), seq_len=2048, global_batch_size=280, micro_batch_size=1, tp=8,
        pp=35, pp_virtual=3, pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="selective",
        sequence_parallel=True, compile=False, dtype=None, tokens_per_s_per_gpu=54.14, tflops_per_gpu=None, mfu=0.56,
        hfu=0.57, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Present Work' column: 37.83 s per iteration with sequence parallelism and selective "
               "activation recomputation; MFU 56.0%, HFU 57.0%. tokens_per_s_per_gpu derived = "
               "global_batch*seq/(iteration time*GPUs). Table 3 config: 128 heads, hidden 20480, 105 layers, TP 8, "
               "PP 35, 280 GPUs, global batch 280, micro-batch 1; interleaved schedule with 3 chunks per rank "
               "(Section 6); '16-bit mixed precision' (fp16 vs bf16 not stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 1T, 512x A100, TP 8 x PP 64, full recompute", gpu="a100", gpus=512,
        **_gpt(128, 25600, 160), seq_len=2048, global_batch_size=512, micro_batch_size=1, tp=8, pp=64, pp_virtual=1,
        pp_schedule="1f1b", cp=1, data="ddp", activation_checkpointing="full", sequence_parallel=False, compile=False,
        dtype=None, tokens_per_s_per_gpu=21.69, tflops_per_gpu=None, mfu=None, hfu=None, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Full Recompute' column: 94.42 s per iteration (baseline: full activation recomputation, no "
               "sequence parallelism); MFU/HFU are given only for the present-work column. tokens_per_s_per_gpu "
               "derived = global_batch*seq/(iteration time*GPUs). Table 3 config: 160 heads, hidden 25600, 128 "
               "layers, TP 8, PP 64, 512 GPUs, global batch 512, micro-batch 1; pipeline schedule not named; the "
               "paper names interleaving only for 175B and 530B, so 1F1B is assumed; '16-bit mixed precision' (fp16 "
               "vs bf16 not stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL, name="GPT 1T, 512x A100, TP 8 x PP 64, selective recompute + SP", gpu="a100",
        gpus=512, **_gpt(128, 25600, 160), seq_len=2048, global_batch_size=512, micro_batch_size=1, tp=8, pp=64,
        pp_virtual=1, pp_schedule="1f1b", cp=1, data="ddp", activation_checkpointing="selective",
        sequence_parallel=True, compile=False, dtype=None, tokens_per_s_per_gpu=28.65, tflops_per_gpu=None, mfu=0.563,
        hfu=0.57, flops_convention=_MEG22_FLOPS,
        notes=("Table 5 'Present Work' column: 71.49 s per iteration with sequence parallelism and selective "
               "activation recomputation; MFU 56.3%, HFU 57.0%. tokens_per_s_per_gpu derived = "
               "global_batch*seq/(iteration time*GPUs). Table 3 config: 160 heads, hidden 25600, 128 layers, TP 8, "
               "PP 64, 512 GPUs, global batch 512, micro-batch 1; pipeline schedule not named; the paper names "
               "interleaving only for 175B and 530B, so 1F1B is assumed; '16-bit mixed precision' (fp16 vs bf16 not "
               "stated); output-tensor deallocation on. " +
               _MEG22_HW +
               ".")),
    _row(
        source=_MEG22, url=_MEG22_URL,
        name="GPT 530B (MT-NLG), 2240x A100, TP 8 x PP 35 x DP 8, selective recompute + SP", gpu="a100", gpus=2240,
        **_gpt(105, 20480, 128), seq_len=2048, global_batch_size=2240, micro_batch_size=1, tp=8, pp=35, pp_virtual=3,
        pp_schedule="interleaved_1f1b", cp=1, data="ddp", activation_checkpointing="selective", sequence_parallel=True,
        compile=False, dtype=None, tokens_per_s_per_gpu=52.31, tflops_per_gpu=None, mfu=0.542, hfu=None,
        flops_convention=_MEG22_FLOPS,
        notes=("Section 6.3 text: the 530B present-work config scaled to 8-way data parallelism (2240 GPUs, batch "
               "per model replica unchanged, so global 2240): 39.15 s per iteration instead of 37.83, MFU 54.2%. The"
               " gradient all-reduce is NOT overlapped with the backward pass. tokens_per_s_per_gpu derived from the"
               " iteration time. " +
               _MEG22_HW +
               ", here with DP 8.")),
    # ---- Llama 3 405B pre-training, Llama 3 paper Table 4 (16K H100s) ------------------------------------------------
    _row(
        source=_LLAMA3, url=_LLAMA3_URL, name="Llama 3 405B, 8192x H100, TP 8 x CP 1 x PP 16, seq 8192", gpu="h100",
        gpus=8192, **_LLAMA3_405B, seq_len=8192, global_batch_size=2048, micro_batch_size=None, tp=8, pp=16,
        pp_virtual=None, pp_schedule="interleaved_1f1b", cp=1, data="zero2", activation_checkpointing="none",
        sequence_parallel=None, compile=None, dtype="bfloat16", tokens_per_s_per_gpu=None, tflops_per_gpu=430.0,
        mfu=0.43, hfu=None, flops_convention=_LLAMA3_FLOPS,
        notes=("Table 4 row '8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43%' (Batch size/DP 32; global batch"
               " = Batch size/DP x DP; Tokens/Batch 16M). The text says 8K-sequence pre-training ran without "
               "activation checkpointing. FSDP shards optimizer state and gradients but keeps parameters gathered "
               "after the forward (no reshard), hence 'zero2'. Pipeline: their modified interleaved schedule "
               "(tunable consecutive micro-batches N, V stages per rank; V and micro-batch size not given), one "
               "layer fewer on the first and last stages, async p2p. CP is all-gather based (K/V gathered), 2xCP "
               "chunks per sequence for balance. Model shape from the released 405B config (the paper's Table 3 "
               "rounds the vocabulary to 128,000); document masking used in pre-training. Hardware: " +
               _LLAMA3_HW +
               ".")),
    _row(
        source=_LLAMA3, url=_LLAMA3_URL, name="Llama 3 405B, 16384x H100, TP 8 x CP 1 x PP 16, seq 8192", gpu="h100",
        gpus=16384, **_LLAMA3_405B, seq_len=8192, global_batch_size=2048, micro_batch_size=None, tp=8, pp=16,
        pp_virtual=None, pp_schedule="interleaved_1f1b", cp=1, data="zero2", activation_checkpointing="none",
        sequence_parallel=None, compile=None, dtype="bfloat16", tokens_per_s_per_gpu=None, tflops_per_gpu=400.0,
        mfu=0.41, hfu=None, flops_convention=_LLAMA3_FLOPS,
        notes=("Table 4 row '16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41%' (Batch size/DP 16; global "
               "batch = Batch size/DP x DP; Tokens/Batch 16M). The text says 8K-sequence pre-training ran without "
               "activation checkpointing. FSDP shards optimizer state and gradients but keeps parameters gathered "
               "after the forward (no reshard), hence 'zero2'. Pipeline: their modified interleaved schedule "
               "(tunable consecutive micro-batches N, V stages per rank; V and micro-batch size not given), one "
               "layer fewer on the first and last stages, async p2p. CP is all-gather based (K/V gathered), 2xCP "
               "chunks per sequence for balance. Model shape from the released 405B config (the paper's Table 3 "
               "rounds the vocabulary to 128,000); document masking used in pre-training. Hardware: " +
               _LLAMA3_HW +
               ".")),
    _row(
        source=_LLAMA3, url=_LLAMA3_URL, name="Llama 3 405B, 16384x H100, TP 8 x CP 16 x PP 16, seq 131072", gpu="h100",
        gpus=16384, **_LLAMA3_405B, seq_len=131072, global_batch_size=128, micro_batch_size=None, tp=8, pp=16,
        pp_virtual=None, pp_schedule="interleaved_1f1b", cp=16, data="zero2", activation_checkpointing=None,
        sequence_parallel=None, compile=None, dtype="bfloat16", tokens_per_s_per_gpu=None, tflops_per_gpu=380.0,
        mfu=0.38, hfu=None, flops_convention=_LLAMA3_FLOPS,
        notes=("Table 4 row '16,384 | 8 | 16 | 16 | 4 | 131,072 | 16 | 16M | 380 | 38%' (Batch size/DP 16; global "
               "batch = Batch size/DP x DP; Tokens/Batch 16M). The table prints DP=4, but 16384/(8*16*16) = 8 and 16"
               " x 131072 x 8 = 16.8M tokens matches the 16M column, so global batch 128 (= 16 x 8) is used here; "
               "activation checkpointing for this 128K stage is not stated. FSDP shards optimizer state and "
               "gradients but keeps parameters gathered after the forward (no reshard), hence 'zero2'. Pipeline: "
               "their modified interleaved schedule (tunable consecutive micro-batches N, V stages per rank; V and "
               "micro-batch size not given), one layer fewer on the first and last stages, async p2p. CP is "
               "all-gather based (K/V gathered), 2xCP chunks per sequence for balance. Model shape from the released"
               " 405B config (the paper's Table 3 rounds the vocabulary to 128,000); document masking used in "
               "pre-training. Hardware: " +
               _LLAMA3_HW +
               ".")),
]
