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
