import collections

import pytest
import torch

from conftest import make_cfg
from model import GPT, GPTConfig

pytestmark = pytest.mark.quick  # the quick tier: all of this file is fast, in this process


def tiny(**kw):
    return GPTConfig(**{"vocab_size": 300, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, **kw})


def test_shapes_and_padded_vocab():
    cfg = tiny()
    assert cfg.padded_vocab_size == 384  # 300 rounded up to a multiple of 128
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    idx = torch.randint(0, 300, (3, 17))
    assert model(idx).shape == (3, 17, 384)
    loss = model(idx, idx)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(384.0)).item()) < 0.5


def test_meta_init_matches_eager():
    """Built on meta then materialized: same parameter names, shapes, count, and (same seed) the same values."""
    eager = GPT(tiny())
    torch.manual_seed(0)
    eager.init_weights()
    with torch.device("meta"):
        lazy = GPT(tiny())
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.init_weights()
    assert lazy.num_params() == eager.num_params()
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    torch.testing.assert_close(lazy.rope_cos, eager.rope_cos)  # buffers are rebuilt by init_weights too


@pytest.mark.parametrize("name,billions", [("gpt_125m", 0.16), ("gpt_350m", 0.41), ("gpt_760m", 0.83),
                                           ("gpt_1p3b", 1.41)])
def test_family_shapes_on_meta(name, billions):
    """The big configs build on the meta device (no memory) with GPT-3-like sizes (untied head adds V x d)."""
    m = make_cfg(f"model={name}").model
    cfg = GPTConfig(vocab_size=50257, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)
    with torch.device("meta"):
        model = GPT(cfg)
    assert cfg.padded_vocab_size == 50304
    d, L, V = m.n_embd, m.n_layer, cfg.padded_vocab_size
    expected = 2 * V * d + L * (12 * d * d + 2 * d) + d  # embeddings + blocks (attn 4d^2, mlp 8d^2, 2 norms) + norm
    assert model.num_params() == expected
    assert abs(model.num_params() / 1e9 - billions) < 0.01


def test_flops_per_token_formula():
    model = GPT(tiny())
    c = model.cfg
    n = model.num_params() - c.padded_vocab_size * c.n_embd
    assert model.flops_per_token(32) == 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * 32


def test_generate_never_emits_padding_ids():
    torch.manual_seed(0)
    model = GPT(tiny())
    model.init_weights()
    with torch.no_grad():
        model.head.weight[300:] = 10.0  # make padding logits the largest
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20)
    assert out.shape == (2, 21) and out.max() < 300


def llama(**kw):
    return tiny(**{"n_head": 4, "n_kv_head": 2, "mlp": "swiglu", "ffn_hidden": 96, "qkv_bias": True,
                   "rope_theta": 500000.0, "norm_eps": 1e-5, **kw})


@pytest.mark.parametrize("tied", [False, True])
def test_llama_meta_init_matches_eager(tied):
    """GQA + SwiGLU + q/k/v biases, tied or not: built on meta and materialized gives the eager model's values, and
    a tied head is the embedding's very parameter again (to_empty breaks the tie; init_weights restores it)."""
    eager = GPT(llama(tie_embeddings=tied))
    torch.manual_seed(0)
    eager.init_weights()
    with torch.device("meta"):
        lazy = GPT(llama(tie_embeddings=tied))
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.init_weights()
    assert (lazy.head.weight is lazy.wte.weight) == tied
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    V, d, L, f, kv = 384, 32, 2, 96, 2 * 8  # 2 key/value heads of 32 / 4 = 8 channels
    assert lazy.num_params() == (1 if tied else 2) * V * d + L * (2 * d * d + 2 * d * kv + d + 2 * kv + 3 * d * f +
                                                                  2 * d) + d


def test_attention_is_hugging_face_llamas():
    """Our fused, grouped qkv and rotate-half RoPE against Hugging Face Llama's attention written out: q_proj, k_proj,
    v_proj from model.unfuse_qkv, cos/sin of the two halves concatenated, rotate_half, each key/value head repeated
    for its query heads."""
    from model import apply_rope, unfuse_qkv
    cfg = llama()
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    attn, B, T, H, D = model.blocks[0].attn, 2, 7, cfg.n_head, cfg.head_dim
    x = torch.randn(B, T, cfg.n_embd)
    (wq, wk, wv), (bq, bk, bv) = unfuse_qkv(attn.qkv.weight, cfg), unfuse_qkv(attn.qkv.bias, cfg)
    q, k, v = ((x @ w.T + b).view(B, T, -1, D).transpose(1, 2) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.outer(torch.arange(T).float(), inv_freq)] * 2, dim=-1)  # HF's LlamaRotaryEmbedding

    def rotate_half(t):
        return torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)
    q, k = (t * emb.cos() + rotate_half(t) * emb.sin() for t in (q, k))
    rep = H // cfg.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # HF's repeat_kv
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = attn.proj(y.transpose(1, 2).reshape(B, T, -1))
    cos, sin = model.rope(T)
    torch.testing.assert_close(attn(x, cos, sin), want, rtol=1e-5, atol=1e-6)
    assert apply_rope is not None


