"""Distributed checkpoints: each rank writes and reads only what it holds (torch.distributed.checkpoint, DCP), and a
checkpoint written under any strategy and world size loads under any other.

One layout for every strategy. A checkpoint stores each parameter and each piece of optimizer state as the tensor it
is in a single process, under a global name (`model.<param>`, `optim.<param>.<state>`, e.g.
`optim.blocks.0.mlp.up.weight.exp_avg`), and each rank writes the rectangles of it that it holds, at their global
offsets. DCP records where every rectangle lies; loading asks for the rectangles the new layout holds, and DCP reads
the overlapping parts of the saved ones. That is the whole of resharding: ZeRO-2 on 2 ranks writes ranges of
flattened parameters, TP on 4 ranks reads blocks of rows, and neither knows of the other.

What each strategy holds (see `_layout`):
  single, ddp, zero1/2's parameters  the whole parameter: one rectangle at offset 0. Every rank would write the
                                     same one; DCP keeps one copy.
  our zero1/2 optimizer state,       segments: the range [a, z) of a flattened parameter that falls in this rank's
  our fsdp                           shard (parallel/zero.py). A range of a row-major matrix is at most 3 rectangles:
                                     the end of a row, whole rows, the start of a row.
  our zero1/2 in mixed precision     weights and optimizer state both as segments: the fp32 master (the bf16
  (parallel.param_dtype=bfloat16)    working copy is rebuilt from it after loading, `after_load`)
  our tp                             a block of rows (column-parallel) or of columns (row-parallel) at the tp rank's
                                     offset; under fsdp_tp the FSDP segments are ranges of that block.
  torch's FSDP2 / TP / fsdp_tp       DTensors, which DCP places itself.
  torch's ZeroRedundancyOptimizer    the whole state of the parameters this rank owns.

A checkpoint is a directory <run dir>/checkpoints/step_0000100 holding:
  __<rank>_0.distcp, .metadata   DCP's files: each rank's tensors; where every rectangle lies (written by rank 0)
  state.json                     step, data position, the resolved config, model shape, world size, W&B run id
  tokenizer.json                 the tokenizer, so that the checkpoint can be exported and sampled on its own
  manifest.json                  every other file's size and sha256
It is written as step_0000100.tmp and renamed once every rank has finished and the manifest is written: a directory
named step_<n> is complete. A crash mid-save leaves only a .tmp directory, which is never loaded.

Loading checks the manifest (missing, truncated or corrupt files), then the shapes against the model, before reading
anything into it. Nothing in a checkpoint is unpickled but DCP's metadata, through an unpickler that accepts only
DCP's metadata classes; tensors load with torch.load(weights_only=True), the rest is JSON.
"""
import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from config import ConfigError
from parallel.comm import all_ranks

NAME = re.compile(r"step_(\d{7})")


