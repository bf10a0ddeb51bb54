"""Dry runs at cluster scale: this one process plays rank r of a world of any size, through torch's fake process
group, with the real mesh, the real `parallelize`, the real strategies and optimizer and train.py's own step; what it
measures stands beside the planner's prediction for the same config.

    python train.py model=gpt_1p3b parallel=fsdp dry_run.world=512 dry_run.rank=0
    python train.py model=gpt_70b parallel=fsdp_tp parallel.tp=8 dry_run.world=512 train.seq_len=2048
    python -m tools.dry_run --table                 # the README's table: gpt_70b at 512 ranks, every strategy
    python -m tools.dry_run --table --only=hsdp,fsdp_cp   # the rows of those layouts alone

How. `init_process_group("fake")` (torch.testing's FakeStore): every collective returns at once and moves nothing,
so this process behaves as rank r of `dry_run.world` ranks; parallel/comm.py counts each collective as a real run
does (bytes by mesh dimension and kind). Batches are random token ids; the data never moves, so the losses mean
nothing and none is reported. Two ways to compute (`dry_run.compute`):
  real   real tensors: the rank's shards, gathered units and activations exist in this process's memory; for layouts
         whose one-rank memory (the planner's state + transient + activations) fits `dry_run.memory_gb`
  fake   torch's FakeTensorMode: every tensor is shapes, dtypes and sizes without memory, every op only propagates
         them, so a 70B model at world 512 steps in seconds; the counted bytes and the strategies' own accounting
         (state_bytes, FSDP's and ZeRO's transient) read sizes, so they are exact; nothing is timed
  auto   (default) real where it fits and its FLOPs per step are few (REAL_FLOPS), else fake
Measured either way: model-state bytes on the rank (`Parallelized.state_bytes`, padding included), the strategy's
transient (the most held at once beyond the state: FSDP's gathered units; ZeRO-2's local gradients), the bytes
autograd saves for backward in one micro-batch's forward (activations), and every collective's bytes per mesh
dimension. Each is printed beside tools/plan.py's prediction, with the ratio; metrics.jsonl gets the usual
`state_bytes`, `comm_bytes`, `param_bytes`, `world_size` and `comm_<dim>_<kind>` keys, plus `dry_run: true`.

What runs under the fake backend (checked by tests/test_dry_run.py):
- ours: ddp, zero1, zero2, fsdp, hsdp, tp, fsdp_tp (and ZeRO beside tp), and context parallel beside them (the
  ring's send/recv and the all-gather's collectives return at once as the others do), real or fake tensors;
- torch's: FSDP2 (fsdp, zero2), DTensor tensor parallel (tp with composable replicate over dp, fsdp_tp), real or
  fake tensors (DeviceMesh computes a rank's coordinates with tensor ops, which fake tensors can't answer: the meshes
  those twins build are made outside FakeTensorMode, `_real_meshes`);
- not torch's DistributedDataParallel (ddp, and zero1's DDP + ZeroRedundancyOptimizer): the all-reduce hook the
  counter sees it through reads each collective's result from its future, which the fake group's future doesn't
  hold (and on fake tensors its C++ reducer would verify and bucket the parameters' memory, which they don't have).
  Asked for, it is one line saying so.
- pipeline parallel (ours, beside our DDP or FSDP over dp): the fake group's send and receive return at once, as
  its collectives do, so a stage steps through its schedule on empty activations; the planner's numbers are those
  of the pp rank played (dry_run.rank // (world / pp)). torch.distributed.pipelining runs without a data strategy
  here (Layout.problem), so its row is one line saying so.
- not torch's context_parallel: it is GPU-only (Layout.problem), here as in a real run.
- all five degrees at once (pp x dp_replicate x dp_shard x cp x tp, ours; tests/test_mesh.py at world 32), each
  term beside the planner's for that pipeline stage.
- a mixture of experts with expert parallelism (ours, beside DDP): on fake tensors with balanced routing
  (balanced_routing: fake tensors hold no token counts), so the all-to-all is the planner's mean over ranks.
"""
import contextlib
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import config
import parallel
import train
from config import ConfigError
from data import prepare
from model import GPT
from parallel.comm import CommCounter
from parallel.strategy import dp_mesh
from tools import plan

GB = 1e9
# dry_run.compute=auto computes for real up to this many FLOPs per step on the rank (about 10 s of one CPU core
# here); above it, fake tensors: the bytes are the same, and a real step of gpt_1p3b's FSDP unit took 77 s
REAL_FLOPS = 1e11


