"""The whole mesh composes: pp x dp_replicate x dp_shard x cp x tp with any degrees above 1 at once.

At world 8 (one torchrun launch for every case) each combination that needs three degrees of 2 runs 3 steps equal
to parallel=single on the same settings: per-step loss and gradient norm, and the final weights (the last
checkpoint). Under each, the state on rank 0 and the bytes by mesh dimension say the groups are the right ones:
HSDP's shards over dp_shard (x cp), its all-reduce across dp_replicate, the activations between stages each cp
rank's pieces, / tp under sequence parallel. Torch's twins where torch composes them: FSDP2 on the (dp_replicate,
dp_shard) mesh beside DTensor tp, and torch's 1F1B schedule beside it. All five degrees at once need 32 ranks: the
dry run builds and steps them as one rank of each pipeline stage, under the fake process group, and its state and
bytes are the planner's terms for that stage (tools/plan.py has no theory of HSDP beside tp, cp or pp to predict()
them)."""
import pytest

import train
from conftest import (assert_refused, assert_same_steps, assert_same_weights, make_cfg, read_metrics, small_run,
                      torchrun_jobs)
from tools import dry_run, plan

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 8 ranks, in one torchrun launch (about 2 minutes on 2 idle cores)."""
    root = tmp_path_factory.mktemp("mesh")
    dirs = {case: str(root / case) for case in CASES}
    torchrun_jobs(8, [(dirs[case], small_run(*RUN, *overrides)) for case, (overrides, _) in CASES.items()])
    return dirs


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
    if cp > 1:
        assert last["comm_cp_p2p"] > 0  # the ring, within each stage
    if pp > 1:  # each micro-batch's activation over the one boundary and its gradient back: (b, T / cp / tp, d)
        m = 16 // (2 * (8 // (pp * cp * tp)))  # micro-batches per step and pipeline: global / (micro x dp)
        assert last["p2p_bytes_pipeline"] == 2 * m * 2 * (64 // cp // tp) * D * 4 * (pp - 1)


# --- all five at once: pp2 x dp_replicate2 x dp_shard2 x cp2 x tp2 = 32 ranks, in the dry run
FIVE = ["parallel=pp", "parallel.pp=2", *HSDP, "parallel.cp=2", "parallel.tp=2", SP, "dry_run.world=32",
        "train.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=8", "model.n_layer=2",
        "dry_run.steps=1"]


@pytest.mark.parametrize("rank", [5, 21])  # of the first stage (ranks 0-15) and of the last (16-31)
def test_all_five_at_world_32(tmp_path, rank):
    """Rank `rank` of 32 builds and steps the five-dimensional layout (train.py's dry-run entry, fake tensors; real
    ones measure the same bytes): our FSDP over dp_shard x cp = 4 ranks, replicas across dp_replicate, on each tp
    slice of each stage, the ring within the stage, sequence-parallel tp, the stages' activations each cp rank's
    pieces / tp. Its state and bytes per mesh dimension are the planner's terms for its stage."""
    cfg = make_cfg(*FIVE, f"dry_run.rank={rank}")
    layout, _, dtype, accum, compute, predicted = dry_run.check(cfg)
    assert layout.name == "pp_hsdp_tp_cp" and predicted is None and compute == "fake"  # no planner prediction
    m = dry_run.run(cfg, str(tmp_path / "run"))
    real = dry_run.measure(cfg, layout, rank, "real", "cpu", dtype, accum, 1)
    for key in ("state_bytes", "transient_bytes", "activation_bytes", "comm_bytes", "comm"):
        assert real[key] == m[key], key
    assert m["dims"] == {"pp": 2, "dp": 4, "cp": 2, "tp": 2} and accum == 2

    shape = plan.model_shape(cfg)
    stage = plan.pp_stages(shape, 2)[rank // 16]
    P, shard, b, T, d = plan.params_per_rank(stage, 2), 2 * 2, 1, 64, shape["n_embd"]
    assert layout.shard_ranks == shard
    assert m["state_bytes"] == pytest.approx(sum(plan.state_bytes(layout, P).values()), rel=1e-3)
    c = m["comm"]
    expect = {("dp_shard_cp", "all_gather"): accum * 2 * P * 4, ("dp_shard_cp", "reduce_scatter"): P * 4,
              ("dp_replicate", "all_reduce"): 2 * P / shard * 4,
              # per micro-batch, each block's 4 sequence-parallel all-gathers and 4 reduce-scatters of (b, T / cp,
              # d), forward and backward, and the stage's end (the embedding's or the head's) one each
              ("tp", "all_gather"): accum * b * T // 2 * d * 4 * (4 * stage["n_layer"] + 1),
              ("tp", "reduce_scatter"): accum * b * T // 2 * d * 4 * (4 * stage["n_layer"] + 1),
              ("cp", "p2p"): plan.cp_comm_bytes(stage, b, T, 4, accum, 2, "ring", 2)["cp", "p2p"],
              ("pp", "p2p"): 2 * accum * b * (T // 2 // 2) * d * 4 * stage["boundaries"],
              ("world", "all_reduce"): 8}  # the gradient norm's one scalar, over every rank
    for key, v in expect.items():
        assert c[key] == pytest.approx(v, rel=1e-2), key
    # tp's all-reduces: the last stage's vocab-parallel loss (3 numbers a token), and the norm gains' gradients
    # where this rank's FSDP shard holds a piece of them (sequence parallel sums them over tp)
    loss = accum * 2 * 3 * b * T // 2 * 4 if stage["last"] else 0
    assert loss <= c.get(("tp", "all_reduce"), 0) <= loss + 2 * (2 * stage["n_layer"] + 1) * d * 4
    assert set(c) == set(expect) | ({("tp", "all_reduce")} if c.get(("tp", "all_reduce")) else set())


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
