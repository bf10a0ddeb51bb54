"""parallel=auto: the planner ranks every candidate (layout x micro-batch x activation checkpointing x pipeline
schedule) that the rule book accepts, picks the fastest predicted that fits, and train.py trains the pick
(tools/plan.py choose; train.py choose_layout). The real self-launched run is in tests/test_launch.py's sweep."""
import copy
import os
import re
import subprocess
import sys

import pytest
import torch

import config
from conftest import ROOT, assert_refused, fake_cpu_profile, make_cfg, small_run
from tools import plan


def planned(*overrides):
    return plan.compose(["parallel=auto", *overrides])


@pytest.fixture(scope="module")
def ranked():
    """gpt_350m on two nodes of 8 H100s: data strategies, tp within a node, HSDP, cp and pp all among the candidates."""
    cfg = planned("model=gpt_350m", "plan.world=16")
    rows, refused = plan.auto_rows(cfg, plan.model_shape(cfg), cfg.plan)
    return cfg, rows, refused


# its two tests on one pytest-xdist worker (pytest.ini: --dist loadgroup): on two, each ranked (6.5 CPU-s) for itself
RANKED = pytest.mark.xdist_group("test_auto-ranked")


@RANKED
def test_ranking_covers_every_knob_and_picks_the_fastest_that_fits(ranked):
    cfg, rows, refused = ranked
    fit = [r for r in rows if r["fits"]]
    assert fit and len(fit) < len(rows)  # some don't fit (no checkpointing, large micro-batches)
    assert rows[:len(fit)] == fit  # those that fit first
    assert fit[0]["step_s"] == min(r["step_s"] for r in fit)
    assert [r["step_s"] for r in fit] == sorted(r["step_s"] for r in fit)
    assert {r["ac"] for r in rows} == {"none", "selective", "full"}
    assert {r["micro"] for r in rows} >= {1, 2, 4, 8, 16, 32}
    assert {r["schedule"] for r in rows if r["pp"] > 1} == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    names = {r["layout"].name for r in rows}
    assert {"ddp", "zero1", "zero2", "fsdp", "hsdp", "fsdp_tp", "fsdp_cp"} <= names and any(n.startswith("pp")
                                                                                            for n in names)
    assert refused and all(why for _, why in refused)
    # choose: the same pick, and its top 5 printed with memory and step time
    said = []
    picked = plan.choose(cfg, cfg.plan, log=said.append)
    assert picked["overrides"] == plan.auto_overrides(fit[0])
    assert [c["overrides"] for c in picked["candidates"]] == [plan.auto_overrides(r) for r in fit[:plan.TOP]]
    table = said[0].splitlines()
    assert len([line for line in table if re.match(r"\s+\d ", line)]) == plan.TOP
    assert f"{fit[0]['total_memory'] / 1e9:.2f}" in table[2] and f"{fit[0]['step_s'] * 1e3:.1f}" in table[2]
    assert " ".join(plan.auto_overrides(fit[0], short=True)) in table[-1]


@RANKED
def test_each_candidate_is_what_its_overrides_train(ranked):
    """A candidate's overrides, set in the config (as train.py does), make the very Layout, micro-batch,
    checkpointing and schedule that were priced: the rule book accepts them and the planner's own prediction of
    that config is the candidate's memory and step time. Every 20th candidate, and every 15th under a pipeline."""
    cfg, rows, _ = ranked
    for r in rows[::20] + [r for r in rows if r["pp"] > 1][::15]:
        c = copy.deepcopy(cfg)
        plan.apply_choice(c, plan.auto_overrides(r))
        layout = config.rules(c, c.plan.world, "bfloat16")
        assert layout == r["layout"]
        assert (c.train.micro_batch_size, c.train.activation_checkpointing) == (r["micro"], r["ac"])
        p = plan.predict(c, layout, shape=plan.model_shape(c), plan=c.plan)
        assert (p["total_memory"], p["step_s"]) == (r["total_memory"], r["step_s"])
        assert p.get("pp_schedule", r["schedule"]) == r["schedule"]


