"""Plan a run before paying for it: per-rank memory, communication per step, step time and MFU of any model on any
layout and cluster, from each strategy's theory. Pure arithmetic: nothing is allocated, nothing communicated.

    python -m tools.plan                       # conf/plan.yaml: gpt_1p3b, parallel=fsdp, 8 H100s over NVLink
    python -m tools.plan model=gpt_1p3b parallel=fsdp parallel.param_dtype=bfloat16 plan.world=64 plan.link=pcie
    python -m tools.plan parallel=fsdp_tp parallel.tp=8 plan.world=64
    python -m tools.plan parallel=hsdp plan.world=64   # FSDP within each node of 8, replicas across the 8 nodes
    python -m tools.plan model=gpt_70b parallel=pp parallel.pp=8 parallel.data=fsdp parallel.tp=2 plan.world=64
    python -m tools.plan --figure1             # the ZeRO paper's Figure 1 from state_bytes, beside the paper's

The settings are conf/plan.yaml: the training config as train.py composes it (model, data for the vocab, parallel,
optim, train) plus `plan.*`, the cluster. It prints the configured layout in detail, then every candidate layout of
the same world ranked by predicted step time, those that fit first. Every layout here is a Layout value
(parallel/layout.py), and each passes the rule book train.py applies (config.rules, Layout.problem: a refused one
is listed with its line, the configured one is refused with it) and then the cluster's own rules (cluster_problem).
The theory reads the Layout's fields (layout.strategy, layout.hsdp, tp, cp, pp, ...), never its name.

The theory, per rank, with P the parameters a rank computes with (all of them, or 1/tp of the matrices under
tensor parallelism) and N the data-parallel ranks:
- state: parameters 4P + gradients 4P + optimizer state (AdamW 8P), each whole or split over N (layout.sharded:
  ZeRO's stages; HSDP splits over its dp_shard ranks only); theory() is this with fp32 Adam, for the tests and the
  benchmark. ZeRO in mixed precision
  (parallel.param_dtype=bfloat16, parallel/zero.py): working weights 2P + fp32 master 4P/N + gradients in
  reduce_dtype + optimizer state, so 2P + 2P + 12P/N (ZeRO-1) and 2P + 14P/N (ZeRO-2) under bf16 gradients: the
  paper's Figure 1 (`--figure1`).
- comm: bytes per optimizer step as parallel/comm.py counts them (all-reduce 2x its tensor, reduce-scatter its
  input, all-gather its output), split by collective and by mesh dimension (dp, tp; HSDP's dp_shard and
  dp_replicate), and what of it crosses the network between nodes (`crosses_nodes`).
- transient: what a strategy holds for a moment beyond that state (FSDP's gathered units; ZeRO-2's full local
  gradients between micro-steps, which parallel.accumulate=sharded trades for a reduce-scatter per micro-step).
- autocast copies: under bf16 autocast, the bf16 copy of every float32 matmul weight autograd keeps for backward
  (none with bf16 working weights, parallel.param_dtype=auto's choice where the strategy has a working copy).
- time: compute at a stated fraction of the peak, plus the communication each strategy can't hide behind it.
- context parallel (parallel/cp.py, cp > 1): each rank holds seq/cp tokens of every sequence, so activations and
  tensor-parallel traffic shrink by cp; the data-parallel strategy reduces over N = dp x cp ranks (filed "dp_cp");
  K, V cross the "cp" dimension: the ring's (cp - 1) hops per layer, each hidden behind one block of attention
  when it is fast enough, or the all-gather's, exposed (`cp_comm_bytes`, `cp_activation_bytes`, `step_time`);
  the balance of (query, key) pairs over the cp ranks under the zig-zag split and the plain one (`cp_balance`).
- pipeline parallel (parallel/pp.py, pp > 1; pp_predict): each pp rank's share of the model (pp_stages, as
  split_blocks splits it), the data strategy over its stage's dp ranks; activations of the micro-batches the
  schedule has it hold at once (peak_in_flight); p2p over "pp" ("pp", "p2p": kept apart from the collectives, as
  cp's ring is); the step stretched by the schedule's bubble (parallel/pp.py's bubble of its own action lists).
  pp groups span nodes first (pp is the mesh's outermost dimension). The rank with the most memory is reported.
tests/test_plan.py checks state and comm against real runs' counters at world sizes 1, 2 and 4.
"""
import copy
import dataclasses
import functools
import itertools
import math
import os
import sys
from collections import Counter

import torch

import config
from tools import step_time as step_time_model
from parallel.layout import DATA_STRATEGIES, Layout
from data import prepare
from model import CPU_CHUNK_BYTES, GPT, GPU_CHUNK_BYTES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Per GPU, from the vendors' datasheets: dense bf16 peak FLOP/s (not the 2:4-sparsity figure, twice as large), memory
# (bytes), its bandwidth ("hbm", bytes/s), and link rates. The datasheets give each link's total over both
# directions; a ring sends and receives at once, so the rate one way, half the total, is what bounds it (bytes/s
# below). "nvlink" is the GPU's scale-up fabric within a node (AMD's Infinity Fabric on the MI300X), None where the
# GPU has none:
#   H100 SXM5:      989 TFLOP/s,  80 GB HBM3 3.35 TB/s,  NVLink 4 900 GB/s -> 450 each way, PCIe Gen5 x16 128 -> 64
#   H100 PCIe:      756 TFLOP/s,  80 GB HBM2e 2.0 TB/s,  NVLink bridge 600 GB/s -> 300,     PCIe Gen5 x16 128 -> 64
#   H200 SXM:       989 TFLOP/s, 141 GB HBM3e 4.8 TB/s,  NVLink 4 900 GB/s -> 450,          PCIe Gen5 x16 128 -> 64
#   A100 SXM4 80GB: 312 TFLOP/s,  80 GB HBM2e 2.04 TB/s, NVLink 3 600 GB/s -> 300,          PCIe Gen4 x16  64 -> 32
#   A100 SXM4 40GB: 312 TFLOP/s,  40 GB HBM2 1.56 TB/s,  NVLink 3 600 GB/s -> 300,          PCIe Gen4 x16  64 -> 32
#   B200 (HGX):    2250 TFLOP/s, 180 GB HBM3e 8 TB/s,    NVLink 5 1.8 TB/s -> 900,          PCIe Gen5 x16 128 -> 64
#   MI300X:        1307 TFLOP/s, 192 GB HBM3 5.3 TB/s,   Infinity Fabric 7 x 128 GB/s -> 448, PCIe Gen5 x16 128 -> 64
#   L40S:           362 TFLOP/s,  48 GB GDDR6 864 GB/s,  no NVLink,                         PCIe Gen4 x16  64 -> 32
GPUS = {"h100": {"peak": 989e12, "memory": 80e9, "hbm": 3.35e12, "nvlink": 450e9, "pcie": 64e9},
        "h100_pcie": {"peak": 756e12, "memory": 80e9, "hbm": 2.0e12, "nvlink": 300e9, "pcie": 64e9},
        "h200": {"peak": 989e12, "memory": 141e9, "hbm": 4.8e12, "nvlink": 450e9, "pcie": 64e9},
        "a100": {"peak": 312e12, "memory": 80e9, "hbm": 2.039e12, "nvlink": 300e9, "pcie": 32e9},
        "a100_40gb": {"peak": 312e12, "memory": 40e9, "hbm": 1.555e12, "nvlink": 300e9, "pcie": 32e9},
        "b200": {"peak": 2250e12, "memory": 180e9, "hbm": 8e12, "nvlink": 900e9, "pcie": 64e9},
        "mi300x": {"peak": 1307e12, "memory": 192e9, "hbm": 5.3e12, "nvlink": 448e9, "pcie": 64e9},
        "l40s": {"peak": 362e12, "memory": 48e9, "hbm": 0.864e12, "nvlink": None, "pcie": 32e9}}
DEVICES = (*GPUS, "cpu")  # plan.gpu: a GPU above, or this machine's CPU (tools/step_time.py measures it)
LINKS = ("nvlink", "pcie")  # within a node, at the GPU's own rate above
# Between nodes, per GPU, each way: NDR InfiniBand, 400 Gb/s per port (NVIDIA ConnectX-7 datasheet), one port per
# GPU as in a DGX H100: 50 GB/s
NETWORKS = {"infiniband": 50e9}


# Settings the theory reads from parallel.*, with the value a strategy without that setting behaves as
KNOBS = {"reduce_dtype": "float32", "param_dtype": "float32", "accumulate": "local", "reshard_after_forward": True,
         "prefetch": 1, "sequence_parallel": False, "cp_method": "ring"}


def compute_dtype(t):
    """The dtype a run of train's settings computes in on the GPUs planned for: train.dtype=auto is bf16 there."""
    return "float32" if t.dtype == "float32" else "bfloat16"


def optimizer_bytes(optim):
    """Optimizer state per parameter: AdamW keeps two fp32 moments; SGD one momentum buffer, or nothing."""
    if optim.name == "sgd":
        return 4 if optim.momentum else 0
    return 8


# --- the model
def model_shape(cfg):
    """The configured GPT's shape, its exact parameter count and its training FLOPs per token (model.py's formula),
    from the model itself built on the meta device (no memory). model.vocab_size null: the tokenizer's, as train.py
    does. A fresh dict each call, of a shape built once per model and sequence length (_shape)."""
    mcfg = config.model_config(cfg, prepare.vocab_size(cfg.data))
    key = (repr(mcfg), cfg.train.seq_len)  # GPTConfig's repr: every field
    if key not in _SHAPES:
        _SHAPES[key] = _shape(mcfg, cfg.train.seq_len)
    return dict(_SHAPES[key])


# model_shape's shapes by model config and sequence length, each built once: a meta model of 126 blocks takes 0.1 s, and
# the planner's callers ask again and again for one model (parallel=auto's candidates, the published table's rows,
# the tests: 10 s of a test session's CPU, 2026-12-07)
_SHAPES = {}


def _shape(mcfg, seq_len):
    with torch.device("meta"):
        gpt = GPT(mcfg)
    c = gpt.cfg
    return {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "vocab": c.padded_vocab_size,
            "n_params": gpt.num_params(), "flops_per_token": gpt.flops_per_token(seq_len),
            # grouped-query attention's key/value width, the MLP's, and one block's parameters
            "kv_embd": c.kv_heads * c.head_dim, "hidden": c.hidden, "mlp": c.mlp, "tied": c.tie_embeddings,
            "block_params": sum(p.numel() for p in gpt.blocks[0].parameters()) if c.n_layer else 0,
            # mixture of experts (none: 0): the routed experts' parameters over all MoE blocks, what expert
            # parallelism splits (model.Experts: gate (SwiGLU), up, down, stacked, no biases)
            "n_experts": c.n_experts, "top_k": c.top_k if c.n_experts else 0, "moe_blocks": c.n_moe,
            "expert_params": c.n_moe * c.n_experts * (3 if c.mlp == "swiglu" else 2) * c.n_embd * c.expert_hidden
            if c.n_experts else 0,
            # what an MoE block keeps for backward (moe_activation_bytes): each expert's and the shared experts'
            # widths, and whether the balancing loss runs
            "expert_hidden": c.expert_hidden if c.n_experts else 0,
            "shared_hidden": c.n_shared_experts * c.expert_hidden if c.n_experts else 0,
            "aux_loss": bool(c.n_experts and c.router == "aux" and c.aux_loss_coef > 0),
            # which blocks are MoE blocks, and each block's parameters: what a pipeline stage's share holds (pp_stages)
            "moe_at": tuple(i for i in range(c.n_layer) if c.is_moe(i)),
            "block_sizes": tuple(sum(p.numel() for p in b.parameters()) for b in gpt.blocks)}


def dims(shape):
    """(d, key/value width, MLP hidden units, wide tensors the MLP keeps for backward, one block's parameters) of a
    shape; a shape written without them (tests, tools) is GPT-3's block: full attention, a GELU MLP of 4d."""
    d = shape["n_embd"]
    hidden = shape.get("hidden", 4 * d)
    wide = 4 if shape.get("mlp", "gelu") == "swiglu" else 2
    return d, shape.get("kv_embd", d), hidden, wide, shape.get("block_params", 12 * d * d + 2 * d)


def params_per_rank(shape, tp, ep=1):
    """P = 2 V d (embedding, untied head) + L (12 d^2 + 2 d) (q, k, v, proj d x d; up d x 4d, down 4d x d; two norm
    gains) + d (final norm), for GPT-3's block; Llama's: L (2 d^2 + 2 d d_kv + 3 d f + 2 d) with d_kv the key/value
    width and f SwiGLU's hidden units (model_shape counts the model itself). Tensor parallelism splits every matrix over tp ranks (heads, MLP columns, vocab rows)
    and keeps the (2L + 1) d norm gains whole on each. A pipeline stage's shape (pp_stages): its L blocks, and the
    final norm only on the last stage. Expert parallelism keeps 1/ep of the routed experts on a rank
    (parallel/ep.py); tensor parallelism splits none of them, nor the routers (parallel/tp.py: they run whole on
    every tp rank), only an MoE block's shared experts."""
    replicated = (2 * shape["n_layer"] + shape.get("last", True)) * shape["n_embd"]
    routed = shape.get("expert_params", 0)
    routers = shape.get("moe_blocks", 0) * shape.get("n_experts", 0) * shape["n_embd"]
    return (shape["n_params"] - routed - routers - replicated) / tp + replicated + routers + routed / ep