def _quiet(fn, *args, **kwargs):
    """fn(...) without DCP's warning that there is no process group: one process (parallel=single, exporting) is a
    case DCP supports, and it needn't say so at every save."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


class CheckpointError(ValueError):
    """A checkpoint that can't be used (missing, incomplete, corrupt, another model) or can't be written."""


# --- the layout: what this rank holds of each global tensor
class Pieces(torch.Tensor):
    """The rectangles of one global tensor that this rank holds, as DCP takes them: a tensor of the global shape
    (metadata only, no storage) whose `pieces` are [(global offsets, view)]. The views point where the values
    live, so saving reads them and loading writes straight into them."""

    @staticmethod
    def __new__(cls, shape, pieces, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.pieces = [(torch.Size(offsets), view) for offsets, view in pieces]
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"Pieces only describes a checkpoint's layout; {func} can't run on it")

    def __repr__(self):
        return f"Pieces({list(self.shape)}, {[(list(o), list(v.shape)) for o, v in self.pieces]})"

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=dcp_metadata.MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=dcp_metadata.ChunkStorageMetadata(o, v.shape),
                                                      properties=dcp_metadata.TensorProperties.create_from_tensor(v),
                                                      size=self.shape))
                for o, v in self.pieces]

    def __create_chunk_list__(self):
        return [dcp_metadata.ChunkStorageMetadata(o, v.shape) for o, v in self.pieces]

    def __get_tensor_shard__(self, index):
        return next(v for o, v in self.pieces if o == index.offset)


def rects(shape, origin, start, n):
    """The flat range [start, start + n) of a row-major tensor of `shape` that sits at `origin` in a bigger one, as
    rectangles [(global offsets, sizes, position in the range)]: the end of a row, whole rows, the start of a row;
    a row of a stacked tensor (model.py's experts, (E, rows, cols)) is itself a matrix, cut the same way."""
    if len(shape) == 1:
        return [((origin[0] + start,), (n,), 0)]
    inner, out, pos = math.prod(shape[1:]), [], 0
    row, col = divmod(start, inner)

    def part(row, start, k, pos):  # a piece of one row: the row's own rectangles, one row deep
        return [((origin[0] + row, *o), (1, *s), pos + p) for o, s, p in rects(shape[1:], origin[1:], start, k)]
    if col:
        k = min(inner - col, n)
        out += part(row, col, k, 0)
        pos, row = k, row + 1
    if (n - pos) // inner:
        rows = (n - pos) // inner
        out.append(((origin[0] + row, *origin[1:]), (rows, *shape[1:]), pos))
        pos, row = pos + rows * inner, row + rows
    if pos < n:
        out += part(row, 0, n - pos, pos)
    return out


@dataclasses.dataclass
class Entry:
    """One parameter as this rank holds it. A holder is (tensor, start): the tensor's flattened values are
    [start, start + numel) of the (tp-local) parameter, whose block sits at `origin` of the global one."""
    shape: tuple           # global
    local_shape: tuple     # the tp-local parameter's
    origin: tuple
    model: list            # holders of the weights
    optim: list            # holders that are keys of the optimizer's state
    dtensor: object = None  # torch's strategies: the DTensor parameter itself


def _layout(par):
    """{parameter name: Entry} for this rank (names as in a single-process model), from the strategies' interface
    (parallel/strategy.py): tensor parallel says where a local parameter sits in the full one, the data-parallel
    strategy which tensors hold its weights and its optimizer state."""
    out = {}
    for name, p in par.module.named_parameters():
        if isinstance(p, DTensor):
            out[name] = Entry(tuple(p.shape), tuple(p.shape), (0,) * p.dim(), [], [(p, 0)], dtensor=p)
            continue
        local_shape = par.data.shape(p)
        # an expert is whole over tp (parallel/tp.py) and split over ep
        shape, origin = par.ep.global_layout(name, p) if par.ep.expert(name) else par.tp.global_layout(name, p) \
            if par.tp.size > 1 else (local_shape, (0,) * len(local_shape))
        model_h, optim_h = par.data.holders(p)
        out[name] = Entry(shape, local_shape, origin, model_h, optim_h)
    return out


def _pieces(e, holders, values):
    """Pieces of the global tensor for values shaped like the holders (the weights, or one state per holder)."""
    pieces = []
    for (h, start), v in zip(holders, values):
        flat = v.detach().view(-1)  # the same memory (holders are contiguous), outside autograd
        for offsets, sizes, pos in rects(e.local_shape, e.origin, start, h.numel()):
            pieces.append((offsets, flat[pos: pos + math.prod(sizes)].view(sizes)))
    ref = holders[0][0] if holders else None
    return Pieces(e.shape, pieces, ref.dtype if ref is not None else torch.float32,
                  ref.device if ref is not None else "cpu")


def router_biases(module):
    """{"router.<block>.expert_bias": tensor} of the MoE blocks with router=bias (model.py MoE): the per-expert
    biases training moves each step, state that is no parameter; the same on every rank (each moves them by the same
    sums), so a checkpoint holds them once, whole."""
    from model import MoE
    return {f"router.{name}.expert_bias": m.expert_bias for name, m in module.named_modules()
            if isinstance(m, MoE) and m.rule == "bias"}


def state_dict(par):
    """This rank's part of the model and optimizer state, under global names, for dcp.save and dcp.load, and the
    routers' biases (router_biases).
    Also returns [(tensor loaded, [tensors to copy it to])] for scalars (Adam's step) that several holders share."""
    sd, copies = dict(router_biases(par.module)), []
    state = par.data.optimizer_state()
    for name, e in _layout(par).items():
        if e.dtensor is not None:
            sd[f"model.{name}"] = e.dtensor
        else:
            sd[f"model.{name}"] = _pieces(e, e.model, [h for h, _ in e.model])
        keys = sorted({k for h, _ in e.optim for k, v in state.get(h, {}).items() if torch.is_tensor(v)})
        for k in keys:
            values = [state[h][k] for h, _ in e.optim]
            if values[0].dim() == 0 or e.dtensor is not None:  # a scalar, or torch's DTensor state
                sd[f"optim.{name}.{k}"] = values[0]
                copies.append((values[0], values[1:]))
            else:
                sd[f"optim.{name}.{k}"] = _pieces(e, e.optim, values)
    return sd, copies


def _local_tensors(sd):
    for v in sd.values():
        if isinstance(v, Pieces):
            yield from (t for _, t in v.pieces)
        elif isinstance(v, DTensor):
            yield v.to_local()
        else:
            yield v


# --- saving
def save(root, step, par, files, keep):
    """Write checkpoint step_<step> under `root` (every rank calls it) and keep the newest `keep`; returns its path.
    `files`: {name: JSON object} that rank 0 writes beside the tensors (state.json, to which it adds the optimizer
    class; tokenizer.json). Refuses, on every rank, to write weights that are not finite."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = os.path.join(root, f"step_{step:07d}")
    if os.path.isdir(final):  # already saved at this step (say, a periodic save at the last step)
        return final
    sd, _ = state_dict(par)
    finite = all(bool(torch.isfinite(t).all()) for t in _local_tensors(sd) if t.is_floating_point())
    if not all_ranks(finite, dist.ReduceOp.MIN):
        raise CheckpointError(f"step {step}: the weights or optimizer state are not finite (nan/inf); no checkpoint "
                              f"written, earlier ones in {root} are untouched")
    sd.update(_rng_state(rank))
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed at this step before
        os.makedirs(tmp)
    _barrier()
    _quiet(dcp.save, sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1))
    # each rank hashes the files it wrote; rank 0 adds its own and writes the manifest, then renames
    mine = {f: _digest(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith(f"__{rank}_")}
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {**files, "state.json": {**files["state.json"], "optimizer": type(par.data.local_optimizer).__name__}}
        for name, obj in files.items():
            _write_json(os.path.join(tmp, name), obj)
        files = {k: v for d in everyone for k, v in d.items()}
        for f in os.listdir(tmp):
            if f not in files:  # .metadata, state.json, tokenizer.json
                files[f] = _digest(os.path.join(tmp, f))
        _write_json(os.path.join(tmp, "manifest.json"), {"files": files})
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in complete(root)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def _rng_state(rank):
    """This rank's RNG states (uint8 tensors). Training draws nothing at random after init (batches are a function
    of seed and step), but code that does, dropout say, resumes exactly with them."""
    out = {f"rng.{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def check_shared(out_dir, rank):
    """A checkpoint is one folder every rank writes its shard into, and any layout reads back: across machines that
    needs train.out_dir on a file system they all share. Rank 0 leaves a file there; every rank must see it. Raises
    CheckpointError (one line, on every rank) where some rank does not, before anything of the run is written."""
    import uuid
    name = [f".shared-probe-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    probe = os.path.join(os.path.expanduser(out_dir), name[0])  # each rank's own train.out_dir: the same string
    if rank == 0:
        os.makedirs(os.path.dirname(probe), exist_ok=True)
        open(probe, "w").close()
    dist.barrier()
    seen = os.path.exists(probe)
    missing = [None] * dist.get_world_size()
    dist.all_gather_object(missing, None if seen else f"{rank} ({socket.gethostname()})")
    dist.barrier()
    if rank == 0:
        os.remove(probe)
    missing = [m for m in missing if m]
    if missing:
        raise CheckpointError(f"checkpoint.keep>0 writes every rank's shard into one folder under train.out_dir="
                              f"{out_dir}, but rank {missing[0]} does not see rank 0's files there: put it on a file "
                              f"system every node shares, or set checkpoint.keep=0")


# --- resuming, and the faults that make a run resume
def resume_from(cfg, run_dir):
    """The checkpoint train.resume names (a path, or None to start afresh). A run dir that already holds a run is
    only ever continued (auto), never written over."""
    r = str(cfg.train.resume)
    r = "none" if r.lower() in ("none", "null") else r  # train.resume=null reads as Python's None
    found = complete(os.path.join(run_dir, "checkpoints"))
    taken = [f for f in ("config.yaml", "metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(run_dir, f))]
    if r == "auto" and found:
        return found[-1]
    if r == "auto" and taken and same_config(cfg, run_dir):
        return None  # restarted (torchrun --max-restarts, a requeued job) before its first checkpoint: start again
    if taken:
        raise ConfigError(f"run dir {run_dir} already holds a run ({', '.join(taken)}) "
                          f"{'with another config and no checkpoint' if r == 'auto' else 'and train.resume=' + r}; "
                          f"choose another with hydra.run.dir=..., continue it with train.resume=auto, or move it away")
    if r in ("auto", "none"):
        return None
    try:
        return find(r)
    except CheckpointError as e:
        raise ConfigError(f"train.resume={r}: {e}") from None


def sha256_json(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def same_config(cfg, run_dir):
    from omegaconf import OmegaConf
    path = os.path.join(run_dir, "config.yaml")
    return os.path.exists(path) and OmegaConf.to_container(OmegaConf.load(path)) == \
        OmegaConf.to_container(cfg, resolve=True)


class Diverged(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


class Preemption:
    """SIGTERM (SLURM preempting or reaching the time limit, torchrun stopping its workers) asks for a checkpoint at
    the end of a step and a clean exit. Every rank must stop at the same step, so with several ranks the flag is
    agreed on with a one-element all-reduce, on log steps only: no step between them waits for the host. (A SLURM
    job asking for the signal ahead of its time limit, `--signal=TERM@120`, leaves time for log_every steps.)"""

    def __init__(self):
        self.flag, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame):
        self.flag = True

    def requested(self, log_step):
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.flag
        return log_step and all_ranks(self.flag, dist.ReduceOp.MAX)

    def close(self):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def check_finite(first_bad, step, last_checkpoint):
    """Stop if any step up to `step` had a loss or gradient norm that is not finite (first_bad: the first such step
    seen on this rank, a device tensor, so that steps need not wait for the device; checked when logging)."""
    if dist.is_initialized():
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
    bad = int(first_bad.item())
    if bad <= step:
        kept = f"the last checkpoint, {last_checkpoint}, is untouched" if last_checkpoint else "no checkpoint written"
        raise Diverged(f"step {bad}: the loss or gradient norm is not finite (nan/inf); stopped, {kept}")


# --- finding
def complete(root):
    """The complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if NAME.fullmatch(d)]


