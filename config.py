"""The configuration's schema and every check that can be made before work starts, in one place that train.py, the
planner and the tools read.

The values live in conf/ (YAML, composed by Hydra); this file says what each may be: its type (the dataclasses
below, checked by OmegaConf's structured configs), its allowed values (`choice`) and range (`at_least`, `above`,
`below`), then the rules that tie settings together (heads that divide the width, degrees that multiply to the
world size, a batch that splits over the data-parallel ranks). Every problem is one line, raised as ConfigError
before anything is prepared or written.

The parallel layout (the mesh's degrees, the data strategy, the implementation) and its rules live in
parallel/layout.py, the one rule book that train.py, the planner and the dry run share; `check` applies it here.
"""
import dataclasses
import functools
import shutil
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model import GPTConfig
from parallel.layout import CP_METHODS, DATA_STRATEGIES, DTYPES, IMPLS, PP_SCHEDULES, Layout, LayoutError, _or



class ConfigError(ValueError):
    """A setting that can't work; reported as one line before any work."""


def choice(*values):
    return field(default=MISSING, metadata={"choices": values})


def at_least(lo):
    return field(default=MISSING, metadata={"min": lo})


def above(lo, below=None):
    return field(default=MISSING, metadata={"gt": lo, "lt": below})


@dataclass
class Train:
    global_batch_size: int = at_least(1)
    micro_batch_size: int = at_least(1)
    seq_len: int = at_least(1)
    max_steps: int = at_least(1)
    eval_every: int = at_least(1)
    eval_steps: int = at_least(1)
    eval_batch_size: Optional[int] = at_least(1)
    log_every: int = at_least(1)
    seed: int = MISSING
    dtype: str = choice("auto", "float32", "bfloat16")
    device: str = choice("auto", "cpu", "cuda")
    compile: bool = MISSING
    profile: bool = MISSING
    peak_tflops: Optional[float] = field(default=None, metadata={"gt": 0})
    activation_checkpointing: str = choice("none", "full", "every_n", "selective")
    ac_every: int = at_least(1)
    selective_matmuls: str = choice("all", "alternate")
    out_dir: str = MISSING
    resume: Optional[str] = MISSING
    init_from: Optional[str] = None
    sample_tokens: int = at_least(0)
    sample_prompt: str = MISSING


@dataclass
class Parallel:
    dp: Optional[int] = at_least(1)
    tp: Optional[int] = at_least(1)
    cp: Optional[int] = at_least(1)
    cp_method: str = choice(*CP_METHODS)
    dp_shard: Optional[int] = at_least(1)
    dp_replicate: Optional[int] = at_least(1)
    data: str = choice(*DATA_STRATEGIES)
    impl: str = choice(*IMPLS)
    sequence_parallel: bool = MISSING
    bucket_mb: float = above(0)
    reduce_dtype: str = choice(*DTYPES)
    param_dtype: str = choice("auto", *DTYPES)
    accumulate: str = choice("local", "sharded")
    blocks_per_unit: int = at_least(1)
    reshard_after_forward: bool = MISSING
    prefetch: int = at_least(0)
    cpu_offload: bool = MISSING
    pp: Optional[int] = at_least(1)
    pp_schedule: str = choice(*PP_SCHEDULES)
    pp_virtual: int = at_least(1)
    ep: int = at_least(1)
    auto: bool = MISSING


