"""The planner (tools/plan.py) against measurement: its state and comm per rank equal what real runs' counters
record for every strategy at world sizes 1, 2 and 4 (pipelines: every stage's state, the p2p of a stage and of the
pipeline, the schedule's bubble); its activation count equals what autograd saves; the command
prints a plan and a ranking, and turns bad input into one line."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import config
import parallel
import train
from conftest import ROOT, forked, make_cfg, needs_bf16, needs_shared, read_metrics, small_run
from model import GPT, GPTConfig
from parallel.layout import DATA_STRATEGIES, Layout, LayoutError
from tools import act_memory, plan

# 4 heads so that tensor parallelism can split them 4 ways; global 8 in micro-batches of 2: accumulation 4, 2, 1 at
# 1, 2, 4 data-parallel ranks; float32 on both sides (the planner's default is bf16 activations)
SHORT = ("model.n_head=4", "train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=2",
         "train.eval_every=100", "train.eval_steps=1", "checkpoint.keep=0", "train.dtype=float32")


# every layout preset (auto is the planner's pick of one: tests/test_auto.py)
PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", "parallel")) if f.endswith(".yaml")
                 and f != "auto.yaml")


def measured_layouts():
    """(preset, world) for every preset in conf/parallel, at every world size of 1, 2, 4 its checks accept (pp's
    among them: its 2 blocks make 2 stages at most)."""
    for strategy in PRESETS:
        cfg = make_cfg(*small_run(*SHORT, f"parallel={strategy}"))
        model, t = config.model_config(cfg, 512), cfg.train
        for world in (1, 2, 4):
            try:
                layout = Layout.from_config(cfg.parallel, world)
            except LayoutError:
                continue
            if layout.problem(cfg.parallel, model, t.seq_len, t.global_batch_size, t.micro_batch_size) is None:
                yield strategy, world


LAYOUTS = list(measured_layouts())


def test_every_strategy_is_measured():
    assert {s for s, _ in LAYOUTS} | {s for s, _, _ in SP} == set(PRESETS)  # hsdp: only with a node size, in SP
    # the planner ranks every data strategy, HSDP and each of the mesh's dimensions
    ranked = list(plan.candidates(16, cluster(world=16)))
    assert {c.strategy for c in ranked} == set(DATA_STRATEGIES) and any(c.hsdp for c in ranked)
    assert all(any(getattr(c, dim) > 1 for c in ranked) for dim in ("pp", "cp", "tp"))


def forked_run(world, run_dir, *overrides):
    forked(world, lambda: train.run(make_cfg(*overrides), run_dir))


# and sequence parallel, whose collectives differ in kind, for both tensor-parallel layouts
SP = [(s, 4, ("parallel.sequence_parallel=true",)) for s in ("tp", "fsdp_tp")]
# and ZeRO over dp beside tensor parallel (zero1_tp, zero2_tp)
SP += [(s, 4, ("parallel.tp=2",)) for s in ("zero1", "zero2")]
# and mixed-precision ZeRO beside sequence parallel: its activations are bf16 although train.dtype=float32
SP += [("zero1", 4, ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.param_dtype=bfloat16"))]
# and HSDP 2 x 2 (its preset shards over a node's ranks, which a forked rank doesn't know: say it)
SP += [("hsdp", 4, ("parallel.dp_shard=2",))]
# and pipelines beside FSDP (pp=2 x dp=2), and interleaved over 4 ranks (8 virtual stages of one block each)
SP += [("pp", 4, ("parallel.pp=2", "parallel.data=fsdp")),
       ("pp", 4, ("model.n_layer=8", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"))]


def marked(case):
    """A case with bf16 working weights skips on a CPU that can't compute in bf16."""
    return pytest.param(*case, marks=needs_bf16) if "parallel.param_dtype=bfloat16" in case[2] else case


@pytest.mark.parametrize("strategy,world,extra", [(s, w, ()) for s, w in LAYOUTS] + [marked(c) for c in SP])
def test_prediction_equals_measurement(tmp_path, strategy, world, extra):
    """A real 2-step run per layout (gloo, float32): state_bytes and comm_bytes of every step, rank 0, against the
    planner's numbers for the same config; padding to multiples of world is the only difference allowed."""
    overrides = small_run(*SHORT, f"parallel={strategy}", *extra)
    run_dir = str(tmp_path / "run")
    if world == 1:  # in this process (no launcher: train.py gives a lone rank a local store)
        train.run(make_cfg(*overrides), run_dir)
    else:
        forked_run(world, run_dir, *overrides)
    start, *records = read_metrics(run_dir)
    steps = [r for r in records if "comm_bytes" in r]
    cfg = make_cfg(*overrides)
    predicted = plan.predict(cfg, Layout.from_config(cfg.parallel, world))
    shape = plan.model_shape(cfg)
    assert shape["n_params"] == start["n_params"] and predicted["accum"] == start["grad_accum"]
    assert len(steps) == 2
    for r in steps:
        # within 1e-3: rank 0's share of the norm gains and of their sequence-parallel sums differs from the mean the
        # planner counts (4e-4 of the comm under fsdp_tp with sequence parallel; everything else within 1e-4)
        assert r["state_bytes"] == pytest.approx(predicted["state"], rel=1e-3)
        assert r["comm_bytes"] == pytest.approx(predicted["comm_total"], rel=1e-3)
        if start["parallel"] == "hsdp":  # by mesh dimension: within dp_shard, and across dp_replicate
            for (dim, kind), v in predicted["comm"].items():
                assert r[f"comm_{dim}_{kind}"] == pytest.approx(v, rel=1e-3), (dim, kind)
        if start["pp"] > 1:  # rank 0 is the first stage's; the largest stage's state is the max over ranks
            stages = predicted["pp_ranks"]
            assert r["state_bytes"] == pytest.approx(stages[0]["state"], rel=1e-3)
            assert r["state_bytes_max"] == pytest.approx(max(s["state"] for s in stages), rel=1e-3)
            assert r["comm_pp_p2p"] == pytest.approx(stages[0]["p2p_total"], rel=1e-3)  # its sends and receives
            assert r["p2p_bytes_pipeline"] == pytest.approx(predicted["p2p_pipeline"], rel=1e-3)
            # the bubble of 1F1B, (p - 1) / (m + p - 1), and of the interleaved, (p - 1) / (v m + p - 1)
            # (Narayanan et al. 2021, section 2.2), with m micro-batches on p stages of v chunks each
            p_, m, v = start["pp"], start["grad_accum"], predicted["pp_virtual"]
            assert predicted["bubble"] == pytest.approx((p_ - 1) / (v * m + p_ - 1), rel=1e-9), (p_, m, v)
        if start["parallel"] in ("fsdp", "fsdp_tp") and start["grad_accum"] > 1:
            # FSDP's transient under accumulation: every unit's local gradient sum (P x 4 bytes) with the units in
            # flight; the planner once left the sums out (5.6 GB per rank for gpt_1p3b at accumulation 8)
            # (measured 2026-12-03: exact under fsdp, 1 KiB over under fsdp_tp, 2e-3)
            assert r["transient_bytes"] == pytest.approx(predicted["memory"]["transient"], rel=5e-3)
    print(f"{strategy} {' '.join(extra)} N={world}: state {steps[-1]['state_bytes'] / predicted['state']:.6f}, comm "
          f"{steps[-1]['comm_bytes'] / max(predicted['comm_total'], 1):.6f} of predicted")


