"""DeepSpeed's ZeRO, the paper's own implementation, as the third twin of ZeRO-1, ZeRO-2 and ZeRO-3 (our zero1 /
zero2 in parallel/zero.py, our fsdp in parallel/fsdp.py): `parallel.impl=deepspeed`.

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; DeepSpeed
(github.com/deepspeedai/DeepSpeed) `runtime/zero/stage_1_and_2.py` and `stage3.py`. Our GPT, our data, our init
(materialized from the meta model before DeepSpeed sees it) and our AdamW: the optimizer train.py builds, with its
two weight-decay groups, betas and eps, is DeepSpeed's "client optimizer", stepped over the flat fp32 partitions
DeepSpeed makes of each group. The training loop is the same as for every other strategy: `loss.backward()` (which
DeepSpeed 0.19 accepts in place of `engine.backward`), our clipping over the shards, then the step.

What DeepSpeed keeps that ours does not: an fp32 master partition even in fp32. Its optimizer steps a separate
flat copy of this rank's slice of the weights ("single_partition_of_fp32_groups"; ZeRO-3 "fp32_partitioned_groups_
flat") and copies the result back into the working ("bit16") weights. Per rank, in fp32 (tests/test_data_parallel.py
measures it from its own tensors, `state_tensors`):
  kept across steps       ZeRO-1 and -2: 4P weights + 4P/N master + 8P/N moments = 4P + 12P/N
                          ZeRO-3: 4P/N weights + 4P/N master + 8P/N moments = 16P/N
  gradients, freed by its step (`transient_bytes`, what it holds at the step): 4P/N, this rank's partition. ZeRO-1
    holds full gradients (4P) through backward until the boundary's reduction.
So at its peak ZeRO-1 holds 8P + 12P/N (ours 8P + 8P/N), ZeRO-2 4P + 16P/N (ours 4P + 12P/N), ZeRO-3 20P/N (ours
16P/N), plus its reduce buckets (reduce_bucket_size, the MiB of our parallel.bucket_mb).

Communication per step with accumulation A, float32, measured (Psi = 4P bytes): ZeRO-1 3 Psi, an all-reduce of the
full gradients at the boundary and an all-gather of the weights (ours 2 Psi: a reduce-scatter instead); ZeRO-2
(2A + 1) Psi, because it all-reduces each bucket at every micro-step and keeps its partition (ours 2 Psi, or A + 1
with parallel.accumulate=sharded); ZeRO-3 3A Psi, gathering the weights in forward and again in backward of every
micro-step and reduce-scattering every micro-step (ours 2A + 1).

Accumulation: train.py's `no_sync()` for every micro-step but the last tells DeepSpeed it is not at an accumulation
boundary (`set_gradient_accumulation_boundary(False)`); the last one is. DeepSpeed's own gradient_accumulation_steps
stays 1, because train.py already divides each micro-batch's loss by the accumulation (DeepSpeed would divide again).

On CPU DeepSpeed's accelerator is "cpu" (DS_ACCELERATOR, set here before the import unless the caller set it), whose
communication backend JIT-builds a shared-memory all-reduce op (deepspeed_shm_comm, minutes of C++ compilation on
first use). Only DeepSpeed's inference all-reduce uses it; ZeRO's collectives are torch.distributed's. So we mark
it unavailable before DeepSpeed starts its backend, and nothing is compiled.
"""
import contextlib
import os
import types

import torch.distributed as dist

from parallel.strategy import DataParallel

INSTALL = "pip install deepspeed==0.19.8"


def import_deepspeed(device_type):
    """deepspeed, imported for `device_type` (cpu or cuda), without its shared-memory op's JIT build."""
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as e:
        from config import ConfigError  # (config imports parallel/: late)
        raise ConfigError(f"parallel.impl=deepspeed needs DeepSpeed ({e}); install it: {INSTALL}") from None
    # the probe of every op builder runs compilers; we need only one answer, and "no" to it
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    return deepspeed


def ds_config(p, stage):
    """DeepSpeed's config for ZeRO-`stage` in float32, with its knobs set to our strategies' equivalents."""
    bucket = int(p.bucket_mb * 2 ** 20 / 4)  # DeepSpeed counts bucket sizes in elements
    return {
        "train_micro_batch_size_per_gpu": 1,  # only for its own logging: train.py feeds the batches
        "gradient_accumulation_steps": 1,  # train.py scales each micro-batch's loss itself
        "gradient_clipping": 0.0,  # train.py clips, over the gradient partitions (grad_pieces)
        "zero_allow_untested_optimizer": True,  # torch's AdamW, ours, rather than DeepSpeed's fused ones
        # its defaults otherwise (contiguous gradients; overlap_comm for stage 3 only), as a user would run it
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
            # every parameter partitioned, as in our FSDP (its default keeps those under 1e5 elements whole on
            # every rank: here, all of a tiny model's norm gains and more)
            "stage3_param_persistence_threshold": 0,
        },
        "steps_per_print": 2 ** 31, "wall_clock_breakdown": False,
    }