def find(path):
    """The checkpoint `path` names: a checkpoint directory, or the newest complete one in a run dir or its
    checkpoints/ directory. Raises CheckpointError."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    if os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(os.path.join(path, "manifest.json")):
        if path.rstrip("/").endswith(".tmp"):
            raise CheckpointError(f"{path} is an unfinished save (a .tmp directory); use a step_<n> one")
        return path
    found = complete(os.path.join(path, "checkpoints")) or complete(path)
    if not found:
        raise CheckpointError(f"{path} holds no complete checkpoint (step_<n> directories)")
    return found[-1]


# --- loading
class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its .metadata; this unpickler builds only DCP's metadata classes and torch's sizes and dtypes,
    so a crafted file can't run code."""
    SAFE = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_StorageInfo", "_MEM_FORMAT_ENCODING"}
    # a layout by its name; the checkpoint's path; what older DCP versions wrote
    ALSO = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib._local", "PosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint.") and name in self.SAFE:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        if (module, name) in self.ALSO:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(str(self.path), ".metadata"), "rb") as f:
            try:
                md = _MetadataUnpickler(f).load()
            except Exception as e:
                raise CheckpointError(f"{self.path}/.metadata is not a checkpoint's metadata ({e})") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def verify(path):
    """Check every file against the manifest (every rank calls it; each hashes its share of the files). Returns
    (state.json, DCP metadata). Raises CheckpointError, the same on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = []
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        files = {}
        problems.append(f"{path} is not a complete checkpoint: manifest.json unreadable ({type(e).__name__})")
    for i, (name, want) in enumerate(sorted(files.items())):
        full = os.path.join(path, name)
        if not os.path.exists(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != want["bytes"]:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest says {want['bytes']} "
                            f"(truncated?)")
        elif i % world == rank and _digest(full)["sha256"] != want["sha256"]:
            problems.append(f"{full} is corrupt (its sha256 differs from the manifest's)")
    if dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = sorted({p for ps in everyone for p in ps})
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
    with open(os.path.join(path, "state.json")) as f:
        info = json.load(f)
    return info, _Reader(path).read_metadata()


def load(path, par):
    """Load checkpoint `path` into this rank's model and optimizer, whatever strategy and world size wrote it.
    Every rank calls it. Returns the checkpoint's state.json. Raises CheckpointError before changing anything if the
    checkpoint is damaged or of another model."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    info, md = verify(path)
    saved = md.state_dict_metadata
    optimizer = type(par.data.local_optimizer).__name__
    if info.get("optimizer") != optimizer:
        raise CheckpointError(f"{path} holds {info.get('optimizer')}'s state, this run's optimizer is {optimizer}")
    layout = _layout(par)
    names = {k[len("model."):] for k in saved if k.startswith("model.")}
    model_names = par.pipeline.names if par.pipeline else set(layout)  # a pipeline stage holds some of them
    if names != model_names:
        diff = sorted(names ^ model_names)
        raise CheckpointError(f"{path} is a checkpoint of another model: {len(diff)} parameters differ, e.g. "
                              f"{diff[0]} (saved with model {info.get('model')})")
    for name, e in layout.items():
        if tuple(saved[f"model.{name}"].size) != e.shape:
            raise CheckpointError(f"{path} holds {name} of shape {list(saved[f'model.{name}'].size)}, this model's "
                                  f"is {list(e.shape)}: it was saved with model {info.get('model')}")
    _make_state(par.data.local_optimizer, layout, saved)
    sd, copies = state_dict(par)
    missing = sorted(k for k in sd if k not in saved)
    if missing and missing[0].startswith("router."):
        raise CheckpointError(f"{path} has no {missing[0]}: saved by a run whose model.router was not bias")
    if missing:
        raise CheckpointError(f"{path} has no {missing[0]}: saved with optim {info.get('config', {}).get('optim')}")
    rng = {}
    if info.get("world_size") == world:  # the same ranks: each gets its own generator back
        rng = {k: torch.empty(saved[k].size, dtype=torch.uint8) for k in _rng_state(rank) if k in saved}
    _quiet(dcp.load, {**sd, **rng}, storage_reader=_Reader(path))
    for src, others in copies:
        for t in others:
            t.copy_(src)
    par.data.after_load()  # ZeRO in mixed precision: the bf16 working weights from the fp32 masters just read
    if f"rng.{rank}.cpu" in rng:
        torch.set_rng_state(rng[f"rng.{rank}.cpu"])
    if f"rng.{rank}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"rng.{rank}.cuda"])
    return info


