import os
import shutil
import subprocess
import sys
import time

import pytest

import config
import train
from conftest import ROOT, make_cfg, read_metrics, read_wandb_history, small_run
from data import prepare


@pytest.mark.quick
def test_every_group_option_composes():
    for group in ("model", "data", "parallel", "optim", "logger"):
        options = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", group)) if f.endswith(".yaml"))
        assert options, group
        for option in options:
            extra = ["data.paths=[x.txt]"] if (group, option) == ("data", "text") else []
            cfg = make_cfg(f"{group}={option}", *extra)
            assert cfg[group] is not None
            if group == "model" and option == "hf":  # every shape setting null: train.init_from's config.json
                assert cfg.model.n_layer is None and cfg.model.n_embd is None
            elif group == "model":
                assert cfg.model.n_embd % cfg.model.n_head == 0
            if group == "data":
                assert cfg.data.source == option and cfg.data.tokenizer in ("bpe", "gpt2")
    assert make_cfg("data=fineweb_edu").data.tokenizer == "gpt2"
    assert make_cfg("data=text", "data.paths=[a]").data.sample_by == "paragraph"  # inherits the rest from pycode


@pytest.mark.quick
def test_compose_matches_hydra(tmp_path, monkeypatch):
    """tools/plan.py compose (the group choices composed once and copied, the plain key=values applied by Hydra's
    own code) gives what Hydra's compose gives: the same config and flags, or the same error; and a caller's edits
    to one config reach no later one."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from tools import plan

    def hydra(overrides, name):
        with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
            return compose(config_name=name, overrides=overrides)

    cases = [([], "config"), (["parallel=fsdp", "model=llama_tiny", "model.n_layer=3"], "config"),
             (["model.n_layer=3", "parallel=tp", "parallel.tp=4", "parallel.impl=torch"], "config"),
             (["data=text", "data.paths=[a,b]", "+train.extra=1", "~checkpoint.keep"], "config"),
             (["hydra/launcher=submitit_slurm", "launcher.nproc_per_node=2"], "config"),
             (["parallel=auto", "plan.world=64", "plan.gpu=a100"], "plan"), (["model=gpt_1p3b"], "plan"),
             (["train.nope=1"], "config"), (["parallel=nope"], "config"), (["+train.seq_len=3"], "config"),
             (["parallel.tp=[1"], "config"), (["model.n_layer=2", "model.n_layer=3"], "config")]
    for overrides, name in cases:
        got = []
        for fn in (hydra, lambda o, n: plan.compose(o, n)):
            try:
                cfg = fn(list(overrides), name)
                got.append((OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg)))
            except Exception as e:
                got.append((type(e).__name__, str(e), repr(e.__cause__)))
        assert got[0] == got[1], overrides
    first = plan.compose(["parallel=fsdp", "model.n_layer=3"], "config")
    first.model.n_embd = 7
    assert plan.compose(["parallel=fsdp"], "config").model.n_embd != 7
    # a config file edited while the process lives (a notebook's, a test session's): composed afresh
    conf = tmp_path / "conf"
    shutil.copytree(os.path.join(ROOT, "conf"), conf)
    monkeypatch.setattr(plan, "CONF", str(conf))
    assert plan.compose(["model=gpt_tiny"], "config").model.n_layer == 4
    preset = conf / "model" / "gpt_tiny.yaml"
    preset.write_text(preset.read_text().replace("n_layer: 4", "n_layer: 5"))
    os.utime(preset, ns=(time.time_ns() + 10**9,) * 2)  # a later mtime, whatever the file system's resolution
    assert plan.compose(["model=gpt_tiny"], "config").model.n_layer == 5


def test_short_run_learns_and_logs(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = make_cfg(*small_run("train.max_steps=40", "train.eval_every=20", "train.log_every=5",
                              "logger.mode=offline", "train.sample_tokens=10"))
    train.run(cfg, run_dir)
    records = read_metrics(run_dir)
    start = records[0]
    assert start["n_params"] > 0 and start["world_size"] == 1 and start["grad_accum"] == 2
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [s for s, _ in vals] == [0, 20, 40]
    assert vals[-1][1] < vals[0][1] - 1.0, vals  # the validation loss falls clearly
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == list(range(5, 41, 5))
    for r in losses:
        assert {"lr", "tok_per_s", "grad_norm", "peak_mem_mb", "step_time_s"} <= r.keys() and r["tok_per_s"] > 0
    assert losses[-1]["loss"] < losses[0]["loss"]
    # W&B received the same numbers: decode its offline run file, don't just look for the folder
    history = {row["_step"]: row for row in read_wandb_history(run_dir)}
    for r in losses:
        assert history[r["step"]]["loss"] == pytest.approx(r["loss"])
    assert history[40]["val_loss"] == pytest.approx(vals[-1][1])
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["step_0000040"]  # keep=2, every=100: the last only
    assert "seq_len: 64" in open(os.path.join(run_dir, "config.yaml")).read()  # the resolved config


def bad(tmp_path, *overrides):
    """Run with bad settings: it must fail with a clear error and write nothing at all."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"  # a cache of its own: the session's is shared (xdist)
    cache.mkdir()
    session_cache, os.environ["NANOPARALLEL_CACHE"] = os.environ["NANOPARALLEL_CACHE"], str(cache)
    try:
        with pytest.raises((train.ConfigError, prepare.DataError)) as err:
            train.run(make_cfg(*small_run(*overrides)), str(run_dir))
    finally:
        os.environ["NANOPARALLEL_CACHE"] = session_cache
    assert not run_dir.exists() or not os.listdir(run_dir)
    assert os.listdir(cache) == []
    return str(err.value)


