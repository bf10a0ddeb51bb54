"""Print the pipeline schedules' action lists and draw them as Gantt charts, one row per rank (parallel/pp.py).

    python -m tools.pp_schedule --show                          # every schedule at pp=4, m=8: lists and bubbles
    python -m tools.pp_schedule --pp 4 --micro 8 --out docs/pp  # + the Gantt charts, docs/pp/schedules.png

Each slot is timed by pp.simulate with unit costs (forward 1, backward 2; B 1 + W 1 where zero_bubble splits it),
communication free: a chart shows the schedule's shape (where ranks wait, how many micro-batches each holds), not
any machine's speed. Arrows are the point-to-point sends: activations forward, gradients back.
"""
import argparse
import os

from parallel import pp

COLORS = {pp.F: "#4c8bd6", pp.B: "#e0843a", pp.W: "#6bb36b"}


def show(name, p, m, v):
    acts = pp.schedule(name, p, m, v)
    lines = [f"{name} (pp={p}, m={m}{f', v={v}' if v > 1 else ''}): bubble {pp.bubble(acts, v):.3f}, "
             f"peak micro-batches held per rank {[pp.peak_in_flight(a) for a in acts]}"]
    for r, a in enumerate(acts):
        lines.append(f"  rank {r}: " + " ".join(f"{k}{i}" + (f".{c}" if v > 1 else "") for k, c, i in a))
    return "\n".join(lines)


def draw(ax, name, p, m, v):
    """One schedule's Gantt chart on `ax`: a bar per action, labelled with its micro-batch, idle left blank."""
    acts = pp.schedule(name, p, m, v)
    times = pp.simulate(acts, v)
    ends = {}
    for r, row in enumerate(times):
        for start, end, (kind, chunk, i) in row:
            shade = 1 - 0.35 * chunk / max(1, v - 1) if v > 1 else 1  # later chunks darker
            ax.barh(r, end - start, left=start, color=COLORS[kind], alpha=shade, edgecolor="black", linewidth=0.4)
            ax.text((start + end) / 2, r, f"{i}", ha="center", va="center", fontsize=6)
            ends[kind, pp.virtual(r, chunk, p), i] = (end, r)
    n = p * v
    for (kind, s, i), (end, r) in ends.items():  # the sends: F to the next stage, B back to the previous
        to = (pp.F, s + 1, i) if kind == pp.F and s < n - 1 else (pp.B, s - 1, i) if kind == pp.B and s > 0 else None
        if to in ends:
            start = next(st for st, _, a in times[to[1] % p] if a == (to[0], to[1] // p, i))
            ax.annotate("", xy=(start, to[1] % p), xytext=(end, r),
                        arrowprops=dict(arrowstyle="->", lw=0.4, color="gray", alpha=0.6))
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    held = [pp.peak_in_flight(a) for a in acts]
    ax.set_title(f"{name}{f' (v={v})' if v > 1 else ''}: bubble {pp.bubble(acts, v):.2f}, peak held {held}", fontsize=9)
    return max(e for row in times for _, e, _ in row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--virtual", type=int, default=2, help="interleaved_1f1b: chunks per rank")
    ap.add_argument("--show", action="store_true", help="print every schedule's action lists")
    ap.add_argument("--out", help="a folder for the Gantt charts (PNG)")
    a = ap.parse_args(argv)
    names = [(n, a.virtual if n == "interleaved_1f1b" else 1) for n in ("gpipe", "1f1b", "interleaved_1f1b",
                                                                       "zero_bubble")]
    if a.show or not a.out:
        for n, v in names:
            print(show(n, a.pp, a.micro, v))
    if a.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        os.makedirs(a.out, exist_ok=True)
        fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.2 * len(names)), sharex=True)
        span = max(draw(ax, n, a.pp, a.micro, v) for ax, (n, v) in zip(axes, names))
        axes[0].set_xlim(0, span)  # one time axis: the schedules' lengths compare
        axes[-1].set_xlabel("time (forward = 1, backward = 2)")
        fig.legend(handles=[Patch(color=COLORS[pp.F], label="F forward"), Patch(color=COLORS[pp.B], label="B backward "
                                                                                "(input grad under zero_bubble)"),
                            Patch(color=COLORS[pp.W], label="W weight grad"), Patch(color="white", label="idle")],
                   loc="upper center", bbox_to_anchor=(0.5, 0.965), fontsize=8, ncol=4)
        fig.suptitle(f"pipeline schedules, pp={a.pp}, m={a.micro} (python -m tools.pp_schedule, 2026-12-01)",
                     fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        path = os.path.join(a.out, "schedules.png")
        fig.savefig(path, dpi=130)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
