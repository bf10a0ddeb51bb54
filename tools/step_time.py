"""The time of a training step from the operations it runs, on a device (tools/plan.py's step_time builds on it).

Each rank's micro-step is a list of operations over its share of the tokens and the weights (ops): the matmuls by
their (M, N, K), attention by its FLOPs and sequence, and the memory-bound element-wise work (norms, RoPE, the
MLP's activation, residual adds, copies, the loss) by its elements. Backward is each matmul's two (the input's
gradient, M x K from an N-wide product; the weight's, N x K summed over M), attention's backward kernel, and each
element-wise op's backward. The optimizer step reads and writes every parameter the rank owns.

A device prices them (Device):
- a GPU from its datasheet (tools/plan.py GPUS) and two measured efficiencies. A matmul runs in output tiles of
  128 x 128 spread over the SMs in waves: a product whose tiles leave the last wave part empty runs that much
  below the rate (wave quantization, what makes small and skinny products slow), at most MATMUL_EFFICIENCY of the
  peak, each tile's pass over K costing TILE more of K (its prologue and epilogue), and never faster than its bytes
  over the memory's bandwidth; each kernel costs KERNEL_S besides. On the H200 (docs/h200/device_bench.json,
  2026-12-04) this puts 49 of the 51 bf16 products that run longer than 30 us within 15% of measured (43 without
  the tile's depth: products 1024 deep ran at 0.77-0.84 of the price; tests/test_step_time.py). Attention runs at
  ATTENTION_EFFICIENCY of the peak (flash attention forward and backward at 16k-32k tokens on the H200: 0.55-0.57),
  element-wise work at MEMORY_EFFICIENCY of the memory's bandwidth (a copy on the H200: 0.88), moving eager's
  bytes (ELEMENTWISE) or, compiled, a fused kernel's (FUSED). The project's own compiled training steps on the H200
  come within 0.84-0.93 of this (test_h200_compiled_runs).
- a CPU from a short microbenchmark of the machine at hand (cpu_profile, cached): matmul rates over a grid of
  shapes, read by the nearest measured shapes; attention forward and backward over sequence lengths and head
  sizes; model.py's own norm, RoPE, activations, loss and AdamW's step per element; the time of one small op
  (what eager PyTorch spends dispatching each); and gloo's collectives between processes of this machine. On a
  CPU the ranks share its cores (a rank's compute takes ranks / cores as long where there are more ranks than
  cores), and gloo's collectives run on the same cores: nothing overlaps.

Eager PyTorch spends host time on every op it dispatches (HOST_OPS per op, HOST_OP_S each on a GPU, measured on a
CPU). A GPU runs ahead of its host: an op takes the longer of its kernel and its dispatch. On a CPU both are the
same core's time: they add.
"""
import fcntl
import json
import math
import os
import platform
import time

MATMUL_EFFICIENCY = 0.72      # bf16 4096-8192 cubes on the H200: 698-711 of 989 TFLOP/s
ATTENTION_EFFICIENCY = 0.57   # flash attention forward + backward, causal, 32 heads of 128, 16k tokens, H200
MEMORY_EFFICIENCY = 0.85      # a 2 GiB copy on the H200: 4.2 of 4.8 TB/s (0.88)
TILE = 128                    # a matmul's output tile, rows and columns
KERNEL_S = 4e-6               # a kernel's start and tail, fitted to the H200's products of 30 us to 1 ms
HOST_OP_S = 10e-6             # eager PyTorch's host time per op on a GPU machine (dispatch, autograd)
# SMs (compute units on the MI300X) per GPU, from the vendors' datasheets
SMS = {"h100": 132, "h100_pcie": 114, "h200": 132, "a100": 108, "a100_40gb": 108, "b200": 148, "mi300x": 304,
       "l40s": 142}

