"""Mixture of experts (model.py's MoE) and expert parallelism (parallel/ep.py): the MoE block against a token-by-token
loop, capacity's drops against an independent count, the balancing loss against its formula (and its gradient
against autograd's of the loss added), the statistics not counted twice under activation checkpointing; ep over
DDP, ZeRO-1, ZeRO-2 and FSDP, an MoE under ZeRO and FSDP (ours and torch's) without ep and under pipeline
parallelism (with ep inside each stage, and interleaved), equal to parallel=single in
loss, grad_norm, val_loss, tokens per expert and final weights, their all-to-all bytes summed as theory has them and
the planner's state and traffic; the refusals, in one line."""
import math

import pytest
import torch
import torch.nn.functional as F

import model as M
from conftest import assert_refused, assert_same_steps, assert_same_weights, launch_jobs, make_cfg, needs_bf16, \
    read_metrics, small_run

CFG = dict(vocab_size=256, n_layer=2, n_head=2, n_embd=32, n_experts=4, top_k=2, mlp="swiglu", ffn_hidden=64,
           n_shared_experts=1)


def moe_block(**kw):
    torch.manual_seed(0)
    m = M.GPT(M.GPTConfig(**{**CFG, **kw}))
    m.init_weights()
    return m, m.blocks[1].mlp


def loop_reference(moe, h):
    """Each token on its own: softmax scores, top-k (chosen by score + bias), weights renormalized."""
    E, out = moe.experts, []
    for t in h:
        s = moe.router(t).float().softmax(-1)
        i = (s + moe.expert_bias).topk(moe.k).indices if moe.rule == "bias" else s.topk(moe.k).indices
        w = s[i] / s[i].sum()
        y = moe.shared(t) if moe.shared is not None else torch.zeros_like(t)
        for wi, e in zip(w, i):
            y = y + wi * ((F.silu(t @ E.gate[e]) * (t @ E.up[e])) @ E.down[e])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("kw", [{}, {"router": "bias"}, {"mlp": "gelu", "n_shared_experts": 0}])
def test_moe_equals_token_loop(kw):
    m, moe = moe_block(**kw)
    if kw.get("router") == "bias":
        moe.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.5, 0.2]))  # changes the choice, not the weights
    if kw.get("mlp") == "gelu":
        E = moe.experts
        ref = []
        h = torch.randn(7, 32)
        for t in h:
            s = moe.router(t).softmax(-1)
            v, i = s.topk(2)
            ref.append(sum(w / v.sum() * (F.gelu(t @ E.up[e]) @ E.down[e]) for w, e in zip(v, i)))
        torch.testing.assert_close(moe.eval()(h[None])[0], torch.stack(ref), rtol=1e-5, atol=1e-6)
        return
    h = torch.randn(7, 32)
    torch.testing.assert_close(moe.eval()(h[None])[0], loop_reference(moe, h), rtol=1e-5, atol=1e-6)


def test_capacity_drops_the_latest_tokens():
    m, moe = moe_block(capacity_factor=0.5)
    h = torch.randn(1, 20, 32)
    moe.train()
    moe.reset_stats()
    y = moe(h)[0]
    s = moe.router(h[0]).softmax(-1)
    top = s.topk(2).indices
    cap = math.ceil(0.5 * 20 * 2 / 4)
    seen, dropped, keep = [0] * 4, 0, []
    for t in range(20):  # token order: the earliest tokens take an expert's places first
        for e in top[t].tolist():
            keep.append(seen[e] < cap)
            dropped += seen[e] >= cap
            seen[e] += 1
    assert int(moe.dropped) == dropped > 0
    assert moe.load.tolist() == seen  # routed, dropped or not
    # a token with both choices dropped gets the shared expert's output alone
    both = [t for t in range(20) if not keep[2 * t] and not keep[2 * t + 1]]
    for t in both:
        torch.testing.assert_close(y[t], moe.shared(h[0, t]))


