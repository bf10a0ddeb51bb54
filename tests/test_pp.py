"""Pipeline parallelism: every schedule equal to single-process training, at pp=2 and pp=4, beside data parallel
and tensor parallel (pp=2 x tp=2, pp=2 x dp=2 x tp=2); the schedules' shapes (order, activations held, bubble)
checked without processes; p2p bytes measured against 2 m (b s d) (p - 1); bad settings refused up front."""
import contextlib
import io

import pytest

from conftest import RUN, assert_refused, job_output, launch_jobs, make_cfg, read_metrics, small_run
import train
from parallel import pp

# 8 blocks: pp=4 x pp_virtual=2 virtual stages of one block each
STEPS = 3  # each pipeline run's; the reference goes on to 2 STEPS, for the checkpoint round trips
PP_RUN = (*(o for o in RUN if not o.startswith("train.max_steps")), "model.n_layer=8", "checkpoint.every=3")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# (schedule, pp, data strategy over dp, impl, tp, sequence parallel): world 4 each; torch's
# (torch.distributed.pipelining) without a data strategy at pp=4. At pp=2 x dp=2 ours runs every backward under
# no_sync and reduces once after the schedule; torch's schedules drive DistributedDataParallel and FSDP2 themselves.
# Under tp each tp rank runs its own copy of the pipeline
CASES = [(s, 4, "ddp", "scratch", 1, False) for s in SCHEDULES] + \
    [(s, 4, "none", "torch", 1, False) for s in SCHEDULES] + \
    [(s, 2, d, i, 1, False) for s, d, i in (
        ("gpipe", "ddp", "scratch"), ("1f1b", "fsdp", "scratch"), ("zero_bubble", "ddp", "scratch"),
        ("interleaved_1f1b", "ddp", "scratch"), ("interleaved_1f1b", "fsdp", "scratch"),
        ("1f1b", "zero1", "scratch"), ("1f1b", "zero2", "scratch"),
        ("1f1b", "ddp", "torch"), ("gpipe", "fsdp", "torch"), ("1f1b", "zero2", "torch"))] + \
    [("gpipe", 2, "ddp", "scratch", 2, False), ("1f1b", 2, "ddp", "scratch", 2, False),
     ("zero_bubble", 2, "ddp", "scratch", 2, True), ("interleaved_1f1b", 2, "ddp", "scratch", 2, True)]
# world 8 is slow on 2 cores: one launch, pp=2 x dp=2 x tp=2 with FSDP over dp
CASES8 = [("1f1b", 2, "fsdp", "scratch", 2, True)]


def case_id(schedule, pp_, data, impl, tp, sp):
    return f"{schedule}-pp{pp_}-{data}-{impl}" + (f"-tp{tp}" if tp > 1 else "") + ("-sp" if sp else "")


IDS, IDS8 = [case_id(*c) for c in CASES], [case_id(*c) for c in CASES8]


def sampled(schedule, tp, sp):
    """Whether a case runs the reference's 2 STEPS and samples at the end through the pipeline: 1F1B beside
    sequence-parallel tp (the world-8 case; the world-4 launch's resumed job samples through a pipeline too). The
    other cases stop after STEPS: each micro-step beside tp is dozens of collectives, ~6 ms each on 4 ranks sharing 2
    cores (2026-12-02)."""
    return tp > 1 and sp and schedule == "1f1b"


def case_run(schedule, pp_, data, impl, tp, sp):
    """A case's overrides (sampled: 2 STEPS and a sample at the end)."""
    return small_run(*PP_RUN, "parallel=pp", f"parallel.data={data}", f"parallel.pp={pp_}", f"parallel.impl={impl}",
                     f"parallel.pp_schedule={schedule}", f"parallel.tp={tp}",
                     f"parallel.sequence_parallel={str(sp).lower()}",
                     *([f"train.max_steps={2 * STEPS}", "train.sample_tokens=8"] if sampled(schedule, tp, sp) else
                       [f"train.max_steps={STEPS}"]))