@pytest.mark.parametrize("n_layer,n_embd,vocab", [(2, 64, 512), (24, 2048, 50257), (3, 96, 1000)])
def test_parameter_formula(n_layer, n_embd, vocab):
    """P = 2 V d + L (12 d^2 + 2 d) + d, of which (2L + 1) d norm gains stay whole under tensor parallelism."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=4, n_embd=n_embd))
    V, L, d = model.cfg.padded_vocab_size, n_layer, n_embd
    assert model.num_params() == 2 * V * d + L * (12 * d * d + 2 * d) + d
    assert sum(p.numel() for n, p in model.named_parameters() if "norm" in n) == (2 * L + 1) * d
    shape = {"n_layer": L, "n_embd": d, "n_params": model.num_params()}
    assert plan.params_per_rank(shape, 4) == (2 * V * d + 12 * L * d * d) / 4 + (2 * L + 1) * d


LLAMA = {"n_kv_head": 1, "mlp": "swiglu", "ffn_hidden": 256}  # 4 query heads on 1 key/value head, SwiGLU of 4d


def saved_for_backward(ac, n_layer=3, d=64, heads=4, vocab=256, b=2, s=32, **llama):
    """Bytes of the distinct storages autograd keeps for backward (parameters and buffers left out)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=s, n_layer=n_layer, n_head=heads, n_embd=d, **llama))
    model.init_weights()
    parallel.apply_activation_checkpointing(model, ac)
    kept, _ = act_memory.saved_bytes(model, torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s)))
    c = model.cfg
    shape = {"n_layer": n_layer, "n_embd": d, "vocab": c.padded_vocab_size}
    if llama:  # model_shape's keys that tell Llama's block from GPT-3's
        shape.update(kv_embd=c.kv_heads * c.head_dim, hidden=c.hidden, mlp=c.mlp)
    return kept, shape


