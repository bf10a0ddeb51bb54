"""Hugging Face in and out (hf.py, tools/hf.py): tiny random Llama, Qwen2 and Mixtral models built by transformers
itself (nothing downloaded), our model loaded from them giving their logits; a round trip HF -> train.py under fsdp x 2
and tp x 2, and a Mixtral under ep x 2 (in the session's world-2 launch) and under single with a tied Qwen2 -> export
-> transformers giving the original logits again; our own trained MoE exported as a Mixtral giving our logits; every
bad input refused in one line before anything is written."""
import dataclasses
import json
import math
import os
import re
import shutil

import pytest
import torch

import checkpoint
import hf
import train
from conftest import job_output, launch_jobs, make_cfg, read_metrics, small_corpus, small_run
from config import ConfigError
from data.prepare import DataError
from model import GPTConfig

V = 320  # the HF vocab: our model pads it to 384 (a multiple of 128), the export trims it back
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)  # SHAPE's blocks, each a mixture of 4 experts of 128


def hf_model(kind="llama", tied=False, seed=0, eos=None):
    """A random tiny transformers model. Qwen2's biases, which transformers initializes to zero, drawn too: a
    mapping that dropped them would pass otherwise."""
    import transformers
    transformers.utils.logging.disable_progress_bar()  # a bar per save and load, in every test's output
    torch.manual_seed(seed)
    conf = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mixtral": transformers.MixtralConfig}[kind]
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "mixtral": transformers.MixtralForCausalLM}[kind](
        conf(**SHAPE, **(MIXTRAL if kind == "mixtral" else {}), tie_word_embeddings=tied, eos_token_id=eos)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def hf_tokenizer(folder, vocab=300):
    """A byte-level BPE of `vocab` tokens trained by `tokenizers` on the small corpus, saved as transformers saves
    one (tokenizer.json, tokenizer_config.json naming its eos token). Returns the eos id."""
    import glob
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    files = [f for pattern in small_corpus() for f in sorted(glob.glob(pattern))]
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return tok.token_to_id("<|endoftext|>")


def save_hf(folder, kind="llama", tied=False, tokenizer=True, **kw):
    """A model folder as save_pretrained writes it, with a tokenizer; returns the transformers model."""
    eos = hf_tokenizer(folder) if tokenizer else None
    model = hf_model(kind, tied, eos=eos)
    model.save_pretrained(folder, **kw)
    return model


def tokens(seed=1):
    return torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


def our_logits(model, x):
    with torch.no_grad():
        return model(x)[..., :V]  # the padded vocab's columns are no tokens


def hf_run(folder, *extra):
    """small_run without its model.* settings: the shape is config.json's (model=hf), the weights DIR's, the
    learning rate so small that no weight moves in fp32, the tokenizer DIR's own."""
    return [o for o in small_run() if not o.startswith("model.")] + [
        "model=hf", f"train.init_from=hf:{folder}", "data.tokenizer=hf", "optim.lr=1e-30", "optim.min_lr=0",
        "train.max_steps=2", "train.eval_every=100", "train.eval_steps=1", *extra]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf") / "llama")
    return folder, save_hf(folder)


# --- logits: ours from an HF folder equal transformers' (catches rotate-half vs interleaved RoPE, q/k permutations)
@pytest.mark.quick
@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", True), ("qwen2", False), ("mixtral", False),
                                       ("mixtral", True)])
def test_logits_equal_transformers(tmp_path, kind, tied):
    ref = save_hf(str(tmp_path / "m"), kind, tied, tokenizer=False)
    ours = hf.from_pretrained(str(tmp_path / "m"))
    assert ours.cfg.padded_vocab_size == 384 and ours.cfg.tie_embeddings == tied and ours.cfg.qkv_bias == (
        kind == "qwen2")
    c = ours.cfg
    assert (c.n_experts, c.top_k, c.n_moe, c.expert_hidden, c.router, c.capacity_factor) == (
        (4, 2, 2, 128, "aux", None) if kind == "mixtral" else (0, 2, 0, 128, "aux", None))
    x = tokens()
    gap = float((our_logits(ours, x) - hf_logits(ref, x)).abs().max())
    print(f"{kind} tied={tied}: largest logit gap {gap:.1e}")
    assert gap < 1e-5


