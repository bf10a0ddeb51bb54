"""The configuration's schema and every check that can be made before work starts, in one place that train.py, the
planner and the tools read.

The values live in conf/ (YAML, composed by Hydra); this file says what each may be: its type (the dataclasses
below, checked by OmegaConf's structured configs), its allowed values (`choice`) and range (`at_least`, `above`,
`below`), then the rules that tie settings together (heads that divide the width, degrees that multiply to the
world size, a batch that splits over the data-parallel ranks). Every problem is one line, raised as ConfigError
before anything is prepared or written.

The parallel layout is a device mesh of named dimensions whose sizes are numbers in `parallel.*`: `tp` (tensor
parallel), `cp` (context parallel: each sequence split over ranks) and `dp` (data parallel, with its strategy
`parallel.data`, which reduces gradients over dp x cp), itself `dp_replicate` x `dp_shard` under HSDP (FSDP within
each shard group, replicas across them). `degrees()` turns them into sizes for a world; `layout_name()` names the
result as the planner and metrics do (single, ddp, ..., tp, fsdp_tp, hsdp, fsdp_cp).
"""
import dataclasses
import math
import shutil
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model import GPTConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DATA_STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp")
# the mesh's dimensions, outermost first: rank = ((i_pp * dp + i_dp) * cp + i_cp) * tp + i_tp (a tp group is
# neighbours, pipeline stages farthest apart: only activations cross between them)
DIMS = ("pp", "dp", "cp", "tp")
CP_METHODS = ("ring", "allgather")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# a dimension the mesh holds as several, outermost first (torchtitan's names); the flattened whole keeps its name
SPLIT = {"dp": ("dp_replicate", "dp_shard")}  # HSDP: i_dp = i_replicate * dp_shard + i_shard (neighbours shard)


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
    log_every: int = at_least(1)
    seed: int = MISSING
    dtype: str = choice("auto", "float32", "bfloat16")
    device: str = choice("auto", "cpu", "cuda")
    compile: bool = MISSING
    profile: bool = MISSING
    peak_tflops: Optional[float] = field(default=None, metadata={"gt": 0})
    activation_checkpointing: str = choice("none", "full", "every_n")
    ac_every: int = at_least(1)
    out_dir: str = MISSING
    resume: Optional[str] = MISSING
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
    impl: str = choice("scratch", "torch", "deepspeed")
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


@dataclass
class Model:
    n_layer: int = at_least(1)
    n_head: int = at_least(1)
    n_embd: int = at_least(1)
    block_size: int = at_least(1)
    vocab_size: Optional[int] = at_least(1)


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
    tokenizer: str = choice("bpe", "gpt2")
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


def _or(values):
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def validate(cfg):
    """Types, allowed values and ranges of every setting the schema knows; raises ConfigError with one line."""
    for group, schema in SCHEMA.items():
        if group not in cfg:
            continue
        node, typed = cfg[group], OmegaConf.structured(schema)
        for f in dataclasses.fields(schema):
            if f.name not in node or OmegaConf.is_missing(node, f.name):
                continue  # a group without this setting (optim=sgd has no betas), or a `???` prepare reports
            key, value = f"{group}.{f.name}", node.get(f.name)
            try:
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


def model_config(cfg, vocab_size):
    """The GPT's shape from cfg.model, with the tokenizer's vocab where model.vocab_size is null."""
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, n_embd=m.n_embd)