@pytest.mark.parametrize("llama", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activation_count_equals_autograd(ac, llama):
    measured, shape = saved_for_backward(ac, **llama)
    kept, _ = plan.activation_bytes(shape, 2, 32, 4, checkpointed=plan.checkpointed_fraction(ac, 3))
    # 0.3-0.7% over (2026-12-03): 4 KiB of the loss's the planner leaves out, at any size
    assert measured == pytest.approx(kept, rel=0.01)


def run_plan(*overrides):
    p = subprocess.run([sys.executable, "-m", "tools.plan", *overrides], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_command_plans_and_ranks():
    out = run_plan("model=gpt_1p3b", "parallel=fsdp", "plan.world=64", "plan.gpu=h100", "plan.link=nvlink")
    assert "layout: parallel=fsdp dp=64 x tp=1, gradient accumulation 1" in out
    assert "activation checkpointing none" in out and "activation checkpointing full" in out
    assert "dp   all_gather" in out and "dp   reduce_scatter" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "rank" not in line]
    layouts = {(r[1].strip(), int(r[3])) for r in rows}
    assert {("ddp", 1), ("zero1", 1), ("zero2", 1), ("fsdp", 1), ("fsdp_tp", 2), ("fsdp_tp", 8)} <= layouts
    fitting = [float(r[10]) for r in rows if r[8].strip() == "yes"]
    assert fitting and fitting == sorted(fitting)  # fastest first
    assert [r[0].strip() for r in rows[:len(fitting)]] == [str(i) for i in range(1, len(fitting) + 1)]


def cluster(**kw):
    from omegaconf import OmegaConf
    return OmegaConf.create({"world": 8, "gpu": "h100", "gpus_per_node": 8, "link": "nvlink",
                             "network": "infiniband", "compute_efficiency": 0.4, "link_efficiency": 0.8,
                             "usable_memory": 0.9, "rank": False, **kw})


def plan_cfg(*overrides):
    return plan.compose(overrides)


def at(cfg, world):
    """The layout cfg's parallel.* asks for on `world` ranks (the planner's default: plan.world)."""
    return Layout.from_config(cfg.parallel, world)


def test_hsdp_what_crosses_nodes():
    """gpt_1p3b on 2 nodes of 8: HSDP shards within each node (16P/8 per rank, as FSDP over 8) and sends only the
    all-reduce of its gradient slice, 2 Psi / 8, over the network; FSDP over all 16 sends all of its traffic there
    (two bf16 all-gathers of Psi / 2, as plan.yaml's train.dtype makes the weights, and the fp32 reduce-scatter of
    Psi: 2 Psi). The
    all-reduce rides one NIC per rank, and in the ranking HSDP shards over a node's GPUs."""
    one_micro = "train.micro_batch_size=32"  # 512 sequences on 16 ranks: no accumulation
    configured, fsdp_cfg = plan_cfg("parallel=hsdp", one_micro), plan_cfg("parallel=fsdp", one_micro)
    hsdp = plan.predict(configured, at(configured, 16), plan=cluster(world=16))
    fsdp = plan.predict(fsdp_cfg, at(fsdp_cfg, 16), plan=cluster(world=16))
    P, psi = hsdp["params_per_rank"], 4 * hsdp["params_per_rank"]  # reduce_dtype float32
    assert (hsdp["layout"].name, hsdp["dp_replicate"], hsdp["dp_shard"]) == ("hsdp", 2, 8)
    assert hsdp["state"] == pytest.approx(16 * P / 8) and fsdp["state"] == pytest.approx(16 * P / 16)
    assert hsdp["comm"]["dp_replicate", "all_reduce"] == pytest.approx(2 * psi / 8)
    assert hsdp["comm"]["dp_shard", "reduce_scatter"] == pytest.approx(psi)
    assert hsdp["crosses_nodes"] == pytest.approx(2 * psi / 8)
    assert fsdp["crosses_nodes"] == pytest.approx(fsdp["comm_total"]) and fsdp["comm_total"] == pytest.approx(2 * psi)
    assert plan.bandwidths(hsdp["layout"], cluster(world=16))["dp_replicate"] == plan.NETWORKS["infiniband"]
    (candidate,) = [c for c in plan.candidates(16, cluster(world=16)) if c.hsdp]
    ranked = plan.predict(fsdp_cfg, candidate, plan=cluster(world=16))
    assert ranked["dp_shard"] == 8 and ranked["comm"] == hsdp["comm"]
    assert not any(c.hsdp for c in plan.candidates(8, cluster()))  # one node: its shard group would be all of it
    # a shard group across a node's edge: the planner has no price for it
    assert plan.cluster_problem(Layout(24, dp_replicate=8, dp_shard=3, data="fsdp"), cluster(world=24)) == (
        "parallel.dp_shard=3: HSDP's shard groups would straddle nodes of 8 GPUs (the planner prices a shard group "
        "within one node or over whole nodes); use a divisor or a multiple of 8")


def test_time_model():
    """Alone, a GPU runs at the assumed efficiency; FSDP's per-micro-step gathers hide behind compute over NVLink
    but not over PCIe once micro-batches are small (the README's 40% -> single digits); TP's all-reduces are
    always exposed."""
    cfg = plan_cfg("parallel=single", "train.global_batch_size=8")
    single = plan.predict(cfg, at(cfg, 1), plan=cluster(world=1))
    assert single["mfu"] == pytest.approx(0.4, rel=1e-9) and single["time"]["exposed comm"] == 0
    cfg = plan_cfg("train.micro_batch_size=1")
    nvlink, pcie = (plan.predict(cfg, plan=cluster(link=link)) for link in ("nvlink", "pcie"))
    assert nvlink["mfu"] > 0.3 and pcie["mfu"] < 0.1
    # the bytes, on either link: 512 sequences in micro-batches of 1 on 8 ranks are 64 micro-steps, each gathering
    # the bf16 weights twice (forward, backward: 2 x 2 P), then one float32 reduce-scatter of the summed gradients
    P = nvlink["params_per_rank"]
    for r in (nvlink, pcie):
        assert r["comm"]["dp", "all_gather"] == pytest.approx(64 * 2 * 2 * P, rel=1e-9)
        assert r["comm"]["dp", "reduce_scatter"] == pytest.approx(4 * P, rel=1e-9)
    tp = plan.predict(cfg, Layout(8, tp=8, data="ddp"), plan=cluster())
    assert tp["time"]["exposed comm"] == pytest.approx(tp["time"]["comm"])
    no_prefetch = plan.predict(plan_cfg("train.micro_batch_size=1", "parallel.prefetch=0"), plan=cluster())
    assert no_prefetch["time"]["exposed comm"] == pytest.approx(no_prefetch["time"]["comm"])


def test_what_nothing_hides():
    """The two exposures besides tensor parallelism's: FSDP's first unit each micro-step (the embedding's gather,
    before anything computes), and, under a pipeline, the data strategy's gradient reduction, which ours
    (parallel/pp.py) and torch's FSDP2 stages run once the schedule is over, where torch's DDP stages reduce during
    the last backward as without a pipeline. gpt_1p3b on 8 H100s, where compute hides every other collective."""
    cfg = plan_cfg("train.micro_batch_size=8")  # 512 sequences on 8 FSDP ranks: 8 micro-steps
    fsdp = plan.predict(cfg, plan=cluster())
    shape, P = plan.model_shape(cfg), fsdp["params_per_rank"]
    gather = fsdp["time"]["each"]["dp", "all_gather"] / fsdp["accum"] / 2  # one pass over the units (reshard)
    first = gather * shape["vocab"] * shape["n_embd"] / P  # the embedding's share of it
    assert first > 0 and fsdp["time"]["exposed comm"] == pytest.approx(fsdp["accum"] * first, rel=1e-6)
    ddp, torch_ddp, pp_fsdp = (
        plan.predict(plan_cfg("parallel=pp", "parallel.pp=2", f"parallel.data={data}", f"parallel.impl={impl}",
                              "train.micro_batch_size=8"), plan=cluster())
        for data, impl in (("ddp", "scratch"), ("ddp", "torch"), ("fsdp", "scratch")))
    assert ddp["time"]["exposed comm"] >= ddp["time"]["each"]["dp", "all_reduce"] > 0
    assert torch_ddp["time"]["exposed comm"] == pytest.approx(ddp["time"]["exposed comm"] -
                                                              ddp["time"]["each"]["dp", "all_reduce"], rel=1e-3)
    assert pp_fsdp["time"]["exposed comm"] >= pp_fsdp["time"]["each"]["dp", "reduce_scatter"] > 0


def test_expert_parallel_time_and_ranking():
    """Expert parallelism at 32 ranks on nodes of 4 (moe_tiny's 8 experts): each all-to-all sends 1/ep of its input
    to each peer and nothing hides it; ep=4 is one node (3 peers over NVLink), ep=8 spans two (3 over NVLink, 4 over
    the GPU's own 50 GB/s NIC); the experts' all-reduce over the ranks that hold the same ones follows backward,
    exposed; the ranking offers DDP with every ep that divides the experts and the world."""
    cfg = plan_cfg("model=moe_tiny", "parallel=ddp", "parallel.ep=8", "plan.world=32", "plan.gpus_per_node=4",
                   "train.seq_len=256", "train.micro_batch_size=1", "train.global_batch_size=64")
    c = cluster(world=32, gpus_per_node=4)
    nvlink, nic = 0.8 * 450e9, 0.8 * 50e9
    for ep, peers in ((4, 3 / nvlink), (8, 3 / nvlink + 4 / nic)):
        r = plan.predict(cfg, Layout(32, dp_shard=32, data="ddp", ep=ep), plan=c)
        t = r["time"]["each"]
        assert t["ep", "all_to_all"] == pytest.approx(r["comm"]["ep", "all_to_all"] / ep * peers, rel=1e-12)
        assert t["ep_replicate", "all_reduce"] > 0
        assert r["time"]["exposed comm"] >= t["ep", "all_to_all"] + t["ep_replicate", "all_reduce"]
    lines = plan.ranking(cfg, plan.model_shape(cfg), 32, c)
    assert {f"ddp_ep ep={ep}" for ep in (2, 4, 8)} <= {ln.split(" | ")[1] for ln in lines if ln.startswith("| ")}


@pytest.mark.parametrize("overrides,message", [
    (["plan.gpu=h900"], "plan.gpu='h900': expected one of h100, h100_pcie, h200, a100, a100_40gb, b200, mi300x, l40s, "
                        "cpu; for another GPU name the nearest and set its figures: plan.peak_tflops, plan.hbm_tbps, "
                        "plan.memory_gb"),
    (["plan.gpu=l40s"], "plan.gpu=l40s has no nvlink: plan.link=pcie"),
    (["plan.link=wifi"], "plan.link='wifi': expected one of nvlink, pcie"),
    (["plan.world=12", "plan.gpus_per_node=4"], "not divisible by micro_batch_size (8) x data-parallel ranks (12)"),
    (["plan.world=12"], "plan.world=12 is not a whole number of nodes of 8 GPUs"),
    (["parallel=single", "plan.world=8"], "parallel=single runs in one process, but 8 were launched"),
    (["parallel=ddp", "plan.world=1"], "needs several processes"),
    (["plan.world=0"], "plan.world=0 must be a positive integer"),
    (["parallel=pipeline"], "Could not find 'parallel/pipeline'"),
    (["parallel=ddp", "parallel.param_dtype=bfloat16"], "parallel.param_dtype=bfloat16: parallel=ddp computes with"),
])
def test_bad_input_is_one_line(overrides, message):
    with pytest.raises(SystemExit) as e:
        plan.main(overrides)
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text


def test_figure1(capsys):
    """`python -m tools.plan --figure1`: the ZeRO paper's Figure 1 (Psi = 7.5B, N = 64) from state_bytes, to the
    paper's one decimal: 120 / 31.4 / 16.6 / 1.9 GB."""
    rows = plan.figure1()
    assert [(s, round(ours, 1)) for s, _, _, ours, _ in rows] == [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6),
                                                                   ("fsdp", 1.9)]
    assert all(round(ours, 1) == paper for *_, ours, paper in rows)
    plan.main(["--figure1"])
    out = capsys.readouterr().out
    assert "| zero1 | parallel=zero1 parallel.param_dtype=bfloat16 parallel.reduce_dtype=bfloat16 | 2 Psi + 2 Psi + " \
           "K Psi / N | 31.41 | 31.4 |" in out and "| fsdp | parallel=fsdp | (2 + 2 + K) Psi / N | 1.88 | 1.9 |" in out


