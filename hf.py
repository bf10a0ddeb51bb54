"""Hugging Face checkpoints in and out: Llama, Qwen2 and Mixtral as `save_pretrained` writes them (config.json,
safetensors).

Design choices:
- In (`model=hf train.init_from=hf:DIR`): our model's shape is read from DIR/config.json (`settings`), every
  `model.*` setting that is not null must agree with it, and everything is checked (files, shards, tensor names and
  shapes, read from the safetensors headers) before any work. The weights are filled after `parallelize`, where a
  resumed run reads its checkpoint: each rank walks the same pieces a checkpoint load fills (checkpoint.state_dict:
  its rectangles of each global tensor, our FSDP's segments, tp's blocks, torch's DTensor shards) and reads each
  rectangle from the file with `safe_open(...).get_slice(...)`, which reads only those bytes. No rank reads the whole
  model unless it holds the whole model.
- The one mapping is `hf_names`: our parameter -> the HF tensors it is made of. q_proj, k_proj, v_proj become our
  fused qkv, rows grouped per key/value head (model.py); a rectangle of qkv rows is read as runs of whole head rows
  from the three. The vocab is padded to a multiple of 128: the padded rows of the embedding and head are zeros.
- Mixtral: every block our MoE (router=aux: softmax, top-k, the k scores renormalized; dropless; no shared
  experts), Llama's attention. Our experts are stacked (E, in, out); the file holds each expert's (out, in) matrices
  (`block_sparse_moe.experts.j.w1/w3/w2`, the hub's layout, which save_pretrained writes): a rectangle of experts
  [e0, e0 + n) reads those experts' slices only, so under parallel.ep a rank reads its own experts.
- Out (`python -m tools.hf export CHECKPOINT OUT_DIR`): any checkpoint consolidated on one process (checkpoint.py),
  qkv unfused, the padded rows trimmed, written as a LlamaConfig (a Qwen2Config where q/k/v have biases, a
  MixtralConfig where the blocks are MoE) and one model.safetensors, with the tokenizer's files where the run used an
  HF one (data.tokenizer=hf). An MoE that Mixtral can't express is refused, the setting named.
"""
import json
import os

import torch

from config import ConfigError

ARCHS = ("llama", "qwen2", "mixtral")
# Mixtral's own config.json keys (settings reads the first four; output_router_logits only says whether HF's forward
# returns the router logits and adds its balancing loss)
MOE_KEYS = {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise",
            "output_router_logits"}
# config.json keys that change nothing our model computes (generation, bookkeeping, HF's own switches)
IGNORED = {"architectures", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
           "pad_token_id", "use_cache", "initializer_range", "pretraining_tp", "_name_or_path", "output_hidden_states",
           "output_attentions", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
           "is_encoder_decoder", "tokenizer_class", "max_window_layers", "sliding_window", "model_type"}
# model.* settings config.json decides (conf/model/hf.yaml leaves them all null)
DECIDED = ("n_layer", "n_head", "n_embd", "n_kv_head", "mlp", "ffn_hidden", "tie_embeddings", "rope_theta",
           "norm_eps", "qkv_bias", "vocab_size", "block_size")


def hf_dir(cfg):
    """DIR of train.init_from=hf:DIR, or None."""
    src = cfg.train.get("init_from")
    if not src:
        return None
    if not str(src).startswith("hf:") or len(str(src)) == 3:
        raise ConfigError(f"train.init_from={src}: expected hf:DIR, DIR a folder written by save_pretrained")
    return os.path.expanduser(str(src)[3:])


def read_config(path):
    """DIR/config.json as a dict; ConfigError if DIR or it is missing or is not a Llama, Qwen2 or Mixtral model's."""
    if not os.path.isdir(path):
        raise ConfigError(f"train.init_from=hf:{path}: no such directory")
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a Hugging Face model: config.json unreadable ({type(e).__name__})") from None
    if c.get("model_type") not in ARCHS:
        raise ConfigError(f"{path} holds a model_type={c.get('model_type')} model; nanoparallel reads llama, qwen2 "
                          f"and mixtral")
    return c