@pytest.mark.quick
def test_fused_ops_equal_torchs():
    """model.py's RMSNorm, RoPE and cross-entropy (autograd Functions, for speed: docs/benchmarks.md) against torch's
    own ops composed by autograd: values and gradients, float32 and bfloat16; gradcheck in float64; and the loss's
    backward run twice through a kept graph (zero-bubble's W after its B) gives the same gradient twice, though
    its first backward writes over the saved logits."""
    from model import CrossEntropy, RMSNorm, RMSNormFn, Rope, rope_tables
    F = torch.nn.functional
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-6)), (torch.bfloat16, dict(rtol=2e-2, atol=1e-2))):
        ours, ref = RMSNorm(48), torch.nn.RMSNorm(48)
        with torch.no_grad():
            ours.weight.normal_()
            ref.weight.copy_(ours.weight)
        x = (torch.randn(3, 10, 48) * 3).to(dtype).requires_grad_()
        g = torch.randn(3, 10, 48).to(dtype)
        got = ours(x), *torch.autograd.grad(ours(x), (x, ours.weight), g)
        want = ref(x), *torch.autograd.grad(ref(x), (x, ref.weight), g)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **tol)

        logits = (torch.randn(40, 300) * 4).to(dtype).requires_grad_()
        targets = torch.randint(0, 300, (40,))
        loss = CrossEntropy.apply(logits * 1, targets)  # * 1: the Function writes over its input's storage
        first = torch.autograd.grad(loss * 3, logits, retain_graph=True)[0]
        again = torch.autograd.grad(loss * 3, logits)[0]
        ref_loss = F.cross_entropy(logits.float(), targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(first, torch.autograd.grad(ref_loss * 3, logits)[0], **tol)
        torch.testing.assert_close(again, first, rtol=0, atol=0)

    cfg = GPTConfig(n_embd=32, n_head=2, block_size=9)
    cos, sin = (t.double()[:, None] for t in rope_tables(cfg, "cpu"))
    x = torch.randn(2, 9, 3, 16, dtype=torch.float64, requires_grad=True)
    composed = torch.addcmul(x * cos, x.roll(8, dims=-1), sin)  # x cos + rotate_half(x) sin, signs in the sin table
    torch.testing.assert_close(Rope.apply(x, cos, sin), composed, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: Rope.apply(t, cos, sin), (x,))
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w: RMSNormFn.apply(t, w, 1e-6), (x, w))
    z = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: CrossEntropy.apply(z * 1, torch.arange(6) % 11), (z,))


