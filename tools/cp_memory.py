"""Activation memory per rank under context parallelism, measured: what autograd keeps for backward on each cp rank
of one forward of one long sequence, beside the planner's count (tools/plan.py activation_bytes).

    python -m tools.cp_memory                       # gpt_tiny's shape at seq_len 8192, cp = 1, 2, 4, both methods
    python -m tools.cp_memory --seq-len 4096 --cp 1 2

Each cp degree runs on that many local ranks (forked, gloo); each rank builds the model, applies parallel/cp.py over
a (1, cp, 1) mesh and counts the distinct storages autograd saves (parameters and buffers left out), then runs the
backward. The count is exact where a peak RSS would be noise.
"""
import argparse
import multiprocessing
import os
import queue
import socket

import torch
import torch.distributed as dist

TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 4096}  # conf/model/gpt_tiny.yaml, the default BPE


def saved_bytes(model, idx, targets):
    """(bytes autograd keeps for backward, the loss) of one forward of model(idx, targets)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    return sum(kept.values()), loss


def _rank(rank, cp, port, method, shape, seq_len, batch, out):
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from model import GPT, GPTConfig
    from parallel import cp as context_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=seq_len, **shape))
    model.init_weights()
    if cp > 1:
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))  # apply_cp takes only its group
        context_parallel.apply_cp(model, mesh, OmegaConf.create({"cp_method": method}))
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, shape["vocab_size"], (batch, seq_len), generator=g) for _ in range(2))
    n, loss = saved_bytes(model, idx, targets)
    loss.backward()  # the ring's backward runs too: the count is of a step that completes
    t = torch.tensor([n], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(int(t.item()))
    dist.destroy_process_group()


def measure(cp, method="ring", shape=TINY, seq_len=8192, batch=1):
    """The most bytes any of the cp ranks keeps for backward (cp = 1: plain one-process attention)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, cp, port, method, shape, seq_len, batch, out)) for r in range(cp)]
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
    assert all(p.exitcode == 0 for p in ranks), "a rank failed"
    return result


def main():
    from tools import plan
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = {**TINY, "vocab": 4096}
    print(f"gpt_tiny shape {TINY}, one sequence of {args.seq_len} tokens, float32; bytes autograd keeps per rank")
    print("| cp | method | measured MiB per rank | x cp=1 | planner MiB |")
    print("|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        for method in (["ring", "allgather"] if cp > 1 else ["-"]):
            n = measure(cp, method if cp > 1 else "ring", seq_len=args.seq_len)
            base = base or n
            predicted = plan.cp_activation_bytes(shape, 1, args.seq_len, 4, cp, method if cp > 1 else "ring")[0]
            print(f"| {cp} | {method} | {n / 2**20:.1f} | {n / base:.3f} | {predicted / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
