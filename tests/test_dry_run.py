"""Dry runs at cluster scale (tools/dry_run.py): this pytest process plays one rank of 64 or 512 under torch's fake
process group, with the real strategies, and the planner's state and communication must equal what it measures,
within 1%. Fake tensors where the rank's work is large; real ones where it is small, and both agree to the byte.
`pytest tests/test_dry_run.py -s -n 0` prints the ratios."""
import itertools
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, assert_planner_equals, make_cfg
from config import ConfigError
from parallel.layout import DATA_STRATEGIES, IMPLS, Layout, LayoutError
from tools import dry_run, plan

# one micro-batch per data-parallel rank (no accumulation: under it torch's FSDP2 keeps units gathered between
# micro-steps, which the planner, ours, does not; the small runs below accumulate); fake tensors (auto would compute
# tp's 2.5 GB shards for real, slowly), whose step costs its op count
GPT_1P3B = ["model=gpt_1p3b", "dry_run.world=64", "train.seq_len=64", "train.micro_batch_size=1", "dry_run.steps=1",
            "dry_run.compute=fake"]
# the 70B-class shape at world 512, with GPT-2's vocab as the README's table has it; a sequence of 256 (the
# tensor-parallel bytes scale with it, the planner's and the counter's alike)
GPT_70B = ["model=gpt_70b", "data=fineweb_edu", "dry_run.world=512", "train.seq_len=256", "train.micro_batch_size=1",
           "dry_run.steps=1", "dry_run.compute=fake"]
# the layout's overrides, with a global batch of one sequence per data-parallel rank of 64 or 512
LAYOUTS = {"ddp": [], "zero1": [], "zero2": [], "fsdp": [], "tp": ["parallel.tp=8"], "fsdp_tp": ["parallel.tp=8"]}


def layout(strategy, world):
    dp = world // 8 if LAYOUTS[strategy] else world
    return [f"parallel={strategy}", *LAYOUTS[strategy], f"train.global_batch_size={dp}"]


def dry(*overrides, rank=3):
    """One dry run in this process: (what it measured, the planner's prediction)."""
    cfg = make_cfg(*overrides, f"dry_run.rank={rank}")
    layout, device, dtype, accum, compute, predicted = dry_run.check(cfg)
    m = dry_run.measure(cfg, layout, rank, compute, device, dtype, accum, cfg.dry_run.steps)
    print(f"\n{' '.join(overrides)}: {compute} tensors, accumulation {accum}\n" +
          "\n".join(f"  {w:32s} {a / 1e9:10.4f} GB {b / 1e9:10.4f} GB {dry_run.ratio(a, b)}"
                    for w, a, b in dry_run.compare(m, predicted)))
    return m, predicted


CASES = [(s, impl) for s in LAYOUTS for impl in ("scratch", "torch") if not (impl == "torch" and s in ("ddp", "zero1"))]


# gpt_1p3b's width and vocabulary on 6 of its 24 blocks: the same tensors per block for a quarter of the ops (a
# fake step's cost is its op count: 4 of these cases took 15.2 s whole, 7.0 s so, 2026-12-07)
GPT_1P3B_6 = [*GPT_1P3B, "model.n_layer=6"]


@pytest.mark.parametrize("strategy,impl", CASES)
def test_gpt_1p3b_at_world_64(strategy, impl):
    """Every strategy, ours and torch's where it runs under the fake backend, as rank 3 of 64: gpt_1p3b's blocks (d =
    2048) and vocabulary, 0.32B parameters on 6 blocks, 5.1 GB of state per rank under DDP, none of it allocated."""
    m, predicted = dry(*GPT_1P3B_6, *layout(strategy, 64), f"parallel.impl={impl}")
    assert m["compute"] == "fake" and m["world_size"] == 64 and m["dims"]["tp"] == (8 if "tp" in strategy else 1)
    # torch's ZeRO-2 twin is FSDP2 without resharding after forward: its parameters stay sharded between steps
    # too, so its state is FSDP's 16P/N (README, Data parallelism), its traffic ZeRO-2's
    fsdp = make_cfg(*GPT_1P3B_6, *layout("fsdp", 64))
    state = plan.predict(fsdp, Layout.from_config(fsdp.parallel, 64))["state"] if (strategy, impl) == ("zero2", "torch") \
        else None
    assert_planner_equals(m, predicted, state)
    if impl == "scratch":  # autograd's saved tensors of one micro-batch, against the planner's count
        assert m["activation_bytes"] == pytest.approx(predicted["memory"]["activations"], rel=0.01)