# pipeline x context parallel, pp=2 x cp=2: the data strategy over dp x cp = 2 ranks (issue 17's cp x pp)
CP_CASES = [("1f1b", "fsdp"), ("zero_bubble", "ddp")]
CP_IDS = [f"{s}-pp2-cp2-{d}" for s, d in CP_CASES]


def sample(out):
    return out.split("--- sample ---\n")[1].split("\n--------------")[0]


REFERENCE = {}


def reference(tmp_path_factory):
    """The reference run (2 STEPS, a checkpoint after STEPS), and the sample it printed at the end: once a session,
    for the fixture and for the world-4 launch's resumed job."""
    if not REFERENCE:
        run_dir = str(tmp_path_factory.mktemp("single_pp") / "run")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.run(make_cfg(*small_run(*PP_RUN, f"train.max_steps={2 * STEPS}", "train.sample_tokens=8")), run_dir)
        REFERENCE["run"] = run_dir, sample(out.getvalue())
    return REFERENCE["run"]


@pytest.fixture(scope="session")
def single_pp(tmp_path_factory):
    return reference(tmp_path_factory)


def steps(run_dir, first, last):
    return [{k: r[k] for k in ("loss", "grad_norm")} for r in read_metrics(run_dir)
            if "loss" in r and first <= r["step"] <= last]


def assert_steps(run_dir, ref, first, last):
    """Per-step loss and grad_norm of steps first..last equal to the reference's (rtol 1e-5)."""
    got, want = steps(run_dir, first, last), steps(ref, first, last)
    assert len(got) == len(want) == last - first + 1
    for g, w in zip(got, want):
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-5), (k, g, w)


def assert_weights(path, ref_path, atol=1e-6):
    """The weights of checkpoint `path` equal to those of `ref_path`, consolidated from whatever wrote them."""
    import torch
    import checkpoint
    got, ref = checkpoint.consolidate(path)[0], checkpoint.consolidate(ref_path)[0]
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def ckpt(run_dir, step):
    return f"{run_dir}/checkpoints/step_{step:07d}"


@launch_jobs(4)
def jobs4(root, request):
    """Every case on 4 ranks, and a pp=2 x dp=2 run resumed from single's checkpoint, in the session's world-4
    launch."""
    these = {case: (str(root / case), case_run(*c)) for case, c in zip(IDS, CASES)}
    these.update({case: (str(root / case), small_run(*PP_RUN, "parallel=pp", f"parallel.data={d}", "parallel.pp=2",
                                                     "parallel.cp=2", f"parallel.pp_schedule={s}",
                                                     f"train.max_steps={STEPS}"))
                  for case, (s, d) in zip(CP_IDS, CP_CASES)})
    these.update({f"uneven-{d}": (str(root / f"uneven-{d}"), small_run(
        *PP_RUN, "parallel=pp", "parallel.pp=2", f"parallel.data={d}", "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_virtual=3", f"train.max_steps={STEPS}")) for d in UNEVEN})
    single = reference(request.getfixturevalue("tmp_path_factory"))[0]
    these["resumed"] = (str(root / "resumed"), small_run(*PP_RUN, "parallel=pp", "parallel.pp=2",
                                                         f"train.max_steps={2 * STEPS}", "train.sample_tokens=8",
                                                         f"train.resume={ckpt(single, STEPS)}"))
    return these


@launch_jobs(8)
def jobs8(root, request):
    """CASES8, in the session's world-8 launch."""
    return {case: (str(root / case), case_run(*c)) for case, c in zip(IDS8, CASES8)}


@pytest.fixture(scope="module")
def runs(launch4):
    """({case id: run dir}, the launch)."""
    return launch4[__name__]


@pytest.fixture(scope="module")
def runs8(launch8):
    return launch8[__name__]


