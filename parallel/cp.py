"""Context parallelism from scratch: every sequence split over the `cp` ranks of a group, attention computed over the
whole of it by passing keys and values around a ring (ring attention) or by gathering them (all-gather).

Liu, Zaharia and Abbeel, 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"; the Llama 3
paper (Dubey et al., 2024, sec. 3.3.2) for the load-balanced split and the all-gather variant.

Everything but attention works token by token: the embedding, norms, MLP, head and loss of a rank see only its own
tokens. Attention needs every earlier token's key and value, and that is all that crosses ranks.

  Split (zig-zag). A sequence of T tokens is cut into 2 cp chunks of C = T / (2 cp); rank i keeps chunks i and
  2 cp - 1 - i, in that order. Under the causal mask a plain split into cp pieces gives the last rank cp times the
  first one's work (its queries see the most keys); pairing an early chunk with a late one gives every rank the same
  number of (query, key) pairs, C^2 (2 cp - 1) + C (C + 1). RoPE uses the tokens' global positions (the model's
  `positions` argument).

  Ring (`parallel.cp_method=ring`). At step s = 0 .. cp-1 rank i holds the K, V of rank j = i - s (mod cp) and
  computes its queries' attention to them. Before that block's attention it posts the send of those K, V to rank
  i+1 and the receive of the next block from rank i-1, so each hop overlaps a block of compute. With zig-zag chunks
  each block is one of three shapes (`block`): its own (causal), an earlier rank's (all queries, that rank's first
  chunk, no mask) or a later rank's (its second chunk of queries, all keys, no mask). The partial results are merged
  by log-sum-exp (the online softmax): out = sum_j exp(lse_j - lse) out_j, lse = log sum_j exp(lse_j).
  Backward (an autograd.Function) rotates K, V the same way and, one step behind them, the partial dK, dV of the
  block they belong to; after cp - 1 hops each accumulator is back at its owner. Saved for backward: q, k, v, the
  output and lse, O(T/cp) per rank; each block's scores are recomputed (flash attention's backward).

  All-gather (`parallel.cp_method=allgather`). One all-gather of K, V per layer, then the ring's blocks over the
  gathered K, V; backward reduce-scatters dK, dV. Nothing overlaps it and it keeps the whole sequence's K, V for
  backward, but it is one collective a layer, and K, V are small beside the queries under grouped-query attention:
  Llama 3's choice.

  Memory per rank: activations of T/cp tokens (1/cp of one process's); the ring holds two K, V blocks at a time;
  the all-gather keeps the whole sequence's K, V in every layer for backward. Each block runs in a fused attention
  kernel that returns its log-sum-exp (on a CPU aten's flash kernel; on a GPU the flash kernel in half precision,
  the memory-efficient one in float32; forward and backward, in the activations' dtype): tiles, never a (2C)^2
  scores tensor; the partial outputs merge in float32.
  Only K and V travel, with their own n_kv_head heads (grouped-query attention: n_head / n_kv_head fewer bytes than
  full multi-head attention's; each block's kernel reads each key/value head for its query heads).
  Communication per layer and step (bytes of K and V of one rank, kv = 2 B (T/cp) d_kv x element size, d_kv =
  n_kv_head x head_dim):
    ring       forward (cp - 1) hops of kv; backward (cp - 1) of kv and (cp - 1) of dK, dV (float32). Each hop is a
               send and a receive; parallel/comm.py counts both, as p2p on the "cp" dimension.
    all-gather forward one all-gather of K, V (its output: cp x kv); backward one reduce-scatter (its input: cp x kv).
  Activation checkpointing recomputes the forward, and its communication, once more in backward.

Loss and gradients. Each rank's loss is the mean over its own tokens; the chunks are equal, so their mean over the
cp ranks is the sequence's mean, and the gradient of it is the mean of the ranks' gradients: the data-parallel
strategy reduces gradients over dp x cp (`data_mesh`) as it does over dp. The K, V gradients a rank's queries
produce for another rank's tokens reach that rank through the ring (or the reduce-scatter) inside backward.

The torch twin, torch.distributed.tensor.experimental.context_parallel, is at the end of this file.
"""
import warnings

import torch
import torch.distributed as dist

from model import MoE, causal_attention
from parallel import comm
from parallel.layout import once_per_group


