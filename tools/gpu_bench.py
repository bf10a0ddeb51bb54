"""Measure one CUDA GPU in one short, unattended run (about 9.5 minutes with the default --budget): its bf16 matmul
rate, then tokens/s, MFU, peak memory and the share of step time outside the model's kernels for gpt_125m and
gpt_350m training in six modes: parallel=single, a one-rank parallel=fsdp (ours) and a one-rank FSDP2
(parallel.impl=torch), each eager and torch.compile. One-rank FSDP has nothing to shard: its rows are what the
machinery costs by itself. Writes gpu_bench.md and gpu_bench.json into --out, after every job.

    python -m tools.gpu_bench --out results/                 # on a machine with one CUDA GPU and requirements.txt
    python -m tools.gpu_bench --device cpu --tiny --out /tmp/gb   # the same logic on a CPU, in under a minute
    python -m tools.gpu_bench --compile no --out results/eager    # half the rows (--compile yes: the other half)

On a GPU image that has torch, tiktoken and numpy and nothing else, and no network (the device machine):

    python -m tools.gpu_bench --bundle gpu_bundle            # here, online: build the bundle (5.4 MiB)
    python3 -m tools.gpu_bench --budget 540 --out $OUT       # there, in a copy of the checkout carrying gpu_bundle/

Design choices:
- Each row is a real `torchrun --nproc_per_node=1 train.py` job (tools/bench.py's run_one), bf16 autocast,
  sequences of 1024, the GPT-2 vocab, no gradient accumulation. Its tokens/s is the median of its timing windows
  after the first (warm-up, compilation and the profiler's export all fall in the first).
- MFU is the model's FLOPs per token (model.flops_per_token) x tokens/s, over the datasheet's dense bf16 peak
  (tools/plan.py GPUS) and over the 8192^3 matmul rate measured here first
  (the fastest of 5 rounds; 256^3, the fastest of 20, with --tiny).
- Peak memory is the CUDA caching allocator's: max allocated and max reserved, GB (on a CPU: peak RSS, no reserved).
- Overhead: every job runs with train.profile=true, a torch.profiler trace of steps 2-4 (metrics.py). Over
  those steps' wall time: `outside_kernels` is the share when no kernel ran on the GPU; `launch`, `sync` and
  `python` are shares of the host's time in kernel launch calls, in synchronize calls, and outside any torch op
  (the interpreter, hooks, the loop). They say where the host's time goes, not which of it the GPU waited for: a
  GPU that is the bottleneck fills the launch queue, and launches then block on it. On a CPU there are no kernels:
  the ops run on the host, so `outside_kernels` is the time outside any op, the same as `python`.
- Time: eager rows run first, since compilation is what may run out of time. Each job's timeout is its share of
  what is left of --budget, a compiled job weighing COMPILE_WEIGHT eager ones, but at least --compile-min seconds
  for a compiled job (a cold compile of the first model needs about that; the later ones hit Inductor's on-disk
  cache) while that much is left. An early finish leaves its time to the rest; a job that fails or overruns its
  share says so in its row, with where it was (starting, compiling, after N windows; an overrun keeps the timing
  windows it had logged), and a job left with under MIN_SHARE is not started. The rest still run.
- Data: offline. tinyshakespeare tokenized with GPT-2's BPE from `<shared>/tiktoken_cache` (--shared, else the
  bundle, else shared/ in the checkout, else ../shared beside it), before the jobs, into the data cache every job
  then reads (a bundle's own, already prepared: no `datasets` needed).
- The bundle (--bundle DIR, an ignored folder in the checkout, default gpu_bundle/, carried to the GPU machine):
  what train.py's path imports that a bare torch + tiktoken + numpy image lacks (BUNDLED: hydra-core, omegaconf,
  antlr4, PyYAML, packaging, tqdm; pure Python, fetched with pip at the versions installed here, or copied from
  this interpreter with --offline), the corpus, tiktoken's GPT-2 files and the tokenized cache. A run finds
  gpu_bundle/ in the checkout by itself (--use-bundle names another, or none) and puts its packages first on its
  own sys.path and its jobs' PYTHONPATH. W&B is never imported (logger.mode=disabled), nor `datasets` (the cache
  is read, not prepared): tests/test_gpu_bench.py runs this path with both, and every package outside torch's,
  tiktoken's and numpy's, hidden from the interpreter.
- --tiny: a 2-layer model, float32, fewer steps, eager rows only (compiling on a CPU takes minutes): the logic.
"""
import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# the standard library alone until the checks have passed (tools/bench.py imports the planner only to run a job):
# on a bare image a missing package must be one line, not a traceback from an import
from tools import bench

