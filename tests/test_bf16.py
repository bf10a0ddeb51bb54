"""bf16 autocast (train.dtype=bfloat16), every strategy, ours and torch's, at world 2: the run tracks float32 and its
twin's bf16 run, its working weights are bf16 where it keeps a working copy (parallel.param_dtype=auto), and its
model state and communication are what the planner predicts for that very config.

float32 reference: parallel=single's float32 run. Every strategy's own float32 run equals it to 1e-5 (loss,
grad_norm, weights: test_data_parallel.py, test_fsdp.py, test_tp.py), a tenth of the bf16 tolerances
here, so it stands for each strategy's own float32 run. Accumulation 4 (RUN: global 16, micro 2, 2 ranks; 8 under
tp, whose 2 ranks share one batch slice): the gradients of the micro-steps are summed, in float32 (reduce_dtype's default), whatever the working weights."""
import pytest
import torch

import train
from conftest import (BF16, RUN, STEPS, assert_same_steps, assert_same_weights, launch_jobs, losses, make_cfg,
                      needs_bf16, read_metrics, small_run)
from parallel.layout import Layout
from tools import plan

# only what computes in bf16 skips on a CPU without it (conftest.needs_bf16); the float32 fused-AdamW tests run
# everywhere
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp")
CASES = [(s, i) for s in STRATEGIES for i in ("scratch", "torch")]
# the torch run each one is held against: its own twin, except where the twin computes differently. Our ZeRO-1
# keeps bf16 working weights, torch's ZeroRedundancyOptimizer can't (it steps the model's own fp32 weights): ours is
# held against FSDP2's MixedPrecisionPolicy (zero2 torch: bf16 weights, fp32 gradients, fp32 master shards), and
# torch's against torch's DDP (fp32 weights under autocast, the same arithmetic).
TWIN = {("zero1", "scratch"): ("zero2", "torch"), ("zero1", "torch"): ("ddp", "torch")}
# Tolerances, relative, over the 6 steps, about 5x what was measured (2026-12-01, this CPU; in the comments):
# - against float32: bf16 rounds every matmul's inputs, and with bf16 working weights the residual stream too
#   (loss 3.4e-6 with fp32 weights, 1.9e-5 with bf16 ones; grad_norm 7.9e-4 and 1.2e-3)
TO_FP32 = {"loss": 1e-4, "grad_norm": 5e-3}
# - against the twin: the same arithmetic but for the order of sums (0 and 2.5e-7 seen)
TO_TWIN = {"loss": 1e-5, "grad_norm": 1e-5}
# - against parallel=single in bf16, for the strategies whose weights stay fp32 (ddp, torch's zero1): the same
#   arithmetic but for the order of sums, which is all for the first 3 steps (8e-8 seen). Then AdamW's g / sqrt(v)
#   turns those fp32 roundings into weight differences that flip bf16 roundings, and the gap grows step by step, by
#   how much depends on the CPU's bf16 kernels (2026-12-03, at step 6: loss 4.5e-6 and grad_norm 4.2e-5 with AMX,
#   1.0e-6 and 1.8e-5 with oneDNN held to AVX512-BF16 by ONEDNN_MAX_CPU_ISA)
TO_SINGLE_BF16 = {"loss": 5e-5, "grad_norm": 4e-4}
FIRST_STEPS, TO_SINGLE_BF16_FIRST = 3, {"loss": 1e-6, "grad_norm": 1e-6}
# - tensor parallel: each rank's row-parallel matmul rounds its partial sum to bf16 before the all-reduce adds them,
#   where one process rounds the whole sum once (ours vs torch's: loss 8.3e-6, grad_norm 8.5e-5)
TO_TWIN_TP = {"loss": 5e-5, "grad_norm": 5e-4}

def bf16_run(strategy, impl):
    return small_run(*RUN, f"parallel={strategy}", f"parallel.impl={impl}", "train.dtype=bfloat16",
                     "checkpoint.keep=0")


# fused AdamW (optim.fused; null: on a GPU): the optimizers the strategies build from the template keep it, float32.
# Our ZeRO's flat-buffer views, our FSDP's CPU-offloaded step, torch's FSDP2 and tensor parallel (DTensor parameters)
FUSED = [("zero1", "scratch", "parallel.impl=scratch"), ("fsdp", "scratch", "parallel.cpu_offload=true"),
         ("fsdp", "torch", "parallel.impl=torch"), ("tp", "torch", "parallel.impl=torch")]


def fused_run(strategy, impl, extra):
    return small_run(*RUN, f"parallel={strategy}", f"parallel.impl={impl}", extra, "optim.fused=true")