class DeepSpeedZero(DataParallel):
    """DeepSpeed's engine behind our interface: the loop calls the engine and steps its ZeRO optimizer."""
    grads_sharded = True

    def __init__(self, engine, stage):
        self.engine, self.stage = engine, stage
        self.model, self.module = engine, engine.module
        self.zero = engine.optimizer  # DeepSpeedZeroOptimizer (stage 1/2) or DeepSpeedZeroOptimizer_Stage3
        self.local_optimizer = self.zero.optimizer  # the torch AdamW over the fp32 partitions
        self.optimizer = self
        self.transient_bytes = 0
        self.fragments = {p: self._fragment(p) for p in self.module.parameters()}

    def _fragment(self, p):
        """(this rank's piece of p in DeepSpeed's fp32 master partition, where it starts in the flattened p), or
        None where this rank holds none of p."""
        if self.stage < 3:  # DeepSpeed links each parameter to its piece of the partition (utils/tensor_fragment.py)
            m = p._hp_mapping
            return None if m is None else (m.hp_fragment, m.lp_fragment_address.start)
        group, at, n = self.zero.grad_position[self.zero.get_param_id(p)]
        start = dist.get_rank(self.zero.dp_process_group) * p.ds_tensor.ds_numel  # even partitions of every p
        n = min(n, p.ds_numel - start)  # the last partitions are padding past the end of p
        return None if n <= 0 else (self.zero.fp32_partitioned_groups_flat[group].narrow(0, at, n), start)

    @property
    def param_groups(self):  # the client optimizer's groups: train.py sets lr in them every step
        return self.local_optimizer.param_groups

    @contextlib.contextmanager
    def no_sync(self):
        self.engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(True)

    def _grads(self):
        # after the boundary's backward: this rank's reduced gradient partition, the tensors DeepSpeed's step reads
        return [g for _, gs in sorted(self.zero.averaged_gradients.items()) for g in
                (gs if isinstance(gs, list) else [gs]) if g is not None]

    def grad_pieces(self):
        return [("", g) for g in self._grads()]

    def step(self):
        # the gradients DeepSpeed holds at the step, which frees them: this rank's partition (ZeRO-1 has already
        # freed the rest of its full gradients, once the boundary's backward reduced them)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in
                self._grads() + [p.grad for p in self.module.parameters() if p.grad is not None]}
        self.transient_bytes = max(self.transient_bytes, sum(held.values()))
        self.engine.step()

    def zero_grad(self, set_to_none=True):
        self.zero.zero_grad(set_to_none=set_to_none)

    def holders(self, p):
        # weights and optimizer state both from the fp32 master partition: ranges of the flattened parameter
        piece = self.fragments[p]
        return ([piece], [piece]) if piece is not None else ([], [])

    def shape(self, p):
        return tuple(p.ds_shape) if self.stage == 3 else tuple(p.shape)  # ZeRO-3: p is empty between gathers

    def optimizer_state(self):
        """{master piece: {exp_avg: its piece of the moment, ..., step}}: views of DeepSpeed's flat AdamW state."""
        out = {}
        for piece in filter(None, self.fragments.values()):
            master, _ = piece
            # the state's key: the flat partition the piece is a view of (stage 3 swaps it into param_groups only
            # for the step)
            flat = next(t for t in self.local_optimizer.state
                        if t.untyped_storage().data_ptr() == master.untyped_storage().data_ptr())
            offset = master.storage_offset() - flat.storage_offset()
            out[master] = {k: v.narrow(0, offset, master.numel()) if v.dim() else v
                           for k, v in self.local_optimizer.state.get(flat, {}).items()}
        return out

    def state_tensors(self):
        # what DeepSpeed keeps across steps: working weights (flat, whole in stages 1 and 2, a partition in 3: ZeRO-3's
        # parameters themselves are empty), and the fp32 master partition the optimizer steps (its moments are the
        # optimizer's state). Counted by storage, so what the parameters and param_groups also point at counts once
        z = self.zero
        if self.stage < 3:
            return [*z.bit16_groups_flat, *z.single_partition_of_fp32_groups]
        return [*z.fp16_partitioned_groups_flat, *z.fp32_partitioned_groups_flat]


def apply_deepspeed(model, mesh, p, make_optimizer, stage):
    """DeepSpeed's ZeRO-`stage` over the mesh's dp group, stepping the optimizer make_optimizer builds."""
    device = next(model.parameters()).device
    deepspeed = import_deepspeed(device.type)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    mpu = types.SimpleNamespace(  # DeepSpeed's "model parallel unit": its groups, taken from our mesh
        get_data_parallel_group=lambda: dp, get_data_parallel_world_size=lambda: dist.get_world_size(dp),
        get_data_parallel_rank=lambda: dist.get_rank(dp), get_model_parallel_group=lambda: tp,
        get_model_parallel_world_size=lambda: dist.get_world_size(tp),
        get_model_parallel_rank=lambda: dist.get_rank(tp))
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=ds_config(p, stage),
                                      mpu=mpu, dist_init_required=False)
    return DeepSpeedZero(engine, stage)