@pytest.mark.parametrize("overrides", [["parallel.tp=8"], ["parallel=pp", "parallel.pp=2", "parallel.data=zero1",
                                                             "parallel.tp=4", "train.global_batch_size=4"]])
def test_working_copy_without_data_parallelism(overrides):
    """Megatron's mixed precision under tensor (and pipeline) parallelism alone, dp=1: ZeRO-1 over one rank keeps
    its bf16 working weights beside float32 master weights and moments, 2 + 4 + 12 bytes a parameter (float32
    gradients), nothing sharded; its one-rank reduce-scatter and all-gather counted as the planner counts them.
    With float32 working weights the rule book refuses it: it would keep nothing DDP does not."""
    base = [*GPT_1P3B_6, "dry_run.world=8", "parallel=zero1", "train.global_batch_size=1", "train.dtype=bfloat16",
            "parallel.param_dtype=auto", *overrides]
    m, predicted = dry(*base)
    assert m["dims"]["dp"] == 1 and m["dims"]["tp"] * m["dims"]["pp"] == 8 and predicted["knobs"]["param_dtype"] == \
        "bfloat16"
    rank = predicted["pp_ranks"][0] if m["dims"]["pp"] > 1 else predicted  # rank 3: the first stage's
    assert m["state_bytes"] == pytest.approx(18 * rank["params_per_rank"], rel=0.01)
    assert_planner_equals(m, rank)
    with pytest.raises(ConfigError, match=r"parallel.data=zero1 shards over the data-parallel ranks, but dp=1 \(tp="):
        dry_run.check(make_cfg(*base, "parallel.param_dtype=float32", "dry_run.rank=3"))


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_70b_at_world_512(strategy):
    """L=80, d=8192 (65.3B parameters) as rank 3 of 512: our FSDP over 512, and over 64 x our tensor parallel 8."""
    m, predicted = dry(*GPT_70B, *layout(strategy, 512))
    assert m["compute"] == "fake" and m["n_params"] > 65e9 and m["dims"]["dp"] == (64 if strategy == "fsdp_tp" else 512)
    assert_planner_equals(m, predicted)


# Llama 3 70B's shape (conf/model/llama3_70b.yaml: GQA 64/8 heads, SwiGLU of 28672, vocab 128256) at world 512
LLAMA_70B = ["model=llama3_70b", "dry_run.world=512", "train.seq_len=256", "train.micro_batch_size=1",
             "dry_run.steps=1", "dry_run.compute=fake"]


@pytest.mark.parametrize("name,overrides,rank", [
    ("fsdp_tp", ["parallel=fsdp", "parallel.tp=8", "parallel.sequence_parallel=true", "train.global_batch_size=64"],
     3),
    # 8 stages of 10 blocks x FSDP over 8 x tp 8, as rank 3: the first stage (the embedding, no head)
    ("pp_fsdp_tp", ["parallel=pp", "parallel.pp=8", "parallel.data=fsdp", "parallel.tp=8",
                    "train.global_batch_size=64"], 3)])
def test_llama_70b_at_world_512(name, overrides, rank):
    """70.6B parameters as one rank of 512: the planner's state and communication by (mesh dimension, collective)
    within 1% of what the rank measures, its key/value heads split over tp (1 of 8 each), SwiGLU's gate and up
    column-parallel; under pp, the first stage's share."""
    m, predicted = dry(*LLAMA_70B, *overrides, rank=rank)
    assert m["compute"] == "fake" and m["world_size"] == 512 and m["dims"]["tp"] == 8
    if name == "pp_fsdp_tp":
        assert m["dims"]["pp"] == 8 and predicted["stage"]["n_layer"] == 10
        predicted = predicted["pp_ranks"][0]
    else:
        assert m["n_params"] > 70e9
    assert_planner_equals(m, predicted)


