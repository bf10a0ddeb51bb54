"""The whole mesh composes: pp x dp_replicate x dp_shard x cp x tp with any degrees above 1 at once.

At world 8 (in the session's one world-8 launch) each combination that needs three degrees of 2 runs 3 steps equal
to parallel=single on the same settings: per-step loss and gradient norm, and the final weights (the last
checkpoint). Under each, the state on rank 0 and the bytes by mesh dimension say the groups are the right ones:
HSDP's shards over dp_shard (x cp), its all-reduce across dp_replicate, the activations between stages each cp
rank's pieces, / tp under sequence parallel. Torch's twins where torch composes them: FSDP2 on the (dp_replicate,
dp_shard) mesh beside DTensor tp, and torch's 1F1B schedule beside it. All five degrees at once need 32 ranks: the
dry run builds and steps them as one rank of each pipeline stage, under the fake process group, at world 32 and
512. The planner (tools/plan.py) equals every one of them: on the real runs, rank 0's state and its bytes by mesh
dimension and collective; in the dry runs, each stage's."""
import pytest

import train
from conftest import (assert_planner_equals, assert_refused, assert_same_steps, assert_same_weights, launch_jobs,
                      make_cfg, read_metrics, record_measured, small_run)
from parallel.layout import Layout
from tools import dry_run

# global batch 16 in micro-batches of 2: accumulation 2 over dp = 4, 8 micro-batches per step through a pipeline
# of dp 1; one checkpoint, the last step's
RUN = ("train.global_batch_size=16", "train.micro_batch_size=2", "train.max_steps=3", "train.eval_every=100",
       "train.log_every=1", "checkpoint.keep=1")
HSDP = ("parallel.data=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2")
SP = "parallel.sequence_parallel=true"
PP = ("parallel=pp", "parallel.pp=2")
# case: (overrides, its Layout.name)
CASES = {
    "hsdp_tp": ((*HSDP, "parallel.tp=2", SP), "hsdp_tp"),
    "hsdp_tp-torch": ((*HSDP, "parallel.tp=2", SP, "parallel.impl=torch"), "hsdp_tp"),
    "hsdp_cp": ((*HSDP, "parallel.cp=2"), "hsdp_cp"),
    "pp_tp_cp": ((*PP, "parallel.tp=2", "parallel.cp=2", SP), "pp_tp_cp"),  # DDP over each stage's 2 cp ranks
    "pp_hsdp": ((*PP, *HSDP), "pp_hsdp"),
    "pp_hsdp-torch": ((*PP, *HSDP, "parallel.impl=torch"), "pp_hsdp"),
}
V, D, L = 512, 64, 2  # small_run's model: padded vocab, width, blocks


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single") / "run")
    train.run(make_cfg(*small_run(*RUN)), run_dir)
    return run_dir


@launch_jobs(8)
def jobs(root, request):
    """Every case, in the session's world-8 launch."""
    return {case: (str(root / case), small_run(*RUN, *overrides)) for case, (overrides, _) in CASES.items()}


@pytest.fixture(scope="module")
def runs(launch8):
    return launch8[__name__][0]


def rank0_params(pp, tp):
    """Rank 0's parameters: the first stage's (the embedding and its L / pp blocks; without a pipeline the final
    norm and head too), the matrices 1/tp each, the norm gains whole."""
    block = 12 * D * D // tp + 2 * D
    return V * D // tp + L // pp * block + (pp == 1) * (V * D // tp + D)