def test_aux_loss_is_the_switch_formula_and_its_gradient():
    m, moe = moe_block(aux_loss_coef=0.1)
    x = torch.randint(0, 256, (2, 16))
    m.set_aux_scale(0.5)
    (m(x, x) * 0.5).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    aux = [float(l.aux) for l in m.moe_layers()]
    # the reference: the loss plus 0.1 x the formula, computed apart, with no AuxLoss
    m.zero_grad()
    for l in m.moe_layers():
        l.coef = 0.0
    terms = []

    def hook(mod, args, out):
        h = args[0].reshape(-1, 32)
        s = mod.router(h).float().softmax(-1)
        f = torch.bincount(s.topk(2).indices.flatten(), minlength=4).float() / (h.size(0) * 2)
        terms.append(4 * (f * s.mean(0)).sum())
    for l in m.moe_layers():
        l.register_forward_hook(hook)
    loss = m(x, x)
    ((loss + 0.1 * sum(terms)) * 0.5).backward()
    assert aux == pytest.approx([t.detach().item() for t in terms], rel=1e-6)
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-8, msg=lambda s, n=n: f"{n}: {s}")


def test_statistics_once_under_activation_checkpointing():
    from parallel import apply_activation_checkpointing
    x = torch.randint(0, 256, (2, 16))
    counts = []
    for ac in ("none", "full"):
        m, _ = moe_block()
        apply_activation_checkpointing(m, ac)
        m(x, x).backward()
        counts.append([l.load.tolist() for l in m.moe_layers()])
    assert counts[0] == counts[1] and sum(counts[0][0]) == 2 * 16 * 2


def test_bias_moves_toward_the_mean():
    m, moe = moe_block(router="bias", bias_update_rate=0.01)
    moe.update_bias(torch.tensor([10.0, 2.0, 5.0, 3.0]))  # mean 5
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


def test_grouped_mm_equals_loop():
    x, w = torch.randn(10, 32), torch.randn(3, 32, 16)
    counts = torch.tensor([3, 0, 7])
    ref = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    torch.testing.assert_close(M.grouped_mm(x, w, counts), ref)
    torch.testing.assert_close(M.grouped_mm(x[:, :30], w[:, :30, :15].contiguous(), counts),
                               torch.cat([x[:3, :30] @ w[0, :30, :15], x[3:, :30] @ w[2, :30, :15]]))  # the loop
    # under autocast in its dtype, as a dense matmul runs (float32 inputs ran in float32 on the CPU, and as a loop
    # over every expert on a GPU)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, dense = M.grouped_mm(x, w, counts), x[:3] @ w[0]
    assert got.dtype == dense.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.cat([x[:3] @ w[0], x[3:] @ w[2]]).bfloat16(), rtol=2e-2, atol=5e-2)


MOE = ("model.n_experts=4", "model.top_k=2", "train.global_batch_size=8", "train.micro_batch_size=2",
       "train.max_steps=3", "train.eval_every=100", "checkpoint.keep=1")