# FSDP on the whole model; DDP and ZeRO-2 on its first 5 blocks (its 3 dense ones and 2 MoE blocks: every kind of
# block, each priced block by block), as a fake step costs its op count: 12 CPU-s each whole, 2026-12-07
@pytest.mark.parametrize("data,n_layer", [("ddp", 5), ("zero2", 5), ("fsdp", 61)])
def test_deepseek_v3_at_world_256(data, n_layer):
    """DeepSeek-V3's shape (672B parameters, 58 MoE blocks of 256 experts, top 8) as rank 3 of 256 under DDP, ZeRO-2
    (the dense part sharded, the experts whole) and FSDP (the experts sharded too, over the 4 ranks that hold the
    same ones), with expert parallelism over 64: each rank holds 4 experts of each block. The routing is balanced here, as the planner
    assumes (fake tensors hold no token counts: tools/dry_run.py balanced_routing), so the all-to-all's bytes are the
    planner's mean; the model state and every collective by (mesh dimension, kind) equal the planner's to 1e-6, and
    what one micro-batch keeps for backward (297.3 GB, float32) its count to 1e-5 (tools/plan.py
    moe_activation_bytes: before it the planner counted an MoE block as a dense MLP, 2.2x short)."""
    m, predicted = dry("model=deepseek_v3", f"model.n_layer={n_layer}", f"parallel={data}", "parallel.ep=64",
                       "dry_run.world=256", "train.seq_len=4096", "train.micro_batch_size=1",
                       "train.global_batch_size=256", "dry_run.steps=1", "dry_run.compute=fake")
    assert m["compute"] == "fake" and m["world_size"] == 256
    assert m["n_params"] == 672_149_632_000 or n_layer < 61
    assert m["state_bytes"] == pytest.approx(predicted["state"], rel=1e-6)
    assert set(m["comm"]) == set(predicted["comm"])
    for key, b in predicted["comm"].items():
        assert m["comm"][key] == pytest.approx(b, rel=1e-6), key
    assert m["activation_bytes"] == pytest.approx(sum(predicted["one_micro_batch"]), rel=1e-5)


# context parallel and HSDP at world 64: fsdp_cp over cp=4 at a long sequence (each rank 1024 of every 4096 tokens),
# ring and all-gather, and HSDP as 8 replicas of 8 shards. gpt_1p3b's width at 4 blocks: a fake step costs its op
# count, and the ring's hops are many small ops per block
LONG = [*(o for o in GPT_1P3B if not o.startswith("train.seq_len")), "model.n_layer=4", "train.seq_len=4096",
        "model.block_size=4096"]
CP_HSDP = {"fsdp_cp ring": ["parallel=fsdp", "parallel.cp=4", "parallel.cp_method=ring", "train.global_batch_size=16"],
           "fsdp_cp allgather": ["parallel=fsdp", "parallel.cp=4", "parallel.cp_method=allgather",
                                 "train.global_batch_size=16"],
           "hsdp": [*GPT_1P3B, "model.n_layer=4", "parallel=hsdp", "parallel.dp_shard=8", "train.global_batch_size=64"]}


@pytest.mark.parametrize("name", CP_HSDP)
def test_cp_and_hsdp_at_world_64(name):
    """The planner's state and communication by (mesh dimension, collective) within 1% of what rank 3 of 64
    measures: the ring's p2p hops and the all-gather's collectives over "cp", the data strategy's over dp x cp
    ("dp_cp"); HSDP's within "dp_shard" and across "dp_replicate"."""
    overrides = CP_HSDP[name] if name == "hsdp" else [*LONG, *CP_HSDP[name]]
    m, predicted = dry(*overrides)
    assert m["compute"] == "fake" and m["world_size"] == 64
    assert m["dims"]["cp"] == (4 if "cp" in name else 1)
    dims = {dim for dim, _ in m["comm"]}
    assert ({"cp", "dp_cp"} if "cp" in name else {"dp_shard", "dp_replicate"}) <= dims, dims
    assert_planner_equals(m, predicted)


def test_real_tensors_measure_what_fake_ones_do():
    """A small model as rank 5 of 64, computed for real and on fake tensors, with gradient accumulation: the same
    bytes to the byte, so the fake numbers above are the real code's, and the planner's within 1%."""
    small = ["model=gpt_tiny", "dry_run.world=64", "train.seq_len=64", "train.micro_batch_size=2",
             "train.global_batch_size=256", "dry_run.steps=2"]
    for layout in (["parallel=fsdp"], ["parallel=tp", "parallel.tp=4", "parallel.sequence_parallel=true"]):
        real, predicted = dry(*small, *layout, rank=5)  # auto: it fits, and computes little
        fake, _ = dry(*small, *layout, "dry_run.compute=fake", rank=5)
        assert real["compute"] == "real" and fake["compute"] == "fake"
        for key in ("state_bytes", "transient_bytes", "activation_bytes", "comm_bytes", "comm"):
            assert real[key] == fake[key], key
        assert_planner_equals(real, predicted)