def test_nothing_fits_says_what_would():
    """70B on 8 H100s: one line with the smallest predicted peak and the smallest world (doubling) where a
    candidate fits; at that world one does, at half of it none."""
    cfg = planned("model=llama3_70b", "plan.world=8")
    with pytest.raises(config.ConfigError) as e:
        plan.choose(cfg, cfg.plan, log=lambda *a: None)
    line = str(e.value)
    assert "\n" not in line and "smallest predicted peak is" in line and "micro-batch 1" in line
    more = int(re.search(r"; (\d+) ranks would fit it", line).group(1))
    shape = plan.model_shape(cfg)
    fits_at = {}
    for world in (more // 2, more):
        bigger = copy.deepcopy(cfg.plan)
        bigger.world = world
        fits_at[world] = any(r["fits"] for r in plan.auto_rows(cfg, shape, bigger, timed=False)[0])
    assert fits_at == {more // 2: False, more: True}


def test_train_refuses_in_one_line(tmp_path, monkeypatch):
    """train.py, before any work: nothing fits (an H100 of 1 MB), an unknown GPU by name, an unknown plan.gpu; a dry
    run of parallel=auto (it has no layout to dry-run)."""
    assert_refused(tmp_path, ["parallel=auto", "plan.gpu=h100", "plan.memory_gb=0.001"], 2,
                   "parallel=auto: nothing fits in 0.0 GB per rank on 2 x h100")
    assert_refused(tmp_path, ["parallel=auto", "plan.gpu=h900"], 2, "plan.gpu='h900': expected one of h100")
    assert_refused(tmp_path, ["parallel=auto", "train.seq_len=128"], 2, "longer than the model's context")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Z9000")
    with pytest.raises(config.ConfigError, match="GPUS has no row for 'NVIDIA Z9000'; name the nearest"):
        plan.cluster(make_cfg("parallel=auto"), 8, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 85e9}))
    got = plan.cluster(make_cfg("parallel=auto"), 16, "cuda")
    assert (got.gpu, got.memory_gb, got.world, got.gpus_per_node) == ("h100", 85.0, 16, 16)
    from tools import dry_run
    with pytest.raises(config.ConfigError, match="parallel=auto picks a layout for a run of train.py"):
        dry_run.check(make_cfg(*small_run("parallel=auto", "dry_run.world=8")))


def test_cpu_pick_is_planned_on_the_cpu_profile():
    """On a CPU, plan.gpu=auto is the CPU (its measured profile: here a made-up one in the session's cache), its
    memory the machine's shared by the node's ranks, and the run's float32; the pick is the fastest there."""
    fake_cpu_profile()
    cfg = make_cfg(*small_run("parallel=auto"))
    cluster = plan.cluster(cfg, 4, "cpu")
    assert (cluster.gpu, cluster.world, cluster.gpus_per_node) == ("cpu", 4, 4)
    c = copy.deepcopy(cfg)
    c.train.dtype = "float32"
    picked = plan.choose(c, cluster, log=lambda *a: None)
    rows = [r for r in plan.auto_rows(c, plan.model_shape(c), cluster)[0] if r["fits"]]
    assert picked["overrides"] == plan.auto_overrides(rows[0]) and picked["device"] == "cpu"


