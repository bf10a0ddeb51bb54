"""The rule book's matrix: the layouts parallel/layout.py accepts at world 2, 4 and 8, proven equal to parallel=single.

The factors of a run: the mesh's degrees (pp, dp_replicate, dp_shard, cp, tp), the data strategy, the impl
(scratch, torch, deepspeed), the pipeline schedule, the context-parallel method, sequence parallel, the dtype
(float32; bfloat16 autocast, with bf16 working weights where the strategy keeps a copy), torch.compile and
activation checkpointing (none, full, every_n, selective). On the tiny Llama below (4 query heads on 2 key/value
heads, SwiGLU; 2 blocks, 4 where the pipeline needs them) the rule book accepts 6,732 of their combinations
at world 2-8: at 1-6 s a job on 2 cores, more than an hour. So the matrix is a covering array:
`CASES` holds every pair of factor values that some accepted run combines (a data strategy with a schedule, a
dtype with pipeline parallel, compile with a torch twin, ...), and the world size with every strategy and degree.
Each case runs 3 steps in the session's shared launch of its world and equals single's run on the same model and
dtype: per-step loss, grad_norm and val_loss, and the final weights.

`test_cases_cover_the_rule_book` enumerates the rule book afresh: a pair it accepts that no case runs is a failure
that names the pair and a case that would cover it (`python tests/test_matrix.py` prints a whole covering, greedily);
a case the rule book refuses is a failure too. `test_refusals_are_one_line` holds every refusal met on the way to
the rule book's promise: one line, naming a setting."""
import itertools
import re
import sys
from functools import lru_cache

import pytest

import train
from conftest import BF16, assert_same_steps, final_weights, launch_jobs, losses, make_cfg, read_metrics, small_run
from test_llama import LLAMA

STEPS = 3
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# a case's defaults; a case's spec names only what differs (and always the data strategy)
DEFAULTS = dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, data="none", impl="scratch", schedule="1f1b",
                cp_method="ring", sp=False, dtype="float32", compile=False, ac="none")
AC_MODES = ("none", "full", "every_n", "selective")
# a job's seconds in its launch, roughly (2 cores; docs/tests.md); a compiled one's more, by what it compiles. Every
# rank compiles the same graphs at once, so a compile takes world / 2 times as long on 2 cores (measured 2026-12-03,
# a block's and the loss's graphs: 5-14 s at world 2, 20-30 s at world 4): the covering compiles at world 2 alone.
# Graphs go to inductor's on-disk cache: a case whose graphs an earlier one compiled costs little (0.3-0.8 s seen),
# but zero-bubble compiles afresh every time (parallel/__init__.py apply_compile: it reads no cache)
COST = {2: 1.0, 4: 2.5, 8: 8.0}
COMPILE_COST = {"fresh": 8.0, "cached": 0.5, "zero_bubble": 5.0, "world>2": 1e3}