@pytest.mark.parametrize("overrides,message", [
    (["dry_run.rank=64"], "dry_run.rank=64 is outside dry_run.world=64: use a rank from 0 to 63"),
    (["dry_run.world=100", "parallel=fsdp_tp", "parallel.tp=8"],
     "dry_run.world=100: parallel.tp=8 must divide the number of ranks (100)"),
    (["parallel=ddp", "dry_run.compute=real"], "dry_run.compute=real: rank 0's state, transient and activations "
                                               "need 19.9 GB (tools/plan.py), over dry_run.memory_gb=4; use "
                                               "dry_run.compute=fake"),
    (["parallel=zero1", "parallel.impl=torch"], "parallel.data=zero1 parallel.impl=torch: torch's "
                                                "DistributedDataParallel does not run under the fake process group"),
    (["launcher.nproc_per_node=2"], "dry_run.world=64 plays one rank of 64 in this one process, but it was started "
                                    "with launcher.nproc_per_node=2"),
    (["dry_run.memory_gb=100000"], "dry_run.memory_gb=100000 is more than this machine's"),
])
def test_bad_input_is_one_line(overrides, message):
    cfg = make_cfg("model=gpt_1p3b", "parallel=fsdp", "dry_run.world=64", "train.seq_len=64",
                   "train.micro_batch_size=1", "train.global_batch_size=64", *overrides)
    with pytest.raises(ConfigError) as e:
        dry_run.check(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_fake_dry_run_of_bf16_on_a_cpu_without_it(monkeypatch):
    """A dry run on fake tensors runs no kernel, so a bf16 run plans on a CPU that can't compute in bf16 (an
    AVX2-only one); one on real tensors is refused there in one line."""
    import config
    monkeypatch.setattr(config, "bf16_supported", lambda device: False)
    base = ["model=gpt_1p3b", "parallel=fsdp", "dry_run.world=64", "train.seq_len=64", "train.micro_batch_size=1",
            "train.global_batch_size=64", "train.dtype=bfloat16", "parallel.param_dtype=bfloat16"]
    assert dry_run.check(make_cfg(*base, "dry_run.compute=fake"))[2] == "bfloat16"
    with pytest.raises(ConfigError, match="can't compute in bfloat16"):
        dry_run.check(make_cfg(*base, "dry_run.compute=real"))


def test_train_py_entry(tmp_path):
    """`python train.py ... dry_run.world=N`: the report beside the planner, metrics.jsonl with a real run's keys;
    under torchrun, one line and nothing started or written."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "parallel=fsdp", "dry_run.world=512", "dry_run.rank=7",
           "train.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=512"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # gpt_tiny's 1/512 of FSDP fits and computes little: real tensors (the tests above: fake ones)
    assert "rank 7 of 512" in p.stdout and "losses mean nothing" in p.stdout and "real tensors" in p.stdout
    state_line = next(line for line in p.stdout.splitlines() if line.strip().startswith("state "))
    assert float(state_line.split()[-1]) == pytest.approx(1, abs=0.01)  # measured / planner (padding to 512)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first, *steps = [json.loads(line) for line in f]
    assert first["world_size"] == 512 and first["dry_run"] and first["param_bytes"] == 4 * first["n_params"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["state_bytes"] and r["comm_bytes"] for r in steps)
    assert steps[-1]["comm_dp_all_gather"] == pytest.approx(2 * first["param_bytes"], rel=0.01)
    p = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'torchrun'}"], capture_output=True, text=True,
                       env={**env, "TORCHELASTIC_RUN_ID": "x"}, cwd=ROOT, timeout=300)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: dry_run.world=512 plays one rank of 512 in this one process, but it was started with torchrun; run "
        "`python train.py ... dry_run.world=512` alone"]
    ran = tmp_path / "torchrun"  # Hydra makes the run dir; nothing is written into it
    assert not os.path.exists(ran) or not os.listdir(ran)


def test_pipeline_stage_at_world_64():
    """pp=4 stages x our FSDP over 16, as rank 21 (the second stage, 6 of the 24 blocks, no embedding, no head):
    the fake group's sends and receives return at once like its collectives, so the stage steps through 1F1B; its
    state, FSDP's traffic, its p2p (two boundaries) and one micro-batch's activations equal the planner's numbers
    for that pp rank."""
    m, predicted = dry(*GPT_1P3B, "parallel=pp", "parallel.pp=4", "parallel.data=fsdp", "train.global_batch_size=64",
                       rank=21)
    assert m["dims"]["pp"] == 4 and m["dims"]["dp"] == 16 and predicted["stage"]["n_layer"] == 6
    stage = predicted["pp_ranks"][1]
    assert stage["state"] < predicted["pp_ranks"][0]["state"]  # the first stage's embedding is not here
    assert_planner_equals(m, stage)
    assert m["comm"][("pp", "p2p")] == pytest.approx(2 * predicted["pp_ranks"][0]["p2p_total"])
    assert m["activation_bytes"] == pytest.approx(sum(stage["one_micro_batch"]), rel=0.02)


# --- one rule book: the planner and the dry run accept and refuse the same layouts, with the same line
SAME_RUN = ["model=gpt_tiny", "data=fineweb_edu", "train.seq_len=64", "train.global_batch_size=64",
            "train.micro_batch_size=1", "train.dtype=float32"]  # float32: the planner's GPU and this CPU alike


def grid(datas, impls):
    """parallel.* for every data strategy x impl given x tp, cp, pp in {1, 2} x dp_replicate in {1, 2} (dp: what the
    others leave; dp_shard: what dp_replicate leaves)."""
    for data, impl, tp, cp, pp, replicate in itertools.product(datas, impls, (1, 2), (1, 2), (1, 2), (1, 2)):
        yield {"data": data, "impl": impl, "tp": tp, "cp": cp, "pp": pp, "dp_replicate": replicate,
               "dp_shard": None}


def refusal(check, cfg):
    """The line `check` refuses cfg with, or None where it accepts it."""
    try:
        check(cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world,datas,impls", [(8, DATA_STRATEGIES, IMPLS), (32, ("ddp", "fsdp"), ("scratch",))])
def test_planner_and_dry_run_refuse_alike(world, datas, impls):
    """Every layout of the grid through the planner's check (what `python -m tools.plan` runs before it plans) and
    the dry run's (`python train.py ... dry_run.world=N`): the same layouts refused, each with the same line (the
    rule book's, Layout.problem); a ranked candidate gets that line too. The only lines apart are each tool's own
    rules: none of the planner's cluster rules apply here (nodes of 8, tp <= 2), and the dry run refuses torch's
    DDP, which the fake process group can't run. Checks only: nothing is built or stepped."""
    planner = plan.compose([*SAME_RUN, f"plan.world={world}"])
    dry = plan.compose([*SAME_RUN, f"dry_run.world={world}", "dry_run.compute=fake"], config_name="config")
    lines = {}
    for p in grid(datas, impls):
        planned = OmegaConf.merge(planner, {"parallel": p})
        said = refusal(plan.check, planned)
        # the dry run says which world it plays before the rule book's line
        ran = refusal(dry_run.check, OmegaConf.merge(dry, {"parallel": p}))
        ran = ran and ran.removeprefix(f"dry_run.world={world}: ")
        try:
            layout = Layout.from_config(planned.parallel, world)
        except LayoutError:
            layout = None
        if layout is not None:  # the ranking's path: the rule book, then the cluster's rules
            assert said == (plan.rule_book(planned, layout) or plan.cluster_problem(layout, planned.plan)), p
        if said != ran:
            assert said is None and ran == dry_run.fake_group_problem(layout), (p, said, ran)
        lines[tuple(p.values())] = said
    refused = {line for line in lines.values() if line}
    # a grid that tells accepting from refusing (at 32, ddp and fsdp alone: only HSDP's replicas beside ddp refused)
    assert None in lines.values() and len(refused) >= (5 if world == 8 else 1), refused
    # the two layouts the planner once ranked though train.py refused them: pp x tp x cp (since built: accepted by
    # both), and pp under DeepSpeed (refused by both)
    assert lines["fsdp", "scratch", 2, 2, 2, 1, None] is None
    if "deepspeed" in impls:
        assert "with parallel.impl=deepspeed" in lines["zero1", "deepspeed", 1, 1, 2, 1, None]
