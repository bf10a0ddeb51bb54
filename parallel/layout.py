"""The parallel layout: one frozen value, built once from `parallel.*` and the world size, and the one rule book.

A layout is the degrees of the device mesh, outermost first,

    pp x dp_replicate x dp_shard x cp x tp = world        rank = (((i_pp * R + i_rep) * S + i_shard) * cp + i_cp) * tp + i_tp

(tensor parallel among neighbours, one node's GPUs on NVLink; context parallel across cp such groups; data parallel
across the rest, HSDP's shard groups inside its replicas; pipeline stages farthest apart, where only activations
cross), plus the data-parallel strategy over dp = dp_replicate x dp_shard (x cp: each cp rank's gradients are its own
tokens'), and which implementation runs it. Expert parallelism will take its ep ranks from within dp x cp, as mature
trainers do, so it adds no mesh dimension; `ep` is here for that (1 until it is built).

The whole mesh composes: ours runs any degrees above 1 at once (HSDP beside tp, cp and pp; pp beside tp and cp
together; all five), each combination equal to one process (tests/test_mesh.py); torch's twins where torch's compose
on CPU/gloo (FSDP2 on the (dp_replicate, dp_shard) mesh beside DTensor tp, torch's pipeline beside HSDP), and
`problem` says in one line where they don't.

Everything that asks "what layout is this?" reads this value: config.check (through `problem`), parallelize, the
metrics record, checkpoints' state.json, the planner (every ranked candidate is a Layout, checked by the same
`problem`) and the dry run. Decisions read its fields and booleans, never a parsed name; `name` is for people.
`problem` returns the one line that says why a layout can't run with a model and a batch (what is not built, and what
to use instead), or None; train.py, the planner and the dry run print that same line.
"""
import importlib.util
import math
import weakref
from dataclasses import asdict, dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DATA_STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp")
IMPLS = ("scratch", "torch", "deepspeed")
CP_METHODS = ("ring", "allgather")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dimensions, outermost first
DIMS = ("pp", "dp", "cp", "tp")  # as the strategies see them: "dp" is dp_replicate x dp_shard flattened
# which parts of the model state a data strategy splits over its ranks (the rest is whole on every rank)
SHARDS = {"none": (), "ddp": (), "zero1": ("optimizer",), "zero2": ("gradients", "optimizer"),
          "fsdp": ("parameters", "gradients", "optimizer")}
# the strategies whose weights on a rank are a working copy apart from the float32 master (ours: zero1, zero2,
# fsdp; torch's: FSDP2's MixedPrecisionPolicy, for zero2 and fsdp). The others compute with the master weights.
# DeepSpeed's: none (its bf16 mode is not wired; its working weights stay float32, beside its fp32 master).
WORKING_COPY = {"scratch": ("zero1", "zero2", "fsdp"), "torch": ("zero2", "fsdp"), "deepspeed": ()}


# Meshes built in this process's default group, by what they are: {default group: {key: mesh}}. A process that runs
# many jobs in one group (tools/jobs.py, the tests' launches) builds each mesh once. A job's groups can't be destroyed
# when it ends (torch's DTensor caches its redistribution plans by mesh, and a later job's equal mesh then reached the
# old groups by name), and new ones per job piled up: each gloo group keeps three threads of its own, and
# a 60-job launch of 4 ranks on 2 cores ran its last jobs several times slower (one job repeated 48 times in one
# launch: 0.5 s a job at the start, 4-7 s at the end; built once, 0.4 s throughout; 2026-12-02).
_MESHES = weakref.WeakKeyDictionary()


def once_per_group(key, build):
    """build(), or what it returned before for `key` in this default process group."""
    import torch.distributed as dist
    meshes = _MESHES.setdefault(dist.group.WORLD, {})
    if key not in meshes:
        meshes[key] = build()
    return meshes[key]


class LayoutError(ValueError):
    """Degrees that don't make a mesh of the world's ranks; one line."""