def _make_state(optimizer, layout, saved):
    """Create the optimizer state the checkpoint holds (a fresh optimizer has none until its first step), as the
    optimizer would: zeros shaped like each holder, float32 scalars (Adam's step) where it keeps them."""
    state = optimizer.state
    # Adam keeps `step` on the parameter's device when fused or capturable (the fused kernel reads it there and
    # does not check), on the CPU otherwise: as torch.optim.Adam's _init_group does
    on_device = {id(p) for g in optimizer.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
    wanted = {}
    for key, m in saved.items():
        if key.startswith("optim."):
            name, k = key[len("optim."):].rsplit(".", 1)
            wanted.setdefault(name, {})[k] = m
    for name, e in layout.items():
        for h, _ in e.optim:
            for k, m in wanted.get(name, {}).items():
                if k not in state[h]:
                    state[h][k] = torch.zeros((), dtype=torch.float32, device=h.device if id(h) in on_device
                                              else "cpu") if len(m.size) == 0 else torch.zeros_like(h)


def consolidate(path):
    """(full weights {name: tensor}, state.json, tokenizer.json) of any checkpoint, read on this one process."""
    if dist.is_initialized():
        raise CheckpointError("consolidate runs in one process, outside a process group")
    info, md = verify(path)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith(("model.", "router."))}
    _quiet(dcp.load, sd, storage_reader=_Reader(path), no_dist=True)
    with open(os.path.join(path, "tokenizer.json")) as f:
        tok = json.load(f)
    return {k.split(".", 1)[1]: v for k, v in sd.items()}, info, tok  # the biases as <block>.expert_bias