CAPACITY = ("model.capacity_factor=0.75",)  # at most 48 of a micro-batch's 256 assignments an expert: 64+ dropped
PP_SHAPE = ("model.n_layer=4", "model.dense_layers=1", "model.router=bias")  # MoE blocks 1-3, not 0
# name: (world, overrides). Over ours DDP: ep=2 and ep=4 over all the ranks; ep=2 on 4 ranks: two ep groups, each
# expert held on two ranks (the replicate group its gradients are summed over); capacity: the drops under ep
EP = {"ep2": (2, ["parallel=ddp", "parallel.ep=2"]), "ep2_capacity": (2, ["parallel=ddp", "parallel.ep=2", *CAPACITY]),
      "ep4": (4, ["parallel=ddp", "parallel.ep=4"]), "ep2_dp4": (4, ["parallel=ddp", "parallel.ep=2"]),
      # over ours ZeRO: the dense parameters sharded, the experts whole on their ep ranks (parallel/zero.py exclude);
      # ZeRO-2 reduce-scattering every micro-step, and ep=2 on 4 ranks (the experts' replicas)
      "zero1_ep2": (2, ["parallel=zero1", "parallel.ep=2"]),
      "zero2_ep2_sharded": (2, ["parallel=zero2", "parallel.ep=2", "parallel.accumulate=sharded"]),
      "zero2_ep2_dp4": (4, ["parallel=zero2", "parallel.ep=2"]),
      # over ours FSDP: the experts sharded over what is left of dp x cp (ep=2 on 4 ranks: each expert's unit over
      # 2 ranks), or whole where ep takes every rank (nothing to gather)
      "fsdp_ep2": (2, ["parallel=fsdp", "parallel.ep=2"]), "fsdp_ep2_dp4": (4, ["parallel=fsdp", "parallel.ep=2"]),
      "fsdp_ep4": (4, ["parallel=fsdp", "parallel.ep=4"]),
      # no expert parallelism: every expert in the strategy's flat shards (a shard's cut through the stacked (E, d, f)
      # tensors is what its checkpoint writes: checkpoint.rects), ours and torch's
      "zero2": (2, ["parallel=zero2"]), "fsdp": (2, ["parallel=fsdp"]),
      "fsdp_torch": (2, ["parallel=fsdp", "parallel.impl=torch"]), "zero1_torch_dp4": (4, ["parallel=zero1",
                                                                                           "parallel.impl=torch"]),
      # under pipeline parallelism (each stage's MoE blocks, their router statistics gathered from every stage):
      # pp=2 alone (one MoE block a stage); pp=2 x dp=2 with ep=2 inside each stage (1F1B); interleaved 1F1B over 4
      # blocks, the first dense (rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3: its rows interleave in the
      # model's order) with router=bias (each block's bias moved by its own whole-batch counts), its own reference
      "pp2": (2, ["parallel=ddp", "parallel.pp=2"]),
      "pp2_ep2_dp4": (4, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.ep=2"]),
      "pp2_interleaved": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                              "parallel.pp_virtual=2", *PP_SHAPE]),
      # the other schedules, and ZeRO-2 and FSDP with ep inside each stage
      "pp2_gpipe": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe"]),
      "pp2_zero_bubble": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=zero_bubble"]),
      "zero2_pp2_ep2_dp4": (4, ["parallel=zero2", "parallel.pp=2", "parallel.ep=2"]),
      "fsdp_pp2_ep2_dp4": (4, ["parallel=fsdp", "parallel.pp=2", "parallel.ep=2"]),
      # beside context parallelism: the balancing loss's counts summed over the sequences' pieces (parallel/cp.py),
      # ring and all-gather, with ep from the dp x cp ranks
      "cp2": (2, ["parallel=ddp", "parallel.cp=2"]), "cp2_ep2": (2, ["parallel=ddp", "parallel.cp=2", "parallel.ep=2"]),
      "fsdp_cp2_allgather": (2, ["parallel=fsdp", "parallel.cp=2", "parallel.cp_method=allgather"]),
      "cp2_ep2_dp4": (4, ["parallel=ddp", "parallel.cp=2", "parallel.ep=2"]),
      # beside tensor parallelism (ours, no sequence parallel): the routers and routed experts whole on every tp
      # rank, the shared experts split; alone, under FSDP x TP, and with ep=2 over DDP and ZeRO-2 (tp x dp x ep)
      "tp2": (2, ["parallel=tp"]), "fsdp_tp2_dp4": (4, ["parallel=fsdp", "parallel.tp=2"]),
      "tp2_ep2_dp4": (4, ["parallel=ddp", "parallel.tp=2", "parallel.ep=2"]),
      "zero2_tp2_ep2_dp4": (4, ["parallel=zero2", "parallel.tp=2", "parallel.ep=2"]),
      # under bf16 autocast: the rows go out in float32 (the residual stream's), the experts' outputs come back in
      # bf16 (the grouped matmul runs in the autocast dtype): the planner's count, not single's numbers
      "ep2_bf16": (2, ["parallel=ddp", "parallel.ep=2", "train.dtype=bfloat16"])}
PROVEN = [n for n in EP if not n.endswith("bf16")]


def register(world):
    @launch_jobs(world)
    def jobs(root, request):
        return {name: (str(root / name), small_run(*MOE, *extra))
                for name, (w, extra) in EP.items() if w == world}
    return jobs


jobs2, jobs4 = register(2), register(4)