def settings(c, path="DIR"):
    """Our model.* settings from config.json `c`. A setting we don't model is refused, not dropped."""
    kind, head_dim = c["model_type"], c["hidden_size"] // c["num_attention_heads"]
    moe = kind == "mixtral"
    rope = dict(c.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    context, window = c.get("max_position_embeddings", 2048), c.get("sliding_window") if moe else None
    dim = c.get("head_dim") or head_dim  # Mixtral writes null: hidden_size / heads
    problems = [
        scaling and f"rope_scaling {scaling} (only plain RoPE is modelled)",
        c.get("hidden_act", "silu") != "silu" and f"hidden_act={c['hidden_act']} (SwiGLU is silu's)",
        c.get("mlp_bias") and "mlp_bias=true",
        kind != "qwen2" and c.get("attention_bias") and "attention_bias=true (o_proj's bias too; ours has none)",
        c.get("attention_dropout") and f"attention_dropout={c['attention_dropout']}",
        dim != head_dim and f"head_dim={dim} (not hidden_size / heads = {head_dim})",
        c.get("use_sliding_window") and "use_sliding_window=true",
        any(t != "full_attention" for t in c.get("layer_types") or []) and "sliding-window layers (layer_types)",
        # a window as long as the context never hides a key: the same attention as ours
        window is not None and window < context and f"sliding_window={window} (ours attends to the whole "
                                                    f"context, max_position_embeddings={context})",
        moe and c.get("router_jitter_noise") and f"router_jitter_noise={c['router_jitter_noise']} (ours routes "
                                                 f"without noise)",
    ]
    known = IGNORED | {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "intermediate_size", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
                       "tie_word_embeddings", "vocab_size", "max_position_embeddings", "attention_bias",
                       "attention_dropout", "head_dim", "hidden_act", "mlp_bias", "use_sliding_window", "layer_types"}
    known |= MOE_KEYS if moe else set()
    problems += [f"{k} (a setting nanoparallel doesn't model)" for k in sorted(c.keys() - known)]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(f"{path}/config.json sets {problems[0]}: our model can't reproduce it")
    out = {"n_layer": c["num_hidden_layers"], "n_head": c["num_attention_heads"], "n_embd": c["hidden_size"],
           "n_kv_head": c.get("num_key_value_heads") or c["num_attention_heads"], "mlp": "swiglu",
           "ffn_hidden": c["intermediate_size"], "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
           "rope_theta": float(theta), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
           "qkv_bias": kind == "qwen2", "vocab_size": c["vocab_size"], "block_size": context, "n_experts": 0}
    if moe:  # every block an MoE of intermediate_size experts, routed as ours with router=aux, dropless
        out.update(n_experts=c["num_local_experts"], top_k=c.get("num_experts_per_tok", 2), moe_every=1,
                   dense_layers=0, n_shared_experts=0, expert_ffn_hidden=c["intermediate_size"], router="aux",
                   aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)), capacity_factor=None)
    return out


def apply(cfg):
    """With train.init_from=hf:DIR, fill cfg.model from DIR/config.json (in place; idempotent) and check DIR's
    weights, before any work. A model.* setting that is set and disagrees is a one-line ConfigError; model.block_size
    may be shorter than max_position_embeddings (the same model over a shorter context)."""
    path = hf_dir(cfg)
    m = cfg.model
    if path is None:
        unset = [k for k in DECIDED if m.get(k) is None and k not in ("n_kv_head", "ffn_hidden", "norm_eps",
                                                                     "vocab_size")]
        if unset:
            raise ConfigError(f"model.{unset[0]} is null: model=hf takes the shape from train.init_from=hf:DIR, "
                              f"which is not set")
        return
    want = settings(read_config(path), path)
    for k, v in want.items():
        have = m.get(k)
        if have is not None and have != v and not (k == "block_size" and have <= v):
            raise ConfigError(f"model.{k}={have} conflicts with {path}/config.json, which makes it {v}; with "
                              f"train.init_from=hf:DIR use model=hf, whose settings are null: config.json's")
        m[k] = have if k == "block_size" and have is not None else v
    if cfg.data.tokenizer == "hf" and not cfg.data.get("tokenizer_dir"):
        cfg.data.tokenizer_dir = path  # DIR's own tokenizer files
    check_weights(path, want)
    from data import prepare
    n = prepare.vocab_size(cfg.data)
    if n > want["vocab_size"]:  # token ids past the embedding's rows
        hint = "a tokenizer of this model's" if cfg.data.tokenizer == "hf" else "DIR's own, data.tokenizer=hf"
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} has {n} tokens, more than {path}'s model embeds "
                          f"(config.json vocab_size={want['vocab_size']}): use {hint}")


