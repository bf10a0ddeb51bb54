"""Our model's training step against a plain GPT-2-style one at the same shape, side by side in one process.

    python -m tools.model_bench                      # 4L-128d and 6L-384d, eager and compiled
    python -m tools.model_bench --shapes 4x128 --modes eager --reps 3

The reference (`PlainGPT` below) is written as the widely used minimal GPTs are (nanoGPT's shape of code): learned
position embeddings, LayerNorm, biases, one fused q/k/v matmul, a GELU MLP of 4d, the head tied to the embedding,
PyTorch's SDPA. Ours is model.py's GPT (RoPE, RMSNorm, no biases, untied head) at the same layers, width, heads,
vocab and context, and again with its head tied to the embedding as the reference's is (model.tie_embeddings: the
same parameter count, so the same optimizer work). One step is forward, backward and AdamW's update, in float32 on one thread per process
(torch.set_num_threads), as a CPU run of train.py computes. The two models alternate, `--steps` timed steps each
per repetition, so that a noisy machine slows both alike; the figure is the median over repetitions of ours' tokens/s
over the reference's. Not a test: tests/test_model.py only checks that it runs.
"""
import argparse
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


def bench(n_layer, d, mode, reps, steps, batch, seq, vocab, warmup):
    """(our tokens/s, the reference's, their ratio, the ratio tied: medians over reps; the untied ratio's lowest and
    highest) at one shape and mode."""
    torch.manual_seed(0)
    models = {}
    for name, tie in (("ours", False), ("ours_tied", True)):  # our default untied head, and tied as the reference
        models[name] = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer,
                                     n_head=d // 64 if d >= 256 else 4, n_embd=d, tie_embeddings=tie))
        models[name].init_weights()
    models["plain"] = PlainGPT(vocab, seq, n_layer, models["ours"].cfg.n_head, d)
    idx, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    steps_of = {k: stepper(m, mode == "compiled") for k, m in models.items()}
    for step in steps_of.values():  # compile and warm the allocator before any timing
        for _ in range(warmup):
            step(idx, targets)
    rates = {k: [] for k in steps_of}
    kernel = {k: [0.0, 0] for k in steps_of}  # system seconds and minor page faults, summed over the timed steps
    for _ in range(reps):
        for k, step in steps_of.items():  # interleaved: both see the same moments of a noisy machine
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(steps):
                step(idx, targets)
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            rates[k].append(steps * batch * seq / (t1 - t0))
            kernel[k][0] += r1.ru_stime - r0.ru_stime
            kernel[k][1] += r1.ru_minflt - r0.ru_minflt
    n = reps * steps
    print(f"{n_layer}L-{d}d {mode:8s}: per step, system time and minor page faults (a fresh large tensor's pages "
          f"fault on first touch): " + ", ".join(f"{k} {s / n * 1e3:.0f} ms, {f / n:,.0f}" for k, (s, f) in
                                                 kernel.items()), flush=True)
    ratios = {k: sorted(a / b for a, b in zip(rates[k], rates["plain"])) for k in ("ours", "ours_tied")}
    ratio = {k: statistics.median(r) for k, r in ratios.items()}
    spread = (ratios["ours"][0], ratios["ours"][-1])  # the repetitions' lowest and highest: how noisy the run was
    return (statistics.median(rates["ours"]), statistics.median(rates["plain"]), ratio["ours"], ratio["ours_tied"],
            spread)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4x128,6x384", help="layers x width, comma-separated")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model per repetition")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for shape in a.shapes.split(","):
        n_layer, d = map(int, shape.split("x"))
        for mode in a.modes.split(","):
            ours, plain, ratio, tied, (lo, hi) = bench(n_layer, d, mode, a.reps, a.steps, a.batch, a.seq, a.vocab,
                                                       a.warmup)
            rows.append((shape, mode, ours, plain, ratio, tied))
            print(f"{n_layer}L-{d}d {mode:8s}: ours {ours:9,.0f} tok/s, plain GPT-2 {plain:9,.0f} tok/s, "
                  f"ratio {ratio:.3f} (repetitions {lo:.3f} to {hi:.3f}), tied as the reference {tied:.3f} "
                  f"(medians of {a.reps})", flush=True)
    return rows


if __name__ == "__main__":
    main()