@dataclass
class Model:  # Optional throughout: model=hf leaves them null for train.init_from's config.json (hf.py)
    n_layer: Optional[int] = at_least(1)
    n_head: Optional[int] = at_least(1)
    n_embd: Optional[int] = at_least(1)
    block_size: Optional[int] = at_least(1)
    vocab_size: Optional[int] = at_least(1)
    n_kv_head: Optional[int] = at_least(1)
    mlp: Optional[str] = choice("gelu", "swiglu")
    ffn_hidden: Optional[int] = at_least(1)
    ffn_multiple: int = at_least(1)
    tie_embeddings: Optional[bool] = MISSING
    rope_theta: Optional[float] = above(0)
    norm_eps: Optional[float] = field(default=None, metadata={"gt": 0})
    qkv_bias: Optional[bool] = MISSING
    # mixture of experts (model.py's MoE): n_experts 0 is a dense model, and the rest must then stay null; n_experts
    # null only in model=hf, for config.json to decide (hf.py)
    n_experts: Optional[int] = at_least(0)
    top_k: Optional[int] = at_least(1)
    moe_every: Optional[int] = at_least(1)
    dense_layers: Optional[int] = at_least(0)
    n_shared_experts: Optional[int] = at_least(0)
    expert_ffn_hidden: Optional[int] = at_least(1)
    router: Optional[str] = choice("aux", "bias")
    aux_loss_coef: Optional[float] = at_least(0)
    bias_update_rate: Optional[float] = at_least(0)
    capacity_factor: Optional[float] = field(default=None, metadata={"gt": 0})


MOE_SETTINGS = ("top_k", "moe_every", "dense_layers", "n_shared_experts", "expert_ffn_hidden", "router",
                "aux_loss_coef", "bias_update_rate", "capacity_factor")


@dataclass
class Optim:
    name: str = choice("adamw", "sgd")
    lr: float = above(0)
    min_lr: float = at_least(0)
    warmup_steps: int = at_least(0)
    weight_decay: float = at_least(0)
    grad_clip: float = at_least(0)
    betas: Optional[List[float]] = None
    eps: Optional[float] = field(default=None, metadata={"gt": 0})
    momentum: Optional[float] = field(default=None, metadata={"min": 0, "lt": 1})
    fused: Optional[bool] = None


@dataclass
class Data:
    source: str = choice("pycode", "text", "fineweb_edu")
    paths: Optional[List[str]] = MISSING
    tokenizer: str = choice("bpe", "gpt2", "hf")
    tokenizer_dir: Optional[str] = None
    vocab_size: int = above(257)
    bpe_train_chars: int = at_least(1)
    token_dtype: str = choice("auto", "uint16", "uint32")
    sample_by: str = choice("document", "paragraph", "line")
    text_field: str = MISSING
    val_fraction: float = above(0, below=1)
    num_proc: Optional[int] = at_least(1)
    cache_dir: str = MISSING
    hub_name: Optional[str] = None
    hub_subset: Optional[str] = None
    max_docs: Optional[int] = field(default=None, metadata={"min": 1})


@dataclass
class DryRun:
    world: Optional[int] = field(default=MISSING, metadata={"min": 1})
    rank: int = at_least(0)
    compute: str = choice("auto", "real", "fake")
    steps: int = at_least(1)
    memory_gb: float = above(0)


@dataclass
class Checkpoint:
    every: int = at_least(0)
    keep: int = at_least(0)


@dataclass
class Logger:
    mode: str = choice("offline", "online", "disabled")
    project: str = MISSING
    group: Optional[str] = None
    name: Optional[str] = None


@dataclass
class Launcher:
    nproc_per_node: Optional[int] = at_least(1)
    nnodes: int = at_least(1)
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None


SCHEMA = {"train": Train, "parallel": Parallel, "model": Model, "optim": Optim, "data": Data,
          "checkpoint": Checkpoint, "logger": Logger, "launcher": Launcher, "dry_run": DryRun}
KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


# groups whose settings (by repr) one merge found well typed: a merge copies its group (~9 ms), and validate runs for
# every job on every rank and for each layout a tool checks (the rule-book grid test: 72 of its 96 s, profiled)
_WELL_TYPED = set()


@functools.cache
def _typed(schema):
    """The schema as a structured config, made once: merges read it and leave it as it is."""
    return OmegaConf.structured(schema)


