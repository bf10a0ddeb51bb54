"""Train a GPT. The recipe, top to bottom: config -> checks -> process group and mesh -> data -> model ->
parallelize -> loop.

    python train.py                                   # tiny GPT on the stdlib's Python sources, CPU or GPU
    python train.py model=gpt_125m data=text data.paths=[my.txt] train.max_steps=2000
    torchrun --nproc_per_node=4 train.py parallel=zero2 train.micro_batch_size=4
    torchrun --nproc_per_node=4 train.py parallel=fsdp parallel.tp=2 train.micro_batch_size=4  # FSDP dp=2 x tp=2
    python train.py -m parallel=ddp,zero1,zero2,fsdp launcher.nproc_per_node=4 train.micro_batch_size=4  # a sweep

Every setting lives in conf/ (Hydra) and is checked by config.py; `python train.py --help` lists the groups.
Bad settings stop the run with one line, `error: ...`, before any work and before anything is written.
"""
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import OmegaConf
from tqdm import tqdm

import checkpoint
import config
import hf
import launch
import parallel
from checkpoint import Diverged
from config import ConfigError
from data import prepare, shards
from model import GPT
from parallel import pp
from parallel.comm import CommCounter
from metrics import Meter, Metrics, mfu_peak, peak_memory_mb, profiler, router_record, start_record


def check_config(cfg, run_dir, world, say=print):
    """config.check's (layout, device, dtype, grad_accum), the checkpoint to resume from (or None), and parallel=auto's
    pick (or None), set in cfg before the checks."""
    hf.apply(cfg)  # train.init_from=hf:DIR: the model's shape from DIR/config.json, DIR's files checked
    resume = checkpoint.resume_from(cfg, run_dir)
    auto = choose_layout(cfg, world, run_dir, say) if cfg.parallel.auto else None
    checked = config.check(cfg, world)
    if resume and cfg.parallel.impl == "deepspeed":  # saving works (parallel/zero_deepspeed.py); loading is not wired
        raise ConfigError(f"parallel.impl=deepspeed can't resume {resume}: resume it with parallel.impl=scratch or "
                          f"torch (any layout loads it), or set train.resume=none")
    return (*checked, resume, auto)


def choose_layout(cfg, world, run_dir, say):
    """parallel=auto: the planner's pick for `world` ranks of this device (tools/plan.py choose: every layout,
    micro-batch, checkpointing mode and schedule priced, the fastest that fits), set in cfg. Rank 0 plans and prints
    the top 5; the others take its pick (launch.rank0_value): each planning alone could pick another layout where
    they see the machine differently (a CPU's measured profile)."""
    from tools import plan  # an instrument: it picks, this recipe trains the pick
    config.validate(cfg)
    config.run_rules(cfg)  # what no layout changes first: told as itself, before any device is measured
    device, dtype = config.device_and_dtype(cfg.train)
    rank = int(os.environ.get("RANK", 0))

    def pick():
        planned = cfg.copy()
        planned.train.dtype = dtype  # what this run computes in (auto: float32 on a CPU)
        try:
            return json.dumps(plan.choose(planned, plan.cluster(planned, world, device),
                                          log=say if rank == 0 else lambda *a: None))
        except ConfigError as e:  # the other ranks stop with the same line
            return json.dumps({"error": str(e)})
    got = json.loads(launch.rank0_value(f"parallel_auto/{run_dir}", pick))  # (one key per run: tools/jobs.py)
    if "error" in got:
        raise ConfigError(got["error"])
    plan.apply_choice(cfg, got["overrides"])
    return got


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
    # fused: one kernel for the whole step instead of a dozen per tensor (foreach, the default); on a GPU by default.
    # The strategies that shard the optimizer build theirs with this one's class and hyper-parameters, fused included
    fused = o.fused if o.fused is not None else params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused or None)


