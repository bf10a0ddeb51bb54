"""One readable GPT, GPT-3- or Llama-shaped. It knows nothing of parallelism: strategies in parallel/ act on it from
outside.

Design choices:
- RoPE positions (no learned position table), RMSNorm, causal scaled-dot-product attention, no biases (but q, k, v
  biases where `qkv_bias`, as Qwen2 has them).
- Two shapes of block, by settings: GPT-3's (full multi-head attention, a GELU MLP of 4d) and Llama's
  (grouped-query attention with `n_kv_head` key/value heads shared by n_head / n_kv_head query heads each, a SwiGLU
  MLP: down(silu(gate(x)) * up(x)), `rope_theta`, `norm_eps`). Presets: conf/model/.
- q, k and v are one fused matmul (`attn.qkv`), its output rows grouped by key/value head: for each of the n_kv_head
  groups, its n_head / n_kv_head query heads, then its key head, then its value head (Megatron's layout). A
  tensor-parallel split of the rows into tp equal pieces then gives each rank whole groups: its query heads with
  the key and value heads they read (parallel/tp.py). Hugging Face's q_proj, k_proj, v_proj are
  `qkv.weight.view(n_kv_head, n_head // n_kv_head + 2, head_dim, n_embd)` sliced along dim 1 ([:rep], [rep],
  [rep + 1]) and flattened; `attn.proj` is o_proj, `mlp.gate/up/down` are gate_proj/up_proj/down_proj.
- RoPE is Hugging Face Llama's "rotate half": channel i of a head is paired with channel i + head_dim / 2 (not
  with its neighbour, as the RoPE paper and Meta's original code interleave them), each pair rotated by
  position x theta^(-2i / head_dim). The tables hold cos and sin over the whole head dim, so a rotation is
  x * cos + rotate_half(x) * sin with the signs in the sin table: no halves computed apart and concatenated.
- Speed, eager: RMSNorm, RoPE and the loss are autograd Functions of their own (RMSNormFn, Rope, CrossEntropy),
  each one node that keeps less and writes fewer fresh tensors than the aten ops autograd would compose; on the
  CPU fresh large tensors cost page faults, and that is most of what these save. Compiled, the same math as plain
  ops, which the compiler fuses itself (faster there than the Functions, measured). The head and the loss are one
  Function eager and compiled (Head, LinearCrossEntropy): the logits are made a chunk of rows at a time and never
  exist whole. With tests/test_model.py checking them against torch's, `python -m tools.model_bench` timing us
  against a plain GPT-2: docs/benchmarks.md.
- Mixture of experts (MoE): with n_experts > 0, every moe_every-th block after the first dense_layers has a routed
  mixture of n_experts MLPs (each token to its top_k, plus n_shared_experts every token passes through) in the
  MLP's place; the class's docstring says how it routes, balances and drops.
- Untied input embedding and output head by default. Every parameter then belongs to exactly one piece of the
  model (embedding, a block, or norm + head), which is what FSDP units, pipeline stages and tensor-parallel
  sharding want. `tie_embeddings=true` (Llama 3.2 1B, Qwen2 0.5B) makes the head's weight the embedding's; the
  layouts where that weight would live in two places (FSDP units, pipeline stages, tp's embedding and head)
  refuse it in one line (parallel/layout.py).
- The vocab is padded to a multiple of 128 so it splits evenly across tensor-parallel ranks and
  matmuls stay aligned; padded logits are never targets, and `generate` masks them out.
- Buildable on the meta device: `with torch.device("meta"): GPT(cfg)`, then `to_empty(device=...)`
  and `init_weights()`. Nothing in __init__ computes values; init_weights fills every parameter and
  buffer (the RoPE tables too, since `to_empty` leaves buffers uninitialized, and the tie, which it breaks).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 4096  # the tokenizer's size; padded_vocab_size is what the model allocates
    block_size: int = 256  # longest sequence the RoPE tables cover
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention; 1: multi-query); None: n_head
    mlp: str = "gelu"  # gelu: down(gelu(up(x))) | swiglu: down(silu(gate(x)) * up(x))
    ffn_hidden: Optional[int] = None  # the MLP's hidden units; None: 4d (gelu), or Llama's rule (swiglu)
    ffn_multiple: int = 256  # swiglu's hidden units rounded up to a multiple of this (Llama's multiple_of)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: Optional[float] = None  # None: torch's RMSNorm default, the dtype's machine epsilon
    qkv_bias: bool = False
    vocab_multiple: int = 128
    # mixture of experts (MoE below): n_experts 0 is a dense model
    n_experts: int = 0  # routed experts in each MoE block
    top_k: int = 2  # experts each token is sent to
    moe_every: int = 1  # every moe_every-th block (after the dense_layers) is an MoE block; the others dense
    dense_layers: int = 0  # the first blocks kept dense (DeepSeek-V3 keeps 3)
    n_shared_experts: int = 0  # experts every token passes through, beside its routed ones (DeepSeek)
    expert_ffn_hidden: Optional[int] = None  # each expert's hidden units; None: the dense MLP's
    router: str = "aux"  # aux: a load-balancing loss | bias: DeepSeek-V3's auxiliary-loss-free bias
    aux_loss_coef: float = 0.01  # router=aux: the loss's weight (Switch Transformer's alpha)
    bias_update_rate: float = 0.001  # router=bias: each step's bias change (DeepSeek-V3's gamma)
    capacity_factor: Optional[float] = None  # None: dropless; else each expert takes ceil(cf x tokens x k / E)

    @property
    def padded_vocab_size(self):
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def hidden(self):
        """The MLP's width: ffn_hidden, else 4d for GELU, and for SwiGLU Llama's 2/3 of 4d (three matrices instead
        of two: the same parameters) rounded up to ffn_multiple."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        m = self.ffn_multiple
        return (int(8 * self.n_embd / 3) + m - 1) // m * m

    @property
    def expert_hidden(self):
        return self.expert_ffn_hidden or self.hidden

    def is_moe(self, i):
        """Whether block i is a mixture-of-experts block."""
        j = i - self.dense_layers
        return self.n_experts > 0 and j >= 0 and (j + 1) % self.moe_every == 0

    @property
    def n_moe(self):
        return sum(self.is_moe(i) for i in range(self.n_layer))


