"""Activation memory per rank, measured: what autograd keeps for backward after one forward of one micro-batch, and
the most activation memory held at once through its forward and backward (the high-water mark: what is kept, plus
what backward allocates before it frees it), beside the planner's counts (tools/plan.py `activation_bytes`,
`backward_bytes`), for every activation checkpointing mode, dtype and context-parallel layout.

    python -m tools.act_memory                              # gpt_tiny's shape at 2k, 8k, 32k tokens: the full grid
    python -m tools.act_memory --seq 8192 --cp 1 2 --ac none selective --dtype float32

How. One process plays rank 0 of `cp` ranks under torch's fake process group (tools/dry_run.py) and, by default,
on fake tensors (torch's FakeTensorMode: shapes, dtypes and sizes, no memory and no arithmetic), so a 32k-token
sequence costs what a short one does; `--compute real` runs real tensors on real gloo ranks (forked) instead,
for the cross-check that both give the same bytes (tests/test_plan.py). Each rank builds the model
(model.py), applies train.activation_checkpointing (parallel.apply_activation_checkpointing) and context
parallelism (parallel/cp.py) as train.py does, and runs one forward and backward under ActivationPeak, which
follows every storage the ops write (torch's MemTracker files the same storages, but reads them at the peak of the
total, gradients included: for a small model late in backward, not at the activations' peak). Measured: the
activation bytes alive after forward (`kept`), and the most alive at once (`peak`). The rank's zig-zag chunks are the same size on every rank (parallel/cp.py),
so rank 0 stands for all.

dtypes: float32; bfloat16 (autocast over float32 weights, as parallel=single and DDP compute under
train.dtype=bfloat16: the residual stream stays float32); bfloat16-weights (the model's parameters in bfloat16,
as FSDP, ZeRO and cp compute under train.dtype=bfloat16 with parallel.param_dtype=auto).
"""
import argparse
import contextlib
import functools
import multiprocessing
import os
import queue
import socket
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 4096}  # conf/model/gpt_tiny.yaml, the default BPE
DTYPES = ("float32", "bfloat16", "bfloat16-weights")
LAYOUTS = ((1, "ring"), (2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather"))  # (cp, method); cp = 1: plain


def saved_bytes(model, idx, targets):
    """(bytes autograd keeps for backward, the loss) of one forward of model(idx, targets): distinct storages,
    parameters and buffers left out."""
    skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            kept[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    return sum(kept.values()), loss


class ActivationPeak(TorchDispatchMode):
    """Follows every storage an op writes while it is active, until it is freed (a weak reference to the storage),
    and the most bytes alive at once, but for the parameters' gradients: a gradient counts until autograd
    accumulates it into .grad, where it becomes model state (the planner's `gradients`). Parameters and buffers
    (and their views) are not followed; autocast's bf16 copies of the weights are (they are activations here, as in
    the planner). `now` after forward is what forward left for backward; `peak` the high-water mark."""

    def __init__(self, model):
        super().__init__()
        self.sizes, self.refs, self.now, self.peak = {}, {}, 0, 0
        # the parameters' and buffers' own storages, which their views (a weight's transpose) share
        self.state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._to_state)

    def _to_state(self, p):
        self._forget(p.grad.untyped_storage()._cdata)

    def _forget(self, key, _ref=None):
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.sizes and key not in self.state:
                    self.sizes[key] = st.nbytes()
                    self.refs[key] = weakref.ref(st, functools.partial(self._forget, key))
                    self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _one_rank(cp, method, shape, seq, batch, ac, dtype):
    """(kept, peak): activation bytes after forward and at the peak of forward + backward, on this rank."""
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    import parallel
    from model import GPT, GPTConfig
    from parallel import cp as context_parallel
    torch.manual_seed(0)
    # the mesh on real tensors (DeviceMesh reads its coordinates back, which a fake tensor can't answer)
    with _real():
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)) if cp > 1 else None
    model = GPT(GPTConfig(block_size=seq, **shape))
    model.init_weights()
    if dtype == "bfloat16-weights":  # the parameters alone, as FSDP's and ZeRO's bf16 working copies (buffers fp32)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    mode, _, matmuls = ac.partition("-")  # selective-alternate: train.selective_matmuls=alternate
    parallel.apply_activation_checkpointing(model, mode, 1, matmuls or "all")
    if cp > 1:
        context_parallel.apply_cp(model, mesh, OmegaConf.create({"cp_method": method}))
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, shape["vocab_size"], (batch, seq), generator=g) for _ in range(2))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype != "float32" else contextlib.nullcontext()
    with ActivationPeak(model) as tracker:
        with amp:
            loss = model(idx, targets)
        kept = tracker.now
        loss.backward()  # the ring's backward runs too: the count is of a step that completes
    return kept, tracker.peak