# Bytes each element-wise kind moves per element, forward and backward, with a the compute dtype's bytes and r the
# residual stream's (model.py): RMSNormFn reads x, writes its output, and in float32 forms x / rms; backward
# reads the gradient and x and writes three float32 temporaries and dx. Rope writes x cos, then adds two halves in
# place. The MLP's activation reads and writes its wide tensor (SwiGLU: silu(gate) x up, two inputs). A residual
# add reads two and writes one; its backward passes the gradient on. The loss (model.CrossEntropy) per logit: a
# float32 copy of each chunk, a log-sum-exp of two passes; backward rewrites the logits through four float32 passes
# (model.LinearCrossEntropy, the model's own since 2026-12-06, makes the same passes over each chunk, all in
# forward; the profile still times CrossEntropy's: not re-measured).
# A cast (autocast's copy of a float32 weight): reads 4, writes 2.
ELEMENTWISE = {"norm": (lambda a, r: (r + a + 8, a + 2 * r + 24)),
               "rope": (lambda a, r: (4 * a, 4 * a)),
               "copy": (lambda a, r: (2 * a, 2 * a)),
               "residual": (lambda a, r: (3 * r, 0)),
               "gelu": (lambda a, r: (2 * a, 3 * a)),
               "swiglu": (lambda a, r: (5 * a, 8 * a)),
               "router": (lambda a, r: (a + 12, 16)),
               "loss": (lambda a, r: (a + 16, 2 * a + 32)),
               "cast": (lambda a, r: (6, 0)),
               "add": (lambda a, r: (12, 0)),        # a float32 gradient added into another (accumulation)
               "adamw": (lambda a, r: (36, 0))}      # per parameter: reads p, g, m, v, writes p, m, v; the clip
# The same under torch.compile, whose kernels each read their inputs and write their outputs once (the float32
# temporaries of eager's separate ops stay in registers): a norm reads x and writes its output, its backward reads
# the gradient and x and writes dx; RoPE reads and writes once each way; SwiGLU reads gate and up and writes their
# product, its backward writes both gradients; the loss reads each logit twice (the log-sum-exp's looped reduction:
# max, then the sum of exps) and, for its gradient, once more, writing the gradient. Checked against the H200's
# compiled runs (docs/h200/gpu_bench_compiled.json; tests/test_step_time.py test_h200_compiled_runs): priced with
# eager's bytes, gpt_125m's loss at 65,536 tokens x 50,304 logits came to 44 of a 168 ms step measured at 132.
# The rest as eager: a copy, a residual add and GELU already move only their inputs and outputs.
FUSED = {**ELEMENTWISE,
         "norm": (lambda a, r: (r + a, a + 2 * r)),
         "rope": (lambda a, r: (2 * a, 2 * a)),
         "swiglu": (lambda a, r: (3 * a, 5 * a)),
         "loss": (lambda a, r: (2 * a, 2 * a))}
# aten ops eager PyTorch dispatches for each, forward and backward (counted on model.py's modules: a linear's
# matmul and its views; the norm's seven forward and twelve backward ops; a loss chunk's)
HOST_OPS = {"matmul": (2, 3), "attention": (3, 2), "attention_unfused": (4, 6), "norm": (7, 12), "rope": (5, 4),
            "copy": (1, 1), "residual": (1, 1), "gelu": (1, 1), "swiglu": (2, 4), "router": (6, 4), "loss": (3, 6), "cast": (1, 0),
            "add": (1, 0), "adamw": (0, 0)}