def rope_tables(cfg, device):
    """cos and signed sin of shape (block_size, head_dim): rotation angle t * theta^(-2i/d) (Su et al., 2021) for
    the pair (i, i + d/2), repeated over both halves; sin's first half negated, so that
    x * cos + rotate_half(x) * sin rotates each pair."""
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.block_size, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x, cos, sin, sign=1):
    """x * cos + rotate_half(x) * sin (sign=-1: by the opposite angle), written half by half in place into one new
    tensor: out1 = x1 cos1 + x2 sin1, out2 = x2 cos2 + x1 sin2 (the sin table's first half is negated)."""
    h = x.size(-1) // 2
    out = x * cos
    out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=sign)
    out[..., h:].addcmul_(x[..., :h], sin[..., h:], value=sign)
    return out


class Rope(torch.autograd.Function):
    """RoPE as one autograd node. A rotation is linear and orthogonal, so its backward is the rotation by the
    opposite angle: nothing saved but the tables. (Composed of aten ops, autograd would keep x and a rolled copy
    and run a mul, a roll and an addcmul each way.)"""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, sin, sign=-1), None, None


def apply_rope(x, cos, sin):
    """x: (..., T, H, D); cos, sin: (T, D), the tables' rows at x's positions. Pair (x1, x2) of the two halves
    becomes (x1 cos - x2 sin, x2 cos + x1 sin). Compiled, the composed ops (the compiler fuses them itself)."""
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    if torch.compiler.is_compiling():
        return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)
    return Rope.apply(x, cos, sin)


class RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * weight (Zhang and Sennrich, 2019), as one autograd node that keeps only x and 1/rms. torch
    has no fused RMSNorm kernel on the CPU: F.rms_norm runs as pow, mean, rsqrt and muls, and autograd keeps their
    intermediates, each a fresh (tokens x d) tensor forward and backward, where LayerNorm is one kernel each way.
    The statistic is taken in float32 (a half-precision input is upcast for it), as F.rms_norm takes it."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
        r = torch.rsqrt(r.square_().div_(x.size(-1)).add_(eps))
        ctx.save_for_backward(x, weight, r)
        return (x * r).to(x.dtype).mul_(weight)

    @staticmethod
    def backward(ctx, grad):
        # with xh = x r: dx = r (g w - xh mean(g w xh)), dweight = sum over tokens of g xh; in float32 (or wider),
        # three (tokens x d) tensors allocated, one of them freed at once, the rest in place
        x, weight, r = ctx.saved_tensors
        grad, xh = grad.to(r.dtype), x * r
        dweight = (grad * xh).sum(dim=tuple(range(x.dim() - 1)))
        gw = grad * weight
        dot = torch.linalg.vecdot(gw, xh, dim=-1).unsqueeze(-1).div_(x.size(-1))
        dx = gw.sub_(xh.mul_(dot)).mul_(r)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (its parameter, its settings, what tensor parallelism recognizes) computed by RMSNormFn; compiled,
    by nn.RMSNorm's own ops, which the compiler fuses (as it does the loss's and RoPE's: measured faster compiled
    than the Functions, docs/benchmarks.md)."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            return super().forward(x)
        # torch's default: the machine epsilon of the dtype the statistic is computed in (float32 for half types)
        eps = self.eps if self.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        return RMSNormFn.apply(x, self.weight, eps)


# The loss's float32 chunk, bytes: about 4 MiB on a CPU; 256 MiB on a GPU, where every chunk costs eight small
# ops (kernel launches). At 4 MiB, gpt_125m's 65,536 x 50,304 logits (micro-batch 64) went in 3,277 chunks, 26,236
# ops a step, and the H200 sat idle 68% of an eager step (tools/gpu_bench.py, 2026-12-04, docs/benchmarks.md).
CPU_CHUNK_BYTES, GPU_CHUNK_BYTES = 1 << 22, 1 << 28