ROOT = bench.ROOT
# Micro-batch per model, sequences of 1024 (= the global batch: no accumulation). The planner (python -m tools.plan
# model=... plan.gpu=h200 train.seq_len=1024) gives 39 GB for gpt_125m at 64 and 44 GB for gpt_350m at 32, Adam
# state included; a count by hand that keeps eager's fp32 layer-norm outputs and fp32 logits (50304 x 4 bytes per
# token, again for their gradient) gives about 66 and 57 GB. Either way under half of the H200's 141 GB, room for
# FSDP's copies and the allocator's fragmentation; doubling passes the planner (75-85 GB) but not the count by
# hand (115-130 GB). The peak columns say whether the next run can double.
MODELS = {"gpt_125m": 64, "gpt_350m": 32}
# (parallel, impl, compile): eager first
MODES = [(p, i, c) for c in (False, True) for p, i in (("single", None), ("fsdp", "scratch"), ("fsdp", "torch"))]
# A compiled job's share of the budget, in eager jobs', and its floor. Measured on an H200 (2026-12-04, the first
# run, docs/benchmarks.md): an eager job took 36-51 s (start, CUDA and the model, the profiled window and its trace,
# 25 steps of 0.5-0.76 s, the loss's 4 MiB chunks then making eager host-bound), a compiled one 28-39 s, the cold
# compile (each model's first compiled job: every block compiles to the same graph, so the later modes hit
# Inductor's on-disk cache) included. On this repo's 2 CPU cores (2026-12-01, the --tiny model): eager 9.5 s,
# compiled 53 s cold, 10 s warm. On the GPU, then, a compiled job weighs about what an eager one does; the floor
# keeps a cold compile from a share no compile fits in (--budget 540: 45 s each).
COMPILE_WEIGHT = 1.0
MIN_COMPILE_SHARE = 45  # seconds, --compile-min: a compiled job's floor
MIN_SHARE = 10  # seconds: less than a job needs to start (torchrun, imports, the model, step 0's evaluation)
# 25 steps: the first window of 5 holds warm-up, compilation and the profiler (steps 2-4, written at 5); 4 after it
STEPS = ["train.seq_len=1024", "train.max_steps=25", "train.log_every=5"]
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32", "train.seq_len=32",
        "train.max_steps=6", "train.log_every=2", "train.dtype=float32"]
CORPUS, TIKTOKEN = os.path.join("data", "tinyshakespeare.txt"), "tiktoken_cache"
# what train.py's path imports beyond the standard library (W&B and datasets are not on it: see the docstring)
NEEDS = ("torch", "numpy", "tiktoken", "hydra", "omegaconf", "yaml", "tqdm")
# the distributions behind NEEDS that a bare torch + tiktoken + numpy image lacks, with all they need (hydra-core:
# omegaconf, antlr4, packaging; omegaconf: PyYAML): the bundle's packages, each pure Python (PyYAML's optional
# libyaml parser aside, which the bundle leaves out)
BUNDLED = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "PyYAML", "packaging", "tqdm")
BUNDLE = os.path.join(ROOT, "gpu_bundle")  # .gitignore'd; the default of --bundle and of a run's --use-bundle
MANIFEST = "bundle.json"  # what marks a folder as a bundle: its packages' versions, the cache's key, when
MAX_BUNDLE_MB = 60  # the device machine carries 64 MiB of ignored paths in all