@launch_jobs(2)
def jobs(root, request):
    """All ten cases (where the CPU computes in bf16) and the fused ones, in the session's world-2 launch."""
    these = {c: (str(root / "-".join(c)), bf16_run(*c)) for c in CASES} if BF16 else {}
    these.update({("fused", *c): (str(root / ("fused-" + "-".join(c))), fused_run(*c)) for c in FUSED})
    return these


@pytest.fixture(scope="module")
def runs(launch2, tmp_path_factory):
    """Every case's run dir: all of them in the session's world-2 launch, and parallel=single in bf16 in this
    process."""
    root = tmp_path_factory.mktemp("bf16")
    dirs = dict(launch2[__name__][0])
    if BF16:
        dirs["single"] = str(root / "single")
        train.run(make_cfg(*small_run(*RUN, "train.dtype=bfloat16", "checkpoint.keep=0")), dirs["single"])
    dirs["fused-single"] = str(root / "fused-single")
    train.run(make_cfg(*small_run(*RUN, "optim.fused=true")), dirs["fused-single"])
    return dirs


def rel_diff(run_dir, ref_dir, key, steps=STEPS):
    """The largest relative difference in `key` over the first `steps` steps."""
    got, ref = losses(run_dir, key), losses(ref_dir, key)
    assert len(got) == len(ref) == STEPS, (key, len(got), len(ref))
    return ((got - ref).abs() / ref.abs())[:steps].max().item()


def assert_tracks(run_dir, ref_dir, tol, what, steps=STEPS):
    for key, rtol in tol.items():
        d = rel_diff(run_dir, ref_dir, key, steps)
        print(f"{what}: {key} max relative difference {d:.2e} (tolerance {rtol:g})")
        assert d <= rtol, f"{what}: {key} differs by {d:.2e} relative, over {rtol:g}"