# --- the theory of each strategy: state and communication, keyed by the Layout's fields (layout.strategy: the data
# strategy that runs; layout.hsdp; layout.tp, layout.cp; layout.sharded and layout.shard_ranks)
def state_bytes(layout, P, opt_bytes=8, knobs=KNOBS, experts=0):
    """Model state per rank: {parameters, gradients, optimizer: bytes}, for P parameters on this rank's tp slice,
    the parts the strategy splits (layout.sharded) over layout.shard_ranks (dp x cp; HSDP: dp_shard).
    ZeRO with param_dtype=bfloat16: bf16 working weights (whole), fp32 master weights (sharded, "master"), gradients
    in the wider of param_dtype and reduce_dtype (parallel/zero.py). FSDP's parameters are its fp32 shards whatever
    param_dtype (the gathered bf16 copies are transient). `experts`: of P, the routed experts the rank holds under
    expert parallelism (E/ep of each MoE block's), float32: whole beside DDP and ZeRO (parallel/zero.py), sharded
    by FSDP over the dp x cp / ep ranks that hold the same ones (parallel/fsdp.py)."""
    state = _split_state(layout, P - experts, opt_bytes, knobs)
    holders = layout.shard_ranks // layout.ep if layout.strategy == "fsdp" else 1
    for k, b in (("parameters", 4), ("gradients", 4), ("optimizer", opt_bytes)):
        state[k] += b * experts / holders
    return state


def _split_state(layout, P, opt_bytes, knobs):
    whole = {"parameters": 4 * P, "gradients": 4 * P, "optimizer": opt_bytes * P}
    if layout.strategy in ("zero1", "zero2") and knobs["param_dtype"] != "float32":
        pb, rb = DTYPE_BYTES[knobs["param_dtype"]], DTYPE_BYTES[knobs["reduce_dtype"]]
        whole = {"parameters": pb * P, "master": 4 * P, "gradients": max(pb, rb) * P, "optimizer": opt_bytes * P}
    split = layout.sharded + ("master",)
    return {k: v / layout.shard_ranks if k in split else v for k, v in whole.items()}


def comm_bytes(layout, P, accum, knobs=KNOBS, shape=None, micro=0, seq=0, act_bytes=4):
    """Bytes per optimizer step per rank, as parallel/comm.py counts them: Counter {(dim, collective): bytes}.
    Non-final micro-steps of gradient accumulation reduce no gradients (no_sync), except under ZeRO-2 with
    accumulate=sharded, which reduce-scatters every micro-step. HSDP: FSDP's traffic within the layout.shard_ranks
    of dp_shard, and its gradient slice, P / dp_shard, all-reduced across dp_replicate. `seq`: the tokens of a
    sequence on this rank (seq_len / cp), what tensor parallelism moves."""
    rb, pb = DTYPE_BYTES[knobs["reduce_dtype"]], DTYPE_BYTES[knobs["param_dtype"]]
    c, strategy = Counter(), layout.strategy
    # the rank's experts: reduced by parallel/ep.py (sharded by FSDP over ep_replicate); a dense stage has none
    if layout.ep > 1 and shape.get("moe_blocks"):
        c.update(ep_comm_bytes(layout, shape, accum, micro, seq, rb, pb, act_bytes))
        experts = shape["expert_params"] / layout.ep
        P -= experts
        if strategy == "fsdp" and layout.reduce_ranks > layout.ep:  # FSDP's traffic for them, over their holders
            c["ep_replicate", "all_gather"] += accum * (2 if knobs["reshard_after_forward"] else 1) * experts * pb
            c["ep_replicate", "reduce_scatter"] += experts * rb
    if strategy == "ddp":  # one all-reduce of the gradients (Li et al., 2020)
        c["dp", "all_reduce"] += 2 * P * rb
    elif strategy in ("zero1", "zero2"):  # reduce-scatter the gradients, all-gather the updated working weights
        c["dp", "reduce_scatter"] += (accum if knobs["accumulate"] == "sharded" else 1) * P * rb
        c["dp", "all_gather"] += P * pb
    elif strategy == "fsdp":  # each micro-step gathers for forward and again for backward
        within = "dp_shard" if layout.hsdp else "dp"
        c[within, "all_gather"] += accum * (2 if knobs["reshard_after_forward"] else 1) * P * pb
        c[within, "reduce_scatter"] += P * rb
        if layout.hsdp:
            c["dp_replicate", "all_reduce"] += 2 * P / layout.shard_ranks * rb
    if layout.tp > 1:
        # sequence parallel sums the norm gains' gradients over tp where the strategy keeps them: whole, or (ZeRO,
        # FSDP) the rank's shard of them, 1/shard_ranks of them on average
        gains = 1 / layout.shard_ranks if layout.sharded else 1
        c.update(tp_comm_bytes(shape, micro, seq, act_bytes, accum, knobs["sequence_parallel"], pb, gains))
    return c


def ep_comm_bytes(layout, shape, accum, micro, seq, reduce_bytes, stream_bytes, act_bytes):
    """Expert parallelism's bytes per step per rank (parallel/ep.py), as comm.py counts them, for balanced routing:
    - ("ep", "all_to_all"): per MoE block and micro-step, the E int64 token counts, then the rows: the tokens'
      k n assignments go out (dispatch, in the residual stream's dtype: `stream_bytes`, float32 under autocast over
      float32 weights) and the experts' outputs come back (combine, in the compute dtype: `act_bytes`), and in
      backward their gradients the other way; a rank's count is its inputs, (sent + received rows) x d x (stream +
      compute bytes), sent = received = k n when every rank receives what it sends (the load the balancing loss or
      bias aims at). That is the mean over ranks: the
      sum over all of them is exact whatever the routing (a dropless run's metrics.jsonl a2a_bytes_all_ranks),
      while the busiest rank receives more. Capacity drops are not predicted (dropless).
    - ("ep_replicate", "all_reduce"): the rank's E/ep experts' gradients, summed over the ranks holding the same
      ones (dp x cp / ep of them), after backward; FSDP reduce-scatters them instead (comm_bytes)."""
    c, E, k, d = Counter(), shape["n_experts"], shape["top_k"], shape["n_embd"]
    rows = 2 * k * micro * seq  # sent + received assignments of a micro-step
    c["ep", "all_to_all"] = shape["moe_blocks"] * accum * (8 * E + rows * d * (stream_bytes + act_bytes))
    if layout.reduce_ranks > layout.ep and layout.strategy != "fsdp":
        c["ep_replicate", "all_reduce"] = 2 * shape["expert_params"] / layout.ep * reduce_bytes
    return c


def tp_comm_bytes(shape, micro, seq, act_bytes, accum, sequence_parallel, stream_bytes=None, gains=1.0):
    """Megatron-style tensor parallelism (Shoeybi et al., 2019; Korthikanti et al., 2022), per optimizer step:
    - each block, per micro-batch: an all-reduce after attention's and after the MLP's row-parallel layer in
      forward, and of the gradient entering each column-parallel layer in backward: 4 x 2 x (b s d) activations
    - the vocab-parallel embedding: one all-reduce of its output in forward; the head's input gradient: one in
      backward
    - the vocab-parallel loss: the rows' max (b s fp32), then [sum of exp, target logit] (2 b s fp32)
    A pipeline stage's shape (pp_stages) has the embedding only on the first stage, the head and loss only on the
    last.
    Dtypes: the row-parallel outputs are matmul results, in the compute dtype (`act_bytes`: bf16 under autocast);
    the embedding's output and every gradient entering a column-parallel layer belong to the residual stream, in the
    working weights' dtype (`stream_bytes`: float32 under autocast with fp32 weights, whose norms run in fp32;
    measured, tests/test_bf16.py).
    With sequence parallelism every activation all-reduce is an all-gather plus a reduce-scatter moving the same
    counted bytes; the norm gains, now fed different tokens on each rank, get their gradients all-reduced once per
    step: (2L + 1) d fp32 (the last stage's final norm: + 1), or `gains` of them where the rank holds a shard of
    the gradients (ZeRO, FSDP: parallel/tp.py sums the rank's pieces)."""
    L, d = shape["n_layer"], shape["n_embd"]
    first, last = shape.get("first", True), shape.get("last", True)
    n = micro * seq * d  # elements of one activation tensor of the micro-batch
    # the f/g pairs: attention's and the MLP's in each block, an MoE block's only where it has shared experts (its
    # routed ones run whole on every tp rank)
    pairs = 2 * L - (shape.get("moe_blocks", 0) if not shape.get("shared_hidden") else 0)
    # all-reduces count 2x
    acts = accum * 2 * n * (pairs * act_bytes + (pairs + first + last) * (stream_bytes or act_bytes))
    c = Counter()
    if sequence_parallel:
        c["tp", "all_gather"] += acts / 2
        c["tp", "reduce_scatter"] += acts / 2
        c["tp", "all_reduce"] += 2 * (2 * L + last) * d * 4 * gains
    else:
        c["tp", "all_reduce"] += acts
    c["tp", "all_reduce"] += accum * 2 * (1 + 2) * micro * seq * 4 * last
    return c


def clip_comm(layout):
    """The global gradient norm's scalar all-reduces (parallel/strategy.py clip_grad_norm, ours), 8 bytes each as
    counted: where every rank holds a disjoint piece of the gradients (ZeRO, FSDP, HSDP's replicas weighted), one
    over the whole world; tensor parallel over whole dp gradients: one over tp, and one over pp beside a pipeline;
    whole gradients: one over pp beside a pipeline, else none. Torch's DTensor gradients (FSDP2, DTensor tp) reduce
    their norm over their own mesh: its few bytes are left out."""
    if layout.impl == "torch" and (layout.strategy in ("zero2", "fsdp") or layout.tp > 1):
        return Counter()
    if layout.sharded:
        return Counter({("world", "all_reduce"): 8})
    c = Counter({("tp", "all_reduce"): 8} if layout.tp > 1 else {})
    if layout.ep > 1:  # the experts' squares, disjoint within an ep group (parallel/ep.py)
        c["ep", "all_reduce"] += 8
    if layout.pp > 1:
        c["pp", "all_reduce"] += 8
    return c


def router_stats_comm(layout, shape):
    """The MoE blocks' router statistics (tokens per expert, dropped, the balancing loss: blocks x (E + 2) float32s),
    summed over the data-parallel ranks once a step (Parallelized.router_stats): a few bytes the step time leaves
    out, as clip_comm's. Under a pipeline every rank sums the whole model's rows (its stage's, zeros elsewhere) over
    its stage's data-parallel ranks, then over pp."""
    blocks = shape.get("model_moe_blocks", shape.get("moe_blocks", 0))
    if not blocks:
        return Counter()
    size = 2 * 4 * blocks * (shape["n_experts"] + 2)
    c = Counter({("dp", "all_reduce"): size} if layout.reduce_ranks > 1 else {})
    if layout.pp > 1:
        c["pp", "all_reduce"] += size
    return c


def theory(data, n_params, world, reduce_bytes=4, accum=1):
    """(comm bytes per step, model-state bytes per rank) the ZeRO paper predicts for fp32 Adam and P parameters on
    world data-parallel ranks under data strategy `data` (ddp, zero1, zero2, fsdp)."""
    knobs = {**KNOBS, "reduce_dtype": {4: "float32", 2: "bfloat16"}[reduce_bytes], "param_dtype": "float32"}
    layout = Layout(world, dp_shard=world, data=data)
    comm = comm_bytes(layout, n_params, accum, knobs)
    return sum(comm.values()), sum(state_bytes(layout, n_params).values())


# The ZeRO paper's Figure 1 (Rajbhandari et al., 2020): model state per GPU for Psi = 7.5B parameters on N = 64
# GPUs with mixed-precision Adam (K = 12 bytes of fp32 master weights and moments per parameter), in GB
FIGURE1 = {"psi": 7.5e9, "n": 64, "paper": {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "fsdp": 1.9}}


def figure1():
    """[(layout, settings, formula, GB from state_bytes, the paper's GB)] for Figure 1. ZeRO-1 and -2 in mixed
    precision with bf16 gradients (the paper's fp16); DDP and FSDP in float32, whose state has the same size as the
    paper's mixed precision: 4 + 4 + 8 = 2 + 2 + 12 bytes per parameter, whole (DDP) or over N (FSDP)."""
    psi, n = FIGURE1["psi"], FIGURE1["n"]
    bf16 = {**KNOBS, "param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    rows = [("ddp", "parallel=ddp", "(2 + 2 + K) Psi", KNOBS),
            ("zero1", "parallel=zero1 parallel.param_dtype=bfloat16 parallel.reduce_dtype=bfloat16",
             "2 Psi + 2 Psi + K Psi / N", bf16),
            ("zero2", "parallel=zero2 parallel.param_dtype=bfloat16 parallel.reduce_dtype=bfloat16",
             "2 Psi + (2 + K) Psi / N", bf16),
            ("fsdp", "parallel=fsdp", "(2 + 2 + K) Psi / N", KNOBS)]
    return [(s, how, formula, sum(state_bytes(Layout(n, dp_shard=n, data=s), psi, 8, knobs).values()) / 1e9,
             FIGURE1["paper"][s]) for s, how, formula, knobs in rows]


def figure1_report():
    lines = [f"The ZeRO paper's Figure 1: model state per GPU, Psi = {FIGURE1['psi'] / 1e9:g}B parameters, "
             f"N = {FIGURE1['n']} GPUs, Adam (K = 12), from tools/plan.py state_bytes",
             "| layout | settings | formula | ours GB | paper GB |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {how} | {formula} | {ours:.2f} | {paper} |" for s, how, formula, ours, paper in figure1()]
    return "\n".join(lines)


# --- memory beyond the model state
def checkpointed_fraction(mode, n_layer, every=1):
    """The share of blocks train.activation_checkpointing recomputes (parallel.apply_activation_checkpointing)."""
    return {"none": 0, "full": 1, "selective": 1, "every_n": math.ceil(n_layer / every) / n_layer}[mode]