def matmul_flops(device, dtype, n=8192, iters=50, rounds=5):
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs each), after a warm-up: the fastest of `rounds` rounds of
    iters/rounds back to back. The fastest, as a datasheet's peak is: one round slowed by a shared machine's other
    work (a CI run's matmul at n=256 once read 8x slow, and a job's MFU_vs_matmul came out at 113%) is left out."""
    import torch
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    per, best = max(1, iters // rounds), 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per):
            a @ b
        sync()
        best = max(best, 2 * n ** 3 * per / (time.perf_counter() - t0))
    del a, b
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the jobs are other processes: hand them this one's cached blocks
    return best


def find_shared(given, bundle=None):
    """The folder holding data/tinyshakespeare.txt and tiktoken_cache/, or None: `given`, else the bundle, else
    shared/ in the checkout, else ../shared beside it."""
    defaults = [bundle, os.path.join(ROOT, "shared"), os.path.join(os.path.dirname(ROOT), "shared")]
    for d in [given] if given else defaults:
        if d and os.path.isfile(os.path.join(d, CORPUS)) and os.path.isdir(os.path.join(d, TIKTOKEN)):
            return os.path.abspath(d)
    return None


def prepare_data(shared):
    """Tokenize the corpus, offline, in this process, once, into the data cache; the overrides that make every job
    read that cache. A bundle (`shared` holding MANIFEST) has its own cache, cache/ beside the corpus, prepared when
    it was built; any other shared folder's tokens go to data.cache_dir ($NANOPARALLEL_CACHE or
    ~/.cache/nanoparallel; once per machine). With the cache prepared, nothing here needs `datasets`."""
    from hydra import compose, initialize_config_dir

    from data import prepare
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(shared, TIKTOKEN)  # the jobs inherit it
    data = ["data=text", f"data.paths=[{os.path.join(shared, CORPUS)}]", "data.tokenizer=gpt2",
            "data.num_proc=1"]  # one process: 1 MB of text takes seconds
    if os.path.isfile(os.path.join(shared, MANIFEST)):
        data.append(f"data.cache_dir={os.path.join(shared, 'cache')}")
    with initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):  # composed as train.py's would be
        dcfg = compose("config", overrides=data).data
    out = prepare.cache_path(dcfg, dcfg.cache_dir)
    if not os.path.exists(os.path.join(out, "meta.json")) and importlib.util.find_spec("datasets") is None:
        sys.exit(f"error: {os.path.join(shared, CORPUS)} is not tokenized in {dcfg.cache_dir}, and preparing it "
                 f"needs `datasets`, missing here: build a bundle where it is installed (python -m tools.gpu_bench "
                 f"--bundle gpu_bundle) and carry it here")
    prepare.prepare(dcfg, dcfg.cache_dir, log=lambda *a: None)
    return data


def build_bundle(out, shared, offline):
    """Write the bundle into `out` (replacing an earlier one): BUNDLED's packages into site/, the corpus and
    tiktoken's files, the corpus tokenized into cache/, and MANIFEST. Built beside `out` and renamed into place, so
    a failed build leaves the old bundle, or none, never half of one."""
    from importlib import metadata
    t0 = time.time()
    versions = {name: metadata.version(name) for name in BUNDLED}  # what this checkout's tests run with
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        site = os.path.join(tmp, "site")
        os.makedirs(site)
        (copy_installed if offline else pip_install)(versions, site)
        keep_pure_python(site)
        shutil.copytree(os.path.join(shared, TIKTOKEN), os.path.join(tmp, TIKTOKEN))
        os.makedirs(os.path.join(tmp, "data"))
        shutil.copy(os.path.join(shared, CORPUS), os.path.join(tmp, CORPUS))
        check_bundle_alone(site)
        manifest = {"packages": versions, "from": "installed here" if offline else "pip (PyPI)",
                    "built": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0]}
        with open(os.path.join(tmp, MANIFEST), "w") as f:  # first: prepare_data tokenizes into a bundle's cache/
            json.dump(manifest, f, indent=1)
        prepare_data(tmp)
        mb = folder_bytes(tmp) / 2**20
        if mb > MAX_BUNDLE_MB:
            sys.exit(f"error: the bundle came to {mb:.1f} MiB, over {MAX_BUNDLE_MB}: the device carries 64 MiB")
        manifest.update(cache=os.listdir(os.path.join(tmp, "cache")), mib=round(mb, 1))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"bundle: {out}, {mb:.1f} MiB in {time.time() - t0:.0f}s: "
          + ", ".join(f"{n} {v}" for n, v in versions.items()) + f"; {CORPUS} as GPT-2 tokens ({manifest['cache'][0]})")
    return manifest


def pip_install(versions, site):
    """BUNDLED at this interpreter's versions from the package index, into `site`; no dependencies beyond those
    named (torch's and tiktoken's are on the image). antlr4 4.9.3 has no wheel: pip builds its sdist, pure Python."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--no-compile", "--target", site, *(f"{n}=={v}" for n, v in versions.items())]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        sys.exit(f"error: pip could not fetch {', '.join(versions)} ({last}); offline, --offline copies the ones "
                 f"installed here")