# --- the mesh
def degrees(p, world):
    """{dim: size} for `world` ranks: tp null means every rank, cp null every rank tp leaves; dp null means what
    the other degrees leave; of dp's two factors (HSDP), a null one is what the other leaves (both null: a shard
    group of dp, plain FSDP)."""
    tp = world if p.tp is None else p.tp
    cp = max(1, world // max(1, tp)) if p.cp is None else p.cp
    pp = p.get("pp", 1)  # null: what tp, cp and dp leave
    pp = pp if pp is not None else max(1, world // max(1, tp * cp * (p.dp or 1)))
    dp = p.dp if p.dp is not None else max(1, world // max(1, tp * cp * pp))
    shard, replicate = p.get("dp_shard"), p.get("dp_replicate", 1)
    if shard is None:
        shard = max(1, dp // replicate) if replicate else dp
    if replicate is None:
        replicate = max(1, dp // shard)
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_replicate": replicate, "dp_shard": shard}


def layout_name(p, world):
    """The layout as the planner and metrics name it: single, ddp, zero1, zero2, fsdp (one dimension, dp), hsdp (fsdp
    with replicas), tp (DDP over dp where dp > 1), fsdp_tp, zero1_tp, zero2_tp, hsdp_tp; with context parallel, cp
    alone (DDP over cp) or _cp after the others' name (fsdp_cp, tp_cp); with pipeline stages, pp alone or pp_
    before it (pp_ddp, pp_fsdp, pp_tp, pp_fsdp_tp)."""
    d = degrees(p, world)
    if p.data == "fsdp" and d["dp_replicate"] > 1:
        name = "hsdp" if d["tp"] == 1 else "hsdp_tp"
    elif d["tp"] > 1:
        name = "tp" if p.data in ("none", "ddp") else f"{p.data}_tp"
    else:
        name = "single" if p.data == "none" else p.data
    if d["cp"] > 1:
        name = "cp" if name in ("single", "ddp") else f"{name}_cp"
    if d["pp"] > 1:
        return "pp" if name == "single" or (name == "ddp" and d["dp"] == 1) else f"pp_{name}"
    return name


# the strategies whose weights on a rank are a working copy apart from the float32 master (ours: zero1, zero2,
# fsdp; torch's: FSDP2's MixedPrecisionPolicy, for zero2 and fsdp). The others compute with the master weights.
# DeepSpeed's: none (its bf16 mode is not wired; its working weights stay float32, beside its fp32 master).
WORKING_COPY = {"scratch": ("zero1", "zero2", "fsdp"), "torch": ("zero2", "fsdp"), "deepspeed": ()}


def working_dtype(param_dtype, data, impl, dtype):
    """The working (gathered) weights' dtype: parallel.param_dtype, or for `auto` FSDP2's convention, bf16 where the
    run computes in bf16 (`dtype`, train.dtype resolved) and the strategy (parallel.data, .impl) keeps a working
    copy. With float32 working weights under bf16 autocast, every matmul casts its weight to bf16 and autograd keeps
    that copy until backward: under FSDP a bf16 copy of the whole model builds up on every rank, and 16P/N no longer
    holds."""
    if param_dtype != "auto":
        return param_dtype
    return "bfloat16" if dtype == "bfloat16" and data in WORKING_COPY[impl] else "float32"


def resolved(p, dtype):
    """The parallel config with param_dtype=auto made concrete (what the strategies and the metrics read)."""
    return OmegaConf.merge(p, {"param_dtype": working_dtype(p.param_dtype, p.data, p.impl, dtype)})


def check_parallel(p, world, model, seq_len, cpu_bf16=True, bf16=True, compile_=False, dtype="float32"):
    """The error message for parallel settings that can't work on `world` processes, or None. `model`: the
    GPTConfig (layers, heads, widths, padded vocab) the run will build; `bf16`: whether the device the run computes
    on can compute in bfloat16 (`cpu_bf16`: whether the CPU can); `dtype`: train.dtype resolved."""
    name, d = layout_name(p, world), degrees(p, world)
    dp, cp, tp, pp = d["dp"], d["cp"], d["tp"], d["pp"]
    p = resolved(p, dtype)
    if p.param_dtype != "float32":
        if p.data not in ("zero1", "zero2", "fsdp"):
            return (f"parallel.param_dtype={p.param_dtype}: parallel={name} computes with its float32 weights and "
                    f"has no working copy in another dtype (zero1, zero2 and fsdp do); use "
                    f"parallel.param_dtype=float32")
        if p.data == "zero1" and p.impl == "torch":
            return ("parallel.param_dtype=bfloat16 with parallel.data=zero1 has no torch twin "
                    "(ZeroRedundancyOptimizer steps the model's own weights); use parallel.impl=scratch, or "
                    "parallel=zero2 parallel.impl=torch (FSDP2's MixedPrecisionPolicy)")
    if p.impl == "deepspeed":
        problem = check_deepspeed(p, name, d["tp"], compile_)
        if problem:
            return problem
    if p.accumulate != "local" and (p.data != "zero2" or p.impl != "scratch"):
        return (f"parallel.accumulate={p.accumulate} reduce-scatters every micro-step into our ZeRO-2's gradient "
                f"shard; parallel={name}{' impl=torch' if p.impl == 'torch' else ''} accumulates locally: use "
                f"parallel.accumulate=local")
    problem = check_hsdp(p, d)
    if problem:
        return problem
    if name == "single":
        return None if world == 1 else \
            f"parallel=single runs in one process, but {world} were launched; pick a parallel strategy"
    if world < 2 and name != "fsdp":  # FSDP on one rank: no sharding, all its machinery, to time it alone
        return (f"parallel={name} needs several processes, but this is one; launch it with "
                f"`torchrun --nproc_per_node=N train.py parallel={name}` (N >= 2)")
    if world % tp:
        return f"parallel.tp={tp} must divide the number of ranks ({world})"
    fixed = [(k, d[k]) for k in ("pp", "cp") if d[k] > 1] + [("tp", tp)]  # the degrees set, dp what they leave
    if len(fixed) > 1 and world % math.prod(v for _, v in fixed):
        return (" x ".join(f"parallel.{k}={v}" for k, v in fixed) + f" = {math.prod(v for _, v in fixed)} must "
                f"divide the number of ranks ({world})")
    if pp * dp * cp * tp != world:
        used = [(k, d[k]) for k in ("pp", "dp", "cp", "tp") if k in ("dp", "tp") or d[k] > 1]
        return (" x ".join(f"parallel.{k}={v}" for k, v in used) + f" = {math.prod(v for _, v in used)}, but "
                f"{world} ranks were launched")
    if dp > 1 and p.data == "none":
        return f"parallel.dp={dp} replicas need a data-parallel strategy: parallel.data={_or(DATA_STRATEGIES[1:])}"
    if cp > 1 and p.data == "none":
        return (f"parallel.cp={cp}: each cp rank's gradients come from its own tokens and are reduced over dp x cp "
                f"as over dp; that needs a data-parallel strategy: parallel.data={_or(DATA_STRATEGIES[1:])}")
    if dp * cp == 1 and p.data in ("zero1", "zero2"):
        return (f"parallel.data={p.data} shards over the data-parallel ranks, but dp=1 (tp={tp} takes all {world}); "
                f"lower parallel.tp or use parallel.data=ddp")
    if cp > 1:
        problem = check_cp(p, cp, tp, seq_len, compile_)
        if problem:
            return problem
    if tp > 1:
        for n, what in ((model.n_head, "attention heads (model.n_head)"),
                        (4 * model.n_embd, "MLP hidden units (4 x model.n_embd)"),
                        (model.padded_vocab_size, "padded vocabulary entries")):
            if n % tp:
                return f"parallel.tp={tp} must divide the model's {n} {what}: each tp rank holds an equal share"
        for length, key in ((seq_len, "train.seq_len"), (model.block_size, "model.block_size")):
            if p.sequence_parallel and length % tp:
                return (f"parallel.sequence_parallel=true splits each sequence over the {tp} tp ranks, but "
                        f"{key}={length} is not divisible by {tp}")
        if p.impl == "torch" and compile_:
            return ("train.compile=true with torch's tensor parallel: DTensor's collectives would run inside the "
                    "compiled graphs, where they can't be counted; use parallel.impl=scratch or train.compile=false")
        if p.impl == "torch" and p.data == "zero1":
            return "parallel.data=zero1 with parallel.tp > 1 has no torch twin (ZeroRedundancyOptimizer needs DDP, " \
                   "which can't take DTensor parameters); use parallel.impl=scratch"
    if p.data == "fsdp":
        k, n_layer = p.blocks_per_unit, model.n_layer
        if n_layer % k or k > n_layer:
            return (f"parallel.blocks_per_unit={k} can't split the model's {n_layer} blocks into equal units; "
                    f"use a divisor of {n_layer}")
        n_units = n_layer // k + 2  # + the embedding and the norm + head
        if p.prefetch >= n_units:
            return (f"parallel.prefetch={p.prefetch}: there are {n_units} units, so at most {n_units - 1} can be "
                    f"gathered ahead of the current one")
        if p.cpu_offload and p.param_dtype == "bfloat16" and not cpu_bf16:
            return ("parallel.cpu_offload=true casts the CPU-held shards to param_dtype=bfloat16 on the CPU, which "
                    "this CPU can't do; use parallel.param_dtype=float32")
    if p.param_dtype == "bfloat16" and not bf16:
        return "parallel.param_dtype=bfloat16: this device can't compute in bfloat16; use parallel.param_dtype=float32"
    return None


def check_hsdp(p, d):
    """dp_replicate x dp_shard: factors of dp, replicas of FSDP alone."""
    dp, shard, replicate = d["dp"], d["dp_shard"], d["dp_replicate"]
    if p.get("dp_shard") is None and p.get("dp_replicate", 1) is None:
        return ("parallel=hsdp shards over each node's ranks, but how many a node has is unknown here (no torchrun "
                "LOCAL_WORLD_SIZE, launcher.nproc_per_node null); set parallel.dp_shard")
    if p.get("dp_shard") is None and dp % replicate:
        return f"parallel.dp_replicate={replicate} must divide the data-parallel size (dp={dp})"
    if shard * replicate != dp:
        return (f"parallel.dp_replicate={replicate} x parallel.dp_shard={shard} = {shard * replicate}, but the "
                f"data-parallel size is dp={dp}")
    if replicate > 1 and p.data != "fsdp":
        return (f"parallel.dp_replicate={replicate} replicates FSDP's shards (HSDP), but parallel.data={p.data}; use "
                f"parallel.data=fsdp, or parallel.dp_replicate=1")
    if replicate > 1 and d["tp"] > 1:
        return (f"parallel.dp_replicate={replicate} with parallel.tp={d['tp']}: HSDP beside tensor parallelism is not "
                f"built yet; use parallel.dp_replicate=1 (fsdp_tp) or parallel.tp=1")
    if replicate > 1 and d["cp"] > 1:
        return (f"parallel.dp_replicate={replicate} with parallel.cp={d['cp']}: HSDP beside context parallelism is not "
                f"built yet; use parallel.dp_replicate=1 (fsdp_cp) or parallel.cp=1")
    return None


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


def check_cp(p, cp, tp, seq_len, compile_):
    """Context parallel's own rules (parallel/cp.py), or None."""
    if seq_len % (2 * cp):
        return (f"parallel.cp={cp} splits each sequence into 2 x cp = {2 * cp} equal chunks, but train.seq_len="
                f"{seq_len} is not divisible by {2 * cp}")
    if p.sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        return (f"parallel.sequence_parallel=true splits each cp rank's {seq_len // cp} tokens over the {tp} tp "
                f"ranks, but {seq_len // cp} is not divisible by {tp}")
    if p.impl == "torch":
        return ("parallel.impl=torch with parallel.cp > 1: torch's context_parallel is GPU-only (it shards the CUDA "
                "attention kernels; on the CPU: NotImplementedError: Operator "
                "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
                "registered); use parallel.impl=scratch")
    if p.impl == "deepspeed":
        return ("parallel.impl=deepspeed with parallel.cp > 1: not wired (its groups are dp's); use "
                "parallel.impl=scratch")
    if compile_:
        return ("train.compile=true with parallel.cp > 1: the ring's sends and receives would run inside the "
                "compiled blocks, where they can't overlap or be counted; use train.compile=false")
    return None


def check_deepspeed(p, name, tp, compile_):
    """parallel.impl=deepspeed (parallel/zero_deepspeed.py): DeepSpeed's ZeRO stages, in float32, over dp alone."""
    import importlib.util
    if p.data not in ("zero1", "zero2", "fsdp"):
        return (f"parallel.impl=deepspeed is DeepSpeed's ZeRO: parallel.data=zero1, zero2 or fsdp (its stage 3); "
                f"parallel={name} has no DeepSpeed twin, use parallel.impl=scratch or torch")
    if tp > 1:
        return f"parallel.impl=deepspeed runs over data parallel alone; parallel.tp={tp}: use parallel.tp=1"
    for key in ("param_dtype", "reduce_dtype"):
        if p[key] != "float32":
            return (f"parallel.{key}={p[key]} with parallel.impl=deepspeed: its twin runs in float32 here; use "
                    f"parallel.{key}=float32")
    if p.cpu_offload:
        return "parallel.cpu_offload=true has no DeepSpeed twin here; use parallel.cpu_offload=false"
    if compile_:
        return "train.compile=true with parallel.impl=deepspeed: not wired; use train.compile=false"
    if importlib.util.find_spec("deepspeed") is None:
        return "parallel.impl=deepspeed needs DeepSpeed, which is not installed: pip install deepspeed==0.19.8"
    return None


def check_pipeline(p, world, model, micro_batches):
    """The error message for pipeline settings that can't work, or None; `micro_batches`: per step and dp rank."""
    d = degrees(p, world)
    pp, s = d["pp"], p.pp_schedule
    if pp == 1:
        return None
    v = p.pp_virtual if s == "interleaved_1f1b" else 1
    if s == "interleaved_1f1b" and v < 2:
        return "parallel.pp_schedule=interleaved_1f1b with parallel.pp_virtual=1 is 1f1b; set pp_virtual to 2 or more"
    if pp * v > model.n_layer:
        return (f"parallel.pp={pp}{f' x pp_virtual={v}' if v > 1 else ''} = {pp * v} stages, but the model has "
                f"{model.n_layer} blocks (model.n_layer): every stage needs at least one")
    if v > 1 and model.n_layer % (pp * v):
        return (f"parallel.pp_schedule=interleaved_1f1b: pp={pp} x pp_virtual={v} = {pp * v} virtual stages must "
                f"divide the model's {model.n_layer} blocks")
    if v > 1 and micro_batches % pp:
        return (f"parallel.pp_schedule=interleaved_1f1b sends micro-batches through each chunk in groups of pp={pp}, "
                f"but a step has {micro_batches} (train.global_batch_size / (micro_batch_size x dp)); make it a "
                f"multiple of {pp}")
    if d["tp"] > 1 and p.impl == "torch":
        return ("parallel.pp > 1 with parallel.tp > 1 and parallel.impl=torch is not built yet (torch's tensor "
                "parallel is not wired to the stage split); use parallel.impl=scratch")
    if d["tp"] > 1 and d["cp"] > 1:
        return "parallel.pp > 1 with both parallel.tp > 1 and parallel.cp > 1 is not built yet; drop one of them"
    if d["dp_replicate"] > 1:
        return "parallel.pp > 1 with HSDP (parallel.dp_replicate > 1) is not built yet; use parallel.dp_replicate=1"
    if p.impl == "deepspeed":
        return "parallel.pp > 1 with parallel.impl=deepspeed is not wired; use parallel.impl=scratch or torch"
    if p.impl == "torch" and d["dp"] > 1:
        # torch's schedules drive the data strategy's wrapper as the stage's module (parallel/pp.py, torch_step)
        why = {"interleaved_1f1b": "drives the data strategy's wrapper as a stage's module, and ours wraps all of "
                                   "a rank's chunks in one (torchtitan wraps each chunk apart)",
               "zero_bubble": "(ScheduleInterleavedZeroBubble) beside DistributedDataParallel or FSDP2 gives "
                              "gradients that differ from single's (torch 2.13, gloo)"}.get(s)
        if s == "gpipe" and p.data in ("ddp", "zero1"):  # zero1's twin is DistributedDataParallel + ZeRO's optimizer
            why = ("(ScheduleGPipe) beside DistributedDataParallel stops in its first step on an internal assert of "
                   "DDP's reducer (rebuilt parameter indices; torch 2.13, gloo)")
        if why:
            return (f"parallel.pp_schedule={s} parallel.data={p.data} over dp={d['dp']} with parallel.impl=torch: "
                    f"torch.distributed.pipelining {why}; use 1f1b, or parallel.impl=scratch")
    if p.accumulate == "sharded":
        # the schedule runs every backward under no_sync and the strategy reduces once after it (parallel/pp.py)
        return ("parallel.accumulate=sharded with parallel.pp > 1: a pipeline's strategy reduces once after the "
                "schedule, not every micro-step; use parallel.accumulate=local")
    if v > 1 and p.data == "fsdp" and (model.n_layer // (pp * v)) % p.blocks_per_unit:
        # FSDP gathers a unit around its own blocks' forward and backward; a unit across two chunks is needed
        # while the other chunk runs
        return (f"parallel.blocks_per_unit={p.blocks_per_unit} with interleaved_1f1b: each of the {pp * v} virtual "
                f"stages has {model.n_layer // (pp * v)} blocks, and an FSDP unit must not span two; use a divisor")
    return None


def check_model(m):
    if m.n_embd % m.n_head:
        return f"model.n_head={m.n_head} must divide model.n_embd={m.n_embd}: every head gets n_embd / n_head channels"
    if (m.n_embd // m.n_head) % 2:
        return (f"model.n_embd / model.n_head = {m.n_embd // m.n_head} channels per head must be even: RoPE rotates "
                f"them in pairs")
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


def check(cfg, world):
    """Everything that can be known wrong before work starts, for `world` ranks; returns (device, dtype,
    grad_accum). Raises ConfigError (or data.prepare's DataError) with one line."""
    from data import prepare, shards
    validate(cfg)
    t, d = cfg.train, cfg.data
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but torch sees no CUDA device")
    device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
    if t.dtype == "bfloat16" and not bf16_supported(device):
        raise ConfigError(f"train.dtype=bfloat16, but this {device} can't compute in bfloat16; use train.dtype=float32")
    dtype = t.dtype if t.dtype != "auto" else ("bfloat16" if device == "cuda" and bf16_supported(device) else "float32")
    for problem in (check_model(cfg.model), check_optim(cfg.optim),
                    check_parallel(cfg.parallel, world, model_config(cfg, prepare.vocab_size(d)), t.seq_len,
                                   cpu_bf16=bf16_supported("cpu"), bf16=bf16_supported(device),
                                   compile_=t.compile, dtype=dtype)):
        if problem:
            raise ConfigError(problem)
    if t.compile and compile_problem(device):
        raise ConfigError(compile_problem(device))
    dp = degrees(cfg.parallel, world)["dp"]  # tensor-parallel and pipeline ranks share one slice of the batch
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel ranks ({dp})")
    problem = check_pipeline(cfg.parallel, world, cfg.model, t.global_batch_size // (t.micro_batch_size * dp))
    if problem:
        raise ConfigError(problem)
    if t.seq_len > cfg.model.block_size:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than the model's context "
                          f"(model.block_size={cfg.model.block_size})")
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < prepare.vocab_size(d):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"({prepare.vocab_size(d)}); leave it null to follow the tokenizer")
    try:
        shards.token_dtype(prepare.vocab_size(d), d.token_dtype)  # vocab too large for the shard dtype
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if d.source != "fineweb_edu":
        prepare.local_files(d)  # missing paths, empty corpus
    return device, dtype, t.global_batch_size // (t.micro_batch_size * dp)
