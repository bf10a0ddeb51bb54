"""FSDP (ZeRO-3), ours and torch's FSDP2: equal to single-process training, 3 Psi per step, 16P/N bytes per rank;
mixed precision, CPU offload, prefetch, wrap granularity and activation checkpointing."""
import pytest
import torch

import parallel
import config
import train
from conftest import (RUN, STEPS, assert_same_steps, assert_same_weights, losses, make_cfg, read_metrics, small_run,
                      torchrun, torchrun_jobs)
from model import GPT, GPTConfig
from tools import plan

# one micro-step per rank per step (global 4 = 2 ranks x 2): the per-step volume is the textbook one
ONE_MICRO = ("train.global_batch_size=4",)


@pytest.fixture(scope="module")
def single_one_micro(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single1") / "run")
    train.run(make_cfg(*small_run(*RUN, *ONE_MICRO)), run_dir)
    return run_dir


def steps(run_dir):
    records = read_metrics(run_dir)
    return records[0], [r for r in records if "comm_bytes" in r]


COMM_CASES = [
    ("scratch", [], 3),
    ("scratch", ["parallel.reshard_after_forward=false"], 2),
    ("scratch", ["parallel.prefetch=0"], 3),
    ("scratch", ["parallel.prefetch=2", "train.activation_checkpointing=full"], 3),
    ("torch", [], 3),
    ("torch", ["parallel.reshard_after_forward=false"], 2),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run this file checks, in two torchrun launches (world 2 and world 4)."""
    root = tmp_path_factory.mktemp("fsdp")
    jobs = {2: {}, 4: {}}
    for world in (2, 4):
        for impl in ("scratch", "torch"):
            jobs[world]["equal", impl, world] = small_run(*RUN, "parallel=fsdp", f"parallel.impl={impl}")
    for i, (impl, overrides, _) in enumerate(COMM_CASES):
        jobs[2]["comm", i] = small_run(*RUN, *ONE_MICRO, "parallel=fsdp", f"parallel.impl={impl}", *overrides)
    jobs[2]["bf16"] = small_run(*RUN, *ONE_MICRO, "parallel=fsdp", "parallel.param_dtype=bfloat16")
    for impl in ("scratch", "torch"):
        jobs[2]["offload", impl] = small_run(*RUN, "parallel=fsdp", f"parallel.impl={impl}", "parallel.cpu_offload=true")
    jobs[2]["wrap"] = small_run(*RUN, "parallel=fsdp", "parallel.blocks_per_unit=2")
    dirs = {}
    for world, these in jobs.items():
        for key in these:
            dirs[key] = str(root / "-".join(map(str, key)))
        torchrun_jobs(world, [(dirs[k], o) for k, o in these.items()])
    return dirs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl", ["scratch", "torch"])
def test_equal_to_single(single, runs, impl, world):
    """With gradient accumulation: non-final micro-steps gather in forward and backward but reduce nothing."""
    run_dir = runs["equal", impl, world]
    assert_same_steps(run_dir, single)
    assert_same_weights(run_dir, single)
    start, records = steps(run_dir)
    P, accum = start["n_params"], start["grad_accum"]
    assert len(records) == STEPS
    for r in records:
        assert r["state_bytes_max"] == pytest.approx(16 * P / world, rel=0.05)  # 16P/N: shards only, after the step
        if impl == "scratch":  # 2 all-gathers per micro-step, one reduce-scatter per step
            assert r["comm_bytes"] == pytest.approx(plan.theory("fsdp", P, world, 4, accum)[0], rel=0.02)


@pytest.mark.parametrize("case", range(len(COMM_CASES)),
                         ids=[f"{i}-{'-'.join(o) or 'default'}" for i, o, _ in COMM_CASES])
def test_comm_per_step(single_one_micro, runs, case):
    """3 Psi per step (all-gather forward + all-gather backward + reduce-scatter), 2 Psi when units stay gathered
    from forward to backward; prefetch and activation checkpointing change neither the bytes nor the numbers."""
    run_dir, psi_per_step = runs["comm", case], COMM_CASES[case][2]
    start, records = steps(run_dir)
    assert start["grad_accum"] == 1
    for r in records:
        assert r["comm_bytes"] == pytest.approx(psi_per_step * start["param_bytes"], rel=0.02)
    assert_same_steps(run_dir, single_one_micro)
    assert_same_weights(run_dir, single_one_micro)


def test_bf16_params_fp32_reduce(single_one_micro, runs):
    """Gathered parameters in bfloat16 (half the all-gather bytes), gradients reduced in float32: the loss tracks
    the float32 run within 1e-3 relative over 6 steps (5e-5 seen)."""
    start, records = steps(runs["bf16"])
    P = start["n_params"]
    for r in records:
        assert r["comm_bytes"] == pytest.approx(2 * (2 * P) + 4 * P, rel=0.02)  # 2 bf16 all-gathers + fp32 RS
        assert r["state_bytes_max"] == pytest.approx(16 * P / 2, rel=0.05)  # shards stay float32
    torch.testing.assert_close(losses(runs["bf16"]), losses(single_one_micro), rtol=1e-3, atol=0)


@pytest.mark.parametrize("impl", ["scratch", "torch"])
def test_cpu_offload_same_losses(single, runs, impl):
    assert_same_steps(runs["offload", impl], single)
    assert_same_weights(runs["offload", impl], single)


def test_wrap_granularity(single, runs):
    """Both blocks in one unit (3 units: embedding, blocks, norm + head): the same numbers."""
    assert_same_steps(runs["wrap"], single)


def saved_bytes_and_grads(mode):
    """Bytes autograd saves for backward in one forward of a small GPT, and the gradients it then computes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=2, n_embd=64))
    model.init_weights()
    parallel.apply_activation_checkpointing(model, mode, every=2)
    idx = torch.randint(0, 256, (4, 64))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx)
    loss.backward()
    return sum(saved), loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_saves_memory_not_numbers():
    none, loss_none, grads_none = saved_bytes_and_grads("none")
    every, loss_every, grads_every = saved_bytes_and_grads("every_n")
    full, loss_full, grads_full = saved_bytes_and_grads("full")
    print(f"saved for backward: none {none / 2**20:.2f} MiB, every 2nd block {every / 2**20:.2f}, full "
          f"{full / 2**20:.2f}")
    assert full < 0.5 * none and full < every < none
    assert loss_none == loss_every == loss_full
    for n in grads_none:
        torch.testing.assert_close(grads_full[n], grads_none[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grads_every[n], grads_none[n], rtol=1e-6, atol=1e-7)


def test_peak_memory_a_third_of_ddp(tmp_path):
    """Peak process memory above what it held before the model (rank 0's peak RSS), FSDP vs DDP, at two sizes.
    At N=4, FSDP's model state is 16P/4 against DDP's 16P: with activations and gathered units, about a third."""
    world, peaks = 4, {}
    # big enough that model state, not the interpreter's own heap, dominates the peak (76M and 118M parameters),
    # and deep enough that the few units in flight are a small part of the model
    for size in ({"model.n_layer": 24, "model.n_embd": 512}, {"model.n_layer": 24, "model.n_embd": 640}):
        shape = [f"{k}={v}" for k, v in size.items()] + ["model.n_head=4", "train.max_steps=1",
                                                         "checkpoint.keep=0", "train.eval_steps=1"]
        for strategy in ("ddp", "fsdp"):
            run_dir = str(tmp_path / f"{strategy}-{size['model.n_embd']}")
            # a fixed mmap threshold: glibc then returns every freed large buffer to the OS at once, so the peak
            # RSS follows the tensors alive (by default freed units would linger in the heap, counted as resident)
            torchrun(world, run_dir, *small_run("train.global_batch_size=4", "train.micro_batch_size=1", *shape,
                                                f"parallel={strategy}"), env={"MALLOC_MMAP_THRESHOLD_": "65536"})
            start, records = steps(run_dir)
            peaks[strategy, size["model.n_embd"]] = (records[-1]["peak_mem_mb"] - start["mem_mb_before_model"],
                                                    start["n_params"])
    for d in (512, 640):
        (ddp, P), (fsdp, _) = peaks["ddp", d], peaks["fsdp", d]
        print(f"n_embd {d}: {P / 1e6:.1f}M params, peak above baseline: ddp {ddp:.0f} MiB, fsdp {fsdp:.0f} MiB "
              f"({fsdp / ddp:.2f})")
        assert fsdp < 0.36 * ddp


@pytest.mark.parametrize("overrides,message", [
    (["parallel.blocks_per_unit=3"], "can't split the model's 2 blocks into equal units"),
    (["parallel.prefetch=4"], "there are 4 units, so at most 3 can be gathered ahead"),
    (["parallel.param_dtype=float16"], "parallel.param_dtype='float16': expected auto, float32 or bfloat16"),
    (["train.activation_checkpointing=some"], "expected none, full or every_n"),
])
def test_bad_fsdp_settings(tmp_path, overrides, message):
    with pytest.raises(train.ConfigError) as err:
        train.check_config(make_cfg(*small_run("parallel=fsdp", *overrides)), str(tmp_path / "run"), 2)
    assert message in str(err.value)


def test_offload_with_a_dtype_the_cpu_cant(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "bf16_supported", lambda device: False)
    with pytest.raises(train.ConfigError, match="this CPU can't do"):
        train.check_config(make_cfg(*small_run("parallel=fsdp", "parallel.cpu_offload=true",
                                               "parallel.param_dtype=bfloat16")), str(tmp_path / "run"), 2)