@pytest.mark.quick
def test_fused_head_and_loss_equal_torchs(monkeypatch):
    """model.Head called with targets (the head's matmul and the loss in one Function, LinearCrossEntropy, over chunks
    of rows) against the head's logits and torch's cross-entropy composed by autograd: the loss and the gradients of
    the hidden states and the weight, float32 and under bf16 autocast, over several chunks (a 1 KiB chunk: 3 rows of
    a 70-wide vocab) and one; no gradients asked, the loss alone; two backwards through a kept graph (zero-bubble's
    W after its B) give the same gradients; gradcheck in float64; and the whole model's loss and gradients equal
    the unfused path's (head, then model.loss)."""
    import model
    from model import GPT, Head, LinearCrossEntropy
    F = torch.nn.functional
    torch.manual_seed(0)
    head = Head(24, 70, bias=False)
    h = torch.randn(2, 10, 24, requires_grad=True)
    targets = torch.randint(0, 70, (2, 10))
    for chunk in (1 << 10, 1 << 22):
        monkeypatch.setattr(model, "CPU_CHUNK_BYTES", chunk)
        for autocast, tol in ((False, dict(rtol=1e-5, atol=1e-6)), (True, dict(rtol=2e-2, atol=2e-3))):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = head(h, targets)
                ref = F.cross_entropy(head(h).float().flatten(0, 1), targets.flatten())
            got = torch.autograd.grad(loss * 3, (h, head.weight), retain_graph=True)
            again = torch.autograd.grad(loss * 3, (h, head.weight))
            want = torch.autograd.grad(ref * 3, (h, head.weight))
            torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
            for a, b, c in zip(got, again, want):
                assert a.dtype == c.dtype
                torch.testing.assert_close(a, c, **tol)
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(head(h, targets), F.cross_entropy(head(h).flatten(0, 1), targets.flatten()))
    monkeypatch.setattr(model, "CPU_CHUNK_BYTES", 256)  # 2 rows of 11
    z, w = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((5, 7), (11, 7)))
    assert torch.autograd.gradcheck(lambda z, w: LinearCrossEntropy.apply(z, w, torch.arange(5) % 11), (z, w))

    monkeypatch.setattr(model, "CPU_CHUNK_BYTES", 1 << 12)
    m = GPT(GPTConfig(vocab_size=200, n_layer=2, n_head=2, n_embd=32, block_size=16))
    m.init_weights()
    x, y = torch.randint(0, 200, (3, 16)), torch.randint(0, 200, (3, 16))
    fused = m(x, y)
    grads = torch.autograd.grad(fused, list(m.parameters()))
    cos, sin = m.rope(16)
    hidden = m.wte(x)
    for block in m.blocks:
        hidden = block(hidden, cos, sin)
    plain = m.loss(m.head(m.norm(hidden)), y)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(plain, list(m.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_loss_kernels_per_step_on_a_gpu():
    """The loss over gpt_125m's logits at micro-batch 64 (65,536 x 50,304, bf16), on meta tensors (no GPU needed:
    the ops dispatched; every device but the CPU takes the GPU's chunk), runs in float32 chunks of at most 256 MiB:
    50 chunks, 420 ops forward and backward. At the CPU's 4 MiB it was 3,277 chunks and 26,236 ops, and the H200 sat
    idle for 68% of an eager step (docs/benchmarks.md, 2026-12-04). On a CPU the chunk stays 4 MiB."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model import CrossEntropy

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    class Ctx:  # the Function's forward and backward called directly: no autograd graph needed to count
        def save_for_backward(self, *t):
            self.saved_tensors = t

    def count(device, n, v):
        with Count() as c:
            logits = torch.randn(n, v, device=device, dtype=torch.bfloat16)
            targets = torch.randint(0, v, (n,), device=device)
            c.ops.clear()
            ctx = Ctx()
            loss = CrossEntropy.forward(ctx, logits, targets)
            CrossEntropy.backward(ctx, torch.ones_like(loss))
        return c.ops

    n, v = 65536, 50304
    gpu = count("meta", n, v)
    rows = (256 << 20) // (4 * v)  # float32 rows in 256 MiB
    assert gpu["logsumexp"] == -(-n // rows) == 50
    assert sum(gpu.values()) < 500
    cpu = count("cpu", 1024, v)
    assert cpu["logsumexp"] == -(-1024 // ((4 << 20) // (4 * v))) == 52  # 20 rows a chunk


def test_default_model_draws_as_before():
    """GPT-3's block with the fused qkv draws q, k and v as the three separate matrices it replaced did: the same
    seed gives the same q, k, v (and every other parameter) as before the fusion."""
    from model import unfuse_qkv
    cfg = tiny()
    model = GPT(cfg)
    torch.manual_seed(0)
    model.init_weights()
    torch.manual_seed(0)
    torch.nn.init.normal_(torch.empty(cfg.padded_vocab_size, cfg.n_embd))  # wte, then blocks.0.norm1 (no draw)
    for got, n in zip(unfuse_qkv(model.blocks[0].attn.qkv.weight, cfg), ("q", "k", "v")):
        want = torch.nn.init.normal_(torch.empty(cfg.n_embd, cfg.n_embd), std=0.02)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_model_bench_runs():
    """tools/model_bench.py, ours against the plain GPT-2, at a toy size: it runs and reports a ratio."""
    from tools import model_bench
    rows = model_bench.main(["--shapes", "2x64", "--modes", "eager", "--rounds", "3", "--warmup", "1",
                             "--seq", "32", "--batch", "2", "--vocab", "256"])
    assert len(rows) == 1 and rows[0][4] > 0 and rows[0][5] > 0 and rows[0][6] <= rows[0][4] <= rows[0][7]
    # the median's 95% interval over 30 values: the 10th and 21st lowest (binomial(30, 1/2) below 10: 2.1%)
    assert model_bench.median_interval(list(range(1, 31))) == (15.5, 10, 21)
    assert model_bench.median_interval([3, 1, 2]) == (2, 1, 3)  # too few values for 95%: the whole range