@pytest.mark.parametrize("case", CASES)
def test_equal_to_single(single, runs, case):
    run_dir, (overrides, name) = runs[case], CASES[case]
    assert_same_steps(run_dir, single)
    assert_same_weights(run_dir, single)
    start, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    assert start["parallel"] == name
    pp, cp, tp = start["pp"], start["cp"], start["tp"]
    assert (pp, start["dp_replicate"], start["dp_shard"], cp, tp) == \
        {"hsdp_tp": (1, 2, 2, 1, 2), "hsdp_cp": (1, 2, 2, 2, 1), "pp_tp_cp": (2, 1, 1, 2, 2),
         "pp_hsdp": (2, 2, 2, 1, 1)}[name]
    # fp32 weight, gradient and two Adam moments of rank 0's parameters, split over the ranks FSDP shards them
    # over (dp_shard x cp; DDP over a stage's cp ranks keeps them whole); + padding and Adam's step counters
    P = rank0_params(pp, tp)
    shard = 2 * cp if "hsdp" in name else 1
    assert last["state_bytes"] == pytest.approx(16 * P / shard, rel=1e-3)
    if "hsdp" in name:
        # across the replicas each rank's reduced slice (1 / shard of what the shard group reduce-scatters) is
        # all-reduced (counted 2x); within the shard group (named dp_shard_cp under cp) our FSDP's 2 all-gathers a
        # micro-step (2 of them) and one reduce-scatter
        within = "dp_shard_cp" if cp > 1 else "dp_shard"
        scattered = last[f"comm_{within}_reduce_scatter"]
        assert last["comm_dp_replicate_all_reduce"] == pytest.approx(2 * scattered / shard)  # every slice, once
        if "torch" not in case:  # FSDP2 keeps units gathered between micro-steps, and under torch's schedule
            # reduces every micro-batch's gradients
            assert scattered == pytest.approx(P * 4, rel=1e-2)
            assert last[f"comm_{within}_all_gather"] == pytest.approx(2 * 2 * P * 4, rel=1e-2)
    if "torch" not in case:  # the planner's theory is ours: rank 0's state and every collective by mesh dimension
        cfg = make_cfg(*small_run(*RUN, *overrides))
        assert_planner_equals(record_measured(last), dry_run.predict(cfg, Layout.from_config(cfg.parallel, 8),
                                                                     "float32"), every=True)
    if cp > 1:
        assert last["comm_cp_p2p"] > 0  # the ring, within each stage
    if pp > 1:  # each micro-batch's activation over the one boundary and its gradient back: (b, T / cp / tp, d)
        m = 16 // (2 * (8 // (pp * cp * tp)))  # micro-batches per step and pipeline: global / (micro x dp)
        assert last["p2p_bytes_pipeline"] == 2 * m * 2 * (64 // cp // tp) * D * 4 * (pp - 1)


# --- all five at once, in the dry run: pp2 x dp_replicate2 x dp_shard2 x cp2 x tp2 = 32 ranks of the tiny model;
# pp4 x dp_replicate4 x dp_shard8 x cp2 x tp2 = 512 ranks of gpt_1p3b's width (8 blocks, 2 per stage)
FIVE = ["parallel=pp", *HSDP, "parallel.cp=2", "parallel.tp=2", SP, "train.micro_batch_size=1", "dry_run.steps=1"]
AT_32 = [*FIVE, "parallel.pp=2", "dry_run.world=32", "train.seq_len=64", "train.global_batch_size=8",
         "model.n_layer=2"]
AT_512 = [*FIVE, "parallel.pp=4", "parallel.dp_replicate=4", "parallel.dp_shard=8", "dry_run.world=512",
          "model=gpt_1p3b", "model.n_layer=8", "train.seq_len=256", "train.global_batch_size=64",
          "dry_run.compute=fake"]


@pytest.mark.parametrize("world,rank", [(32, 5), (32, 21), (512, 300)])  # the first stage, the last; the third
def test_all_five_equal_the_planner(tmp_path, world, rank):
    """Rank `rank` builds and steps the five-dimensional layout (train.py's dry-run entry; real tensors at world 32,
    where fake ones measure the same bytes, fake at 512): our FSDP over dp_shard x cp, replicas across dp_replicate, on each tp
    slice of each stage, the ring within the stage, sequence-parallel tp, the stages' activations each cp rank's
    pieces / tp. Its state and every collective by mesh dimension equal the planner's for its stage."""
    cfg = make_cfg(*(AT_32 if world == 32 else AT_512), f"dry_run.rank={rank}")
    layout, _, dtype, accum, compute, predicted = dry_run.check(cfg)
    assert layout.name == "pp_hsdp_tp_cp" and compute == ("real" if world == 32 else "fake")  # auto: what fits
    m = dry_run.run(cfg, str(tmp_path / "run"))
    if world == 32:
        fake = dry_run.measure(cfg, layout, rank, "fake", "cpu", dtype, accum, 1)
        for key in ("state_bytes", "transient_bytes", "activation_bytes", "comm_bytes", "comm"):
            assert fake[key] == m[key], key
    pp = layout.pp
    assert m["dims"] == {"pp": pp, "dp": world // pp // 4, "cp": 2, "tp": 2}
    assert predicted["dp_shard"] == layout.dp_shard * 2  # the shard group: dp_shard x cp
    assert_planner_equals(m, predicted, every=True)
    # one micro-batch's saved activations: the ring's small per-block extras (its log-sum-exp, positions, masks: ~9 KB
    # a block here) are not counted, 5% of the tiny model's 164 KB at world 32, under 1% at 512
    assert m["activation_bytes"] == pytest.approx(sum(predicted["one_micro_batch"]), rel=0.06 if world == 32 else 0.01)
    # the terms by name: FSDP within dp_shard x cp, its slices across replicas, the ring, the pipeline, the clip
    assert {dim for dim, _ in m["comm"]} == {"dp_shard_cp", "dp_replicate", "tp", "cp", "pp", "world"}


# each composition of the world-8 cases above at cluster scale: 512 ranks of gpt_1p3b's width (8 blocks)
AT_SCALE = ["model=gpt_1p3b", "model.n_layer=8", "train.seq_len=256", "train.micro_batch_size=1",
            "train.global_batch_size=256", "dry_run.world=512", "dry_run.steps=1", "dry_run.compute=fake"]
COMPOSED = {"hsdp_tp": [*HSDP, "parallel.dp_shard=64", "parallel.tp=4", SP],
            "hsdp_cp": [*HSDP, "parallel.dp_replicate=4", "parallel.dp_shard=64", "parallel.cp=2"],
            "pp_tp_cp": [*PP, "parallel.pp=4", "parallel.tp=4", "parallel.cp=4", SP, "parallel.data=fsdp"],
            "pp_hsdp": [*PP, "parallel.pp=4", *HSDP, "parallel.dp_replicate=16", "parallel.dp_shard=8"]}


@pytest.mark.parametrize("name", COMPOSED)
def test_compositions_at_512_equal_the_planner(name):
    """Rank 300 of 512 under each composition (fake tensors): its state and every collective by mesh dimension equal
    the planner's numbers for that rank (its pipeline stage's), and one micro-batch's activations within 3%."""
    cfg = make_cfg(*AT_SCALE, *COMPOSED[name], "dry_run.rank=300")
    layout, device, dtype, accum, compute, predicted = dry_run.check(cfg)
    assert layout.name == name.replace("pp_tp_cp", "pp_fsdp_tp_cp") and layout.world == 512
    m = dry_run.measure(cfg, layout, 300, compute, device, dtype, accum, 1)
    assert_planner_equals(m, predicted, every=True)
    assert m["activation_bytes"] == pytest.approx(sum(predicted["one_micro_batch"]), rel=0.03)


@pytest.mark.parametrize("overrides,world,message", [
    ((*HSDP, "parallel.cp=2", "parallel.impl=torch"), 8, "torch's context_parallel is GPU-only"),
    ((*PP, *HSDP, "parallel.tp=2", "parallel.impl=torch"), 16,
     "parallel.pp > 1 with parallel.tp > 1 and parallel.impl=torch is not built yet"),
    ((*PP, *HSDP, "parallel.impl=torch", "parallel.pp_schedule=zero_bubble"), 8, "gives gradients that differ"),
    ((*HSDP, "parallel.tp=2", "parallel.impl=deepspeed"), 8, "DeepSpeed's HSDP (its hpZ) is not wired"),
])
def test_still_refused(tmp_path, overrides, world, message):
    """What the rule book still refuses beside the mesh, in one line that says what to use instead."""
    assert_refused(tmp_path, (*RUN, *overrides), world, message)