@pytest.fixture(scope="module")
def moe_single(tmp_path_factory):
    """The references, in this process: dropless, and with the capacity factor."""
    import train
    dirs = {}
    for key, extra in (("dropless", ()), ("capacity", CAPACITY), ("pp_shape", PP_SHAPE)):
        dirs[key] = str(tmp_path_factory.mktemp(f"moe_single_{key}") / "run")
        train.run(make_cfg(*small_run(*MOE, *extra)), dirs[key])
    return dirs


def a2a_theory(record, cp=1, tp=1, n_moe=2, E=4, k=2, d=64, tokens=8 * 64, micro_batches=8 // 2):
    """parallel/ep.py's sum over all ranks of the bytes they send by all-to-all in a step: each MoE block, each
    micro-batch, every rank sends its E int64 counts; each kept assignment's row of d float32s goes out and back in
    forward and both ways again in backward. `micro_batches`: over all ranks, global / micro batch, at any world;
    each on cp ranks, every one of which sends its counts; and every tp rank, which routes the same tokens, sends
    all of it again (parallel/tp.py: the routed experts run whole on each)."""
    micro_batches *= cp
    return tp * (n_moe * 8 * E * micro_batches + 4 * d * 4 * (n_moe * k * tokens - record["moe_dropped"]))


@pytest.mark.parametrize("name", [n for n in PROVEN if EP[n][0] == 2])
def test_moe_layouts_equal_single_2(launch2, moe_single, name):
    check_ep(launch2, moe_single, name)


@pytest.mark.parametrize("name", [n for n in PROVEN if EP[n][0] == 4])
def test_moe_layouts_equal_single_4(launch4, moe_single, name):
    check_ep(launch4, moe_single, name)


def check_ep(launch, moe_single, name):
    world, run = EP[name][0], launch[__name__][0][name]
    ref = moe_single["capacity" if name.endswith("capacity") else "pp_shape" if name == "pp2_interleaved" else
                     "dropless"]
    # grad_norm: single's is torch's clip_grad_norm_, whose float32 norm of a large tensor accumulates serially on
    # the CPU (1.6e-5 off float64 at 2M values, measured 2026-12-04); ep sums squares by pairwise sums
    assert_same_steps(run, ref, rtol={"loss": 1e-6, "grad_norm": 5e-5, "val_loss": 1e-6})
    # beside cp, attention's pieces are summed in another order, and AdamW's division by sqrt(v) grows that rounding
    # in an expert's rarely used weights: 1.25e-6 in one of 65,536 (cp2_ep2, an AVX2-only CPU, 2026-12-07)
    assert_same_weights(run, ref, atol=2e-6 if "cp" in name else 1e-6)
    got, want = ([r for r in read_metrics(d) if "moe_tokens_per_expert" in r] for d in (run, ref))
    assert len(got) == 3 and read_metrics(run)[0]["world_size"] == world
    for key in ("moe_tokens_per_expert", "moe_dropped"):  # the routing itself, token counts and drops: exact
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert all((r["moe_dropped"] > 0) == name.endswith("capacity") for r in got)
    # the balancing loss itself, over the whole batch (context parallelism's pieces summed: parallel/cp.py
    # batch_counts; each piece's own f puts it 7e-4 off, measured 2026-12-06, against 1.2e-7 summed)
    torch.testing.assert_close(torch.tensor([r["moe_aux_loss"] for r in got]),
                               torch.tensor([r["moe_aux_loss"] for r in want]), rtol=1e-6, atol=0)
    # every MoE block of the model on rank 0, a pipeline's other stages' too
    assert all(len(r["moe_tokens_per_expert"]) == (3 if name == "pp2_interleaved" else 2) for r in got)
    for r in got:
        if "ep" in name:
            theory = a2a_theory(r, read_metrics(run)[0]["cp"], read_metrics(run)[0]["tp"])
            assert r["a2a_bytes_all_ranks"] == theory, r["a2a_bytes_all_ranks"] - theory
        else:
            assert "a2a_bytes_all_ranks" not in r and "comm_ep_all_to_all" not in r
    if "torch" not in name:  # the planner's theory is ours: FSDP2 gathers less (3/4 of it here: it keeps the root
        check_planner(name, world, got)  # unit gathered from forward to backward), ZeroRedundancyOptimizer broadcasts


@needs_bf16
def test_ep_bf16_all_to_all_equals_planner(launch2):
    got = [r for r in read_metrics(launch2[__name__][0]["ep2_bf16"]) if "moe_tokens_per_expert" in r]
    assert len(got) == 3
    check_planner("ep2_bf16", 2, got, "bfloat16")


def check_planner(name, world, got, dtype="float32"):
    """tools/plan.py's expert-parallel theory against the run's rank 0: its model state (the dense parameters whole,
    1/ep of the experts), the dense all-reduce over dp (the router statistics' included), the experts' over
    ep_replicate and the norm's scalar over ep, each exact; the all-to-all it predicts for balanced routing is the
    mean over ranks, exact where nothing is dropped (the sum is exact whatever the routing), and with capacity it
    is over by the dropped rows' bytes; rank 0's own all-to-all is the one part of comm_bytes that depends on where
    its tokens went."""
    import config
    from parallel.layout import Layout
    from tools import plan
    cfg = make_cfg(*small_run(*MOE, *EP[name][1], f"train.dtype={dtype}"))
    layout = Layout.from_config(cfg.parallel, world)
    p = plan.predict(cfg, layout)
    a2a = p["comm"].get(("ep", "all_to_all"), 0)
    with torch.device("meta"):
        names = [n for n, _ in M.GPT(config.model_config(cfg, 512)).named_parameters()]
    if layout.pp > 1:  # rank 0 is the first stage's (parallel/pp.py split): the planner's first pp rank, its tensors
        from parallel.pp import split_blocks
        p, n = p["pp_ranks"][0], layout.pp * cfg.parallel.pp_virtual if cfg.parallel.pp_schedule == \
            "interleaved_1f1b" else layout.pp
        mine = {f"blocks.{i}." for k in range(0, n, layout.pp) for i in split_blocks(cfg.model.n_layer, n)[k]}
        names = [x for x in names if x.startswith("wte.") or any(x.startswith(b) for b in mine)]
        a2a = p["comm"].get(("ep", "all_to_all"), 0)  # each stage's dp ranks send their MoE blocks' rows (alike)
    tensors = len(names)
    for r in got:
        # AdamW's step counters, which the planner leaves out: one a tensor (a ZeRO or FSDP rank: one a segment it
        # owns, at most one a tensor)
        extra = r["state_bytes"] - p["state"]
        whole = layout.strategy in ("ddp", "none")
        assert extra == 4 * tensors if whole else 0 < extra <= 4 * tensors and extra % 4 == 0
        # exact but where a shard's padding or torch's DTensor norm (bytes the planner leaves out) add a little
        exact = whole or layout.ep > 1 and layout.impl == "scratch"
        for (dim, kind), v in p["comm"].items():
            if kind != "all_to_all":
                assert r[f"comm_{dim}_{kind}"] == (v if exact else pytest.approx(v, rel=1e-3)), (dim, kind)
        if layout.ep > 1:
            assert a2a * world - r["a2a_bytes_all_ranks"] == 4 * 64 * 4 * r["moe_dropped"]  # d = 64, float32
        assert r["comm_bytes"] == pytest.approx(p["comm_total"] - a2a + r.get("comm_ep_all_to_all", 0), rel=1e-3)


def test_refusals(tmp_path):
    assert_refused(tmp_path, ["model.top_k=4"], 1, "mixture-of-experts setting, but model.n_experts=0")
    assert_refused(tmp_path, ["model.n_experts=2", "model.top_k=3"], 1, "model.top_k=3 is more than")
    assert_refused(tmp_path, ["parallel=ddp", "parallel.ep=2"], 2, "but the model has none")
    assert_refused(tmp_path, ["model.n_experts=3", "parallel=ddp", "parallel.ep=2"], 2, "must divide model.n_experts")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=ddp", "parallel.ep=4"], 2, "must divide them")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=fsdp", "parallel.impl=torch", "parallel.ep=2"], 2,
                   "runs beside ours DDP, ZeRO-1, ZeRO-2 and FSDP")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=hsdp", "parallel.dp_shard=2", "parallel.ep=2"], 4,
                   "parallel.dp_replicate=2: expert parallelism runs beside ours")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=ddp", "parallel.impl=torch", "parallel.ep=2"], 2,
                   "runs beside ours DDP, ZeRO-1, ZeRO-2 and FSDP")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=zero2", "parallel.ep=2", "parallel.param_dtype=bfloat16"],
                   2, "the experts stay out of ZeRO's buckets, whole and in float32")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=tp", "parallel.sequence_parallel=true"], 2,
                   "parallel.sequence_parallel=true: not built yet")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=tp", "parallel.impl=torch"], 2,
                   "parallel.impl=torch: not built yet")
    assert_refused(tmp_path, ["model.n_experts=4", "model.capacity_factor=1.0", "parallel=cp"], 2,
                   "an expert's capacity keeps a micro-batch's earliest tokens")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=ddp", "parallel.pp=2", "parallel.impl=torch"], 2,
                   "divides the gradients by the micro-batches itself")
    assert_refused(tmp_path, ["model.n_experts=4", "parallel=zero2", "parallel.impl=deepspeed"], 2,
                   "DeepSpeed's MoE routes by its own gate")


