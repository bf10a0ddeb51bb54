"""Tensor parallelism from scratch (Megatron-LM), with sequence parallelism and a vocab-parallel loss.

Shoeybi et al., 2019, "Megatron-LM"; Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models" (sequence parallelism). `tp` ranks share every layer: each holds 1/tp of every matrix.

  attention   the fused qkv column-parallel: its rows are grouped by key/value head (model.py), so each rank gets
              whole groups, n_kv_head / tp key/value heads with the query heads that read them (grouped-query
              attention: tp must divide n_kv_head, refused in one line otherwise; no key/value head is
              replicated); proj row-parallel
  MLP         up (and SwiGLU's gate) column-parallel (a slice of the hidden units), down row-parallel
  embedding   vocab-parallel: rank r holds rows [r V/tp, (r+1) V/tp); a lookup outside them gives zeros, and the
              all-reduce of the partial results is the full embedding
  head + loss column-parallel over the vocab; the cross-entropy is computed from the local logits with three
              reductions of per-token numbers (row max, sum of exps, target logit), never the full logits
  norm gains  replicated on every rank (they are tiny)
  MoE block   (model.py's MoE) the shared experts split as the MLP; the router and the routed experts whole on every
              rank, which all route the same tokens: nothing to reduce after them (and under parallel/ep.py each tp
              rank runs its own all-to-all with the ep peers of its tp coordinate)

A column-parallel layer followed by a row-parallel one needs its input replicated and leaves partial sums:
Megatron's two conjugate operators make that exact with one all-reduce each way per pair:
  f: identity in forward, all-reduce of the input gradient in backward   (before the column-parallel layers)
  g: all-reduce in forward, identity in backward                          (after the row-parallel layer)
so every transformer layer costs 2 all-reduces of a (batch, seq, d) activation in forward and 2 in backward. The
fused qkv's one matmul has one f (a hook on the attention module's input), as SwiGLU's gate and up share the MLP's.

Sequence parallel (`sequence_parallel=true`): between the layers the activations are split along the sequence, so
the norms and residual adds work on T/tp positions and store 1/tp of those activations. f becomes an all-gather
along the sequence (reduce-scatter in backward) and g a reduce-scatter (all-gather in backward): each all-reduce
becomes an all-gather plus a reduce-scatter, the same volume. The norm gains then see only their rank's positions,
so their gradients are summed over the tp ranks once per step (`sync_replicated_grads`).

Per rank, parameters are (every matrix and the q, k, v biases) / tp + (2L + 1) d (the norm gains): the model state
shrinks by tp. A tied embedding is refused beside tp (parallel/layout.py): the vocab-parallel embedding and the head
would each hold the one weight.

Applied to a model built on the meta device: `shard` swaps each parameter for a meta tensor of its local shape and
returns the init function that fills a local shard by initializing the full parameter and keeping its slice, so
every rank draws exactly the numbers parallel=single draws. model.py is untouched except that its loss is a method
this file can replace. A pipeline stage (parallel/pp.py) is sharded the same way: the vocab-parallel embedding
where the stage has the embedding (the first), the vocab-parallel loss where it has the head (the last).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import MoE
from parallel import comm
from parallel.strategy import TensorParallel, materialize

# an MoE block's shared experts (model.py's MoE.shared, an MLP) split as the dense MLP; its router and routed experts
# stay whole on every tp rank
COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.gate.weight", "mlp.up.weight", "shared.gate.weight",
          "shared.up.weight", "head.weight", "wte.weight")
ROW = ("attn.proj.weight", "mlp.down.weight", "shared.down.weight")


def shard_dim(name):
    """The dimension a parameter is split along over the tp ranks: 0 (output rows), 1 (input columns) or None."""
    return 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None


# --- the collectives, as autograd functions
def _gather_seq(x, group):
    """(B, T/tp, ...) from every rank -> (B, T, ...), rank r's piece at positions [r T/tp, (r+1) T/tp)."""
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()  # all_gather_single concatenates along dim 0
    out = torch.empty((n * local.size(0),) + local.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather_single(out, local, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x, group):
    """(B, T, ...) partial sums on every rank -> (B, T/tp, ...): rank r gets the sum of positions [r T/tp, ...)."""
    n = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()
    out = torch.empty((full.size(0) // n,) + full.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_single(out, full, group=group)
    return out.transpose(0, 1).contiguous()


def _all_reduce(x, group):
    x = x.clone(memory_format=torch.contiguous_format)  # not in place: autograd may have saved x
    dist.all_reduce(x, group=group)
    return x


class Copy(torch.autograd.Function):
    """Megatron's f: the input is already replicated; each rank's gradient w.r.t. it is partial, so sum them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class Reduce(torch.autograd.Function):
    """Megatron's g: sum the partial outputs of a row-parallel layer; the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSeq(torch.autograd.Function):
    """Sequence parallel's f: all-gather the sequence shards; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ScatterSeq(torch.autograd.Function):
    """Sequence parallel's g: reduce-scatter the partial sums along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (N, V/tp) local logits whose vocab slice starts at `lo`, with targets (N,) in the full
    vocab. loss_i = log sum_v exp(z_iv - m_i) - (z_i,t_i - m_i), with m_i the row max: one all-reduce (max) of N
    numbers, one (sum) of 2N: the sums of exps and the target logit, which only the rank holding it contributes.
    The gradient, softmax - onehot(target), is computed from local pieces only."""

    @staticmethod
    def forward(ctx, logits, targets, lo, group):
        m = logits.detach().max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - m[:, None]).exp()
        local = targets - lo
        mine = (local >= 0) & (local < logits.size(-1))
        local = local.clamp(0, logits.size(-1) - 1)
        target_logit = (logits.gather(1, local[:, None]).squeeze(1) - m) * mine
        stats = torch.stack([exp.sum(-1), target_logit])
        dist.all_reduce(stats, group=group)
        loss = stats[0].log() - stats[1]
        ctx.save_for_backward(exp.div_(stats[0][:, None]), local, mine)  # exp becomes the local softmax
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.size(0), device=g.device), local] -= mine.to(g.dtype)
        return g.mul_(grad / g.size(0)), None, None, None


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V/tp) of the embedding. Ids outside them look up zeros; summing over ranks (all-reduce, or
    reduce-scatter along the sequence under sequence parallelism) gives every id its row."""

    def __init__(self, weight, lo, group, sequence_parallel):
        super().__init__()
        self.weight, self.lo, self.group, self.sp = weight, lo, group, sequence_parallel

    def forward(self, idx):
        outside = (idx < self.lo) | (idx >= self.lo + self.weight.size(0))
        out = F.embedding((idx - self.lo).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return ScatterSeq.apply(out, self.group) if self.sp else Reduce.apply(out, self.group)


# --- sharding the model
def shard(model, group, sequence_parallel=False):
    """Split `model` (a GPT on the meta device) over the ranks of `group`, in place: local parameter shapes, the
    f/g operators as module hooks, the vocab-parallel embedding and loss. Returns init_param(name, tensor), which
    fills a local shard with exactly this rank's slice of what parallel=single would initialize."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    enter, leave = (GatherSeq, ScatterSeq) if sequence_parallel else (Copy, Reduce)

    for name, p in list(model.named_parameters()):
        d = shard_dim(name)
        if d is None:
            continue
        path, leaf = name.rsplit(".", 1)
        module = model.get_submodule(path)
        shape = list(p.shape)
        shape[d] //= n
        setattr(module, leaf, nn.Parameter(torch.empty(shape, device=p.device, dtype=p.dtype)))
        if isinstance(module, nn.Linear) and leaf == "weight":
            module.out_features, module.in_features = shape
    vocab_lo = r * model.cfg.padded_vocab_size // n  # this rank's first row of the embedding and the head
    if model.wte is not None:  # a pipeline stage has the embedding only if it is the first (parallel/pp.py)
        model.wte = VocabParallelEmbedding(model.wte.weight, vocab_lo, group, sequence_parallel)

    # one f before each column-parallel group (attention: qkv; MLP: up and gate; head) and one g after each row-parallel
    # layer; positional args only, as model.py calls them
    for block in model.blocks:
        # an MoE block: f and g around its shared experts only; its router and routed experts run whole on every
        # rank's (identical) tokens, so their output is complete as it is (and their gradients equal on every rank)
        mlp = block.mlp.shared if isinstance(block.mlp, MoE) else block.mlp
        for m in (block.attn, mlp) if mlp is not None else (block.attn,):
            m.register_forward_pre_hook(lambda m, args: (enter.apply(args[0], group),) + args[1:])
            m.register_forward_hook(lambda m, args, out: leave.apply(out, group))
    if model.head is not None:  # and the head and loss only if it is the last
        model.head.register_forward_pre_hook(lambda m, args: (enter.apply(args[0], group),))

        def loss(logits, targets):
            return VocabParallelCrossEntropy.apply(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                                   vocab_lo, group)
        put_loss(model, loss)
    if model.wte is not None and model.head is not None:
        # called without targets (sampling), the whole model returns the full logits: gather the vocab slices. A
        # pipeline stage is called without targets for every activation it passes on, and no stage sees both the
        # prompt and the logits: Pipeline.generate pads the prompt and gathers the logits itself
        model.register_forward_hook(lambda m, args, kwargs, out: out if has_targets(args, kwargs) else
                                    gather_vocab(out, group), with_kwargs=True)
        if sequence_parallel:
            pad_sequence_for_sampling(model, n)

    def init_param(name, local):
        full = torch.empty(full_shapes[name], dtype=local.dtype, device=local.device)
        model.init_param(name, full)
        d = shard_dim(name)
        local.copy_(full if d is None else full.chunk(n, dim=d)[r])
    return init_param


def pad_sequence_for_sampling(model, tp):
    """Sequence parallel splits every sequence tp ways, and training lengths are checked to divide; sampling feeds
    any length. Pad those on the right to a multiple of tp and drop the padding's logits: attention is causal, so
    no real position ever sees the padding. (Registered after any hook that gathers the logits.)"""
    lengths = []

    def pad(m, args, kwargs):
        idx = args[0]
        lengths.append(idx.size(1))
        if idx.size(1) % tp == 0 or has_targets(args, kwargs):
            return None
        return (F.pad(idx, (0, -idx.size(1) % tp)),) + args[1:], kwargs

    def trim(m, args, kwargs, out):
        length = lengths.pop()
        return out if has_targets(args, kwargs) else out[:, :length]
    model.register_forward_pre_hook(pad, with_kwargs=True)
    model.register_forward_hook(trim, with_kwargs=True)


def put_loss(model, loss):
    """`loss` over this rank's logits in the model's place (model.GPT.loss), and the head before it where the model
    fuses the two (GPT.head_loss: the fused loss would compute over this rank's vocabulary slice alone)."""
    model.loss = loss
    model.head_loss = lambda h, targets: loss(model.head(h), targets)


def has_targets(args, kwargs):
    return (len(args) > 1 and args[1] is not None) or kwargs.get("targets") is not None


def gather_vocab(x, group):
    """(..., V/tp) logits on every tp rank -> (..., V), the ranks' slices in order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def sync_replicated_grads(pieces, group):
    """Sequence parallel: sum the norm gains' gradients (each rank saw only its positions) over the tp ranks, in
    one all-reduce. `pieces`: the gradient tensors (or FSDP shard segments of them) of the replicated parameters."""
    pieces = [g for g in pieces if g is not None]
    if not pieces:
        return
    flat = torch.cat([g.reshape(-1) for g in pieces])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in pieces:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


class ScratchTP(TensorParallel):
    """Ours: local shards of every matrix; init_param fills one from parallel=single's draw."""

    def __init__(self, group, sequence_parallel, init_param):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.sequence_parallel, self.init_param = sequence_parallel, init_param

    def replicated(self, name):
        return shard_dim(name) is None

    def global_layout(self, name, p):
        shape, origin, d = list(p.shape), [0] * p.dim(), shard_dim(name)
        if d is not None:
            origin[d] = self.rank * p.shape[d]
            shape[d] *= self.size
        return tuple(shape), tuple(origin)

    def sync_grads(self, data):
        """Sequence parallel: each rank's norm gains saw only its positions; sum their gradients over tp, once per
        step, wherever the data-parallel strategy keeps them (.grad, or FSDP's and ZeRO's shard pieces: the sum is
        linear, so it commutes with their reduction over dp)."""
        if self.sequence_parallel:
            sync_replicated_grads([g for n, g in data.grad_pieces() if self.replicated(n)], self.group)


def apply_tp(model, mesh, p):
    """Ours over the mesh's tp dimension, on a model still on the meta device: shards in place; the data-parallel
    step materializes them (all at once, or FSDP one shard at a time) through init_param."""
    group = mesh.get_group("tp")
    return ScratchTP(group, p.sequence_parallel, shard(model, group, p.sequence_parallel))


# --- torch's twin
class TorchTP(TensorParallel):
    def __init__(self, size):
        self.size = size

    def loss_context(self):
        """torch's tensor parallel computes the loss on vocab-sharded logits only inside torch's loss_parallel()."""
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()


def apply_torch_tp(model, mesh, p, device):
    """The same sharding through DTensor: torch's column/row-parallel styles, its vocab-parallel loss
    (loss_parallel, entered by the loop through loss_context) and its sequence-parallel norms. DTensor shards full
    tensors, so the model is materialized whole first."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    materialize(model, model.init_param, device)
    sequence_parallel, tp_mesh = p.sequence_parallel, mesh["tp"]
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between layers
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        # one DTensor input per attention / MLP, so gate and up's input gradients are summed before one all-reduce
        plan[b + "attn"] = PrepareModuleInput(input_layouts=(seq, None, None),
                                              desired_input_layouts=(Replicate(), None, None))
        plan[b + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        # the fused qkv's Shard(0) is a contiguous split of its rows: whole key/value groups (model.py)
        plan.update({b + "attn.qkv": ColwiseParallel(), b + "attn.proj": RowwiseParallel(output_layouts=seq),
                     b + "mlp.up": ColwiseParallel(), b + "mlp.down": RowwiseParallel(output_layouts=seq)})
        if model.blocks[i].mlp.gate is not None:
            plan[b + "mlp.gate"] = ColwiseParallel()
        if sequence_parallel:
            plan.update({b + "norm1": SequenceParallel(), b + "norm2": SequenceParallel()})
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    if not sequence_parallel:
        # the norm gains are replicated; as DTensors (Replicate) too, so that every gradient is a DTensor on the same
        # mesh, as torch's gradient clipping needs, with the norm's input and output plain local tensors as before
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                distribute_module(m, tp_mesh, input_fn=lambda m, args, mesh: tuple(
                    DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args),
                    output_fn=lambda m, out, mesh: out.to_local())
    # loss_parallel shards torch's own cross-entropy over the vocab, not the model's fused one (model.CrossEntropy)
    put_loss(model, lambda logits, targets: torch.nn.functional.cross_entropy(
        logits.float().flatten(0, -2), targets.reshape(-1)))
    # the loss comes back as a replicated DTensor: hand the loop a plain tensor (its gradient flows through
    # to_local); called without targets (sampling), the model returns the full logits, not a vocab-sharded DTensor
    model.register_forward_hook(lambda m, args, kwargs, out: out.to_local() if has_targets(args, kwargs)
                                else out.full_tensor(), with_kwargs=True)
    if sequence_parallel:
        pad_sequence_for_sampling(model, tp_mesh.size())
    return TorchTP(tp_mesh.size())
