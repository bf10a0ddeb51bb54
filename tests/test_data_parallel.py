"""DDP, ZeRO-1 and ZeRO-2, ours and torch's, checked against single-process training and against the ZeRO paper.

Real runs of train.py (torchrun, gloo, CPU, float32): the same seed and global batch as a parallel=single run must
give the same per-step losses and final parameters; the comm counter and state accounting must match theory."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train
from conftest import (RUN, STEPS, assert_same_steps, assert_same_weights, losses, make_cfg, read_metrics, small_run,
                      torchrun_jobs)
from model import GPT, GPTConfig
from parallel.ddp import DDP
from parallel.zero import ZeroOptimizer
from tools import plan

# what torch's implementations pay, per step and per rank (P parameters, N ranks, fp32)
TORCH_COMM = {"ddp": 2, "zero1": 3, "zero2": 2}  # x Psi: ZeroRedundancyOptimizer broadcasts after DDP's all-reduce
TORCH_STATE = {"ddp": lambda P, N: 16 * P,
               "zero1": lambda P, N: 8 * P + 8 * P / N,  # whole parameters per rank: uneven, checked to 15%
               "zero2": lambda P, N: 16 * P / N}  # FSDP2 keeps even the parameters sharded between steps


CASES = [(s, i, w) for w in (2, 4) for i in ("scratch", "torch") for s in ("ddp", "zero1", "zero2")]
BF16 = ("ddp", "zero2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run dir: all of one world size's jobs in one torchrun launch (and the bf16 ones with world 2)."""
    root = tmp_path_factory.mktemp("dp")
    dirs = {(s, i, w): str(root / f"{s}-{i}-{w}") for s, i, w in CASES}
    dirs.update({("bf16", s): str(root / f"bf16-{s}") for s in BF16})
    for world in (2, 4):
        jobs = [(dirs[c], small_run(*RUN, f"parallel={c[0]}", f"parallel.impl={c[1]}")) for c in CASES if c[2] == world]
        if world == 2:
            jobs += [(dirs["bf16", s], small_run(*RUN, f"parallel={s}", "parallel.reduce_dtype=bfloat16"))
                     for s in BF16]
        torchrun_jobs(world, jobs)
    return dirs


@pytest.mark.parametrize("strategy,impl,world", CASES, ids=[f"{s}-{i}-{w}" for s, i, w in CASES])
def test_equal_to_single_and_to_theory(single, runs, strategy, impl, world):
    run_dir = runs[strategy, impl, world]
    records = read_metrics(run_dir)
    assert records[0]["world_size"] == world and records[0]["grad_accum"] == 16 // (2 * world)
    assert (records[0]["dp"], records[0]["tp"], records[0]["parallel"]) == (world, 1, strategy)
    assert len(losses(run_dir)) == STEPS
    assert_same_steps(run_dir, single)
    assert_same_weights(run_dir, single)

    P, psi = records[0]["n_params"], records[0]["param_bytes"]
    comm_theory, state_theory = plan.theory(strategy, P, world)
    steps = [r for r in records if "comm_bytes" in r]
    assert len(steps) == STEPS
    for r in steps:
        if impl == "scratch":
            assert r["comm_bytes"] == pytest.approx(comm_theory, rel=0.02)
            assert r["state_bytes_max"] == pytest.approx(state_theory, rel=0.05)
        else:
            assert r["comm_bytes"] == pytest.approx(TORCH_COMM[strategy] * psi, rel=0.02)
            rel = 0.15 if strategy == "zero1" else 0.05
            assert r["state_bytes_max"] == pytest.approx(TORCH_STATE[strategy](P, world), rel=rel)
        # every byte is filed under the data-parallel dimension, or the world group's scalar (the norm's)
        assert sum(v for k, v in r.items() if k.startswith("comm_dp_")) == pytest.approx(r["comm_bytes"], abs=200)
    print(f"{strategy}/{impl} N={world}: comm {steps[-1]['comm_bytes'] / psi:.3f} Psi, "
          f"state {steps[-1]['state_bytes_max'] / P:.2f} bytes/param")


@pytest.mark.parametrize("strategy", BF16)
def test_bf16_reduction(single, runs, strategy):
    """Gradients communicated in bfloat16: half the gradient bytes, and the loss still tracks float32 closely.
    ZeRO's all-gather moves parameters, which stay float32: 2P (bf16 reduce-scatter) + 4P bytes."""
    run_dir = runs["bf16", strategy]
    records = read_metrics(run_dir)
    P = records[0]["n_params"]
    assert records[0]["param_bytes"] == 2 * P
    expected = 2 * (2 * P) if strategy == "ddp" else 2 * P + 4 * P
    for r in records:
        if "comm_bytes" in r:
            assert r["comm_bytes"] == pytest.approx(expected, rel=0.02)
    torch.testing.assert_close(losses(run_dir), losses(single), rtol=2e-3, atol=0)


# ---- in-process checks with a tiny GPT on 2 ranks (torch.multiprocessing, gloo) ----

def _tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=32))
    model.init_weights()
    return model