@pytest.mark.quick
@pytest.mark.parametrize("overrides,message", [
    (["train.micro_batch_size=3"], "not divisible"),
    (["train.global_batch_size=6"], "not divisible"),
    (["train.seq_len=128"], "longer than the model's context"),
    (["data.paths=[/nonexistent/*.txt]"], "matches no file"),
    (["data.vocab_size=70000", "data.token_dtype=uint16"], "does not fit in data.token_dtype=uint16"),
    (["train.dtype=float16"], "expected auto, float32 or bfloat16"),
    (["logger.mode=sometimes"], "expected offline, online or disabled"),
    (["train.max_steps=0"], "at least 1"),
    (["checkpoint.every=-1"], "checkpoint.every=-1 must be a whole number"),
    (["train.resume=/nonexistent/run"], "train.resume=/nonexistent/run: /nonexistent/run: no such checkpoint"),
    # the model's shape, the optimizer's hyperparameters, values of the wrong type: config.py's schema and rules
    (["model.n_head=3"], "model.n_head=3 must divide model.n_embd=64"),
    (["model.n_embd=66"], "model.n_embd / model.n_head = 33 channels per head must be even"),
    (["model.n_layer=0"], "model.n_layer=0 must be at least 1"),
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be positive"),
    (["optim.lr=fast"], "optim.lr='fast': expected a number"),
    (["optim.min_lr=0.1"], "optim.min_lr=0.1 is above optim.lr=0.003"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5]: expected two numbers in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0 must be positive"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1 must be at least 0"),
    (["optim.warmup_steps=-5"], "optim.warmup_steps=-5 must be a whole number, 0 or more"),
    (["optim.warmup_steps=2.5"], "optim.warmup_steps=2.5: expected a whole number"),
    (["train.max_steps=abc"], "train.max_steps='abc': expected a whole number"),
    (["train.compile=maybe"], "train.compile='maybe': expected true or false"),
    (["train.device=tpu"], "train.device='tpu': expected auto, cpu or cuda"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 must be below 1"),
    (["train.eval_batch_size=6"], "train.eval_batch_size=6 is not divisible by micro_batch_size (4)"),
])
def test_bad_settings(tmp_path, overrides, message):
    assert message in bad(tmp_path, *overrides)


@pytest.mark.quick
def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert "empty corpus" in bad(tmp_path, f"data.paths=[{tmp_path}/empty.txt]")


@pytest.mark.quick
def test_compile_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(config.shutil, "which", lambda name: None)  # no g++, c++, clang++ or $CXX on PATH
    assert "no C++ compiler (g++, clang++ or $CXX) is on PATH" in bad(tmp_path, "train.compile=true")


@pytest.mark.quick
def test_bfloat16_where_the_device_cant(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "bf16_supported", lambda device: False)
    assert "can't compute in bfloat16" in bad(tmp_path, "train.dtype=bfloat16")


@pytest.mark.quick
def test_existing_run_dir_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "old": true}\n')
    with pytest.raises(train.ConfigError, match="already holds a run"):
        train.run(make_cfg(*small_run()), str(run_dir))
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0, "old": true}\n'
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl"]


