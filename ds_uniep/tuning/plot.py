"""Pictures of a tuning space: time per plan, and why the invalid plans were rejected."""

from collections import Counter
from typing import Dict, List, Optional, Tuple

from .space import SCHEDULES, Plan, Space

_COLORS = {"sequential": "tab:gray", "pipelined": "tab:blue", "fused": "tab:orange"}
_GEMM_NAMES = {"torch": "torch's GEMM", "uniep": "ds_uniep's GEMM"}


def reason_counts(table: List[Tuple[Plan, Optional[str]]]) -> Counter:
    """How many candidates each kind of rejection (the text before the first ':') hit; a plan may count twice."""
    c: Counter = Counter()
    for _, reason in table:
        if reason:
            for part in reason.split("; "):
                c[part.split(":")[0].split(" (")[0]] += 1
    return c


def plot_space(path: str, space: Space, times: Dict[Plan, float], *, measured: bool, title: str,
               pruned: Optional[Dict[Plan, float]] = None, marks: Optional[Dict[str, float]] = None,
               winner: Optional[Plan] = None) -> str:
    """Write a PNG: left, time per valid plan (enumeration order) by schedule (and, where the plans run
    both grouped GEMMs, by GEMM); right, rejection reasons.

    ``measured`` says whether ``times`` are medians measured on the device or
    the cost model's estimates; the axis label says which, so an estimate is
    never mistaken for a measurement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = space.table()
    index = {p: i for i, p in enumerate(space.enumerate())}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    gemms = sorted({p.expert_gemm for p in times})
    for sched in SCHEDULES:
        for gemm in gemms:  # where the space walks both grouped GEMMs, ds_uniep's plans are triangles
            pts = sorted((index.get(p, len(index)), t) for p, t in times.items()
                         if p.schedule == sched and p.expert_gemm == gemm)
            if pts:
                ax.scatter([i for i, _ in pts], [t for _, t in pts], s=10, color=_COLORS[sched],
                           marker="^" if gemm == "uniep" and len(gemms) > 1 else "o",
                           label=sched + (", " + _GEMM_NAMES[gemm] if len(gemms) > 1 else ""))
    if pruned:
        pts = [(index.get(p, len(index)), t) for p, t in pruned.items()]
        ax.scatter([i for i, _ in pts], [t for _, t in pts], s=14, marker="x", color="tab:red",
                   label="pruned (probe median)")
    for (name, t), style in zip((marks or {}).items(), ("--", ":", "-.")):
        if t is not None:
            ax.axhline(t, linestyle=style, color="black", linewidth=1, label=f"{name} {t:.3f} ms")
    if winner is not None and winner in times:
        ax.scatter([index.get(winner, len(index))], [times[winner]], s=120, marker="*", color="gold",
                   edgecolor="black", zorder=5, label=f"winner {winner.label()}")
    ax.set_xlabel("plan (enumeration order of the valid plans)")
    ax.set_ylabel("median ms, measured" if measured else "analytical estimate, ms (not measured)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    counts = reason_counts(table)
    names = [n for n, _ in counts.most_common()]
    bx.barh(range(len(names)), [counts[n] for n in names], color="tab:purple")
    bx.set_yticks(range(len(names)))
    bx.set_yticklabels([n if len(n) < 48 else n[:45] + "..." for n in names], fontsize=8)
    bx.invert_yaxis()
    n_valid = len(index)
    bx.set_title(f"{n_valid} valid / {len(table) - n_valid} rejected of {len(table)} candidates")
    bx.set_xlabel("rejected candidates (a plan can fail several checks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
