"""One readable GPT. It knows nothing of parallelism: strategies in parallel/ act on it from outside.

Design choices:
- RoPE positions (no learned position table), RMSNorm, no biases, causal scaled-dot-product attention.
- Untied input embedding and output head. Every parameter then belongs to exactly one piece of the
  model (embedding, a block, or norm + head), which is what FSDP units and tensor-parallel sharding
  want: the embedding is split by vocab rows for lookup, the head by vocab rows for the loss, and a
  tied weight would have to live in two FSDP units at once. It costs vocab x n_embd extra parameters.
- The vocab is padded to a multiple of 128 so it splits evenly across tensor-parallel ranks and
  matmuls stay aligned; padded logits are never targets, and `generate` masks them out.
- Buildable on the meta device: `with torch.device("meta"): GPT(cfg)`, then `to_empty(device=...)`
  and `init_weights()`. Nothing in __init__ computes values; init_weights fills every parameter and
  buffer (the RoPE tables too, since `to_empty` leaves buffers uninitialized).
"""
import math
from dataclasses import dataclass

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
    rope_base: float = 10000.0
    vocab_multiple: int = 128

    @property
    def padded_vocab_size(self):
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


def rope_tables(cfg, device):
    """cos/sin of shape (block_size, head_dim/2): rotation angle t * base^(-2i/d) (Su et al., 2021)."""
    inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.block_size, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); rotate pairs (x1, x2) made of the two halves of the head dimension
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (T, head_dim/2): the tables' rows at x's positions
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q, k, v):
    """Softmax attention of each position to itself and the positions before it; q, k, v: (B, H, T, head_dim)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        # q, k and v are separate so a column-parallel split of each splits whole heads
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        # an attribute, so that a strategy that splits the sequence over ranks can put its own in place (parallel/cp.py)
        self.attend = causal_attention

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 rather than self.n_head: under tensor parallelism this rank holds only some heads
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
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
        allocated yet), else where they are."""
        cos, sin = rope_tables(self.cfg, device=device or self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin  # registered buffers: assigning replaces them

    @torch.no_grad()
    def init_param(self, name, p):
        """One parameter's init, by name. Drawing from the global RNG in named_parameters() order gives the same
        values whether the model is initialized whole or one piece at a time (sharded meta-device init)."""
        if "norm" in name:
            nn.init.ones_(p)
        elif name.endswith(("proj.weight", "down.weight")):
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
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return self.loss(logits, targets)

    def rope(self, T, positions=None):
        """The RoPE tables (cos, sin) of T tokens at `positions`, or at 0..T-1."""
        if positions is None:
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[positions], self.rope_sin[positions]

    def loss(self, logits, targets):
        """Mean cross-entropy over all positions, in float32. A method of its own so that a strategy which splits
        the vocabulary across ranks can put its own in place (parallel/tp.py)."""
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self, exclude_embedding=False):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6N for the matmuls of forward + backward (N = parameters that take part in a
        matmul; the embedding is a lookup, so it is left out) plus 12*L*H*Q*T for attention scores and their
        weighted sum (PaLM paper, appendix B). Causal masking's savings are not subtracted, as is customary."""
        c = self.cfg
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * seq_len

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