@pytest.mark.parametrize("schedule,pp_,data,impl,tp,sp", CASES, ids=IDS)
def test_equal_to_single(runs, single_pp, schedule, pp_, data, impl, tp, sp):
    dirs, launch = runs
    check_case(dirs[case_id(schedule, pp_, data, impl, tp, sp)], launch, single_pp, 4, schedule, pp_, data, impl, tp, sp)


@pytest.mark.parametrize("schedule,pp_,data,impl,tp,sp", CASES8, ids=IDS8)
def test_equal_to_single_3d(runs8, single_pp, schedule, pp_, data, impl, tp, sp):
    dirs, launch = runs8
    check_case(dirs[case_id(schedule, pp_, data, impl, tp, sp)], launch, single_pp, 8, schedule, pp_, data, impl, tp, sp)


def check_case(run_dir, launch, single_pp, world, schedule, pp_, data, impl, tp, sp):
    ref, ref_sample = single_pp
    dp, last_step = world // (pp_ * tp), 2 * STEPS if sampled(schedule, tp, sp) else STEPS
    # the gradient norm covers every stage (the tp ranks' shards once, their replicated norm gains once); the loss
    # is the last stage's, meaned as one process means it
    assert_steps(run_dir, ref, 1, last_step)
    # every stage's checkpoint shard, under single's names. Tensor parallel sums input gradients in another order
    # than one process: Adam magnifies that rounding where gradients are tiny (2e-6 seen in one element), as in
    # tests/test_tp.py
    for step in range(STEPS, last_step + 1, STEPS):
        assert_weights(ckpt(run_dir, step), ckpt(ref, step), atol=1e-5 if tp > 1 else 1e-6)
    start, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    assert (start["pp"], start["dp"], start["tp"]) == (pp_, dp, tp)
    # evaluated through the pipeline: single's loss on single's validation set (train.eval_batch_size, whatever dp)
    val, ref_val = ([r["val_loss"] for r in read_metrics(d) if "val_loss" in r] for d in (run_dir, ref))
    assert val[0] == pytest.approx(ref_val[0], rel=1e-5)  # step 0
    if last_step == 2 * STEPS:
        assert val[-1] == pytest.approx(ref_val[-1], rel=1e-5)
    out = job_output(launch, run_dir)
    assert f"pipeline: {schedule}, {16 // (2 * dp)} micro-batches per step" in out
    if sampled(schedule, tp, sp):  # drawn through the pipeline, the last stage's tp ranks gathering the vocab slices
        assert sample(out) == ref_sample
    # model state on rank 0 (the first stage: the embedding and 8 / pp blocks of 12 d^2 + 2 d, the matrices 1/tp
    # each) is that stage's parameters x 16 bytes (fp32 weight, gradient, two Adam moments), / dp under FSDP; + Adam's
    # step counters
    stage = 512 * 64 // tp + 8 // pp_ * (12 * 64 * 64 // tp + 2 * 64)
    # (ZeRO-1 shards the moments: 8 + 8 / dp; ZeRO-2 the gradients too: 4 + 12 / dp; torch's ZeRO-2 is FSDP2's 16 / dp)
    per_param = {"fsdp": 16 / dp, "zero1": 8 + 8 / dp, "zero2": 16 / dp if impl == "torch" else 4 + 12 / dp}
    expected = stage * per_param.get(data, 16)
    assert expected <= last["state_bytes"] <= expected * 1.001
    # p2p: each micro-batch's activation forward and its gradient back over every stage boundary, each tp rank its
    # own copy (its 1/tp of the positions under sequence parallel)
    m, v = 16 // (2 * dp), 2 if schedule == "interleaved_1f1b" else 1
    assert last["p2p_bytes_pipeline"] == 2 * m * (2 * 64 * 64 // (tp if sp else 1)) * (pp_ * v - 1) * 4


UNEVEN = ("ddp", "fsdp")


@pytest.mark.parametrize("data", UNEVEN)
def test_uneven_stages(runs, single_pp, data):
    """8 blocks over pp=2 x pp_virtual=3 virtual stages: 2, 2, 1, 1, 1, 1 blocks (split_blocks, the planner's split
    too), interleaved 1F1B beside DDP or FSDP over dp=2: single's steps, weights and validation loss."""
    (dirs, launch), (ref, _) = runs, single_pp
    run_dir = dirs[f"uneven-{data}"]
    assert [len(r) for r in pp.split_blocks(8, 6)] == [2, 2, 1, 1, 1, 1]
    assert_steps(run_dir, ref, 1, STEPS)
    assert_weights(ckpt(run_dir, STEPS), ckpt(ref, STEPS))
    val, ref_val = ([r["val_loss"] for r in read_metrics(d) if "val_loss" in r] for d in (run_dir, ref))
    assert val[0] == pytest.approx(ref_val[0], rel=1e-5)
    assert "rank 0: wte + blocks 0-1 | blocks 4 | block 6" in job_output(launch, run_dir) or \
        "rank 0: wte + blocks 0-1 | block 4 | block 6" in job_output(launch, run_dir), job_output(launch, run_dir)


@pytest.mark.parametrize("schedule,data", CP_CASES, ids=CP_IDS)
def test_pipeline_with_context_parallel(runs, single_pp, schedule, data):
    """pp=2 x cp=2: each cp rank streams its zig-zag pieces of every micro-batch through the stages (to the same cp
    rank of the next stage), the ring runs within each stage, the gradients are reduced over cp: single's steps
    and weights, and the p2p traffic of activations 1/cp as long."""
    (dirs, _), (ref, _) = runs, single_pp
    run_dir = dirs[CP_IDS[CP_CASES.index((schedule, data))]]
    assert_steps(run_dir, ref, 1, STEPS)
    # measured 2026-12-01: all but 2 of the 0.46M weights within 4e-7 of single's after 3 AdamW steps, those two
    # 2.6e-6 and 4.8e-6: Adam's g / sqrt(v) magnifies the ring's rounding where a gradient is near zero. Under SGD
    # (lr 0.5) the same runs agree within 1e-8, so the gradients are single's.
    assert_weights(ckpt(run_dir, STEPS), ckpt(ref, STEPS), atol=1e-5)
    start, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    assert (start["pp"], start["dp"], start["cp"], start["tp"]) == (2, 1, 2, 1)
    assert start["parallel"] == (f"pp_{data}_cp" if data != "ddp" else "pp_cp")
    val, ref_val = ([r["val_loss"] for r in read_metrics(d) if "val_loss" in r] for d in (run_dir, ref))
    assert val[0] == pytest.approx(ref_val[0], rel=1e-5)  # evaluated through the pipeline, on split sequences
    assert last["comm_cp_p2p"] > 0  # the ring, within each stage
    # one pipeline per cp rank, each micro-batch's (b, s / cp, d) activation over the one boundary and back
    m = 16 // 2
    assert last["p2p_bytes_pipeline"] == 2 * m * (2 * (64 // 2) * 64) * (2 - 1) * 4


# --- the schedules' shapes, without processes: order, activations held, bubble (forward 1, backward 2)
@pytest.mark.quick
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 12)])
def test_schedule_shapes(p, m):
    gp, ob, zb = (pp.schedule(s, p, m) for s in ("gpipe", "1f1b", "zero_bubble"))
    for acts in (gp, ob, zb):  # every rank runs every micro-batch's passes once, in micro-batch order
        for rank in acts:
            for kind in {k for k, _, _ in rank}:
                order = [i for k, _, i in rank if k == kind]
                assert sorted(order) == list(range(m)) and (order == sorted(order) or acts is gp)
    assert [pp.peak_in_flight(r) for r in gp] == [m] * p  # GPipe holds every micro-batch
    assert [pp.peak_in_flight(r) for r in ob] == [min(p - r, m) for r in range(p)]  # 1F1B at most p - rank
    assert max(pp.peak_in_flight(r) for r in zb) <= p  # ZB-H1: 1F1B's peak
    assert pp.bubble(gp) == pytest.approx((p - 1) / (m + p - 1))
    assert pp.bubble(ob) == pytest.approx((p - 1) / (m + p - 1))
    # ZB-H1 (Qi et al.): idle (p - 1)(F + B - W) per rank, B = W = 1
    assert pp.bubble(zb) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert pp.bubble(zb) < pp.bubble(ob)
    for v in (2, 3):  # Megatron's interleaved: the bubble shrinks v-fold
        il = pp.schedule("interleaved_1f1b", p, m, v)
        assert pp.bubble(il, v) == pytest.approx((p - 1) / (v * m + p - 1))
        assert all(sorted((c, i) for k, c, i in r if k == "F") == [(c, i) for c in range(v) for i in range(m)]
                   for r in il)