def test_router_biases_resume_and_export(tmp_path):
    """router=bias: the per-expert biases (buffers training moves each step, no parameter) go into checkpoints. A run
    resumed at step 3 of 5 gives the uninterrupted run's losses, weights and biases to the bit (resumed at zero
    biases, its routing and losses differ); the exported file carries them to sample.py; a checkpoint without them
    is refused in one line."""
    import checkpoint
    import sample
    import train
    # odd steps: the biases move by +-0.05 a step, and an even number of moves can bring them back to 0
    base = small_run(*MOE, "model.router=bias", "model.bias_update_rate=0.05", "train.max_steps=5",
                     "checkpoint.every=3", "checkpoint.keep=2", "train.eval_every=100")
    ref, resumed = str(tmp_path / "ref"), str(tmp_path / "resumed")
    train.run(make_cfg(*base), ref)
    train.run(make_cfg(*base, f"train.resume={ref}/checkpoints/step_0000003"), resumed)
    losses = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}
    got, want = losses(resumed), losses(ref)
    assert sorted(got) == [4, 5] and all(got[s] == want[s] for s in got)
    assert_same_weights(resumed, ref, atol=0, rtol=0)
    final = lambda d: checkpoint.consolidate(f"{d}/checkpoints/step_0000005")[0]
    biases = {k: v for k, v in final(ref).items() if k.endswith("expert_bias")}
    assert len(biases) == 2 and all(v.abs().sum() > 0 for v in biases.values())  # moved
    assert all(torch.equal(final(resumed)[k], v) for k, v in biases.items())
    out = str(tmp_path / "model.safetensors")
    checkpoint.export(f"{ref}/checkpoints/step_0000005", out)
    model = sample.load(out)[0]
    for k, v in biases.items():
        assert torch.equal(model.get_submodule(k.rsplit(".", 1)[0]).expert_bias, v)
    train.run(make_cfg(*base, "model.router=aux", "train.max_steps=3"), str(tmp_path / "aux"))
    with pytest.raises(checkpoint.CheckpointError, match="has no router.*: saved by a run whose model.router was"):
        train.run(make_cfg(*base, f"train.resume={tmp_path}/aux/checkpoints/step_0000003"), str(tmp_path / "again"))


@pytest.mark.quick
@pytest.mark.parametrize("name,params,vocab", [("mixtral_8x7b", 46_702_792_704, 32000),
                                               ("deepseek_v3", 672_149_632_000, 129280)])
def test_presets_on_meta(name, params, vocab):
    """Mixtral's count is Hugging Face's MixtralForCausalLM's to the parameter; DeepSeek-V3's is ours at its shape
    (multi-head attention for its MLA, conf/model/deepseek_v3.yaml), its 58 x 257 experts of 3 x 7168 x 2048 inside."""
    import config
    cfg = make_cfg(f"model={name}")
    config.validate(cfg)
    with torch.device("meta"):
        model = M.GPT(config.model_config(cfg, 4096))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or ".shared." in n)
    assert model.cfg.padded_vocab_size == vocab and model.num_params() == params
    assert experts == {"mixtral_8x7b": 32 * 8, "deepseek_v3": 58 * 257}[name] * 3 * model.cfg.n_embd * \
        model.cfg.expert_hidden
