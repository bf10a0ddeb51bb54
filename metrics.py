"""What a run writes about itself: metrics.jsonl (one JSON object per line) and W&B, on rank 0; peak memory; a
profiler trace."""
import contextlib
import json
import os
import resource

import torch
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