def moe_activation_bytes(shape, tokens, act_bytes, ep=1, tp=1):
    """What an MoE block (model.py's MoE) keeps for backward in its MLP's place, over `tokens` tokens, for dropless
    balanced routing (each of the k n assignments kept; under ep each rank receives as many rows as it sends),
    per token:
      the router: its scores, float32 (4 E), the top-k's indices (8 k), the chosen scores and their sum (4 k + 4)
      the dispatch: the token and order indices of the assignments (16 k), their rows as the experts' first matmul
        takes them (k d, compute dtype); under ep the all-to-all saves nothing, but the two permutations of the
        rows that arrive (16 k more)
      the experts: the MLP's wide tensors over the k rows (k f x 4 SwiGLU, x 2 GELU; f each expert's width)
      the combine: the experts' outputs, twice (the product with the gates, and the scatter's), the gates (k)
      the shared experts: a dense MLP's wide tensors at their width (split over tp; the rest is whole on every tp
        rank: parallel/tp.py)
    and per block: each grouped matmul's int32 offsets over the rank's experts, the balancing loss's f (4 E).
    (Under autocast the grouped matmuls' bf16 copies of the experts' weights are kept too: autocast_copy_bytes'.)"""
    E, k, d, f = shape["n_experts"], shape["top_k"], shape["n_embd"], shape["expert_hidden"]
    wide, ab = dims(shape)[3], act_bytes
    per_token = (4 * E + 12 * k + 4 + 16 * k + k * d * ab + k * f * wide * ab + k * (2 * d + 1) * ab
                 + shape["shared_hidden"] * wide * ab / tp + (16 * k if ep > 1 else 0))
    return per_token * tokens + 4 * E // ep * (wide - 1) + 4 * E * shape["aux_loss"]


def selective_matmuls(shape, alternate=False):
    """The widths (elements per token) of the matmul outputs selective checkpointing keeps in a dense block and in an
    MoE block, in the order the block runs them (model.py): qkv, proj, then the MLP's up (GELU) or gate and up
    (SwiGLU) and down; an MoE block's router and its shared experts' MLP (its experts' grouped matmuls are not
    kept). `alternate` (train.selective_matmuls=alternate, parallel._selective_policy): the 1st, 3rd, ... alone."""
    d, kv, hidden, wide, _ = dims(shape)
    mlp = lambda f: ([f, f] if wide == 4 else [f]) + [d]  # noqa: E731
    dense = [d + 2 * kv, d, *mlp(hidden)]
    shared = shape.get("shared_hidden", 0)
    routed = [d + 2 * kv, d, shape.get("n_experts", 0), *(mlp(shared) if shared else [])]
    return (dense[::2], routed[::2]) if alternate else (dense, routed)


def activation_bytes(shape, micro, seq, act_bytes, tp=1, sequence_parallel=False, checkpointed=0.0, residual_bytes=4,
                     selective=False, ring_attention=False, ep=1, alternate=False):
    """Bytes autograd keeps for backward, one micro-batch (only one is alive at a time), counted in our Block
    (tools/act_memory.py measures them, tests/test_plan.py checks the count); `act_bytes` the compute dtype's (the
    matmuls' outputs), `residual_bytes` the residual stream's, the working weights' dtype (4 under autocast over
    float32 weights, whose residual adds stay float32; 2 with bf16 working weights):
      each RMSNorm (model.RMSNormFn): its input, in the residual's dtype, and its float32 1/rms (b s d rb + 4 b s),
      and its output in the compute dtype, which the matmul after it keeps (b s d ab: under autocast the bf16 copy
      the matmul casts it to); two per block, one at the end
      attention: q and k after RoPE, v, the output, which is the proj input too (a view: the kernel writes it in
      the token-major order the fused qkv's views give it) (2 b s d + 2 b s d_kv: 4 b s d without grouped-query
      attention), and the kernel's float32 log-sum-exp per head (4 b s H); below float32, RoPE keeps its cos and sin
      tables cast to the compute dtype (2 b s head_dim); MLP, f hidden units: GELU's up's and GELU's outputs
      (2 b s f: 8 b s d), SwiGLU's four wide tensors (4 b s f): gate's output (silu's input), silu's and up's
      outputs (the product's operands), the product (down's input)
      the head and the loss (model.LinearCrossEntropy, one Function over chunks of rows): the gradients of the
      final norm's output and of the head's weight, computed in forward (b s d in the residual's dtype, V d
      float32), no logits; under tensor parallelism the head keeps the final norm's output (above) and the
      vocab-parallel loss the float32 softmax of its slice (b s V / tp)
    Tensor parallelism splits attention, MLP and logits over tp; the norms' tensors are whole on every rank unless
    sequence parallelism splits them too: then each norm keeps its b (s/tp) d input and statistic (its output is
    all-gathered, and the gathered whole-sequence b s d is what the column-parallel matmul after it keeps: qkv's, the
    MLP's, the head's; measured on fake tensors, tools/dry_run.py, 2026-12-02). A checkpointed block keeps only its
    input (the residual stream, in its dtype) and is recomputed in backward, one at a time; `selective`
    (train.activation_checkpointing=selective, parallel.SELECTIVE_SAVE) keeps besides the outputs of its matmuls
    and of its attention kernel (qkv's, proj's, the MLP's up (and gate) and down; the attention's output and
    log-sum-exp) and recomputes the rest. Attention is flash-style (no s x s scores). Compiled, the compiler
    chooses what to keep. Returns (kept, recomputed at once)."""
    L, V = shape["n_layer"], shape["vocab"]
    d, kv, hidden, wide, _ = dims(shape)
    heads = shape.get("n_head", 0)  # the log-sum-exp and the tables, a few bytes a token: 0 where a shape omits it
    ab, rb = act_bytes, residual_bytes
    sp = sequence_parallel and tp > 1
    norm_split = tp if sp else 1
    # per norm and token: its input and 1/rms (split under sp), and its output (under sp the gathered one after it)
    norm = (d * rb + 4) / norm_split + d * ab
    tables = 2 * d / heads * ab if heads and ab < 4 else 0  # cos and sin cast below float32 (model.apply_rope)
    attention = (2 * d + 2 * kv) * ab + 4 * heads
    block = (2 * norm + (attention + wide * hidden * ab) / tp + tables) * micro * seq
    # an MoE block (moe_activation_bytes) keeps its router's, experts' and shared experts' tensors in its MLP's
    # place (no tensor parallelism beside experts)
    n_moe = min(shape.get("moe_blocks", 0), L)
    moe = block - wide * hidden * ab / tp * micro * seq + moe_activation_bytes(shape, micro * seq, ab, ep, tp) \
        if n_moe else 0
    if tp > 1:  # the head's input as the norm's output (above), the vocab-parallel loss's float32 softmax slice
        end = (norm + V * 4 / tp) * micro * seq
    else:  # the final norm's own tensors, and what the fused head and loss keep: dh per token and dW (float32)
        end = (d * rb + 4 + d * rb) * micro * seq + V * d * 4
    end *= shape.get("last", True)  # pp: only the last stage
    n_ckpt = round(checkpointed * L)
    ckpt = moe_ckpt = d * rb / norm_split * micro * seq  # a checkpointed block's input
    if selective:  # the matmuls' outputs (qkv, proj, up (and gate), down) and the attention's, kept; the rest recomputed
        dense, routed = selective_matmuls(shape, alternate)
        saved = sum(dense) * ab
        attention_out = 0 if ring_attention else d * ab + 4 * heads
        # the attention kernel's output and log-sum-exp (context parallelism's: recomputed)
        ckpt += (saved + attention_out) / tp * micro * seq
        block -= (saved + attention_out) / tp * micro * seq
        if n_moe:  # an MoE block's matmuls: the router's scores and the shared experts' MLP; its experts' grouped
            # matmuls are recomputed with the rest
            saved_moe = sum(routed) * ab + attention_out
            moe_ckpt += saved_moe * micro * seq
            moe -= saved_moe * micro * seq
    ids = 8 * micro * seq  # the token ids the embedding keeps (int64)
    # checkpointing takes blocks of either kind alike (every_n: the mean block)
    mean = ((L - n_moe) * block + n_moe * moe) / L if L else 0
    mean_ckpt = ((L - n_moe) * ckpt + n_moe * moe_ckpt) / L if L else 0
    # recomputed at once: one block's tensors but its input, which it kept
    return (L - n_ckpt) * mean + n_ckpt * mean_ckpt + end + ids, \
        max(block, moe) - d * rb / norm_split * micro * seq if n_ckpt else 0


