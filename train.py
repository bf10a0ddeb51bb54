"""Train a GPT. The recipe, top to bottom: config -> checks -> process group -> data -> model -> optimizer -> loop.

    python train.py                                   # tiny GPT on the stdlib's Python sources, CPU or GPU
    python train.py model=gpt_125m data=text data.paths=[my.txt] train.max_steps=2000
    torchrun --nproc_per_node=4 train.py parallel=zero2 parallel.impl=scratch
    python train.py -m parallel=ddp,zero1,zero2,fsdp launcher.nproc_per_node=4   # a sweep of 4-rank jobs

Every setting lives in conf/ (Hydra); `python train.py --help` lists the groups and their options.
Bad settings stop the run with one line, `error: ...`, before any work and before anything is written.
"""
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import resource
import signal
import sys
import threading
import time

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import OmegaConf
from tqdm import tqdm

import parallel
from data import prepare, shards
from model import GPT, GPTConfig
from parallel import checkpoint, launch, plan
from parallel.comm import CommCounter


class ConfigError(ValueError):
    """A setting that can't work; reported as one line before any work."""


class Diverged(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


def check_config(cfg, run_dir, world):
    """Everything that can be known wrong before work starts; returns (device, dtype, grad_accum, checkpoint to
    resume from or None)."""
    t, d = cfg.train, cfg.data
    resume = resume_from(cfg, run_dir)
    problem = parallel.check(cfg.parallel, world, model_config(cfg, vocab_size=prepare.vocab_size(d)), t.seq_len,
                             cpu_bf16=bf16_supported("cpu"))
    if problem:
        raise ConfigError(problem)
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={t.device!r}: expected auto, cpu or cuda")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but torch sees no CUDA device")
    device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
    if t.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"train.dtype={t.dtype!r}: expected auto, float32 or bfloat16")
    if t.dtype == "bfloat16" and not bf16_supported(device):
        raise ConfigError(f"train.dtype=bfloat16, but this {device} can't compute in bfloat16; use train.dtype=float32")
    dtype = t.dtype if t.dtype != "auto" else ("bfloat16" if device == "cuda" and bf16_supported(device) else "float32")
    dp_world, _ = parallel.degrees(cfg.parallel, world)  # tensor-parallel ranks share one slice of the batch
    for key in ("global_batch_size", "micro_batch_size", "seq_len", "max_steps", "eval_every", "eval_steps",
                "log_every"):
        if t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]} must be at least 1")
    for key in ("every", "keep"):
        if not isinstance(cfg.checkpoint[key], int) or cfg.checkpoint[key] < 0:
            raise ConfigError(f"checkpoint.{key}={cfg.checkpoint[key]!r} must be a whole number, 0 or more")
    if t.global_batch_size % (t.micro_batch_size * dp_world):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel ranks ({dp_world})")
    if t.activation_checkpointing not in ("none", "full", "every_n") or t.ac_every < 1:
        raise ConfigError(f"train.activation_checkpointing={t.activation_checkpointing!r} (ac_every={t.ac_every}): "
                          f"expected none, full or every_n with ac_every >= 1")
    if t.seq_len > cfg.model.block_size:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than the model's context "
                          f"(model.block_size={cfg.model.block_size})")
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < prepare.vocab_size(d):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"({prepare.vocab_size(d)}); leave it null to follow the tokenizer")
    if cfg.optim.name not in ("adamw", "sgd"):
        raise ConfigError(f"optim.name={cfg.optim.name!r}: expected adamw or sgd")
    if cfg.logger.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.mode={cfg.logger.mode!r}: expected offline, online or disabled")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
    if d.tokenizer not in ("bpe", "gpt2"):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: expected bpe or gpt2")
    if d.tokenizer == "bpe" and d.vocab_size <= 257:
        raise ConfigError(f"data.vocab_size={d.vocab_size}: a byte-level BPE needs more than 257 tokens")
    try:
        shards.token_dtype(prepare.vocab_size(d), d.token_dtype)  # vocab too large for the shard dtype
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if d.source != "fineweb_edu":
        prepare.local_files(d)  # missing paths, empty corpus
    return device, dtype, t.global_batch_size // (t.micro_batch_size * dp_world), resume


