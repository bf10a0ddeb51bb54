"""FSDP (ZeRO-3), ours and torch's FSDP2: equal to single-process training, 3 Psi per step, 16P/N bytes per rank;
mixed precision, CPU offload, prefetch, wrap granularity and activation checkpointing. HSDP (FSDP within each shard
group, replicas across): equal to single, its bytes by mesh dimension and its state the planner's, its checkpoints
loading into other layouts and theirs into it."""
import pytest
import torch

import parallel
import config
import train
from conftest import (BF16, RUN, STEPS, assert_refused, assert_same_steps, assert_same_weights, forked,
                      launch_jobs, make_cfg, needs_bf16, read_metrics, small_run)
from model import GPT, GPTConfig
from parallel.layout import Layout
from tools import plan

# one micro-step per rank per step (global 4 = 2 ranks x 2): the per-step volume is the textbook one
ONE_MICRO = ("train.global_batch_size=4",)
# bf16 working weights against the float32 run: 5-7x the largest gap measured (2026-12-03, accumulation 4, this
# AMX CPU: loss 2.1e-5, grad_norm 1.2e-3, val_loss 2.9e-5), room for another CPU's bf16 kernels
BF16_PARAMS_RTOL = {"loss": 1.5e-4, "grad_norm": 6e-3, "val_loss": 2e-4}


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


# HSDP 2 x 2 at world 4: two replicas of 2-rank shard groups. Ours with gradient accumulation 2 (RUN); torch's with
# none (micro-batches of 4), where FSDP2's gathers are the textbook ones (under no_sync it keeps units gathered)
HSDP = ("parallel=hsdp", "parallel.dp_shard=2")
HSDP_IMPL = {"scratch": (), "torch": ("parallel.impl=torch", "train.micro_batch_size=4")}
# checkpoints across layouts: each resumes at step STEPS from a checkpoint another layout wrote, and trains to RESUMED
RESUMED = STEPS + 1
FURTHER = (f"train.max_steps={RESUMED}", "train.eval_steps=1")


def checkpoint_of(run_dir):
    return f"train.resume={run_dir}/checkpoints/step_{STEPS:07d}"


def equal(world):
    return {("equal", impl, world): small_run(*RUN, "parallel=fsdp", f"parallel.impl={impl}")
            for impl in ("scratch", "torch")}


@launch_jobs(2)
def jobs2(root, request):
    """Every world-2 run this file checks, in the session's world-2 launch."""
    these = equal(2)
    for i, (impl, overrides, _) in enumerate(COMM_CASES):
        these["comm", i] = small_run(*RUN, *ONE_MICRO, "parallel=fsdp", f"parallel.impl={impl}", *overrides)
    if BF16:
        these["bf16"] = small_run(*RUN, "parallel=fsdp", "parallel.param_dtype=bfloat16")  # accumulation 4
    for impl in ("scratch", "torch"):
        these["offload", impl] = small_run(*RUN, "parallel=fsdp", f"parallel.impl={impl}", "parallel.cpu_offload=true")
    these["wrap"] = small_run(*RUN, "parallel=fsdp", "parallel.blocks_per_unit=2")
    return {key: (run_dir(root, key), o) for key, o in these.items()}


@launch_jobs(4)
def jobs4(root, request):
    """Every world-4 run, in the session's world-4 launch: its HSDP jobs load the checkpoints of single and of a
    world-2 job, and later jobs of the launch load those of its first."""
    these = equal(4)
    these.update({("hsdp", impl): small_run(*RUN, *HSDP, *extra) for impl, extra in HSDP_IMPL.items()})
    # HSDP's checkpoints into ddp and FSDP2 at world 4 (and single, in test_hsdp_checkpoints); theirs into HSDP
    into = savers(request.getfixturevalue("single"), {**request.getfixturevalue("launch2")[__name__][0],
                                                      **{key: run_dir(root, key) for key in these}})
    for saver, loader in CHECKPOINTS:
        if loader != "single":
            these["resume", saver, loader] = small_run(*RUN, *FURTHER, *LOADERS[loader], checkpoint_of(into[saver]))
    return {key: (run_dir(root, key), o) for key, o in these.items()}