def cp_activation_bytes(shape, micro, seq, act_bytes, cp, method, tp=1, sequence_parallel=False, checkpointed=0.0,
                        residual_bytes=4, selective=False, ep=1, alternate=False):
    """activation_bytes for one cp rank's seq/cp tokens (the ring saves what one process's attention does: q, k, v,
    output and its log-sum-exp, of its own tokens). The all-gather keeps the whole sequence's K and V for backward
    in every layer it doesn't recompute, 2 b (seq - seq/cp) d more than its own. Returns (kept, recomputed at
    once)."""
    kept, recompute = activation_bytes(shape, micro, seq // cp, act_bytes, tp, sequence_parallel, checkpointed,
                                       residual_bytes, selective, ring_attention=cp > 1, ep=ep, alternate=alternate)
    if cp > 1 and shape.get("n_head") and (act_bytes == 4 or checkpointed):
        # the RoPE tables' rows at the rank's positions (model.GPT.rope), float32, one copy every block's rotation
        # (or checkpoint) keeps
        kept += 2 * shape["n_embd"] / shape["n_head"] * 4 * micro * seq // cp
    if method == "allgather" and cp > 1:
        L = shape["n_layer"]
        extra = 2 * micro * (seq - seq // cp) * dims(shape)[1] / tp * act_bytes
        n_ckpt = round(checkpointed * L)
        kept += (L - n_ckpt) * extra
        recompute += extra if n_ckpt else 0
    return kept, recompute


def backward_bytes(shape, micro, seq, act_bytes, cp=1, method="ring", tp=1, residual_bytes=4, recompute=0, cached=0,
                   loss_chunk=None):
    """What backward allocates beyond the kept activations and the block it recomputes (`recompute`, the second of
    activation_bytes' pair) before it frees it: the high-water mark of one micro-batch's activation memory is
    activations + this (tools/act_memory.py measures it). The largest of the moments where backward holds the most
    (measured on fake tensors, 2026-12-03), each with everything forward kept still alive:
      the end of forward, in the loss: the fused head and loss's chunk (model.LinearCrossEntropy: `loss_chunk`
        bytes of float32 logits at most, by default a GPU's, model.GPU_CHUNK_BYTES): its logits in the compute
        dtype and, below float32, their float32 copy and the gradient cast back, or the gradient beside a V x d
        product for dW; under tensor parallelism, below float32, a chunk of the logits cast to float32
        (model.CrossEntropy's); and `cached`, what lives until forward ends and no longer: autocast's cache of
        bf16 weights (every block's, the checkpointed ones' too, until the autocast context exits)
      the head's backward: the fused loss's dh and dW scaled (b s d, V d float32) and dW cast to half-precision
        weights; under tensor parallelism the weight's gradient as the matmul writes it (V d / tp in the compute
        dtype) and, below float32, its float32 copy for .grad, until the gradient is accumulated; its input's
        gradient (b s d)
      the final norm's backward (model.RMSNormFn): its float32 arithmetic, three b s d temporaries and, below
        float32, the incoming gradient cast to float32
      the last block's MLP backward, on top of the block recomputed: the gradient of the MLP's hidden units
        (b s f) and the residual's (b s d, float32), the final norm's tensors freed by then
      the last block's attention backward under context parallelism, its MLP's tensors freed by then: the ring's
        float32 dQ, the output's gradient, K, V held and incoming (one on 2 ranks), every dK, dV accumulator on
        the way round (its own, the one computed, the one arriving, the one leaving), float32, and a block
        kernel's gradients (on 2 ranks, at the last step: its own and the one computed beside the kernel's, then
        the one arriving); the all-gather's, the whole sequence's dK, dV (the reduce-scatter's input) beside a
        block kernel's gradients, then beside its own slice
    The model's weights' gradients otherwise belong to the state (state_bytes); the head's backward frees what the
    fused loss kept (dh, dW). Measured against tools/act_memory.py's grid at 2k and 8k tokens on 2026-12-06, after
    the head and loss were fused: at most 6.1% off (the all-gather's bf16 rows), but 11% over at 2k tokens, full
    checkpointing, cp=4 all-gather (docs/context_parallel.md)."""
    V, last = shape["vocab"], shape.get("last", True)
    d, kv, hidden, wide, _ = dims(shape)
    ab, rb, t = act_bytes, residual_bytes, micro * (seq // cp)
    low = ab < 4  # a float32 copy of a half-precision gradient
    dw = V * d * 4 * (tp == 1) * last  # the fused loss's float32 dW, kept from forward until the head's backward
    if tp > 1:
        forward = cached + min(t * V / tp * 4, loss_chunk or GPU_CHUNK_BYTES) * low * last
        head = (V * d / tp * (ab + 4 * low) + t * d * ab) * last
    else:  # the fused head and loss: one chunk's logits (and below float32 their float32 copy and the gradient
        # cast back), and a chunk's product for dW; backward: dh and dW scaled, dW cast to a half-precision weight
        chunk = min(t, max(1, (loss_chunk or GPU_CHUNK_BYTES) // (4 * V))) * V  # logits in one chunk
        forward = cached + max(chunk * (4 + ab * low), chunk * ab + V * d * ab * low) * last
        head = (t * d * rb + V * d * (4 + rb * (rb < 4))) * last
    norm = t * d * 4 * (3 + low) * last
    # freed once the head's backward is done: the final norm's input and statistic, and the head's input (tp) or
    # the fused loss's dh and dW
    done = t * (d * rb + 4 + (d * ab if tp > 1 else d * rb)) * last + dw
    mlp = recompute + t * (hidden * ab / tp + d * 4) - done
    attention = 0
    if cp > 1:
        kv_b = 2 * kv / tp * t  # elements of one rank's K, V
        freed = t * (wide * hidden * ab / tp + d * rb + 4 + d * ab)  # the last block's MLP and second norm
        kernel = t * (d / tp + kv / tp) * (ab + 4 * low)  # a block's dq, and dk, dv of half the tokens
        if method == "ring" and cp > 2:
            held = 2 * kv_b * ab + 4 * kv_b * 4 + kernel
        elif method == "ring":  # the last step: no K, V incoming; the kernel's gradients freed before the third
            held = kv_b * ab + max(2 * kv_b * 4 + kernel, 3 * kv_b * 4)
        else:  # every rank's dK, dV with the block kernel's, then its own slice beside them, then the returned
            # gradients cast to the compute dtype, below float32, beside both (dQ's, dK's, dV's)
            held = max(cp * kv_b * 4 + kernel, (cp + 1) * kv_b * 4 + (t * d / tp + kv_b) * ab * low)
        attention = recompute + t * d / tp * (4 + ab) + held - freed - dw
    return max(0, max(forward, head, norm, mlp, attention) - recompute)


def cp_comm_bytes(shape, micro, seq, act_bytes, accum, cp, method, tp=1, checkpointed=0.0):
    """K and V over the "cp" dimension per optimizer step, as parallel/comm.py counts them. One rank's K and V of
    one micro-batch at one layer: kv = 2 b (seq/cp) (d_kv/tp) act_bytes, d_kv the key/value heads' width (d, or
    d n_kv_head / n_head under grouped-query attention); their gradients travel in float32.
      ring       per layer: forward (cp - 1) hops of kv, backward (cp - 1) of kv and of dK, dV; a hop is a send and
                 a receive, both counted (p2p)
      all-gather per layer: one all-gather (output cp x kv) and one reduce-scatter (input cp x kv, float32)
    A checkpointed layer runs its forward, and its communication, twice."""
    L = shape["n_layer"]
    tokens = micro * (seq // cp) * dims(shape)[1] / tp
    kv, dkv = 2 * tokens * act_bytes, 2 * tokens * 4
    layers = accum * L
    c = Counter()
    if method == "ring":
        c["cp", "p2p"] += layers * 2 * (cp - 1) * ((1 + checkpointed) * kv + kv + dkv)
    else:
        c["cp", "all_gather"] += layers * (1 + checkpointed) * cp * kv
        c["cp", "reduce_scatter"] += layers * cp * dkv
    return c


def cp_balance(seq, cp):
    """(max / min of the (query, key) pairs per rank under the zig-zag split, the same under the plain split)."""
    from parallel import cp as context_parallel

    def spread(split):
        pairs = [context_parallel.causal_pairs(split(seq, cp, r)) for r in range(cp)]
        return max(pairs) / min(pairs)
    return spread(context_parallel.zigzag_positions), spread(context_parallel.plain_positions)


def fsdp_unit(shape, tp=1):
    """Parameters of the first FSDP unit a micro-step gathers on a rank: the embedding's (V d) where the rank holds it,
    else its first block's; 1/tp of it under tensor parallelism."""
    return (shape["vocab"] * shape["n_embd"] if shape.get("first", True) else dims(shape)[4]) / tp


def transient_bytes(layout, shape, P, accum, knobs):
    """What a strategy holds for a moment beyond its steady state. FSDP: 1 + prefetch units gathered (every unit,
    at the end of forward, with reshard_after_forward=false), the gradients of the unit in backward, and two units'
    flattened gradients in reduction; the largest unit is the embedding or the norm + head, V d parameters; under
    gradient accumulation, every unit's local gradient sum in reduce_dtype besides (P rb: 5.6 GB for gpt_1p3b at
    accumulation 8, over all of FSDP's 16P/N at N = 8).
    ZeRO-2 with local gradient accumulation: full local gradients between micro-steps (none with
    accumulate=sharded); ZeRO with bf16 gradients: their float32 copy for the step, 4P/N (N: layout.shard_ranks);
    the larger of the two, as parallel/zero.py measures it (buffers of a bucket or two in reduction left out)."""
    strategy, tp = layout.strategy, layout.tp
    if strategy == "fsdp":  # HSDP: the same (its reduced slices in the all-reduce left out, as the reduce-scatters')
        d, block = shape["n_embd"], dims(shape)[4]  # a stage without the embedding or the head: its largest unit a block
        unit = (shape["vocab"] * d if shape.get("first", True) or shape.get("last", True) else block) / tp
        pb, rb = DTYPE_BYTES[knobs["param_dtype"]], DTYPE_BYTES[knobs["reduce_dtype"]]
        gathered = (1 + knobs["prefetch"]) * unit if knobs["reshard_after_forward"] else P
        if accum > 1:  # every unit's gradient sum, kept between micro-steps (the last one reduce-scatters those)
            return gathered * pb + unit * pb + P * rb
        return gathered * pb + unit * (pb + 2 * rb)
    if strategy in ("zero1", "zero2"):
        pb, rb = DTYPE_BYTES[knobs["param_dtype"]], DTYPE_BYTES[knobs["reduce_dtype"]]
        grad_bytes = max(pb, rb)
        local = grad_bytes * P if strategy == "zero2" and accum > 1 and knobs["accumulate"] == "local" else 0
        return max(local, 4 * P / layout.shard_ranks if grad_bytes == 2 else 0)
    return 0


def autocast_copy_bytes(shape, P, tp, checkpointed=0.0):
    """bf16 autocast over float32 working weights: each matmul casts its weight to bf16, and autograd keeps that
    copy for the backward of the micro-batch, so a bf16 copy of every matmul weight on the rank (all but the
    embedding, a lookup, and the norm gains) is held from forward to backward. Under FSDP it outlives the unit's
    reshard: the whole model's. A checkpointed block casts its weights again when it is recomputed, and keeps
    none (measured, tools/act_memory.py). bf16 working weights (parallel.param_dtype=auto under bf16) need no copy
    (tests/test_bf16.py measures both)."""
    d, L = shape["n_embd"], shape["n_layer"]
    embedding = shape["vocab"] * d / tp if shape.get("first", True) else 0  # pp: the first stage's
    recast = round(checkpointed * L) * ((dims(shape)[4] - 2 * d) / tp)  # checkpointed blocks' matmul weights
    # the head's weight too where the head and loss are one Function (model.LinearCrossEntropy: its casts are its own)
    head = shape["vocab"] * d if tp == 1 and shape.get("last", True) else 0
    return 2 * (P - embedding - head - (2 * L + shape.get("last", True)) * d - recast)


# --- time
def spec(plan):
    """plan.gpu's row of GPUS; for plan.gpu=cpu, this machine's, from tools/step_time.py's measurements: the best
    float32 matmul rate of one core as its peak, the memory a rank gets (the machine's, shared by the ranks of a
    node), a copy's bandwidth, and gloo's all-reduce rate between its processes as its link."""
    if plan.gpu != "cpu":  # a GPU the table lacks: the nearest one's row with its own datasheet's figures over it
        row = dict(GPUS[plan.gpu])
        for key, setting, unit in (("peak", "peak_tflops", 1e12), ("hbm", "hbm_tbps", 1e12),
                                   ("memory", "memory_gb", 1e9)):
            if plan.get(setting):
                row[key] = plan[setting] * unit
        return row
    profile = step_time_model.cpu_profile()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = profile["gloo"]["2"]["all_reduce"][1]
    return {"peak": max(r[3] for r in profile["matmul"]["4"]), "memory": ram / min(plan.world, plan.gpus_per_node),
            # a float32 copy moves 8 bytes per element
            "hbm": 8 / profile["elementwise"]["4"]["copy"], "nvlink": link, "pcie": link}


def group_spans(layout, plan):
    """{dim: ranks of its group in each node it spans, or None where the group lies within one node}, for one
    pipeline stage's ranks (all of them without pp; a stage's ranks are neighbours, pp being outermost). The mesh is
    row-major (replicate, shard, cp, tp): a tp group is neighbours, a cp group ranks tp apart (one GPU per node
    when it spans nodes: each carries its own hops), a dp_shard group ranks cp x tp apart, a dp_replicate group
    ranks shard x cp x tp apart; dp is all of the data-parallel ranks (under cp, the dp x cp they reduce over).
    Expert parallelism's groups (parallel/ep.py): an ep group is ep neighbours of the dp x cp ranks (tp apart), an
    ep_replicate group ranks ep x tp apart."""
    n, world, tp, cp, shard = plan.gpus_per_node, layout.stage_world, layout.tp, layout.cp, layout.shard_ranks
    ep = layout.ep
    return {"tp": None, "dp": None if world <= n else n // tp, "cp": None if cp * tp <= n else 1,
            "dp_shard": None if shard * cp * tp <= n else max(1, n // (cp * tp)),
            "dp_replicate": None if world <= n else max(1, n // (shard * cp * tp)),
            "ep": None if ep * tp <= n else n // tp, "ep_replicate": None if world <= n else max(1, n // (ep * tp))}


def bandwidths(layout, plan):
    """Bytes/s each way for a collective over each mesh dimension. tp stays within a node. A group within one node
    rides the node's links; one that spans nodes crosses the network, where NCCL spreads the traffic over the NICs of
    the group's GPUs in each node (one per GPU): k GPUs per node give k x NIC bandwidth, capped by the in-node link
    (a hierarchical ring: reduce-scatter within the node, then across nodes, 1/k of it per NIC). HSDP's dp_replicate
    groups hold one GPU per node when dp_shard is a node: one NIC's rate each."""
    intra = spec(plan)[plan.link]
    return {dim: intra if k is None else min(intra, k * NETWORKS[plan.network])
            for dim, k in group_spans(layout, plan).items()}


def crosses_nodes(comm, layout, plan):
    """Of comm's bytes, those of collectives whose groups span nodes (each rank's, counted as comm counts them)."""
    spans = group_spans(layout, plan)
    return sum(v for (dim, _), v in comm.items() if spans.get(dim) is not None)


def step_time(layout, shape, accum, micro, seq, comm, knobs, ac, checkpointed, plan, act_bytes=2, compiled=False,
              alternate=False):
    """(seconds per optimizer step, {what: seconds}). Compute (compute_time): the operations of the rank's share of
    each micro-step priced on the device (tools/step_time.py: matmuls by shape, attention by its kernel, element-wise
    work by its bytes, eager PyTorch's host time per op), what activation checkpointing recomputes (full: the
    blocks' forward; selective: their element-wise ops), the optimizer's step over the parameters the rank owns and
    the gradients' accumulation; or, where plan.compute_efficiency is set, 6N + attention FLOPs
    (model.flops_per_token) at that fraction of the peak, forward 1/3 and backward 2/3. A collective of `counted` bytes over n ranks takes
    counted x (n-1)/n / (bandwidth x link_efficiency): a ring all-gather sends (n-1)/n of its output from each rank,
    a ring reduce-scatter (n-1)/n of its input, a ring all-reduce 2 (n-1)/n of its tensor (counted twice), so one
    formula serves all three (nccl-tests' "bus bandwidth"). Latency is left out: large messages. Overlap:
      ddp            the gradient all-reduce runs during the last micro-step's backward
      zero1, zero2   the reduce-scatter likewise (accumulate=sharded: each micro-step's during its own backward);
                     the all-gather of updated weights follows the step, exposed
      fsdp, fsdp_tp  with prefetch, each micro-step's gathers run during its forward and backward, but for its
                     first unit's (before anything computes), the reduce-scatter during the last backward;
                     prefetch=0 exposes them all
      under pp       the gradient reduction follows the schedule (ours, and torch's FSDP2 stages): exposed; torch's
                     DDP stages reduce during the last backward
      hsdp           as fsdp within dp_shard; the all-reduce across replicas joins the last backward's
                     reduce-scatters (each slice's starts as its reduce-scatter lands)
      tp             the all-reduces sit between the layers that need them: all exposed
      cp ring        each hop of K, V runs while the block before it is computed: per layer and micro-step,
                     (cp - 1) x max(0, hop - one block's attention) in forward, and with dK, dV in backward
      cp all-gather  between the layers, exposed
      ep             the all-to-alls sit between the router and the experts: exposed; an all-to-all sends 1/ep
                     of a rank's rows to each peer, over the node's link to those in its node and its own NIC to
                     the others; the experts' all-reduce over ep_replicate follows backward, exposed
    Under cp, "dp" is the dp x cp ranks the gradients are reduced over. Under pp, `layout`'s numbers are one
    stage's. On a CPU (plan.gpu=cpu) the collectives are gloo's between processes of the machine at the rates
    measured for each; they run on the cores that compute, so none is hidden."""
    tp, cp, shard, dp_cp = layout.tp, layout.cp, layout.shard_ranks, layout.reduce_ranks
    strategy, cp_method = layout.strategy, knobs["cp_method"]
    dev = step_time_model.device(plan)
    fwd, bwd, recompute, optimizer = compute_time(layout, shape, accum, micro, seq, knobs, ac, checkpointed, plan,
                                                  dev, act_bytes, compiled, alternate)
    bw = bandwidths(layout, plan)
    ep = layout.ep
    size = {"dp": dp_cp, "tp": tp, "cp": cp, "dp_shard": shard, "dp_replicate": dp_cp // shard, "ep": ep,
            "ep_replicate": dp_cp // ep}
    link = {k: bw[k] * plan.link_efficiency for k in bw}
    if isinstance(dev, step_time_model.CPU):  # gloo, every collective exposed
        t = Counter({k: dev.collective_s("all_gather" if k[1] in ("p2p", "all_to_all") else k[1],
                                         v / 2 if k[1] == "p2p" else v, max(2, size[k[0]]),
                                         collective_calls(k, layout, shape, accum, knobs))
                     for k, v in comm.items()})
        if layout.world > 1:  # the step's scalars: the loss's mean and the gradient norm, all-reduced
            t["world", "scalars"] = dev.collective_s("all_reduce", 16, layout.world, calls=2)
        compute = accum * (fwd + bwd + recompute) + optimizer
        exposed = sum(t.values())
        return compute + exposed, {"compute": compute, "exposed comm": exposed, "exposed cp": 0.0,
                                   "comm": exposed, "each": t, "optimizer": optimizer}
    # a p2p hop sends and receives at once: counted twice, it takes bytes / 2 over the link one way
    t = Counter({k: v / 2 / link[k[0]] if k[1] == "p2p" else v * (size[k[0]] - 1) / size[k[0]] / link[k[0]]
                 for k, v in comm.items()})
    if ("ep", "all_to_all") in comm:  # counted: each call's input, 1/ep of it to each peer while as much arrives
        near = group_spans(layout, plan)["ep"] or ep  # the group's GPUs in this rank's node
        intra, nic = spec(plan)[plan.link], NETWORKS[plan.network]
        t["ep", "all_to_all"] = comm["ep", "all_to_all"] / ep * ((near - 1) / intra + (ep - near) / nic) \
            / plan.link_efficiency
    exposed = t["tp", "all_reduce"] + t["tp", "all_gather"] + t["tp", "reduce_scatter"]
    exposed += t["ep", "all_to_all"] + t["ep_replicate", "all_reduce"]
    exposed_cp = 0.0
    if cp > 1 and cp_method == "ring":
        L, chunk = shape["n_layer"], seq // (2 * cp)
        # QK^T and PV of a 2C x C block
        flops = 4 * micro * (shape["n_embd"] / tp) * 2 * chunk * chunk
        block = (flops / (spec(plan)["peak"] * plan.compute_efficiency) if plan.compute_efficiency else
                 dev.attention_s(flops, 2 * chunk, shape["n_embd"] // shape["n_head"], shape["n_head"] // tp,
                                 act_bytes, False))
        tokens = micro * 2 * chunk * dims(shape)[1] / tp  # K and V: the key/value heads
        hop = 2 * tokens * act_bytes / link["cp"]
        hop_grad = 2 * tokens * 4 / link["cp"]
        exposed_cp = accum * L * (cp - 1) * ((1 + checkpointed) * max(0.0, hop - block)
                                             + max(0.0, hop + hop_grad - 2 * block))
    elif cp > 1:
        exposed_cp = t["cp", "all_gather"] + t["cp", "reduce_scatter"]
    exposed += exposed_cp
    # under a pipeline, ours (parallel/pp.py) runs every backward under the data strategy's no_sync and reduces once
    # the schedule is over, and torch's FSDP2 stages reduce at the schedule's end too: nothing is left to hide that
    # reduction; torch's DDP stages reduce during the last backward, as without a pipeline
    after = 0.0 if layout.pp == 1 or (layout.impl == "torch" and strategy == "ddp") else 1.0
    if strategy == "ddp":
        exposed += max(0.0, t["dp", "all_reduce"] - (1 - after) * bwd)
    elif strategy in ("zero1", "zero2"):
        n = 1 if after or knobs["accumulate"] != "sharded" else accum  # reduce-scatters that backward can hide
        exposed += n * max(0.0, t["dp", "reduce_scatter"] / n - (1 - after) * bwd) + t["dp", "all_gather"]
    elif strategy == "fsdp":
        within = "dp_shard" if layout.hsdp else "dp"
        reduce = t[within, "reduce_scatter"] + t["dp_replicate", "all_reduce"]
        gather = t[within, "all_gather"] / accum  # one micro-step's gathers
        fwd_gather = gather / 2 if knobs["reshard_after_forward"] else gather
        bwd_gather = gather - fwd_gather
        # each micro-step's first unit (the embedding's, or a later stage's first block) is gathered before anything
        # computes: nothing hides its share of forward's gathers
        first = fwd_gather * fsdp_unit(shape, tp) / params_per_rank(shape, tp, ep)
        if knobs["prefetch"] == 0:
            exposed += t[within, "all_gather"] + reduce
        else:
            exposed += accum * (first + max(0.0, fwd_gather - first - fwd)) \
                + (accum - 1) * max(0.0, bwd_gather - bwd) + max(0.0, bwd_gather + (1 - after) * reduce - bwd) \
                + after * reduce
    compute = accum * (fwd + bwd + recompute) + optimizer
    return compute + exposed, {"compute": compute, "exposed comm": exposed, "exposed cp": exposed_cp,
                               "comm": sum(t.values()), "each": t, "optimizer": optimizer}


def collective_calls(key, layout, shape, accum, knobs):
    """How many collectives of `key` (dim, collective) a step makes, for their latency (on a CPU): tensor
    parallelism's two all-reduces per block forward and two backward, and the embedding's and the loss's, each
    micro-step; FSDP's gathers per unit (a block each, and the root) and micro-step (twice with
    reshard_after_forward), a reduce-scatter per unit; otherwise one (a model small enough for a CPU fills one
    25 MiB bucket)."""
    dim, kind = key
    L = shape["n_layer"]
    if dim == "tp":
        return accum * (4 * L + 4)
    if layout.strategy == "fsdp" and dim in ("dp", "dp_shard"):
        return (L + 1) * (accum * (1 + knobs["reshard_after_forward"]) if kind == "all_gather" else 1)
    return 1


def compute_time(layout, shape, accum, micro, seq, knobs, ac, checkpointed, plan, dev, act_bytes, compiled,
                 alternate=False):
    """(forward, backward and recomputation of one micro-step, the optimizer's step), seconds, on one rank of
    `layout` (under pp, its stage's share: `shape`), from the ops of tools/step_time.py on `dev`."""
    tp, cp, L = layout.tp, layout.cp, shape["n_layer"]
    tokens = micro * seq // cp
    if plan.compute_efficiency:  # the stated fraction of peak, on 6N + attention FLOPs
        fwd = shape["flops_per_token"] * tokens / tp / 3 / (spec(plan)["peak"] * plan.compute_efficiency)
        return fwd, 2 * fwd, (0.0 if ac == "selective" else checkpointed * fwd), 0.0
    autocast = act_bytes == 2 and knobs["param_dtype"] == "float32"
    residual = DTYPE_BYTES[knobs["param_dtype"]] if act_bytes == 2 else 4
    moe = shape.get("moe_blocks", 0)
    unfused = plan.get("attention", "flash") == "unfused"
    ops = lambda is_moe: step_time_model.block_ops(shape, tokens, seq, tp, is_moe, layout.ep, autocast,  # noqa
                                                    knobs["sequence_parallel"] and tp > 1, unfused)
    # (ops, times): each kind of block priced once, the L blocks as multiples of it
    blocks = [(ops(False), L - moe)] + ([(ops(True), moe)] if moe else [])
    head = step_time_model.head_ops(shape, tokens, tp, autocast) if shape.get("last", True) else []

    def run(parts):
        device = host = 0.0
        for o, times in parts:
            d, h = dev.seconds(o, act_bytes, residual, compiled)
            device, host = device + times * d, host + times * h
        return dev.combine(device, host)
    fwd = run(blocks + [(head, 1)])
    bwd = run([(step_time_model.backward(o), n) for o, n in blocks + [(head, 1)]])
    if ac == "selective":  # the element-wise ops again, and with alternate every second matmul
        recompute = checkpointed * run([(selective_recompute(o, shape, layout.ep, alternate), n)
                                        for o, n in blocks])
    else:
        recompute = checkpointed * run(blocks)
    P = params_per_rank(shape, tp, layout.ep)
    owned = P / layout.shard_ranks if layout.strategy in ("zero1", "zero2", "fsdp") else P
    optimizer = run([([("elementwise", "adamw", owned), ("elementwise", "add", (accum - 1) * P)], 1)])
    if dev.cores:  # a CPU's ranks on one machine share its cores
        slow = dev.shared(min(layout.world, plan.gpus_per_node))
        fwd, bwd, recompute, optimizer = (x * slow for x in (fwd, bwd, recompute, optimizer))
    return fwd, bwd, recompute, optimizer


def selective_recompute(ops, shape, ep=1, alternate=False):
    """What selective checkpointing runs again of a block's forward `ops` (step_time.block_ops): its element-wise
    ops; with `alternate`, also the 2nd, 4th, ... of the matmuls the policy counts (parallel._selective_policy: not an
    MoE block's routed experts, whose grouped matmuls it never keeps), but the last of them, whose output backward
    never reads (torch.utils.checkpoint stops recomputing once backward has what it asked for: GELU's down, counted
    on model.py's blocks, tests/test_train.py). With attention unfused (plan.attention=unfused: Megatron-LM's),
    selective is Megatron's (Korthikanti et al., 2022, sec. 4.2): the attention core again, QK^T, softmax, dropout
    and the product with V, and nothing else."""
    if any(o[0] == "attention_unfused" for o in ops):
        return [o for o in ops if o[0] == "attention_unfused"]
    matmuls = [i for i, o in enumerate(ops) if o[0] == "matmul"]
    if any(o[0] == "elementwise" and o[1] == "router" for o in ops):  # qkv, proj, the router, then the experts'
        per_expert = 3 if shape.get("mlp", "gelu") == "swiglu" else 2
        matmuls = matmuls[:3] + matmuls[3 + per_expert * (shape["n_experts"] // ep):]
    again = set(matmuls[1:-1:2]) if alternate else set()
    return [o for i, o in enumerate(ops) if o[0] == "elementwise" or i in again]


# --- pipeline parallel
def pp_stages(shape, pp, v=1):
    """Each pp rank's share of the model as a shape (model_shape's keys, for that share): the blocks split as
    parallel/pp.py's split_blocks splits them into pp x v virtual stages, rank r holding stages r, r + pp, ...; the
    embedding on the first, final norm + head on the last; its FLOPs per token (the head's and its blocks' matmuls,
    its blocks' attention); `boundaries`: the stage boundaries its chunks touch, each crossed by every micro-batch's
    activation forward and its gradient back."""
    from parallel import pp as pipeline
    L, d, V = shape["n_layer"], shape["n_embd"], shape["vocab"]
    n, block = pp * v, dims(shape)[4]
    sizes = shape.get("block_sizes") or (block,) * L  # an MoE model's blocks differ: dense and MoE ones
    moe_at, moe_blocks = shape.get("moe_at", ()), shape.get("moe_blocks", 0)
    # an MoE block's routed experts a token does not pass through (all but top_k of them): no FLOPs
    idle = shape["expert_params"] / moe_blocks * (1 - shape["top_k"] / shape["n_experts"]) if moe_blocks else 0
    attention = (shape["flops_per_token"] - 6 * (shape["n_params"] - moe_blocks * idle - V * d)) / L  # per block
    ranges = pipeline.split_blocks(L, n)
    out = []
    for r in range(pp):
        ks = range(r, n, pp)
        mine = [i for k in ks for i in ranges[k]]
        blocks, first, last = len(mine), 0 in ks, n - 1 in ks
        matmul = sum(sizes[i] for i in mine) + last * (V * d + d)  # the embedding is a lookup
        moe = sum(i in moe_at for i in mine)  # the stage's MoE blocks and their experts (each block's alike)
        # "model_moe_blocks": the router statistics' rows every rank sums over pp (router_stats_comm)
        out.append({**shape, "n_layer": blocks, "first": first, "last": last, "n_params": matmul + first * V * d,
                    "flops_per_token": 6 * (matmul - moe * idle) + blocks * attention,
                    "boundaries": sum((k > 0) + (k < n - 1) for k in ks),
                    "moe_blocks": moe, "model_moe_blocks": moe_blocks,
                    "expert_params": shape.get("expert_params", 0) * moe / moe_blocks if moe_blocks else 0})
    return out


@functools.lru_cache(maxsize=None)
def pp_schedule_shape(name, pp, m, v=1):
    """(bubble fraction, (micro-batches whose activations each rank holds at most)) of the schedule, from
    parallel/pp.py's own action lists: its `bubble` (forward 1, backward 2) and `peak_in_flight`."""
    from parallel import pp as pipeline
    actions = pipeline.schedule(name, pp, m, v)
    return pipeline.bubble(actions, v), tuple(pipeline.peak_in_flight(a) for a in actions)


def pp_bandwidth(world, plan):
    """Bytes/s each way of a pipeline hop: the mesh has pp outermost, a pp group's ranks world / pp apart, so on
    more than one node some hop crosses the network (each GPU its own NIC: one activation per hop), and the slowest
    hop paces the pipeline."""
    intra = spec(plan)[plan.link]
    return intra if world <= plan.gpus_per_node else min(intra, NETWORKS[plan.network])


def pp_predict(cfg, layout, ac, shape, plan):
    """Pipeline parallelism (parallel/pp.py): pp stages of world / pp ranks each, the data strategy over each
    stage's dp ranks as without pp (_predict on the stage's share of the model, pp_stages). Per pp rank, besides:
      activations  one micro-batch's through the rank's blocks, times the micro-batches it holds at once (the
                   schedule's peak_in_flight: m under GPipe, at most pp under 1F1B and ZB-H1; interleaved: (chunk,
                   micro-batch) pairs, each 1/v of the rank's blocks)
      p2p          ("pp", "p2p"): each micro-batch's activation (b, s/cp, d) forward over every boundary the rank's
                   chunks touch, its gradient back, a send and a receive each counted (parallel/comm.py): 2 m b s d
                   x boundaries elements, in the working weights' dtype (the residual stream's), / tp under
                   sequence parallelism; the pipeline sends 2 m b s d (pp v - 1) in all
      clipping     the squared gradient norm summed over the stages too (clip_comm)
      time         the slowest rank's compute stretched by the schedule's bubble (span = busy / (1 - bubble), the
                   bubble of the same action lists), plus its exposed data-parallel communication, plus the fill
                   and drain: one hop per boundary each way that nothing overlaps, and any p2p time beyond the
                   compute it runs behind
    The numbers reported are the rank with the most memory (what must fit); "pp_ranks" holds each rank's."""
    p, t = cfg.parallel, cfg.train
    world, pp, tp, cp = layout.world, layout.pp, layout.tp, layout.cp
    v = p.pp_virtual if p.pp_schedule == "interleaved_1f1b" else 1
    stages = pp_stages(shape, pp, v)
    ranks = [_predict(cfg, layout, ac, s, plan) for s in stages]
    m, knobs = ranks[0]["accum"], ranks[0]["knobs"]
    bubble, held = pp_schedule_shape(p.pp_schedule, pp, m, v)
    split = tp if knobs["sequence_parallel"] else 1
    hop = t.micro_batch_size * (t.seq_len // cp) * shape["n_embd"] / split * DTYPE_BYTES[knobs["param_dtype"]]
    for r, s, n_held in zip(ranks, stages, held):
        kept, recompute = r["one_micro_batch"]
        r["pp"] = pp
        r["memory"]["activations"] = kept * n_held / v + recompute
        r["total_memory"] = sum(r["memory"].values())
        r["comm"]["pp", "p2p"] = r["p2p_total"] = 2 * m * hop * s["boundaries"]
    largest = max(range(pp), key=lambda k: ranks[k]["total_memory"])
    out = {**ranks[largest], "pp": pp, "pp_schedule": p.pp_schedule, "pp_virtual": v,
           "micro_batches": m, "bubble": bubble, "in_flight": held, "largest_stage": largest, "stage": stages[largest], "pp_ranks": ranks,
           "p2p_pipeline": 2 * m * hop * (pp * v - 1)}
    if plan is not None:
        link = pp_bandwidth(world, plan) * plan.link_efficiency
        compute = max(r["time"]["compute"] for r in ranks)
        span = compute / (1 - bubble)
        fill = 2 * (pp * v - 1) * hop / link
        p2p = [r["p2p_total"] / 2 / link for r in ranks]  # sends and receives at once: half of it each way
        exposed_p2p = fill + max(max(0.0, x - r["time"]["compute"]) for x, r in zip(p2p, ranks))
        exposed = max(r["time"]["exposed comm"] for r in ranks) + exposed_p2p
        seconds, tokens = span + exposed, t.global_batch_size * t.seq_len
        each = Counter(ranks[largest]["time"]["each"])
        each["pp", "p2p"] = max(p2p)
        out.update(step_s=seconds, tok_per_s=tokens / seconds,
                   time={**ranks[largest]["time"], "compute": compute, "bubble": span - compute,
                         "exposed comm": exposed, "exposed p2p": exposed_p2p, "each": each,
                         "comm": sum(each.values())},
                   mfu=shape["flops_per_token"] * tokens / seconds / (spec(plan)["peak"] * world),
                   fits=out["total_memory"] <= plan.usable_memory * spec(plan)["memory"],
                   crosses_nodes=out["crosses_nodes"] + (out["p2p_total"] if world > plan.gpus_per_node else 0))
    return out


# --- one layout, all of it
def predict(cfg, layout=None, ac=None, shape=None, plan=None):
    """Every number of one Layout (parallel/layout.py): the configured one where None (parallel.* on plan.world
    ranks), the parallel knobs staying the configured ones; `ac`: activation checkpointing's mode, train's where
    None. With `plan` (the cluster), step time and MFU too. Under pipeline parallelism: pp_predict."""
    layout = Layout.from_config(cfg.parallel, cfg.plan.world) if layout is None else layout
    shape = shape or model_shape(cfg)
    ac = ac or cfg.train.activation_checkpointing
    return (pp_predict if layout.pp > 1 else _predict)(cfg, layout, ac, shape, plan)


def _predict(cfg, layout, ac, shape, plan):
    """predict for a rank of one pipeline stage's ranks (all of them without pp; under pp `shape` is the stage's
    share), the data strategy (layout.strategy) over its dp x cp."""
    t, tp, cp = cfg.train, layout.tp, layout.cp
    checkpointed = checkpointed_fraction(ac, shape["n_layer"], t.ac_every)
    knobs = {k: cfg.parallel.get(k, v) for k, v in KNOBS.items()}
    method = knobs["cp_method"]
    # auto: bf16 working weights where the strategy keeps a working copy and the run computes in bf16 (config.py)
    knobs["param_dtype"] = layout.working_dtype(knobs["param_dtype"], compute_dtype(t))
    n, shard = layout.reduce_ranks, layout.shard_ranks  # the ranks gradients are reduced over; those of a shard
    accum = t.global_batch_size // (t.micro_batch_size * layout.dp)
    # auto: bf16 autocast, as on any GPU this plans for; bf16 working weights compute in bf16 whatever train.dtype
    act_bytes = 2 if knobs["param_dtype"] == "bfloat16" else DTYPE_BYTES.get(t.dtype, 2)
    P = params_per_rank(shape, tp, layout.ep)
    experts = shape.get("expert_params", 0) / layout.ep if layout.ep > 1 else 0  # outside the data strategy
    state = state_bytes(layout, P, optimizer_bytes(cfg.optim), knobs, experts)
    comm = comm_bytes(layout, P, accum, knobs, shape, t.micro_batch_size, t.seq_len // cp, act_bytes)
    if cp > 1:
        comm.update(cp_comm_bytes(shape, t.micro_batch_size, t.seq_len, act_bytes, accum, cp, method, tp,
                                  checkpointed))
        if shape.get("moe_blocks") and shape.get("aux_loss"):  # the balancing loss's routing counts (E int64s) over
            # the sequences' pieces, each MoE block and micro-step, again where a block is recomputed (parallel/cp.py)
            comm["cp", "all_reduce"] += 2 * 8 * shape["n_experts"] * shape["moe_blocks"] * accum * (1 + checkpointed)
    clip = clip_comm(layout) + router_stats_comm(layout, shape)  # scalars: the step time leaves them out
    # what of comm is a mean over ranks: under sequence parallel each rank's ZeRO or FSDP shard holds its own piece of
    # the norm gains (none to all of them, by where the shard boundaries fall), whose gradients it sums over tp
    spread = Counter({("tp", "all_reduce"): 2 * (2 * shape["n_layer"] + shape.get("last", True)) * shape["n_embd"]
                      * 4}) if tp > 1 and knobs["sequence_parallel"] and layout.sharded \
        else Counter()
    # the residual stream (and so a checkpointed block's input) in the working weights' dtype
    residual = DTYPE_BYTES[knobs["param_dtype"]]
    selective = ac == "selective"
    alternate = selective and t.get("selective_matmuls", "all") == "alternate"
    kept, recompute = cp_activation_bytes(shape, t.micro_batch_size, t.seq_len, act_bytes, cp, method, tp,
                                          knobs["sequence_parallel"], checkpointed, residual, selective, layout.ep,
                                          alternate)
    memory = {**state, "transient": transient_bytes(layout, shape, P - experts, accum, knobs),
              "activations": kept + recompute,
              "autocast copies": autocast_copy_bytes(shape, P, tp, checkpointed) if act_bytes == 2 and
              knobs["param_dtype"] == "float32" else 0}
    cached = autocast_copy_bytes(shape, P, tp) - memory["autocast copies"] if memory["autocast copies"] else 0
    # the loss's chunk (model.py): a CPU's where the plan is for this CPU or the run ran on one (predict_run)
    cpu = (plan is not None and plan.gpu == "cpu") or str(t.get("device", "auto")).startswith("cpu")
    memory["backward buffers"] = backward_bytes(shape, t.micro_batch_size, t.seq_len, act_bytes, cp, method, tp,
                                                residual, recompute, cached,
                                                loss_chunk=CPU_CHUNK_BYTES if cpu else GPU_CHUNK_BYTES)
    # as parallel/comm.py files them: beside cp the data strategy reduces over dp x cp (HSDP: dp_shard x cp)
    dims = {"dp": "dp_cp", "dp_shard": "dp_shard_cp"} if cp > 1 else {}
    # dp_shard and dp_replicate as the theory sees them: the ranks of a shard (dp x cp, HSDP's dp_shard) and of a
    # replica group
    out = {"layout": layout, "pp": 1, "tp": tp, "dp": layout.dp, "cp": cp, "dp_shard": shard,
           "dp_replicate": n // shard, "accum": accum, "ac": ac,
           "params_per_rank": P, "state": sum(state.values()), "memory": memory, "total_memory": sum(memory.values()),
           "comm": Counter({(dims.get(d, d), k): v for (d, k), v in (comm + clip).items()}),
           # as parallel/comm.py's comm_bytes: collectives; the ring's sends and receives apart
           "comm_total": sum(v for (d, k), v in comm.items() if k != "p2p") + sum(clip.values()),
           "p2p_total": comm["cp", "p2p"],
           "spread": spread, "knobs": knobs, "one_micro_batch": (kept, recompute)}
    if cp > 1:
        out["balance"] = cp_balance(t.seq_len, cp)
    if plan is not None:
        seconds, parts = step_time(layout, shape, accum, t.micro_batch_size, t.seq_len, comm, knobs, ac,
                                   checkpointed, plan, act_bytes, t.compile, alternate)
        parts["each"] = Counter({(dims.get(d, d), k): v for (d, k), v in parts["each"].items()})
        tokens = t.global_batch_size * t.seq_len
        out.update(step_s=seconds, time=parts, tok_per_s=tokens / seconds,
                   mfu=shape["flops_per_token"] * tokens / seconds / (spec(plan)["peak"] * layout.stage_world),
                   fits=out["total_memory"] <= plan.usable_memory * spec(plan)["memory"],
                   crosses_nodes=crosses_nodes(comm, layout, plan))
    return out


def predict_run(run_dir, plan=None):
    """The prediction for a finished run of train.py, from its own resolved config.yaml and the Layout its first
    record holds (Layout.record()): the benchmark and the sweep report set it beside the run's measured counters."""
    import json
    from omegaconf import OmegaConf
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        start = json.loads(f.readline())
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    cfg.train.dtype = start["dtype"]  # what the run resolved `auto` to (the planner otherwise assumes a GPU's bf16)
    cfg.train.device = start["device"]  # and where it ran (the loss's chunk: model.py)
    return predict(cfg, Layout(**{f.name: start[f.name] for f in dataclasses.fields(Layout)}), plan=plan)


def cluster_problem(layout, plan):
    """Why the planner can't price this layout on plan's cluster, or None: the cluster's own rules, of which train.py
    knows nothing (a run's rules are the rule book's, Layout.problem, which the planner applies first). Tensor
    parallelism stays within a node: its all-reduces sit between the layers, exposed, and over the network they
    would be the step. An HSDP shard group lies within one node or spans whole nodes: group_spans prices a group by
    its GPUs per node, which a group across a node's edge does not have evenly. (That plan.world is a whole number
    of nodes is check_plan's: a property of the cluster, told before any layout is built.)"""
    n, tp = plan.gpus_per_node, layout.tp
    if tp > n or (layout.world > n and n % tp):
        return f"tp={tp} would span nodes of {n} GPUs (tensor parallelism stays within a node)"
    if layout.hsdp and n % layout.dp_shard and layout.dp_shard % n:
        return (f"parallel.dp_shard={layout.dp_shard}: HSDP's shard groups would straddle nodes of {n} GPUs (the "
                f"planner prices a shard group within one node or over whole nodes); use a divisor or a multiple of "
                f"{n}")
    return None


def candidates(world, plan, impl="scratch", experts=0):
    """Every Layout the planner ranks for this world, with `impl`: each data strategy over all ranks; tensor
    parallelism over all ranks, and over 2 .. a node's GPUs (dividing world) with FSDP, ZeRO-1 or ZeRO-2 over the
    rest; HSDP with a shard group per node where there is more than one node; context parallel over every divisor
    of world, with DDP or FSDP over dp x cp, and FSDP x TP beside it within a node; pipeline stages over every
    divisor of world (outermost: across nodes first), with DDP (nothing to reduce where a stage is one rank) or FSDP
    over each stage's ranks, and FSDP x TP within a node; for a model with `experts`, DDP, ZeRO-1, ZeRO-2 and FSDP
    with expert parallelism over every ep that divides both. Whether one can run this model, batch and knobs is the rule
    book's to say (ranking)."""
    n = plan.gpus_per_node
    for data in DATA_STRATEGIES:
        yield Layout(world, dp_shard=world, data=data, impl=impl)
    yield from (Layout(world, dp_shard=world, data=data, impl=impl, ep=ep)
                for data in ("ddp", "zero1", "zero2", "fsdp")
                for ep in range(2, world + 1) if world % ep == 0 and experts % ep == 0)
    yield Layout(world, tp=world, data="ddp", impl=impl)
    for data in ("fsdp", "zero1", "zero2"):
        yield from (Layout(world, dp_shard=world // k, tp=k, data=data, impl=impl)
                    for k in range(2, min(world, n) + 1) if world % k == 0 and k < world)
    if world > n:  # on one node, HSDP's shard group would be all of it: fsdp
        yield Layout(world, dp_replicate=world // n, dp_shard=n, data="fsdp", impl=impl)
    for cp in range(2, world + 1):
        if world % cp == 0:
            yield Layout(world, dp_shard=world // cp, cp=cp, data="ddp", impl=impl)
            yield Layout(world, dp_shard=world // cp, cp=cp, data="fsdp", impl=impl)
            yield from (Layout(world, dp_shard=world // (cp * k), cp=cp, tp=k, data="fsdp", impl=impl)
                        for k in range(2, n + 1) if (world // cp) % k == 0 and k * cp <= n)
    for pp in range(2, world + 1):
        if world % pp == 0:
            stage = world // pp  # ranks per stage
            yield Layout(world, pp=pp, dp_shard=stage, data="ddp", impl=impl)
            if stage > 1:
                yield Layout(world, pp=pp, dp_shard=stage, data="fsdp", impl=impl)
            yield from (Layout(world, pp=pp, dp_shard=stage // k, tp=k, data="fsdp", impl=impl)
                        for k in range(2, min(stage, n) + 1) if stage % k == 0 and n % k == 0)


# --- parallel=auto: the planner picks the layout
AC_MODES = ("none", "selective", "full")
# under pipeline parallelism, each schedule (parallel/pp.py) with its stages per rank
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))
# plan.gpu=auto on a GPU: the first row whose part torch.cuda.get_device_name() contains
GPU_NAMES = (("H100 PCIe", "h100_pcie"), ("H100", "h100"), ("H200", "h200"), ("A100-SXM4-40GB", "a100_40gb"),
             ("A100-PCIE-40GB", "a100_40gb"), ("A100", "a100"), ("B200", "b200"), ("MI300X", "mi300x"),
             ("L40S", "l40s"))
TOP = 5  # the candidates parallel=auto prints and records


class Settings(dict):
    """A config as nested plain dicts that read as OmegaConf's do (cfg.train.seq_len, cfg.parallel.get(...))."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    __setattr__ = dict.__setitem__

    @classmethod
    def of(cls, cfg):
        from omegaconf import OmegaConf
        wrap = lambda x: cls({k: wrap(v) for k, v in x.items()}) if isinstance(x, dict) else x  # noqa: E731
        return wrap(OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg)


def cluster(cfg, world, device):
    """cfg.plan made concrete for a run of train.py on `world` ranks of `device` (cpu | cuda): plan.gpu=auto is the
    device's row (a GPU by its name, with the memory torch reports for it), the world is the run's, and a node is
    torchrun's LOCAL_WORLD_SIZE (else launcher.nproc_per_node, else the world). Raises ConfigError with one line."""
    from omegaconf import OmegaConf
    p = OmegaConf.to_container(cfg.plan, resolve=True)
    if p["gpu"] == "auto":
        if device == "cpu":
            p["gpu"] = "cpu"
        else:
            name = torch.cuda.get_device_name()
            p["gpu"] = next((key for part, key in GPU_NAMES if part in name), None)
            if p["gpu"] is None:
                raise config.ConfigError(f"parallel=auto: tools/plan.py GPUS has no row for {name!r}; name the nearest "
                                         f"as plan.gpu ({', '.join(GPUS)}) and set plan.peak_tflops, plan.hbm_tbps")
            p["memory_gb"] = p["memory_gb"] or torch.cuda.get_device_properties(0).total_memory / 1e9
    p["world"], p["rank"] = world, False
    p["gpus_per_node"] = p["gpus_per_node"] or int(os.environ.get("LOCAL_WORLD_SIZE") or
                                                   cfg.launcher.nproc_per_node or world)
    plan = OmegaConf.create(p)
    problem = check_plan(plan)
    if problem:
        raise config.ConfigError(f"parallel=auto: {problem}")
    return plan


def auto_rows(cfg, shape, plan, timed=True):
    """(every candidate the rule book and the cluster accept, predicted, fastest first among those that fit; the
    refused ones as (what, why)). A candidate is a Layout of candidates() with a micro-batch (every divisor of the
    rank's share of the batch that also splits the eval batch), an activation-checkpointing mode (AC_MODES) and,
    under pipeline parallelism, a schedule (SCHEDULES); the other knobs stay cfg's. timed=False: memory alone
    (no step time; rows in no order)."""
    # each candidate's micro-batch, checkpointing and schedule set in a copy, as train.py would; plain dicts, as
    # thousands of candidates read settings millions of times (an OmegaConf read costs some 20 us, a dict's 0.1)
    c, plan = Settings.of(cfg), Settings.of(plan)
    t, p = c.train, c.parallel
    eval_batch = t.eval_batch_size or t.global_batch_size
    rows, refused = [], []
    usable = plan.usable_memory * spec(plan)["memory"]
    for layout in candidates(plan.world, plan, p.impl, shape.get("n_experts", 0)):
        problem = cluster_problem(layout, plan)
        if problem:
            refused.append((f"{layout.name} ({layout.describe()})", problem))
            continue
        per_rank = t.global_batch_size // layout.dp if t.global_batch_size % layout.dp == 0 else None
        micros = [m for m in range(1, per_rank + 1) if per_rank % m == 0 and eval_batch % (m * layout.dp) == 0] \
            if per_rank else [t.micro_batch_size]  # (the rule book says why the batch doesn't split)
        schedules = SCHEDULES if layout.pp > 1 else ((p.pp_schedule, p.pp_virtual),)
        for micro, ac, (schedule, virtual) in itertools.product(micros, AC_MODES, schedules):
            t.micro_batch_size, t.activation_checkpointing = micro, ac
            p.pp_schedule, p.pp_virtual = schedule, virtual
            problem = rule_book(c, layout)
            if problem:
                refused.append((f"{layout.name} ({layout.describe()}), micro-batch {micro}, AC {ac}"
                                + (f", {schedule}" if layout.pp > 1 else ""), problem))
                continue
            row = predict(c, layout, ac, shape, plan if timed else None)
            row["fits"] = row["total_memory"] <= usable
            rows.append({**row, "micro": micro, "schedule": schedule, "virtual": virtual})
    rows.sort(key=lambda r: (not r["fits"], r.get("step_s", 0), r["total_memory"]))
    return rows, refused


def auto_overrides(row, short=False):
    """The settings that make a run train `row` (one of auto_rows), as train.py's overrides; short: only those a
    person would type (no degree of 1, no schedule without a pipeline)."""
    lay = row["layout"]
    out = [f"parallel.data={lay.data}", f"parallel.pp={lay.pp}", f"parallel.dp={lay.dp}", f"parallel.cp={lay.cp}",
           f"parallel.tp={lay.tp}", f"parallel.dp_shard={lay.dp_shard}", f"parallel.dp_replicate={lay.dp_replicate}",
           f"parallel.ep={lay.ep}", f"parallel.pp_schedule={row['schedule']}", f"parallel.pp_virtual={row['virtual']}",
           f"train.micro_batch_size={row['micro']}", f"train.activation_checkpointing={row['ac']}"]
    if not short:
        return out
    implied = {"parallel.pp=1", "parallel.cp=1", "parallel.tp=1", "parallel.ep=1", "parallel.dp_replicate=1",
               f"parallel.dp_shard={lay.dp}", f"parallel.dp={lay.dp}"}  # (dp null: what the others leave)
    if lay.pp == 1 or row["schedule"] != "interleaved_1f1b":
        implied |= {f"parallel.pp_virtual={row['virtual']}"}
    if lay.pp == 1:
        implied |= {f"parallel.pp_schedule={row['schedule']}"}
    return [o for o in out if o not in implied]


def apply_choice(cfg, overrides):
    """Set auto's pick (auto_overrides) in cfg: from here on the run is that layout, parallel.auto false."""
    from omegaconf import OmegaConf
    cfg.merge_with(OmegaConf.from_dotlist([*overrides, "parallel.auto=false"]))


def row_record(r):
    """One candidate as metrics.jsonl and the printed table hold it."""
    return {"parallel": r["layout"].name, "layout": r["layout"].describe(), "micro_batch_size": r["micro"],
            "activation_checkpointing": r["ac"], "pp_schedule": r["schedule"] if r["pp"] > 1 else None,
            "memory_gb": r["total_memory"] / 1e9, "step_s": r["step_s"], "tok_per_s": r["tok_per_s"], "fits": r["fits"],
            "overrides": auto_overrides(r)}


def choose(cfg, plan, log=print):
    """parallel=auto: rank every candidate (auto_rows) on `plan`'s cluster and pick the fastest predicted that fits.
    Logs the top TOP with their memory and step time, and returns {"overrides": the pick's (auto_overrides),
    "candidates": the top TOP (row_record), counts}. Raises ConfigError (one line) where nothing fits. The caller
    has applied config.run_rules (train.py before it measures any device)."""
    shape = model_shape(cfg)
    rows, refused = auto_rows(cfg, shape, plan)
    fit = [r for r in rows if r["fits"]]
    if not fit:
        raise config.ConfigError(nothing_fits(cfg, shape, plan, rows, refused))
    top = [row_record(r) for r in fit[:TOP]]
    usable = plan.usable_memory * spec(plan)["memory"] / 1e9
    lines = [f"parallel=auto on {plan.world} x {plan.gpu} ({usable:.1f} GB usable per rank): {len(rows)} candidates "
             f"ranked (layouts x micro-batch x activation checkpointing x pipeline schedule), {len(fit)} fit, "
             f"{len(refused)} refused by the rule book; the fastest predicted step that fits, first:",
             f"  {'':2s} {'parallel':12s} {'layout':34s} {'micro':>5s} {'AC':9s} {'schedule':16s} {'memory GB':>9s} "
             f"{'step ms':>9s} {'tokens/s':>10s}"]
    for i, r in enumerate(top, 1):
        lines.append(f"  {i:<2d} {r['parallel']:12s} {r['layout']:34s} {r['micro_batch_size']:>5d} "
                     f"{r['activation_checkpointing']:9s} {r['pp_schedule'] or '-':16s} {r['memory_gb']:>9.2f} "
                     f"{r['step_s'] * 1e3:>9.1f} {r['tok_per_s']:>10,.0f}")
    best = fit[0]
    lines.append(f"parallel=auto picks {best['layout'].name} ({best['layout'].describe()}), micro-batch "
                 f"{best['micro']}, activation checkpointing {best['ac']}"
                 + (f", {best['schedule']}" if best["pp"] > 1 else "") + ": "
                 + " ".join(auto_overrides(best, short=True)))
    log("\n".join(lines))
    return {"device": plan.gpu, "world": plan.world, "ranked": len(rows), "fit": len(fit), "refused": len(refused),
            "overrides": auto_overrides(best), "candidates": top}


def nothing_fits(cfg, shape, plan, rows, refused):
    """The one line for parallel=auto where no candidate fits: the smallest predicted peak, and the smallest world
    (up to 16x) where one would (memory alone, with micro-batch 1 and full checkpointing among the candidates)."""
    if not rows:
        what, why = refused[0] if refused else ("every layout", "none")
        return f"parallel=auto: the rule book refuses every layout on {plan.world} ranks, e.g. {what}: {why}"
    small = min(rows, key=lambda r: r["total_memory"])
    usable = plan.usable_memory * spec(plan)["memory"]
    more = None
    for k in (2, 4, 8, 16):
        bigger = copy.deepcopy(plan)
        bigger.world = plan.world * k
        if any(r["fits"] for r in auto_rows(cfg, shape, bigger, timed=False)[0]):
            more = bigger.world
            break
    return (f"parallel=auto: nothing fits in {usable / 1e9:.1f} GB per rank on {plan.world} x {plan.gpu}: the smallest "
            f"predicted peak is {small['total_memory'] / 1e9:.1f} GB ({small['layout'].name}, "
            f"{small['layout'].describe()}, micro-batch {small['micro']}, activation checkpointing {small['ac']}); "
            + (f"{more} ranks would fit it" if more else f"not even {16 * plan.world} ranks would fit it")
            + " (smaller micro-batches and full checkpointing are already among the candidates), or a shorter "
              "train.seq_len or a smaller model")


# --- the command
def check_plan(plan):
    if plan.gpu not in DEVICES:
        return (f"plan.gpu={plan.gpu!r}: expected one of {', '.join(DEVICES)}; for another GPU name the nearest "
                f"and set its figures: plan.peak_tflops, plan.hbm_tbps, plan.memory_gb")
    if plan.link not in LINKS:
        return f"plan.link={plan.link!r}: expected one of {', '.join(LINKS)} (within a node; plan.network between)"
    if spec(plan)[plan.link] is None:
        return f"plan.gpu={plan.gpu} has no {plan.link}: plan.link=pcie"
    if plan.network not in NETWORKS:
        return f"plan.network={plan.network!r}: expected one of {', '.join(NETWORKS)}"
    for key in ("world", "gpus_per_node"):
        if not (isinstance(plan[key], int) and plan[key] >= 1):
            return f"plan.{key}={plan[key]!r} must be a positive integer"
    if plan.world > plan.gpus_per_node and plan.world % plan.gpus_per_node:
        return f"plan.world={plan.world} is not a whole number of nodes of {plan.gpus_per_node} GPUs"
    if plan.get("attention", "flash") not in ("flash", "unfused"):
        return f"plan.attention={plan.attention!r}: expected flash or unfused"
    if plan.get("attention") == "unfused" and plan.gpu == "cpu":
        return ("plan.attention=unfused prices attention on a GPU (Megatron-LM's kernels of 2021-2022); the CPU's "
                "profile measures torch's fused attention alone: plan.attention=flash")
    for key in ("compute_efficiency", "link_efficiency", "usable_memory"):
        if (plan[key] is not None or key != "compute_efficiency") and not 0 < plan[key] <= 1:
            return f"plan.{key}={plan[key]} must be in (0, 1]"
    return None


def gb(x):
    return f"{x / 1e9:.2f}"


def pipeline_part(r):
    """The pipeline part of a layout, e.g. 'pp=8 (1f1b, 16 micro-batches, bubble 30.4%)', or '' without one."""
    if r["pp"] == 1:
        return ""
    v = f" x {r['pp_virtual']} virtual" if r["pp_virtual"] > 1 else ""
    return f"pp={r['pp']}{v} ({r['pp_schedule']}, {r['micro_batches']} micro-batches, bubble {r['bubble']:.1%})"


def report(cfg, shape, layout=None):
    """The plan as text: the layout (the configured one where None) in detail, then the ranking."""
    plan, t, world = cfg.plan, cfg.train, cfg.plan.world
    chosen = predict(cfg, layout, shape=shape, plan=plan)
    layout, gpu, pp = chosen["layout"], spec(plan), chosen["pp"]
    bw = bandwidths(layout, plan)
    bw["dp_cp"] = bw["dp"]
    bw["pp"] = pp_bandwidth(world, plan)
    bw["world"] = min(bw.values())
    cp_part, balance = "", ""
    if chosen["cp"] > 1:
        zigzag, plain = chosen["balance"]
        cp_part = f"cp={chosen['cp']} ({chosen['knobs']['cp_method']}) x "
        balance = (f"; attention pairs per cp rank, max/min: {zigzag:.3f} zig-zag (a plain split: {plain:.2f}); "
                   f"exposed K, V communication {chosen['time']['exposed cp'] * 1e3:.1f} ms per step")
    nodes = math.ceil(world / plan.gpus_per_node)
    lines = [
        f"model: {shape['n_params'] / 1e9:.3f}B parameters (L={shape['n_layer']}, d={shape['n_embd']}, "
        f"heads={shape['n_head']}, vocab {shape['vocab']} padded), {shape['flops_per_token'] / 1e9:.2f} GFLOP/token "
        f"| batch {t.global_batch_size} x {t.seq_len} tokens, micro-batch {t.micro_batch_size}, activations in "
        f"{'float32' if t.dtype == 'float32' and chosen['knobs']['param_dtype'] == 'float32' else 'bfloat16'}, "
        f"{cfg.optim.name}",
        f"cluster: {world} x {plan.gpu} ({gpu['peak'] / 1e12:.0f} TFLOP/s bf16, {gpu['memory'] / 1e9:.0f} GB at "
        f"{gpu['hbm'] / 1e12:.2f} TB/s) on "
        f"{nodes} node(s) of {plan.gpus_per_node}; {plan.link} {gpu[plan.link] / 1e9:.0f} GB/s within a node, "
        f"{plan.network} {NETWORKS[plan.network] / 1e9:.0f} GB/s per GPU between; compute: "
        + (f"assumed {plan.compute_efficiency:.0%} of peak" if plan.compute_efficiency else
           "from the step's operations (tools/step_time.py)")
        + f"; assumed {plan.link_efficiency:.0%} of link bandwidth",
        "knobs: " + ", ".join(f"{k}={v}" for k, v in chosen["knobs"].items()),
        "",
        f"layout: parallel={layout.name} {pipeline_part(chosen) + ' x ' if pp > 1 else ''}dp={chosen['dp']}"
        f"{' (dp_replicate={dp_replicate} x dp_shard={dp_shard})'.format(**chosen) * layout.hsdp}"
        f" x {cp_part}tp={chosen['tp']}, gradient accumulation {chosen['accum']}, "
        f"{chosen['params_per_rank'] / 1e6:.1f}M parameters per rank{balance}",
        *([f"pipeline: the largest pp rank, {chosen['largest_stage']} ({chosen['stage']['n_layer']} blocks"
           f"{' + embedding' * chosen['stage']['first']}{' + norm, head' * chosen['stage']['last']}), holds activations of at most "
           f"{chosen['in_flight'][chosen['largest_stage']]} micro-batches; the pipeline sends "
           f"{gb(chosen['p2p_pipeline'])} GB per step between its stages"] if pp > 1 else []),
        "",
        "memory per rank (GB)",
    ]
    for ac in ("none", "selective", "full"):
        p = predict(cfg, layout, ac=ac, shape=shape, plan=plan)
        m = p["memory"]
        if ac == "none":
            master = f"   fp32 master {gb(m['master'])}" if "master" in m else ""
            lines += [f"  parameters {gb(m['parameters']):>8}{master}   gradients {gb(m['gradients'])}   optimizer "
                      f"state {gb(m['optimizer'])}   transient {gb(m['transient'])}"
                      + (f"   bf16 autocast copies of fp32 weights {gb(m['autocast copies'])}"
                         if m["autocast copies"] else "")]
        lines += [f"  activation checkpointing {p['ac']:9s}: activations {gb(m['activations']):>7}, backward buffers "
                  f"{gb(m['backward buffers']):>6}, total "
                  f"{gb(p['total_memory']):>7} of {gpu['memory'] * plan.usable_memory / 1e9:.0f} usable: "
                  f"{'fits' if p['fits'] else 'does NOT fit'}"]
    # the gradient norm's scalar all-reduces (clip_comm: 8 bytes each) are in the totals, not rows of their own
    rows = {key: v for key, v in chosen["comm"].items() if v > 8}
    w = max([4] + [len(dim) for dim, _ in rows])  # HSDP's dimensions have longer names
    lines += ["", "communication per step per rank",
              f"  {'dim':{w}s} {'collective':15s} {'GB':>9s} {'ranks':>6s} {'GB/s':>6s} {'ms':>9s}"]
    size = {**{k: chosen[k] for k in ("dp", "tp", "cp", "dp_shard", "dp_replicate", "pp")},
            "dp_cp": chosen["dp"] * chosen["cp"], "world": world, "ep": chosen["layout"].ep,
            "ep_replicate": chosen["dp"] * chosen["cp"] // chosen["layout"].ep}
    for (dim, kind), v in sorted(rows.items()):
        ms = 1e3 * chosen["time"]["each"][dim, kind]
        lines.append(f"  {dim:{w}s} {kind:15s} {gb(v):>9} {size[dim]:>6d} {bw[dim] / 1e9:>6.0f} {ms:>9.1f}")
    lines.append(f"  {'':{w}s} {'total':15s} {gb(chosen['comm_total'] + chosen['p2p_total']):>9}")
    lines.append(f"  {'':{w}s} {'across nodes':15s} {gb(chosen['crosses_nodes']):>9}   (the collectives whose groups "
                 f"span nodes)")
    tm = chosen["time"]
    bubble = f" + pipeline bubble {tm['bubble'] * 1e3:.0f} ms" if pp > 1 else ""
    lines += ["", f"step: compute {tm['compute'] * 1e3:.0f} ms{bubble} + exposed communication {tm['exposed comm'] * 1e3:.0f} "
                  f"ms (of {tm['comm'] * 1e3:.0f} ms) = {chosen['step_s'] * 1e3:.0f} ms -> "
                  f"{chosen['tok_per_s']:,.0f} tokens/s, MFU {chosen['mfu']:.1%}", ""]
    if plan.rank:
        lines += ranking(cfg, shape, world, plan)
    return "\n".join(lines)


def ranking(cfg, shape, world, plan):
    """Every candidate layout that the rule book (the one train.py applies, with the configured knobs, model and
    batch) and the cluster's rules accept, predicted with and without activation checkpointing, fastest first among
    those that fit; the others listed with the line that refuses them."""
    rows, skipped = [], []
    for layout in candidates(world, plan, cfg.parallel.impl, shape.get("n_experts", 0)):
        problem = rule_book(cfg, layout) or cluster_problem(layout, plan)
        if problem:
            skipped.append(f"{layout.name} ({layout.describe()}): {problem}")
            continue
        for ac in ("none", "full"):
            rows.append(predict(cfg, layout, ac, shape, plan))
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["total_memory"]))
    lines = [f"every layout on {world} GPU(s), fastest first among those that fit (the knobs above):",
             "| rank | parallel | dp | tp | cp | accum | AC | memory GB | fits | comm GB/step | step ms | exposed comm "
             "ms | tokens/s | MFU | across nodes GB/step | pipeline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        ep = f" ep={r['layout'].ep}" if r["layout"].ep > 1 else ""
        lines.append(f"| {i if r['fits'] else '-'} | {r['layout'].name}{ep} | {r['dp']} | {r['tp']} | {r['cp']} | "
                     f"{r['accum']} | "
                     f"{r['ac']} | {r['total_memory'] / 1e9:.1f} | {'yes' if r['fits'] else 'no'} | "
                     f"{(r['comm_total'] + r['p2p_total']) / 1e9:.2f} | {r['step_s'] * 1e3:.0f} | "
                     f"{r['time']['exposed comm'] * 1e3:.0f} "
                     f"| {r['tok_per_s']:,.0f} | {r['mfu']:.1%} | {r['crosses_nodes'] / 1e9:.2f} | "
                     f"{pipeline_part(r) or '-'} |")
    return lines + [f"not possible here: {s}" for s in skipped]


def compose(overrides, config_name="plan"):
    """The config `python train.py` (config_name="config") or this command would compose from these overrides.

    Hydra composes the config groups' choices first (model=..., parallel=...: which files, in which packages), then
    applies each plain key=value to the result (ConfigLoaderImpl._apply_overrides_to_config, in the order given).
    The first half is nearly all of its time (about 0.2 CPU-s a call: every file parsed again) and repeats across
    calls that differ only in plain values (the planner's candidates, the dry runs' tables, the tests' configs), so
    it is composed once per set of choices (and state of conf/'s files: an edited one composes afresh) and copied;
    the second half is Hydra's own, on the copy."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException
    plain, choices = [], []
    for o in OverridesParser.create().parse_overrides(overrides=list(overrides)):
        (plain if _plain_override(o) else choices).append(o)
    files = tuple((os.path.join(d, f), os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, names in os.walk(CONF) for f in sorted(names))
    cfg = copy.deepcopy(_compose_choices(config_name, tuple(o.input_line for o in choices), files))
    try:
        ConfigLoaderImpl._apply_overrides_to_config(plain, cfg)
    except OmegaConfBaseException as e:  # as Hydra's load_configuration words it
        raise ConfigCompositionException().with_traceback(e.__traceback__) from e
    return cfg


CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _plain_override(o):
    """A key=value (or +key=value, ~key) on a config value, not a config group's choice, Hydra's own settings or a
    sweep: what Hydra applies after composing."""
    key = o.key_or_group
    return (o.package is None and not o.is_sweep_override() and not key.startswith("hydra")
            and not os.path.isdir(os.path.join(CONF, *key.split("/"))))


@functools.lru_cache(maxsize=None)
def _compose_choices(config_name, overrides, files):
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def rule_book(cfg, layout):
    """The rule book's line for `layout` with cfg's knobs, model and batch on a GPU (config.layout_problem, the call
    config.check makes), or None."""
    return config.layout_problem(cfg, layout, compute_dtype(cfg.train))


def check(cfg):
    """Everything the planner can know wrong before it plans: the cluster (check_plan), the settings
    (config.validate), the run's own rules on plan.world GPUs (config.rules: the model's, the layout's degrees and
    the rule book, as train.py applies them), then the cluster's rules for the layout (cluster_problem). Returns
    the Layout; raises ConfigError with one line."""
    problem = check_plan(cfg.plan)
    if problem:
        raise config.ConfigError(problem)
    config.validate(cfg)
    layout = config.rules(cfg, cfg.plan.world, compute_dtype(cfg.train))
    problem = cluster_problem(layout, cfg.plan)
    if problem:
        raise config.ConfigError(problem)
    return layout


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    if "--figure1" in argv:
        print(figure1_report())
        return
    try:
        cfg = compose(argv)
    except Exception as e:  # Hydra's own message: unknown group option, bad override syntax, missing key
        sys.exit(f"error: {str(e).splitlines()[0]}")
    try:
        picked = pick(cfg) if cfg.parallel.auto else None
        layout = check(cfg)
    except config.ConfigError as e:
        sys.exit(f"error: {e}")
    print(report(cfg, model_shape(cfg), layout))
    if picked and cfg.plan.dry_run:
        print(confirm(picked, cfg.plan.dry_run, argv))


def pick(cfg):
    """`python -m tools.plan parallel=auto`: choose on plan.*'s cluster, print the top 5, set the pick in cfg (the
    report below is then the pick's). Returns choose's summary."""
    problem = check_plan(cfg.plan)
    if problem:
        raise config.ConfigError(problem)
    config.validate(cfg)
    config.run_rules(cfg)  # what no layout changes is told as itself, not as every layout refused
    picked = choose(cfg, cfg.plan)
    apply_choice(cfg, picked["overrides"])
    cfg.plan.rank = False  # choose has ranked them
    print()
    return picked


def confirm(picked, k, argv):
    """The memory of auto's top k, measured by dry runs at plan.world (tools/dry_run.py: rank 0 under the fake
    process group, fake tensors: sizes exact, nothing computed) beside the planner's, as a markdown table."""
    from tools import dry_run
    world = picked["world"]
    lines = [f"dry runs of parallel=auto's top {k} at world {world} (rank 0, fake tensors), measured / planner GB:",
             "| # | parallel | layout | micro | AC | state | peak model state | activations (one micro-batch) |",
             "|---|---|---|---|---|---|---|---|"]
    for i, cand in enumerate(picked["candidates"][:k], 1):
        cfg = compose([a for a in argv if not a.startswith("parallel=")])  # the same run, the pick's layout
        apply_choice(cfg, [*cand["overrides"], f"dry_run.world={world}", "dry_run.rank=0", "dry_run.compute=fake",
                           "launcher.nproc_per_node=null"])  # (one process: plan.yaml's node size is the cluster's)
        layout, device, dtype, accum, compute, predicted = dry_run.check(cfg)
        print(f"dry run {i} of {k}: {cand['parallel']} ({cand['layout']}) ...", file=sys.stderr, flush=True)
        m = dry_run.measure(cfg, layout, 0, compute, device, dtype, accum, steps=1)
        got = {what: f"{a / 1e9:.4g} / {b / 1e9:.4g} ({dry_run.ratio(a, b)})" for what, a, b in
               dry_run.compare(m, predicted)}
        lines.append(f"| {i} | {cand['parallel']} | {cand['layout']} | {cand['micro_batch_size']} | "
                     f"{cand['activation_checkpointing']} | {got['state']} | {got.get('peak model state', '-')} | "
                     f"{got['activations (one micro-batch)']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