def tensor_files(path):
    """{HF tensor name: safetensors file} of DIR, one file or sharded with model.safetensors.index.json; ConfigError
    naming what is missing."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = {name: os.path.join(path, shard) for name, shard in json.load(f)["weight_map"].items()}
        for shard in sorted(set(files.values())):
            if not os.path.exists(shard):
                raise ConfigError(f"{path} is incomplete: shard {os.path.basename(shard)} (named in "
                                  f"model.safetensors.index.json) is missing")
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ConfigError(f"{path} is incomplete: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}  # our stacked experts' projections -> Mixtral's per expert


def hf_names(name, s):
    """The HF tensors our parameter `name` is made of (settings `s`): one, q/k/v for the fused qkv, or one per
    expert for a stack of experts."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        kind = rest.rsplit(".", 1)[1]  # weight or bias (or an expert stack's gate, up, down)
        p = f"model.layers.{i}."
        if rest.startswith("attn.qkv."):
            return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
        if rest.startswith("mlp.experts."):
            return [f"{p}block_sparse_moe.experts.{j}.{EXPERT[kind]}.weight" for j in range(s["n_experts"])]
        return [p + {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                     "attn.proj.weight": "self_attn.o_proj.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
                     "mlp.up.weight": "mlp.up_proj.weight", "mlp.down.weight": "mlp.down_proj.weight",
                     "mlp.router.weight": "block_sparse_moe.gate.weight"}[rest]]
    return [{"wte.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}[name]]


def is_qkv(name):
    return ".attn.qkv." in name


def is_experts(name):
    return ".mlp.experts." in name


def hf_shapes(s):
    """{HF tensor name: shape} that a model of settings `s` is stored as (lm_head absent when tied)."""
    from model import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(**s))
    d, hd, out = s["n_embd"], s["n_embd"] // s["n_head"], {}
    for name, p in model.named_parameters():
        names = hf_names(name, s)
        if is_qkv(name):  # q, k, v: n_head, n_kv_head, n_kv_head heads of rows
            for n, heads in zip(names, (s["n_head"], s["n_kv_head"], s["n_kv_head"])):
                out[n] = (heads * hd, d) if n.endswith("weight") else (heads * hd,)
        elif is_experts(name):  # ours (E, in, out), each expert's in the file (out, in)
            out.update({n: tuple(p.shape[:0:-1]) for n in names})
        else:
            out[names[0]] = (s["vocab_size"], d) if name in ("wte.weight", "head.weight") else tuple(p.shape)
    return out


def check_weights(path, s):
    """Every tensor the model needs is in DIR's files with its shape (read from the headers alone)."""
    from safetensors import safe_open
    files = tensor_files(path)
    for name, shape in hf_shapes(s).items():
        if name not in files:
            raise ConfigError(f"{path} is incomplete: no tensor {name} in its safetensors files")
        with safe_open(files[name], "pt") as f:
            got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise ConfigError(f"{path}: {name} has shape {list(got)}, config.json implies {list(shape)}")


class Reader:
    """Rectangles of our parameters read from DIR's safetensors, each through get_slice: only its bytes."""

    def __init__(self, path, s):
        self.s, self.files, self.open, self.read = s, tensor_files(path), {}, 0

    def slice(self, name):
        from safetensors import safe_open
        file = self.files[name]
        if file not in self.open:  # each file opened once: its header read, its tensors left where they are
            self.open[file] = safe_open(file, "pt")
        return self.open[file].get_slice(name)

    def rect(self, name, offsets, sizes):
        """Our parameter `name`'s rectangle at `offsets` of `sizes` (rows, and columns for a matrix)."""
        if is_experts(name):
            return self.experts(name, offsets, sizes)
        (r0, n), cols = (offsets[0], sizes[0]), tuple(slice(o, o + k) for o, k in zip(offsets[1:], sizes[1:]))
        out = torch.zeros(sizes, dtype=torch.float32)  # padded vocab rows stay zero
        for hf_name, src, dst, k in self.runs(name, r0, n):
            out[dst: dst + k] = self.slice(hf_name)[(slice(src, src + k), *cols)].float()
            self.read += k * (out[0].numel() if out.dim() > 1 else 1)
        return out

    def experts(self, name, offsets, sizes):
        """Experts [e0, e0 + n) of a stack, a block of their (in, out) matrices: each the transpose of its block of
        the expert's (out, in) tensor in the file, read alone."""
        (e0, a0, b0), (n, a, b) = offsets, sizes
        out = torch.stack([self.slice(hf_name)[b0: b0 + b, a0: a0 + a].float().T
                           for hf_name in hf_names(name, self.s)[e0: e0 + n]])
        self.read += out.numel()
        return out

    def runs(self, name, r0, n):
        """[(HF tensor, its first row, the row in the rectangle, rows)] that rows [r0, r0 + n) of `name` are."""
        names, s = hf_names(name, self.s), self.s
        if not is_qkv(name):
            # the tied head is the embedding: read embed_tokens where the file has no lm_head
            hf_name = names[0] if names[0] in self.files else "model.embed_tokens.weight"
            last = s["vocab_size"] if name in ("wte.weight", "head.weight") else r0 + n
            return [(hf_name, r0, 0, min(n, last - r0))] if r0 < last else []
        # fused qkv: blocks of head_dim rows; block b is group g's slot j (its rep query heads, then k, then v)
        hd, rep, out, r = s["n_embd"] // s["n_head"], s["n_head"] // s["n_kv_head"], [], r0
        while r < r0 + n:
            (g, j), within = divmod(r // hd, rep + 2), r % hd
            k = min(hd - within, r0 + n - r)
            hf_name, head = (names[0], g * rep + j) if j < rep else (names[j - rep + 1], g)
            out.append((hf_name, head * hd + within, r - r0, k))
            r += k
        return out


@torch.no_grad()
def load(path, par, s):
    """Fill this rank's pieces of every parameter from DIR (every rank calls it, after parallelize). Returns the
    values this rank read."""
    import checkpoint
    from torch.distributed.checkpoint.metadata import MetadataIndex
    reader = Reader(path, s)
    sd, _ = checkpoint.state_dict(par)
    for key, t in sd.items():
        if not key.startswith("model."):
            continue
        # the protocol DCP itself loads through: this rank's chunks of the global tensor and the tensors they fill
        for chunk in t.__create_chunk_list__():
            dst = t.__get_tensor_shard__(MetadataIndex(key, chunk.offsets))
            if dst.numel():
                dst.copy_(reader.rect(key[len("model."):], tuple(chunk.offsets), tuple(chunk.sizes)))
    par.data.after_load()  # ZeRO in mixed precision: the bf16 working weights from the fp32 masters
    return reader.read


@torch.no_grad()
def from_pretrained(path):
    """Our GPT with DIR's weights, whole, on this one process (what the logit tests compare with transformers')."""
    from model import GPT, GPTConfig
    s = settings(read_config(path), path)
    check_weights(path, s)
    with torch.device("meta"):
        model = GPT(GPTConfig(**s))
    model.to_empty(device="cpu")
    reader = Reader(path, s)
    for name, p in model.named_parameters():
        p.copy_(reader.rect(name, (0,) * p.dim(), tuple(p.shape)))
    model.init_buffers()  # the RoPE tables (to_empty leaves them unset), and the tie
    return model.eval()


# --- out
def hf_config(m, tok):
    """The transformers config of our model settings `m` (a checkpoint's state.json "model")."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config
    from data import tokenizer
    from model import GPTConfig
    g = GPTConfig(**m)
    if g.mlp != "swiglu":
        raise ConfigError(f"model.mlp={g.mlp}: only Llama-shaped (swiglu) models have a Hugging Face twin")
    # an MoE is Mixtral's when routed, balanced and laid out as Mixtral's: every block, no shared experts, no drops
    unlike = [("router", g.router != "aux", "Mixtral balances by an aux loss, not by biases"),
              ("n_shared_experts", g.n_shared_experts, "Mixtral has no shared experts"),
              ("dense_layers", g.dense_layers, "every block of Mixtral's is an MoE"),
              ("moe_every", g.moe_every != 1, "every block of Mixtral's is an MoE"),
              ("capacity_factor", g.capacity_factor is not None, "Mixtral drops no tokens"),
              ("qkv_bias", g.qkv_bias, "Mixtral's attention has no biases")]
    for k, bad, why in unlike:
        if g.n_experts and bad:
            raise ConfigError(f"model.{k}={getattr(g, k)} with model.n_experts={g.n_experts}: {why}, so this "
                              f"model has no Hugging Face twin")
    kind = "Mixtral" if g.n_experts else "Qwen2" if g.qkv_bias else "Llama"
    eot = tokenizer.eot_of_spec(tok)
    common = dict(vocab_size=g.vocab_size, hidden_size=g.n_embd, num_hidden_layers=g.n_layer,
                  num_attention_heads=g.n_head, num_key_value_heads=g.kv_heads, max_position_embeddings=g.block_size,
                  rms_norm_eps=g.norm_eps or torch.finfo(torch.float32).eps,  # null: torch's default, fp32's
                  tie_word_embeddings=g.tie_embeddings, bos_token_id=eot, eos_token_id=eot,
                  rope_parameters={"rope_type": "default", "rope_theta": g.rope_theta}, dtype="float32",
                  architectures=[f"{kind}ForCausalLM"])
    if kind == "Mixtral":  # Llama's attention, every MLP a mixture routed as ours with router=aux
        return MixtralConfig(**common, intermediate_size=g.expert_hidden, head_dim=g.head_dim,
                             num_local_experts=g.n_experts, num_experts_per_tok=g.top_k,
                             router_aux_loss_coef=g.aux_loss_coef, router_jitter_noise=0.0, sliding_window=None)
    if kind == "Qwen2":  # q, k, v biases and nothing else: Qwen2's attention
        return Qwen2Config(**common, intermediate_size=g.hidden, use_sliding_window=False)
    return LlamaConfig(**common, intermediate_size=g.hidden, head_dim=g.head_dim, attention_bias=False,
                       mlp_bias=False)


def export(path, out):
    """Checkpoint `path` (any layout) -> OUT_DIR that transformers' from_pretrained loads. Never writes into a
    folder that holds files. Returns (parameters, step)."""
    import shutil
    from safetensors.torch import save_file
    import checkpoint
    from model import GPTConfig, unfuse_qkv
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise checkpoint.CheckpointError(f"{out} already holds files; export to a new or empty folder")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise checkpoint.CheckpointError(f"{os.path.dirname(out)}: no such directory")
    weights, info, tok = checkpoint.consolidate(checkpoint.find(path))
    m = info["model"]
    try:
        config = hf_config(m, tok)
    except ConfigError as e:
        raise checkpoint.CheckpointError(str(e)) from None
    gcfg = GPTConfig(**m)
    tensors = {}
    for name, w in weights.items():
        names = hf_names(name, m)
        if is_qkv(name):
            parts = unfuse_qkv(w, gcfg)
        elif is_experts(name):  # (E, in, out) -> each expert's (out, in)
            parts = [e.T for e in w]
        else:
            parts = (w[:m["vocab_size"]] if name in ("wte.weight", "head.weight") else w,)
        tensors.update({n: p.contiguous() for n, p in zip(names, parts)})
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name, text in (tok.get("files") or {}).items():  # an HF tokenizer's own files, as the run read them
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(tmp, out)
    return sum(t.numel() for t in tensors.values()), info["step"]