def run_dir(root, key):
    return str(root / (key if isinstance(key, str) else "-".join(map(str, key)).replace(" ", "_")))


def savers(single, dirs):
    """Who wrote the checkpoints the resumed runs load: single, FSDP2 at world 2, HSDP's two (world 4)."""
    return {"single": single, "fsdp torch 2": dirs["equal", "torch", 2],
            **{f"hsdp {impl}": dirs["hsdp", impl] for impl in HSDP_IMPL}}


@pytest.fixture(scope="module")
def runs(single, launch2, launch4):
    """Every run this file checks: each world size's in the session's launch of that many ranks."""
    dirs = {**launch2[__name__][0], **launch4[__name__][0]}
    return {**dirs, "savers": savers(single, dirs)}


LOADERS = {"single": (), "ddp": ("parallel=ddp",), "fsdp torch": ("parallel=fsdp", "parallel.impl=torch"),
           "hsdp scratch": HSDP, "hsdp torch": (*HSDP, "parallel.impl=torch")}
# (who wrote the checkpoint, who loads it): HSDP's ours and torch's, written at world 4, into every other kind of
# layout; single's (whole tensors) and FSDP2's at world 2 (DTensors, another world size) into HSDP
CHECKPOINTS = [("hsdp scratch", "ddp"), ("hsdp torch", "fsdp torch"), ("hsdp scratch", "single"),
               ("hsdp torch", "single"), ("single", "hsdp torch"), ("fsdp torch 2", "hsdp scratch")]


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


@needs_bf16
def test_bf16_params_fp32_reduce(single, runs):
    """Gathered parameters in bfloat16 (half the all-gather bytes), gradients summed over 4 micro-steps and reduced
    in float32: loss, grad_norm and val_loss track the float32 run over 6 steps within 5-7x the gaps measured
    (the working weights rounded to bf16 after every step: BF16_PARAMS_RTOL)."""
    start, records = steps(runs["bf16"])
    P, accum = start["n_params"], start["grad_accum"]
    assert accum == 4
    for r in records:
        # every micro-step gathers the bf16 weights for forward and again for backward; one fp32 reduce-scatter
        assert r["comm_bytes"] == pytest.approx(accum * 2 * (2 * P) + 4 * P, rel=0.02)
        assert r["state_bytes_max"] == pytest.approx(16 * P / 2, rel=0.05)  # shards stay float32
    assert_same_steps(runs["bf16"], single, rtol=BF16_PARAMS_RTOL)


@pytest.mark.parametrize("impl", ["scratch", "torch"])
def test_cpu_offload_same_losses(single, runs, impl):
    assert_same_steps(runs["offload", impl], single)
    assert_same_weights(runs["offload", impl], single)


def test_wrap_granularity(single, runs):
    """Both blocks in one unit (3 units: embedding, blocks, norm + head): the same numbers and weights."""
    assert_same_steps(runs["wrap"], single)
    assert_same_weights(runs["wrap"], single)


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


def peak_rank(cfg, run_dir):
    """One forked rank of the peak-memory runs. A forked process's peak RSS starts from what it holds at the fork
    (not from its parent's peak), and the run measures its peak above what it held before the model. A fixed mmap
    threshold (what MALLOC_MMAP_THRESHOLD_=65536 sets at a process's start): glibc then returns every freed large
    buffer to the OS at once, so the peak RSS follows the tensors alive (by default freed units would linger in the
    heap, counted as resident)."""
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1  # M_MMAP_THRESHOLD
    train.run(cfg, run_dir)