# Tolerances, about 10x the largest gap measured over the cases (2026-12-03, this CPU; in the comments): relative
# for loss, grad_norm and val_loss, absolute for the weights (each tensor's largest gap, and its mean gap).
# float32: the order of sums alone (loss 2.3e-7, grad_norm 2.6e-7, val_loss 7.7e-8; weights 3.2e-7, mean 2.6e-10)
TOL = dict(loss=2e-6, grad_norm=3e-6, val_loss=1e-6, max=3e-6, mean=3e-9)
# bfloat16 against single's bfloat16: each layout rounds its own partial sums to bf16 (tp's row-parallel halves,
# pp's and cp's micro-batches), and with bf16 working weights the residual stream too (loss 3.1e-6, grad_norm
# 2.6e-4, val_loss 3.8e-6; weights 1.2e-3, mean 1.1e-5). The largest weight gap is AdamW's: its first steps move a
# weight by about lr (3e-3) whatever its gradient's size, so where a gradient is rounding-sized a rounding flips
# the step. The bound on the largest gap is about 2 such steps; the mean gap is what sees a shard stepped wrong.
TOL_BF16 = dict(loss=3e-5, grad_norm=3e-3, val_loss=4e-5, max=5e-3, mean=1e-4)
# the covering (python tests/test_matrix.py prints one), by world
CASES = [
    'data=ddp cp=2 cp_method=allgather ac=full',  # world 2, 2 blocks
    'data=ddp pp=2 impl=torch schedule=gpipe dtype=bfloat16 ac=full',  # world 2, 2 blocks
    'data=ddp pp=2 impl=torch schedule=interleaved_1f1b dtype=bfloat16',  # world 2, 4 blocks
    'data=ddp pp=2 schedule=interleaved_1f1b compile ac=full',  # world 2, 4 blocks
    'data=ddp pp=2 schedule=zero_bubble ac=every_n',  # world 2, 2 blocks
    'data=ddp tp=2 impl=torch dtype=bfloat16 ac=selective',  # world 2, 2 blocks
    'data=ddp tp=2 sp',  # world 2, 2 blocks
    'data=fsdp dp_replicate=2 compile ac=full',  # world 2, 2 blocks
    'data=fsdp dp_shard=2 impl=deepspeed ac=full',  # world 2, 2 blocks
    'data=fsdp pp=2 dtype=bfloat16 ac=selective',  # world 2, 2 blocks
    'data=fsdp pp=2 schedule=interleaved_1f1b ac=selective',  # world 2, 4 blocks
    'data=fsdp pp=2 schedule=zero_bubble compile ac=full',  # world 2, 2 blocks
    # beyond the pairs: torch's zero-bubble compiled (its B pass keeps the graph too; it crashed as ours did)
    'data=none pp=2 impl=torch schedule=zero_bubble compile',  # world 2, 2 blocks
    'data=none pp=2 compile ac=full',  # world 2, 2 blocks
    'data=none pp=2 impl=torch schedule=zero_bubble dtype=bfloat16',  # world 2, 2 blocks
    'data=none pp=2 schedule=gpipe compile ac=full',  # world 2, 2 blocks
    'data=none pp=2 schedule=interleaved_1f1b ac=every_n',  # world 2, 4 blocks
    'data=none tp=2 compile ac=selective',  # world 2, 2 blocks
    'data=none tp=2 dtype=bfloat16 compile',  # world 2, 2 blocks
    'data=none tp=2 sp ac=full',  # world 2, 2 blocks
    'data=none tp=2 sp compile ac=every_n',  # world 2, 2 blocks
    'data=zero1 cp=2 cp_method=allgather ac=selective',  # world 2, 2 blocks
    'data=zero1 cp=2 dtype=bfloat16 ac=every_n',  # world 2, 2 blocks
    'data=zero1 dp_shard=2 compile ac=full',  # world 2, 2 blocks
    'data=zero1 dp_shard=2 impl=deepspeed ac=every_n',  # world 2, 2 blocks
    'data=zero1 dp_shard=2 impl=deepspeed dtype=bfloat16',  # world 2, 2 blocks
    'data=zero2 dp_shard=2 impl=deepspeed ac=selective',  # world 2, 2 blocks
    'data=zero2 dp_shard=2 impl=torch compile ac=full',  # world 2, 2 blocks
    'data=ddp dp_shard=2 cp=2',  # world 4, 2 blocks
    'data=ddp dp_shard=2 tp=2',  # world 4, 2 blocks
    'data=ddp pp=2 cp=2',  # world 4, 2 blocks
    'data=ddp pp=2 dp_shard=2 schedule=interleaved_1f1b',  # world 4, 4 blocks
    'data=ddp pp=2 tp=2',  # world 4, 2 blocks
    'data=fsdp dp_replicate=2 cp=2',  # world 4, 2 blocks
    'data=fsdp dp_replicate=2 cp=2 cp_method=allgather ac=full',  # world 4, 2 blocks
    'data=fsdp dp_replicate=2 tp=2 impl=torch dtype=bfloat16 ac=every_n',  # world 4, 2 blocks
    'data=fsdp pp=2 cp=2 schedule=gpipe ac=selective',  # world 4, 2 blocks
    'data=fsdp pp=2 dp_replicate=2',  # world 4, 2 blocks
    'data=fsdp pp=2 dp_replicate=2 schedule=gpipe',  # world 4, 2 blocks
    'data=fsdp pp=2 dp_replicate=2 schedule=interleaved_1f1b',  # world 4, 4 blocks
    'data=fsdp pp=2 dp_replicate=2 schedule=zero_bubble',  # world 4, 2 blocks
    'data=none pp=2 tp=2 schedule=gpipe sp ac=selective',  # world 4, 2 blocks
    'data=none pp=2 tp=2 schedule=interleaved_1f1b',  # world 4, 4 blocks
    'data=none pp=2 tp=2 schedule=interleaved_1f1b sp',  # world 4, 4 blocks
    'data=none pp=2 tp=2 schedule=zero_bubble',  # world 4, 2 blocks
    'data=none pp=2 tp=2 sp',  # world 4, 2 blocks
    'data=zero1 cp=2 tp=2 cp_method=allgather',  # world 4, 2 blocks
    'data=zero1 dp_shard=4 impl=deepspeed',  # world 4, 2 blocks
    'data=zero1 pp=2 cp=2 schedule=gpipe cp_method=allgather',  # world 4, 2 blocks
    'data=zero1 pp=2 cp=2 schedule=interleaved_1f1b',  # world 4, 4 blocks
    'data=zero1 pp=2 dp_shard=2 impl=torch ac=full',  # world 4, 2 blocks
    'data=zero2 cp=2 tp=2 ac=full',  # world 4, 2 blocks
    'data=zero2 cp=2 tp=2 cp_method=allgather sp dtype=bfloat16',  # world 4, 2 blocks
    'data=zero2 pp=2 cp=2 cp_method=allgather ac=every_n',  # world 4, 2 blocks
    'data=zero2 pp=2 cp=2 schedule=interleaved_1f1b cp_method=allgather',  # world 4, 4 blocks
    'data=zero2 pp=2 dp_shard=2 schedule=gpipe ac=every_n',  # world 4, 2 blocks
    'data=ddp cp=4 tp=2',  # world 8, 2 blocks
    'data=fsdp dp_replicate=2 dp_shard=2 tp=2 impl=torch sp ac=selective',  # world 8, 2 blocks
    'data=none pp=4 tp=2 schedule=gpipe',  # world 8, 4 blocks
    'data=zero1 dp_shard=8 impl=deepspeed',  # world 8, 2 blocks
    'data=zero1 pp=2 cp=2 tp=2 schedule=zero_bubble sp',  # world 8, 2 blocks
    'data=zero2 pp=2 dp_shard=2 cp=2 schedule=zero_bubble cp_method=allgather',  # world 8, 2 blocks
]