def copy_installed(versions, site):
    """BUNDLED as installed in this interpreter, file by file from each distribution's RECORD, into `site`: the
    same trees pip would write, without the network."""
    from importlib import metadata
    for name in versions:
        dist = metadata.distribution(name)
        for f in dist.files or []:
            if f.parts[0] == ".." or "__pycache__" in f.parts:  # console scripts outside site-packages; bytecode
                continue
            dst = os.path.join(site, *f.parts)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(dist.locate_file(f), dst)


def keep_pure_python(site):
    """Drop what works on one interpreter or machine alone: compiled extensions (PyYAML's libyaml parser, which
    yaml does without), bytecode, console scripts with this interpreter's path in them. The GPU image's Python is
    another version (3.12 there, the time of writing)."""
    shutil.rmtree(os.path.join(site, "bin"), ignore_errors=True)
    for d, dirs, files in os.walk(site, topdown=False):
        for f in files:
            if f.endswith((".so", ".pyd", ".dylib", ".pyc")):
                os.remove(os.path.join(d, f))
        if os.path.basename(d) == "__pycache__":
            os.rmdir(d)


def check_bundle_alone(site):
    """The bundle's packages import and compose train.py's config with the standard library alone (python -S: no
    site-packages), so nothing they need is missing from it; one line if not."""
    code = ("import hydra, omegaconf, yaml, tqdm; from hydra import compose, initialize_config_dir\n"
            f"assert all(m.__file__.startswith({site!r}) for m in (hydra, omegaconf, yaml, tqdm))\n"
            f"with initialize_config_dir({os.path.join(ROOT, 'conf')!r}, version_base='1.3'):\n"
            "    compose('config', overrides=['data=text', 'data.paths=[x.txt]'])\n")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": site})
    if p.returncode:
        sys.exit(f"error: the bundle's packages do not work alone: {(p.stderr.strip().splitlines() or ['?'])[-1]}")


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@contextlib.contextmanager
def bundle_on_path(bundle):
    """The bundle's packages first on this process's sys.path and on its jobs' PYTHONPATH (torchrun and the ranks
    inherit it), both as they were afterwards (tests call main in their own process)."""
    if not bundle:
        yield
        return
    site, saved = os.path.join(bundle, "site"), (list(sys.path), os.environ.get("PYTHONPATH"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *([saved[1]] if saved[1] else [])])
    try:
        yield
    finally:
        sys.path[:] = saved[0]
        if saved[1] is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved[1]