def chunk_rows(device, vocab):
    """Rows of `vocab`-wide float32 logits in one of the loss's chunks on `device` (CPU_CHUNK_BYTES on a CPU,
    GPU_CHUNK_BYTES elsewhere)."""
    return max(1, (CPU_CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_BYTES) // (4 * vocab))


class CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits (N, V) against targets (N,), where the logits exist whole (the model's own loss
    fuses the head in: LinearCrossEntropy; torch's pipeline schedules hand a stage's logits to model.loss), the
    softmax in float32 (or wider), as one autograd
    node that keeps the logits (in their own dtype) and each row's log-sum-exp. Composed of aten ops (F.cross_entropy
    of the float32 logits), autograd keeps the whole float32 log-softmax, and backward writes two more N x V
    tensors; here backward writes the gradient over the saved logits, which nothing else reads (the head's matmul
    keeps its input, not its output). Rows go in float32 chunks (CPU_CHUNK_BYTES, GPU_CHUNK_BYTES), so a
    half-precision input never needs a whole float32 copy."""

    @staticmethod
    def forward(ctx, logits, targets):
        rows = chunk_rows(logits.device, logits.size(1))
        wide = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.cat([torch.logsumexp(c.to(wide), dim=-1) for c in logits.split(rows)])
        picked = logits.gather(1, targets[:, None]).squeeze(1).to(wide)
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows, ctx.done = rows, None
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        # d loss / d logits = (softmax(logits) - onehot(target)) * grad / N
        if ctx.done is not None:  # backward again through a kept graph (zero-bubble's W after its B, parallel/pp.py)
            dlogits, first = ctx.done  # the logits now hold the first call's gradient: rescale it
            return (dlogits if torch.equal(grad, first) else dlogits * (grad / first)), None
        logits, targets, lse = ctx.saved_tensors
        scale = grad / logits.size(0)
        for c, l in zip(logits.split(ctx.rows), lse.split(ctx.rows)):
            c.copy_(c.to(l.dtype).sub_(l[:, None]).exp_().mul_(scale))
        logits.view(-1)[torch.arange(logits.size(0), device=logits.device) * logits.size(1) + targets] -= scale
        ctx.done = logits, grad
        return logits, None


class LinearCrossEntropy(torch.autograd.Function):
    """The head's matmul and the mean cross-entropy of its logits as one autograd node, over chunks of rows: each
    chunk's logits, log-sum-exp (in float32 or wider) and gradient (softmax - onehot) are made and used at once, and
    the gradients of the hidden states (N x d) and of the weight (V x d) computed in forward and kept, where the
    logits would be N x V. The logits never exist whole: on a CPU a whole step's logits are fresh pages on every
    step (vocab 4096 at 2,048 tokens: 32 MiB, more than glibc's heap serves), and their first touch cost more than
    the plain GPT-2 saves on its head (docs/benchmarks.md); at long context they were the largest activation.
    Backward scales what forward kept: called twice through a kept graph (zero-bubble's W after its B,
    parallel/pp.py), it gives the same gradients again. Under autocast each chunk's matmuls run in the compute dtype,
    as the head's would; the weight's gradient is summed over the chunks in float32."""

    @staticmethod
    def forward(ctx, h, weight, targets):
        loss, dh, dw = linear_cross_entropy(h, weight, targets, grads=True)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None


def linear_cross_entropy(h, weight, targets, grads=False):
    """(mean cross-entropy of h @ weight.T against targets, and where `grads` the gradients of h and weight, or
    None, None), over chunks of rows of CPU_CHUNK_BYTES / GPU_CHUNK_BYTES float32 logits."""
    N, rows = h.size(0), chunk_rows(h.device, weight.size(0))
    wide = torch.promote_types(h.dtype, torch.float32)
    total = torch.zeros((), dtype=wide, device=h.device)
    dh = torch.empty_like(h) if grads else None
    dw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if grads else None
    for lo in range(0, N, rows):  # each chunk's tensors freed before the next chunk's are made (del)
        hc, tc = h[lo:lo + rows], targets[lo:lo + rows]
        z = hc @ weight.t()  # the compute dtype (autocast's, if on)
        dtype, logits = z.dtype, z.to(wide)
        del z
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
        if grads:  # d loss / d logits = (softmax - onehot) / N, in the compute dtype
            logits.sub_(lse[:, None]).exp_()[torch.arange(logits.size(0), device=logits.device), tc] -= 1
            g = logits.div_(N).to(dtype)
            del logits
            if g.dtype == dw.dtype == weight.dtype == h.dtype:  # float32: written in place, no products besides
                torch.mm(g, weight, out=dh[lo:lo + rows])
                dw.addmm_(g.t(), hc)
            else:
                dh[lo:lo + rows] = g @ weight.to(dtype)
                dw += g.t() @ hc.to(dtype)
            del g
        else:
            del logits
    return total / N, dh, dw


class Head(nn.Linear):
    """The output layer: called with the final hidden states alone, the logits; with targets as well, the mean
    cross-entropy of its logits by LinearCrossEntropy (a forward without gradients runs its chunks alone)."""

    def forward(self, h, targets=None):
        if targets is None:
            return super().forward(h)
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
        if torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad):
            return LinearCrossEntropy.apply(h, self.weight, targets)
        return linear_cross_entropy(h, self.weight, targets)[0]


def causal_attention(q, k, v):
    """Softmax attention of each position to itself and the positions before it; q: (B, H, T, head_dim), k, v:
    (B, H_kv, T, head_dim), each key/value head read by H / H_kv query heads in a row."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def fuse_qkv(q, k, v, cfg):
    """(q, k, v) weights (or biases) in head order -> the fused qkv's rows: per key/value head, its query heads, its
    key head, its value head. The inverse is unfuse_qkv."""
    groups = lambda w: w.reshape(cfg.kv_heads, -1, cfg.head_dim, *w.shape[1:])  # (groups, heads, head_dim, ...)
    return torch.cat([groups(q), groups(k), groups(v)], dim=1).reshape(-1, *q.shape[1:])


def unfuse_qkv(w, cfg):
    """The fused qkv's weight (or bias) -> (q, k, v) in head order (Hugging Face's q_proj, k_proj, v_proj)."""
    rep = cfg.n_head // cfg.kv_heads
    g = w.reshape(cfg.kv_heads, rep + 2, cfg.head_dim, *w.shape[1:])
    return tuple(part.reshape(-1, *w.shape[1:]) for part in g.split((rep, 1, 1), dim=1))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim, self.rep = cfg.head_dim, cfg.n_head // cfg.kv_heads  # query heads per key/value head
        # one matmul for q, k and v, rows grouped by key/value head (the module docstring): a contiguous split of
        # the rows splits whole groups
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        # an attribute, so that a strategy that splits the sequence over ranks can put its own in place (parallel/cp.py)
        self.attend = causal_attention

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 rather than n_kv_head: under tensor parallelism this rank holds only some groups
        qkv = self.qkv(x).view(B, T, -1, self.rep + 2, self.head_dim)
        # one split rather than three indexings: its backward is one cat, where each indexing's would fill a zeroed
        # copy of the whole qkv output
        q, k, v = qkv.split((self.rep, 1, 1), dim=3)
        # the tables in the activations' dtype once for q and k (each rotation keeps what it is given)
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q = apply_rope(q, cos[:, None], sin[:, None]).view(B, T, -1, self.head_dim)
        k = apply_rope(k.squeeze(3), cos, sin)
        # a copy: attention keeps v for backward, and a view would keep the whole qkv output alive with it
        v = v.squeeze(3).contiguous()
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """GELU: down(gelu(up(x))). SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, hidden=None):
        super().__init__()
        hidden = hidden or cfg.hidden
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=False) if cfg.mlp == "swiglu" else None
        self.up = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        if self.gate is None:
            return self.down(F.gelu(self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


def grouped_mm(x, w, counts):
    """Rows of x in runs by group (counts[g] rows for group g, in order) times each group's matrix w[g]: (rows, a) x
    (G, a, b) -> (rows, b). torch's grouped matmul where it takes the shapes (rows 16-byte aligned: a and b multiples
    of 4 floats, 8 halves) and the device (any in bf16; float32 on the CPU); a loop over the groups otherwise. Under
    autocast in the autocast dtype, as autocast runs the dense MLP's matmuls (autocast does not know the grouped
    matmul: a float32 input ran in float32 on the CPU, and on a GPU, where the grouped matmul takes bf16 only, as a
    loop over every expert)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    aligned = (w.size(1) * w.element_size()) % 16 == 0 and (w.size(2) * w.element_size()) % 16 == 0
    if aligned and (w.dtype == torch.bfloat16 or x.device.type == "cpu") and x.dtype == w.dtype:
        return torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
    return torch.cat([xs @ wg for xs, wg in zip(x.split(counts.tolist()), w.to(x.dtype))])