def parse(spec):
    """'data=fsdp dp_shard=2 compile' -> the case's full dict (its world the product of its degrees)."""
    case = dict(DEFAULTS)
    for token in spec.split():
        key, _, value = token.partition("=")
        if key not in case:
            raise ValueError(f"{spec!r}: unknown factor {key!r}")
        case[key] = {"": True}.get(value, int(value) if key in DEGREES else value)
    case["world"] = 1
    for k in DEGREES:
        case["world"] *= case[k]
    return case


def spec(case):
    """The shortest spec that parses back to `case`."""
    return " ".join(["data=" + case["data"]] + [
        (k if v is True else f"{k}={v}") for k, v in case.items()
        if k not in ("world", "data", "n_layer") and v != DEFAULTS[k]])


def features(case):
    """The factor values a case stands for: each degree above 1 or not, the strategy and its knobs (the schedule
    where there is a pipeline, the method where there is context parallelism, sequence parallel where there is
    tensor parallelism), the dtype, compile, checkpointing."""
    f = {f"{k}>1": case[k] > 1 for k in DEGREES}
    f.update({k: case[k] for k in ("data", "impl", "dtype", "compile", "ac")})
    f["schedule"] = case["schedule"] if case["pp"] > 1 else None
    f["cp_method"] = case["cp_method"] if case["cp"] > 1 else None
    f["sp"] = case["sp"] if case["tp"] > 1 else None
    return {k: v for k, v in f.items() if v is not None}