def validate(cfg):
    """Types, allowed values and ranges of every setting the schema knows; raises ConfigError with one line."""
    for group, schema in SCHEMA.items():
        if group not in cfg:
            continue
        # plain values, read once (each read of a config node costs ~0.1 ms); a group without a setting (optim=sgd has
        # no betas), or a `???` that prepare reports, is left alone
        node, typed = OmegaConf.to_container(cfg[group], resolve=True), _typed(schema)
        fields = [f for f in dataclasses.fields(schema) if f.name in node and node[f.name] != "???"]
        values = {f.name: node[f.name] for f in fields}
        seen = (group, repr(values))
        try:  # every type of the group in one merge (each merge copies the group: one per setting costs 10x more)
            if seen not in _WELL_TYPED:
                OmegaConf.merge(typed, values)
                _WELL_TYPED.add(seen)
            wrong_type = False
        except OmegaConfBaseException:
            wrong_type = True  # which one: setting by setting below
        for f in fields:
            key, value = f"{group}.{f.name}", values[f.name]
            try:
                if wrong_type:
                    OmegaConf.merge(typed, {f.name: value})
            except OmegaConfBaseException:
                kind = f.type.__args__[0] if getattr(f.type, "__args__", None) else f.type  # Optional[int]: int
                raise ConfigError(f"{key}={value!r}: expected {KINDS.get(kind, 'a list')}") from None
            m = f.metadata
            if value is None:
                continue
            if "choices" in m and value not in m["choices"]:
                raise ConfigError(f"{key}={value!r}: expected {_or(m['choices'])}")
            if "min" in m and value < m["min"]:
                raise ConfigError(f"{key}={value} must be " + ("a whole number, 0 or more" if m["min"] == 0 and
                                                              f.type is int else f"at least {m['min']}"))
            if m.get("gt") is not None and not value > m["gt"]:
                raise ConfigError(f"{key}={value} must be " + ("positive" if m["gt"] == 0 else
                                                              f"more than {m['gt']}"))
            if m.get("lt") is not None and not value < m["lt"]:
                raise ConfigError(f"{key}={value} must be below {m['lt']}")
    betas = cfg.optim.get("betas")
    if betas is not None and not (len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ConfigError(f"optim.betas={list(betas)}: expected two numbers in [0, 1)")
    t = cfg.get("train", {})
    if t.get("selective_matmuls", "all") != "all" and t.get("activation_checkpointing") != "selective":
        raise ConfigError(f"train.selective_matmuls={t.selective_matmuls} chooses what selective checkpointing keeps, "
                          f"but train.activation_checkpointing={t.activation_checkpointing}; set it to selective, or "
                          f"leave selective_matmuls at all")


def model_config(cfg, vocab_size):
    """The GPT's shape from cfg.model, with the tokenizer's vocab where model.vocab_size is null."""
    m = cfg.model
    moe = {k: m.get(k) for k in ("n_experts", *MOE_SETTINGS) if m.get(k) is not None}  # null: GPTConfig's default
    return GPTConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, n_embd=m.n_embd, n_kv_head=m.n_kv_head, mlp=m.mlp, ffn_hidden=m.ffn_hidden,
                     ffn_multiple=m.ffn_multiple, tie_embeddings=m.tie_embeddings, rope_theta=m.rope_theta,
                     norm_eps=m.norm_eps, qkv_bias=m.qkv_bias, **moe)


def resolved(p, layout, dtype):
    """The parallel config with param_dtype=auto made concrete for `layout` (what the strategies and the metrics
    read): bf16 working weights where the run computes in bf16 and the strategy keeps a working copy."""
    return OmegaConf.merge(p, {"param_dtype": layout.working_dtype(p.param_dtype, dtype)})