def resume_from(cfg, run_dir):
    """The checkpoint train.resume names (a path, or None to start afresh). A run dir that already holds a run is
    only ever continued (auto), never written over."""
    r = str(cfg.train.resume)
    r = "none" if r.lower() in ("none", "null") else r  # train.resume=null reads as Python's None
    found = checkpoint.complete(os.path.join(run_dir, "checkpoints"))
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
        return checkpoint.find(r)
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"train.resume={r}: {e}") from None


def same_config(cfg, run_dir):
    path = os.path.join(run_dir, "config.yaml")
    return os.path.exists(path) and OmegaConf.to_container(OmegaConf.load(path)) == \
        OmegaConf.to_container(cfg, resolve=True)


def model_config(cfg, vocab_size):
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size or vocab_size, block_size=m.block_size, n_layer=m.n_layer,
                     n_head=m.n_head, n_embd=m.n_embd)


def bf16_supported(device):
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # CPUs with AVX512-BF16/AMX, or emulation that oneDNN trusts


def lr_at(step, o, max_steps):
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model, o):
    # decay matrices (linear weights, embeddings), not norm gains: a gain pulled toward 0 only fights the norm
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


@torch.no_grad()
def evaluate(model, opt, val, cfg, autocast, device, rank, world):
    """Mean loss over eval_steps fixed val batches (the same ones at every evaluation), averaged over ranks."""
    model.eval()
    t = cfg.train
    dp, tp = parallel.degrees(cfg.parallel, world)
    total = torch.zeros((), device=device)
    for i in range(t.eval_steps):
        x, y = shards.get_batch(val, "val", t.seed, i, t.micro_batch_size * dp, t.seq_len, rank // tp, dp)
        with autocast, parallel.loss_parallel(cfg.parallel):
            total += model(x.to(device), y.to(device)).float()
    if world > 1:
        dist.all_reduce(total)  # the tp ranks of a dp group hold the same loss: the mean over all ranks is right
    parallel.reshard(model, opt)  # a forward without backward may leave sharded parameters gathered
    model.train()
    return total.item() / (t.eval_steps * world)


class Metrics:
    """metrics.jsonl (one JSON object per line) and W&B, on rank 0; on other ranks every call does nothing."""

    def __init__(self, cfg, run_dir, rank, wandb_id=None):
        self.on, self.id = rank == 0, None
        if not self.on:
            return
        import wandb
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # a resumed run adds to the same file
        lg = cfg.logger
        self.wandb = wandb.init(project=lg.project, group=lg.group, name=lg.name, mode=lg.mode, dir=run_dir,
                                config=OmegaConf.to_container(cfg, resolve=True),
                                settings=wandb.Settings(console="off", quiet=True),
                                id=wandb_id, resume="allow" if wandb_id else None)  # a resumed run: the same W&B run
        self.id = None if lg.mode == "disabled" else self.wandb.id

    def log(self, record):
        if self.on:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        if self.on:
            self.file.close()
            self.wandb.finish()


def peak_memory_mb(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS (Linux: KiB)


class Preemption:
    """SIGTERM (SLURM preempting or reaching the time limit, torchrun stopping its workers) asks for a checkpoint at
    the end of the current step and a clean exit. Every rank must stop at the same step, so the flag is agreed on
    with a one-element all-reduce per step (outside the step's communication counts)."""

    def __init__(self):
        self.flag, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame):
        self.flag = True

    def requested(self):
        return parallel.all_ranks(self.flag, dist.ReduceOp.MAX)

    def close(self):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def sha256_json(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def check_finite(first_bad, step, world, last_checkpoint):
    """Stop if any step up to `step` had a loss or gradient norm that is not finite (first_bad: the first such step
    seen on this rank, a device tensor, so that steps need not wait for the device; checked when logging)."""
    if world > 1:
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
    bad = int(first_bad.item())
    if bad <= step:
        kept = f"the last checkpoint, {last_checkpoint}, is untouched" if last_checkpoint else "no checkpoint written"
        raise Diverged(f"step {bad}: the loss or gradient norm is not finite (nan/inf); stopped, {kept}")


def run(cfg, run_dir):
    # --- process group: torchrun sets RANK/WORLD_SIZE; plain `python train.py` is one process
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device, dtype, accum, resume = check_config(cfg, run_dir, world)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 or cfg.parallel.name != "single":  # a one-rank FSDP still calls collectives (on itself)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", **launch.process_group_store())
        dist.barrier()  # every rank has checked the run dir before rank 0 writes into it
        if rank > 0:  # one console: the other ranks print to rank<k>.log in the run dir
            launch.log_to_file(run_dir, rank)
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    print0 = print if rank == 0 else (lambda *a, **k: None)
    t, o = cfg.train, cfg.optim

    # --- data: one process per machine prepares the shards, the others wait and then read the cache
    if local_rank == 0:
        prepare.prepare(cfg.data, cfg.data.cache_dir, log=print0)
    if world > 1:
        dist.barrier()
    data_dir = prepare.prepare(cfg.data, cfg.data.cache_dir)
    train_tokens, val_tokens, enc, meta = prepare.load(data_dir)
    for name, toks in (("train", train_tokens), ("val", val_tokens)):
        if len(toks) <= t.seq_len:
            raise ConfigError(f"the {name} split has {len(toks)} tokens, too few for seq_len={t.seq_len}; "
                              f"add text or lower data.val_fraction / train.seq_len")

    # --- model: built on the meta device and materialized in place, so no full copy is ever made elsewhere
    mcfg = model_config(cfg, meta["vocab_size"])
    mem_before_model = peak_memory_mb(device)  # what the process holds before any model state exists
    with torch.device("meta"):
        model = GPT(mcfg)
    n_params, flops_per_token = model.num_params(), model.flops_per_token(t.seq_len)
    torch.manual_seed(t.seed)
    model, opt = parallel.apply(model, cfg.parallel, lambda m: make_optimizer(m, o), device)
    parallel.apply_activation_checkpointing(model, t.activation_checkpointing, t.ac_every)
    if t.compile:
        model.compile()  # in place, so the strategies' hooks and wrappers see the same module
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" \
        else contextlib.nullcontext()
    # MFU only where the datasheet's peak is known (parallel/plan.py GPUS); a CPU's is not a number we can state
    peak = plan.peak_flops(torch.cuda.get_device_name(device)) if device.startswith("cuda") else None

    # --- resume: any strategy's checkpoint at any world size loads into this one (parallel/checkpoint.py)
    tokenizer_spec = prepare.tokenizer_spec(data_dir, meta)
    tokenizer_sha256 = sha256_json(tokenizer_spec)
    start, wandb_id = 0, None
    if resume:
        info = checkpoint.load(resume, model, opt)
        if info["model"]["vocab_size"] != mcfg.vocab_size or info["tokenizer_sha256"] != tokenizer_sha256:
            raise checkpoint.CheckpointError(f"{resume} was trained with another tokenizer or vocab "
                                             f"({info['model']['vocab_size']} tokens) than data={cfg.data.source}'s")
        start, wandb_id = info["step"], info.get("wandb_id")
        print0(f"resumed from {resume}: step {start}, written by parallel={info['parallel']['name']} on "
               f"{info['world_size']} rank(s)")
        if start >= t.max_steps:
            print0(f"step {start} is already train.max_steps={t.max_steps}: nothing to train "
                   f"(raise train.max_steps to go on)")
    if rank == 0:  # the run's first files, written once every check has passed (a resumed run keeps its config)
        os.makedirs(run_dir, exist_ok=True)
        name = "config.yaml" if not os.path.exists(os.path.join(run_dir, "config.yaml")) or same_config(cfg, run_dir) \
            else f"config.step{start}.yaml"
        OmegaConf.save(cfg, os.path.join(run_dir, name), resolve=True)

    metrics = Metrics(cfg, run_dir, rank, wandb_id)
    tokens_per_step = t.global_batch_size * t.seq_len
    reduce_bytes = parallel.DTYPES[cfg.parallel.get("reduce_dtype", "float32")].itemsize
    dp, tp = parallel.degrees(cfg.parallel, world)
    metrics.log({"step": start, "n_params": n_params, "param_bytes": n_params * reduce_bytes, "world_size": world,
                 "dp": dp, "tp": tp,
                 "flops_per_token": flops_per_token, "tokens_per_step": tokens_per_step, "grad_accum": accum,
                 "device": device, "dtype": dtype, "parallel": cfg.parallel.name,
                 "impl": cfg.parallel.get("impl", "scratch"), "mem_mb_before_model": mem_before_model})
    print0(f"model: {n_params / 1e6:.2f}M parameters, vocab {mcfg.vocab_size} (padded {mcfg.padded_vocab_size}) | "
           f"data: {len(train_tokens):,} train / {len(val_tokens):,} val tokens | {device} {dtype} | "
           f"{world} rank(s) {cfg.parallel.name}, grad accumulation {accum} | run dir {run_dir}")
    if resume:
        metrics.log({"step": start, "resumed_from": resume})
    ckpt, last_checkpoint = cfg.checkpoint, resume
    ckpt_info = {"world_size": world, "dp": dp, "tp": tp, "parallel": OmegaConf.to_container(cfg.parallel),
                 "model": dataclasses.asdict(mcfg), "tokenizer_sha256": tokenizer_sha256,
                 "wandb_id": metrics.id, "config": OmegaConf.to_container(cfg, resolve=True)}
    if rank == 0:
        print0(f"checkpoints: every {ckpt.every} steps and at the last, in {os.path.join(run_dir, 'checkpoints')}"
               if ckpt.keep else "checkpoints: none (checkpoint.keep=0)")

    # --- the loop. `step` counts finished optimizer steps; evaluation runs at 0, every eval_every, and at the end.
    # A resumed run picks up at the step after its checkpoint's: batches and the learning rate are functions of the
    # step, so the steps are the very ones an uninterrupted run takes.
    record = {"step": start}
    if start == 0:
        record["val_loss"] = evaluate(model, opt, val_tokens, cfg, autocast, device, rank, world)
        metrics.log(record)
        print0(f"step 0: val loss {record['val_loss']:.4f}")
    bar = tqdm(range(start + 1, t.max_steps + 1), initial=start, total=t.max_steps, disable=rank != 0, desc="train",
               dynamic_ncols=True, file=sys.stdout,
               mininterval=0.1 if sys.stdout.isatty() else 30)  # a log file gets a line every 30 s, not thousands
    t_last, tokens_since = time.time(), 0
    preemption, stop = Preemption(), False
    first_bad = torch.tensor(t.max_steps + 1, device=device)  # the first step whose loss or grad norm was not finite
    for step in bar:
        lr = lr_at(step - 1, o, t.max_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        # each dp group takes its slice of the global batch; the tp ranks within it take the same one
        x, y = shards.get_batch(train_tokens, "train", t.seed, step - 1, t.global_batch_size, t.seq_len, rank // tp,
                                dp)
        loss_sum = torch.zeros((), device=device)
        with CommCounter() as comm:  # every collective of the step, ours or torch's
            for micro in range(accum):
                sl = slice(micro * t.micro_batch_size, (micro + 1) * t.micro_batch_size)
                # only the last micro-step's backward communicates; the others accumulate gradients locally
                with parallel.no_sync(model, opt) if micro < accum - 1 else contextlib.nullcontext(), \
                        parallel.loss_parallel(cfg.parallel):
                    with autocast:
                        loss = model(x[sl].to(device), y[sl].to(device))
                    # each micro-batch's mean loss weighs 1/accum: the summed gradient is that of the batch's mean
                    (loss / accum).backward()
                loss_sum += loss.detach()
            grad_norm = parallel.clip_grad_norm(model, opt, o.grad_clip if o.grad_clip > 0 else math.inf)
            opt.step()
        state = parallel.state_bytes(model, opt)  # after the step, before zero_grad: everything resident
        opt.zero_grad(set_to_none=True)
        tokens_since += tokens_per_step
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm).to(device)
        first_bad = torch.where(finite | (first_bad < step), first_bad, step)

        record = {"step": step}
        stop = preemption.requested()
        save = ckpt.keep > 0 and (step == t.max_steps or stop or (ckpt.every > 0 and step % ckpt.every == 0))
        if step % t.log_every == 0 or step == t.max_steps or save or step % t.eval_every == 0:
            check_finite(first_bad, step, world, last_checkpoint)
        if step % t.log_every == 0 or step == t.max_steps:
            if world > 1:
                dist.all_reduce(loss_sum)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.time() - t_last
            tok_s = tokens_since / dt
            # rank 0's comm and state, and the largest over ranks (ZeroRedundancyOptimizer shards unevenly)
            worst = torch.tensor([comm.bytes, state], dtype=torch.float64, device=device)
            if world > 1:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            record.update(loss=loss_sum.item() / (accum * world), lr=lr, grad_norm=grad_norm.item(), tok_per_s=tok_s,
                          step_time_s=dt * tokens_per_step / tokens_since, peak_mem_mb=peak_memory_mb(device),
                          comm_bytes=comm.bytes, state_bytes=state, comm_bytes_max=int(worst[0]),
                          state_bytes_max=int(worst[1]))
            if hasattr(opt, "peak_gathered"):  # our FSDP: the most bytes of gathered units it ever held at once
                record["transient_bytes"] = opt.peak_gathered
            if peak:
                record["mfu"] = flops_per_token * tok_s / (peak * world)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            t_last, tokens_since = time.time(), 0
        if step % t.eval_every == 0 or step == t.max_steps:
            record["val_loss"] = evaluate(model, opt, val_tokens, cfg, autocast, device, rank, world)
            bar.write(f"step {step}: val loss {record['val_loss']:.4f}") if rank == 0 else None
            t_last = time.time()  # evaluation time is not training throughput
        if len(record) > 1:
            metrics.log(record)
        if save:  # every rank writes its own shard; no rank gathers the model
            last_checkpoint = checkpoint.save(
                os.path.join(run_dir, "checkpoints"), step, model, opt, keep=ckpt.keep,
                files={"state.json": {**ckpt_info, "step": step, "preempted": stop,
                                      "data": {"seed": t.seed, "next_batch": step, "global_batch_size":
                                               t.global_batch_size, "seq_len": t.seq_len,
                                               "tokens_seen": step * tokens_per_step}},
                       "tokenizer.json": tokenizer_spec})
        if stop:
            bar.write(f"SIGTERM: stopped after step {step}, checkpoint {last_checkpoint}") if rank == 0 else None
            break
    bar.close()
    preemption.close()

    # every rank samples the same way: a sharded model needs all of them to run forward (not after a SIGTERM)
    if t.sample_tokens > 0 and not stop:
        torch.manual_seed(t.seed)
        prompt = torch.tensor([enc.encode_ordinary(t.sample_prompt) or [prepare.tokenizer.eot_id(enc)]], device=device)
        with autocast:
            out = parallel.unwrap(model).generate(prompt, t.sample_tokens)
        print0("--- sample ---\n" + enc.decode(out[0].tolist()) + "\n--------------")
    metrics.close()
    if dist.is_initialized():
        # torch's DDP reducer holds the process group: free it while every peer is still connected (gloo's
        # destructor can otherwise wait forever on a peer that has already gone)
        del model, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return record


@hydra.main(config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"), config_name="config",
            version_base="1.3")
def main(cfg):
    """One job: this process's rank (torchrun, SLURM, or none), or the launcher of its own ranks
    (launcher.nproc_per_node; parallel/launch.py). In a sweep (-m) a failed job says why in one line, and the sweep
    goes on to the next job: Hydra records it as failed and exits non-zero at the end."""
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    sweep = hc.mode == RunMode.MULTIRUN
    # W&B: a sweep's jobs share a group, and a run is named by its overrides (logger.group/name override both)
    cfg.logger.group = cfg.logger.group or (hc.sweep.dir if sweep else None)
    cfg.logger.name = cfg.logger.name or hc.job.override_dirname or None
    try:
        problem = launch.check(cfg.launcher, cfg.train.device, under_torchrun="TORCHELASTIC_RUN_ID" in os.environ)
        if problem:
            raise ConfigError(problem)
        if cfg.launcher.nproc_per_node:
            check_config(cfg, run_dir, cfg.launcher.nproc_per_node * cfg.launcher.nnodes)  # before starting ranks
            launch.launch(run, cfg, run_dir, cfg.launcher)
        else:
            launch.ranks_from_submitit()
            run(cfg, run_dir)
    except (ConfigError, prepare.DataError, launch.LaunchError, checkpoint.CheckpointError, Diverged) as e:
        if not sweep:
            sys.exit(f"error: {e}")
        print(f"error: job #{hc.job.num} ({hc.job.override_dirname}): {e}", file=sys.stderr, flush=True)
        raise JobFailed(f"job #{hc.job.num} ({hc.job.override_dirname}) failed: {e}") from None


class JobFailed(CompactHydraException):
    """A sweep's job failed: the sweep goes on, and Hydra ends it with this one line rather than a traceback."""


if __name__ == "__main__":
    # call the main of the module `train`, not of `__main__`: a launcher that pickles the job (submitit) then refers
    # to it by name, train.main, and its job imports it (from the repo root, where `python train.py` runs)
    import train
    train.main()