def pairs(case):
    """What a case covers: every pair of its factor values (HSDP's replicas of one-rank shards, dp_replicate>1 with
    dp_shard>1 false, and of larger ones), and the world with its strategy, impl and each degree above 1
    (DeepSpeed at 4 ranks, FSDP at 8)."""
    f = sorted(features(case).items())
    out = set(itertools.combinations(f, 2))
    return out | {(("world", case["world"]), (k, v)) for k, v in f if k in ("data", "impl") or k.endswith(">1")}


def factorizations(world, k=len(DEGREES)):
    if k == 1:
        yield (world,)
        return
    for d in range(1, world + 1):
        if world % d == 0:
            yield from ((d, *rest) for rest in factorizations(world // d, k - 1))


@lru_cache(maxsize=None)
def shapes():
    """{n_layer: (the composed config, the GPTConfig the rule book reads)} for the matrix's model; the config's
    parallel and train groups as plain namespaces (the rule book reads them 136,000 times in an enumeration, and an
    OmegaConf attribute costs 20 us)."""
    from types import SimpleNamespace
    from omegaconf import OmegaConf
    import config
    from data import prepare
    out = {}
    for n_layer in (2, 4):
        cfg = make_cfg(*base(n_layer))
        plain = SimpleNamespace(**{k: SimpleNamespace(**OmegaConf.to_container(cfg[k], resolve=True))
                                   for k in ("parallel", "train")})
        out[n_layer] = plain, config.model_config(cfg, prepare.vocab_size(cfg.data))
    return out


def base(n_layer):
    """The matrix's model: test_llama's tiny Llama at d=32 (4 query heads of 8 on 2 key/value heads), 3 steps,
    without its q/k/v biases. The key bias's gradient is zero in exact arithmetic (q.b_k adds the same to every
    score of a query's row, and softmax ignores that), so what it gets is rounding, and AdamW's first steps turn
    any rounding into a step of about lr: the bias would differ from single's by 6e-4 under a layout that sums in
    another order (seen). test_llama.py proves the biases under the strategies that split or shard them."""
    return small_run(*LLAMA, "model.n_embd=32", "model.qkv_bias=false", f"model.n_layer={n_layer}")


def layout_of(case):
    from parallel.layout import Layout
    return Layout(case["world"], *(case[k] for k in DEGREES), data=case["data"], impl=case["impl"])


def problem(case, n_layer):
    """The rule book's line for a case on the n_layer-block model (parallel/layout.py Layout.problem), or None."""
    cfg, model = shapes()[n_layer]
    p = cfg.parallel
    p.pp_schedule, p.cp_method, p.sequence_parallel = case["schedule"], case["cp_method"], case["sp"]
    layout = layout_of(case)
    t = cfg.train
    return layout.problem(p, model, t.seq_len, t.global_batch_size, t.micro_batch_size, case["compile"],
                          case["dtype"], ac=case["ac"])


def n_layer(case):
    """2 blocks, or 4 where the rule book wants more (a pipeline of 4 stages, or interleaved); None: refused."""
    return next((n for n in (2, 4) if problem(case, n) is None), None)


@lru_cache(maxsize=None)
def rule_book():
    """(every case the rule book accepts at world 2, 4 and 8, with its n_layer; every refusal line met). The
    schedule, cp method and sequence parallel vary only where they mean something."""
    from parallel.layout import CP_METHODS, DATA_STRATEGIES, IMPLS, PP_SCHEDULES
    accepted, refusals = [], set()
    for world in (2, 4, 8):
        for degrees in factorizations(world):
            d = dict(zip(DEGREES, degrees))
            for data, impl, schedule, cp_method, sp, dtype, compile_ in itertools.product(
                    DATA_STRATEGIES, IMPLS, PP_SCHEDULES if d["pp"] > 1 else ("1f1b",),
                    CP_METHODS if d["cp"] > 1 else ("ring",), (False, True) if d["tp"] > 1 else (False,),
                    ("float32", "bfloat16"), (False, True)):
                for ac in AC_MODES:
                    case = dict(DEFAULTS, **d, world=world, data=data, impl=impl, schedule=schedule,
                                cp_method=cp_method, sp=sp, dtype=dtype, compile=compile_, ac=ac)
                    layers = n_layer(case)
                    if layers is None:
                        refusals.add(problem(case, 4))
                    else:
                        accepted.append(dict(case, n_layer=layers))
    return accepted, refusals


def graphs(case):
    """What decides the graphs a compiled case compiles (None: it compiles nothing): the dtype and the weights'
    (bf16 working copies or fp32), checkpointing, and tensor parallel's split of each block, with or without
    sequence parallel. The data strategy's hooks and the pipeline's stages sit outside the graphs."""
    if not case["compile"]:
        return None
    working = layout_of(case).working_dtype("auto", case["dtype"])
    return (case["dtype"], working, case["ac"], case["tp"] > 1, case["sp"])


def compile_cost(case, g, compiled):
    """A case's compile seconds, roughly: `g` its graphs(case), `compiled` the graphs compiled already."""
    if g is None:
        return 0.0
    if case["world"] > 2:
        return COMPILE_COST["world>2"]
    if case["pp"] > 1 and case["schedule"] == "zero_bubble":
        return COMPILE_COST["zero_bubble"]
    return COMPILE_COST["cached" if g in compiled else "fresh"]


def covering(accepted, have=()):
    """Cases that cover every pair `accepted` covers, beyond those of `have`: greedily, the most new pairs per
    second of launch, then without the cases the others make redundant, dearest first."""
    left = set().union(*map(pairs, accepted)) - set().union(set(), *map(pairs, have))
    base = [COST[c["world"]] * (1 + c["n_layer"] / 4) for c in accepted]
    covers, sets = [pairs(c) for c in accepted], [graphs(c) for c in accepted]
    chosen, need, compiled = [], set(left), {graphs(c) for c in have}
    while left:
        i = max(range(len(accepted)),
                key=lambda i: len(covers[i] & left) / (base[i] + compile_cost(accepted[i], sets[i], compiled)))
        chosen.append(i)
        compiled.add(sets[i])
        left -= covers[i]
    for i in sorted(chosen, key=lambda i: -(base[i] + compile_cost(accepted[i], sets[i], set()))):
        if need <= set().union(*(covers[j] for j in chosen if j != i)):
            chosen.remove(i)
    return [accepted[i] for i in chosen]


def overrides(case):
    """train.py's settings for a case."""
    p = [f"parallel.{k}={case[k]}" for k in (*DEGREES, "data", "impl", "cp_method")]
    return base(n_layer(case)) + [*p, f"parallel.pp_schedule={case['schedule']}",
                                  f"parallel.sequence_parallel={str(case['sp']).lower()}",
                                  f"train.dtype={case['dtype']}", f"train.compile={str(case['compile']).lower()}",
                                  f"train.activation_checkpointing={case['ac']}"]


def case_id(case):
    return spec(case).replace(" ", ",")


def here(s):
    """A case as this CPU runs it: on one that can't compute in bf16 (conftest.BF16), a bf16 case runs in float32,
    so the pairs of its other factors are still proven there (the dtype's alone are not)."""
    return s if BF16 else s.replace(" dtype=bfloat16", "")


RUN_CASES = list(dict.fromkeys(map(here, CASES)))


def register(world):
    @launch_jobs(world)
    def jobs(root, request):
        return {s: (str(root / case_id(parse(s))), overrides(parse(s))) for s in RUN_CASES
                if parse(s)["world"] == world}
    return jobs


jobs2, jobs4, jobs8 = register(2), register(4), register(8)


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """parallel=single's runs, in this process, by (n_layer, dtype): made when a case first asks."""
    dirs = {}

    def get(n_layer, dtype):
        if (n_layer, dtype) not in dirs:
            dirs[n_layer, dtype] = str(tmp_path_factory.mktemp(f"single_{n_layer}_{dtype}") / "run")
            train.run(make_cfg(*base(n_layer), f"train.dtype={dtype}"), dirs[n_layer, dtype])
        return dirs[n_layer, dtype]
    return get


def check(launch, singles, case):
    """The case's run is the layout it names, and equal to single's on its model and dtype."""
    c = parse(case)
    run_dir = launch[__name__][0][case]
    start = read_metrics(run_dir)[0]
    assert start["world_size"] == c["world"] and len(losses(run_dir)) == STEPS, start
    assert {k: start[k] for k in (*DEGREES, "data", "impl")} == {k: c[k] for k in (*DEGREES, "data", "impl")}
    ref = singles(n_layer(c), c["dtype"])
    tol = TOL_BF16 if c["dtype"] == "bfloat16" else TOL
    gaps = {k: float(((losses(run_dir, k) - losses(ref, k)).abs() / losses(ref, k)).max())
            for k in ("loss", "grad_norm", "val_loss")}
    got, want = final_weights(run_dir), final_weights(ref)
    assert got.keys() == want.keys()
    diffs = {k: (got[k] - want[k]).abs() for k in want}
    gaps["weights max"] = max(float(d.max()) for d in diffs.values())
    gaps["weights mean"] = max(float(d.mean()) for d in diffs.values())
    print(f"{case}: largest gaps to single " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    assert_same_steps(run_dir, ref, rtol=tol)
    for k, d in diffs.items():
        assert float(d.max()) <= tol["max"] and float(d.mean()) <= tol["mean"], (k, float(d.max()), float(d.mean()))


def of_world(world):
    these = [s for s in RUN_CASES if parse(s)["world"] == world]
    return pytest.mark.parametrize("case", these, ids=[case_id(parse(s)) for s in these])


@of_world(2)
def test_world2_equal_to_single(launch2, singles, case):
    check(launch2, singles, case)


@of_world(4)
def test_world4_equal_to_single(launch4, singles, case):
    check(launch4, singles, case)


@of_world(8)
def test_world8_equal_to_single(launch8, singles, case):
    check(launch8, singles, case)


def test_cases_cover_the_rule_book():
    """Every case is a run the rule book accepts, and together they combine every pair of factor values that some
    accepted run combines: a layout the rule book accepts that the matrix doesn't prove is a failure naming it."""
    accepted, _ = rule_book()
    cases = [parse(s) for s in CASES]
    refused = [s for s, c in zip(CASES, cases) if n_layer(c) is None]
    assert not refused, f"the rule book refuses these cases: {refused}"
    have = [dict(c, n_layer=n_layer(c)) for c in cases]
    missing = set().union(*map(pairs, accepted)) - set().union(*map(pairs, have))
    if missing:
        add = covering(accepted, have)
        pytest.fail(f"{len(missing)} pairs of factor values the rule book accepts are in no case, e.g. "
                    f"{sorted(missing, key=str)[:3]}; add to CASES: {[spec(c) for c in add]}")


@pytest.mark.quick
def test_selective_checkpointing_refused_under_zero_bubble(tmp_path):
    """Zero-bubble's B and W passes backward through each block twice; torch's selective checkpointing allows
    one ("Trying to backward an extra time", seen on the last stage before this rule)."""
    from conftest import assert_refused
    assert_refused(tmp_path, ["parallel=pp", "parallel.pp_schedule=zero_bubble",
                              "train.activation_checkpointing=selective"], 2,
                   "train.activation_checkpointing=selective with parallel.pp_schedule=zero_bubble")


def test_refusals_are_one_line():
    """Every line the rule book refuses a run of the enumeration with is one line that names a setting."""
    _, refusals = rule_book()
    assert len(refusals) > 20, len(refusals)  # the enumeration meets most of the rule book's rules
    for line in refusals:
        assert "\n" not in line and re.search(r"\b(parallel|train|model)[.=]\w+", line), line


def main():
    """Print a covering of the rule book (the cases CASES would hold), with the launch seconds it would take."""
    accepted, _ = rule_book()
    chosen = sorted(covering(accepted), key=lambda c: (c["world"], spec(c)))
    for c in chosen:
        print(f"    {spec(c)!r},  # world {c['world']}, {c['n_layer']} blocks")
    fresh = {graphs(c) for c in chosen} - {None}
    print(f"{len(chosen)} cases for {len(accepted)} accepted runs: {sum(COST[c['world']] for c in chosen):.0f} s of "
          f"launch, roughly; {sum(c['compile'] for c in chosen)} compiled, {len(fresh)} sets of graphs",
          file=sys.stderr)


if __name__ == "__main__":
    main()
