"""Measure the constants a step-time model needs from the device at hand, in one short run: the matmul rate over a
grid of shapes (square, and the (tokens, width, width) and (tokens, 4 width, width) products of a transformer
block), per dtype; memory bandwidth (a copy, and an add that reads two and writes one); and fused attention forward
and backward (torch's scaled_dot_product_attention, causal) over sequence lengths. Writes device_bench.json and
device_bench.md into --out.

    python -m tools.device_bench --out results/h200           # a CUDA GPU: about 40 s
    python -m tools.device_bench --device cpu --out /tmp/db   # this machine's CPU: about 30 s, a smaller grid

Why: the planner's step time is FLOPs at one efficiency of a datasheet peak. A matmul's real rate depends on its
shape (tile and wave quantization on a GPU, cache blocking on a CPU), and the small, skinny products of small models
run far below peak. These rows are what a shape-aware cost is checked against; on a CPU they are the only peak there
is (no datasheet says what 2 shared cores reach).

Timing: each case runs once to warm up (kernel selection, allocation), then back to back for at least --min-time
seconds (and 3 runs), synchronized before and after; its rate is work over the mean time. Rates are TFLOP/s for
matmuls and attention (attention's FLOPs: 4 B H T^2 D forward, halved by the causal mask, backward 2.5x the
forward, as flash attention's papers count them) and GB/s for memory (bytes read plus written).
"""
import argparse
import json
import os
import sys
import time

# (M, N, K): M rows (tokens), an (M, K) @ (K, N) product
SQUARES = [256, 512, 1024, 2048, 4096, 8192]
WIDTHS = [256, 768, 1024, 2048, 4096, 8192]
TOKENS = [512, 2048, 8192, 32768]
CPU_SQUARES, CPU_WIDTHS, CPU_TOKENS = [128, 256, 512, 1024], [128, 256, 512, 1024], [256, 1024, 4096]
# attention: (batch, heads, head_dim) at each sequence length
ATTENTION = {"cuda": ((1, 32, 128), [1024, 4096, 16384, 32768]), "cpu": ((1, 4, 64), [256, 1024, 4096])}
BANDWIDTH_BYTES = {"cuda": 2 ** 30, "cpu": 2 ** 27}


def shapes(device):
    squares, widths, tokens = (SQUARES, WIDTHS, TOKENS) if device == "cuda" else \
        (CPU_SQUARES, CPU_WIDTHS, CPU_TOKENS)
    out = [("square", n, n, n) for n in squares]
    for m in tokens:
        for d in widths:
            out += [("d x d", m, d, d), ("4d x d", m, 4 * d, d), ("d x 4d", m, d, 4 * d)]
    return out


def timed(fn, sync, min_time):
    """Mean seconds of fn() after one warm-up run, over at least 3 runs and min_time seconds."""
    fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < min_time:
        fn()
        n += 1
        if n % 4 == 0 or n < 3:
            sync()
    sync()
    return (time.perf_counter() - t0) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new (or empty) folder for device_bench.json and .md")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds each case runs for at least (default 0.05 on a GPU, 0.2 on a CPU)")
    a = ap.parse_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    import torch
    import torch.nn.functional as F
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device; --device cpu measures this machine's CPU")
    min_time = a.min_time if a.min_time is not None else (0.05 if a.device == "cuda" else 0.2)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    os.makedirs(a.out, exist_ok=True)
    result = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "matmul": [],
              "bandwidth": [], "attention": []}

    def save():
        with open(os.path.join(a.out, "device_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "device_bench.md"), "w") as f:
            f.write(markdown(result))

    dtypes = [torch.bfloat16, torch.float32]
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 rows are float32, not TF32
    for dtype in dtypes:
        for kind, m, n, k in shapes(a.device):
            x = torch.randn(m, k, device=a.device, dtype=dtype)
            w = torch.randn(k, n, device=a.device, dtype=dtype)
            s = timed(lambda: x @ w, sync, min_time)
            result["matmul"].append({"dtype": str(dtype).split(".")[1], "kind": kind, "M": m, "N": n, "K": k,
                                     "seconds": s, "tflops": 2 * m * n * k / s / 1e12})
            del x, w
        print(f"matmul {dtype}: {len(shapes(a.device))} shapes, best "
              f"{max(r['tflops'] for r in result['matmul'] if r['dtype'] == str(dtype).split('.')[1]):.1f} "
              f"TFLOP/s", flush=True)
        save()
    nbytes = BANDWIDTH_BYTES[a.device]
    x = torch.empty(nbytes // 4, device=a.device, dtype=torch.float32).normal_()
    y, z = torch.empty_like(x).normal_(), torch.empty_like(x)
    for op, fn, moved in (("copy", lambda: z.copy_(x), 2 * nbytes), ("add", lambda: torch.add(x, y, out=z),
                                                                      3 * nbytes)):
        s = timed(fn, sync, min_time)
        result["bandwidth"].append({"op": op, "bytes": moved, "seconds": s, "gbps": moved / s / 1e9})
    del x, y, z
    print("bandwidth: " + ", ".join(f"{r['op']} {r['gbps']:.0f} GB/s" for r in result["bandwidth"]), flush=True)
    save()
    (b, h, d), lengths = ATTENTION[a.device]
    for t in lengths:
        q, k, v = (torch.randn(b, h, t, d, device=a.device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fwd = 4 * b * h * t * t * d / 2  # causal: half the scores
        s_f = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sync, min_time)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.randn_like(out)
        s_fb = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                 (q, k, v), g), sync, min_time)
        result["attention"].append({"dtype": "bfloat16", "B": b, "H": h, "T": t, "D": d, "forward_s": s_f,
                                    "forward_tflops": fwd / s_f / 1e12, "fwd_bwd_s": s_fb,
                                    "fwd_bwd_tflops": 3.5 * fwd / s_fb / 1e12})
        del q, k, v, out, g
        if a.device == "cuda":
            torch.cuda.empty_cache()
    print("attention: " + ", ".join(f"T={r['T']} {r['fwd_bwd_tflops']:.0f}" for r in result["attention"])
          + " TFLOP/s forward+backward", flush=True)
    save()
    print(markdown(result))
    return result


def markdown(r):
    lines = [f"# {r['device']}, torch {r['torch']}, {r['date']}", ""]
    if r["matmul"]:
        lines += ["| dtype | kind | M | N | K | TFLOP/s |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {m['dtype']} | {m['kind']} | {m['M']} | {m['N']} | {m['K']} | {m['tflops']:.3g} |"
                  for m in r["matmul"]]
    if r["bandwidth"]:
        lines += ["", "| memory | GB moved | GB/s |", "|---|---:|---:|"]
        lines += [f"| {b['op']} | {b['bytes'] / 1e9:.2f} | {b['gbps']:.0f} |" for b in r["bandwidth"]]
    if r["attention"]:
        lines += ["", "| attention (bf16, causal) | B x H x D | T | forward TFLOP/s | forward+backward TFLOP/s |",
                  "|---|---|---:|---:|---:|"]
        lines += [f"| sdpa | {a['B']} x {a['H']} x {a['D']} | {a['T']} | {a['forward_tflops']:.3g} | "
                  f"{a['fwd_bwd_tflops']:.3g} |" for a in r["attention"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
