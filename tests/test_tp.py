"""Tensor parallelism and 2D FSDP x TP: equal to single-process training, Megatron's communication counted
collective by collective, logits never materialized whole, bad settings refused up front."""
import gc

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import train
from conftest import RUN, assert_refused, assert_same_steps, assert_same_weights, forked, job_output, launch_jobs, \
    make_cfg, read_metrics, small_run
from parallel import tp as tensor_parallel
from parallel.strategy import materialize

# 4 heads (the other tests' model has 2), so that tp=4 splits whole heads; 4 steps of micro-batches of 4 (accumulation
# 4 at tp=4, 2 beside dp=2): every micro-step is ~12 collectives per block pair, each ~6 ms on 4 ranks sharing 2
# cores (measured, 2026-12-02), so fewer and larger micro-steps keep the launch short
TP_RUN = (*(o for o in RUN if not o.startswith(("train.micro_batch_size", "train.max_steps"))), "model.n_head=4",
          "train.micro_batch_size=4", "train.max_steps=4")


@pytest.fixture(scope="session")
def single_tp(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single_tp") / "run")
    train.run(make_cfg(*small_run(*TP_RUN)), run_dir)
    return run_dir


def local_params(n_layer, d, vocab, tp):
    """Parameters one tp rank holds: every matrix split tp ways, the 2L + 1 norm gains whole."""
    return (2 * vocab * d + 12 * n_layer * d * d) // tp + (2 * n_layer + 1) * d


# A covering set: tp=4 alone, tp=2 alone (world 2) and dp2 x tp2 (world 4), with and without sequence parallel, each
# impl on every layout; and ZeRO over dp beside tensor parallel, which the mesh composes like any other data strategy
CASES = [("tp", "scratch", 4, False), ("tp", "scratch", 2, True), ("fsdp_tp", "scratch", 2, False),
         ("fsdp_tp", "scratch", 2, True), ("tp", "torch", 2, True), ("tp", "torch", 2, False),
         ("fsdp_tp", "torch", 2, False), ("fsdp_tp", "torch", 2, True), ("zero1", "scratch", 2, False),
         ("zero2", "scratch", 2, True), ("zero2", "torch", 2, False)]
IDS = [f"{s}-{i}-tp{t}{'-sp' if sp else ''}" for s, i, t, sp in CASES]
# torch's tp alone with sequence parallel runs on 2 ranks (tp=2, no dp): DTensor's many small ops and collectives
# cost 3x more at world 4, where 4 ranks share 2 cores (38 s against 13 s, 2026-12-02); the rest on 4
WORLD = {case: 2 if case == "tp-torch-tp2-sp" else 4 for case in IDS}
# model state bytes per local parameter (fp32 weight and gradient, two Adam moments), by how dp shares them
STATE = {"tp": lambda dp: 16, "fsdp_tp": lambda dp: 16 / dp, "zero1": lambda dp: 8 + 8 / dp,
         "zero2": lambda dp: 4 + 12 / dp}


def jobs(root, world):
    these = {}
    for case, (strategy, impl, tp, sp) in zip(IDS, CASES):
        if WORLD[case] != world:
            continue
        sample = impl == "torch" or strategy == "tp"  # sampling needs the full logits gathered back
        these[case] = (str(root / case), small_run(*TP_RUN, f"parallel={strategy}", f"parallel.impl={impl}",
                                                   f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                                                   *(["train.sample_tokens=8"] if sample else [])))
    return these


@launch_jobs(2)
def jobs2(root, request):
    """The world-2 cases, in the session's world-2 launch."""
    return jobs(root, 2)


@launch_jobs(4)
def jobs4(root, request):
    """The world-4 cases, in the session's world-4 launch."""
    return jobs(root, 4)


@pytest.fixture(scope="module")
def runs(launch2, launch4):
    """{case id: (run dir, the launch that ran it)}."""
    return {case: (d, launch) for dirs, launch in (launch2[__name__], launch4[__name__]) for case, d in dirs.items()}


@pytest.mark.parametrize("strategy,impl,tp,sp", CASES, ids=IDS)
def test_equal_to_single(runs, single_tp, strategy, impl, tp, sp):
    case = IDS[CASES.index((strategy, impl, tp, sp))]
    (run_dir, launch), world = runs[case], WORLD[case]
    # the gradient norm over the whole mesh, replicated norm gains counted once, is one process's norm
    assert_same_steps(run_dir, single_tp)
    # tensor parallel sums every input gradient over ranks, in another order than one process does; Adam's
    # normalization magnifies that rounding where gradients are tiny (3e-6 seen in one element). The weights move
    # up to 3e-3 in 6 steps: 1e-5 is 0.3% of that
    assert_same_weights(run_dir, single_tp, atol=1e-5)
    start, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    assert (start["dp"], start["tp"]) == (world // tp, tp)
    if tp == 4:  # one dp group evaluates the same batches as one process (more dp ranks evaluate more of them)
        assert last["val_loss"] == pytest.approx(read_metrics(single_tp)[-1]["val_loss"], rel=1e-5)
    # model state per rank: bytes per local parameter as dp shares them (plus Adam's step counters and the
    # strategies' padding: < 0.1%). torch's vocab-parallel embedding leaves its gradient shard as a view into a
    # full-vocabulary buffer (measured: V x d x 4 bytes more where nothing copies the gradients out, i.e. without
    # FSDP or replicate() over dp)
    per_param = STATE[strategy](world // tp)  # the preset: every ZeRO case runs beside tp=2
    if impl == "torch" and strategy == "zero2":
        per_param = 16 / (world // tp)  # torch's ZeRO-2 is FSDP2 keeping units gathered through backward
    expected = per_param * local_params(2, 64, 512, tp)
    slack = expected * 0.001 + (512 * 64 * 4 if impl == "torch" else 0)
    print(f"\n{strategy}/{impl} tp={tp} sp={sp}: state {last['state_bytes']:,} B/rank = "
          f"{last['state_bytes'] / local_params(2, 64, 512, tp):.3f} x P_local; "
          f"single {read_metrics(single_tp)[-1]['state_bytes']:,}")
    assert expected <= last["state_bytes"] <= expected + slack
    if impl == "torch" or strategy == "tp":
        assert "--- sample ---" in job_output(launch, run_dir)


# --- in-process workers (forked ranks on gloo): one forward and backward, collective by collective
B, T, L, D, H, V = 4, 32, 2, 32, 4, 1024  # a vocab large enough that the logits are the largest tensor


def _tiny_gpt():
    from model import GPT, GPTConfig
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D))


def _sharded(impl, sp, mesh):
    torch.manual_seed(0)
    model = _tiny_gpt()
    p = OmegaConf.create({"sequence_parallel": sp})
    if impl == "scratch":
        materialize(model, tensor_parallel.apply_tp(model, mesh, p).init_param, "cpu")
        return model, tensor_parallel.TensorParallel()
    return model, tensor_parallel.apply_torch_tp(model, mesh, p, "cpu")


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any operator's output has had (a DTensor counts its local shard)."""
    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _tp_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from parallel.comm import CommCounter
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(1)
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    torch.manual_seed(0)
    reference = _tiny_gpt()
    reference.to_empty(device="cpu")
    reference.init_weights()
    with LargestTensor() as single_size:
        reference(idx, targets).backward()
    act = B * T * D * 4  # bytes of one (batch, seq, d) float32 activation
    for impl in ("scratch", "torch"):
        for sp in (False, True):
            model, par_tp = _sharded(impl, sp, mesh)
            with par_tp.loss_context(), CommCounter() as fwd:
                loss = model(idx, targets)
            with par_tp.loss_context(), CommCounter() as bwd:
                loss.backward()
            torch.testing.assert_close(loss, reference(idx, targets), rtol=1e-5, atol=1e-6)
            # Megatron: per layer 2 all-reduces of an activation in forward (after proj and down) and 2 in
            # backward (the inputs of attention and MLP); the embedding adds one in forward, the head's input
            # one in backward; the loss reduces per-token numbers only (max; sum of exps and target logit).
            # Sequence parallel: each all-reduce -> all-gather + reduce-scatter, the same bytes in all.
            if not sp:
                want_fwd = {"all_reduce": 2 * L + 1 + 2}
                want_bwd = {"all_reduce": 2 * L + 1}
            else:
                want_fwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1, "all_reduce": 2}
                want_bwd = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
            layer_bytes = (2 * L + 1) * 2 * act  # each all-reduce of an activation counts 2x its bytes
            loss_bytes = 2 * (B * T * 4) + 2 * (2 * B * T * 4)
            if impl == "torch":  # torch's loss_parallel reduces the sum of exps and the target logit apart
                want_fwd["all_reduce"] += 1
            assert dict(fwd.calls) == want_fwd and dict(bwd.calls) == want_bwd, (sp, fwd.calls, bwd.calls)
            assert fwd.bytes == layer_bytes + loss_bytes and bwd.bytes == layer_bytes, (fwd.log, bwd.log)
            if rank == 0:
                print(f"\n{impl} sp={sp} tp={world}: forward {dict(fwd.calls)} {fwd.bytes:,} B, backward "
                      f"{dict(bwd.calls)} {bwd.bytes:,} B")
            # gradients: this rank's slice of the reference's
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
                d = tensor_parallel.shard_dim(name)
                ref = reference.get_parameter(name).grad
                if impl == "scratch" and d is not None:
                    ref = ref.chunk(world, dim=d)[rank]
                if impl == "scratch" and sp and d is None:  # norm gains: partial until summed over tp
                    tensor_parallel.sync_replicated_grads([g], mesh.get_group())
                torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            reference.zero_grad()
            reference(idx, targets).backward()  # the reference's gradients again, for the next model
            # sampling: called without targets, the model gives the full-vocab logits, at any length (7: not
            # divisible by tp, which sequence parallel pads)
            with torch.no_grad():
                for n in (T, 7):
                    torch.testing.assert_close(model(idx[:, :n]), reference(idx[:, :n]), rtol=1e-5, atol=1e-6)
    # the vocab-parallel loss never builds the full (B*T, V) logits: the largest tensor of a tp rank's forward
    # and backward is its (B*T, V/tp) slice
    model, _ = _sharded("scratch", False, mesh)
    with LargestTensor() as tp_size:
        model(idx, targets).backward()
    if rank == 0:
        print(f"largest tensor: single {single_size.numel:,} elements, tp={world} {tp_size.numel:,}")
    assert single_size.numel == B * T * V and tp_size.numel == B * T * V // world, (single_size.numel,
                                                                                     tp_size.numel)
    # free what holds the mesh's groups while every peer is still connected (gloo can abort in its destructor
    # when a peer has gone: train.py does the same)
    del model, reference
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_collectives_gradients_and_logits(world):
    forked(world, _tp_worker)


@pytest.mark.quick
@pytest.mark.parametrize("overrides,world,message", [
    (["parallel=tp", "parallel.tp=4"], 4, "parallel.tp=4 must divide the model's 2 attention heads (model.n_head)"),
    (["parallel=tp", "model.n_head=4", "parallel.tp=3"], 4, "parallel.tp=3 must divide the number of ranks (4)"),
    (["parallel=tp", "model.n_head=3", "model.n_embd=48"], 3,
     "parallel.tp=3 must divide the model's 512 padded vocabulary entries"),  # padded to a multiple of 128
    (["parallel=fsdp_tp"], 1, "parallel=fsdp_tp needs several processes, but this is one"),
    (["parallel=tp", "parallel.sequence_parallel=true", "train.seq_len=63"], 2,
     "train.seq_len=63 is not divisible by 2"),
    (["parallel=fsdp_tp", "parallel.tp=2", "model.n_layer=2", "parallel.blocks_per_unit=3"], 4,
     "parallel.blocks_per_unit=3 can't split the model's 2 blocks"),
])
def test_bad_tp_settings(tmp_path, overrides, world, message):
    assert_refused(tmp_path, overrides, world, message)