@pytest.mark.quick
def test_sharded_folder_and_a_missing_shard(tmp_path):
    """save_pretrained's sharded layout (model.safetensors.index.json) loads the same; a shard gone is named."""
    folder = str(tmp_path / "m")
    ref = save_hf(folder, max_shard_size="100KB")
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    x = tokens()
    assert float((our_logits(hf.from_pretrained(folder), x) - hf_logits(ref, x)).abs().max()) < 1e-5
    os.remove(os.path.join(folder, shards[1]))
    refused(tmp_path, folder, [], f"shard {shards[1]} (named in model.safetensors.index.json) is missing")


@pytest.mark.quick
def test_mixtral_experts_read_by_rank(tmp_path):
    """What hf.load asks for one rank under parallel.ep=2: its half of a stacked expert tensor, read from those
    experts' file tensors alone; the values are the whole stack's rows, each expert's w1/w3/w2 transposed."""
    folder = str(tmp_path / "m")
    ref = save_hf(folder, "mixtral", tokenizer=False)
    s = hf.settings(hf.read_config(folder))
    reader = hf.Reader(folder, s)
    experts = ref.model.layers[1].mlp.experts  # transformers' merged layout in memory: gate_up (E, 2I, d), down
    for ours, full in (("gate", experts.gate_up_proj[:, :128]), ("up", experts.gate_up_proj[:, 128:]),
                       ("down", experts.down_proj)):
        reader.read = 0
        got = reader.rect(f"blocks.1.mlp.experts.{ours}", (2, 0, 0), (2, *full.shape[:0:-1]))
        assert torch.equal(got, full[2:].transpose(1, 2)), ours
        assert reader.read == got.numel() == full.numel() // 2  # experts 2 and 3, no more


# --- bad input: one line, before anything is written
def refused(tmp_path, folder, extra, message, tokenizer=True, model_hf=True):
    """train.check_config stops with one line saying `message`, and the run dir is never made. `tokenizer`: the run
    reads DIR's tokenizer (else the BPE); `model_hf`: model=hf (else the default preset, gpt_tiny)."""
    drop = {"data.tokenizer=hf"} if not tokenizer else set()
    drop |= {"model=hf"} if not model_hf else set()
    overrides = [o for o in hf_run(folder) if o not in drop] + list(extra)
    if "data.tokenizer=bpe" in extra:
        overrides.remove("data.tokenizer=hf")
    with pytest.raises((ConfigError, DataError)) as err:
        train.check_config(make_cfg(*overrides), str(tmp_path / "run"), 1)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


def edit_config(folder, **changes):
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    c.update(changes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)