def _or(values):
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


@dataclass(frozen=True)
class Layout:
    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    data: str = "none"  # parallel.data, as configured: none | ddp | zero1 | zero2 | fsdp
    impl: str = "scratch"  # parallel.impl: scratch | torch | deepspeed
    ep: int = 1  # expert parallel: each MoE block's experts split over ep ranks from within dp x cp (parallel/ep.py)

    @classmethod
    def from_config(cls, p, world):
        """The layout `parallel.*` asks for on `world` ranks. A null degree is what the others leave: tp null means
        every rank, cp null every rank tp leaves, pp and dp null what the rest leave; of dp's two factors (HSDP) a
        null one is what the other leaves (both null: a shard group of dp, plain FSDP). Raises LayoutError (one
        line) where the degrees don't make a mesh of `world` ranks."""
        tp = world if p.tp is None else p.tp
        cp = max(1, world // max(1, tp)) if p.cp is None else p.cp
        pp = p.get("pp", 1)
        pp = pp if pp is not None else max(1, world // max(1, tp * cp * (p.dp or 1)))
        dp = p.dp if p.dp is not None else max(1, world // max(1, tp * cp * pp))
        asked_shard, asked_replicate = p.get("dp_shard"), p.get("dp_replicate", 1)
        shard, replicate = asked_shard, asked_replicate
        if shard is None and replicate is None:
            raise LayoutError("parallel=hsdp shards over each node's ranks, but how many a node has is unknown here "
                              "(no torchrun LOCAL_WORLD_SIZE, launcher.nproc_per_node null); set parallel.dp_shard")
        if shard is None:
            if dp % replicate:
                raise LayoutError(f"parallel.dp_replicate={replicate} must divide the data-parallel size (dp={dp})")
            shard = dp // replicate
        if replicate is None:
            replicate = max(1, dp // shard)
        if shard * replicate != dp:
            raise LayoutError(f"parallel.dp_replicate={replicate} x parallel.dp_shard={shard} = {shard * replicate}, "
                              f"but the data-parallel size is dp={dp}")
        layout = cls(world, pp, replicate, shard, cp, tp, p.data, p.impl, p.get("ep", 1))
        problem = layout._mesh_problem()
        if problem:
            raise LayoutError(problem)
        return layout

    def _mesh_problem(self):
        """Why these degrees don't make a mesh of `world` ranks, or None."""
        world, tp, d = self.world, self.tp, self.degrees
        alone = self.pp == self.cp == tp == 1  # no model parallelism: a data strategy, or none
        if alone and self.data == "none":
            return None if world == 1 else \
                f"parallel=single runs in one process, but {world} were launched; pick a parallel strategy"
        if world < 2 and not (alone and self.data == "fsdp"):  # FSDP on one rank: its machinery, timed alone
            return (f"parallel={self.name} needs several processes, but this is one; launch it with "
                    f"`torchrun --nproc_per_node=N train.py parallel={self.name}` (N >= 2)")
        if world % tp:
            return f"parallel.tp={tp} must divide the number of ranks ({world})"
        fixed = [(k, d[k]) for k in ("pp", "cp") if d[k] > 1] + [("tp", tp)]  # the degrees set, dp what they leave
        if len(fixed) > 1 and world % math.prod(v for _, v in fixed):
            return (" x ".join(f"parallel.{k}={v}" for k, v in fixed) + f" = {math.prod(v for _, v in fixed)} must "
                    f"divide the number of ranks ({world})")
        if self.pp * self.dp * self.cp * tp != world:
            used = [(k, d[k]) for k in DIMS if k in ("dp", "tp") or d[k] > 1]
            return (" x ".join(f"parallel.{k}={v}" for k, v in used) + f" = {math.prod(v for _, v in used)}, but "
                    f"{world} ranks were launched")
        return None

    # --- what follows from the degrees
    @property
    def dp(self):
        return self.dp_replicate * self.dp_shard

    @property
    def reduce_ranks(self):
        """The ranks a gradient is averaged over: dp x cp."""
        return self.dp * self.cp

    @property
    def strategy(self):
        """The data strategy that runs: parallel.data, or none where there is one replica (dp x cp = 1) and nothing
        to reduce; FSDP runs on one rank too, to be timed alone, and ZeRO for its bf16 working copy (the rule book
        lets it through at dp=1 only with one)."""
        return "none" if self.data == "none" or (self.reduce_ranks == 1 and self.data == "ddp") else self.data

    @property
    def hsdp(self):
        return self.strategy == "fsdp" and self.dp_replicate > 1

    @property
    def shard_ranks(self):
        """The ranks each sharded piece of state is split over: dp x cp, or HSDP's dp_shard x cp."""
        return (self.dp_shard if self.hsdp else self.dp) * self.cp

    @property
    def sharded(self):
        """The parts of the model state the data strategy splits over shard_ranks."""
        return SHARDS[self.strategy]

    @property
    def stage_world(self):
        """The ranks of one pipeline stage (all of them without a pipeline)."""
        return self.world // self.pp

    @property
    def dims(self):
        """{dim: size} as the strategies see the mesh: pp, dp, cp, tp."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def degrees(self):
        return {**self.dims, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}

    @property
    def name(self):
        """A name for people and tables, from parallel.data and the degrees: single, ddp, zero1, zero2, fsdp, hsdp;
        tp (DDP over its replicas), fsdp_tp, hsdp_tp, ...; _cp after them (cp alone: DDP over cp); pp_ before (pp
        alone: stages and nothing else). Never parsed: decisions read the fields."""
        name = {"none": "single", "fsdp": "hsdp" if self.hsdp else "fsdp"}.get(self.data, self.data)
        if self.tp > 1:
            name = "tp" if name in ("single", "ddp") else f"{name}_tp"
        if self.cp > 1:
            name = "cp" if name in ("single", "ddp") else f"{name}_cp"
        if self.ep > 1:
            name = f"{name}_ep"
        if self.pp > 1:
            return "pp" if name == "single" or (name == "ddp" and self.dp == 1) else f"pp_{name}"
        return name

    def describe(self):
        """'pp=2 x dp=2 (dp_replicate=2 x dp_shard=1) x tp=2': the degrees above 1 (dp always), and ep (which
        takes its ranks from dp x cp: no factor of the world of its own)."""
        split = f" (dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard})" if self.dp_replicate > 1 else ""
        return " x ".join(f"{k}={v}{split if k == 'dp' else ''}" for k, v in self.dims.items()
                          if v > 1 or k == "dp") + (f", ep={self.ep} within dp x cp" if self.ep > 1 else "")

    def record(self):
        """What metrics.jsonl and a checkpoint's state.json say of the layout."""
        return {**asdict(self), "dp": self.dp, "parallel": self.name, "strategy": self.strategy}

    def working_dtype(self, param_dtype, dtype):
        """The working (gathered) weights' dtype: parallel.param_dtype, or for `auto` FSDP2's convention, bf16 where
        the run computes in bf16 (`dtype`, train.dtype resolved) and the strategy keeps a working copy. With float32
        working weights under bf16 autocast, every matmul casts its weight to bf16 and autograd keeps that copy
        until backward: under FSDP a bf16 copy of the whole model builds up on every rank, and 16P/N no longer
        holds. Under expert parallelism `auto` is float32 beside ZeRO: the experts stay out of its buckets, with no
        working copy (parallel/zero.py); FSDP gathers them in param_dtype as any unit."""
        if param_dtype != "auto":
            return param_dtype
        copy = self.data in WORKING_COPY[self.impl] and (self.ep == 1 or self.data == "fsdp")
        return "bfloat16" if dtype == "bfloat16" and copy else "float32"

    # --- the mesh
    def build_mesh(self, device_type):
        """The device mesh over MESH_DIMS (a degree of 1 is a dimension of size 1), with dp_replicate x dp_shard
        flattened into "dp", the one group of every data-parallel rank that the data loader and the other
        strategies see (strategy.dp_mesh). Its groups are named for the communication counter."""
        from torch.distributed.device_mesh import init_device_mesh

        from parallel import comm
        degrees = tuple(getattr(self, k) for k in MESH_DIMS)

        def build():
            mesh = init_device_mesh(device_type, degrees, mesh_dim_names=MESH_DIMS)
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            return mesh
        mesh = once_per_group(("mesh", device_type, degrees), build)
        # named at every run (comm.name_groups says why)
        comm.name_groups({mesh.get_group(k): k for k in (*MESH_DIMS, "dp")}, replace=True)
        return mesh

    # --- the rule book
    def problem(self, p, model, seq_len, global_batch=None, micro_batch=None, compile_=False, dtype="float32",
                cpu_bf16=True, bf16=True, ac="none"):
        """Why this layout can't run, in one line, or None. `p`: the parallel settings (their knobs); `model`: the
        GPTConfig the run builds (layers, heads, widths, padded vocab); `seq_len`: train.seq_len; the batch
        (train.global_batch_size, micro_batch_size) where it is known; `compile_`: train.compile; `dtype`:
        train.dtype resolved; `bf16`: whether the device computes in bfloat16 (`cpu_bf16`: whether the CPU can);
        `ac`: train.activation_checkpointing."""
        # the machine's own limit (bf16 working weights on a device without bf16) last: a layout the rule book
        # refuses is refused with the same line on every machine
        for rule in (self._degrees_problem(p), self._strategy_problem(p, dtype, compile_),
                     self._tp_problem(p, model, seq_len, compile_), self._cp_problem(p, seq_len, compile_),
                     self._fsdp_problem(p, model, cpu_bf16), self._tie_problem(model),
                     self._moe_problem(model, p, dtype), self._dtype_problem(p, dtype, bf16)):
            if rule:
                return rule
        if global_batch is None:
            return None
        if global_batch % (micro_batch * self.dp):
            return (f"train.global_batch_size={global_batch} is not divisible by micro_batch_size ({micro_batch}) x "
                    f"data-parallel ranks ({self.dp})")
        return self._pp_problem(p, model, global_batch // (micro_batch * self.dp), ac)

    def _degrees_problem(self, p):
        if self.dp_replicate > 1 and self.data != "fsdp":
            return (f"parallel.dp_replicate={self.dp_replicate} replicates FSDP's shards (HSDP), but parallel.data="
                    f"{self.data}; use parallel.data=fsdp, or parallel.dp_replicate=1")
        problem = self._mesh_problem()
        if problem:
            return problem
        if self.dp > 1 and self.data == "none":
            return (f"parallel.dp={self.dp} replicas need a data-parallel strategy: parallel.data="
                    f"{_or(DATA_STRATEGIES[1:])}")
        if self.cp > 1 and self.data == "none":
            return (f"parallel.cp={self.cp}: each cp rank's gradients come from its own tokens and are reduced over "
                    f"dp x cp as over dp; that needs a data-parallel strategy: parallel.data="
                    f"{_or(DATA_STRATEGIES[1:])}")
        if self.hsdp and self.impl == "deepspeed":
            return ("parallel.dp_replicate > 1 with parallel.impl=deepspeed: DeepSpeed's HSDP (its hpZ) is not "
                    "wired; use parallel.impl=scratch or torch")
        return None

    def _strategy_problem(self, p, dtype, compile_):
        param_dtype = self.working_dtype(p.param_dtype, dtype)
        # over one data-parallel rank ZeRO shards nothing, but its bf16 working copy beside float32 master weights
        # and Adam moments is still what it keeps: Megatron's mixed precision under tp x pp alone (its
        # Float16OptimizerWithFloat16Params), with no autocast cast of every weight at every micro-step
        if self.reduce_ranks == 1 and self.data in ("zero1", "zero2") and \
                (param_dtype == "float32" or self.impl == "deepspeed"):
            taken = " x ".join(f"{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp)) if v > 1)
            return (f"parallel.data={self.data} shards over the data-parallel ranks, but dp=1 ({taken}: all "
                    f"{self.world} ranks); over one rank it keeps only its bf16 working copy (parallel.param_dtype="
                    f"bfloat16, parallel.impl=scratch or torch): use that, or parallel.data=ddp")
        if param_dtype != "float32":
            if self.data not in ("zero1", "zero2", "fsdp"):
                return (f"parallel.param_dtype={param_dtype}: parallel={self.name} computes with its float32 weights "
                        f"and has no working copy in another dtype (zero1, zero2 and fsdp do); use "
                        f"parallel.param_dtype=float32")
            if self.data == "zero1" and self.impl == "torch":
                return ("parallel.param_dtype=bfloat16 with parallel.data=zero1 has no torch twin "
                        "(ZeroRedundancyOptimizer steps the model's own weights); use parallel.impl=scratch, or "
                        "parallel=zero2 parallel.impl=torch (FSDP2's MixedPrecisionPolicy)")
        if self.impl == "deepspeed":
            if self.data not in ("zero1", "zero2", "fsdp"):
                return (f"parallel.impl=deepspeed is DeepSpeed's ZeRO: parallel.data=zero1, zero2 or fsdp (its stage "
                        f"3); parallel={self.name} has no DeepSpeed twin, use parallel.impl=scratch or torch")
            if self.tp > 1:
                return (f"parallel.impl=deepspeed runs over data parallel alone; parallel.tp={self.tp}: use "
                        f"parallel.tp=1")
            for key, value in (("param_dtype", param_dtype), ("reduce_dtype", p.reduce_dtype)):
                if value != "float32":
                    return (f"parallel.{key}={value} with parallel.impl=deepspeed: its twin runs in float32 here; "
                            f"use parallel.{key}=float32")
            if p.cpu_offload:
                return "parallel.cpu_offload=true has no DeepSpeed twin here; use parallel.cpu_offload=false"
            if compile_:
                return "train.compile=true with parallel.impl=deepspeed: not wired; use train.compile=false"
            if importlib.util.find_spec("deepspeed") is None:
                return "parallel.impl=deepspeed needs DeepSpeed, which is not installed: pip install deepspeed==0.19.8"
        if p.accumulate != "local" and (self.data != "zero2" or self.impl != "scratch"):
            return (f"parallel.accumulate={p.accumulate} reduce-scatters every micro-step into our ZeRO-2's gradient "
                    f"shard; parallel={self.name}{' impl=torch' if self.impl == 'torch' else ''} accumulates "
                    f"locally: use parallel.accumulate=local")
        return None

    def _tp_problem(self, p, model, seq_len, compile_):
        tp = self.tp
        if tp == 1:
            return None
        share = "each tp rank holds an equal share"
        for n, what, why in ((model.n_head, "attention heads (model.n_head)", share),
                             (model.kv_heads, "key/value heads (model.n_kv_head)", "each tp rank holds whole groups "
                              "of query heads with their key/value head (none is replicated)"),
                             (model.hidden, "MLP hidden units (model.ffn_hidden, or its default)", share),
                             (model.padded_vocab_size, "padded vocabulary entries", share)):
            if n % tp:
                return f"parallel.tp={tp} must divide the model's {n} {what}: {why}"
        for length, key in ((seq_len, "train.seq_len"), (model.block_size, "model.block_size")):
            if p.sequence_parallel and length % tp:
                return (f"parallel.sequence_parallel=true splits each sequence over the {tp} tp ranks, but "
                        f"{key}={length} is not divisible by {tp}")
        if self.impl == "torch" and compile_:
            return ("train.compile=true with torch's tensor parallel: DTensor's collectives would run inside the "
                    "compiled graphs, where they can't be counted; use parallel.impl=scratch or train.compile=false")
        if self.impl == "torch" and self.data == "zero1":
            return ("parallel.data=zero1 with parallel.tp > 1 has no torch twin (ZeroRedundancyOptimizer needs DDP, "
                    "which can't take DTensor parameters); use parallel.impl=scratch")
        return None

    def _cp_problem(self, p, seq_len, compile_):
        cp, tp = self.cp, self.tp
        if cp == 1:
            return None
        if seq_len % (2 * cp):
            return (f"parallel.cp={cp} splits each sequence into 2 x cp = {2 * cp} equal chunks, but train.seq_len="
                    f"{seq_len} is not divisible by {2 * cp}")
        if p.sequence_parallel and tp > 1 and (seq_len // cp) % tp:
            return (f"parallel.sequence_parallel=true splits each cp rank's {seq_len // cp} tokens over the {tp} tp "
                    f"ranks, but {seq_len // cp} is not divisible by {tp}")
        if self.impl == "torch":
            return ("parallel.impl=torch with parallel.cp > 1: torch's context_parallel is GPU-only (it shards the "
                    "CUDA attention kernels; on the CPU: NotImplementedError: Operator "
                    "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
                    "registered); use parallel.impl=scratch")
        if self.impl == "deepspeed":
            return ("parallel.impl=deepspeed with parallel.cp > 1: not wired (its groups are dp's); use "
                    "parallel.impl=scratch")
        if compile_:
            return ("train.compile=true with parallel.cp > 1: the ring's sends and receives would run inside the "
                    "compiled blocks, where they can't overlap or be counted; use train.compile=false")
        return None

    def _fsdp_problem(self, p, model, cpu_bf16):
        if self.data != "fsdp":
            return None
        k, n_layer = p.blocks_per_unit, model.n_layer
        if n_layer % k or k > n_layer:
            return (f"parallel.blocks_per_unit={k} can't split the model's {n_layer} blocks into equal units; use a "
                    f"divisor of {n_layer}")
        n_units = n_layer // k + 2  # + the embedding and the norm + head
        if p.prefetch >= n_units:
            return (f"parallel.prefetch={p.prefetch}: there are {n_units} units, so at most {n_units - 1} can be "
                    f"gathered ahead of the current one")
        if p.cpu_offload and p.param_dtype == "bfloat16" and not cpu_bf16:
            return ("parallel.cpu_offload=true casts the CPU-held shards to param_dtype=bfloat16 on the CPU, which "
                    "this CPU can't do; use parallel.param_dtype=float32")
        return None

    def _tie_problem(self, model):
        """A tied embedding is one parameter used at both ends of the model: fine wherever every rank holds the
        whole model (single, DDP, ZeRO-1/2 ours, context parallel), refused where the two ends would hold it apart."""
        if not model.tie_embeddings:
            return None
        where = ("parallel.pp={} puts the embedding on the first pipeline stage and the head on the last".format(
            self.pp) if self.pp > 1 else
            f"parallel.tp={self.tp} splits the embedding (vocab-parallel lookup) and the head (vocab-parallel "
            f"logits) apart" if self.tp > 1 else
            "FSDP gathers the embedding and the head in two units" if self.strategy == "fsdp" else
            "torch's ZeRO-2 twin (FSDP2) shards the embedding and the head in two units"
            if self.strategy == "zero2" and self.impl == "torch" else None)
        if where is None:
            return None
        return (f"model.tie_embeddings=true: {where}, and one weight can't live in two places; use "
                f"model.tie_embeddings=false, or parallel=ddp or zero1/zero2 (impl=scratch)")

    def _dtype_problem(self, p, dtype, bf16):
        if self.working_dtype(p.param_dtype, dtype) == "bfloat16" and not bf16:
            return ("parallel.param_dtype=bfloat16: this device can't compute in bfloat16; use "
                    "parallel.param_dtype=float32")
        return None

    def _moe_problem(self, model, p, dtype):
        """Mixture of experts (model.py's MoE) and expert parallelism (parallel/ep.py): what is built so far."""
        n, ep = model.n_experts, self.ep
        if ep > 1 and not n:
            return (f"parallel.ep={ep} splits each MoE block's experts over ranks, but the model has none "
                    f"(model.n_experts=0)")
        if not n:
            return None
        if self.impl == "deepspeed":  # deepspeed.moe.layer.MoE gates with its own top-1/top-2 (GShard) policy
            return (f"model.n_experts={n} with parallel.impl=deepspeed: DeepSpeed's MoE routes by its own gate (top-1 "
                    f"or top-2, its capacity and token-dropping policy), not model.py's router, so it would train "
                    f"another model; use parallel.impl=scratch")
        if self.tp > 1 and (self.impl != "scratch" or p.sequence_parallel):
            setting, why = (f"parallel.impl={self.impl}", "torch's plan (parallelize_module) knows the dense MLP only") \
                if self.impl != "scratch" else ("parallel.sequence_parallel=true", "each rank would route its piece of "
                                                "the sequence, its router's statistics summed over tp")
            return (f"model.n_experts={n} with parallel.tp={self.tp} and {setting}: not built yet ({why}); an MoE "
                    f"runs beside ours tp without sequence parallel, its routed experts whole on every tp rank")
        if self.cp > 1 and model.capacity_factor is not None:
            return (f"model.capacity_factor={model.capacity_factor} with parallel.cp={self.cp}: an expert's capacity "
                    f"keeps a micro-batch's earliest tokens, and context parallelism splits each sequence over ranks; "
                    f"use model.capacity_factor=null (dropless) or parallel.cp=1")
        if self.pp > 1 and self.impl == "torch":  # train.py scales the balancing loss's gradient as ours pipeline does
            return (f"model.n_experts={n} with parallel.pp={self.pp} parallel.impl=torch: torch.distributed.pipelining "
                    f"divides the gradients by the micro-batches itself, the balancing loss's too, which train.py "
                    f"has already scaled (not wired); use parallel.impl=scratch")
        if ep == 1:
            return None
        if n % ep:
            return f"parallel.ep={ep} must divide model.n_experts={n}: each ep rank holds an equal share of the experts"
        if self.reduce_ranks % ep:
            return (f"parallel.ep={ep} takes its ranks from the {self.reduce_ranks} data-parallel ranks (dp x cp), "
                    f"and must divide them")
        if self.data not in ("ddp", "zero1", "zero2", "fsdp") or self.impl != "scratch" or self.hsdp:
            return (f"parallel.ep={ep} with parallel.data={self.data} parallel.impl={self.impl}"
                    f"{' parallel.dp_replicate=' + str(self.dp_replicate) if self.hsdp else ''}: expert parallelism "
                    f"runs beside ours DDP, ZeRO-1, ZeRO-2 and FSDP so far (parallel.impl=scratch, no HSDP); the "
                    f"twins are not wired to it yet")
        if self.data in ("zero1", "zero2") and self.working_dtype(p.param_dtype, dtype) != "float32":
            return (f"parallel.ep={ep} with parallel.param_dtype={self.working_dtype(p.param_dtype, dtype)}: the "
                    f"experts stay out of ZeRO's buckets, whole and in float32, with no bf16 working copy; use "
                    f"parallel.param_dtype=float32 (train.dtype=bfloat16's autocast still computes them in bf16)")
        return None

    def _pp_problem(self, p, model, micro_batches, ac="none"):
        """A pipeline's rules; `micro_batches`: per step and dp rank. Stages may hold unequal numbers of blocks
        (parallel/pp.py split_blocks: as even as they go), never none."""
        from parallel.pp import split_blocks
        pp, s = self.pp, p.pp_schedule
        if pp == 1:
            return None
        v = p.pp_virtual if s == "interleaved_1f1b" else 1
        if s == "interleaved_1f1b" and v < 2:
            return ("parallel.pp_schedule=interleaved_1f1b with parallel.pp_virtual=1 is 1f1b; set pp_virtual to 2 "
                    "or more")
        if pp * v > model.n_layer:
            return (f"parallel.pp={pp}{f' x pp_virtual={v}' if v > 1 else ''} = {pp * v} stages, but the model has "
                    f"{model.n_layer} blocks (model.n_layer): every stage needs at least one")
        if v > 1 and micro_batches % pp:
            return (f"parallel.pp_schedule=interleaved_1f1b sends micro-batches through each chunk in groups of "
                    f"pp={pp}, but a step has {micro_batches} (train.global_batch_size / (micro_batch_size x dp)); "
                    f"make it a multiple of {pp}")
        if s == "zero_bubble" and ac == "selective":  # seen: "Trying to backward an extra time"
            return ("train.activation_checkpointing=selective with parallel.pp_schedule=zero_bubble: zero-bubble "
                    "runs each block's backward twice (B for the input gradient, W for the weights), and torch's "
                    "selective checkpointing allows one; use full or every_n, or another schedule")
        if self.tp > 1 and self.impl == "torch":
            return ("parallel.pp > 1 with parallel.tp > 1 and parallel.impl=torch is not built yet (torch's tensor "
                    "parallel is not wired to the stage split); use parallel.impl=scratch")
        if self.impl == "deepspeed":
            return "parallel.pp > 1 with parallel.impl=deepspeed is not wired; use parallel.impl=scratch or torch"
        if self.impl == "torch" and self.dp > 1:
            # torch's schedules drive the data strategy's wrapper as the stage's module (parallel/pp.py, torch_step)
            why = {"interleaved_1f1b": "drives the data strategy's wrapper as a stage's module, and ours wraps all "
                                       "of a rank's chunks in one (torchtitan wraps each chunk apart)",
                   "zero_bubble": "(ScheduleInterleavedZeroBubble) beside DistributedDataParallel or FSDP2 gives "
                                  "gradients that differ from single's (torch 2.13, gloo)"}.get(s)
            if s == "gpipe" and self.data in ("ddp", "zero1"):  # zero1's twin: DistributedDataParallel + ZeRO's
                why = ("(ScheduleGPipe) beside DistributedDataParallel stops in its first step on an internal assert "
                       "of DDP's reducer (rebuilt parameter indices; torch 2.13, gloo)")
            if why:
                return (f"parallel.pp_schedule={s} parallel.data={self.data} over dp={self.dp} with "
                        f"parallel.impl=torch: torch.distributed.pipelining {why}; use 1f1b, or parallel.impl=scratch")
        if p.accumulate == "sharded":
            # the schedule runs every backward under no_sync and the strategy reduces once after it (parallel/pp.py)
            return ("parallel.accumulate=sharded with parallel.pp > 1: a pipeline's strategy reduces once after the "
                    "schedule, not every micro-step; use parallel.accumulate=local")
        sizes = [len(r) for r in split_blocks(model.n_layer, pp * v)]  # as even as they go; the first ones longer
        if self.data == "fsdp" and any(n % p.blocks_per_unit for n in sizes):
            # FSDP gathers a unit around its own blocks' forward and backward; a unit across two stages (or two
            # chunks of one rank) would be needed while the other runs
            return (f"parallel.blocks_per_unit={p.blocks_per_unit}: the {pp * v} pipeline stages hold "
                    f"{', '.join(map(str, sizes))} blocks, and an FSDP unit must not span two; use a divisor of each")
        return None