def cli(*args, cwd):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_errors_are_one_line(tmp_path):
    run_dir = tmp_path / "run"
    p = cli(*small_run("train.micro_batch_size=3"), f"hydra.run.dir={run_dir}", cwd=tmp_path)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: train.global_batch_size=8"), p.stderr
    assert not run_dir.exists() or not os.listdir(run_dir)
    p = cli(*small_run("train.max_steps=abc"), f"hydra.run.dir={run_dir}", cwd=tmp_path)  # a value of the wrong type
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1 and lines == ["error: train.max_steps='abc': expected a whole number"], p.stderr
    assert not run_dir.exists() or not os.listdir(run_dir)
    p = cli("model=gpt_huge", cwd=tmp_path)  # an unknown group option: Hydra says so, listing the choices
    assert p.returncode != 0 and "Could not find 'model/gpt_huge'" in p.stderr and "gpt_tiny" in p.stderr
    assert not (tmp_path / "outputs").exists()


def test_val_loss_is_one_quantity(tmp_path):
    """The validation set is eval_steps batches of eval_batch_size sequences whatever the micro-batch (and, in the
    equivalence tests, the layout): micro-batches of 1, 2 or 4 give one val loss, and the default is the global
    batch."""
    vals = []
    for micro in (1, 2, 4):
        run_dir = str(tmp_path / f"m{micro}")
        train.run(make_cfg(*small_run("train.max_steps=1", f"train.micro_batch_size={micro}")), run_dir)
        vals.append([r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r])
    assert vals[0] == pytest.approx(vals[1], rel=1e-6) and vals[0] == pytest.approx(vals[2], rel=1e-6), vals
    other = str(tmp_path / "eval4")  # another eval batch is another validation set
    train.run(make_cfg(*small_run("train.max_steps=1", "train.eval_batch_size=4")), other)
    assert [r["val_loss"] for r in read_metrics(other) if "val_loss" in r][0] != pytest.approx(vals[2][0], rel=1e-4)


def test_selective_checkpointing_recomputes_the_cheap_ops(tmp_path):
    """train.activation_checkpointing=selective: the losses and gradient norms of none, and in between none and full
    in what autograd keeps (the matmuls' and attention's outputs saved, norms, activations and RoPE recomputed);
    train.selective_matmuls=alternate the same losses, with each block's second matmul (proj) run again."""
    import torch

    import parallel
    from model import GPT
    runs = {}
    for mode, matmuls in (("none", "all"), ("selective", "all"), ("selective", "alternate")):
        runs[mode, matmuls] = str(tmp_path / f"{mode}-{matmuls}")
        train.run(make_cfg(*small_run("train.max_steps=3", f"train.activation_checkpointing={mode}",
                                      f"train.selective_matmuls={matmuls}")), runs[mode, matmuls])
    steps = [[(r["loss"], r["grad_norm"]) for r in read_metrics(runs[m]) if "loss" in r] for m in runs]
    assert steps[0] == steps[1] == steps[2], steps
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # every aten op a forward and backward runs, by name
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))
    ran = {}
    for mode, matmuls in (("none", "all"), ("selective", "all"), ("selective", "alternate"), ("full", "all")):
        torch.manual_seed(0)
        model = GPT(config.model_config(make_cfg(*small_run()), 512))
        parallel.apply_activation_checkpointing(model, mode, 1, matmuls)
        idx = torch.randint(0, 512, (2, 64))
        with Ops() as ops:
            model(idx, idx).backward()
        ran["alternate" if matmuls == "alternate" else mode] = ops.n
    # selective runs no matmul twice (their outputs are kept) but reruns the norms' (rsqrt) in backward; full reruns both
    assert ran["selective"]["mm"] == ran["none"]["mm"] < ran["full"]["mm"], {m: ran[m]["mm"] for m in ran}
    assert ran["none"]["rsqrt"] < ran["selective"]["rsqrt"] == ran["full"]["rsqrt"], {m: ran[m]["rsqrt"] for m in ran}
    # of a block's four matmuls (qkv, proj, up, down), alternate runs proj again (it keeps qkv's and up's outputs;
    # down's, the last, backward never reads), full all but down: torch.utils.checkpoint stops recomputing once
    # backward has what it asked for (tools/plan.py selective_recompute prices the same)
    L = make_cfg(*small_run()).model.n_layer
    assert ran["alternate"]["mm"] == ran["none"]["mm"] + L and ran["full"]["mm"] == ran["none"]["mm"] + 3 * L, \
        {m: ran[m]["mm"] for m in ran}