def test_peak_memory_a_third_of_ddp(tmp_path):
    """Peak process memory above what it held before the model (rank 0's peak RSS), FSDP vs DDP. At N=4, FSDP's
    model state is 16P/4 against DDP's 16P: with activations and gathered units, about a third. The ranks are forked
    from this process (torchrun's fresh interpreters cost CI 20 s more here)."""
    world, peaks = 4, {}
    # big enough that model state, not the interpreter's own heap, dominates the peak (43M parameters), and deep
    # enough that the few units in flight are a small part of the model. (A second size, 118M, gave the same ratio,
    # 2026-11; it cost CI 50 s. 76M measured 0.29 in 52 CPU-s, 43M 0.32 in 38: 2026-12-07.)
    for size in ({"model.n_layer": 24, "model.n_embd": 384},):
        shape = [f"{k}={v}" for k, v in size.items()] + ["model.n_head=4", "train.max_steps=1",
                                                         "checkpoint.keep=0", "train.eval_steps=1"]
        for strategy in ("ddp", "fsdp"):
            run_dir = str(tmp_path / f"{strategy}-{size['model.n_embd']}")
            cfg = make_cfg(*small_run("train.global_batch_size=4", "train.micro_batch_size=1", *shape,
                                      f"parallel={strategy}"))
            forked(world, lambda: peak_rank(cfg, run_dir))
            start, records = steps(run_dir)
            peaks[strategy, size["model.n_embd"]] = (records[-1]["peak_mem_mb"] - start["mem_mb_before_model"],
                                                    start["n_params"])
    for d in (384,):
        (ddp, P), (fsdp, _) = peaks["ddp", d], peaks["fsdp", d]
        print(f"n_embd {d}: {P / 1e6:.1f}M params, peak above baseline: ddp {ddp:.0f} MiB, fsdp {fsdp:.0f} MiB "
              f"({fsdp / ddp:.2f})")
        assert fsdp < 0.36 * ddp


@pytest.mark.quick
@pytest.mark.parametrize("overrides,message", [
    (["parallel.blocks_per_unit=3"], "can't split the model's 2 blocks into equal units"),
    (["parallel.prefetch=4"], "there are 4 units, so at most 3 can be gathered ahead"),
    (["parallel.param_dtype=float16"], "parallel.param_dtype='float16': expected auto, float32 or bfloat16"),
    (["train.activation_checkpointing=some"], "expected none, full, every_n or selective"),
    (["train.activation_checkpointing=full", "train.selective_matmuls=alternate"],
     "train.selective_matmuls=alternate chooses what selective checkpointing keeps, but "
     "train.activation_checkpointing=full"),
    (["train.selective_matmuls=half"], "train.selective_matmuls='half': expected all or alternate"),
])
def test_bad_fsdp_settings(tmp_path, overrides, message):
    with pytest.raises(train.ConfigError) as err:
        train.check_config(make_cfg(*small_run("parallel=fsdp", *overrides)), str(tmp_path / "run"), 2)
    assert message in str(err.value)


@pytest.mark.quick
def test_offload_with_a_dtype_the_cpu_cant(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "bf16_supported", lambda device: False)
    with pytest.raises(train.ConfigError, match="this CPU can't do"):
        train.check_config(make_cfg(*small_run("parallel=fsdp", "parallel.cpu_offload=true",
                                               "parallel.param_dtype=bfloat16")), str(tmp_path / "run"), 2)