def union(intervals, lo, hi):
    """Length of the union of (start, end) intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def trace_shares(path):
    """From a torch.profiler Chrome trace: shares of the profiled steps' wall time (see the module's docstring)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]  # host
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    wall = hi - lo

    def spans(keep):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if keep(e)]

    def runtime(word):
        return lambda e: e.get("cat") in ("cuda_runtime", "cuda_driver") and word in e["name"]

    kernels = spans(lambda e: e.get("cat") == "kernel")
    host_ops = spans(lambda e: e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"))  # every thread's
    busy = kernels if kernels else host_ops  # a CPU: the ops are the device's work
    return {"outside_kernels": 1 - union(busy, lo, hi) / wall,
            "launch": union(spans(runtime("Launch")), lo, hi) / wall,
            "sync": union(spans(runtime("Synchronize")), lo, hi) / wall,
            "python": 1 - union(host_ops, lo, hi) / wall}


def cut_short(run_dir, compiled):
    """A job stopped at its share: run_one's (first record, median tokens/s, last record) from the timing windows it
    had logged after the first, or None if none; and where it was stopped, for its row."""
    records = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:  # the line it was writing when it was stopped
                pass
    windows = [r for r in records if "tok_per_s" in r]
    if len(windows) > 1:
        timed = windows[1:]
        return (records[0], statistics.median(r["tok_per_s"] for r in timed), timed[-1]), f"{len(timed)} windows"
    # where in train.py's order: its first record, step 0's evaluation, the first window (compilation of the
    # training step, warm-up, the profiler), then the timed windows
    if windows:
        where = "after its first window"
    elif any("val_loss" in r for r in records):
        where = "compiling the training step" if compiled else "in its first window"
    elif records:
        where = "compiling step 0's evaluation" if compiled else "in step 0's evaluation"
    else:
        where = "starting"
    return None, where


def failure(text):
    """The line that says why a job failed: train.py's one-line error or its rank's last exception, from before
    torchrun's own report of the failure (which ends in a banner of '='), else the first line there."""
    lines = text.strip().splitlines()
    lines = lines[1:] if lines and lines[0].endswith(" failed:") else lines  # run_one's header
    end = next((i for i, line in enumerate(lines) if "torch/distributed/elastic" in line or "ChildFailedError" in line),
               len(lines))
    lines = [line.strip() for line in lines[:end] if line.strip()] or [line.strip() for line in lines if line.strip()]
    said = [line for line in lines if re.match(r"(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)\b|error: )", line)]
    return (said[-1] if said else (lines or ["?"])[0])[:100]  # else a message's start (Hydra's: "Could not ...")


def measure(result, run_dir, peak, measured):
    """A row's numbers from run_one's (first record, median tokens/s, last record) and the job's trace (none if it
    was stopped before writing it)."""
    start, tok_s, last = result
    try:
        shares = trace_shares(os.path.join(run_dir, "trace.json"))
    except (OSError, ValueError):
        shares = dict.fromkeys(("outside_kernels", "launch", "sync", "python"))
    flops = start["flops_per_token"] * tok_s
    gb = lambda mb: None if mb is None else mb * 2**20 / 1e9  # noqa: E731
    return {"tok_per_s": tok_s, "mfu": flops / peak if peak else None, "mfu_vs_matmul": flops / measured,
            "step_ms": start["tokens_per_step"] / tok_s * 1e3, "peak_alloc_gb": gb(last["peak_mem_mb"]),
            "peak_reserved_gb": gb(last.get("peak_reserved_mb")), **shares}


def markdown(rows):
    """One table; a row without numbers shows why in its tok/s column."""
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    table = []
    for r in rows:
        base = {"model": r["model"], "micro": r["micro"], "parallel": r["parallel"], "compile": r["compile"]}
        if not r.get("tok_per_s"):
            table.append({**base, "tok_per_s": r["status"], **{k: "" for k in
                          ("MFU", "MFU_vs_matmul", "step_ms", "alloc_GB", "reserved_GB", "outside_kernels",
                           "launch", "sync", "python")}})
            continue
        table.append({**base, "tok_per_s": f"{r['tok_per_s']:,.0f}" + ("" if r["status"] == "ok" else
                      f" ({r['status']})"), "MFU": pct(r["mfu"]),
                      "MFU_vs_matmul": pct(r["mfu_vs_matmul"]), "step_ms": num(r["step_ms"], ".1f"),
                      "alloc_GB": num(r["peak_alloc_gb"], ".1f"), "reserved_GB": num(r["peak_reserved_gb"], ".1f"),
                      **{k: pct(r[k]) for k in ("outside_kernels", "launch", "sync", "python")}})
    return bench.markdown(table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="a new (or empty) folder for gpu_bench.md and gpu_bench.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model, eager only, float32: the logic, on a CPU")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--compile-min", type=float, default=MIN_COMPILE_SHARE,
                    help=f"a compiled job's least share, seconds, while time is left (default {MIN_COMPILE_SHARE})")
    ap.add_argument("--shared", help="the folder with data/tinyshakespeare.txt and tiktoken_cache/ "
                                     "(default: the bundle's, else shared/ in the checkout, else ../shared)")
    ap.add_argument("--bundle", metavar="DIR", nargs="?", const=BUNDLE,
                    help="build the bundle for a GPU image without network in DIR (default gpu_bundle/ in the "
                         "checkout), run nothing")
    ap.add_argument("--offline", action="store_true", help="with --bundle: copy the packages installed here, no pip")
    ap.add_argument("--use-bundle", metavar="DIR", help="a run's bundle: DIR, or none (default: gpu_bundle/ in the "
                                                        "checkout if it is there)")
    ap.add_argument("--compile", choices=("both", "no", "yes"), default="both",
                    help="which rows: eager and compiled (default), eager only, compiled only")
    ap.add_argument("overrides", nargs="*", help="train.py overrides for every job")
    a = ap.parse_args(argv)
    # every check before any work, and before any import beyond the standard library
    if a.bundle:
        return bundle_main(a)
    if a.offline:
        sys.exit("error: --offline goes with --bundle (it builds the bundle from the packages installed here)")
    if not a.out:
        sys.exit("error: --out DIR is required: the folder gpu_bench.md and gpu_bench.json go in")
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        sys.exit(f"error: --out {a.out} exists and is not an empty folder; name a new one")
    if a.budget <= 0:
        sys.exit(f"error: --budget {a.budget:g}: expected a positive number of seconds")
    if a.tiny and a.compile == "yes":
        sys.exit("error: --tiny runs eager rows only (compiling on a CPU takes minutes): --compile yes has none")
    if a.compile_min < 0:
        sys.exit(f"error: --compile-min {a.compile_min:g}: expected seconds, 0 or more")
    bundle = None if a.use_bundle == "none" else os.path.abspath(a.use_bundle or BUNDLE)
    if bundle and not os.path.isfile(os.path.join(bundle, MANIFEST)):
        if a.use_bundle:
            sys.exit(f"error: --use-bundle {a.use_bundle} is not a bundle (no {MANIFEST}); build one with "
                     f"`python -m tools.gpu_bench --bundle {a.use_bundle}`, or say --use-bundle none")
        bundle = None  # no gpu_bundle/ in the checkout: this interpreter's packages
    with bundle_on_path(bundle):
        return run(a, bundle)