def test_mixed_precision_zero_follows_every_knob():
    """Psi = 7.66B on 64 ranks, accumulation 8 (the issue's example): ZeRO-2's local accumulation holds full fp32
    gradients between micro-steps (30.6 GB, all of its saving); sharded accumulation holds none and reduce-scatters
    8 times. ZeRO-1 with bf16 weights and fp32 gradients is Megatron's distributed optimizer, 6 + 12/N bytes."""
    big = ("model.n_layer=36", "model.n_embd=4096", "model.n_head=32", "train.global_batch_size=4096",
           "parallel.param_dtype=bfloat16")
    local, sharded = (plan.predict(cfg, at(cfg, 64)) for cfg in
                      (plan_cfg(*big, "parallel=zero2", f"parallel.accumulate={a}") for a in ("local", "sharded")))
    P = local["params_per_rank"]
    assert round(P / 1e9, 2) == 7.66 and local["accum"] == 8
    assert local["memory"]["transient"] == 4 * P and round(local["memory"]["transient"] / 1e9, 1) == 30.6
    assert sharded["memory"]["transient"] == 0
    assert sharded["state"] == local["state"] == pytest.approx((2 + 16 / 64) * P)
    assert sharded["comm"]["dp", "reduce_scatter"] == 8 * local["comm"]["dp", "reduce_scatter"] == 8 * 4 * P
    assert local["comm"]["dp", "all_gather"] == 2 * P  # the bf16 working weights
    cfg = plan_cfg(*big, "parallel=zero2", "parallel.reduce_dtype=bfloat16")
    bf16 = plan.predict(cfg, at(cfg, 64))
    assert bf16["state"] == pytest.approx((2 + 14 / 64) * P) and bf16["memory"]["transient"] == 2 * P
    assert bf16["comm"]["dp", "reduce_scatter"] == 2 * P
    cfg = plan_cfg(*big, "parallel=zero1")
    zero1 = plan.predict(cfg, at(cfg, 64))
    assert zero1["state"] == pytest.approx((6 + 12 / 64) * P) and zero1["memory"]["transient"] == 0
    cfg = plan_cfg(*big[:-1], "parallel=zero1", "parallel.param_dtype=float32")
    fp32 = plan.predict(cfg, at(cfg, 64))
    assert fp32["state"] == pytest.approx((8 + 8 / 64) * P) and fp32["comm"]["dp", "all_gather"] == 4 * P