@needs_bf16
@pytest.mark.parametrize("strategy,impl", CASES, ids=[f"{s}-{i}" for s, i in CASES])
def test_bf16_tracks_float32_and_its_twin(single, runs, strategy, impl):
    run_dir = runs[strategy, impl]
    start = read_metrics(run_dir)[0]
    working = Layout(**{k: start[k] for k in ("world", "data", "impl")}).working_dtype("auto", "bfloat16")
    assert (start["dtype"], start["param_dtype"], start["grad_accum"]) == ("bfloat16", working, 8 // start["dp"])
    assert_tracks(run_dir, single, TO_FP32, f"{strategy}/{impl} bf16 vs float32")
    if impl == "scratch" or (strategy, impl) in TWIN:
        twin = TWIN.get((strategy, impl), (strategy, "torch"))
        assert_tracks(run_dir, runs[twin], TO_TWIN_TP if strategy == "tp" else TO_TWIN, f"{strategy}/{impl} vs {'/'.join(twin)}, both bf16")
    if working == "float32" and strategy == "tp":
        assert_tracks(run_dir, runs["single"], TO_TWIN_TP, f"{strategy}/{impl} vs single, both bf16")
    elif working == "float32":
        what = f"{strategy}/{impl} vs single, both bf16"
        assert_tracks(run_dir, runs["single"], TO_SINGLE_BF16_FIRST, f"{what}, first {FIRST_STEPS} steps", FIRST_STEPS)
        assert_tracks(run_dir, runs["single"], TO_SINGLE_BF16, what)


# Where torch's twin does other than ours (and than the planner, which models ours), bytes per step or per rank for
# P parameters on N ranks with `accum` micro-steps, in this bf16 config (bf16 working weights, fp32 gradients):
TORCH_OWN = {
    # ZeroRedundancyOptimizer behind DDP: fp32 weights and gradients whole, moments by whole parameters (uneven);
    # DDP's fp32 all-reduce (8P) and then each rank broadcasts the parameters it updated (4P)
    ("zero1", "torch"): {"state": lambda P, N: 8 * P + 8 * P / N, "comm": lambda P, N, accum: 12 * P},
    # FSDP2 keeps even the fp32 parameters sharded between steps
    ("zero2", "torch"): {"state": lambda P, N: 16 * P / N},
    # FSDP2 leaves units gathered after a no_sync backward: one bf16 gather for the first forward, one per backward
    ("fsdp", "torch"): {"comm": lambda P, N, accum: (1 + accum) * 2 * P + 4 * P},
}


@needs_bf16
@pytest.mark.parametrize("strategy,impl", CASES, ids=[f"{s}-{i}" for s, i in CASES])
def test_bf16_state_and_comm_as_planned(runs, strategy, impl):
    """bf16 working weights: ZeRO-1 2 + 4 + 12/N bytes per parameter (Megatron's distributed optimizer: fp32
    gradients), ZeRO-2 2 + 16/N, FSDP 16/N with bf16 all-gathers; every other strategy keeps its float32 state.
    Tensor parallel's activations: row-parallel outputs in bf16, the residual stream's gradients in fp32. The
    planner's numbers for the run's own config (tools.plan.predict_run), measured; torch's own where it differs."""
    run_dir = runs[strategy, impl]
    start, *records = read_metrics(run_dir)
    P, N, accum = start["n_params"], start["dp"], start["grad_accum"]
    predicted = plan.predict_run(run_dir)
    own = TORCH_OWN.get((strategy, impl), {})
    state = own["state"](P, N) if "state" in own else predicted["state"]
    comm = own["comm"](P, N, accum) if "comm" in own else predicted["comm_total"]
    steps = [r for r in records if "comm_bytes" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert r["comm_bytes"] == pytest.approx(comm, rel=0.02)
        # torch's ZeroRedundancyOptimizer shards by whole parameters, unevenly
        assert r["state_bytes_max"] == pytest.approx(state, rel=0.15 if (strategy, impl) == ("zero1", "torch")
                                                     else 0.05)
    print(f"{strategy}/{impl} bf16: state {steps[-1]['state_bytes_max'] / P:.2f} bytes/param, "
          f"comm {steps[-1]['comm_bytes'] / P:.2f} bytes/param")


@needs_bf16
def test_bf16_working_weights_halve_the_all_gather(runs):
    """The bf16 working copy is what moves: ZeRO's and FSDP's all-gathers carry 2 bytes per parameter."""
    for strategy in ("zero1", "zero2", "fsdp"):
        start, *records = read_metrics(runs[strategy, "scratch"])
        r = [r for r in records if "comm_bytes" in r][-1]
        # FSDP gathers in forward and again in backward, every micro-step
        gathers = 2 * start["grad_accum"] if strategy == "fsdp" else 1
        assert r["comm_dp_all_gather"] == pytest.approx(gathers * 2 * start["n_params"], rel=0.02)


@pytest.mark.parametrize("case", FUSED, ids=[f"{s}-{i}-{e.split('.')[-1]}" for s, i, e in FUSED])
def test_fused_adamw_equal_to_single(runs, case):
    """Every strategy's optimizer is the fused one, and the run equals parallel=single's with the fused AdamW."""
    run_dir = runs["fused", *case]
    assert read_metrics(run_dir)[0]["fused"] and read_metrics(runs["fused-single"])[0]["fused"]
    assert_same_steps(run_dir, runs["fused-single"])
    assert_same_weights(run_dir, runs["fused-single"])


def test_fused_adamw_is_asked_for_where_the_config_says():
    model = torch.nn.Linear(4, 4)
    o = make_cfg("optim.fused=true").optim
    assert train.make_optimizer(model, o).defaults["fused"] is True
    default = make_cfg().optim  # null: fused on a GPU only; this one's weights are on the CPU
    assert not train.make_optimizer(model, default).defaults["fused"]


def autocast_weight_copies(param_dtype):
    """Bytes of the bf16 weight copies autograd keeps from one bf16-autocast forward of a small GPT whose weights
    are `param_dtype`: saved tensors of a parameter's shape (or its transpose) that are not the parameter itself,
    each storage counted once."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=384, block_size=32, n_layer=3, n_head=2, n_embd=48))
    model.init_weights()
    model.to(param_dtype)
    shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}  # linear saves W^T
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes and t.untyped_storage().data_ptr() not in own:
            copies[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t
    idx = torch.randint(0, 384, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx)
    loss.backward()
    return sum(copies.values()), model


@needs_bf16
def test_autocast_keeps_a_bf16_copy_of_fp32_weights_and_none_of_bf16_ones():
    """Why param_dtype=auto picks bf16 under bf16: with fp32 working weights, autocast's bf16 cast of every matmul
    weight lives until backward, 2 bytes per matmul parameter (the planner's "autocast copies"); with bf16 working
    weights the matmuls save the parameters themselves."""
    fp32, model = autocast_weight_copies(torch.float32)
    m = model.cfg
    shape = {"vocab": m.padded_vocab_size, "n_embd": m.n_embd, "n_layer": m.n_layer}
    assert fp32 == plan.autocast_copy_bytes(shape, model.num_params(), 1) > 0
    assert autocast_weight_copies(torch.bfloat16)[0] == 0


def test_precision_tool_bad_input(tmp_path):
    from tools import precision
    with pytest.raises(SystemExit, match="error: --world must be at least 2"):
        precision.main(["--world", "1", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []  # nothing written