def machine_memory_gb():
    """This machine's memory, GB (Linux /proc/meminfo; elsewhere: unknown, None)."""
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024 / GB
    except (OSError, StopIteration):
        return None


def fake_group_problem(layout):
    """Why this layout can't run under the fake process group though a real run could, or None: the dry run's own
    rule, after the rule book's (config.check)."""
    if layout.impl == "torch" and layout.data in ("ddp", "zero1") and layout.tp == 1:
        return (f"parallel.data={layout.data} parallel.impl=torch: torch's DistributedDataParallel does not run under "
                f"the fake process group (its all-reduce hook reads the collective's result, which a fake group's "
                f"future doesn't hold; on fake tensors its C++ reducer needs the parameters' memory too); use "
                f"parallel.impl=scratch")
    return None


def check(cfg, under_torchrun=False):
    """Everything a dry run can know wrong before it starts; returns (the Layout, device, dtype, grad_accum, compute,
    the planner's prediction). Raises ConfigError with one line."""
    config.validate(cfg)
    d = cfg.dry_run
    problem = config.check_dry_run(d, cfg.launcher, under_torchrun)
    if problem:
        raise ConfigError(problem)
    try:  # the training config's own rules, for this world: degrees that divide it, heads, batch, ...
        layout, device, dtype, accum = config.check(cfg, d.world, computes=d.compute != "fake")
    except ConfigError as e:
        raise ConfigError(f"dry_run.world={d.world}: {e}") from None
    problem = fake_group_problem(layout)
    if problem:
        raise ConfigError(problem)
    predicted = predict(cfg, layout, dtype)
    need = predicted["total_memory"] / GB
    total = machine_memory_gb()
    if total is not None and d.memory_gb > total:
        raise ConfigError(f"dry_run.memory_gb={d.memory_gb:g} is more than this machine's {total:.0f} GB")
    t = cfg.train  # the rank's compute per step: tp splits it, dp does not
    flops = plan.model_shape(cfg)["flops_per_token"] * t.micro_batch_size * accum * t.seq_len / layout.tp
    fits = need <= d.memory_gb and flops <= REAL_FLOPS
    compute = d.compute if d.compute != "auto" else "real" if fits else "fake"
    if compute == "real" and need > d.memory_gb:
        raise ConfigError(f"dry_run.compute=real: rank {d.rank}'s state, transient and activations need "
                          f"{need:.1f} GB (tools/plan.py), over dry_run.memory_gb={d.memory_gb:g}; use "
                          f"dry_run.compute=fake (or auto), a larger dry_run.world, or a smaller model or micro-batch")
    return layout, device, dtype, accum, compute, predicted