# --- what a step runs
def block_ops(shape, tokens, seq, tp=1, moe=False, ep=1, autocast=False, sp=False, unfused=False):
    """One block's forward on one rank over `tokens` tokens (micro-batch x seq / cp), each sequence `seq` long: a
    list of ("matmul", M, N, K), ("attention", FLOPs, seq, head_dim, queries' heads) and ("elementwise", kind,
    elements). Tensor parallelism splits the heads and the MLP's width over tp (parallel/tp.py); an MoE block's
    router and routed experts run whole on every tp rank, its experts' rows balanced (each rank of ep processes
    k x its tokens, over E / ep experts). `autocast`: float32 weights cast to bf16 for every matmul. `sp`: sequence
    parallel, whose norms and residual adds each see 1/tp of the tokens (Korthikanti et al. 2022: what it saves
    besides memory). `unfused`: attention as Megatron-LM ran it before FlashAttention (plan.attention=unfused;
    GPU.unfused_attention_s)."""
    d, M = shape["n_embd"], tokens
    rows = M * d // tp if sp else M * d  # the residual stream's elements on this rank
    hd = d // shape["n_head"]
    heads, kv = shape["n_head"] // tp, shape.get("kv_embd", d) // tp
    ops = [("elementwise", "norm", rows),
           ("matmul", M, heads * hd + 2 * kv, d),
           ("elementwise", "rope", M * (heads * hd + kv)),
           ("elementwise", "copy", M * kv),
           # causal: each query meets seq / 2 keys on average, QK^T and PV at 2 FLOPs each per head_dim
           ("attention_unfused" if unfused else "attention", 4 * M * (seq / 2) * heads * hd, seq, hd, heads),
           ("elementwise", "copy", M * heads * hd),
           ("matmul", M, d, heads * hd),
           ("elementwise", "residual", rows),
           ("elementwise", "norm", rows)]
    if moe:
        E, k = shape["n_experts"], shape["top_k"]
        ops += [("matmul", M, E, d), ("elementwise", "router", M * E), ("elementwise", "copy", 2 * M * k * d)]
        ops += mlp_ops(shape, M * k * ep // E, shape["expert_hidden"], repeat=E // ep)
        if shape.get("shared_hidden"):
            ops += mlp_ops(shape, M, shape["shared_hidden"] // tp)
    else:
        ops += mlp_ops(shape, M, shape.get("hidden", 4 * d) // tp)
    ops.append(("elementwise", "residual", rows))
    if autocast:
        ops += [("elementwise", "cast", o[2] * o[3]) for o in ops if o[0] == "matmul"]
    return ops


def mlp_ops(shape, M, f, repeat=1):
    d = shape["n_embd"]
    if shape.get("mlp", "gelu") == "swiglu":
        one = [("matmul", M, f, d), ("matmul", M, f, d), ("elementwise", "swiglu", M * f), ("matmul", M, d, f)]
    else:
        one = [("matmul", M, f, d), ("elementwise", "gelu", M * f), ("matmul", M, d, f)]
    return one * repeat


def head_ops(shape, tokens, tp=1, autocast=False):
    """The final norm, the head's matmul over the rank's vocabulary rows, the loss; and the embedding's lookup."""
    d, V = shape["n_embd"], shape["vocab"] // tp
    ops = [("elementwise", "copy", tokens * d), ("elementwise", "norm", tokens * d), ("matmul", tokens, V, d),
           ("elementwise", "loss", tokens * V)]
    return ops + ([("elementwise", "cast", V * d)] if autocast else [])


def backward(ops):
    """The backward of forward ops: a matmul's two, attention's kernel, each element-wise op's own."""
    out = []
    for op in ops:
        if op[0] == "matmul":
            _, M, N, K = op
            out += [("matmul", M, K, N), ("matmul", N, K, M)]
        else:
            out.append((op[0] + "_backward",) + op[1:])
    return out


# --- devices
def _kind(op):
    """(the op's kind without "_backward", whether it is a backward op)."""
    backward_op = op[0].endswith("_backward")
    return (op[0][:-len("_backward")] if backward_op else op[0]), backward_op


def _nearest_rate(rows, key, column, k):
    """The rate in `column` of measured rows whose leading entries are nearest `key` in log space: a geometric mean
    of the k nearest, weighted by inverse squared distance."""
    def distance(row):
        return sum((math.log2(u) - math.log2(v)) ** 2 for u, v in zip(key, row))
    near = sorted(rows, key=distance)[:k]
    weights = [1 / (1e-3 + distance(row)) for row in near]
    return math.exp(sum(w * math.log(row[column]) for w, row in zip(weights, near)) / sum(weights))


class Device:
    """Seconds for each op on one device; `cores` > 0 on a CPU (ranks beyond them share)."""
    name, cores, overlap = "device", 0, True

    def op_seconds(self, op, a, r, compiled=False):
        base, backward_op = _kind(op)
        if base == "matmul":
            return self.matmul_s(*op[1:], a)
        if base == "attention":
            return self.attention_s(*op[1:], a, backward_op)
        if base == "attention_unfused":
            return self.unfused_attention_s(*op[1:], a, backward_op)
        return self.elementwise_s(op[1], op[2], a, r, backward_op, compiled)

    def host_ops(self, op):
        base, backward_op = _kind(op)
        n = HOST_OPS[op[1] if base == "elementwise" else base][backward_op]
        if base == "elementwise" and op[1] == "loss":  # one chunk at a time (model.CrossEntropy)
            n *= max(1, math.ceil(op[2] * 4 / self.loss_chunk_bytes))
        return n

    def seconds(self, ops, a, r, compiled=False):
        """(device seconds, host seconds) of a list of ops, `a` the compute dtype's bytes, `r` the residual's."""
        device = sum(self.op_seconds(op, a, r, compiled) for op in ops)
        host = sum(self.host_ops(op) for op in ops) * self.host_op_s
        if compiled:  # the compiler fuses the element-wise ops between matmuls: a graph's launch each (about 4)
            host = sum(op[0].startswith(("matmul", "attention")) for op in ops) * 2 * self.host_op_s
        return device, host

    def time(self, ops, a, r, compiled=False):
        return self.combine(*self.seconds(ops, a, r, compiled))

    def combine(self, device, host):
        """A step's time from its device and host seconds: the host queues ahead of a GPU, a CPU does both."""
        return max(device, host) if self.overlap else device + host


class GPU(Device):
    loss_chunk_bytes = 1 << 28  # model.GPU_CHUNK_BYTES

    def __init__(self, name, spec):
        self.name, self.spec, self.sms = name, spec, SMS[name]
        self.host_op_s = HOST_OP_S

    def peak(self, a):
        return self.spec["peak"] if a == 2 else self.spec["peak"] / 2  # float32 matmuls as TF32

    def matmul_s(self, M, N, K, a):
        tiles = math.ceil(M / TILE) * math.ceil(N / TILE)
        waves = math.ceil(tiles / self.sms)
        # each tile's pass over K costs TILE more of K besides (its prologue and epilogue: the first slices loaded,
        # the output written): a product 1024 deep runs at 0.89 of a deep one's rate
        compute = 2 * M * N * (K + TILE) / (self.peak(a) * MATMUL_EFFICIENCY * tiles / (waves * self.sms))
        return max(compute, a * (M * K + K * N + M * N) / self.spec["hbm"]) + KERNEL_S

    def attention_s(self, flops, seq, head_dim, heads, a, backward_op):
        return (2.5 if backward_op else 1.0) * flops / (self.peak(a) * ATTENTION_EFFICIENCY) + KERNEL_S

    def unfused_attention_s(self, flops, seq, head_dim, heads, a, backward_op):
        """Attention with its scores in memory (Megatron-LM 2021-2022, before FlashAttention): per head, QK^T and
        the product with V as batched matmuls over the whole seq x seq (the causal half computed and masked), a
        fused scale-mask-softmax reading and writing the scores, dropout writing them again with a byte of mask;
        backward, the four products of dV, dP, dQ and dK, dropout's and the softmax's backward over the scores."""
        rows = flops / (4 * (seq / 2) * head_dim)  # (sequences x heads) x seq queries
        scores = rows * seq
        hbm = self.spec["hbm"] * MEMORY_EFFICIENCY
        scores_out, head_out = self.matmul_s(rows, seq, head_dim, a), self.matmul_s(rows, head_dim, seq, a)
        if backward_op:  # dP = dO V^T makes scores; dV = P^T dO, dQ = dS K, dK = dS^T Q make head_dim-wide outputs
            return scores_out + 3 * head_out + (5 * a + 1) * scores / hbm + 2 * KERNEL_S
        return scores_out + head_out + (4 * a + 1) * scores / hbm + 2 * KERNEL_S

    def elementwise_s(self, kind, n, a, r, backward_op, compiled=False):
        moved = (FUSED if compiled else ELEMENTWISE)[kind](a, r)[backward_op] * n
        return moved / (self.spec["hbm"] * MEMORY_EFFICIENCY) + (KERNEL_S if moved else 0.0)


class CPU(Device):
    """A CPU from cpu_profile's measurements."""
    overlap = False
    loss_chunk_bytes = 1 << 22  # model.CPU_CHUNK_BYTES

    def __init__(self, profile):
        self.profile, self.name = profile, "cpu"
        self.cores, self.host_op_s = profile["cores"], profile["host_op_s"]

    def shared(self, ranks):
        """How much longer a rank computes where `ranks` processes share this machine: measured amid collectives
        up to as many ranks as cores (their caches' and memory's sharing), times ranks / cores beyond. (Measured
        beyond, 4 ranks on 2 cores read 1.5: a rank computes alone while the others wait in a collective for it,
        and the sharing shows up as their wait instead.)"""
        if ranks <= 1:
            return 1.0
        measured = self.profile["shared"]
        if ranks <= self.cores and str(ranks) in measured:
            return measured[str(ranks)]
        within = max((int(w) for w in measured if int(w) <= self.cores), default=2)
        return max(1.0, ranks / self.cores) * measured[str(within)]

    def matmul_s(self, M, N, K, a):
        # [M, N, K, FLOP/s] rows: the 4 measured shapes nearest
        rate = _nearest_rate(self.profile["matmul"][str(a)], [max(1, x) for x in (M, N, K)], 3, 4)
        return 2 * M * N * K / rate

    def attention_s(self, flops, seq, head_dim, heads, a, backward_op):
        # [seq, head_dim, forward FLOP/s, backward FLOP/s] rows: the 2 measured nearest
        rate = _nearest_rate(self.profile["attention"][str(a)], (seq, head_dim), 3 if backward_op else 2, 2)
        return (2.5 if backward_op else 1.0) * flops / rate

    def elementwise_s(self, kind, n, a, r, backward_op, compiled=False):
        # measured: seconds per element forward + backward (model.py's eager ops: compiled kernels on a CPU are not
        # profiled, and are priced as these); split between them as their bytes are
        fwd, bwd = ELEMENTWISE[kind](a, r)
        share = (bwd if backward_op else fwd) / (fwd + bwd)
        return n * self.profile["elementwise"][str(a)][kind] * share

    def collective_s(self, kind, counted, n, calls=1):
        """gloo between processes of this machine, `calls` collectives of `counted` bytes in all (as
        parallel/comm.py counts them) over n ranks."""
        if n <= 1 or not counted:
            return 0.0
        key = str(min(n, max(int(k) for k in self.profile["gloo"])))
        latency, rate = self.profile["gloo"][key].get(kind, self.profile["gloo"][key]["all_gather"])
        return calls * latency + counted * (n - 1) / n / rate


def device(plan):
    """The Device plan.gpu names: a GPU of tools/plan.py's table (with plan.peak_tflops and the like over it), or
    `cpu`, measured (cpu_profile)."""
    from tools.plan import spec
    if plan.gpu == "cpu":
        return CPU(cpu_profile())
    return GPU(plan.gpu, spec(plan))


# --- the CPU's microbenchmark
SQUARES = (32, 128, 512)
CPU_SHAPES = [(m, n, k) for m in (256, 1024, 4096) for n in SQUARES + (2048,) for k in SQUARES + (2048,)]
CPU_ATTENTION = [(t, hd) for t in (128, 512, 2048) for hd in (32, 64, 128)]
ELEMENTWISE_N = 1 << 20
_PROFILES = {}  # cpu_profile's, by path
PROFILE_VERSION = 3  # in the cache's file name: a profile measured the way an older version measured is not read


def _timed(fn, min_time, windows=3):
    """Seconds per call of fn: the median over `windows` windows of at least min_time (and two calls) each. One
    window of 20 ms read the same attention kernel at 12.8 and 20.7 GFLOP/s from one profile to the next (2026-12-07,
    this VM's noise); the median of three steadies it."""
    fn()
    per_call = []
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < min_time:
            fn()
            n += 1
        per_call.append((time.perf_counter() - t0) / n)
    return sorted(per_call)[len(per_call) // 2]


def profile_path():
    """Where cpu_profile keeps this machine's measurements."""
    import torch
    cache = os.path.expanduser(os.environ.get("NANOPARALLEL_CACHE", "~/.cache/nanoparallel"))
    return os.path.join(cache, f"cpu_profile-v{PROFILE_VERSION}-{platform.node()}-{os.cpu_count()}-"
                               f"{torch.__version__}.json")


def cpu_profile(path=None, min_time=0.02, refresh=False, log=print, dtypes=("float32", "bfloat16"), worlds=(2, 4)):
    """This machine's CPU as the step-time model needs it, measured on one thread (as each rank of a run with
    OMP_NUM_THREADS=1 computes) in about a minute (75 s on an AVX2-only EPYC, 2026-12-07) and cached (`path`,
    default $NANOPARALLEL_CACHE/cpu_profile-v*.json, keyed by the profile's version, machine and torch). `dtypes` and
    `worlds` (gloo's, and the cores' sharing) narrow what is measured, for a profile kept at a `path` of its own
    (tests/test_step_time.py's, which plans float32 runs at world 1 and 2): the default path holds a whole one."""
    assert path or (tuple(dtypes), tuple(worlds)) == (("float32", "bfloat16"), (2, 4)), "a partial profile needs a path"
    path = path or profile_path()
    if path in _PROFILES and not refresh:  # read once per process: the planner asks at every layout it prices
        return _PROFILES[path]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # one process measures, the others of this machine wait for its file (processes that measured at once would
    # slow each other down, and could see different machines)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path) and not refresh:
            with open(path) as f:
                _PROFILES[path] = json.load(f)
            return _PROFILES[path]
        log(f"measuring this CPU for the step-time model (once, about a minute): {path}")
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            profile = _measure_cpu(min_time, log, dtypes, worlds)
        finally:
            torch.set_num_threads(threads)
        with open(path + ".tmp", "w") as f:
            json.dump(profile, f, indent=1)
        os.replace(path + ".tmp", path)
    _PROFILES[path] = profile
    return profile


def _measure_cpu(min_time, log=print, dtypes=("float32", "bfloat16"), worlds=(2, 4)):
    import torch
    import torch.nn.functional as F
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"cores": cores, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "matmul": {},
           "attention": {}, "elementwise": {}}
    # A CPU without bf16 instructions (AVX-512 BF16, AMX) multiplies bf16 some 50x slower than float32 (1.4 against
    # 74 GFLOP/s on an AVX2-only EPYC, 2026-12-07): the grid's largest products would take minutes each, so there
    # its bf16 rates come from the small products and sequences alone (the rate is flat there, and the nearest
    # measured shape is read); the whole bf16 grid took 100 s on that machine, this part of it 10 s.
    before = probe(worlds)
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    bf16_here = lambda *sizes: native_bf16 or max(sizes) <= 512  # noqa: E731
    t0 = time.perf_counter()
    for dtype, a in ((getattr(torch, name), str(getattr(torch, name).itemsize)) for name in dtypes):
        log(f"  {dtype}: matmuls, attention, element-wise ops ({time.perf_counter() - t0:.0f} s so far)")
        out["matmul"][a] = []
        for m, n, k in CPU_SHAPES:
            if a == "2" and not bf16_here(m, n, k):
                continue
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            out["matmul"][a].append([m, n, k, 2 * m * n * k / _timed(lambda: x @ w, min_time)])
        out["attention"][a] = []
        for t, hd in CPU_ATTENTION:
            if a == "2" and not bf16_here(t):
                continue
            # 2,048 tokens a call, as a micro-batch brings: the kernel splits its work over (batch, head) pairs,
            # and at one sequence of 128 tokens it ran at half the rate it reaches over sixteen
            b = max(1, 2048 // t)
            q, k, v = (torch.randn(b, 4, t, hd, dtype=dtype, requires_grad=True) for _ in range(3))
            flops = b * 4 * 4 * t * (t / 2) * hd
            fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), min_time)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            g = torch.randn_like(y)
            both = _timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                      (q, k, v), g), min_time)
            out["attention"][a].append([t, hd, flops / fwd, 2.5 * flops / max(both - fwd, 1e-9)])
        out["elementwise"][a] = _measure_elementwise(dtype, min_time)
    x = torch.ones(8, requires_grad=True)

    def small():  # 64 tiny ops forward, as many backward
        y = x
        for _ in range(64):
            y = y * 1.0001
        y.sum().backward()
    out["host_op_s"] = _timed(small, min_time) / 130
    log(f"  gloo's collectives at {' and '.join(map(str, worlds))} ranks ({time.perf_counter() - t0:.0f} s so far)")
    out["gloo"] = _measure_gloo(worlds)
    # the machine's speed while it was measured, for relevel (the mean of the probes before and after), and what a
    # rank's compute takes where `world` ranks share the machine, amid collectives, against one process alone
    out["probe"] = {k: math.sqrt(before[k] * v) for k, v in probe(worlds).items()}
    out["shared"] = {w: out["gloo"][w].pop("shared") for w in out["gloo"] if int(w) <= cores}  # CPU.shared: why
    return out