def test_plan_command_picks_and_dry_runs_its_top_picks():
    """`python -m tools.plan parallel=auto ... plan.dry_run=2`: the top 5, the pick's full plan, and its top 2
    dry-run at plan.world under the fake process group, their state as measured equal to the planner's."""
    p = subprocess.run([sys.executable, "-m", "tools.plan", "parallel=auto", "model=gpt_tiny", "train.seq_len=256",
                        "plan.world=8", "plan.dry_run=2"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    pick = re.search(r"parallel=auto picks (\S+) \(", out).group(1)
    assert f"layout: parallel={pick} " in out and "every layout on" not in out  # the pick's plan, not re-ranked
    rows = [line for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert len(rows) == 2 and f"| 1 | {pick} |" in rows[0]
    for row in rows:
        state, activations = (float(row.split("|")[k].split("(")[1].rstrip(") ")) for k in (6, 8))
        assert state == pytest.approx(1, abs=0.02) and activations == pytest.approx(1, abs=0.05), row


def test_ranks_that_disagree_on_the_layout_stop(tmp_path):
    """Ranks that would build different meshes (SLURM's tasks planning parallel=auto apart, or given different
    settings) stop with one line when the process group forms, instead of waiting forever on each other's groups."""
    import launch
    from conftest import forked
    from parallel.layout import Layout
    said = tmp_path / "said"

    def rank():
        r = int(os.environ["RANK"])
        try:
            launch.process_group(Layout(2, dp_shard=2, data="ddp" if r == 0 else "fsdp"), "cpu", str(tmp_path), r)
        except launch.LaunchError as e:
            if r == 0:
                said.write_text(str(e))
    forked(2, rank)
    assert said.read_text() == ("the ranks disagree on the layout: rank 0 would train ddp (pp=1 dp=2 cp=1 tp=1), "
                                "rank 1 fsdp (pp=1 dp=2 cp=1 tp=1) (different settings, or parallel=auto planned "
                                "apart); set the layout explicitly")


def test_auto_bench_keeps_each_candidates_fastest_round(tmp_path, monkeypatch):
    """tools/auto_bench.py without its launch (a fake one writes each run's metrics): every candidate runs once per
    round, forward then backward through the list; each keeps its fastest round, and the pick is rated against the
    best of those. The rates here put candidate 1 ahead in round 0 alone and the pick ahead in round 1 alone."""
    import json
    from tools import auto_bench
    from tools import jobs as launcher
    fake_cpu_profile()
    assert auto_bench.order(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]
    launched = []

    class Started:  # the launch already over: every run's metrics written
        proc = type("P", (), {"poll": lambda self: 0})()

        def done(self):
            return [d for d, _ in launched]

        def finish(self, timeout):
            return subprocess.CompletedProcess([], 0, "", "")

    def start(world, jobs):
        launched.extend(jobs)
        for run_dir, overrides in jobs:
            k, i = (int(x) for x in os.path.basename(run_dir)[1:].split("-")[:2])
            step = {(0, 0): 4.0, (1, 0): 1.0, (0, 1): 2.0, (1, 1): 8.0}.get((k, i), 5.0)
            os.makedirs(run_dir)
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                first = {"tokens_per_step": 1000, "parallel": "zero1", "auto": {"overrides": ["x=1"]}}
                f.writelines(json.dumps(r) + "\n" for r in [first] + [{"step_time_s": step}] * 3)
        return Started()
    monkeypatch.setattr(launcher, "start", start)
    said = []
    s = auto_bench.run(str(tmp_path / "out"), 2, 3, ["model=gpt_tiny"], log=said.append, rounds=2)
    assert len(launched) == 6 and "parallel=auto" in launched[0][1] and "parallel=auto" in launched[-1][1]
    assert [line.split()[0] for line in said[1:7]] == [f"{k}/6" for k in range(1, 7)]  # progress, a line per run
    assert [r["rounds_tok_per_s"] for r in s["rows"]] == [[250, 1000], [500, 125], [200, 200]]
    assert [r["measured_tok_per_s"] for r in s["rows"]] == [1000, 500, 200] and s["pick_of_best"] == 1
    assert [r["of_best"] for r in s["rows"]] == [1, 0.5, 0.2]
    md = (tmp_path / "out" / "auto_bench.md").read_text()
    assert "the fastest of 2 round(s)) is 1.000 of the best measured" in md and "| 1,000 (250, 1,000) | 1.000 |" in md
    assert json.loads((tmp_path / "out" / "auto_bench.json").read_text())["rounds"] == 2