def predict(cfg, layout, dtype):
    """tools/plan.py's numbers for this config's layout, with the activations' dtype the run resolved."""
    cfg = cfg.copy()
    cfg.train.dtype = dtype  # auto means bf16 to the planner (a GPU); on a CPU train.py computes in float32
    predicted = plan.predict(cfg, layout)
    if layout.pp > 1:  # the numbers of the pp rank this process plays (pp outermost: a stage's ranks are neighbours)
        predicted = {**predicted, **predicted["pp_ranks"][cfg.dry_run.rank // layout.stage_world]}
    return predicted


@contextlib.contextmanager
def fake_process_group(rank, world):
    """This process as `rank` of `world` under torch's fake backend; destroyed on the way out, so one process can
    hold several dry runs one after the other."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _real_meshes():
    """DeviceMesh finds this rank's coordinates with tensor ops and reads them back (`nonzero`, `tolist`), which a
    fake tensor can't answer; torch's FSDP2 and DTensor build sub-meshes as they go. Build every mesh on real
    tensors (they are small index tables), whatever mode is active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from parallel import cp
    init, data_mesh = DeviceMesh.__init__, cp.data_mesh

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_data_mesh(mesh):  # context parallel's data mesh: its groups are enumerated from the mesh's ranks
        with unset_fake_temporarily():
            return data_mesh(mesh)
    DeviceMesh.__init__, cp.data_mesh = real_init, real_data_mesh
    try:
        yield
    finally:
        DeviceMesh.__init__, cp.data_mesh = init, data_mesh


@contextlib.contextmanager
def compute_mode(compute):
    """Real tensors, or FakeTensorMode for every tensor made inside (and the meshes real, above), with balanced
    routing for a mixture of experts."""
    if compute == "real":
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    import model
    with warnings.catch_warnings(), _real_meshes(), balanced_routing(), FakeTensorMode(allow_non_fake_inputs=True):
        # the strategies compare .grad's data_ptr with their buckets'; a fake tensor's is 0, and torch warns
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # fake tensors stand for a GPU's, whose loss goes in model.GPU_CHUNK_BYTES chunks: on the CPU's 4 MiB a
        # fake step of deepseek_v3 (4,096 tokens x 129,280 logits) ran 505 chunks each way, a quarter of its time
        cpu_chunk, model.CPU_CHUNK_BYTES = model.CPU_CHUNK_BYTES, model.GPU_CHUNK_BYTES
        try:
            yield
        finally:
            model.CPU_CHUNK_BYTES = cpu_chunk


@contextlib.contextmanager
def balanced_routing():
    """A mixture of experts on fake tensors: its token counts are data, which fake tensors don't hold, and the host
    needs them (the all-to-all's split sizes; the grouped matmul's shape check on a CPU, which takes only bf16 there).
    So the dry run routes as the planner assumes: every rank sends 1/ep of its rows to each peer and receives as
    many (parallel/ep.py splits), and an expert group's rows go through one matmul of the same shape (model.py
    grouped_mm): the same sizes, the same bytes counted."""
    import model
    from parallel import ep

    def even(send_counts, recv_counts, rows):
        n = send_counts.size(0)
        each = [rows // n + (i < rows % n) for i in range(n)]
        return each, list(each)

    saved = model.grouped_mm, ep.splits
    model.grouped_mm = lambda x, w, counts: x @ w[0].to(x.dtype)
    ep.splits = even
    try:
        yield
    finally:
        model.grouped_mm, ep.splits = saved


class SavedBytes:
    """The bytes autograd saves for backward during the first forward of the module after `arm()`: distinct storages,
    parameters, buffers and views of them left out (they are model state, or FSDP's gathered units; the RoPE tables,
    a buffer, are saved by every block's rotation and would count once as the whole table)."""

    def __init__(self, module):
        self.armed, self.bytes, self.ctx, self.module = False, None, None, module
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def arm(self):
        self.armed, self.bytes = True, None

    def _enter(self, module, args):
        if self.armed:
            self.kept = {}
            self.buffers = {b.untyped_storage()._cdata for b in self.module.buffers()}
            self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.ctx.__enter__()

    def _exit(self, module, args, out):
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx, self.armed, self.bytes = None, False, sum(self.kept.values())

    def _pack(self, t):
        from torch.distributed.tensor import DTensor
        if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if st._cdata not in self.buffers:
                self.kept[st._cdata] = st.nbytes()
        return t


def measure(cfg, layout, rank, compute, device, dtype, accum, steps, on_step=None):
    """One dry run in this process: rank `rank` of the layout's world under the fake backend, `steps` optimizer steps
    of train.py's own step. Returns what the last step measured. `on_step(step, measured)` sees every step."""
    t, world = cfg.train, layout.world
    mcfg = config.model_config(cfg, prepare.vocab_size(cfg.data))
    with fake_process_group(rank, world):
        start = time.time()
        mesh = layout.build_mesh(device.split(":")[0])
        with compute_mode(compute):
            with torch.device("meta"):
                model = GPT(mcfg)
            n_params = model.num_params()
            torch.manual_seed(t.seed)
            p = config.resolved(cfg.parallel, layout, dtype)  # param_dtype=auto made concrete, as train.py does
            par = parallel.parallelize(model, layout, p, mesh, lambda m: train.make_optimizer(m, cfg.optim), device,
                                       t)
            saved = SavedBytes(par.module)
            info = {"n_params": n_params, "world_size": world, "rank": rank, "dims": dict(par.dims),
                    "param_bytes": n_params * config.DTYPES[cfg.parallel.reduce_dtype].itemsize,
                    "compute": compute, "build_s": time.time() - start, "layout": layout.name}
            autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" \
                else contextlib.nullcontext()
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            # random token ids, the same on every rank of a tp group as in a real run; their values don't matter
            gen = torch.Generator().manual_seed(t.seed + dp_mesh(mesh).get_local_rank())
            tokens = t.micro_batch_size * accum
            with CommCounter() as comm:
                for step in range(1, steps + 1):
                    x = torch.randint(0, mcfg.vocab_size, (tokens, t.seq_len), generator=gen).to(device)
                    y = torch.randint(0, mcfg.vocab_size, (tokens, t.seq_len), generator=gen).to(device)
                    comm.reset()
                    saved.arm()
                    step_start = time.time()
                    train.train_step(par, x, y, accum, t.micro_batch_size, autocast, max_norm)
                    par.router_stats()  # as train.py's loop: an MoE's statistics summed over the dp x cp ranks
                    out = {**info, "step": step, "state_bytes": par.state_bytes(), "comm_bytes": comm.bytes,
                           "transient_bytes": par.data.transient_bytes, "activation_bytes": saved.bytes,
                           "comm": dict(comm.by_dim), "step_s": time.time() - step_start}
                    par.optimizer.zero_grad(set_to_none=True)
                    if on_step:
                        on_step(step, out)
    return out


def compare(measured, predicted):
    """[(what, measured bytes, predicted bytes)] for the state, the transient, state + transient (the peak of model
    state), the activations and every collective by (mesh dimension, kind), the planner's and the counter's."""
    m, p = measured, predicted
    rows = [("state", m["state_bytes"], p["state"])]
    if m["transient_bytes"] is not None:  # measured by our FSDP and ZeRO only (None: the strategy doesn't say)
        rows += [("transient", m["transient_bytes"], p["memory"]["transient"]),
                 ("peak model state", m["state_bytes"] + m["transient_bytes"], p["state"] + p["memory"]["transient"])]
    rows += [("activations (one micro-batch)", m["activation_bytes"], sum(p["one_micro_batch"]))]
    for key in sorted(set(m["comm"]) | set(p["comm"])):
        rows.append((f"comm {key[0]} {key[1]}", m["comm"].get(key, 0), p["comm"].get(key, 0)))
    return rows + [("comm per step", m["comm_bytes"], p["comm_total"])]


def ratio(a, b):
    if not b:
        return "exact" if not a else "-"
    return f"{a / b:.4f}"


def report(cfg, measured, predicted):
    m = measured
    dims = " x ".join(f"{k}={v}" for k, v in m["dims"].items())
    how = ("real tensors: measured in this process's memory" if m["compute"] == "real" else
           "fake tensors (FakeTensorMode): sizes without memory; bytes exact, no compute")
    lines = [f"dry run: rank {m['rank']} of {m['world_size']}, parallel={m['layout']} impl={cfg.parallel.impl} "
             f"({dims}), {m['n_params'] / 1e9:.3f}B parameters, {how}",
             "dry run: the fake process group moves no data, so the losses mean nothing; none is reported",
             f"step {m['step']} (built in {m['build_s']:.1f} s, step {m['step_s']:.1f} s):",
             f"  {'':34s} {'measured GB':>12s} {'planner GB':>12s} {'ratio':>8s}"]
    for what, a, b in compare(m, predicted):
        lines.append(f"  {what:34s} {a / GB:12.4f} {b / GB:12.4f} {ratio(a, b):>8s}")
    return "\n".join(lines)


def run(cfg, run_dir, under_torchrun=False):
    """train.py's entry for `dry_run.world=N`: check, measure, write config.yaml and metrics.jsonl, print the report."""
    from omegaconf import OmegaConf
    from metrics import Metrics
    layout, device, dtype, accum, compute, predicted = check(cfg, under_torchrun)
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise ConfigError(f"{run_dir} already holds a run; a dry run writes into a fresh run dir")
    d = cfg.dry_run
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"), resolve=True)
    cfg = cfg.copy()
    cfg.logger.mode = "disabled"  # its numbers are not training: no W&B run
    metrics = Metrics(cfg, run_dir, rank=0)  # this process is the only one, whichever rank it plays
    print(f"dry run: rank {d.rank} of {d.world} under torch's fake process group ({compute} tensors), "
          f"{d.steps} step(s), gradient accumulation {accum}")

    first = {"step": 0, "dry_run": True, "compute": compute, "rank": d.rank, "world_size": d.world,
             **layout.record(), "grad_accum": accum, "device": device, "dtype": dtype,
             "predicted_state_bytes": predicted["state"], "predicted_comm_bytes": predicted["comm_total"]}

    def log(step, out):
        if step == 1:  # the first record, as a real run's: what was built (known once it is)
            metrics.log({**first, "n_params": out["n_params"], "param_bytes": out["param_bytes"], **out["dims"]})
        metrics.log({"step": step, "dry_run": True, "state_bytes": out["state_bytes"], "comm_bytes": out["comm_bytes"],
                     "activation_bytes": out["activation_bytes"],
                     **({"transient_bytes": out["transient_bytes"]} if out["transient_bytes"] is not None else {}),
                     **{f"comm_{dim}_{kind}": n for (dim, kind), n in sorted(out["comm"].items())}})
    m = measure(cfg, layout, d.rank, compute, device, dtype, accum, d.steps, on_step=log)
    metrics.close()
    print(report(cfg, m, predicted))
    return m


# --- the README's table: every strategy at one scale, in one process
TABLE = ["model=gpt_70b", "data=fineweb_edu", "train.seq_len=2048", "train.micro_batch_size=1",
         "train.global_batch_size=512", "dry_run.world=512"]
# one micro-batch per step on every rank (512 sequences over dp = 512, or 8 at a time over dp = 64 beside tp = 8):
# the same tokens per step everywhere, and a fake step costs its op count, which accumulation multiplies
LAYOUTS = [("ddp", []), ("zero1", []), ("zero2", []), ("fsdp", []),
           ("tp", ["parallel.tp=8", "train.micro_batch_size=8"]),
           ("fsdp_tp", ["parallel.tp=8", "train.micro_batch_size=8"]),
           # 8 stages of 10 blocks x FSDP over dp = 64: 8 micro-batches per step through each pipeline
           ("pp", ["parallel.pp=8", "parallel.data=fsdp"])]
# HSDP: 64 replicas of 8-rank shard groups (a node each); context parallel: FSDP over 64 x cp 8 at a 16k sequence,
# each rank 2048 tokens of every sequence, the same tokens per rank as above
LAYOUTS += [("hsdp", ["parallel.dp_shard=8"])] + \
    [("fsdp", ["parallel.cp=8", f"parallel.cp_method={method}", "train.seq_len=16384", "model.block_size=16384",
               "train.global_batch_size=64"]) for method in ("ring", "allgather")]


def layouts(impls=("scratch", "torch")):
    """(parallel preset, impl, overrides) for the table; torch's DDP twins need real tensors (see the docstring)."""
    for name, extra in LAYOUTS:
        for impl in impls:
            yield name, impl, extra


def table(overrides, impls=("scratch", "torch"), steps=1, only=None):
    """Markdown: per-rank state, peak model state and communication per step, measured and predicted; `only`: the
    layout names (Layout.name, for people: hsdp, fsdp_cp, ...) whose rows to run, every row where None. Rows the
    checks refuse are listed below the table with their line."""
    head = ("| parallel | impl | dp x tp | tensors | state GB | planner | ratio | peak model state GB | planner | "
            "ratio | comm GB/step | planner | ratio |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    skipped = []
    for name, impl, extra in layouts(impls):
        cfg = plan.compose([*TABLE, *overrides, f"parallel={name}", f"parallel.impl={impl}", *extra],
                           config_name="config")
        try:
            layout, device, dtype, accum, compute, predicted = check(cfg)
        except ConfigError as e:  # torch's DDP twins: they don't run under the fake process group
            skipped.append(f"parallel={name} impl={impl}: {e}")  # listed whatever `only`: refused, it has no Layout
            continue
        if only is not None and layout.name not in only:
            continue
        m = measure(cfg, layout, cfg.dry_run.rank, compute, device, dtype, accum, steps)
        ppeak = predicted["state"] + predicted["memory"]["transient"]
        if m["transient_bytes"] is None:  # the strategy doesn't measure what it holds beyond its state
            peak = "- | " + f"{ppeak / GB:.2f} | -"
        else:
            peak = m["state_bytes"] + m["transient_bytes"]
            peak = f"{peak / GB:.2f} | {ppeak / GB:.2f} | {ratio(peak, ppeak)}"
        label = layout.name + (f" (cp={layout.cp}, {cfg.parallel.cp_method})" if layout.cp > 1 else "") + \
            (f" ({layout.dp_replicate} x {layout.dp_shard})" if layout.dp_replicate > 1 else "")
        lines.append(f"| {label} | {impl} | {m['dims']['dp']} x {m['dims']['tp']} | {compute} | "
                     f"{m['state_bytes'] / GB:.2f} | {predicted['state'] / GB:.2f} | "
                     f"{ratio(m['state_bytes'], predicted['state'])} | {peak} | "
                     f"{m['comm_bytes'] / GB:.2f} | {predicted['comm_total'] / GB:.2f} | "
                     f"{ratio(m['comm_bytes'], predicted['comm_total'])} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines + [""] + [f"not run: {s}" for s in skipped])


def main(argv):
    if "--table" not in argv:
        print(__doc__)
        return
    # --only hsdp,fsdp_cp: those layouts' rows alone (the whole table takes about 40 minutes here)
    only = next((a.split("=", 1)[1].split(",") for a in argv if a.startswith("--only=")), None)
    overrides = [a for a in argv if a != "--table" and not a.startswith("--only=")]
    try:
        print(table(overrides, only=only))
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
