"""Llama-shaped models (model.py: grouped-query attention, SwiGLU, q/k/v biases, a tied embedding) under the
strategies that split or shard the biases (FSDP and TP under selective checkpointing that keeps every other
matmul), and a tied embedding under ddp and zero2 (every other layout on a Llama without biases:
tests/test_matrix.py), each equal to parallel=single step for step (loss, grad_norm) and in its
final weights; the context parallel ring's bytes with only the key/value heads; the layouts that refuse a tied
embedding, in one line; the presets' shapes. The runs join the session's shared world-2 and world-4 launches
(conftest.launch_jobs)."""
import pytest
import torch

import train
from conftest import assert_refused, assert_same_steps, assert_same_weights, launch_jobs, losses, make_cfg, \
    read_metrics, small_run

STEPS = 3
# a tiny Llama: 4 query heads sharing 2 key/value heads (GQA), SwiGLU of 128, biases on q, k, v (Qwen2), Llama 3's
# theta and epsilon; 3 steps of global batch 16 in micro-batches of 2, as the quick tier's
LLAMA = ("model.n_head=4", "model.n_kv_head=2", "model.mlp=swiglu", "model.ffn_hidden=128", "model.qkv_bias=true",
         "model.rope_theta=500000.0", "model.norm_eps=1e-5", "train.global_batch_size=16", "train.micro_batch_size=2",
         f"train.max_steps={STEPS}", "train.eval_every=100", "train.log_every=1")
TIED = ("model.tie_embeddings=true",)
SP = ("parallel.sequence_parallel=true",)
# selective checkpointing that keeps every other matmul's output (train.selective_matmuls=alternate): its count of a
# block's matmuls (q/k/v's with a bias an addmm) must pick the same ones in forward and in recomputation under
# tensor parallel's split and FSDP's hooks, and still train as single does
ALTERNATE = ("train.activation_checkpointing=selective", "train.selective_matmuls=alternate")
# name: (world, overrides). The layouts without biases or a tied embedding, torch's twins, compile, checkpointing
# and bf16 are tests/test_matrix.py's (its Llama has no q/k/v biases); these are the strategies that split or shard
# the biases (FSDP's units, tp's head-wise split, the pipeline's stages, both at once), and the tied embedding where
# every rank holds the whole model. Each joins its world's one shared launch
LAYOUTS = {
    "fsdp": (2, ["parallel=fsdp", *ALTERNATE]),
    "tp_sp": (2, ["parallel=tp", *SP, *ALTERNATE]),
    "cp_ring": (2, ["parallel=cp"]), "cp_allgather": (2, ["parallel=cp", "parallel.cp_method=allgather"]),
    "pp": (2, ["parallel=pp"]),
    "fsdp_tp": (4, ["parallel=fsdp", "parallel.tp=2", *SP]),
    "ddp_tied": (2, ["parallel=ddp", *TIED]), "zero2_tied": (2, ["parallel=zero2", *TIED]),
}
# final weights: tensor parallel sums input gradients in another order than one process, and Adam magnifies that
# rounding where gradients are tiny (as in tests/test_tp.py)
ATOL = {"tp_sp": 1e-5, "fsdp_tp": 1e-5}


def overrides(name):
    return small_run(*LLAMA, *LAYOUTS[name][1])


def register(world):
    @launch_jobs(world)
    def jobs(root, request):
        return {name: (str(root / name), overrides(name)) for name, (w, _) in LAYOUTS.items() if w == world}
    return jobs


jobs2, jobs4 = register(2), register(4)


@pytest.fixture(scope="module")
def llama_single(tmp_path_factory):
    """The references, in this process: untied and tied."""
    dirs = {}
    for key, extra in (("untied", ()), ("tied", TIED)):
        dirs[key] = str(tmp_path_factory.mktemp(f"llama_single_{key}") / "run")
        train.run(make_cfg(*small_run(*LLAMA, *extra)), dirs[key])
    return dirs


def check_equal(launch, llama_single, name):
    run_dir = launch[__name__][0][name]
    ref = llama_single["tied" if name.endswith("_tied") else "untied"]
    start = read_metrics(run_dir)[0]
    assert start["world_size"] == LAYOUTS[name][0] and len(losses(run_dir)) == STEPS
    assert_same_steps(run_dir, ref)
    assert_same_weights(run_dir, ref, atol=ATOL.get(name, 1e-6))
    got, want = losses(run_dir, "grad_norm"), losses(ref, "grad_norm")
    print(f"{name}: largest grad_norm gap to single {float(((got - want).abs() / want).max()):.1e} relative")


