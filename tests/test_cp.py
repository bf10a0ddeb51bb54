"""Context parallelism (parallel/cp.py): ring and all-gather attention equal to single-process training alone and
composed with data and tensor parallel, the ring's attention against plain causal attention, the zig-zag split's
balance, and communication counted hop by hop against the formulas."""
import pytest
import torch
import torch.distributed as dist

from conftest import RUN, assert_same_steps, assert_same_weights, forked, job_output, launch_jobs, make_cfg, \
    read_metrics, small_run
from parallel import cp
from tools import plan

L, D = 2, 64  # small_run's model: layers, width
# (case id, world, overrides), in the session's world-4 launch. cp=2 runs both methods beside dp (cp2-ddp2: ring;
# cp2-fsdp2-allgather), cp=4 both alone (a world-2 launch of cp=2 alone cost CI 34 s and added no path these don't
# take)
CASES = [
    ("cp4-ring", 4, ["parallel=cp"]),
    ("cp4-allgather", 4, ["parallel=cp", "parallel.cp_method=allgather"]),
    ("cp2-ddp2", 4, ["parallel=ddp", "parallel.cp=2"]),
    # also a checkpoint at step 3, which RESUME reads under another layout
    ("cp2-fsdp2-allgather", 4, ["parallel=fsdp", "parallel.cp=2", "parallel.cp_method=allgather",
                                "checkpoint.every=3"]),
    ("cp2-tp2", 4, ["parallel=cp", "parallel.cp=2", "parallel.tp=2", "train.sample_tokens=8"]),  # and samples
]
IDS = [c[0] for c in CASES]
# FSDP over dp 2 x cp 2's step-3 checkpoint, resumed by the ring at cp 4 with DDP (the world-4 launch's last job)
RESUME = ["parallel=cp", "train.resume=RUN/checkpoints/step_0000003"]


@launch_jobs(4)
def jobs(root, request):
    """Every case and the resumed run, in the session's world-4 launch."""
    these = {case: (str(root / case), small_run(*RUN, *o)) for case, _, o in CASES}
    resume = [o.replace("RUN", these["cp2-fsdp2-allgather"][0]) for o in RESUME]
    return {**these, "resume": (str(root / "resume"), small_run(*RUN, *resume))}


@pytest.fixture(scope="module")
def runs(launch4):
    """{case id: run dir}, and what cp2-tp2 printed."""
    dirs, launch = launch4[__name__]
    return {**dirs, "sample": job_output(launch, dirs["cp2-tp2"])}  # sampling runs whole sequences, plain attention