def bundle_main(a):
    """--bundle DIR: its own checks, then the build."""
    out = os.path.abspath(a.bundle)
    if a.out or a.tiny or a.use_bundle or a.overrides:
        sys.exit("error: --bundle DIR builds the bundle and runs nothing: no --out, --tiny, --use-bundle or "
                 "overrides with it")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and \
            not os.path.isfile(os.path.join(out, MANIFEST)):
        sys.exit(f"error: --bundle {a.bundle} exists and is neither empty nor a bundle; name a new folder")
    if os.path.commonpath([out, ROOT]) != ROOT:
        print(f"note: {a.bundle} is outside the checkout: only paths inside it are carried to the device machine")
    missing = [m for m in (*BUNDLED, "datasets") if not has_distribution(m)]
    if missing:
        sys.exit(f"error: building the bundle needs {', '.join(missing)} installed here (requirements.txt)")
    shared = find_shared(a.shared)
    if not shared:
        sys.exit(f"error: no {CORPUS} and {TIKTOKEN}/ in {a.shared or 'shared/ or ../shared'}; name them with --shared")
    return build_bundle(out, shared, a.offline)


def has_distribution(name):
    from importlib import metadata
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def run(a, bundle):
    """The benchmark, its checks done but for those that need the bundle on the path."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # a GPU image may carry torch and little else
        sys.exit(f"error: train.py's packages are missing here: {', '.join(missing)} (requirements.txt)")
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device; `--device cpu --tiny --out DIR` checks the logic on a CPU")
    shared = find_shared(a.shared, bundle)
    if not shared:
        sys.exit(f"error: no {CORPUS} and {TIKTOKEN}/ in {a.shared or 'shared/ or ../shared'}; on a machine "
                 f"without ../shared, build a bundle (--bundle) or copy them into a folder that travels and name it "
                 f"with --shared")
    t_start = time.time()
    deadline = t_start + a.budget
    data = prepare_data(shared)  # before anything is written: a cache missing where `datasets` is is one line
    from metrics import peak_flops
    os.makedirs(a.out, exist_ok=True)
    device = "cuda:0" if a.device == "cuda" else "cpu"
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    if a.tiny:
        dtype, models, modes, train = torch.float32, {"gpt_tiny": 4}, [m for m in MODES if not m[2]], TINY
        n, iters, rounds = 256, 200, 20
    else:
        dtype, models, train = torch.bfloat16, MODELS, STEPS
        modes = [m for m in MODES if a.compile == "both" or m[2] == (a.compile == "yes")]
        n, iters, rounds = 8192, 50, 5
    measured = matmul_flops(device, dtype, n, iters, rounds)
    peak = peak_flops(name)  # None on a CPU or an unlisted GPU
    print(f"{name}: {str(dtype)[6:]} matmul {measured / 1e12:.1f} TFLOP/s measured"
          + (f", {peak / 1e12:.0f} datasheet" if peak else ""), flush=True)
    print(f"data: {shared}/{CORPUS}, GPT-2 tokens" + (f"; packages from {bundle}" if bundle else "")
          + f" ({time.time() - t_start:.0f}s so far)", flush=True)

    rows, jobs = [], [(m, micro, *mode) for mode in modes for m, micro in models.items()]
    weights = [COMPILE_WEIGHT if c else 1 for *_, c in jobs]
    with tempfile.TemporaryDirectory() as tmp:
        for k, (model, micro, strategy, impl, compiled) in enumerate(jobs):
            left = deadline - time.time()
            share = left * weights[k] / sum(weights[k:])  # an early finish leaves time to the rest
            if compiled:  # a cold compile needs its time whatever the split; the later jobs then get less
                share = min(max(share, a.compile_min), left)
            run_dir = os.path.join(tmp, f"{k}")
            overrides = [f"model={model}", f"train.device={a.device}", *data, *train,
                         f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                         "train.profile=true", *a.overrides, f"train.compile={str(compiled).lower()}"]
            t0 = time.time()
            try:
                if share < MIN_SHARE:
                    raise TimeoutError
                numbers, status = measure(bench.run_one(strategy, impl, 1, overrides, run_dir, timeout=share),
                                          run_dir, peak, measured), "ok"
            except (TimeoutError, subprocess.TimeoutExpired) as e:
                cut, where = cut_short(run_dir, compiled) if isinstance(e, subprocess.TimeoutExpired) else \
                    (None, "not started")
                # what it measured before its time ran out still counts
                numbers = measure(cut, run_dir, peak, measured) if cut else {}
                status = f"out of time ({max(share, 0):.0f}s share), {where}"
            except (SystemExit, OSError, ValueError, KeyError, statistics.StatisticsError) as e:
                numbers, status = {}, "failed: " + failure(str(e))
            rows.append({"model": model, "micro": micro, "parallel": {"single": "single", "scratch": "fsdp (ours)",
                         "torch": "FSDP2"}[impl or "single"] + ("" if strategy == "single" else ", 1 rank"),
                         "compile": "yes" if compiled else "no", "status": status,
                         "seconds": round(time.time() - t0, 1), "share_s": round(max(share, 0), 1), **numbers})
            print(f"  {model} {rows[-1]['parallel']} compile={compiled}: {status}"
                  + (f", {numbers['tok_per_s']:,.0f} tok/s" if numbers else "") + f" ({time.time() - t0:.0f}s)",
                  flush=True)
            write(a.out, rows, name, dtype, (n, measured), peak, train + a.overrides, a.budget)  # kept if we are killed
    text = write(a.out, rows, name, dtype, (n, measured), peak, train + a.overrides, a.budget)
    print("\n" + text + f"\nwritten: {a.out}/gpu_bench.md, gpu_bench.json")
    return rows


def write(out, rows, name, dtype, matmul, peak, overrides, budget):
    import torch
    n, measured = matmul  # the matmul's size and its FLOP/s
    head = (f"{time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}: {str(dtype)[6:]} matmul {n}^3 "
            f"{measured / 1e12:.1f} TFLOP/s measured" + (f", {peak / 1e12:.0f} datasheet" if peak else "") +
            f". Jobs: one rank, seq x micro tokens per step, overrides {' '.join(overrides)}; --budget {budget:g}s. "
            f"outside_kernels, launch, sync, python: shares of steps 2-4's wall time (tools/gpu_bench.py).")
    text = head + "\n\n" + markdown(rows) + "\n"
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "dtype": str(dtype)[6:], "matmul_n": n, "matmul_flops": measured, "datasheet_flops": peak,
                   "overrides": overrides, "budget_s": budget, "rows": rows}, f, indent=1)
    return text


if __name__ == "__main__":
    main()