def _worker(rank, world, init_file, strategy, errors):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        model = _tiny()
        seen_at_last_grad = []
        # registered before the strategy's own hooks, so it runs first on the parameter whose gradient comes last
        # (the embedding: first in forward, last in backward)
        model.wte.weight.register_post_accumulate_grad_hook(
            lambda p: seen_at_last_grad.append(list(owner.hooks.ready_log)))
        torch.manual_seed(rank)
        idx = torch.randint(0, 256, (4, 16))
        if strategy == "ddp":
            owner = wrapped = DDP(model, bucket_mb=0.02)
        else:
            owner = ZeroOptimizer(model, lambda m: torch.optim.AdamW(m.parameters()), stage=2,
                                           bucket_mb=0.02)
            wrapped = model
        reference = _tiny()  # the plain model, for the expected averaged gradient
        reference(idx, idx).backward()
        expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
        for g in expected.values():
            dist.all_reduce(g)
            g.div_(world)
        wrapped(idx, idx).backward()
        assert len(owner.buckets) >= 3, len(owner.buckets)
        # overlap: when the last gradient arrives, earlier buckets' collectives are already in flight
        assert len(seen_at_last_grad) == 1 and len(seen_at_last_grad[0]) >= 1, seen_at_last_grad
        assert owner.hooks.ready_log == list(range(len(owner.buckets)))  # every bucket, in backward order
        if strategy == "ddp":  # the averaged gradients are in .grad itself
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7, msg=n)
        else:  # ZeRO-2: no full gradient survives backward; this rank's shard holds its slice of the average
            assert all(p.grad is None for p in model.parameters())
            assert all("pending" not in b.state for b in owner.buckets)  # transient buffers released
            for b in owner.buckets:
                full = torch.cat([expected[_name(model, p)].view(-1) for p in b.params])
                full = torch.nn.functional.pad(full, (0, b.numel - full.numel()))
                torch.testing.assert_close(b.state["grad_shard"], full[b.state["lo"]: b.state["hi"]],
                                           rtol=1e-5, atol=1e-7)
        dist.destroy_process_group()
    except Exception as e:  # surface the failure in the parent's assertion
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _name(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_overlap_and_gradients_in_place(strategy):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(2, os.path.join(d, "init"), strategy, errors), nprocs=2,
                           start_method="spawn")
    assert errors.empty(), errors.get()


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel=ddp"], 1, "needs several processes, but this is one; launch it with `torchrun --nproc_per_node=N"),
    (["parallel=zero1"], 3, "not divisible by micro_batch_size (4) x data-parallel ranks (3)"),
    (["parallel=ddp", "parallel.impl=deepspeed"], 2, "parallel.impl='deepspeed': expected scratch or torch"),
    (["parallel=zero2", "parallel.bucket_mb=0"], 2, "parallel.bucket_mb=0 must be positive"),
    (["parallel=zero2", "parallel.reduce_dtype=float16"], 2, "expected float32 or bfloat16"),
    (["parallel=single"], 2, "parallel=single runs in one process, but 2 were launched"),
    # the mesh: degrees that don't multiply to the world size, a dimension without its strategy, a strategy that
    # can't run on a dimension of size 1
    (["parallel=ddp", "parallel.tp=2", "parallel.dp=4"], 4, "parallel.dp=4 x parallel.tp=2 = 8, but 4 ranks were "
                                                            "launched"),
    (["parallel=ddp", "parallel.dp=0"], 2, "parallel.dp=0 must be at least 1"),
    (["parallel=fsdp", "parallel.tp=3"], 4, "parallel.tp=3 must divide the number of ranks (4)"),
    (["parallel=tp", "parallel.data=none", "parallel.tp=2"], 4, "parallel.dp=2 replicas need a data-parallel "
                                                                 "strategy: parallel.data=ddp, zero1, zero2 or fsdp"),
    (["parallel=zero1", "parallel.tp=2"], 2, "parallel.data=zero1 shards over the data-parallel ranks, but dp=1"),
    (["parallel=zero2"], 1, "parallel=zero2 needs several processes, but this is one"),
    (["parallel=tp", "parallel.impl=torch", "train.compile=true"], 2, "train.compile=true with torch's tensor "
                                                                      "parallel"),
    (["parallel=zero1", "parallel.tp=2", "parallel.impl=torch"], 4, "parallel.data=zero1 with parallel.tp > 1 has "
                                                                    "no torch twin"),
])
def test_bad_parallel_settings(tmp_path, overrides, world, message):
    with pytest.raises(train.ConfigError) as err:
        train.check_config(make_cfg(*small_run(*overrides)), str(tmp_path / "run"), world)
    assert message in str(err.value)
    assert not (tmp_path / "run").exists()


def _count_worker(rank, world, init_file, errors):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from parallel.comm import CommCounter
        t = torch.ones(1000)  # 4000 bytes
        with CommCounter() as c:
            dist.all_reduce(t)
            dist.reduce_scatter_single(torch.empty(500), torch.ones(1000))
            dist.all_gather_single(torch.empty(1000), torch.ones(500))
            dist.broadcast(t, src=0)
            dist.barrier()
        assert dict(c.by_kind) == {"all_reduce": 8000, "reduce_scatter": 4000, "all_gather": 4000,
                                   "broadcast": 4000}, c.by_kind
        assert c.bytes == 20000 and sum(c.calls.values()) == 4
        assert torch.equal(t, torch.full((1000,), 2.0))  # the counted collectives really ran
        dist.destroy_process_group()
    except Exception as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_comm_counter_volume_rules():
    """all-reduce counts 2x its tensor, reduce-scatter its input, all-gather its output, broadcast its tensor."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_count_worker, args=(2, os.path.join(d, "init"), errors), nprocs=2, start_method="spawn")
    assert errors.empty(), errors.get()