def kv_bytes(run):
    """Bytes of one rank's K and V for one micro-batch at one layer: 2 x micro-batch x (T / cp) x (d / tp) x 4 (its
    own tokens, its own heads)."""
    t = 64 // run["cp"]  # small_run's seq_len
    return 2 * 2 * t * (D // run["tp"]) * 4  # RUN's micro-batches of 2 sequences, float32


@pytest.mark.parametrize("case", IDS)
def test_equal_to_single(runs, single, case):
    run_dir = runs[case]
    assert_same_steps(run_dir, single)
    assert_same_weights(run_dir, single)
    world, overrides = CASES[IDS.index(case)][1:]
    first, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    cp_size = 2 if "cp2" in case else 4
    assert (first["cp"], first["dp"] * first["cp"] * first["tp"]) == (cp_size, world)
    if first["dp"] == 1:  # the cp ranks of one dp group evaluate the very batches one process does
        assert last["val_loss"] == pytest.approx(read_metrics(single)[-1]["val_loss"], rel=1e-5)
    if case == "cp2-tp2":
        assert "--- sample ---" in runs["sample"]
    # communication per step on the cp dimension, every micro-step, every layer (parallel/cp.py's docstring)
    micro = first["grad_accum"]
    kv, hops = kv_bytes(first), cp_size - 1
    if "allgather" in case:
        expected = {"comm_cp_all_gather": micro * L * cp_size * kv, "comm_cp_reduce_scatter": micro * L * cp_size * kv}
    else:  # each hop is a send and a receive of kv: forward K, V; backward K, V and dK, dV
        expected = {"comm_cp_p2p": micro * L * 2 * hops * (kv + 2 * kv)}
    got = {k: v for k, v in last.items() if k.startswith("comm_cp_")}
    assert got == expected, (got, expected)
    # and the planner's every collective by dimension, from the run's own config, within 2%
    predicted = plan.predict_run(run_dir)["comm"]
    assert predicted, "the planner predicts no communication"
    for (dim, kind), v in predicted.items():
        assert last[f"comm_{dim}_{kind}"] == pytest.approx(v, rel=0.02), (dim, kind)
    # the gradients are reduced over dp x cp, as over dp alone: DDP's one all-reduce, 2 Psi
    if first["parallel"] == "cp":
        assert last["comm_dp_cp_all_reduce"] == 2 * first["param_bytes"]


# --- the ring's attention against plain causal attention, forward and backward, on forked ranks
def _ring_worker(method, T=32, heads=(3, 3), dtype=torch.float32):
    """`heads`: query and key/value heads (grouped-query attention where they differ); float64 takes the blocks'
    written-out math instead of the fused CPU kernel."""
    from model import causal_attention
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, T, 8, dtype=dtype, requires_grad=True) for h in (heads[0], heads[1], heads[1]))
    y = causal_attention(q, k, v)
    dy = torch.randn_like(y)
    y.backward(dy)
    pos = cp.zigzag_positions(T, n, r)
    ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    yl = (cp.RingAttention if method == "ring" else cp.AllGatherAttention).apply(ql, kl, vl, None)
    yl.backward(dy[:, :, pos])
    for got, ref in ((yl, y), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)):
        torch.testing.assert_close(got, ref[:, :, pos], rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_attention_equals_causal(method, world):
    forked(world, lambda: _ring_worker(method))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_gqa_attention_equals_causal(method, dtype):
    """4 query heads on 2 key/value heads: the blocks read each key/value head for its query heads, and its
    gradient sums theirs."""
    forked(2, lambda: _ring_worker(method, heads=(4, 2), dtype=dtype))


@pytest.mark.quick
# --- balance: (query, key) pairs per rank
@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balance(n, T=1024):
    zigzag = [cp.causal_pairs(cp.zigzag_positions(T, n, r)) for r in range(n)]
    plain = [cp.causal_pairs(cp.plain_positions(T, n, r)) for r in range(n)]
    assert sum(zigzag) == sum(plain) == T * (T + 1) // 2  # every causal pair computed once, by some rank
    print(f"\ncp={n}: zig-zag pairs per rank {zigzag} (max/min {max(zigzag) / min(zigzag):.3f}); "
          f"plain split {plain} (max/min {max(plain) / min(plain):.2f})")
    assert max(zigzag) <= 1.1 * min(zigzag)
    assert max(plain) > 2 * min(plain)  # the imbalance zig-zag removes: the last rank's queries see the most keys
    # what the ring actually computes per rank is the same: its blocks (cp.block) hold exactly those pairs
    chunk = T // (2 * n)
    for r in range(n):
        pos = cp.zigzag_positions(T, n, r)
        computed = 0
        for s in range(n):
            src = (r - s) % n
            qs, ks, causal = cp.block(r, src, chunk)
            qp, kp = pos[qs], cp.zigzag_positions(T, n, src)[ks]
            seen = qp[:, None] >= kp[None, :]
            assert seen.all() or causal  # an unmasked block holds only pairs the causal mask keeps
            computed += int(seen.sum())
            if causal:
                assert torch.equal(seen, torch.ones_like(seen).tril())
        assert computed == zigzag[r]


@pytest.mark.quick
# --- bad input: one line, before any work
@pytest.mark.parametrize("overrides,world,message", [
    (["parallel=cp", "train.seq_len=60"], 4, "splits each sequence into 2 x cp = 8 equal chunks"),
    (["parallel=cp", "parallel.cp=3"], 4, "parallel.cp=3 x parallel.tp=1 = 3 must divide the number of ranks (4)"),
    (["parallel=cp", "parallel.cp_method=striped"], 2, "parallel.cp_method='striped': expected ring or allgather"),
    (["parallel=cp", "parallel.data=none"], 2, "needs a data-parallel strategy"),
    (["parallel=cp", "train.compile=true"], 2, "train.compile=true with parallel.cp > 1"),
    (["parallel=cp", "parallel.impl=torch"], 2, "torch's context_parallel is GPU-only"),
    (["parallel=cp", "parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.n_head=4",
      "train.seq_len=12", "model.block_size=12"], 8, "splits each cp rank's 6 tokens over the 4 tp ranks"),
])
def test_bad_input(overrides, world, message):
    import config
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.check(make_cfg(*small_run(*overrides)), world)


# --- the torch twin: torch.distributed.tensor.experimental.context_parallel, on this CPU
def _torch_cp_worker():
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu.default does not "
                                                  "have a sharding strategy registered"):
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dist.destroy_process_group()