def train_step(par, x, y, accum, micro_batch_size, autocast, max_norm):
    """One optimizer step on this rank's slice (x, y) of the global batch, in `accum` micro-batches: forward,
    backward, the gradients' last sums, clipping, the step. Returns (the micro-batches' summed loss, the global
    gradient norm), both left on the device. tools/dry_run.py runs this very step."""
    loss_sum = torch.zeros((), device=par.device)
    if par.pipeline:  # the micro-batches stream through the stages by the schedule (parallel/pp.py)
        with autocast, par.loss_context():
            loss_sum = par.pipeline.step(x, y, accum, micro_batch_size)
    for micro in range(0 if par.pipeline else accum):  # (a pipeline has run them above)
        sl = slice(micro * micro_batch_size, (micro + 1) * micro_batch_size)
        # only the last micro-step's backward communicates; the others accumulate gradients locally
        with par.no_sync() if micro < accum - 1 else contextlib.nullcontext(), par.loss_context():
            with autocast:
                loss = par.model(x[sl], y[sl])
            # each micro-batch's mean loss weighs 1/accum: the summed gradient is that of the batch's mean
            (loss / accum).backward()
        loss_sum += loss.detach()
    par.sync_grads()  # what backward leaves unsummed: sequence parallel's norm gains, over tp
    grad_norm = par.clip_grad_norm(max_norm)
    par.optimizer.step()
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(par, val, t, autocast, rank, world):
    """Mean loss over eval_steps fixed val batches of eval_batch_size sequences (the same ones at every evaluation,
    in every layout: each data-parallel rank takes its slice of each, in micro-batches), averaged over ranks."""
    par.model.eval()
    dp, batch = par.dims["dp"], t.eval_batch_size or t.global_batch_size
    chunks = batch // (t.micro_batch_size * dp)  # equal micro-batches: the mean of their means is the batch's
    total = torch.zeros((), device=par.device)
    for i in range(t.eval_steps):
        xs, ys = shards.get_batch(val, "val", t.seed, i, batch, t.seq_len, par.dp_rank, dp)
        for x, y in zip(xs.to(par.device).split(t.micro_batch_size), ys.to(par.device).split(t.micro_batch_size)):
            with autocast, par.loss_context():  # a pipeline's last stage holds the loss, the others zero
                total += (par.pipeline.evaluate(x, y) if par.pipeline else par.model(x, y)).float()
    par.data.reshard()  # a forward without backward may leave sharded parameters gathered
    par.model.train()
    return par.global_loss(total, t.eval_steps * chunks)  # the mean over the ranks that hold a loss