@pytest.mark.parametrize("strategy,impl,working", [("zero1", "scratch", 2), ("zero2", "scratch", 2),
                                                   ("fsdp", "scratch", 2), ("fsdp", "torch", 2),
                                                   ("zero2", "torch", 2), ("zero1", "torch", 4), ("ddp", "scratch", 4)])
def test_param_dtype_auto_follows_the_compute_dtype(strategy, impl, working):
    """param_dtype=auto (the default): bf16 working weights where the run computes in bf16 and the strategy keeps a
    working copy (FSDP2's convention), float32 under float32 compute, and float32 where the weights are the master
    (ddp; torch's ZeroRedundancyOptimizer steps the model's own)."""
    over = (f"parallel={strategy}", f"parallel.impl={impl}")
    auto = plan.predict(plan_cfg(*over, "train.dtype=bfloat16"))
    explicit = plan.predict(plan_cfg(*over, "train.dtype=bfloat16",
                                     f"parallel.param_dtype={'bfloat16' if working == 2 else 'float32'}"))
    assert auto["knobs"]["param_dtype"] == ("bfloat16" if working == 2 else "float32")
    assert auto["memory"] == explicit["memory"] and auto["comm"] == explicit["comm"]
    fp32 = plan.predict(plan_cfg(*over, "train.dtype=float32"))
    assert fp32["knobs"]["param_dtype"] == "float32"


@pytest.mark.parametrize("overrides,message", [
    (["parallel=fsdp_tp", "parallel.tp=8", "plan.world=12", "plan.gpus_per_node=4"],
     "parallel.tp=8 must divide the number of ranks (12)"),
    (["parallel=fsdp_tp", "parallel.tp=16", "plan.world=32"],
     "tp=16 would span nodes of 8 GPUs (tensor parallelism stays within a node)"),
    (["parallel=tp", "parallel.tp=6", "plan.world=6"], "parallel.tp=6 must divide the model's 16 attention heads"),
])
def test_impossible_layouts(overrides, message):
    """The rule book's line (train.py's), then the cluster's own."""
    with pytest.raises(SystemExit) as e:
        plan.main(overrides)
    assert str(e.value.code).startswith(f"error: {message}")


needs_data_and_bpe = needs_shared("data/tinyshakespeare.txt", "tiktoken_cache")


def test_gpu_bench_trace_shares(tmp_path):
    """The overhead columns from a hand-made CUDA trace: steps 0-100 us on the host (the GPU's annotation of a step
    runs later and is not the window); kernels busy 0-30 and 50-70 (one overlapping another, one past the steps'
    end), launches 10 us, a sync 20 us, ops covering 0-80 on two threads."""
    from tools import gpu_bench
    X = lambda name, cat, ts, dur, tid=1: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}
    events = [X("ProfilerStep#2", "user_annotation", 0, 50), X("ProfilerStep#3", "user_annotation", 50, 50),
              X("ProfilerStep#3", "gpu_user_annotation", 55, 60, 7),
              X("gemm", "kernel", 0, 30, 7), X("gemm", "kernel", 10, 10, 8), X("softmax", "kernel", 50, 20, 7),
              X("tail", "kernel", 95, 20, 7), X("cudaLaunchKernel", "cuda_runtime", 2, 4),
              X("cuLaunchKernel", "cuda_driver", 40, 6), X("cudaStreamSynchronize", "cuda_runtime", 20, 20),
              X("aten::mm", "cpu_op", 0, 50), X("autograd::engine", "cpu_op", 45, 35, 2),
              {"ph": "s", "name": "flow", "cat": "ac2g", "ts": 0}]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    shares = gpu_bench.trace_shares(str(tmp_path / "trace.json"))
    assert shares == pytest.approx({"outside_kernels": 0.45, "launch": 0.1, "sync": 0.2, "python": 0.2})