def test_torch_twin_is_gpu_only():
    """What Layout.problem says of parallel.impl=torch: torch's context parallel shards only the CUDA attention
    kernels, and on a CPU fails with this error. (Where a torch release makes it run here, this goes red: wire it.)"""
    forked(2, _torch_cp_worker)


def test_checkpoint_loads_across_cp_layouts(runs, single):
    """Steps 4-6 resumed under cp=4 (ring, DDP) from FSDP over dp 2 x cp 2's step 3 are single's steps 4-6."""
    got = [r for r in read_metrics(runs["resume"]) if "loss" in r]
    ref = [r for r in read_metrics(single) if "loss" in r and r["step"] > 3]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [4, 5, 6]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in ref]),
                                   rtol=1e-5, atol=0)
    assert_same_weights(runs["resume"], single)


# --- the GPU's fused blocks: their calls checked on fake CUDA tensors here, their numbers on a GPU where there is one
def _blocks_on(device, dtype, heads=4, kv_heads=2, tq=96, tk=64, causal=False):
    torch.manual_seed(0)
    mk = lambda h, t: torch.randn(2, h, t, 32, device=device, dtype=dtype)
    q, k, v = mk(heads, tq), mk(kv_heads, tk if not causal else tq), mk(kv_heads, tk if not causal else tq)
    out, lse = cp.attention_block(q, k, v, causal)
    dout = mk(heads, tq)
    grads = cp.attention_block_backward(q, k, v, out.to(dtype), dout, lse, causal)
    return (q, k, v), (out, lse), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_blocks_call_the_fused_kernels(dtype):
    """On fake CUDA tensors (no GPU needed: shapes, dtypes and the ops called), each block runs the GPU's fused
    kernel (flash in bf16, memory-efficient in float32), never forms a (Tq, Tk) tensor, and returns float32 out,
    lse (Tq, unpadded) and gradients shaped like q and the key/value heads (grouped-query attention summed back)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names, self.shapes = set(), set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.names.add(func.__name__.split(".")[0])
            self.shapes |= {tuple(t.shape[-2:]) for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.dim() >= 2}
            return out
    for causal in (False, True):
        with FakeTensorMode(), Ops() as ops:
            (q, k, v), (out, lse), grads = _blocks_on("cuda", dtype, causal=causal)
        kernel = "_scaled_dot_product_efficient_attention" if dtype == torch.float32 \
            else "_scaled_dot_product_flash_attention"
        assert {kernel, kernel + "_backward"} <= ops.names
        assert (q.size(2), k.size(2)) not in ops.shapes  # no scores
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        assert out.dtype == lse.dtype == torch.float32
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the GPU's fused kernels against the math")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_blocks_equal_the_written_out_math(dtype, monkeypatch):
    for causal in (False, True):
        _, (out, lse), grads = _blocks_on("cuda", dtype, causal=causal)
        monkeypatch.setattr(cp, "fused", lambda q: False)
        _, (out_w, lse_w), grads_w = _blocks_on("cuda", dtype, causal=causal)
        monkeypatch.undo()
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        for a, b in zip((out, lse, *grads), (out_w, lse_w, *grads_w)):
            torch.testing.assert_close(a, b, **tol)