def probe(worlds=(2, 4), rounds=9, calls=10):
    """How fast this machine computes now: {"1": seconds per call of a small mix of work (about 7 ms) in one
    process, "N": per call in each of N processes computing at once}, in about a second per world. On this project's
    VMs the same step ran 10% slower alone and 35% slower on 2 ranks a few minutes later (2026-12-07, AVX2 EPYC: other
    tenants' load), so a profile measured once can't price a run measured later; relevel carries it to the speed
    the probe sees at the run. One process times `calls` calls alone, then as many while the others run them too,
    `rounds` times: the median of those pairs' ratios. (Timed apart, one second each, the ratio read 0.9 to 1.2 in
    successive probes; paired, the drift between its two halves cancels.)"""
    import multiprocessing
    import torch
    # a step's mix: a matmul whose operands spill out of a core's cache, and element-wise work over 4 MiB tensors
    # (at 2 ranks it reads 1.00-1.02 of one, as a cache-resident 192 x 192 product alone did)
    a, b, x, y = torch.randn(1024, 512), torch.randn(512, 512), torch.randn(1 << 20), torch.randn(1 << 20)

    def compute():
        a @ b
        for _ in range(4):
            x.mul_(0.5).add_(y)
    compute()
    ctx = multiprocessing.get_context("fork")
    out = {}
    for world in worlds:
        queue, barrier = ctx.Queue(), ctx.Barrier(world)

        def rank(timer, barrier=barrier, queue=queue):
            def window():
                t0 = time.perf_counter()
                for _ in range(calls):
                    compute()
                return (time.perf_counter() - t0) / calls
            pairs = []
            for _ in range(rounds):
                barrier.wait()
                alone = window() if timer else None  # the others wait at the barrier
                barrier.wait()
                busy = window()
                pairs.append((alone, busy))
            if timer:
                queue.put(pairs)
        procs = [ctx.Process(target=rank, args=(r == 0,)) for r in range(world)]
        for p in procs:
            p.start()
        pairs = queue.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
        alone = sorted(a for a, _ in pairs)[rounds // 2]
        out.setdefault("1", alone)
        out[str(world)] = out["1"] * sorted(b / a for a, b in pairs)[rounds // 2]
    return out


def relevel(profile, now):
    """`profile` at the speed probe() measured `now`: every compute rate scaled by the one process's probe against the
    profile's own, the cores' sharing at each world by how far the probes' sharing moved. gloo's constants stay."""
    scale = profile["probe"]["1"] / now["1"]  # < 1: the machine is slower now
    out = {**profile, "probe": now, "host_op_s": profile["host_op_s"] / scale,
           "matmul": {a: [[*row[:3], row[3] * scale] for row in rows] for a, rows in profile["matmul"].items()},
           "attention": {a: [[*row[:2], row[2] * scale, row[3] * scale] for row in rows]
                         for a, rows in profile["attention"].items()},
           "elementwise": {a: {k: v / scale for k, v in per.items()} for a, per in profile["elementwise"].items()},
           # the sharing measured amid collectives, moved as far as the probes' sharing moved since
           "shared": {w: v * (now[w] / now["1"]) / (profile["probe"][w] / profile["probe"]["1"])
                      if w in now and w in profile["probe"] else v for w, v in profile["shared"].items()}}
    return out


def _measure_elementwise(dtype, min_time):
    """Seconds per element of model.py's own element-wise pieces, forward and backward."""
    import torch
    import torch.nn.functional as F
    import model
    n, d = ELEMENTWISE_N, 256
    rows = n // d

    def fwd_bwd(f, *shapes):
        xs = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
        y = f(*xs)
        g = torch.randn_like(y)
        return _timed(lambda: torch.autograd.grad(f(*xs), xs, g), min_time) / y.numel()

    w = torch.ones(d, requires_grad=True)
    cos, sin = model.rope_tables(model.GPTConfig(n_embd=64, n_head=1, block_size=rows), "cpu")
    c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)
    v = 4096  # the loss over a vocabulary of 4096
    out = {"norm": fwd_bwd(lambda x: model.RMSNormFn.apply(x, w.to(dtype), 1e-6), (rows, d)),
           "rope": fwd_bwd(lambda x: model.Rope.apply(x, c, s), (rows, n // rows // 64, 64)),
           "copy": fwd_bwd(lambda x: x.transpose(0, 1).contiguous(), (rows, d)),
           "residual": fwd_bwd(lambda x, y: x + y, (rows, d), (rows, d)),
           "gelu": fwd_bwd(F.gelu, (rows, d)),
           "swiglu": fwd_bwd(lambda x, y: F.silu(x) * y, (rows, d), (rows, d)),
           "router": fwd_bwd(lambda x: x.float().softmax(-1), (rows, d))}
    logits = torch.randn(n // v, v, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n // v,))
    out["loss"] = _timed(lambda: model.CrossEntropy.apply(logits.detach().clone().requires_grad_(), targets)
                         .backward(), min_time) / n
    a, b = torch.randn(n), torch.randn(n)
    out["add"] = out["cast"] = _timed(lambda: a.add_(b), min_time) / n
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-9)

    def step():
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
    out["adamw"] = _timed(step, min_time) / n
    return out


def _gloo_rank(rank, world, port, queue, reps=8, pairs=15):
    """Each collective as a training step meets it: between matmuls that keep every rank's core busy, so that its
    cost includes what it takes from the compute (gloo's work runs on the same cores) and the ranks' waiting for
    one another. Returns {collective: [latency s, bytes/s], "shared": x}: one latency for the three (the median
    over all their 4 KiB calls: one kind's alone read anywhere from 1.0 to 3.6 ms at 2 ranks, 2026-12-07), a rate
    each from 4 MiB; and how much slower the compute runs amid collectives than alone (the others idle meanwhile)."""
    import warnings
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    compute = _compute_load()

    def window(fn):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        return (time.perf_counter() - t0) / reps

    def extras(run):
        """What the collective adds to the compute before it: windows of the compute alone and of the compute then
        the collective, back to back, so that the machine's drift cancels in each pair."""
        run()
        return [window(lambda: (compute(), run())) - window(compute) for _ in range(pairs)]

    def median(xs):
        return sorted(xs)[len(xs) // 2]
    compute()
    small, large = {}, {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for size, into in ((1 << 12, small), (1 << 22, large)):
            n = size // 4
            x = torch.ones(n)
            y = torch.empty(n * world) if kind == "all_gather" else torch.empty(n // world)
            run = {"all_reduce": lambda: dist.all_reduce(x),
                   "all_gather": lambda: dist.all_gather_into_tensor(y, x),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(y, x)}[kind]
            counted = {"all_reduce": 2 * x.numel() * 4, "all_gather": y.numel() * 4,
                       "reduce_scatter": x.numel() * 4}[kind]
            into[kind] = (counted * (world - 1) / world, extras(run))
    latency = max(0.0, median([t for _, ts in small.values() for t in ts]))
    out = {}
    for kind, (b, ts) in large.items():  # no faster than a memory copy here: noise can make it any value
        out[kind] = [latency, b / max(median(ts) - latency, b / 16e9)]
    # the compute timed by itself, each call after a 4 KiB all-reduce, against the same compute on this rank alone
    x, amid, alone = torch.ones(1024), [], []
    for _ in range(pairs):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            for _ in range(reps):
                compute()
            alone.append(time.perf_counter() - t0)
        dist.barrier()
        t = 0.0
        for _ in range(reps):
            dist.all_reduce(x)
            t0 = time.perf_counter()
            compute()
            t += time.perf_counter() - t0
        amid.append(t)
    if rank == 0:
        out["shared"] = median([m / a for m, a in zip(amid, alone)])
        queue.put(out)
    dist.destroy_process_group()


def _compute_load():
    """About 4 ms of matmuls: the load the ranks keep up while the collectives are timed, as long as a small model's
    block computes between tensor parallelism's all-reduces. The ranks' waiting for one another grows with the
    compute between collectives (gloo's all-reduce of 4 KiB at 2 ranks: 1.4 ms after none, 2.3 after 2 ms, 2.4-3.1
    after 10 ms; 2026-12-07, AVX2 EPYC): timed after 10 ms, a profile read 4.3 ms a call, and the planner put tensor
    parallel steps 20-47% over their measured time."""
    import torch
    a, b = torch.randn(192, 192), torch.randn(192, 192)

    def compute():
        for _ in range(24):
            a @ b
    return compute


def _measure_gloo(worlds=(2, 4)):
    """gloo's collectives at world 2 and 4 between processes forked from this one: {world: {collective: [latency
    s, bus bytes/s (as tools/plan.py's collective time reads bytes)]}}."""
    import multiprocessing
    import socket
    out = {}
    ctx = multiprocessing.get_context("fork")
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        ranks = [ctx.Process(target=_gloo_rank, args=(r, world, port, queue)) for r in range(world)]
        for p in ranks:
            p.start()
        out[str(world)] = queue.get(timeout=120)
        for p in ranks:
            p.join(timeout=60)
    return out
