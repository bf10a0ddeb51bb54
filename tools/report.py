"""Report on a sweep: a markdown table, one row per job, and plots, read back from each job's files.

    python train.py -m parallel=ddp,zero1,zero2,fsdp launcher.nproc_per_node=2 train.micro_batch_size=8 train.max_steps=30
    python -m tools.report outputs/multirun/2026-11-30/12-00-00

A job is a subfolder of the sweep (Hydra's job number); its config.yaml and metrics.jsonl are all the report reads,
so it works on any sweep, finished or not, however it was launched. Written into <sweep>/report/ (rewritten on a
rerun; nothing else is touched): report.md, and loss.png (training loss per step, validation loss dotted),
throughput.png (tokens/s), memory.png (model state per rank), comm.png (bytes communicated per optimizer step), the
last two beside what the planner (tools/plan.py) predicts. Jobs that did not finish are listed with how far they got.
"""
import argparse
import json
import os
import statistics
import sys

from omegaconf import OmegaConf

from tools import plan
from tools.bench import markdown

MiB = 2**20
# settings that say where things go, not what was run: never part of a job's label
NOT_LABELS = ("train.out_dir", "logger.", "data.cache_dir")


def load(sweep_dir):
    """[{dir, cfg (flat dict, None if the job never wrote one), records}], in job order."""
    names = [n for n in os.listdir(sweep_dir) if not n.startswith(".") and os.path.isdir(os.path.join(sweep_dir, n))
             and n != "report"]
    jobs = []
    for name in sorted(names, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        d = os.path.join(sweep_dir, name)
        cfg_path, metrics_path = os.path.join(d, "config.yaml"), os.path.join(d, "metrics.jsonl")
        cfg = flatten(OmegaConf.to_container(OmegaConf.load(cfg_path))) if os.path.exists(cfg_path) else None
        records = []
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        jobs.append({"name": name, "dir": d, "cfg": cfg, "records": records})
    return jobs


def flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def labels(jobs):
    """Each job's label: the settings whose values differ between the sweep's jobs (a strategy's own knobs only
    when every job has them), strategy first."""
    cfgs = [j["cfg"] for j in jobs if j["cfg"]]
    keys = [k for k in cfgs[0] if not k.startswith(NOT_LABELS) and all(k in c for c in cfgs)
            and len({json.dumps(c[k]) for c in cfgs}) > 1] if cfgs else []
    keys.sort(key=lambda k: (k != "parallel.data", k != "parallel.impl", k))
    out = []
    for j in jobs:
        if not j["cfg"]:
            out.append(f"job {j['name']}")
            continue
        parts = [str(j["cfg"][k]) if k in ("parallel.data", "parallel.impl") else f"{k}={j['cfg'][k]}" for k in keys]
        out.append(" ".join(parts) or j["cfg"]["parallel.data"])
    return out


def summarize(job, label):
    """The job's row: what it measured and how it compares with the theory (blank where there is none)."""
    recs = job["records"]
    steps = [r for r in recs if "loss" in r]
    row = {"job": job["name"], "label": label, "status": status(job), "world": "", "steps": len(steps) and
           steps[-1]["step"], "loss": "", "val_loss": "", "tok_per_s": "", "peak_MiB": "", "state_MiB_per_rank": "",
           "state_vs_theory": "", "comm_MiB_per_step": "", "comm_in_psi": "", "comm_vs_theory": ""}
    if not steps:
        return row
    start, last = recs[0], steps[-1]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    comm_theory, state_theory = theory(job)
    row.update(world=start["world_size"], loss=f"{last['loss']:.4f}", val_loss=f"{vals[-1]:.4f}" if vals else "",
               tok_per_s=round(tok_per_s(steps)), peak_MiB=f"{last['peak_mem_mb'] - start['mem_mb_before_model']:.0f}",
               state_MiB_per_rank=f"{last['state_bytes_max'] / MiB:.2f}",
               comm_MiB_per_step=f"{last['comm_bytes'] / MiB:.2f}",
               comm_in_psi=f"{last['comm_bytes'] / start['param_bytes']:.3f}")
    if state_theory:
        row["state_vs_theory"] = f"{last['state_bytes_max'] / state_theory:.3f}"
    if comm_theory:
        row["comm_vs_theory"] = f"{last['comm_bytes'] / comm_theory:.3f}"
    return row


def status(job):
    if not job["cfg"]:
        return "failed before training"
    steps = [r["step"] for r in job["records"] if "loss" in r]
    if steps and steps[-1] == job["cfg"]["train.max_steps"]:
        return "done"
    return f"stopped after step {steps[-1] if steps else 0} of {job['cfg']['train.max_steps']}"


def tok_per_s(steps):
    """Median over the logged windows, the first left out when there are others: it includes warm-up."""
    return statistics.median(r["tok_per_s"] for r in (steps[1:] or steps))


def theory(job):
    """(comm bytes per step, state bytes per rank) that the planner predicts for the job's own config."""
    predicted = plan.predict_run(job["dir"])
    return predicted["comm_total"], predicted["state"]


def plot(jobs, rows, out):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    done = [(j, r) for j, r in zip(jobs, rows) if r["world"] != ""]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, (j, r) in enumerate(done):
        color = f"C{k % 10}"
        steps = [x for x in j["records"] if "loss" in x]
        width = 1 + 2 * (len(done) - 1 - k) / max(1, len(done) - 1)  # first widest: equal curves stay visible
        ax.plot([x["step"] for x in steps], [x["loss"] for x in steps], color=color, lw=width, label=r["label"])
        vals = [x for x in j["records"] if "val_loss" in x]
        ax.plot([x["step"] for x in vals], [x["val_loss"] for x in vals], ":o", color=color, lw=width,
                markersize=2 + width)
    ax.set(xlabel="optimizer step", ylabel="loss", title="loss: training (lines), validation (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save(fig, out, "loss.png"))

    names = [r["label"] for _, r in done]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(done)))
    ax.barh(names, [r["tok_per_s"] for _, r in done], color=[f"C{k % 10}" for k in range(len(done))])
    for y, (_, r) in enumerate(done):
        ax.text(r["tok_per_s"], y, f" {r['tok_per_s']:,}", va="center", fontsize=8)
    ax.set(xlabel="tokens/s (median over logged windows)", title="throughput",
           xlim=(0, 1.15 * max(r["tok_per_s"] for _, r in done)))  # room for the numbers
    ax.invert_yaxis()
    paths.append(save(fig, out, "throughput.png"))

    for key, theory_index, fname, title in (
            ("state_bytes_max", 1, "memory.png", "model state per rank, MiB (largest rank)"),
            ("comm_bytes", 0, "comm.png", "communication per optimizer step, MiB (rank 0)")):
        measured = [[x for x in j["records"] if key in x][-1][key] / MiB for j, _ in done]
        predicted = [(theory(j)[theory_index] or 0) / MiB for j, _ in done]
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.6 * len(done)))
        ys = range(len(done))
        ax.barh([y - 0.2 for y in ys], measured, height=0.4, label="measured", color="C0")
        ax.barh([y + 0.2 for y in ys], predicted, height=0.4, label="theory (ZeRO paper)", color="C7")
        for y, m in zip(ys, measured):
            ax.text(m, y - 0.2, f" {m:.2f}", va="center", fontsize=8)
        ax.set_yticks(list(ys), names)
        ax.set(xlabel="MiB", title=title, xlim=(0, 1.15 * max(measured + predicted)))
        ax.invert_yaxis()
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
        paths.append(save(fig, out, fname))
    return paths


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # tight: the legends below the axes included
    fig.clf()
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", help="a Hydra multirun dir: outputs/multirun/<date>/<time>")
    a = ap.parse_args(argv)
    jobs = load(a.sweep_dir) if os.path.isdir(a.sweep_dir) else []
    if not jobs:
        sys.exit(f"error: {a.sweep_dir} holds no jobs (expected the numbered folders of a `python train.py -m` run)")
    rows = [summarize(j, label) for j, label in zip(jobs, labels(jobs))]
    out = os.path.join(a.sweep_dir, "report")
    os.makedirs(out, exist_ok=True)
    pngs = plot(jobs, rows, out) if any(r["world"] != "" for r in rows) else []
    note = ("tok_per_s: median of the logged windows after the first; peak_MiB: rank 0's peak memory above what it "
            "held before the model was built (CUDA allocated, or RSS on CPU); state: the largest rank's parameters, "
            "gradients and optimizer state; comm: rank 0's bytes per optimizer step, in Psi = parameter bytes; "
            "theory: the planner, tools/plan.py (the ZeRO paper's formulas; tensor parallel's activations).")
    text = f"# Sweep {a.sweep_dir}\n\n{markdown(rows)}\n\n{note}\n\n" + \
        "".join(f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in pngs)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(markdown(rows))
    print(f"\nwritten: {out}/report.md" + "".join(f", {os.path.basename(p)}" for p in pngs))
    return rows


if __name__ == "__main__":
    main()
