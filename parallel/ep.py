"""Expert parallelism from scratch: each MoE block's experts split over `ep` ranks, tokens sent to the rank that holds
their expert and back by all-to-all (GShard, Lepikhin et al., 2020; DeepSpeed-MoE; Megatron-LM's token dispatcher).

Where the ranks come from: the data-parallel ranks (dp x cp), as mature trainers take them, so expert parallelism
adds no mesh dimension. The dp x cp ranks of a (pp, tp) coordinate, in the mesh's order j, form groups of ep
neighbours (the "ep" groups: j // ep); the ranks that hold the same experts, one in each ep group (j % ep equal), form
the "ep_replicate" groups. With E experts, ep rank r holds experts [r E/ep, (r+1) E/ep).

  memory per rank:      each MoE block's routed experts / ep, whole (beside DDP and ZeRO) or sharded by FSDP over
                        the dp x cp / ep ranks that hold the same ones; the dense parameters as the data strategy
                        keeps them (DDP whole, ZeRO-1/2 their optimizer state and gradients sharded over dp x cp,
                        FSDP all of it)
  communication:        per MoE block and micro-batch, forward: the (ep, E/ep) token counts (E int64s), then the
                        routed tokens out (dispatch) and their outputs back (combine), each k x tokens rows of d
                        values; backward: the same two all-to-alls of gradients in reverse. A rank's count (the
                        bytes it sends) is 8 E + 2 (sent + received rows) d b a block and micro-batch; summed over
                        all ranks (metrics.jsonl's a2a_bytes_all_ranks), per step,
                          MoE blocks x (8 E x ranks x micro-batches + 4 k N d b) - 4 dropped d b,
                        N the batch's tokens, b bytes per value, `dropped` the assignments capacity dropped (they
                        move nothing)

How one MoE block runs (model.py's MoE does the routing; this file replaces its `dispatch`):
1. MoE sorts this rank's assignments by expert: counts[e] rows for expert e, in expert order. The rows for ep rank
   r's experts are then one contiguous run, so the all-to-all's send splits are the counts summed per rank.
2. One all-to-all of the counts tells each rank how many rows it receives from each peer for each of its experts;
   the receive splits follow (and must reach the host: all_to_all_single takes them as Python ints).
3. The rows go out (AllToAll: its backward is the all-to-all the other way, with the splits swapped). They arrive
   grouped by source rank, then by expert; a stable sort by local expert makes them one run per expert, for the
   grouped matmul; the inverse permutation restores the arrival order, and a second all-to-all returns the outputs.
4. Gradients: an expert's gradient on its holder sums the contributions of every token any rank of its ep group
   sent it, each scaled as its own rank's loss was (1 / accumulation steps). The global batch's mean gradient is
   then that summed over the ep_replicate group (the other ep groups' holders of the same experts) and divided by
   all dp x cp ranks, not by the ep_replicate group's size: the classic slip (a mean where a sum is wanted) makes
   expert gradients ep x too large. The data strategy (DDP, ZeRO-1, ZeRO-2) reduces every other parameter over
   dp x cp as before, and leaves the experts alone (`exclude`); its broadcast of the initial weights too (each
   rank's experts differ). ZeRO keeps the experts out of its buckets, whole, and steps them with its shards. FSDP
   instead shards each block's experts over ep_replicate, a unit of their own, and reduce-scatters their gradients
   there itself (divided by all dp x cp ranks): nothing is left for sync_grads.
5. The global gradient norm: under DDP the dense gradients are equal on every rank, the experts' disjoint within an
   ep group: squares summed over the ep group, the dense ones weighted 1 / ep. Under ZeRO the dense pieces are
   disjoint over every rank: squares summed over all of them, each expert's weighted 1 / (its replicas); under
   FSDP every piece is disjoint, the experts' shards too.

No overlap yet: the expert gradients are reduced after backward (sync_grads), not in buckets during it. No twin:
torch.distributed has no expert parallelism of its own, and DeepSpeed's MoE layer is not wired here.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from model import MoE
from parallel import comm
from parallel.layout import once_per_group
from parallel.strategy import ExpertParallel as Base


class AllToAll(torch.autograd.Function):
    """Rows of x to the ranks of `group`: send[i] rows (in order) to rank i, recv[i] from it. Backward: the
    gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def dispatch(experts, group, ep, tokens, counts):
    """MoE.dispatch over the ep group: `tokens` sorted by (global) expert, counts[e] of them for expert e; returns
    the experts' outputs in the same order. `experts`: this rank's E / ep of them."""
    send_counts = counts.view(ep, -1)  # [rank i][its local expert e]: rows this rank sends
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # [source i][my expert e]
    send, recv = splits(send_counts, recv_counts, tokens.size(0))
    rows = AllToAll.apply(tokens, recv, send, group)
    local = torch.arange(send_counts.size(1), device=tokens.device).repeat(ep)
    # arrival order -> expert order
    order = local.repeat_interleave(recv_counts.flatten(), output_size=sum(recv)).argsort(stable=True)
    out = experts(rows[order], recv_counts.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return AllToAll.apply(out[back], send, recv, group)


def splits(send_counts, recv_counts, rows):
    """The all-to-all's split sizes, rows to and from each peer, as Python ints: one host read for both. (`rows`:
    how many this rank sends; tools/dry_run.py puts balanced splits of them in its place: fake tensors hold no
    counts.)"""
    send, recv = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    return send, recv


def groups(layout):
    """(this rank's ep group, its ep_replicate group), made once per default group: every rank creates every group,
    in the same order, as new_group requires."""
    tp, D, ep = layout.tp, layout.reduce_ranks, layout.ep
    data = [[(i_pp * D + j) * tp + i_tp for j in range(D)] for i_pp in range(layout.pp) for i_tp in range(tp)]

    def build():
        mine_ep, _ = dist.new_subgroups_by_enumeration([g[a: a + ep] for g in data for a in range(0, D, ep)])
        mine_rep, _ = dist.new_subgroups_by_enumeration([g[r::ep] for g in data for r in range(ep)])
        return mine_ep, mine_rep
    out = once_per_group(("ep", layout.pp, D, tp, ep), build)
    comm.name_groups({out[0]: "ep", out[1]: "ep_replicate"})  # at every run, as Layout.build_mesh names its groups
    return out


class ExpertParallel(Base):
    """What the training loop and the data strategy need of expert parallelism (parallel/strategy.py's interface)."""

    def __init__(self, model, layout, group, replicate, names, init_param, modules):
        self.module, self.size, self.group, self.replicate = model, layout.ep, group, replicate
        self.modules = modules  # each MoE block's experts (model.py's Experts): FSDP makes each a unit
        self.names, self.reduce_ranks, self._init = frozenset(names), layout.reduce_ranks, init_param
        self.rank = dist.get_rank(group)

    def init_param(self, inner):
        return functools.partial(self._init, inner)

    @torch.no_grad()
    def sync_grads(self):
        # under FSDP no expert has a .grad here: FSDP reduce-scattered them over ep_replicate (parallel/fsdp.py)
        for name, p in self.module.named_parameters():
            if name in self.names and p.grad is not None:
                if self.replicate.size() > 1:
                    dist.all_reduce(p.grad, group=self.replicate)
                p.grad.div_(self.reduce_ranks)  # the mean over every data-parallel rank's loss (step 4 above)

    def expert(self, name):
        return name in self.names

    def global_layout(self, name, p):
        """(the full parameter's shape, where this rank's experts start in it), for checkpoints."""
        return (p.size(0) * self.size, *p.shape[1:]), (self.rank * p.size(0),) + (0,) * (p.dim() - 1)


def apply_ep(model, mesh, layout):
    """Split each MoE block's routed experts of `model` (on the meta device) over the ep group, and route its tokens
    through it. Returns the ExpertParallel."""
    group, replicate = groups(layout)
    ep, r = layout.ep, dist.get_rank(group)
    names, full_shapes, modules = [], {}, []
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        for pname, p in list(moe.experts.named_parameters()):
            full = f"{name}.experts.{pname}"
            names.append(full)
            full_shapes[full] = tuple(p.shape)
            setattr(moe.experts, pname, nn.Parameter(p.new_empty(p.size(0) // ep, *p.shape[1:])))
        moe.dispatch = functools.partial(dispatch, moe.experts, group, ep)
        modules.append(moe.experts)

    def init_param(inner, name, local):
        if name not in full_shapes:
            return inner(name, local)
        full = torch.empty(full_shapes[name], dtype=local.dtype, device=local.device)
        inner(name, full)  # single's draw of all the experts, then this rank's share
        local.copy_(full.chunk(ep)[r])
    return ExpertParallel(model, layout, group, replicate, names, init_param, modules)