# --- the split
def zigzag_positions(seq_len, cp, rank, device=None):
    """The global positions rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp equal chunks."""
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def plain_positions(seq_len, cp, rank, device=None):
    """The split zig-zag replaces: one contiguous piece per rank (for comparison: the last rank works most)."""
    return torch.arange(seq_len, device=device).view(cp, seq_len // cp)[rank]


def causal_pairs(positions):
    """(query, key) pairs a rank holding `positions` computes under the causal mask: each query sees itself and
    every earlier position."""
    return int((positions + 1).sum())


def block(rank, src, chunk):
    """Which of this rank's queries attend to which of rank src's keys, with zig-zag chunks of `chunk` tokens:
    (query slice, key slice, causal). Own block: causal. An earlier rank's chunks are src < rank and
    2 cp - 1 - src > 2 cp - 1 - rank: every query sees the first whole, none the second. A later rank's: the first
    chunk of queries sees neither, the second sees both whole."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


# --- one block of attention, and its backward: a fused kernel that returns the log-sum-exp
# Fused: tiles, never the (Tq, Tk) scores, in the compute dtype with float32 accumulation, forward and backward.
# The backward takes the output and lse of the *merged* attention, so each block's probabilities are
# exp(s - lse) under the final softmax and blocks need nothing from each other (flash attention's backward, split
# by key blocks). On a CPU, aten's flash kernel for the CPU (the one F.scaled_dot_product_attention runs there); on
# a GPU, the flash kernel in half precision and the memory-efficient one in float32 (both as SDPA calls them; their
# lse is natural-log, the efficient kernel's padded to 32 queries), key/value heads repeated for grouped-query
# attention. Elsewhere (another device, or a head_dim the GPU kernels lack): the same math written out, in
# float32, (Tq, Tk) scores a block, with a warning that says so.
def fused(q):
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.bfloat16)
    return q.device.type == "cuda" and q.size(-1) % 8 == 0 and q.size(-1) <= 256 and \
        q.dtype in (torch.float32, torch.bfloat16, torch.float16)


_warned = set()


def _written_out(q):
    key = (q.device.type, q.dtype, q.size(-1))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"parallel/cp.py: no fused attention kernel for {q.dtype} with head_dim {q.size(-1)} on "
                      f"{q.device.type}: each block runs written out, its (Tq, Tk) scores in float32")


def _repeat_kv(q, k, v):
    rep = q.size(1) // k.size(1)  # grouped-query attention: each key/value head serves rep query heads in a row
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))


def _group(g, k):
    """A gradient over the repeated key/value heads summed back onto each key/value head."""
    B, H_kv = k.size(0), k.size(1)
    return g if g.size(1) == H_kv else g.view(B, H_kv, g.size(1) // H_kv, *g.shape[2:]).sum(2)


def _lse_rows(tq):
    return -(-tq // 32) * 32  # the memory-efficient kernel's lse: queries padded to a multiple of 32


def attention_block(q, k, v, causal):
    """Softmax attention of q to k, v and its log-sum-exp per query: (out (B, H, Tq, D) float32, lse (B, H, Tq)
    float32). `causal`: q and k are the same positions (the diagonal block), each query sees itself and earlier."""
    if fused(q) and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out.float(), lse
    if fused(q):
        k, v = _repeat_kv(q, k, v)
        if q.dtype == torch.float32:
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
            return out.float(), lse.narrow(-1, 0, q.size(2)).float()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out.float(), lse.float()
    _written_out(q)
    k, v = _repeat_kv(q, k, v)
    q, k, v = q.float(), k.float(), v.float()
    s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    lse = s.logsumexp(dim=-1)
    return (s - lse[..., None]).exp() @ v, lse


def attention_block_backward(q, k, v, out, dout, lse, causal):
    """Gradients (dq, dk, dv) of one block, float32, given the merged attention's output and lse for these
    queries (out and dout in q's dtype, lse float32)."""
    if fused(q) and q.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                                   causal)
        return tuple(g.float() for g in grads)
    if fused(q):
        kr, vr = _repeat_kv(q, k, v)
        tq, tk = q.size(2), k.size(2)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the kernels draw nothing
        if q.dtype == torch.float32:
            padded = torch.nn.functional.pad(lse, (0, _lse_rows(tq) - tq))
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, kr, vr, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, kr, vr, out, lse, None, None, tq, tk, 0.0, causal, torch.zeros(2, dtype=torch.int64,
                                                                                       device=q.device), seed)
        return dq.float(), _group(dk.float(), k), _group(dv.float(), k)
    B, H_kv, rep = k.size(0), k.size(1), q.size(1) // k.size(1)
    q, out, dout = q.float(), out.float(), dout.float()
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scale = q.size(-1) ** -0.5
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    p = (s - lse[..., None]).exp()
    delta = (dout * out).sum(-1)
    ds = p * (dout @ v.transpose(-2, -1) - delta[..., None])
    dk, dv = (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ dout
    group = lambda g: g.view(B, H_kv, rep, *g.shape[2:]).sum(2)  # each key/value head's query heads' parts summed
    return (ds @ k) * scale, group(dk), group(dv)


def _future(s):
    return torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)