class Experts(nn.Module):
    """n experts, each an MLP of the model's kind (GELU or SwiGLU) and expert_hidden units, their weights stacked
    (n, in, out) so that all of them run as one grouped matmul per projection over tokens sorted by expert."""

    def __init__(self, cfg, n):
        super().__init__()
        d, h = cfg.n_embd, cfg.expert_hidden
        self.gate = nn.Parameter(torch.empty(n, d, h)) if cfg.mlp == "swiglu" else None
        self.up = nn.Parameter(torch.empty(n, d, h))
        self.down = nn.Parameter(torch.empty(n, h, d))

    def forward(self, x, counts):
        """x: (rows, d), counts[e] rows for expert e in a row (of this module's experts)."""
        if torch.is_autocast_enabled(x.device.type):  # cast the rows once: gate's and up's casts kept one copy each
            x = x.to(torch.get_autocast_dtype(x.device.type))
        up = grouped_mm(x, self.up, counts)
        h = F.gelu(up) if self.gate is None else F.silu(grouped_mm(x, self.gate, counts)) * up
        return grouped_mm(h, self.down, counts)


class AuxLoss(torch.autograd.Function):
    """Adds a loss's gradient without adding the loss: forward returns y as it is, backward sends `scale` as the
    gradient of `aux`. So the router's balancing loss trains wherever its block runs (a pipeline stage far from the
    loss too) while the loss that is returned and logged stays the language model's (as Megatron-LM does it)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


class MoE(nn.Module):
    """A mixture of experts in the MLP's place (Shazeer et al., 2017; GShard; Switch Transformer; Mixtral;
    DeepSeek-V3): a linear router scores the n experts for each token (softmax), the token goes to its top_k, and the
    output is their outputs weighted by the chosen scores renormalized to sum to 1 (Mixtral's rule), plus any shared
    experts' (which every token passes through).

    - Balance, router=aux: the load-balancing loss n * sum_e f_e P_e (Switch Transformer, eq. 4), f_e the fraction
      of the micro-batch's k x tokens routed to e, P_e its mean score, weighted by aux_loss_coef; its gradient is
      added (AuxLoss) x aux_scale, the factor the training loop scales the loss by (1 / accumulation steps).
      router=bias: DeepSeek-V3's auxiliary-loss-free balance: a per-expert bias added to the scores for choosing
      only (the weights stay the scores), moved after each step by bias_update_rate toward the mean load
      (update_bias, from the step's token counts over the whole batch).
    - Capacity: dropless by default; with capacity_factor each expert takes at most ceil(cf x tokens x k / n) of a
      micro-batch's assignments, the earliest tokens first, and the rest are dropped (their output is the shared
      experts' or 0 for that choice; the residual carries the token on).
    - `dispatch(tokens, counts)`: the experts' outputs for tokens sorted by expert, counts[e] of them for expert e.
      An attribute, so that expert parallelism can put its own in place (parallel/ep.py: an all-to-all to the ranks
      that hold the experts and back).
    - `batch_counts(routed, tokens)`: the balancing loss's f_e is taken over the micro-batch's sequences whole: the
      assignments per expert and the tokens they came from, this module's own by default. An attribute too: context
      parallelism (parallel/cp.py) holds a piece of every sequence, and sums them over the ranks holding the rest.
    - For the training loop: `load` (tokens each expert was given since the last step, this rank's), `dropped`,
      `aux` (the summed balancing losses, detached), kept while training and not recomputing."""

    def __init__(self, cfg):
        super().__init__()
        self.n, self.k, self.rule = cfg.n_experts, cfg.top_k, cfg.router
        self.coef, self.capacity_factor, self.rate = cfg.aux_loss_coef, cfg.capacity_factor, cfg.bias_update_rate
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg, cfg.n_experts)
        self.shared = MLP(cfg, cfg.n_shared_experts * cfg.expert_hidden) if cfg.n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("aux", torch.zeros(()), persistent=False)
        self.dispatch = self.experts.__call__  # (a method, not the module again: it would be a second child)
        self.batch_counts = lambda routed, tokens: (routed, tokens)
        self.aux_scale = 1.0

    def forward(self, x):
        shape, d = x.shape, x.size(-1)
        x = x.reshape(-1, d)
        scores = self.router(x).float().softmax(dim=-1)  # (tokens, n)
        choose = scores + self.expert_bias if self.rule == "bias" else scores
        top = choose.topk(self.k, dim=-1).indices  # (tokens, k)
        weights = scores.gather(1, top)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = top.flatten()  # each assignment's expert, token by token
        # the assignments per expert (bincount's values; its output's size depends on them, which fake tensors can't
        # answer: tools/dry_run.py)
        routed = torch.zeros(self.n, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        order = flat.argsort(stable=True)  # the assignments grouped by expert, earliest token first in each
        counts = routed
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * x.size(0) * self.k / self.n)
            start = routed.cumsum(0) - routed  # where each expert's run begins in `order`
            kept = torch.arange(order.numel(), device=x.device) - start[flat[order]] < cap
            order, counts = order[kept], routed.clamp(max=cap)
        token = order // self.k
        out = self.dispatch(x[token], counts)
        # in the experts' dtype (the compute dtype under autocast, as the dense MLP's output is)
        gates = weights.flatten()[order, None].to(out.dtype)
        y = x.new_zeros(x.shape, dtype=out.dtype).index_add_(0, token, out * gates)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training and self.rule == "aux" and self.coef > 0:
            # f over the whole sequences (batch_counts); P_e the mean over this module's tokens: where context
            # parallelism holds equal pieces, the mean of the pieces' losses is the whole's, as the LM loss's is
            everywhere, tokens = self.batch_counts(routed, x.size(0))
            f = everywhere.to(scores.dtype) / (tokens * self.k)
            aux = self.n * (f * scores.mean(dim=0)).sum()
            y = AuxLoss.apply(y, aux, self.coef * self.aux_scale)
            self.keep(aux=aux)
        if self.training:
            self.keep(load=routed, dropped=routed.sum() - counts.sum())
        return y.view(shape)

    @torch.no_grad()
    def keep(self, **stats):
        """Add to the step's statistics, once per forward: not again when activation checkpointing recomputes the
        block inside backward."""
        if torch._C._current_graph_task_id() != -1:
            return
        for name, value in stats.items():
            getattr(self, name).add_(value.detach().to(getattr(self, name).dtype))

    @torch.no_grad()
    def update_bias(self, load):
        """router=bias, after a step: each expert's bias moves by `rate` up if it had fewer tokens than the mean,
        down if more (DeepSeek-V3, sec. 2.1.2); `load`: the step's tokens per expert over the whole batch."""
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.rate)

    @torch.no_grad()
    def reset_stats(self):
        for t in (self.load, self.dropped, self.aux):
            t.zero_()


class Block(nn.Module):
    def __init__(self, cfg, moe=False):
        super().__init__()
        self.norm1 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.head = Head(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight  # one parameter, named wte.weight (named_parameters keeps the first)
        cos, sin = rope_tables(cfg, device=self.wte.weight.device)
        # not persistent: derived from the config, so checkpoints stay weights only
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Fill every parameter and buffer. Std 0.02 (GPT-2); the two projections that write into the
        residual stream get 0.02/sqrt(2 * n_layer) so its variance does not grow with depth (GPT-2 paper)."""
        self.init_buffers()
        for name, p in self.named_parameters():
            self.init_param(name, p)

    @torch.no_grad()
    def init_buffers(self, device=None):
        """The RoPE tables, on `device` when given (a model materialized piece by piece from the meta device has none
        allocated yet), else where they are; and the tie, which materializing (to_empty, or a strategy's parameter by
        parameter) breaks: the head gets the embedding's parameter again."""
        cos, sin = rope_tables(self.cfg, device=device or self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin  # registered buffers: assigning replaces them
        for moe in self.moe_layers():  # the router's bias and statistics start at zero
            for name in ("expert_bias", "load", "dropped", "aux"):
                setattr(moe, name, torch.zeros_like(getattr(moe, name), device=cos.device))
        if self.cfg.tie_embeddings:
            self.head.weight = self.wte.weight

    @torch.no_grad()
    def init_param(self, name, p):
        """One parameter's init, by name. Drawing from the global RNG in named_parameters() order gives the same
        values whether the model is initialized whole or one piece at a time (sharded meta-device init)."""
        if "norm" in name:
            nn.init.ones_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        elif name.endswith("qkv.weight"):
            # drawn as q, then k, then v (as three separate matrices would be), then laid out in groups
            c = self.cfg
            q, k, v = (torch.empty(n * c.head_dim, c.n_embd, dtype=p.dtype, device=p.device)
                       for n in (c.n_head, c.kv_heads, c.kv_heads))
            for w in (q, k, v):
                nn.init.normal_(w, std=0.02)
            p.copy_(fuse_qkv(q, k, v, c))
        elif name.endswith(("proj.weight", "down.weight", "experts.down")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
        else:
            nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None, positions=None):
        """Logits, or the mean loss where targets are given. `positions`: each token's position in its sequence
        (T,), where idx holds not a whole sequence but some of its pieces (parallel/cp.py); default 0..T-1."""
        x = self.wte(idx)
        cos, sin = self.rope(idx.size(1), positions)
        for block in self.blocks:
            x = block(x, cos, sin)
        h = self.norm(x)
        return self.head(h) if targets is None else self.head_loss(h, targets)

    def head_loss(self, h, targets):
        """The mean loss from the final hidden states: the head and the loss in one (Head, LinearCrossEntropy), so
        that the logits never exist whole. A strategy that puts its own `loss` in place (tensor parallelism's over
        the vocabulary, parallel/tp.py) puts `loss(head(h), targets)` here."""
        return self.head(h, targets)

    def rope(self, T, positions=None):
        """The RoPE tables (cos, sin) of T tokens at `positions`, or at 0..T-1."""
        if positions is None:
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[positions], self.rope_sin[positions]

    def loss(self, logits, targets):
        """Mean cross-entropy of logits over all positions, in float32: where the logits exist whole (torch's
        pipeline schedules take a stage's output and a loss function apart). A method of its own so that a strategy
        which splits the vocabulary across ranks can put its own in place (parallel/tp.py)."""
        logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        return CrossEntropy.apply(logits, targets)

    def moe_layers(self):
        """The MoE modules, in block order (none in a dense model)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_aux_scale(self, scale):
        """The factor the training loop scales each micro-batch's loss by (1 / accumulation steps): the balancing
        losses' gradients take it too."""
        for moe in self.moe_layers():
            moe.aux_scale = scale

    def num_params(self, exclude_embedding=False, active=False):
        """Parameters (a tied weight once); `exclude_embedding`: those that take part in a matmul, all but an untied
        embedding (a lookup; tied, it is the head's matrix too). `active`: of each MoE block's routed experts only
        the top_k a token passes through (from the config: the same with experts split over ranks)."""
        c = self.cfg
        n = sum(p.numel() for p in self.parameters())
        if active and c.n_experts:
            per_expert = (3 if c.mlp == "swiglu" else 2) * c.n_embd * c.expert_hidden
            n -= c.n_moe * (c.n_experts - c.top_k) * per_expert
        return n - self.wte.weight.numel() if exclude_embedding and not self.cfg.tie_embeddings else n

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6N for the matmuls of forward + backward (N = parameters that take part in a
        matmul, of each MoE block's routed experts the top_k a token passes through) plus 12*L*H*Q*T for attention scores and their weighted sum (PaLM paper, appendix B; H the query
        heads: grouped-query attention shares keys and values, not the scores). Causal masking's savings are not
        subtracted, as is customary."""
        c = self.cfg
        return 6 * self.num_params(exclude_embedding=True, active=True) + 12 * c.n_layer * c.n_head * c.head_dim * seq_len

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=50):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float()
            idx = torch.cat([idx, self.next_token(logits, temperature, top_k)], dim=1)
        return idx

    def next_token(self, logits, temperature=0.8, top_k=50):
        """One token per row drawn from the last position's logits (B, vocab): top-k, then temperature."""
        logits[:, self.cfg.vocab_size:] = -float("inf")  # padding ids are not tokens
        if top_k:
            kth = torch.topk(logits, min(top_k, self.cfg.vocab_size)).values[:, -1:]
            logits[logits < kth] = -float("inf")
        return torch.multinomial(F.softmax(logits / temperature, dim=-1), 1)
