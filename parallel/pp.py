"""Pipeline parallelism from scratch: the GPT's blocks split into stages, one (or v) per rank, and micro-batches
streamed through them by an explicit schedule.

GPipe (Huang et al., 2019); 1F1B (PipeDream-Flush, Narayanan et al., 2019); interleaved 1F1B (Narayanan et al.,
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"); zero bubble ZB-H1 (Qi et
al., 2023, "Zero Bubble Pipeline Parallelism").

  stages      n_layer blocks split as evenly as they go into pp x v virtual stages; virtual stage k lives on pp
              rank k % pp (its chunk k // pp). The embedding sits on the first, final norm + head + loss on the last.
  memory      each rank holds only its stages' parameters (~1/pp of the blocks), plus the activations of the
              micro-batches in flight: all m under GPipe, at most pp - rank under 1F1B and ZB-H1
  comm        point-to-point only: each micro-batch's activation (b, s, d) forward over each of the pp - 1 stage
              boundaries, and its gradient back: 2 m (b s d) (p - 1) elements per step and pipeline (x v under
              interleaving, which has pp v - 1 boundaries)
  bubble      idle share of a step, costing forward 1 and backward 2: (p - 1) / (m + p - 1) for GPipe and 1F1B,
              (p - 1) / (v m + p - 1) interleaved, less for ZB-H1 (its weight gradients fill the cool-down)

A schedule is a list of actions per rank, (kind, chunk, micro-batch), kind F (forward), B (backward: input and
weight gradients; under zero_bubble only the input gradient, what the previous stage waits for) and W (the
weight gradients, deferred). `schedule()` builds them, `simulate()` times them with unit costs (the bubble, the
Gantt chart of tools/pp_schedule.py), and `Pipeline.step` runs one: before each action it posts, in one batch, the
sends of the action before it and its own receive (`p2p_program`), the order NCCL needs: it runs a rank's batches
in order on one stream, and a receive posted ahead of sends a peer is waiting for hangs both (`p2p_hang` plays that
model; the sends still travel while the next forward or backward computes).
Beside data parallelism over dp, every backward of the schedule runs under the data strategy's no_sync and the
strategy reduces once after the schedule (`reduce_grads`): its gradient communication then follows the step's
backward instead of overlapping the last one, which no single backward could start under interleaving anyway.

The torch twin (parallel.impl=torch, `Pipeline.torch_step`): torch.distributed.pipelining's PipelineStage over the
same chunks, with ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble. Beside a
data strategy over dp, the stage's module is the strategy's wrapper (torch's DDP, FSDP2), which torch's schedules
sync themselves; on gloo that runs for 1f1b (and gpipe under FSDP2), one chunk per rank (Layout.problem).

Every rank builds only its stages' parameters from the meta device, with parallel=single's values: `split` first
walks the whole model once, drawing each parameter into a scratch tensor and noting the RNG state before it, so
that a stage's parameter is later drawn from exactly the state a single process would draw it from, in whatever
order tensor parallel or FSDP materialize it. The stage keeps single's parameter names (blocks.5 stays blocks.5),
so checkpoints reshard between pp and every other layout by name (checkpoint.py).
"""
import contextlib
import functools

import torch
import torch.distributed as dist

from parallel.cp import zigzag_positions
from parallel.tp import gather_vocab

F, B, W = "F", "B", "W"


# --- the stage split
def split_blocks(n_layer, n_stages):
    """[range of block indices] for each of n_stages virtual stages, the first n_layer % n_stages one block longer."""
    size, extra = divmod(n_layer, n_stages)
    out, lo = [], 0
    for k in range(n_stages):
        hi = lo + size + (k < extra)
        out.append(range(lo, hi))
        lo = hi
    return out