@pytest.mark.quick
def test_schedule_orders():
    """The action lists themselves, for one small pipeline (p=2, m=3)."""
    names = {s: [" ".join(f"{k}{i}" for k, _, i in r) for r in pp.schedule(s, 2, 3)] for s in ("gpipe", "1f1b",
                                                                                                 "zero_bubble")}
    assert names["gpipe"] == ["F0 F1 F2 B2 B1 B0"] * 2
    assert names["1f1b"] == ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]
    assert names["zero_bubble"] == ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 B0 F1 B1 W0 F2 B2 W1 W2"]
    assert pp.split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert pp.describe(4, 2, 2) == ["rank 0: wte + block 0 | block 2", "rank 1: block 1 | block 3 + norm, head, loss"]
    with pytest.raises(RuntimeError, match="deadlocks"):  # the simulator refuses an order that can't run
        pp.simulate([[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]])


def _executor_ranks():
    """On each of 2 forked ranks, every schedule: Pipeline.step on a tiny GPT gives this rank's parameters the
    gradients that the whole model, run in this process with the same micro-batches, gives them, and the loss sum
    (on the last stage); it holds at most the schedule's peak of micro-batches."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from model import GPT, GPTConfig
    from parallel.strategy import materialize
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=4, n_head=2, n_embd=16)
    accum, micro = 4, 2
    with torch.device("meta"):  # built on meta and drawn from seed 0, as split draws (constructors draw too)
        whole = GPT(cfg)
    whole.to_empty(device="cpu")
    torch.manual_seed(0)
    whole.init_weights()
    x = torch.randint(0, 128, (accum * micro, 16))
    loss_sum = 0.0
    for xi in x.split(micro):
        loss = whole(xi, xi)
        (loss / accum).backward()
        loss_sum += loss.item()
    want = {n: q.grad for n, q in whole.named_parameters()}
    for schedule in SCHEDULES:
        p = OmegaConf.create(dict(pp_schedule=schedule, pp_virtual=2, sequence_parallel=False, impl="scratch",
                                  param_dtype="float32", data="none"))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
        pipe = pp.split(model, mesh, p, "cpu")
        materialize(model, pipe.init_param(model.init_param), "cpu")
        got = pipe.step(x, x, accum, micro)
        if pipe.rank == 1:  # the last stage sums the micro-batches' losses
            assert got.item() == pytest.approx(loss_sum, rel=1e-6), (schedule, got.item(), loss_sum)
        mine = dict(model.named_parameters())
        assert mine and all(q.grad is not None for q in mine.values()), schedule
        for n, q in mine.items():  # fp32, the same ops in the same order per micro-batch: 1e-6 holds
            torch.testing.assert_close(q.grad, want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{schedule} {n}: {m}")
        expected = pp.schedule(schedule, 2, accum, pipe.v)[pipe.rank]
        assert sorted(pipe.log) == sorted(expected), schedule  # every action once
        assert pipe.peak == pp.peak_in_flight(expected), (schedule, pipe.peak)
    dist.destroy_process_group()


def test_executor_gives_the_whole_models_gradients():
    from conftest import forked
    forked(2, _executor_ranks)


@pytest.mark.quick
@pytest.mark.parametrize("overrides,world,message", [
    (("parallel=pp", "parallel.pp=3"), 4, "parallel.pp=3 x parallel.tp=1 = 3 must divide the number of ranks (4)"),
    (("parallel=pp", "model.n_layer=2"), 4, "4 stages, but the model has 2 blocks"),
    (("parallel=pp", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=3", "model.n_layer=5"), 2,
     "pp=2 x pp_virtual=3 = 6 stages, but the model has 5 blocks"),
    (("parallel=pp", "parallel.pp_schedule=interleaved_1f1b", "model.n_layer=4", "train.global_batch_size=12",
      "train.micro_batch_size=4"), 2, "but a step has 3"),
    (("parallel=pp", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=1", "model.n_layer=4"), 2,
     "pp_virtual=1 is 1f1b"),
    (("parallel=pp", "parallel.pp_schedule=2f2b"), 2, "parallel.pp_schedule='2f2b': expected gpipe, 1f1b"),
    (("parallel=pp", "parallel.pp=2", "parallel.tp=2", "parallel.impl=torch", "parallel.data=none"), 4,
     "parallel.tp > 1 and parallel.impl=torch is not built yet"),
    (("parallel=pp", "parallel.pp=2", "parallel.impl=torch", "parallel.pp_schedule=interleaved_1f1b",
      "model.n_layer=4", "train.global_batch_size=16", "train.micro_batch_size=2"), 4,
     "parallel.pp_schedule=interleaved_1f1b parallel.data=ddp over dp=2 with parallel.impl=torch: torch.distributed"),
    (("parallel=pp", "parallel.pp=2", "parallel.impl=torch", "parallel.pp_schedule=zero_bubble"), 4,
     "gives gradients that differ from single's"),
    (("parallel=pp", "parallel.pp=2", "parallel.impl=torch", "parallel.pp_schedule=gpipe", "parallel.data=zero1"), 4,
     "internal assert of DDP's reducer"),
    (("parallel=pp", "parallel.pp=2", "parallel.data=zero2", "parallel.accumulate=sharded"), 4,
     "parallel.accumulate=sharded with parallel.pp > 1"),
    (("parallel=pp", "parallel.pp=2", "parallel.data=fsdp", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.blocks_per_unit=4", "model.n_layer=8", "train.global_batch_size=16", "train.micro_batch_size=2"), 4,
     "an FSDP unit must not span two"),
])
def test_bad_pp_settings(tmp_path, overrides, world, message):
    assert_refused(tmp_path, overrides, world, message)


def test_checkpoints_reshard_both_ways(runs, single_pp, tmp_path):
    """single's checkpoint goes on under pp=2 x dp=2, and a pp=4 checkpoint goes on in one process: both equal
    to the uninterrupted single run, step for step and in the final weights. The sample, drawn through the
    pipeline at the end of the resumed run, is single's."""
    (dirs, launch), (ref, ref_sample) = runs, single_pp
    assert_steps(dirs["resumed"], ref, STEPS + 1, 2 * STEPS)
    assert_weights(ckpt(dirs["resumed"], 2 * STEPS), ckpt(ref, 2 * STEPS))
    assert sample(job_output(launch, dirs["resumed"])) == ref_sample
    back = str(tmp_path / "back")
    train.run(make_cfg(*small_run(*PP_RUN, f"train.max_steps={2 * STEPS}",
                                  f"train.resume={ckpt(dirs['1f1b-pp4-ddp-scratch'], STEPS)}")), back)
    assert_steps(back, ref, STEPS + 1, 2 * STEPS)
    assert_weights(ckpt(back, 2 * STEPS), ckpt(ref, 2 * STEPS))