@contextlib.contextmanager
def _real():
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        yield


def measure(cp=1, method="ring", shape=TINY, seq=8192, batch=1, ac="none", dtype="float32", compute="fake"):
    """(kept, peak) activation bytes of the most loaded cp rank (cp = 1: one process, plain attention)."""
    if compute == "real":
        return _forked(cp, method, shape, seq, batch, ac, dtype)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tools.dry_run import fake_process_group
    group = fake_process_group(0, cp) if cp > 1 else contextlib.nullcontext()
    with group, warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return _one_rank(cp, method, shape, seq, batch, ac, dtype)


def _rank(rank, cp, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    t = torch.tensor(_one_rank(cp, *args), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(tuple(int(x) for x in t.tolist()))
    dist.destroy_process_group()


def _forked(cp, *args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, cp, port, args, out)) for r in range(cp)]
    for p in ranks:
        p.start()
    result = None
    while result is None:  # a rank that dies puts nothing: fail then, not after a long timeout
        try:
            result = out.get(timeout=2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in ranks):
                for p in ranks:
                    p.kill()
                raise RuntimeError("a cp rank failed: its traceback is in the captured stderr")
    for p in ranks:
        p.join()
    return result


def planned(cp=1, method="ring", shape=TINY, seq=8192, batch=1, ac="none", dtype="float32"):
    """The planner's (kept, peak) for the same run: activations (kept + one block's recompute) and the backward's
    buffers, plus, under autocast over float32 weights, the bf16 copies of the weights autograd keeps."""
    from tools import plan
    from model import CPU_CHUNK_BYTES, GPT, GPTConfig
    with torch.device("meta"):
        n_params = GPT(GPTConfig(block_size=seq, **shape)).num_params()
    s = {"n_layer": shape["n_layer"], "n_embd": shape["n_embd"], "n_head": shape["n_head"],
         "vocab": shape["vocab_size"], "n_params": n_params}
    ab = 4 if dtype == "float32" else 2
    rb = 2 if dtype == "bfloat16-weights" else 4
    mode, _, matmuls = ac.partition("-")
    checkpointed = plan.checkpointed_fraction(mode, s["n_layer"])
    kept, recompute = plan.cp_activation_bytes(s, batch, seq, ab, cp, method, checkpointed=checkpointed,
                                               residual_bytes=rb, selective=mode == "selective",
                                               alternate=matmuls == "alternate")
    copies = cached = 0
    if dtype == "bfloat16":
        P = plan.params_per_rank(s, 1)
        copies = plan.autocast_copy_bytes(s, P, 1, checkpointed)
        cached = plan.autocast_copy_bytes(s, P, 1) - copies
    back = plan.backward_bytes(s, batch, seq, ab, cp, method, residual_bytes=rb, recompute=recompute, cached=cached,
                               loss_chunk=CPU_CHUNK_BYTES)  # measured on the CPU, its chunk
    return kept + copies, kept + recompute + copies + back


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ac", nargs="+", default=["none", "selective", "full"],
                    help="none, selective, selective-alternate (train.selective_matmuls=alternate), full")
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--compute", default="fake", choices=["fake", "real"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"gpt_tiny's shape {TINY}, one sequence; activation MiB per rank ({args.compute} tensors)")
    print("| tokens | dtype | checkpointing | cp | method | kept | planner | peak | planner | peak / planner |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0
    for seq in args.seq:
        for dtype in args.dtype:
            for ac in args.ac:
                for cp, method in (x for x in LAYOUTS if x[0] in args.cp):
                    kept, peak = measure(cp, method, seq=seq, ac=ac, dtype=dtype, compute=args.compute)
                    p_kept, p_peak = planned(cp, method, seq=seq, ac=ac, dtype=dtype)
                    worst = max(worst, abs(peak / p_peak - 1))
                    print(f"| {seq} | {dtype} | {ac} | {cp} | {method if cp > 1 else '-'} | {kept / 2**20:.1f} "
                          f"| {p_kept / 2**20:.1f} | {peak / 2**20:.1f} | {p_peak / 2**20:.1f} "
                          f"| {peak / p_peak:.3f} |", flush=True)
    print(f"largest gap between the measured peak and the planner's: {worst:.1%}")


if __name__ == "__main__":
    main()