def check_dry_run(d, launcher, under_torchrun):
    """The error message for a dry run (tools/dry_run.py) that can't start, or None. A dry run is one process that
    plays one rank of d.world; it must never become a real multi-process run."""
    if under_torchrun or launcher.nproc_per_node:
        how = "torchrun" if under_torchrun else f"launcher.nproc_per_node={launcher.nproc_per_node}"
        return (f"dry_run.world={d.world} plays one rank of {d.world} in this one process, but it was started with "
                f"{how}; run `python train.py ... dry_run.world={d.world}` alone")
    if not 0 <= d.rank < d.world:
        return f"dry_run.rank={d.rank} is outside dry_run.world={d.world}: use a rank from 0 to {d.world - 1}"
    return None


def check_model(m):
    if m.n_embd % m.n_head:
        return f"model.n_head={m.n_head} must divide model.n_embd={m.n_embd}: every head gets n_embd / n_head channels"
    if (m.n_embd // m.n_head) % 2:
        return (f"model.n_embd / model.n_head = {m.n_embd // m.n_head} channels per head must be even: RoPE rotates "
                f"them in pairs")
    if m.n_kv_head and m.n_head % m.n_kv_head:
        return (f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}: each key/value head serves an "
                f"equal group of query heads")
    n_experts = m.get("n_experts") or 0
    if not n_experts:
        set_ = [k for k in MOE_SETTINGS if m.get(k) is not None]
        if set_:
            return (f"model.{set_[0]}={m.get(set_[0])} is a mixture-of-experts setting, but model.n_experts=0 (a dense "
                    f"model); set model.n_experts, or leave model.{set_[0]} null")
        return None
    top_k = m.get("top_k") or 2
    if top_k > n_experts:
        return f"model.top_k={top_k} is more than model.n_experts={n_experts}: a token can't go to more experts than exist"
    dense, every = m.get("dense_layers") or 0, m.get("moe_every") or 1
    if dense + every > m.n_layer:
        return (f"model.dense_layers={dense} and model.moe_every={every} leave no MoE block among model.n_layer="
                f"{m.n_layer}; lower them, or set model.n_experts=0")
    return None


def check_optim(o):
    if o.min_lr > o.lr:
        return f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}: the schedule decays from lr to min_lr"
    return None


def compile_problem(device):
    """Why train.compile=true can't work on this device, or None: inductor builds C++ on a CPU and Triton kernels on
    a GPU."""
    if device == "cpu":
        from torch._inductor import config as inductor_config
        cxx = inductor_config.cpp.cxx[-1] if isinstance(inductor_config.cpp.cxx, tuple) else inductor_config.cpp.cxx
        if not any(shutil.which(c) for c in (cxx, "g++", "c++", "clang++") if c):
            return ("train.compile=true: inductor compiles C++ on the CPU, and no C++ compiler (g++, clang++ or $CXX) "
                    "is on PATH; install one or use train.compile=false")
        return None
    from torch.utils._triton import has_triton
    if not has_triton():
        return "train.compile=true: inductor needs Triton on a GPU, which is not installed; use train.compile=false"
    return None


def bf16_supported(device):
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # CPUs with AVX512-BF16/AMX, or emulation that oneDNN trusts


def layout_problem(cfg, layout, dtype, cpu_bf16=True, bf16=True):
    """The rule book's line for `layout` (Layout.problem) with cfg's parallel knobs, model and batch, or None: the
    one call that config.check and the planner's ranking (tools/plan.py) make. `dtype`: train.dtype resolved;
    `bf16`, `cpu_bf16`: whether the device, and the CPU, compute in bfloat16."""
    from data import prepare
    t = cfg.train
    return layout.problem(cfg.parallel, model_config(cfg, prepare.vocab_size(cfg.data)), t.seq_len,
                          t.global_batch_size, t.micro_batch_size, t.compile, dtype, cpu_bf16=cpu_bf16, bf16=bf16,
                          ac=t.activation_checkpointing)