@pytest.mark.quick
@pytest.mark.parametrize("case,message", [
    ("missing", "no such directory"),
    ("no_config", "is not a Hugging Face model: config.json unreadable"),
    ("gpt2", "holds a model_type=gpt2 model; nanoparallel reads llama, qwen2 and mixtral"),
    ("rope_scaling", "config.json sets rope_scaling {'rope_type': 'llama3'"),
    ("sliding", "config.json sets use_sliding_window=true"),
    ("unknown", "config.json sets qk_norm (a setting nanoparallel doesn't model)"),
    ("no_weights", "is incomplete: no model.safetensors or model.safetensors.index.json"),
    ("conflict", "model.n_layer=3 conflicts with"),
    ("preset", "model.n_layer=4 conflicts with"),  # model=gpt_tiny's shape, not model=hf
    ("bpe_vocab", "data.tokenizer=bpe has 512 tokens, more than"),
    ("hf_vocab", "data.tokenizer=hf has 400 tokens, more than"),
    ("no_tokenizer", "has no tokenizer.json"),
])
def test_bad_hf_dir(tmp_path, llama_dir, case, message):
    folder = str(tmp_path / "m")
    shutil.copytree(llama_dir[0], folder)
    extra = {"conflict": ["model.n_layer=3"], "bpe_vocab": ["data.tokenizer=bpe"]}.get(case, [])
    if case == "missing":
        folder += "-not-there"
    if case == "no_config":
        os.remove(os.path.join(folder, "config.json"))
    if case == "gpt2":
        edit_config(folder, model_type="gpt2")
    if case == "rope_scaling":
        edit_config(folder, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    if case == "sliding":
        edit_config(folder, use_sliding_window=True)
    if case == "unknown":
        edit_config(folder, qk_norm=True)
    if case == "no_weights":
        os.remove(os.path.join(folder, "model.safetensors"))
    if case == "hf_vocab":  # another folder's tokenizer, larger than this model's vocab
        hf_tokenizer(str(tmp_path / "big"), vocab=400)
        extra = [f"data.tokenizer_dir={tmp_path / 'big'}"]
    if case == "no_tokenizer":
        os.remove(os.path.join(folder, "tokenizer.json"))
    refused(tmp_path, folder, extra, message, model_hf=case != "preset")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf") / "mixtral")
    return folder, save_hf(folder, "mixtral")


@pytest.mark.quick
@pytest.mark.parametrize("change,extra,message", [
    ({"sliding_window": 32}, [], "config.json sets sliding_window=32 (ours attends to the whole context, "
                                 "max_position_embeddings=64): our model can't reproduce it"),
    ({"router_jitter_noise": 0.1}, [], "config.json sets router_jitter_noise=0.1 (ours routes without noise)"),
    ({}, ["model.n_experts=8"], "model.n_experts=8 conflicts with"),
    ({}, ["model.capacity_factor=1.0"], "model.capacity_factor=1.0 conflicts with"),
    ({}, ["model.router=bias"], "model.router=bias conflicts with"),
])
def test_bad_mixtral_dir(tmp_path, mixtral_dir, change, extra, message):
    folder = str(tmp_path / "m")
    shutil.copytree(mixtral_dir[0], folder)
    edit_config(folder, **change)
    refused(tmp_path, folder, extra, message)


@pytest.mark.quick
def test_mixtral_dir_settings(tmp_path, mixtral_dir, llama_dir):
    """A sliding window as long as the context is full attention: accepted. The MoE's settings are config.json's;
    a Llama folder is a dense model, so model.n_experts set on one conflicts."""
    folder = str(tmp_path / "m")
    shutil.copytree(mixtral_dir[0], folder)
    edit_config(folder, sliding_window=64, router_aux_loss_coef=0.02)
    cfg = make_cfg(*hf_run(folder))
    train.check_config(cfg, str(tmp_path / "run"), 1)
    m = cfg.model
    assert (m.n_experts, m.top_k, m.moe_every, m.dense_layers, m.n_shared_experts, m.expert_ffn_hidden, m.router,
            m.aux_loss_coef, m.capacity_factor) == (4, 2, 1, 0, 0, 128, "aux", 0.02, None)
    refused(tmp_path, llama_dir[0], ["model.n_experts=4"], "model.n_experts=4 conflicts with")


@pytest.mark.quick
@pytest.mark.parametrize("change,message", [
    ({"router": "bias"}, "model.router=bias with model.n_experts=4: Mixtral balances by an aux loss"),
    ({"n_shared_experts": 1}, "model.n_shared_experts=1 with model.n_experts=4: Mixtral has no shared experts"),
    ({"dense_layers": 1}, "model.dense_layers=1 with model.n_experts=4: every block of Mixtral's is an MoE"),
    ({"moe_every": 2}, "model.moe_every=2 with model.n_experts=4: every block of Mixtral's is an MoE"),
    ({"capacity_factor": 1.25}, "model.capacity_factor=1.25 with model.n_experts=4: Mixtral drops no tokens"),
    ({"qkv_bias": True}, "model.qkv_bias=True with model.n_experts=4: Mixtral's attention has no biases"),
])
def test_export_refuses_an_moe_mixtral_cannot_express(change, message):
    m = {**dataclasses.asdict(GPTConfig(n_layer=2, mlp="swiglu", n_experts=4)), **change}
    with pytest.raises(ConfigError) as err:
        hf.hf_config(m, {})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.quick
@pytest.mark.parametrize("overrides,message", [
    (["model=hf"], "model.n_layer is null: model=hf takes the shape from train.init_from=hf:DIR, which is not set"),
    (["train.init_from=some/dir"], "train.init_from=some/dir: expected hf:DIR"),
])
def test_init_from_settings(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        train.check_config(make_cfg(*[o for o in small_run() if not o.startswith("model.")], *overrides),
                           str(tmp_path / "run"), 1)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.quick
def test_a_shorter_context_is_no_conflict(llama_dir, tmp_path):
    cfg = make_cfg(*hf_run(llama_dir[0], "model.block_size=32", "train.seq_len=32"))
    train.check_config(cfg, str(tmp_path / "run"), 1)
    assert cfg.model.block_size == 32 and cfg.model.n_layer == 2 and cfg.model.n_kv_head == 2


def test_export_refuses_a_folder_with_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError) as err:
        hf.export(str(tmp_path / "no-checkpoint"), str(out))
    assert "already holds files" in str(err.value) and (out / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(out)) == ["keep.txt"]


# --- round trips: HF -> train.py (lr 1e-30: nothing moves) -> export -> transformers gives the original logits
def assert_round_trip(run_dir, folder, out):
    """The export of run_dir's last checkpoint gives the logits of HF folder `folder`'s model, and its tokenizer
    tokenizes as the folder's does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    n, step = hf.export(run_dir, out)
    ref, back = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (folder, out))
    x = tokens()
    gap = float((hf_logits(back, x) - hf_logits(ref, x)).abs().max())
    print(f"{os.path.basename(run_dir)}: round trip's largest logit gap {gap:.1e}")
    assert gap < 1e-4 and step == 2
    text = "def f(x):\n    return x\n"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(folder)(text)[
        "input_ids"]


def test_round_trip_single_tied_qwen2(tmp_path, capsys):
    """One process, a tied Qwen2 with q/k/v biases: its own tokenizer tokenizes the corpus, and its export carries
    the tokenizer's files. Run again in the same run dir with more steps, it goes on from its own checkpoint: the
    weights it trained, not DIR's again (train.init_from only starts a run)."""
    folder = str(tmp_path / "qwen2")
    save_hf(folder, "qwen2", tied=True)
    run_dir = str(tmp_path / "run")
    train.run(make_cfg(*hf_run(folder)), run_dir)
    assert "init_from: " in capsys.readouterr().out
    out = str(tmp_path / "out")
    assert_round_trip(run_dir, folder, out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen2"

    train.run(make_cfg(*hf_run(folder, "optim.lr=1e-2", "train.max_steps=3")), run_dir)
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step 2" in printed and "init_from: " not in printed, printed
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == [1, 2, 3], steps  # 1 and 2 from the first run, 3 from the resumed one (not 1, 2, 3 again)


def test_our_moe_exported_as_mixtral(tmp_path):
    """Ours -> export -> transformers: an MoE of our own, trained 2 steps (its router and experts moved off their
    initialization), exported as a Mixtral, gives our logits; the export's config.json says what it is."""
    import sample
    from transformers import AutoModelForCausalLM
    run_dir = str(tmp_path / "run")
    train.run(make_cfg(*small_run("model.mlp=swiglu", "model.n_head=4", "model.n_kv_head=2", "model.n_experts=4",
                                  "model.top_k=2", "model.expert_ffn_hidden=96", "model.aux_loss_coef=0.02",
                                  "train.max_steps=2", "train.eval_every=100")), run_dir)
    checkpoint.export(run_dir, str(tmp_path / "ours.safetensors"))
    ours = sample.load(str(tmp_path / "ours.safetensors"))[0]
    out = str(tmp_path / "out")
    hf.export(run_dir, out)
    c = json.load(open(os.path.join(out, "config.json")))
    assert (c["model_type"], c["architectures"], c["num_local_experts"], c["num_experts_per_tok"],
            c["intermediate_size"], c["router_aux_loss_coef"], c["sliding_window"], c["router_jitter_noise"]) == (
        "mixtral", ["MixtralForCausalLM"], 4, 2, 96, 0.02, None, 0.0)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = float((ours(x)[..., :512] - back(x).logits).abs().max())
    print(f"our MoE as a Mixtral: largest logit gap {gap:.1e}")
    assert gap < 1e-5


# ours (segments of flattened shards, blocks of rows and columns) and torch's (DTensor shards); a Mixtral's experts
# split over 2 ranks (parallel.ep over DDP: each rank reads its own experts, all the rest)
LAYOUTS = {"fsdp": ["parallel=fsdp"], "tp": ["parallel=tp"], "fsdp_torch": ["parallel=fsdp", "parallel.impl=torch"],
           "tp_torch": ["parallel=tp", "parallel.impl=torch"], "ep_mixtral": ["parallel=ddp", "parallel.ep=2"]}


@launch_jobs(2)
def jobs(root, request):
    for kind in ("llama", "mixtral"):
        save_hf(str(root / kind), kind)
    return {name: (str(root / name), hf_run(str(root / folder_of(name)), *o)) for name, o in LAYOUTS.items()}


def folder_of(name):
    return "mixtral" if name == "ep_mixtral" else "llama"


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_two_ranks(launch2, tmp_path, name):
    """fsdp x 2 and tp x 2 read the HF files, each rank its own pieces (rank 0 reads about half the values), train
    2 steps, and the export is the original model."""
    dirs, p = launch2[__name__]
    run_dir = dirs[name]
    folder = os.path.join(os.path.dirname(run_dir), folder_of(name))
    read, total = map(float, re.search(r"rank 0 read ([\d.]+)M of the model's ([\d.]+)M", job_output(p, run_dir))
                      .groups())
    print(f"{name}: rank 0 read {read:.3f}M of the model's {total:.3f}M values")
    if name == "ep_mixtral":  # every value in the files but the other rank's 2 of each block's 4 experts (to 0.01M)
        from safetensors import safe_open
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        mine = sum(math.prod(v) for k, v in sizes.items() if not re.search(r"experts\.[23]\.", k))
        assert abs(read - mine / 1e6) <= 0.005 and mine < 0.7 * sum(math.prod(v) for v in sizes.values()), (read, mine)
    else:
        assert read < 0.6 * total, (read, total)
    assert_round_trip(run_dir, folder, str(tmp_path / "out"))


@pytest.mark.quick
def test_planner_reads_the_shape_from_the_folder(llama_dir):
    """tools/plan.py with model=hf train.init_from=hf:DIR plans DIR's model: every number it predicts equals the
    planner's for the same shape written out as model.* settings (SHAPE above: SwiGLU, 2 of 4 heads for keys and
    values, untied)."""
    from tools import plan
    world = ["plan.world=8", "parallel=fsdp", "parallel.tp=2", "train.seq_len=64", "data.tokenizer=hf",
             f"data.tokenizer_dir={llama_dir[0]}"]
    from_dir = plan.compose(["model=hf", f"train.init_from=hf:{llama_dir[0]}", *world])
    written = plan.compose(["model=llama_tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
                            "model.n_kv_head=2", "model.ffn_hidden=128", "model.block_size=64", "model.vocab_size=320",
                            "model.tie_embeddings=false", "model.rope_theta=500000.0", "model.norm_eps=1e-5", *world])
    got, want = (plan.predict(c, plan.check(c), shape=plan.model_shape(c)) for c in (from_dir, written))
    assert from_dir.model.n_kv_head == 2 and from_dir.model.mlp == "swiglu"
    assert got == want and got["state"] > 0