@pytest.mark.parametrize("name", [n for n, (w, _) in LAYOUTS.items() if w == 2])
def test_equal_to_single(launch2, llama_single, name):
    check_equal(launch2, llama_single, name)


@pytest.mark.parametrize("name", [n for n, (w, _) in LAYOUTS.items() if w == 4])
def test_equal_to_single_world4(launch4, llama_single, name):
    check_equal(launch4, llama_single, name)


@pytest.mark.parametrize("name", ["cp_ring", "cp_allgather"])
def test_cp_passes_only_kv_heads(launch2, name):
    """The ring (and the all-gather) move K and V with their n_kv_head = 2 heads: half the bytes of the 4 heads'
    multi-head attention, counted by parallel/comm.py, and equal to the planner's."""
    from tools import plan
    run_dir = launch2[__name__][0][name]
    first, last = read_metrics(run_dir)[0], read_metrics(run_dir)[-1]
    micro, L, cp, head_dim, kv_heads = first["grad_accum"], 2, 2, 64 // 4, 2
    kv = 2 * 2 * (64 // cp) * kv_heads * head_dim * 4  # K and V: micro-batch 2 x own tokens x kv heads x fp32
    if name == "cp_ring":  # each hop a send and a receive: forward K, V; backward K, V and dK, dV
        expected = {"comm_cp_p2p": micro * L * 2 * (cp - 1) * (kv + 2 * kv)}
    else:
        expected = {"comm_cp_all_gather": micro * L * cp * kv, "comm_cp_reduce_scatter": micro * L * cp * kv}
    assert {k: v for k, v in last.items() if k.startswith("comm_cp_")} == expected
    for (dim, kind), v in plan.predict_run(run_dir)["comm"].items():
        assert last[f"comm_{dim}_{kind}"] == pytest.approx(v, rel=0.02), (dim, kind)


# --- refusals, one line each, before any work
@pytest.mark.quick
@pytest.mark.parametrize("extra,world,message", [
    (["parallel=tp", "parallel.tp=4"], 4, "parallel.tp=4 must divide the model's 2 key/value heads (model.n_kv_head)"),
    (["parallel=tp", "model.ffn_hidden=129"], 2, "parallel.tp=2 must divide the model's 129 MLP hidden units"),
    (["parallel=fsdp", *TIED], 2, "model.tie_embeddings=true: FSDP gathers the embedding and the head in two units"),
    (["parallel=pp", *TIED], 2, "model.tie_embeddings=true: parallel.pp=2 puts the embedding on the first pipeline"),
    (["parallel=tp", *TIED], 2, "model.tie_embeddings=true: parallel.tp=2 splits the embedding"),
    (["parallel=zero2", "parallel.impl=torch", *TIED], 2, "torch's ZeRO-2 twin (FSDP2) shards the embedding"),
    (["model.n_kv_head=3"], 1, "model.n_kv_head=3 must divide model.n_head=4"),
    (["model.mlp=relu"], 1, "model.mlp='relu': expected gelu or swiglu"),
    (["model.norm_eps=0"], 1, "model.norm_eps=0 must be positive"),
])
def test_bad_settings(tmp_path, extra, world, message):
    assert_refused(tmp_path, [*LLAMA, *extra], world, message)


@pytest.mark.quick
@pytest.mark.parametrize("name,billions,vocab", [("llama3_1b", 1.236, 128256), ("llama3_8b", 8.030, 128256),
                                                 ("llama3_70b", 70.554, 128256), ("qwen2_0p5b", 0.494, 151936)])
def test_presets_on_meta(name, billions, vocab):
    """The presets' parameter counts are their Hugging Face models' (the tied ones count the embedding once)."""
    import config
    from model import GPT
    cfg = make_cfg(f"model={name}")
    config.validate(cfg)
    with torch.device("meta"):
        model = GPT(config.model_config(cfg, 4096))
    assert model.cfg.padded_vocab_size == vocab and round(model.num_params() / 1e9, 3) == billions