def describe(n_layer, pp, v):
    """The split as one line per rank, e.g. 'rank 0: wte + blocks 0-1'."""
    ranges, n = split_blocks(n_layer, pp * v), pp * v
    lines = []
    for r in range(pp):
        parts = []
        for k in range(r, n, pp):
            blocks = ranges[k]
            piece = f"blocks {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"block {blocks[0]}"
            parts.append(("wte + " if k == 0 else "") + piece + (" + norm, head, loss" if k == n - 1 else ""))
        lines.append(f"rank {r}: " + " | ".join(parts))
    return lines


# --- the schedules: [(kind, chunk, micro-batch)] for one rank of p, m micro-batches
def gpipe(p, m, rank):
    """Every forward, then every backward (in reverse order, as the last forward's gradient arrives first)."""
    return [(F, 0, i) for i in range(m)] + [(B, 0, i) for i in reversed(range(m))]


def one_f_one_b(p, m, rank):
    """Warm-up: p - 1 - rank forwards; then one forward, one backward while forwards remain; then the backwards.
    A rank holds at most p - rank micro-batches' activations, however large m is."""
    warm = min(p - 1 - rank, m)
    out = [(F, 0, i) for i in range(warm)]
    for i in range(m - warm):
        out += [(F, 0, warm + i), (B, 0, i)]
    return out + [(B, 0, i) for i in range(m - warm, m)]


def interleaved_1f1b(p, m, rank, v):
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of p through each chunk in turn. The
    k-th forward on every rank is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p; backwards go through
    the chunks in reverse. Warm-up is (p - 1 - rank) 2 + (v - 1) p forwards; then 1F1B over the (chunk, micro) pairs."""
    n = m * v

    def forward(k):
        return (F, (k // p) % v, (k // (p * v)) * p + k % p)

    def backward(k):
        return (B, v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)
    warm = min((p - 1 - rank) * 2 + (v - 1) * p, n)
    out = [forward(k) for k in range(warm)]
    for k in range(n - warm):
        out += [forward(warm + k), backward(k)]
    return out + [backward(k) for k in range(n - warm, n)]


def zero_bubble_h1(p, m, rank):
    """ZB-H1: 1F1B with each backward split into B (the input gradient, which the previous stage waits for) and W
    (the weight gradients, which nobody waits for). Rank r defers its W's by r micro-batches: then the B's run back
    through the stages at the speed of B alone, and the deferred W's fill the cool-down, where 1F1B's ranks wait.
    A rank holds at most p micro-batches (p - 1 - r warm-up + 1 + r deferred), 1F1B's peak."""
    warm = min(p - 1 - rank, m)
    out, n_w = [(F, 0, i) for i in range(warm)], 0
    for i in range(m):
        out += ([(F, 0, warm + i)] if warm + i < m else []) + [(B, 0, i)]
        if i + 1 - n_w > rank:  # more than r W's outstanding: do the oldest
            out.append((W, 0, n_w))
            n_w += 1
    return out + [(W, 0, i) for i in range(n_w, m)]


def schedule(name, p, m, v=1):
    """[actions] for every rank of p."""
    if name == "gpipe":
        return [gpipe(p, m, r) for r in range(p)]
    if name == "1f1b":
        return [one_f_one_b(p, m, r) for r in range(p)]
    if name == "interleaved_1f1b":
        return [interleaved_1f1b(p, m, r, v) for r in range(p)]
    if name == "zero_bubble":
        return [zero_bubble_h1(p, m, r) for r in range(p)]
    raise ValueError(f"unknown pipeline schedule {name!r}")


def virtual(rank, chunk, p):
    return chunk * p + rank