@pytest.mark.parametrize("impl", ["scratch", "torch"])
def test_hsdp_equal_to_single_and_to_the_plan(single, runs, impl):
    """HSDP 2 x 2: per-step loss, grad_norm and final weights equal to single (rtol 1e-5); each rank holds 16P/2;
    within dp_shard the all-gathers of Psi and the reduce-scatter of Psi, across dp_replicate the all-reduce of
    Psi/2: each dimension's bytes the planner's within 2%."""
    run_dir = runs["hsdp", impl]
    assert_same_steps(run_dir, single)
    assert_same_weights(run_dir, single)
    start, records = steps(run_dir)
    assert (start["parallel"], start["dp_replicate"], start["dp_shard"]) == ("hsdp", 2, 2)
    # the dtype the run resolved `auto` to (the planner otherwise assumes a GPU's bf16)
    cfg = make_cfg(*small_run(*RUN, *HSDP, *HSDP_IMPL[impl]), f"train.dtype={start['dtype']}")
    predicted = plan.predict(cfg, Layout.from_config(cfg.parallel, 4))
    assert predicted["layout"].name == "hsdp" and predicted["accum"] == start["grad_accum"] == {"scratch": 2,
                                                                                             "torch": 1}[impl]
    assert predicted["state"] == pytest.approx(16 * start["n_params"] / 2, rel=1e-3)
    # (ours: and the gradient norm's one scalar over every rank, plan.clip_comm)
    assert set(predicted["comm"]) == {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
                                      ("dp_replicate", "all_reduce")} | ({("world", "all_reduce")} if impl == "scratch"
                                                                         else set())
    assert len(records) == STEPS
    for r in records:
        assert r["state_bytes_max"] == pytest.approx(predicted["state"], rel=0.02)
        for (dim, kind), v in predicted["comm"].items():
            assert r[f"comm_{dim}_{kind}"] == pytest.approx(v, rel=0.02), (dim, kind)
        # nothing else moves but the gradient norm's few bytes (ours: one scalar over the world; FSDP2's DTensor
        # norms over dp_shard)
        assert r["comm_bytes"] - sum(predicted["comm"].values()) < 200


@pytest.fixture(scope="module")
def further(tmp_path_factory, single):
    """The reference for the resumed runs: single, from its own step-STEPS checkpoint to RESUMED."""
    run_dir = str(tmp_path_factory.mktemp("further") / "run")
    train.run(make_cfg(*small_run(*RUN, *FURTHER, checkpoint_of(single))), run_dir)
    return run_dir


@pytest.mark.parametrize("saver,loader", CHECKPOINTS, ids=[f"{a}->{b}".replace(" ", "_") for a, b in CHECKPOINTS])
def test_hsdp_checkpoints(runs, further, tmp_path, saver, loader):
    """A checkpoint saved under HSDP (replicas of shards: ours flat ranges, FSDP2's Replicate x Shard DTensors)
    loads into ddp, FSDP2 and single, and single's and FSDP2's (world 2) load into HSDP: the step after it
    equal single's own from its own checkpoint (loss, grad_norm, final weights)."""
    if loader == "single":
        run_dir = str(tmp_path / "run")
        train.run(make_cfg(*small_run(*RUN, *FURTHER, checkpoint_of(runs["savers"][saver]))), run_dir)
    else:
        run_dir = runs["resume", saver, loader]
    assert read_metrics(run_dir)[1]["resumed_from"].endswith(f"step_{STEPS:07d}")
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [RESUMED]
    assert_same_steps(run_dir, further)
    assert_same_weights(run_dir, further)


@pytest.mark.quick
@pytest.mark.parametrize("overrides,message", [
    (["parallel=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=4"],
     "parallel.dp_replicate=2 x parallel.dp_shard=4 = 8, but the data-parallel size is dp=4"),
    (["parallel=fsdp", "parallel.dp_replicate=3"], "parallel.dp_replicate=3 must divide the data-parallel size (dp=4)"),
    (["parallel=zero2", "parallel.dp_replicate=2"], "replicates FSDP's shards (HSDP), but parallel.data=zero2"),
    (["parallel=ddp", "parallel.dp_shard=2", "parallel.dp_replicate=null"],
     "replicates FSDP's shards (HSDP), but parallel.data=ddp"),
    (["parallel=hsdp"], "how many a node has is unknown here"),
    (["parallel=hsdp", "parallel.dp_shard=0"], "parallel.dp_shard=0 must be at least 1"),
])
def test_bad_hsdp_settings(tmp_path, overrides, message):
    assert_refused(tmp_path, overrides, 4, message)