def test_gpu_bench_budget_and_failures(tmp_path, monkeypatch):
    """The GPU run's bookkeeping with the jobs faked: 12 rows, eager first; each job's timeout is its share of what
    is left (a compiled job weighs COMPILE_WEIGHT eager ones); a failed job says why in its row and the rest still
    run; a job stopped at its share keeps the windows it had logged after the first."""
    from tools import gpu_bench
    timeouts = []
    start = {"step": 0, "flops_per_token": 1e9, "tokens_per_step": 65536}
    window = lambda step, tok_s: {"step": step, "tok_per_s": tok_s, "peak_mem_mb": 1e3, "peak_reserved_mb": 2e3}  # noqa

    def run_one(strategy, impl, world, overrides, run_dir, timeout):
        timeouts.append(timeout)
        compiled = "train.compile=true" in overrides
        if impl == "torch" and compiled:
            sys.exit("error: fsdp/torch failed:\nTraceback ...\nRuntimeError: no graph")
        if impl is None and compiled and "model=gpt_350m" in overrides:  # stopped while writing its fourth window
            os.makedirs(run_dir)
            lines = [json.dumps(r) for r in (start, window(5, 1.0), window(10, 3e5), window(15, 5e5))]
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                f.write("\n".join(lines) + '\n{"step": 20, "lo')
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return start, 4e5, window(25, 4e5)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(gpu_bench, "matmul_flops", lambda *a, **k: 800e12)
    monkeypatch.setattr(gpu_bench, "prepare_data", lambda shared: [])
    monkeypatch.setattr(gpu_bench.bench, "run_one", run_one)
    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    (shared / "data" / "tinyshakespeare.txt").write_text("First Citizen:")
    (shared / "tiktoken_cache").mkdir()
    rows = gpu_bench.main(["--out", str(tmp_path / "out"), "--budget", "480", "--shared", str(shared)])
    assert [(r["model"], r["parallel"], r["compile"]) for r in rows[:3]] == [
        ("gpt_125m", "single", "no"), ("gpt_350m", "single", "no"), ("gpt_125m", "fsdp (ours), 1 rank", "no")]
    assert [r["compile"] for r in rows] == ["no"] * 6 + ["yes"] * 6
    assert [r["status"][:7] for r in rows] == ["ok"] * 7 + ["out of "] + ["ok"] * 2 + ["failed:"] * 2
    assert rows[-1]["status"] == "failed: RuntimeError: no graph" and "tok_per_s" not in rows[-1]
    w = gpu_bench.COMPILE_WEIGHT
    assert timeouts[0] == pytest.approx(480 / (6 + 6 * w), rel=0.01) and timeouts[6] == pytest.approx(80, rel=0.01)
    cut = rows[7]
    assert cut["status"].endswith("s share), 2 windows") and cut["tok_per_s"] == 4e5  # the median of 3e5, 5e5
    assert cut["mfu"] == pytest.approx(1e9 * 4e5 / 989e12) and cut["peak_alloc_gb"] == pytest.approx(1e3 * 2**20 / 1e9)
    assert cut["outside_kernels"] is None  # no trace
    md = (tmp_path / "out" / "gpu_bench.md").read_text()
    assert "| gpt_350m | 32 | FSDP2, 1 rank | yes | failed: RuntimeError: no graph |" in md
    assert "| gpt_350m | 32 | single | yes | 400,000 (out of time (" in md
    for which in ("no", "yes"):  # one half of the rows, given the whole budget
        half = gpu_bench.main(["--out", str(tmp_path / which), "--budget", "480", "--shared", str(shared),
                               "--compile", which])
        assert [r["compile"] for r in half] == [which] * 6
    assert timeouts[12] == pytest.approx(480 / 6, rel=0.01)


@needs_data_and_bpe
@pytest.mark.quiet
def test_gpu_bench_stays_within_its_budget(tmp_path, monkeypatch):
    """Too little budget for a job to start: none is launched. Jobs launched with less than they need: each is
    killed at its share, and the run ends on time."""
    from tools import gpu_bench
    t0 = time.time()
    rows = gpu_bench.main(["--device", "cpu", "--tiny", "--budget", "1", "--out", str(tmp_path / "a")])
    assert time.time() - t0 < 10 and [r["status"][:11] for r in rows] == ["out of time"] * 3
    assert all(r["seconds"] < 1 for r in rows)  # not launched
    monkeypatch.setattr(gpu_bench, "MIN_SHARE", 0)
    t0 = time.time()
    rows = gpu_bench.main(["--device", "cpu", "--tiny", "--budget", "4", "--out", str(tmp_path / "b")])
    assert time.time() - t0 < 10 and len(rows) == 3
    assert all(r["status"].startswith("out of time") for r in rows), [r["status"] for r in rows]


