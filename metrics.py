"""What a run writes about itself: metrics.jsonl (one JSON object per line) and W&B, on rank 0; peak memory; a
profiler trace."""
import contextlib
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf


# Dense bf16 peak FLOP/s by the exact name torch.cuda.get_device_name() gives, from NVIDIA's datasheets. Exact: the
# PCIe and NVL cards share a family name with the SXM ones and peak lower (a substring match gave an H100 PCIe the
# SXM5's 989 TFLOP/s). Any other GPU: train.peak_tflops.
DEVICE_PEAKS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
                "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
                "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
                "NVIDIA A100 80GB PCIe": 312e12}


def peak_flops(device_name):
    """The datasheet's dense bf16 peak of a GPU named as torch.cuda.get_device_name() names it, or None."""
    return DEVICE_PEAKS.get(device_name)


class Metrics:
    """On rank 0, every record goes to metrics.jsonl and W&B; on other ranks every call does nothing."""

    def __init__(self, cfg, run_dir, rank, wandb_id=None):
        self.on, self.id, self.wandb = rank == 0, None, None
        if not self.on:
            return
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # a resumed run adds to the same file
        lg = cfg.logger
        if lg.mode == "disabled":  # no W&B at all: it need not even be installed (a bare GPU image)
            return
        import wandb
        self.wandb = wandb.init(project=lg.project, group=lg.group, name=lg.name, mode=lg.mode, dir=run_dir,
                                config=OmegaConf.to_container(cfg, resolve=True),
                                settings=wandb.Settings(console="off", quiet=True),
                                id=wandb_id, resume="allow" if wandb_id else None)  # a resumed run: the same W&B run
        self.id = None if lg.mode == "disabled" else self.wandb.id

    def log(self, record):
        if self.on:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        if self.on:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def mfu_peak(peak_tflops, device):
    """(the peak FLOP/s MFU is measured against, or None; why MFU is left out, or None): train.peak_tflops, or the
    datasheet's for a GPU we know by name. A CPU has no MFU unless someone states its peak."""
    gpu = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else None
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(gpu) if gpu else None
    why = f"mfu: left out: no datasheet peak for {gpu!r} in metrics.py DEVICE_PEAKS; set train.peak_tflops" \
        if gpu and not peak else None
    return peak, why


def start_record(step, cfg, par, n_params, flops_per_token, accum, dtype, mem_before_model):
    """The run's first record: the model, the layout (parallel/layout.py's record: degrees, data strategy, impl,
    name), what the strategies resolved (working dtype, fused optimizer) and the memory held before any model
    state."""
    t = cfg.train
    return {"step": step, "n_params": n_params,
            "param_bytes": n_params * torch.empty((), dtype=getattr(torch, cfg.parallel.reduce_dtype)).itemsize,
            "world_size": par.layout.world, **par.layout.record(), "flops_per_token": flops_per_token,
            "tokens_per_step": t.global_batch_size * t.seq_len, "grad_accum": accum, "device": par.device,
            "dtype": dtype, "param_dtype": par.param_dtype,
            "fused": bool(par.data.local_optimizer.param_groups[0].get("fused")), "compile": t.compile,
            "mem_mb_before_model": mem_before_model}


class Meter:
    """Throughput between log steps, and each log step's record from what the step left on the device: the loss
    averaged over the global batch, the gradient norm, tokens/s, peak memory, and the step's communication and
    model state (rank 0's, and the largest over ranks: ZeroRedundancyOptimizer shards unevenly)."""

    def __init__(self, par, tokens_per_step, flops_per_token, peak):
        self.par, self.tokens_per_step, self.flops_per_token, self.peak = par, tokens_per_step, flops_per_token, peak
        self.restart()

    def restart(self):
        """Time from now (after evaluation: its time is not training throughput)."""
        self.t0, self.tokens = time.time(), 0

    def stepped(self):
        self.tokens += self.tokens_per_step

    def record(self, loss_sum, grad_norm, accum, lr, comm_bytes, comm_by_dim, state):
        par, device = self.par, self.par.device
        loss = par.global_loss(loss_sum, accum)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.time() - self.t0
        tok_s = self.tokens / dt
        worst = torch.tensor([comm_bytes, state], dtype=torch.float64, device=device)
        if par.layout.world > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        r = {"loss": loss, "lr": lr, "grad_norm": grad_norm.item(), "tok_per_s": tok_s,
             "step_time_s": dt * self.tokens_per_step / self.tokens, "peak_mem_mb": peak_memory_mb(device),
             "comm_bytes": comm_bytes, "state_bytes": state, "comm_bytes_max": int(worst[0]),
             "state_bytes_max": int(worst[1]),
             **{f"comm_{dim}_{kind}": n for (dim, kind), n in sorted(comm_by_dim.items())}}
        if device.startswith("cuda"):
            r["peak_reserved_mb"] = peak_reserved_mb(device)
        if par.pipeline:  # what one pipeline's stages send each other per step (each p2p byte counts at both ends)
            sent = torch.tensor(comm_by_dim.get(("pp", "p2p"), 0) / 2, device=device)
            dist.all_reduce(sent, group=par.mesh.get_group("pp"))
            r["p2p_bytes_pipeline"] = int(sent.item())
        if par.ep.size > 1:  # every rank's all-to-all bytes summed, the quantity parallel/ep.py's theory gives
            moved = torch.tensor(float(comm_by_dim.get(("ep", "all_to_all"), 0)), dtype=torch.float64, device=device)
            dist.all_reduce(moved)
            r["a2a_bytes_all_ranks"] = int(moved.item())
        if par.data.transient_bytes is not None:  # our FSDP: most bytes of gathered units held at once, ...
            r["transient_bytes"] = par.data.transient_bytes
        if self.peak:
            r["mfu"] = self.flops_per_token * tok_s / (self.peak * par.layout.world)
        self.restart()
        return r


def router_record(stats, micro_batches):
    """What a step's router statistics (Parallelized.router_stats: per MoE block, tokens per expert, then dropped
    assignments and summed balancing losses, over the whole batch) put in metrics.jsonl: `micro_batches` the
    batch's micro-batch forwards summed over the data-parallel ranks (accumulation x dp x cp)."""
    rows = stats.tolist()
    load = [[int(c) for c in r[:-2]] for r in rows]
    worst = max(max(r) / (sum(r) / len(r)) if sum(r) else 1.0 for r in load)
    return {"moe_tokens_per_expert": load, "moe_load_max_over_mean": worst,
            "moe_dropped": int(sum(r[-2] for r in rows)),
            "moe_aux_loss": sum(r[-1] for r in rows) / (len(rows) * micro_batches)}


def peak_memory_mb(device):
    """The most memory this process has held: allocated on the GPU (cuda:N), or the process's peak RSS on a CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def peak_reserved_mb(device):
    return torch.cuda.max_memory_reserved(device) / 2**20 if str(device).startswith("cuda") else None


def profiler(t, run_dir, rank):
    """train.profile=true: torch.profiler over steps 2-4 (after one to settle and one to warm up), its trace written
    to <run dir>/trace.json (rank k > 0: trace_rank<k>.json), for Perfetto or chrome://tracing."""
    if not t.profile:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule
    path = os.path.join(run_dir, "trace.json" if rank == 0 else f"trace_rank{rank}.json")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path))