def simulate(actions, v=1, cost=None):
    """Time the schedule: [[(start, end, action)] per rank], each rank doing its actions in order as soon as their
    inputs exist (F after the previous stage's F, B after the next stage's B, W after its own B), communication
    free. Costs per full stage: forward 1, backward 2 (B 1 + W 1 where the schedule splits them); a chunk of an
    interleaved rank costs 1/v of that. Raises on a schedule that can never finish."""
    split = any(a[0] == W for acts in actions for a in acts)
    cost = cost or ({F: 1, B: 1, W: 1} if split else {F: 1, B: 2})
    p, n = len(actions), len(actions) * v
    done, times = {}, [[] for _ in actions]
    pos, free = [0] * p, [0.0] * p
    while any(pos[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(actions[r]):
                continue
            kind, chunk, i = action = actions[r][pos[r]]
            s = virtual(r, chunk, p)
            deps = {F: [(F, s - 1, i)] if s > 0 else [],
                    B: [(F, s, i)] + ([(B, s + 1, i)] if s < n - 1 else []),
                    W: [(B, s, i)]}[kind]
            if any(d not in done for d in deps):
                continue
            start = max([free[r]] + [done[d] for d in deps])
            end = start + cost[kind] / v
            done[kind, s, i], free[r] = end, end
            times[r].append((start, end, action))
            pos[r] += 1
            progressed = True
        if not progressed:
            waiting = [a[k] for a, k in zip(actions, pos) if k < len(a)]
            raise RuntimeError(f"the schedule deadlocks: the ranks' next actions {waiting} wait on each other")
    return times


def bubble(actions, v=1):
    """The idle share of the step's span, summed over ranks (simulate's unit costs)."""
    times = simulate(actions, v)
    span = max(end for t in times for _, end, _ in t)
    busy = sum(end - start for t in times for start, end, _ in t)
    return 1 - busy / (span * len(times))


def peak_in_flight(actions):
    """The most (chunk, micro-batch) pairs whose activations a rank holds at once: forward done, the last of its
    backward passes (B, or W where it is split off) not yet."""
    split = any(a[0] == W for a in actions)
    held, peak = set(), 0
    for kind, chunk, i in actions:
        if kind == F:
            held.add((chunk, i))
            peak = max(peak, len(held))
        elif kind == (W if split else B):
            held.discard((chunk, i))
    return peak


# --- point-to-point: what each action sends and receives, when a rank posts it, and NCCL's order
def messages(action, rank, p, v=1):
    """(the message this action receives before it runs or None, [the messages it sends once it has run]); a message
    is (kind, the stage it goes to, micro-batch): a forward's activation to the next stage, a backward's input
    gradient to the previous one."""
    kind, chunk, i = action
    s, last = virtual(rank, chunk, p), p * v - 1
    if kind == F:
        return ((F, s, i) if s > 0 else None), ([(F, s + 1, i)] if s < last else [])
    if kind == B:
        return ((B, s, i) if s < last else None), ([(B, s - 1, i)] if s > 0 else [])
    return None, []


def p2p_program(schedule_, rank, p, v=1):
    """What `rank` does around its actions, as Pipeline.run does it: [(batch, wait)], one before each of its actions
    and one after the last; `schedule_`: every rank's actions. Each batch holds the sends of the action before it
    and the receives of every message sent to this rank by then on the schedule's timeline (simulate's unit costs);
    the rank waits for all it has posted before an action that receives. Every pair of ranks then meets its
    messages in one order on both ends, that of the time they are sent, which NCCL needs: it runs a rank's batches
    in order on one stream, and a send finishes only once its receive is running (`p2p_hang` plays that model;
    posting each receive just before the action that needs it hangs every schedule, interleaving worst)."""
    return _p2p_program(tuple(tuple(a) for a in schedule_), rank, p, v)


@functools.lru_cache(maxsize=256)
def _p2p_program(schedule_, rank, p, v):
    times = simulate(schedule_, v)
    sent = sorted((end, m) for r, ts in enumerate(times) for _, end, a in ts for m in messages(a, r, p, v)[1])
    mine = [(t, m) for t, m in sent if m[1] % p == rank]  # the messages this rank receives, by when they are sent
    program, pending, k = [], [], 0
    for start, _, action in times[rank]:
        recv, sends = messages(action, rank, p, v)
        batch = [("send", m) for m in pending]
        while k < len(mine) and mine[k][0] <= start:
            batch.append(("recv", mine[k][1]))
            k += 1
        program.append((batch, recv is not None))
        pending = sends
    program.append(([("send", m) for m in pending] + [("recv", m) for _, m in mine[k:]], True))
    return program


def p2p_hang(programs, p):
    """None if every rank's program runs to its end under NCCL's ordering, else the ranks' stuck batches (one line).
    The model: a rank posts its batches in program order, and stops at a wait until everything it posted has
    finished; each rank's posted batches run one at a time, in order; an op of the running batch completes when the
    peer's running batch holds its match (a send of message m to its stage's rank, a receive of m)."""
    def peer(op, rank):  # the rank on the other end of op, from the message's destination stage
        kind, stage, _ = op[1]
        dest = stage % p
        if op[0] == "send":
            return dest
        return (stage - 1 if kind == F else stage + 1) % p
    n = len(programs)
    step, waiting = [0] * n, [False] * n  # the next program entry to post; stopped at a wait
    queue = [[] for _ in programs]  # each rank's posted batches not yet finished, oldest first: {ops left}
    progressed = True
    while progressed:
        progressed = False
        for r, prog in enumerate(programs):  # post until a wait with something still in flight
            while step[r] < len(prog) and not (waiting[r] and queue[r]):
                batch, waiting[r] = prog[step[r]]
                if batch:
                    queue[r].append(set(batch))
                step[r] += 1
                progressed = True
        for r in range(n):  # the running batches' ops that meet their match in the peer's running batch
            for op in list(queue[r][0]) if queue[r] else []:
                q, match = peer(op, r), ("recv" if op[0] == "send" else "send", op[1])
                if queue[q] and match in queue[q][0]:
                    queue[r][0].discard(op)
                    queue[q][0].discard(match)
                    progressed = True
            for k in range(n):
                while queue[k] and not queue[k][0]:
                    queue[k].pop(0)
    stuck = {r: sorted(queue[r][0]) for r in range(n) if queue[r]}
    unposted = [r for r, prog in enumerate(programs) if step[r] < len(prog)]
    if stuck or unposted:
        return f"p2p hangs: running batches {stuck}, ranks {unposted} never reach the end of their programs"
    return None


# --- building a rank's stages from the meta device
def _generator(device):
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.default_generators[d.index if d.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@torch.no_grad()
def split(model, mesh, p, device):
    """Keep in `model` (a GPT on the meta device) only this pp rank's stages; returns its Pipeline. Draws every
    parameter once, as parallel=single would, to note where each one's values start in the RNG stream."""
    pp, v, rank = mesh["pp"].size(), p.pp_virtual if p.pp_schedule == "interleaved_1f1b" else 1, \
        mesh["pp"].get_local_rank()
    gen = _generator(device)
    states = {}
    for name, param in model.named_parameters():
        states[name] = gen.get_state()
        model.init_param(name, torch.empty(param.shape, dtype=param.dtype, device=device))
    states[None] = gen.get_state()  # where single's stream is once the model is drawn
    n = pp * v
    ranges = split_blocks(model.cfg.n_layer, n)
    chunks = [dict(first=k == 0, last=k == n - 1, blocks=list(ranges[k])) for k in range(rank, n, pp)]
    mine = [i for c in chunks for i in c["blocks"]]
    # the blocks keep their single-process names (a ModuleList with its kept keys), the other pieces go
    model.blocks._modules = {str(i): model.blocks[i] for i in mine}
    if not chunks[0]["first"]:
        model.wte = None
    if not chunks[-1]["last"]:
        model.norm = model.head = None
    pipe = Pipeline(model, chunks, mesh, p, device, states)
    model.forward = pipe.stage_forward  # what the strategies' wrappers (DDP, FSDP's hooks) call
    return pipe


class Pipeline:
    """This rank's stages and the executor of a schedule over them."""

    def __init__(self, model, chunks, mesh, p, device, states):
        self.model, self.chunks, self.device, self.states = model, chunks, device, states
        self.group = mesh.get_group("pp")
        self.pp, self.rank, self.v = mesh["pp"].size(), mesh["pp"].get_local_rank(), len(chunks)
        self.peers = [dist.get_global_rank(self.group, r) for r in range(self.pp)]
        self.name, self.impl, self.torch_schedule = p.pp_schedule, p.impl, None
        self.tp_split = mesh["tp"].size() if p.sequence_parallel else 1  # activations between stages, per rank
        self.tp_group = mesh.get_group("tp") if mesh["tp"].size() > 1 else None  # the last stage's vocab slices
        self.dtype = torch.bfloat16 if p.param_dtype == "bfloat16" and p.data != "none" else torch.float32
        self.names = set(states) - {None}  # the whole model's parameters, for checkpoints
        # set by parallelize to the data strategy's: its wrapper, its no_sync and the reduction after it
        self.call, self.no_sync, self.reduce_grads = model, contextlib.nullcontext, lambda: None
        self.log, self.peak = [], 0  # the actions run, in order; the most micro-batches held at once
        cp = mesh.get_group("cp")
        self.cp_n, self.cp_rank, self.positions = cp.size(), cp.rank(), None  # see _cp_split

    def init_param(self, inner):
        """init_param(name, tensor) that draws from where single's stream stood before that parameter."""
        gen = _generator(self.device)

        def init(name, t):
            gen.set_state(self.states[name])
            inner(name, t)
            gen.set_state(self.states[None])
        return init

    def stage_forward(self, x, targets=None, chunk=0, positions=None):
        """One chunk: token ids (first stage) or the previous stage's activation in; the activation, or on the
        last stage the logits (loss with targets), out. `positions`: the tokens' places in their sequences, under
        context parallel (this cp rank's zig-zag pieces)."""
        c, m = self.chunks[chunk], self.model
        # under sequence parallel a later stage's input holds this tp rank's 1/tp of the positions; its attention
        # gathers them all, and takes the RoPE tables of the whole sequence (under cp: this cp rank's pieces)
        cos, sin = m.rope(x.size(1) if c["first"] else x.size(1) * self.tp_split, positions)
        if c["first"]:
            x = m.wte(x)
        for i in c["blocks"]:
            x = m.blocks._modules[str(i)](x, cos, sin)
        if not c["last"]:
            return x
        h = m.norm(x)
        return m.head(h) if targets is None else m.head_loss(h, targets)

    # --- point-to-point
    def _stage(self, chunk):
        return virtual(self.rank, chunk, self.pp)

    def _peer(self, stage):
        return self.peers[stage % self.pp]

    def _tag(self, kind, stage, micro):
        return (micro * self.pp * self.v + stage) * 2 + (kind != F)  # gloo matches by tag; NCCL by order

    def _post(self, sends, recvs):
        ops = [dist.P2POp(dist.isend, t, peer, self.group, tag) for peer, tag, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group, tag) for peer, tag, t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    # --- running a schedule
    def run(self, schedule_, x, y, shape, accum=1, train=True):
        """Run this rank's actions of `schedule_` (every rank's) over micro-batches x[i], y[i]; returns this rank's
        summed loss (zero off the last stage)."""
        actions = schedule_[self.rank]
        last_stage = self.pp * self.v - 1
        grads_in = W if any(a[0] == W for a in actions) else B
        held = {}  # (chunk, micro) -> (input, output[, output gradient])
        loss_sum = torch.zeros((), device=self.device)
        outbox, works = {}, []  # outbox: message -> the tensor to send; works: what is posted, oldest first
        inbox = {}  # message -> its receive buffer, posted (p2p_program says when)
        for n, (batch, wait) in enumerate(p2p_program(schedule_, self.rank, self.pp, self.v)):
            # the previous action's sends and the receives due by now: one batch, in the order NCCL needs
            sends = [(self._peer(m[1]), self._tag(*m), outbox.pop(m)) for op, m in batch if op == "send"]
            recvs = [m for op, m in batch if op == "recv"]
            for m in recvs:
                inbox[m] = torch.empty(shape, dtype=self.dtype, device=self.device)
            works += self._post(sends, [(self._peer(m[1] - 1 if m[0] == F else m[1] + 1), self._tag(*m), inbox[m])
                                        for m in recvs])
            if wait:  # wait in the order posted (gloo: one work per op; a send it left unwaited once a later
                for w in works:  # receive on the pair has completed never completes)
                    w.wait()
                works = []
            if n == len(actions):
                break
            kind, chunk, i = action = actions[n]
            s = self._stage(chunk)
            self.log.append(action)
            needed = messages(action, self.rank, self.pp, self.v)[0]
            here = inbox.pop(needed) if needed else None
            if kind == F:
                inp = here.requires_grad_(train) if s > 0 else x[i]
                out = self.call(inp, y[i] if s == last_stage else None, chunk=chunk, positions=self.positions)
                if s == last_stage:
                    loss_sum += out.detach()
                    out = out / accum  # each micro-batch weighs 1/accum, as in single's accumulation
                else:
                    outbox[F, s + 1, i] = out.detach()
                if train:
                    held[chunk, i] = (inp, out)
                    self.peak = max(self.peak, len(held))
                continue
            if kind == B:  # the output's gradient: received from the next stage, or none (the loss)
                inp, out = held.pop((chunk, i))[:2]
                grad = here
            else:
                inp, out, grad = held.pop((chunk, i))
            g = None
            if kind == B and grads_in == B:  # input and weight gradients in one pass
                torch.autograd.backward(out, grad)
                g = inp.grad if s > 0 else None
            elif kind == B:  # the input gradient alone; the graph stays for W
                g = torch.autograd.grad(out, inp, grad, retain_graph=True)[0] if s > 0 else None
                held[chunk, i] = (inp, out, grad)
            else:  # W: the weight gradients, through the kept graph
                torch.autograd.backward(out, grad, inputs=self.params)
            if g is not None:
                outbox[B, s - 1, i] = g
        return loss_sum

    def step(self, x, y, accum, micro):
        """One training step's forward and backward over its accum micro-batches of `micro` sequences."""
        if self.impl == "torch":
            return self.torch_step(x, y, accum)
        x, y = self._cp_split(x, y)
        xs, ys = x.split(micro), y.split(micro)
        self.log = []
        self.params = [q for q in self.model.parameters() if q.requires_grad]  # W's (FSDP swaps parameters)
        actions = schedule(self.name, self.pp, accum, self.v)
        # every backward accumulates locally, and the data strategy reduces once the schedule is over: no backward
        # of an interleaved schedule covers all of a rank's chunks, and the one that comes last differs by rank
        with self.no_sync():
            loss_sum = self.run(actions, xs, ys, self._shape(x, micro), accum)
        self.reduce_grads()
        return loss_sum

    def _shape(self, x, micro):
        return micro, x.size(1) // self.tp_split, self.model.cfg.n_embd

    def _cp_split(self, x, y):
        """Under context parallel, this cp rank's zig-zag pieces of every sequence (parallel/cp.py), which every
        stage then runs with their positions; the cp ranks of a stage pass their pieces to the same cp rank of the
        next stage. Without it, x and y whole."""
        if self.cp_n == 1:
            self.positions = None
            return x, y
        self.positions = zigzag_positions(x.size(1), self.cp_n, self.cp_rank, x.device)
        return x[:, self.positions], y[:, self.positions]

    # --- torch's twin: torch.distributed.pipelining's schedules over the same stages
    def torch_step(self, x, y, accum):
        """One step by torch's schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, or its zero-bubble
        ScheduleInterleavedZeroBubble), each of this rank's chunks a PipelineStage. The batch goes in whole: torch
        splits it into accum micro-batches, and scales the gradients by 1 / accum itself."""
        from torch.distributed import pipelining as tp_
        if self.torch_schedule is None:
            # beside a data strategy the stage's module is its wrapper (DistributedDataParallel, FSDP2's root), which
            # torch's schedules drive themselves: no_sync but on the last backward (DDP), gradient sync off until the
            # schedule's REDUCE_GRAD (FSDP2). One chunk per rank then: the wrapper holds all of the rank's chunks
            mods = [self.call] if self.call is not self.model else [_Chunk(self, c) for c in range(self.v)]
            stages = [tp_.PipelineStage(m, self._stage(c), self.pp * self.v, torch.device(self.device),
                                        group=self.group) for c, m in enumerate(mods)]
            single = {"gpipe": tp_.ScheduleGPipe, "1f1b": tp_.Schedule1F1B}
            multi = {"interleaved_1f1b": tp_.ScheduleInterleaved1F1B,
                     "zero_bubble": tp_.ScheduleInterleavedZeroBubble}
            loss = (lambda logits, targets: self.model.loss(logits, targets))
            self.torch_schedule = single[self.name](stages[0], accum, loss_fn=loss) if self.name in single else \
                multi[self.name](stages, accum, loss_fn=loss)
        first, last = self.chunks[0]["first"], self.chunks[-1]["last"]
        losses = []
        self.torch_schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
        return torch.stack(losses).detach().sum() if last else torch.zeros((), device=self.device)

    def evaluate(self, x, y):
        """The loss of one batch on the last stage, zero on the others (train.evaluate sums over ranks)."""
        x, y = self._cp_split(x, y)
        with torch.no_grad():
            return self.run([[(F, c, 0) for c in range(self.v)]] * self.pp, [x], [y], self._shape(x, x.size(0)),
                            train=False)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        """model.generate through the pipeline: the last stage computes the logits and draws each token (the RNG
        draws single's draws), then hands it to every stage. Under tensor parallel each tp rank runs its own copy
        of the pipeline, the last stage's tp ranks gather the vocab slices of the last position's logits and draw
        the same token; under sequence parallel the context is padded on the right to a multiple of tp (attention
        is causal: no real position sees the padding), as tp.pad_sequence_for_sampling does for a whole model."""
        m = self.model
        self.positions = None  # whole sequences on every cp rank, plain causal attention (as parallel/cp.py samples)
        for _ in range(max_new_tokens):
            ctx = idx[:, -m.cfg.block_size:]
            length = ctx.size(1)
            ctx = torch.nn.functional.pad(ctx, (0, -length % self.tp_split))
            shape = (ctx.size(0), ctx.size(1) // self.tp_split, m.cfg.n_embd)
            token = torch.zeros((idx.size(0), 1), dtype=idx.dtype, device=idx.device)
            x = ctx
            for c in range(self.v):
                s = self._stage(c)
                if s > 0:
                    x = torch.empty(shape, dtype=self.dtype, device=self.device)
                    dist.recv(x, self._peer(s - 1), self.group, tag=s)
                x = self.call(x, None, chunk=c)
                if s < self.pp * self.v - 1:
                    dist.send(x, self._peer(s + 1), self.group, tag=s + 1)
                else:
                    logits = x[:, length - 1, :]
                    if self.tp_group is not None:
                        logits = gather_vocab(logits, self.tp_group)
                    token = m.next_token(logits.float())
            dist.broadcast(token, self.peers[-1], group=self.group)
            idx = torch.cat([idx, token], dim=1)
        return idx


class _Chunk(torch.nn.Module):
    """One of this rank's chunks as the module a torch PipelineStage runs: the same blocks (shared, not copied),
    forward(x) -> the activation, or the logits on the last stage (torch's schedule computes the loss)."""

    def __init__(self, pipe, chunk):
        super().__init__()
        c, m = pipe.chunks[chunk], pipe.model
        self.wte = m.wte if c["first"] else None
        self.blocks = torch.nn.ModuleList(m.blocks._modules[str(i)] for i in c["blocks"])
        self.norm, self.head = (m.norm, m.head) if c["last"] else (None, None)
        self.run = lambda x: pipe.call(x, None, chunk=chunk)  # through the data strategy's wrapper

    def forward(self, x):
        return self.run(x)