@pytest.mark.parametrize("args,message", [
    ([], "--out DIR is required"),
    (["--out", "{full}"], "exists and is not an empty folder"),
    (["--out", "{empty}", "--budget", "0"], "--budget 0: expected a positive number"),
    (["--out", "{empty}", "--shared", "{empty}"], "no data/tinyshakespeare.txt and tiktoken_cache/ in"),
    (["--out", "{empty}"], "torch sees no CUDA device"),
    (["--out", "{empty}", "--tiny", "--compile", "yes"], "--tiny runs eager rows only"),
])
def test_gpu_bench_bad_input_is_one_line(tmp_path, monkeypatch, args, message):
    from tools import gpu_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "gpu_bench.md").write_text("an earlier run")
    (tmp_path / "empty").mkdir()
    args = [x.format(full=tmp_path / "full", empty=tmp_path / "empty") for x in args]
    if "--shared" in args:
        args += ["--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        gpu_bench.main(args)
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text
    assert os.listdir(tmp_path / "empty") == []  # nothing written before the checks


def test_gpu_bench_names_missing_packages(tmp_path, monkeypatch):
    """A GPU image may carry torch and little else: one line naming what train.py would fail to import."""
    from tools import gpu_bench
    monkeypatch.setattr(gpu_bench, "NEEDS", ("json", "no_such_package", "another_one"))
    with pytest.raises(SystemExit) as e:
        gpu_bench.main(["--out", str(tmp_path / "out"), "--device", "cpu", "--tiny"])
    assert str(e.value.code) == "error: train.py's packages are missing here: no_such_package, another_one " \
        "(requirements.txt)"
    assert not (tmp_path / "out").exists()


def test_peak_flops_by_exact_name(tmp_path):
    """An H100 PCIe is not an H100 SXM: exact names from torch.cuda.get_device_name, unknown ones None (MFU is then
    left out unless train.peak_tflops states the peak, which also gives a CPU run its MFU)."""
    from metrics import peak_flops
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("NVIDIA H100 PCIe 2") is None and peak_flops("NVIDIA GeForce RTX 4090") is None
    run_dir = str(tmp_path / "run")
    train.run(make_cfg(*small_run("train.max_steps=2", "train.peak_tflops=0.5")), run_dir)
    first, *records = read_metrics(run_dir)
    for r in (r for r in records if "tok_per_s" in r):
        assert r["mfu"] == pytest.approx(first["flops_per_token"] * r["tok_per_s"] / 0.5e12)
    with pytest.raises(config.ConfigError, match="train.peak_tflops=0.0 must be positive"):
        config.validate(make_cfg("train.peak_tflops=0.0"))


# --- context parallel: activations per rank on real cp ranks, the long-context plan
CP_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512}


def test_real_ranks_keep_what_fake_tensors_count():
    """tools/act_memory.py measures on fake tensors; on 2 real gloo ranks (forked) what forward keeps is the same
    bytes, and the peak within 5% (3.4% lower, 2026-12-03: the fake group's sends and receives hold their buffers
    until the next hop), and the ring's rank keeps half of one process's."""
    args = dict(shape=CP_SHAPE, seq=256, batch=2)
    real, fake = act_memory.measure(2, "ring", compute="real", **args), act_memory.measure(2, "ring", **args)
    assert real[0] == fake[0]
    assert real[1] == pytest.approx(fake[1], rel=0.05)
    one = act_memory.measure(1, **args)
    dw = 512 * 64 * 4  # the head's weight gradient the fused loss keeps (model.LinearCrossEntropy): whole on each rank
    assert real[0] - 8 * 2 * 128 - dw == pytest.approx((one[0] - 8 * 2 * 256 - dw) / 2, rel=0.02)  # and the ids


# (checkpointing, dtype) pairs, each with one cp layout and one length in turn: every mode, dtype, cp degree,
# method and length appears
MEMORY_CASES = [(ac, dtype, *act_memory.LAYOUTS[i % 5], (8192, 32768)[i % 2])
                for i, (ac, dtype) in enumerate((ac, dtype)
                                                for ac in ("none", "selective", "selective-alternate", "full")
                                                for dtype in act_memory.DTYPES)]


@pytest.mark.parametrize("ac,dtype,cp,method,seq", MEMORY_CASES)
def test_activation_memory_equals_planner(ac, dtype, cp, method, seq):
    """The planner's activation memory per rank (kept, and the high-water mark through backward: kept + the block
    recomputed + the backward's buffers) against what torch's MemTracker measures on a gpt_tiny-shaped rank, one
    sequence. Kept is exact to 0.1% (the log-sum-exp, the RoPE tables' copies, the token ids all counted); the peak
    within 5% (measured 2026-12-06 with the head and loss fused, the full grid of tools/act_memory.py, 2k, 8k and
    32k tokens: at most 6.1% off but one row at 2k, docs/context_parallel.md; these cases at most 5%)."""
    kept, peak = act_memory.measure(cp, method, seq=seq, ac=ac, dtype=dtype)
    p_kept, p_peak = act_memory.planned(cp, method, seq=seq, ac=ac, dtype=dtype)
    assert kept == pytest.approx(p_kept, rel=1e-3)
    assert peak == pytest.approx(p_peak, rel=0.05)


# two MoE shapes (model.py's MoE): SwiGLU experts with a shared one in every block, and GELU experts every second
# block among dense ones; each with the mode of checkpointing that shows it best
MOE_SHAPES = [({"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 512, "n_experts": 4, "top_k": 2,
                "mlp": "swiglu", "n_shared_experts": 1, "ffn_hidden": 128},
               ("none", "selective", "selective-alternate")),
              ({"n_layer": 3, "n_head": 4, "n_embd": 64, "vocab_size": 512, "n_experts": 8, "top_k": 2,
                "mlp": "gelu", "moe_every": 2}, ("full",))]