def run(cfg, run_dir):
    # --- process group and mesh: torchrun sets RANK/WORLD_SIZE; plain `python train.py` is one process
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    layout, device, dtype, accum, resume, auto = check_config(cfg, run_dir, world)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":  # before the process group: NCCL binds each rank to its own GPU (SLURM may show each
        device = f"cuda:{local_rank % torch.cuda.device_count()}"  # task only its own: cuda:0)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 for what runs in float32 (its matmuls), as is usual
    print0 = print if rank == 0 else (lambda *a, **k: None)
    t, o = cfg.train, cfg.optim

    # --- data: one process per machine prepares the shards; the others wait for them on the file system, before any
    # collective (a long tokenization would pass NCCL's timeout in a barrier)
    data_dir = prepare.prepare(cfg.data, cfg.data.cache_dir, log=print0) if local_rank == 0 else \
        prepare.wait_for(cfg.data, cfg.data.cache_dir, log=print0)
    owns_group, mesh = launch.process_group(layout, device, run_dir, rank)
    if cfg.checkpoint.keep and launch.multi_node():  # every rank writes its shard into one checkpoint folder
        checkpoint.check_shared(cfg.train.out_dir, rank)
    train_tokens, val_tokens, enc, meta = prepare.load(data_dir)
    for split, toks in (("train", train_tokens), ("val", val_tokens)):
        if len(toks) <= t.seq_len:
            raise ConfigError(f"the {split} split has {len(toks)} tokens, too few for seq_len={t.seq_len}; "
                              f"add text or lower data.val_fraction / train.seq_len")

    # --- model: built on the meta device, then parallelized; every strategy materializes only what its rank holds
    mcfg = config.model_config(cfg, meta["vocab_size"])
    mem_before_model = peak_memory_mb(device)  # what the process holds before any model state exists
    with torch.device("meta"):
        model = GPT(mcfg)
    n_params, flops_per_token = model.num_params(), model.flops_per_token(t.seq_len)
    torch.manual_seed(t.seed)
    # tensor parallel -> activation checkpointing -> compile -> data parallel + optimizer (parallel/__init__.py)
    p = config.resolved(cfg.parallel, layout, dtype)  # param_dtype=auto made concrete: bf16 working weights
    par = parallel.parallelize(model, layout, p, mesh, lambda m: make_optimizer(m, o), device, t)
    par.module.set_aux_scale(1 / accum)  # MoE's balancing losses: each micro-batch's loss weighs 1 / accum
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" \
        else contextlib.nullcontext()
    peak, why = mfu_peak(t.peak_tflops, device)  # MFU only against a peak someone stated, or a datasheet's
    if why:
        print0(why)

    # --- resume: any strategy's checkpoint at any world size loads into this one (checkpoint.py)
    tokenizer_spec = prepare.tokenizer_spec(data_dir, meta)
    tokenizer_sha256 = checkpoint.sha256_json(tokenizer_spec)
    start, wandb_id = 0, None
    if resume:
        info = checkpoint.load(resume, par)
        if info["model"]["vocab_size"] != mcfg.vocab_size or info["tokenizer_sha256"] != tokenizer_sha256:
            raise checkpoint.CheckpointError(f"{resume} was trained with another tokenizer or vocab "
                                             f"({info['model']['vocab_size']} tokens) than data={cfg.data.source}'s")
        start, wandb_id = info["step"], info.get("wandb_id")
        written = info.get("layout", {}).get("parallel") or info.get("parallel_layout")  # (older checkpoints)
        print0(f"resumed from {resume}: step {start}, written by parallel={written} on {info['world_size']} rank(s)")
        if start >= t.max_steps:
            print0(f"step {start} is already train.max_steps={t.max_steps}: nothing to train "
                   f"(raise train.max_steps to go on)")
    elif hf.hf_dir(cfg):  # a fresh run from a Hugging Face model: each rank reads its own pieces of the files
        n_read = hf.load(hf.hf_dir(cfg), par, dataclasses.asdict(mcfg))
        print0(f"init_from: {hf.hf_dir(cfg)}: rank 0 read {n_read / 1e6:.2f}M of the model's {n_params / 1e6:.2f}M "
               f"values")
    if rank == 0:  # the run's first files, written once every check has passed (a resumed run keeps its config)
        os.makedirs(run_dir, exist_ok=True)
        conf = "config.yaml" if not os.path.exists(os.path.join(run_dir, "config.yaml")) or \
            checkpoint.same_config(cfg, run_dir) else f"config.step{start}.yaml"
        OmegaConf.save(cfg, os.path.join(run_dir, conf), resolve=True)

    metrics = Metrics(cfg, run_dir, rank, wandb_id)
    metrics.log({**start_record(start, cfg, par, n_params, flops_per_token, accum, dtype, mem_before_model),
                 **({"auto": auto} if auto else {})})  # parallel=auto: its candidates beside the pick's name
    print0(f"model: {n_params / 1e6:.2f}M parameters, vocab {mcfg.vocab_size} (padded {mcfg.padded_vocab_size}) | "
           f"data: {len(train_tokens):,} train / {len(val_tokens):,} val tokens | {device} {dtype} | "
           f"{world} rank(s) {layout.name} ({layout.describe()}), grad accumulation {accum} | run dir {run_dir}")
    if par.pipeline:
        print0(f"pipeline: {cfg.parallel.pp_schedule}, {accum} micro-batches per step | " +
               "; ".join(pp.describe(mcfg.n_layer, layout.pp, par.pipeline.v)))
    if resume:
        metrics.log({"step": start, "resumed_from": resume})
    ckpt, last_checkpoint = cfg.checkpoint, resume
    ckpt_info = {"world_size": world, "layout": layout.record(), "parallel": OmegaConf.to_container(p),
                 "model": dataclasses.asdict(mcfg), "tokenizer_sha256": tokenizer_sha256,
                 "wandb_id": metrics.id, "config": OmegaConf.to_container(cfg, resolve=True)}
    print0(f"checkpoints: every {ckpt.every} steps and at the last, in {os.path.join(run_dir, 'checkpoints')}"
           if ckpt.keep else "checkpoints: none (checkpoint.keep=0)")

    # --- the loop. `step` counts finished optimizer steps; evaluation runs at 0, every eval_every, and at the end.
    # A resumed run picks up at the step after its checkpoint's: batches and the learning rate are functions of the
    # step, so the steps are the very ones an uninterrupted run takes. Only log steps wait for the device (losses,
    # norms, the finiteness check, SIGTERM agreement, state accounting); the others queue work and go on.
    record = {"step": start}
    if start == 0:
        record["val_loss"] = evaluate(par, val_tokens, t, autocast, rank, world)
        metrics.log(record)
        print0(f"step 0: val loss {record['val_loss']:.4f}")
    bar = tqdm(range(start + 1, t.max_steps + 1), initial=start, total=t.max_steps, disable=rank != 0, desc="train",
               dynamic_ncols=True, file=sys.stdout,
               mininterval=0.1 if sys.stdout.isatty() else 30)  # a log file gets a line every 30 s, not thousands
    meter = Meter(par, t.global_batch_size * t.seq_len, flops_per_token, peak)
    preemption, stop = checkpoint.Preemption(), False
    first_bad = torch.tensor(t.max_steps + 1, device=device)  # the first step whose loss or grad norm was not finite
    max_norm = o.grad_clip if o.grad_clip > 0 else math.inf
    with CommCounter() as comm, profiler(t, run_dir, rank) as prof:  # every collective, ours or torch's
        for step in bar:
            comm.reset()
            lr = lr_at(step - 1, o, t.max_steps)
            for group in par.optimizer.param_groups:
                group["lr"] = lr
            # each dp group takes its slice of the global batch; the cp and tp ranks within it take the same one
            x, y = shards.get_batch(train_tokens, "train", t.seed, step - 1, t.global_batch_size, t.seq_len,
                                    par.dp_rank, par.dims["dp"])
            if device.startswith("cuda"):  # non_blocking copies are asynchronous only from pinned memory
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss_sum, grad_norm = train_step(par, x, y, accum, t.micro_batch_size, autocast, max_norm)
            router = par.router_stats()  # MoE: the step's tokens per expert (router=bias moves its biases by them)
            comm_bytes, comm_by_dim = comm.bytes, dict(comm.by_dim)
            log_step = step % t.log_every == 0 or step == t.max_steps
            state = par.state_bytes() if log_step else None  # after the step, before zero_grad: all resident
            par.optimizer.zero_grad(set_to_none=True)
            meter.stepped()
            finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm).to(device)
            first_bad = torch.where(finite | (first_bad < step), first_bad, step)
            if prof is not None:
                prof.step()

            record = {"step": step}
            stop = preemption.requested(log_step)
            save = ckpt.keep > 0 and (step == t.max_steps or stop or (ckpt.every > 0 and step % ckpt.every == 0))
            if log_step or save or step % t.eval_every == 0:
                checkpoint.check_finite(first_bad, step, last_checkpoint)
            if log_step:
                record.update(meter.record(loss_sum, grad_norm, accum, lr, comm_bytes, comm_by_dim, state))
                if router is not None:
                    record.update(router_record(router, accum * layout.reduce_ranks))
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tok_per_s']:,.0f}", refresh=False)
            if step % t.eval_every == 0 or step == t.max_steps:
                record["val_loss"] = evaluate(par, val_tokens, t, autocast, rank, world)
                bar.write(f"step {step}: val loss {record['val_loss']:.4f}") if rank == 0 else None
                meter.restart()  # evaluation time is not training throughput
            if len(record) > 1:
                metrics.log(record)
            if save:  # every rank writes its own shard; no rank gathers the model
                last_checkpoint = checkpoint.save(
                    os.path.join(run_dir, "checkpoints"), step, par, keep=ckpt.keep,
                    files={"state.json": {**ckpt_info, "step": step, "preempted": stop,
                                          "data": {"seed": t.seed, "next_batch": step, "global_batch_size":
                                                   t.global_batch_size, "seq_len": t.seq_len,
                                                   "tokens_seen": step * t.global_batch_size * t.seq_len}},
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
            out = par.generate(prompt, t.sample_tokens)
        print0("--- sample ---\n" + enc.decode(out[0].tolist()) + "\n--------------")
    metrics.close()
    if dist.is_initialized():
        # torch's DDP reducer holds the process group: free it while every peer is still connected (gloo's
        # destructor can otherwise wait forever on a peer that has already gone)
        del model, par
        gc.collect()
        dist.barrier()
        if owns_group:
            dist.destroy_process_group()
    return record


@hydra.main(config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"), config_name="config",
            version_base="1.3")
def main(cfg):
    """One job: this process's rank (torchrun, SLURM, or none), or the launcher of its own ranks
    (launcher.nproc_per_node; launch.py). In a sweep (-m) a failed job says why in one line, and the sweep
    goes on to the next job: Hydra records it as failed and exits non-zero at the end."""
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    sweep = hc.mode == RunMode.MULTIRUN
    # W&B: a sweep's jobs share a group, and a run is named by its overrides (logger.group/name override both)
    cfg.logger.group = cfg.logger.group or (hc.sweep.dir if sweep else None)
    cfg.logger.name = cfg.logger.name or hc.job.override_dirname or None
    try:
        if cfg.dry_run.world:  # one rank of a simulated world, in this process, under torch's fake process group
            from tools import dry_run  # an instrument that drives this recipe: handed off to, never imported by it
            dry_run.run(cfg, run_dir, under_torchrun="TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ)
            return
        problem = launch.check(cfg.launcher, cfg.train.device, under_torchrun="TORCHELASTIC_RUN_ID" in os.environ)
        if problem:
            raise ConfigError(problem)
        if cfg.launcher.nproc_per_node:
            # before starting ranks; on a copy: under parallel=auto the ranks pick (the same) again, and record it
            check_config(cfg.copy(), run_dir, cfg.launcher.nproc_per_node * cfg.launcher.nnodes,
                         say=lambda *a: None)
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
