"""NCCL-ready without a GPU: what gloo forgives and NCCL doesn't, as checks that run on the CPU.

- The collective order: NCCL needs every rank of a group to issue the same collectives in the same order, and ranks
  that share two groups to interleave them alike. Every layout family at world 4 logs its collectives per rank
  (CommCounter(log=True)); comm.order_problem finds none out of order.
- Older torch: the same runs with the collectives under their names before torch 2.13 (all_gather_into_tensor,
  reduce_scatter_tensor; the _single names gone) train as parallel=single does and count every byte.
- Adam's `step` after a resume lives where the optimizer keeps it: on the parameter's device when fused.
- Two "nodes" on this machine: their local ranks 0 prepare one shared data cache at once without a crash, and a run
  whose nodes don't share train.out_dir is refused in one line before it writes anything.
- The pipeline's p2p: every schedule, posted as Pipeline.run posts it, runs to its end in NCCL's order.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from conftest import ROOT, assert_same_steps, free_port, launch_jobs, make_cfg, read_metrics, small_run
from parallel import comm

STEPS = ["train.global_batch_size=8", "train.micro_batch_size=1", "train.max_steps=3", "train.eval_every=100",
         "train.log_every=1"]
# every layout family at world 4, ours (torch's twins call torch's own, renamed, collectives)
FAMILIES = {"ddp": ["parallel=ddp"],
            "zero1_tp_sp": ["parallel=zero1", "parallel.tp=2", "parallel.sequence_parallel=true"],
            "zero2": ["parallel=zero2"],
            "hsdp": ["parallel=hsdp", "parallel.dp_shard=2"],
            "fsdp_cp": ["parallel=fsdp", "parallel.cp=2"],
            "pp_ddp": ["parallel=pp", "parallel.pp=2"]}


@launch_jobs(4)
def jobs(root, request):
    """Every family at world 4, in the session's world-4 launch, each under the collectives' names before torch 2.13
    and logged per rank (tests/launch_ranks.py, `@old_torch`)."""
    return {name: (str(root / f"{name}@old_torch"), small_run(*STEPS, *o)) for name, o in FAMILIES.items()}


@pytest.fixture(scope="module")
def old_torch_runs(launch4):
    return launch4[__name__][0]


@pytest.fixture(scope="module")
def single_small(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single") / "run")
    train.run(make_cfg(*small_run(*STEPS)), run_dir)
    return run_dir


def logs_of(run_dir):
    logs = {}
    for r in range(4):
        with open(os.path.join(run_dir, f"comm_order_rank{r}.json")) as f:
            logs[r] = [(tuple(g), kind, json.dumps(shape), dtype) for g, kind, shape, dtype in json.load(f)]
    return logs


@pytest.mark.parametrize("family", FAMILIES)
def test_collectives_in_one_order_on_every_rank(old_torch_runs, family):
    logs = logs_of(old_torch_runs[family])
    assert all(len(log) > 10 for log in logs.values()), {r: len(log) for r, log in logs.items()}
    assert comm.order_problem(logs) is None, comm.order_problem(logs)


@pytest.mark.parametrize("family", FAMILIES)
def test_older_torch_names_train_and_count(old_torch_runs, single_small, family):
    run_dir = old_torch_runs[family]
    assert_same_steps(run_dir, single_small)
    records = read_metrics(run_dir)
    start, steps = records[0], [r for r in records if "loss" in r]
    psi = start["param_bytes"]
    for r in steps:  # what the renamed collectives move, counted under their old names
        if family == "zero2":
            assert r["comm_dp_reduce_scatter"] == psi and r["comm_dp_all_gather"] == psi, r
        if family == "hsdp":  # two all-gathers per micro-step (accumulation 2) and one reduce-scatter within a shard
            assert r["comm_dp_shard_all_gather"] == 2 * 2 * psi and r["comm_dp_shard_reduce_scatter"] == psi, r
        if family == "zero1_tp_sp":  # sequence parallel: every activation all-reduce an all-gather + reduce-scatter
            assert r["comm_tp_all_gather"] == r["comm_tp_reduce_scatter"] > 0, r


def test_order_problem_sees_what_would_hang():
    """comm.order_problem plays NCCL's in-order model: it passes logs that complete, names a mismatched slot, and
    finds the deadlock of two groups issued in crossed orders (each rank waits on the other's first)."""
    a, b = (0, 1), (0, 2)
    ok = {0: [(a, "all_reduce", "[4]", "f32"), (b, "all_gather", "[8]", "f32")],
          1: [(a, "all_reduce", "[4]", "f32")], 2: [(b, "all_gather", "[8]", "f32")]}
    assert comm.order_problem(ok) is None
    shape = {**ok, 1: [(a, "all_reduce", "[5]", "f32")]}  # another tensor in the same slot
    assert "group [0, 1]: rank 0's collective #0" in comm.order_problem(shape)
    extra = {**ok, 2: [(b, "all_gather", "[8]", "f32"), (b, "all_gather", "[8]", "f32")]}
    assert "rank 2 waits forever in collective #1" in comm.order_problem(extra)
    crossed = {0: [(a, "all_reduce", "[4]", "f32"), (b, "all_reduce", "[4]", "f32")],
               1: [(a, "all_reduce", "[4]", "f32")],
               2: [(b, "all_reduce", "[4]", "f32")]}
    assert comm.order_problem(crossed) is None  # 0 reduces with 1, then with 2
    crossed[0] = crossed[0][::-1]
    assert comm.order_problem(crossed) is None  # (either order completes: 1 and 2 only wait on 0)
    g01, g12, g02 = (0, 1), (1, 2), (0, 2)  # each rank starts with a group whose other rank starts elsewhere
    cycle = {0: [(g01, "all_reduce", "[4]", "f32"), (g02, "all_reduce", "[4]", "f32")],
             1: [(g12, "all_reduce", "[4]", "f32"), (g01, "all_reduce", "[4]", "f32")],
             2: [(g02, "all_reduce", "[4]", "f32"), (g12, "all_reduce", "[4]", "f32")]}
    assert "waits forever in collective #0" in comm.order_problem(cycle)
    cycle[1] = cycle[1][::-1]  # rank 1 meets rank 0 first: 0 -> 2 -> 1 all complete
    assert comm.order_problem(cycle) is None


def test_adam_step_where_the_optimizer_keeps_it():
    """checkpoint._make_state creates Adam's `step` on the parameter's device where the group is fused (the fused
    kernel reads it there and does not check), on the CPU otherwise. On the meta device, so that the two differ here
    as cpu and cuda do on a GPU machine."""
    import types

    import checkpoint
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    fused, plain = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    opt = types.SimpleNamespace(param_groups=[{"params": [fused], "fused": True}, {"params": [plain], "fused": None}],
                                state={fused: {}, plain: {}})
    layout = {"w": types.SimpleNamespace(optim=[(fused, 0)]), "v": types.SimpleNamespace(optim=[(plain, 0)])}
    meta = {k: TensorStorageMetadata(properties=None, size=torch.Size(s), chunks=[])
            for k, s in (("optim.w.step", ()), ("optim.w.exp_avg", (3,)), ("optim.v.step", ()))}
    checkpoint._make_state(opt, layout, meta)
    assert opt.state[fused]["step"].device.type == "meta" and opt.state[fused]["exp_avg"].device.type == "meta"
    assert opt.state[plain]["step"].device.type == "cpu"
    # and torch's own optimizer agrees with that rule on this CPU: fused AdamW's step is on the parameter's device
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    real = torch.optim.AdamW([p], fused=True)
    real.step()
    assert real.state[p]["step"].device == p.device and real.state[p]["step"].dtype == torch.float32


def test_two_nodes_share_a_cache_and_refuse_unshared_checkpoints(tmp_path):
    """Two torchrun "nodes" of one rank each on this machine (--nnodes=2, static rendezvous), one fresh data cache
    between them and a train.out_dir each: both local ranks 0 tokenize into the shared cache at once (an atomic
    replace: neither crashes, one copy stays), then every rank stops with one line, since checkpoints need a
    train.out_dir both nodes see; nothing of the run is written."""
    port = free_port()
    cache = tmp_path / "cache"
    procs = []
    for node in (0, 1):
        out = tmp_path / f"out{node}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
               os.path.join(ROOT, "train.py"), *small_run("parallel=ddp", "checkpoint.keep=2"),
               f"data.cache_dir={cache}", f"train.out_dir={out}", f"hydra.run.dir={out / 'run'}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    # rank 0 prints to the console, rank 1 into its rank1.log in the run dir
    with open(tmp_path / "out1" / "run" / "rank1.log") as f:
        outputs[1] += f.read()
    for p, out in zip(procs, outputs):
        assert p.returncode != 0, out[-2000:]
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert errors and "does not see rank 0's files there" in errors[0], out[-3000:]
        assert "OSError" not in out and "not empty" not in out, out[-3000:]  # the cache race
    folders = [f for f in os.listdir(cache)]
    assert len(folders) == 1 and os.path.exists(cache / folders[0] / "meta.json"), folders  # no tmp left behind
    for node in (0, 1):
        assert not (tmp_path / f"out{node}" / "run" / "config.yaml").exists()
        assert [f for f in os.listdir(tmp_path / f"out{node}") if f.startswith(".shared-probe")] == []


def test_cache_replace_lost_to_another_node(tmp_path, monkeypatch):
    """Over a shared cache, another node's local rank 0 may finish its copy between this one's writing and its
    os.replace: the replace then fails on a folder that is complete, and this copy is dropped, not an error."""
    from data import prepare
    cfg = make_cfg(*small_run(f"data.cache_dir={tmp_path}"))
    written = prepare.write_split

    def other_node_first(docs, dtype, tmp, val_fraction):
        count = written(docs, dtype, tmp, val_fraction)
        out = prepare.cache_path(cfg.data, cfg.data.cache_dir)
        os.makedirs(out)
        with open(os.path.join(out, "meta.json"), "w") as f:
            f.write("{}")  # the other node's complete copy
        return count
    monkeypatch.setattr(prepare, "write_split", other_node_first)
    out = prepare.prepare(cfg.data, cfg.data.cache_dir, log=lambda *a: None)
    assert os.listdir(tmp_path) == [os.path.basename(out)]  # ours dropped, no tmp folder left


SCHEDULES = [(name, p, m, v) for name in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble") for p in (2, 4, 8)
             for m in range(1, 17) for v in ((2, 3) if name == "interleaved_1f1b" else (1,))
             if name != "interleaved_1f1b" or m % p == 0]


def posted_before_2026_12(actions, rank, p, v):
    """The posting order Pipeline.run had until 2026-12-01: before each action, the sends of the action before it
    with the receive of the action after it (the receive for the first action posted alone, first)."""
    from parallel import pp
    recv_of = [pp.messages(a, rank, p, v)[0] for a in actions]
    program = [([("recv", recv_of[0])] if actions and recv_of[0] else [], False)]
    pending = []
    for n, a in enumerate(actions):
        nxt = recv_of[n + 1] if n + 1 < len(actions) else None
        program.append(([("send", m) for m in pending] + ([("recv", nxt)] if nxt else []), recv_of[n] is not None))
        pending = pp.messages(a, rank, p, v)[1]
    program.append(([("send", m) for m in pending], True))
    return program


def test_pipeline_p2p_runs_to_the_end_in_nccl_order():
    """Every schedule at pp 2, 4 and 8, with 1 to 16 micro-batches and v 1 to 3, posted as Pipeline.run posts it
    (pp.p2p_program), runs to its end when each rank's batches complete in order and a send completes only against
    its running receive (pp.p2p_hang). The same player shows the posting order before 2026-12-01 hanging."""
    from parallel import pp
    for name, p, m, v in SCHEDULES:
        actions = pp.schedule(name, p, m, v)
        assert pp.p2p_hang([pp.p2p_program(actions, r, p, v) for r in range(p)], p) is None, (name, p, m, v)
    hangs = {}
    for name, p, m, v in SCHEDULES:
        actions = pp.schedule(name, p, m, v)
        old = pp.p2p_hang([posted_before_2026_12(actions[r], r, p, v) for r in range(p)], p)
        hangs.setdefault(name, []).append(old is not None)
    assert all(any(h) for h in hangs.values()), {k: sum(h) for k, h in hangs.items()}
    print({k: f"{sum(h)}/{len(h)} hang" for k, h in hangs.items()})
