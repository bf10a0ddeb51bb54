"""Pipeline parallelism: every schedule equal to single-process training, at pp=2 and pp=4 and beside data
parallel; the schedules' shapes (order, activations held, bubble) checked without processes; p2p bytes measured
against 2 m (b s d) (p - 1); bad settings refused up front."""
import contextlib
import io

import pytest

from conftest import RUN, assert_same_steps, assert_same_weights, job_output, make_cfg, read_metrics, small_run, \
    torchrun_jobs
import train
from parallel import pp

# 8 blocks: pp=4 x pp_virtual=2 virtual stages of one block each
PP_RUN = (*RUN, "model.n_layer=8")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# (schedule, pp, data strategy over dp): world 4 each
CASES = [(s, 4, "ddp") for s in SCHEDULES] + [(s, 2, "ddp") for s in SCHEDULES[:2]] + [("1f1b", 2, "fsdp")]
IDS = [f"{s}-pp{p}-{d}" for s, p, d in CASES]


def sample(out):
    return out.split("--- sample ---\n")[1].split("\n--------------")[0]


@pytest.fixture(scope="session")
def single_pp(tmp_path_factory):
    """The reference run, and the sample it printed."""
    run_dir = str(tmp_path_factory.mktemp("single_pp") / "run")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.run(make_cfg(*small_run(*PP_RUN, "train.sample_tokens=8")), run_dir)
    return run_dir, sample(out.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 4 ranks, in one torchrun launch; returns ({case id: run dir}, the launch)."""
    root = tmp_path_factory.mktemp("pp")
    dirs = {case: str(root / case) for case in IDS}
    jobs = [(dirs[case], small_run(*PP_RUN, "parallel=pp", f"parallel.data={d}", f"parallel.pp={p}",
                                   f"parallel.pp_schedule={s}", "train.sample_tokens=8"))
            for case, (s, p, d) in zip(IDS, CASES)]
    return dirs, torchrun_jobs(4, jobs)


@pytest.mark.parametrize("schedule,pp_,data", CASES, ids=IDS)
def test_equal_to_single(runs, single_pp, schedule, pp_, data):
    (dirs, launch), (ref, ref_sample) = runs, single_pp
    run_dir, dp = dirs[IDS[CASES.index((schedule, pp_, data))]], 4 // pp_
    # the gradient norm covers every stage; the loss is the last stage's, meaned as one process means it
    assert_same_steps(run_dir, ref)
    assert_same_weights(run_dir, ref)  # every stage's checkpoint shard, under single's names
    start, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    assert (start["pp"], start["dp"], start["tp"]) == (pp_, dp, 1)
    if dp == 1:  # one pipeline evaluates single's batches (more dp ranks evaluate more of them)
        assert last["val_loss"] == pytest.approx(read_metrics(ref)[-1]["val_loss"], rel=1e-5)
    out = job_output(launch, run_dir)
    assert f"pipeline: {schedule}, {16 // (2 * dp)} micro-batches per step" in out
    assert sample(out) == ref_sample  # sampled through the pipeline: single's tokens
    # p2p: each micro-batch's activation forward and its gradient back over every stage boundary
    m, v = 16 // (2 * dp), 2 if schedule == "interleaved_1f1b" else 1
    assert last["p2p_bytes_pipeline"] == 2 * m * (2 * 64 * 64) * (pp_ * v - 1) * 4
