"""The quick tier's runs (`pytest -m quick`, for hacking on one file): every strategy once at world 2, in one launch
of 3 steps with gradient accumulation, each equal to parallel=single step for step (loss and grad_norm) and in its
final weights. The tier also takes the fast in-process tests marked quick in the other files: the model, the data,
the bad settings config.py and the layout's rule book refuse, the pipeline schedules. Under the whole suite these
jobs join the session's world-2 launch (conftest.launch2) and cost no start-up of their own; the files of each
strategy prove the rest (both implementations, world 4, the theory, checkpoints)."""
import pytest

import train
from conftest import assert_same_steps, assert_same_weights, launch_jobs, losses, make_cfg, read_metrics, small_run

pytestmark = pytest.mark.quick

STEPS = 3
# global batch 16 in micro-batches of 2: accumulation 8 alone, 4 over dp=2, 8 where both ranks share one batch slice
QUICK = ("train.global_batch_size=16", "train.micro_batch_size=2", f"train.max_steps={STEPS}",
         "train.eval_every=100", "train.log_every=1")
# (overrides, the start record's layout: parallel, pp, dp, cp, tp, and the accumulation)
LAYOUTS = {
    "ddp": (["parallel=ddp"], ("ddp", 1, 2, 1, 1), 4),
    "zero1": (["parallel=zero1"], ("zero1", 1, 2, 1, 1), 4),
    "zero2": (["parallel=zero2"], ("zero2", 1, 2, 1, 1), 4),
    "fsdp": (["parallel=fsdp"], ("fsdp", 1, 2, 1, 1), 4),
    # HSDP at world 2: 2 replicas of a 1-rank shard group, its gradients all-reduced across dp_replicate
    "hsdp": (["parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=1"], ("hsdp", 1, 2, 1, 1), 4),
    "tp": (["parallel=tp"], ("tp", 1, 1, 1, 2), 8),
    "cp": (["parallel=cp"], ("cp", 1, 1, 2, 1), 8),
    "pp": (["parallel=pp"], ("pp", 2, 1, 1, 1), 8),
}
# final weights: tensor parallel sums input gradients in another order than one process, and Adam magnifies that
# rounding where gradients are tiny (as in tests/test_tp.py)
ATOL = {"tp": 1e-5}


@launch_jobs(2)
def jobs(root, request):
    """Every layout, in the session's world-2 launch (under `pytest -m quick`, the launch's only jobs)."""
    return {name: (str(root / name), small_run(*QUICK, *o)) for name, (o, _, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def quick_single(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("quick_single") / "run")
    train.run(make_cfg(*small_run(*QUICK)), run_dir)
    return run_dir


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_strategy_at_world_2(launch2, quick_single, name):
    run_dir = launch2[__name__][0][name]
    start = read_metrics(run_dir)[0]
    _, layout, accum = LAYOUTS[name]
    assert (start["parallel"], start["pp"], start["dp"], start["cp"], start["tp"]) == layout
    assert (start["world_size"], start["grad_accum"]) == (2, accum)
    if name == "hsdp":
        assert (start["dp_replicate"], start["dp_shard"]) == (2, 1)
    assert len(losses(run_dir)) == STEPS
    assert_same_steps(run_dir, quick_single)
    assert_same_weights(run_dir, quick_single, atol=ATOL.get(name, 1e-6))
    got, ref = losses(run_dir, "grad_norm"), losses(quick_single, "grad_norm")
    print(f"{name}: losses {[round(x, 6) for x in losses(run_dir).tolist()]}, largest grad_norm gap to single "
          f"{float(((got - ref).abs() / ref).max()):.1e} relative")