@pytest.mark.parametrize("shape,modes", MOE_SHAPES)
def test_moe_activations_equal_planner(shape, modes):
    """What an MoE model keeps for backward after one forward (tools/act_memory.py on real tensors, one process,
    float32) against the planner's count (plan.activation_bytes with moe_activation_bytes): equal but for a few
    bytes (4 measured, 2026-12-06), without checkpointing, under selective checkpointing (the router's and the
    shared expert's matmuls kept, the grouped matmuls recomputed), with only every other of those matmuls kept
    (train.selective_matmuls=alternate), and full."""
    from model import GPT, GPTConfig
    with torch.device("meta"):
        c = GPT(GPTConfig(block_size=256, **shape)).cfg
    s = {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "vocab": c.padded_vocab_size,
         "kv_embd": c.kv_heads * c.head_dim, "hidden": c.hidden, "mlp": c.mlp, "n_experts": c.n_experts,
         "top_k": c.top_k, "moe_blocks": c.n_moe, "expert_hidden": c.expert_hidden,
         "shared_hidden": c.n_shared_experts * c.expert_hidden, "aux_loss": True}
    for ac in modes:
        kept, _ = act_memory.measure(1, shape=shape, seq=256, batch=2, ac=ac, compute="real")
        mode, _, matmuls = ac.partition("-")
        planned, _ = plan.activation_bytes(s, 2, 256, 4, checkpointed=plan.checkpointed_fraction(mode, c.n_layer),
                                           selective=mode == "selective", alternate=matmuls == "alternate")
        assert kept == pytest.approx(planned, rel=1e-6, abs=64), (ac, kept, planned)


@pytest.mark.parametrize("model", ["deepseek_v3", "moe_tiny", "gpt_tiny"])
def test_stages_add_up_to_the_model(model):
    """pp_stages' shares of the model: parameters and FLOPs per token add up to the whole model's (an MoE's FLOPs
    count each block's top_k experts, not all of them; its stages' MoE blocks and experts add up too)."""
    s = plan.model_shape(make_cfg(f"model={model}", "train.seq_len=256"))
    for pp, v in ((2, 1), (4, 1), (2, 2)):
        stages = plan.pp_stages(s, pp, v)
        assert sum(st["flops_per_token"] for st in stages) == pytest.approx(s["flops_per_token"], rel=1e-12)
        assert sum(st["n_params"] for st in stages) == s["n_params"]
        assert sum(st["moe_blocks"] for st in stages) == s["moe_blocks"]
        assert sum(st["expert_params"] for st in stages) == pytest.approx(s["expert_params"])


def test_long_context_plan():
    """gpt_1p3b at 32k tokens on 8 GPUs: the ranking covers cp layouts, and the configured one reports its balance
    and exposed ring time."""
    out = run_plan("model=gpt_1p3b", "model.block_size=32768", "train.seq_len=32768", "train.global_batch_size=8",
                   "train.micro_batch_size=1", "parallel=fsdp", "parallel.cp=8", "plan.world=8")
    assert "layout: parallel=fsdp_cp dp=1 x cp=8 (ring) x tp=1" in out
    assert "1.000 zig-zag (a plain split: 15.00)" in out  # 2 cp - 1: the last rank's queries see the most keys
    assert re.search(r"\n  cp +p2p ", out) and re.search(r"\n  dp_cp +reduce_scatter ", out)
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "rank" not in line]
    fitting = [r for r in rows if r[8].strip() == "yes"]
    assert {int(r[4]) for r in fitting} >= {1, 2, 4, 8}
    # the ring hides its hops behind attention at cp=2 (blocks of 8k tokens), not at cp=8 (blocks of 2k); the
    # exposed communication beside it, FSDP's first unit (the embedding's gather, about 1 ms), is the same at both
    ring = {int(r[4]): float(r[11]) for r in fitting if r[1].strip() == "fsdp_cp" and r[6].strip() == "none"}
    assert ring[2] < 2 < 20 < ring[8]
    exposed_cp = {}
    for cp in (2, 8):
        cfg = plan.compose(["model=gpt_1p3b", "model.block_size=32768", "train.seq_len=32768",
                            "train.global_batch_size=8", "train.micro_batch_size=1", "parallel=fsdp",
                            f"parallel.cp={cp}", "plan.world=8"])
        exposed_cp[cp] = plan.predict(cfg, plan.check(cfg), plan=cfg.plan)["time"]["exposed cp"]
    assert exposed_cp[2] == 0 < exposed_cp[8]


# --- pipeline parallel: the planner's pp layouts on a model no node holds
def test_pipeline_plan_for_70b():
    """gpt_70b (65B parameters): FSDP x TP over one node of 8 H100s holds 16 bytes x 65B / 8 = 130 GB of state per
    GPU, so it fits on no single node; pp=8 stages x tp=8 over 64 GPUs keep a stage's 1/8 per GPU. The report
    prints the pipeline part (schedule, micro-batches, the bubble of parallel/pp.py's list), and the ranking holds
    pp layouts across nodes, whose p2p is all that crosses the network when pp x tp spans the 64."""
    big = ("model=gpt_70b", "parallel.data=fsdp", "parallel.tp=8", "train.activation_checkpointing=full")
    node = plan.predict(plan_cfg(*big, "parallel=fsdp_tp"), plan=cluster())
    assert not node["fits"] and node["state"] > 80e9
    cfg = plan_cfg(*big, "parallel=pp", "parallel.pp=8", "plan.world=64")
    piped = plan.predict(cfg, plan=cluster(world=64))
    assert (piped["layout"].name, piped["pp"], piped["dp"], piped["tp"], piped["micro_batches"]) == \
        ("pp_fsdp_tp", 8, 1, 8, 64)
    assert piped["fits"] and piped["bubble"] == pytest.approx(7 / (64 + 7))  # 1F1B: (p - 1) / (m + p - 1)
    assert piped["crosses_nodes"] == pytest.approx(piped["p2p_total"])  # the stages' hops, nothing else
    out = plan.report(cfg, plan.model_shape(cfg))
    assert "layout: parallel=pp_fsdp_tp pp=8 (1f1b, 64 micro-batches, bubble 9.9%) x dp=1 x tp=8" in out
    assert re.search(r"\n  pp +p2p ", out) and "pipeline bubble" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "rank" not in line]
    assert {r[1].strip() for r in rows if r[8].strip() == "yes"} >= {"pp_fsdp_tp", "pp_fsdp"}