def rules(cfg, world, dtype, cpu_bf16=True, bf16=True):
    """The run's rules that no device decides: the model's and the optimizer's, the layout's degrees on `world` ranks
    and the rule book (layout_problem), the sequence against the model's context, the vocabulary against the
    tokenizer's. Returns the Layout; raises ConfigError with one line. config.check applies them for this device,
    the planner (tools/plan.py) for the GPUs it plans, so both refuse a run with the same line."""
    if cfg.parallel.get("auto"):  # train.py and tools/plan.py set the pick before they get here
        raise ConfigError("parallel=auto picks a layout for a run of train.py; a dry run needs one: dry-run the "
                          "planner's top picks with `python -m tools.plan parallel=auto plan.world=N plan.dry_run=3`")
    run_rules(cfg)
    t = cfg.train
    try:
        layout = Layout.from_config(cfg.parallel, world)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    problem = layout_problem(cfg, layout, dtype, cpu_bf16, bf16)
    if problem:
        raise ConfigError(problem)
    eval_batch = t.eval_batch_size or t.global_batch_size
    if eval_batch % (t.micro_batch_size * layout.dp):
        raise ConfigError(f"train.eval_batch_size={eval_batch} is not divisible by micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel ranks ({layout.dp}): each rank evaluates its share "
                          f"of every val batch in micro-batches")
    return layout


def run_rules(cfg):
    """The rules no layout decides: the model's, the optimizer's, the sequence against the model's context, the
    vocabulary against the tokenizer's (what parallel=auto checks before it ranks any layout). Raises ConfigError."""
    import hf
    from data import prepare
    hf.apply(cfg)  # train.init_from=hf:DIR: the shape from DIR/config.json (once; again is a no-op)
    t, m = cfg.train, cfg.model
    for problem in (check_model(m), check_optim(cfg.optim)):
        if problem:
            raise ConfigError(problem)
    if t.seq_len > m.block_size:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than the model's context (model.block_size="
                          f"{m.block_size})")
    if m.vocab_size is not None and m.vocab_size < prepare.vocab_size(cfg.data):
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
                          f"({prepare.vocab_size(cfg.data)}); leave it null to follow the tokenizer")


def device_and_dtype(t, computes=True):
    """(device, dtype): train.device and train.dtype made concrete on this machine (auto: a GPU where torch sees one,
    bf16 autocast where that GPU has it, else float32). Raises ConfigError where the machine can't do what was asked;
    `computes=False` (a dry run on fake tensors, which runs no kernel) asks no bf16 of it."""
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but torch sees no CUDA device")
    device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
    if t.dtype == "bfloat16" and computes and not bf16_supported(device):
        raise ConfigError(f"train.dtype=bfloat16, but this {device} can't compute in bfloat16; use train.dtype=float32")
    return device, t.dtype if t.dtype != "auto" else ("bfloat16" if device == "cuda" and bf16_supported(device)
                                                      else "float32")


def check(cfg, world, computes=True):
    """Everything that can be known wrong before work starts, for `world` ranks; returns (the Layout, device, dtype,
    grad_accum). Raises ConfigError (or data.prepare's DataError) with one line. `computes=False`: a dry run on fake
    tensors, which needs no bf16 kernels of this machine (device_and_dtype)."""
    from data import prepare, shards
    validate(cfg)
    t, d = cfg.train, cfg.data
    device, dtype = device_and_dtype(t, computes)
    layout = rules(cfg, world, dtype, cpu_bf16=bf16_supported("cpu") or not computes,
                   bf16=bf16_supported(device) or not computes)
    if t.compile and compile_problem(device):
        raise ConfigError(compile_problem(device))
    try:
        shards.token_dtype(prepare.vocab_size(d), d.token_dtype)  # vocab too large for the shard dtype
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if d.source != "fineweb_edu":
        prepare.local_files(d)  # missing paths, empty corpus
    return layout, device, dtype, t.global_batch_size // (t.micro_batch_size * layout.dp)
