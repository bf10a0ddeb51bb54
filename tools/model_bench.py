"""Our model's training step against a plain GPT-2-style one at the same shape, side by side, each in a process.

    python -m tools.model_bench                      # 4L-128d and 6L-384d, eager and compiled
    python -m tools.model_bench --shapes 4x128 --modes eager --rounds 15

The reference (`PlainGPT` below) is written as the widely used minimal GPTs are (nanoGPT's shape of code): learned
position embeddings, LayerNorm, biases, one fused q/k/v matmul, a GELU MLP of 4d, the head tied to the embedding,
PyTorch's SDPA. Ours is model.py's GPT (RoPE, RMSNorm, no biases, untied head) at the same layers, width, heads,
vocab and context, and again with its head tied to the embedding as the reference's is (model.tie_embeddings: the
same parameter count, so the same optimizer work). One step is forward, backward and AdamW's update, in float32 on
one thread per process (torch.set_num_threads), as a CPU run of train.py computes. Each model trains in a process of
its own (its own heap, as a training run has). The models take turns step by step, in an order that rotates each
round, so that the steps of a round see the same moment of a noisy machine (this VM's speed drifts by several
percent over seconds: blocks of five steps per model spread the ratio over 0.92-1.08, 2026-12-06). A round's ratio
is the reference's step time over ours; the figure is their median over `--rounds` rounds, with a 95% interval for
that median that assumes nothing of the noise's shape (order statistics: the binomial distribution's tails). Not a
test: tests/test_model.py only checks that it runs.
"""
import argparse
import math
import multiprocessing
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPT, GPTConfig


class PlainBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    """The reference: a plain GPT-2."""

    def __init__(self, vocab, block_size, n_layer, n_head, d):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(PlainBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def stepper(model, compiled):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    fwd = torch.compile(model) if compiled else model

    def step(idx, targets):
        loss = fwd(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def median_interval(values, confidence=0.95):
    """(median, low, high): the median of `values` and an interval that holds the true median with at least
    `confidence`, whatever the distribution: the k-th lowest and k-th highest values, k the largest count whose
    binomial(n, 1/2) tail below it is at most (1 - confidence) / 2."""
    v, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while k < n // 2 and tail + math.comb(n, k) / 2 ** n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return statistics.median(v), v[max(k - 1, 0)], v[n - max(k, 1)]


def build(name, n_layer, d, batch, seq, vocab):
    """One of the three models (ours, ours tied, the reference), and the batch its steps train on."""
    torch.manual_seed(0)
    if name == "plain":
        model = PlainGPT(vocab, seq, n_layer, d // 64 if d >= 256 else 4, d)
    else:  # our default untied head, and tied as the reference's
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=d // 64 if d >= 256 else 4,
                              n_embd=d, tie_embeddings=name == "ours_tied"))
        model.init_weights()
    return model, torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def worker(conn, name, shape, compiled, warmup, threads):
    """One model in a process of its own (its own heap, as a training run has), stepping when the parent asks and
    answering with (seconds, system seconds, minor page faults) of that step."""
    torch.set_num_threads(threads)
    model, idx, targets = build(name, *shape)
    step = stepper(model, compiled)
    for _ in range(warmup):  # compile, and bring the heap to its steady state
        step(idx, targets)
    conn.send("ready")
    while conn.recv():
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step(idx, targets)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        conn.send((t1 - t0, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))


def bench(n_layer, d, mode, rounds, batch, seq, vocab, warmup, threads=1):
    """(our tokens/s, the reference's, the ratio's median with its 95% interval, the tied ratio's median) at one
    shape and mode."""
    names = ("ours", "ours_tied", "plain")
    ctx = multiprocessing.get_context("fork")  # forked before any model exists: nothing of another model's heap
    pipes, procs = {}, []
    for k in names:
        pipes[k], child = ctx.Pipe()
        procs.append(ctx.Process(target=worker, args=(child, k, (n_layer, d, batch, seq, vocab), mode == "compiled",
                                                     warmup, threads), daemon=True))
    for k, p in zip(names, procs):  # one at a time, so that the warm-ups and compiles do not share the cores
        p.start()
        if not pipes[k].poll(1800) or pipes[k].recv() != "ready":
            raise RuntimeError(f"the benchmark's {k} worker did not start (exit code {p.exitcode})")
    seconds, kernel = {k: [] for k in names}, {k: [0.0, 0] for k in names}
    for r in range(rounds):
        for k in names[r % 3:] + names[:r % 3]:  # one step at a time, each model first, second and third in turn
            pipes[k].send(True)
            t, sys_s, faults = pipes[k].recv()
            seconds[k].append(t)
            kernel[k][0] += sys_s
            kernel[k][1] += faults
    for k in names:
        pipes[k].send(False)
    for p in procs:
        p.join()
    print(f"{n_layer}L-{d}d {mode:8s}: per step, system time and minor page faults (a fresh large tensor's pages "
          f"fault on first touch): " + ", ".join(f"{k} {s / rounds * 1e3:.0f} ms, {f / rounds:,.0f}" for k, (s, f) in
                                                 kernel.items()), flush=True)
    ratio = {k: median_interval([p / o for p, o in zip(seconds["plain"], seconds[k])]) for k in ("ours", "ours_tied")}
    rate = {k: batch * seq / statistics.median(s) for k, s in seconds.items()}
    return rate["ours"], rate["plain"], ratio["ours"], ratio["ours_tied"][0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4x128,6x384", help="layers x width, comma-separated")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds: one step of each model in each")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    rows = []
    for shape in a.shapes.split(","):
        n_layer, d = map(int, shape.split("x"))
        for mode in a.modes.split(","):
            ours, plain, (ratio, lo, hi), tied = bench(n_layer, d, mode, a.rounds, a.batch, a.seq, a.vocab,
                                                       a.warmup, a.threads)
            rows.append((shape, mode, ours, plain, ratio, tied, lo, hi))
            print(f"{n_layer}L-{d}d {mode:8s}: ours {ours:9,.0f} tok/s, plain GPT-2 {plain:9,.0f} tok/s, "
                  f"ratio {ratio:.3f} (95% interval {lo:.3f} to {hi:.3f}), tied as the reference {tied:.3f} "
                  f"(medians of {a.rounds} rounds)", flush=True)
    return rows


if __name__ == "__main__":
    main()