def token_major_zeros(q):
    """A float32 (B, H, T, D) accumulator laid out (B, T, H, D) in memory, as SDPA lays out its output for model.py's
    queries: the attention's output then flattens into proj's input as a view, with no copy kept for backward."""
    B, H, T, D = q.shape
    return torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)


def merge(out, lse, out_b, lse_b):
    """Fold a block's (out_b, lse_b) into the running (out, lse) of the same queries, in place, in float32."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_((lse - new).exp()[..., None]).add_(out_b * (lse_b - new).exp()[..., None])
    lse.copy_(new)


# --- the ring
class Ring:
    """Sends to the next rank of the group and receives from the previous one, posted together (one batch, so that
    NCCL can't deadlock on the cycle) and waited for later."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def pass_on(self, t):
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + 1) % self.size),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works):
        for w in works:
            w.wait()


def forward_block(q, kv, rank, src, out, lse):
    """Fold this rank's queries' attention to rank src's K, V (kv: (2, B, H, 2C, D)) into (out, lse), float32."""
    qs, ks, causal = block(rank, src, q.size(2) // 2)
    out_b, lse_b = attention_block(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal)
    merge(out[:, :, qs], lse[:, :, qs], out_b, lse_b)


def backward_block(q, kv, out, dout, lse, rank, src, dq, g=None):
    """Add this block's part of dq into dq (float32); return its part of rank src's dK, dV, (2, B, H, 2C, D)
    float32, written into g where given (zeros). out, dout: the merged attention's output and its gradient, in q's
    dtype."""
    qs, ks, causal = block(rank, src, q.size(2) // 2)
    dq_b, dk_b, dv_b = attention_block_backward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                                                dout[:, :, qs], lse[:, :, qs], causal)
    dq[:, :, qs] += dq_b
    g = torch.zeros_like(kv, dtype=torch.float32) if g is None else g
    g[0][:, :, ks], g[1][:, :, ks] = dk_b, dv_b
    return g


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag queries to the whole sequence's keys; q, k, v (B, H, 2C, D)."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        ring = Ring(group)
        with torch.autocast(q.device.type, enabled=False):  # blocks in the activations' dtype, merged in float32
            kv = torch.stack([k, v])  # one message per hop, in the activations' dtype
            out = token_major_zeros(q)
            lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            for s in range(ring.size):
                if s + 1 < ring.size:  # the next block travels while this one is computed
                    incoming, works = ring.pass_on(kv)
                forward_block(q, kv, ring.rank, (ring.rank - s) % ring.size, out, lse)
                if s + 1 < ring.size:
                    ring.wait(works)
                    kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        n, rank = ring.size, ring.rank
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        own = travelling = acc_works = None
        for s in range(n):
            if s + 1 < n:
                incoming, works = ring.pass_on(kv)
            g = backward_block(q, kv, out, dout, lse, rank, (rank - s) % n, dq)  # of the block held
            if s == 0:
                own = g  # kept here; the other ranks' parts come back round the ring at the end
            else:
                if acc_works is not None:  # the block's accumulator, from the rank that held it one step ago
                    ring.wait(acc_works)
                    g += travelling
                # on to the rank that holds this block next (after the last step: its owner)
                travelling, acc_works = ring.pass_on(g)
            if s + 1 < n:
                ring.wait(works)
                kv = incoming
        if acc_works is not None:
            ring.wait(acc_works)
            own += travelling
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


# --- all-gather
class AllGatherAttention(torch.autograd.Function):
    """The same blocks as the ring's, with every rank's K, V gathered at once (one all-gather) instead of passed
    round; backward sums each rank's dK, dV pieces back to it (one reduce-scatter). Saves the gathered K, V."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.stack([k, v])
            gathered = torch.empty((n * 2,) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
            comm.all_gather_single(gathered, kv, group=group)
            gathered = gathered.view(n, *kv.shape)  # rank r's K, V at [r]
            out = token_major_zeros(q)
            lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            for s in range(n):  # the ring's order, so the merge rounds alike
                src = (rank - s) % n
                forward_block(q, gathered[src], rank, src, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, gathered, out, lse = ctx.saved_tensors
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # every rank's dK, dV pieces written in place into the reduce-scatter's input: no list of them besides
        grads = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
        for src in range(n):
            backward_block(q, gathered[src], out, dout, lse, rank, src, dq, grads[src])
        own = torch.empty(grads.shape[1:], dtype=torch.float32, device=q.device)
        comm.reduce_scatter_single(own, grads.view((n * 2,) + grads.shape[2:]), group=ctx.group)
        return dq.to(q.dtype), own[0].to(q.dtype), own[1].to(q.dtype), None


# --- applying it
def apply_cp(model, mesh, p):
    """Split every sequence the model is given with targets over the mesh's cp ranks (zig-zag), and put the ring's
    (or the all-gather's) attention in every block. Called without targets (sampling), the model runs whole
    sequences on every rank, with plain causal attention."""
    group = mesh.get_group("cp")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    # whether the forward under way runs on this rank's pieces of sequences; a recomputing backward (activation
    # checkpointing) runs after the forward that set it
    state = {"split": False}

    def attend(q, k, v):
        if not state["split"]:
            return causal_attention(q, k, v)
        method = RingAttention if p.cp_method == "ring" else AllGatherAttention
        return method.apply(q, k, v, group)

    def batch_counts(routed, tokens):  # an MoE's routing counts over the whole sequences (model.py's MoE)
        if not state["split"]:
            return routed, tokens
        routed = routed.clone()
        dist.all_reduce(routed, group=group)
        return routed, tokens * n

    for b in model.blocks:
        b.attn.attend = attend
        if isinstance(b.mlp, MoE):
            b.mlp.batch_counts = batch_counts

    def split(module, args, kwargs):
        idx, targets = args[0], args[1] if len(args) > 1 else kwargs.get("targets")
        if kwargs.get("positions") is not None:  # a pipeline stage: parallel/pp.py has split the micro-batch
            state["split"] = True
            return None
        state["split"] = targets is not None
        if targets is None:
            return None
        pos = zigzag_positions(idx.size(1), n, rank, idx.device)
        return (idx[:, pos], targets[:, pos]), {**{k: v for k, v in kwargs.items() if k != "targets"},
                                                "positions": pos}
    model.register_forward_pre_hook(split, with_kwargs=True)
    return model


def data_mesh(mesh):
    """The mesh the data-parallel strategies see: ("pp", "dp_replicate", "dp_shard", "tp") with dp_shard x cp ranks
    in "dp_shard", flattened with the replicas into "dp" (dp x cp ranks, those that share a pp and a tp coordinate).
    Each cp rank's gradients come from its own tokens, so the data-parallel strategy averages them over dp x cp as it
    would over replicas (torchtitan's dp_shard_cp). Its groups are new ones, even where they span every rank (where
    DeviceMesh would reuse the default group, cp's too), so that comm.py files their bytes apart, under "dp_cp"."""
    out, names = once_per_group(("dp x cp", mesh.device_type, tuple(mesh.mesh.shape)), lambda: _data_mesh(mesh))
    comm.name_groups(names)  # at every run, as Layout.build_mesh names its groups
    return out


def _data_mesh(mesh):
    from torch.distributed.device_mesh import DeviceMesh
    d = {k: mesh.get_group(k).size() for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    ranks = mesh.mesh.reshape(d["pp"], d["dp_replicate"], d["dp_shard"] * d["cp"], d["tp"])

    def groups_along(dim):  # this rank's group along `dim` of `ranks`; every rank creates every group
        rows = ranks.movedim(dim, -1).reshape(-1, ranks.size(dim))
        return dist.new_subgroups_by_enumeration(rows.tolist())[0]
    replicate, shard = groups_along(1), groups_along(2)
    out = DeviceMesh.from_group([mesh.get_group("pp"), replicate, shard, mesh.get_group("tp")], mesh.device_type,
                                mesh=ranks, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    flat = out["dp_replicate", "dp_shard"]._flatten("dp", backend_override=dist.get_backend())  # a new group
    return out, {shard: "dp_shard_cp", replicate: "dp_replicate", flat.get_group(): "dp_cp"}