# --- export: one file, one process
def export(path, out):
    """Consolidate checkpoint `path` into the single safetensors file `out`: the full weights, and in its metadata
    the model's shape, the tokenizer and the training config. Never overwrites a file."""
    from safetensors.torch import save_file
    if os.path.exists(out):
        raise CheckpointError(f"{out} already exists; export to a new name")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise CheckpointError(f"{os.path.dirname(out)}: no such directory")
    weights, info, tok = consolidate(find(path))
    meta = {"model": info["model"], "step": info["step"], "tokenizer": tok, "config": info.get("config")}
    save_file({k: v.contiguous() for k, v in weights.items()}, out + ".tmp",
              metadata={"nanoparallel": json.dumps(meta)})
    os.replace(out + ".tmp", out)
    return sum(v.numel() for v in weights.values()), info["step"]


def main(argv=None):
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m checkpoint",
                                 description="Export a checkpoint (any strategy, any world size) to one safetensors "
                                             "file that `python sample.py` loads.")
    ap.add_argument("checkpoint", help="a checkpoint directory (step_<n>), or a run dir: its newest checkpoint")
    ap.add_argument("out", help="the .safetensors file to write (must not exist)")
    args = ap.parse_args(argv)
    try:
        n, step = export(args.checkpoint, args.out)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}: {n / 1e6:.2f}M parameters, step {step}")


if __name__ == "__main__":
    main()
