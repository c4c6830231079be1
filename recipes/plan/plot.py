"""The planner's figures: cost against wall time per device plan, and time and cost per batch size.

Each writes one PNG with matplotlib (imported only when a figure is asked for, on the Agg backend, so the
planner runs without a display and ``import recipes.plan`` stays light). They plot what the model computed
and compute nothing themselves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from callbacks.analysis.batch_size import DIMINISHING_FACTOR

if TYPE_CHECKING:
    from callbacks.analysis.batch_size import BatchPlan
    from recipes.plan.model import PlanResult

__all__ = ["write_batch_plot", "write_plot"]


def write_plot(result: PlanResult, path: str | Path) -> Path:
    """Write a PNG of expected cost against expected wall time, Pareto front marked and labelled.

    Args:
        result: From :func:`plan`.
        path: The PNG file to write.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    path = Path(path)
    rows = [r for r in result.rows if math.isfinite(r.wall_h) and math.isfinite(r.cost_usd)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for market, marker in (("on_demand", "o"), ("spot", "s")):
        pts = [r for r in rows if r.market == market]
        if pts:
            ax.scatter(
                [r.wall_h for r in pts],
                [r.cost_usd for r in pts],
                marker=marker,
                alpha=0.6,
                label=market.replace("_", "-"),
            )
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.wall_h)
    if front:
        ax.plot([r.wall_h for r in front], [r.cost_usd for r in front], "k--", lw=1, label="Pareto front")
        ax.scatter(
            [r.wall_h for r in front], [r.cost_usd for r in front], facecolors="none", edgecolors="k", s=120
        )
        for r in front:
            ax.annotate(
                r.label, (r.wall_h, r.cost_usd), textcoords="offset points", xytext=(6, 4), fontsize=8
            )
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if rows and all(r.wall_h > 0 for r in rows):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plain)
    if rows and all(r.cost_usd > 0 for r in rows):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
    inst = result.inputs.instance
    ax.set_xlabel("expected wall time (h)")
    ax.set_ylabel("expected cost (USD)")
    ax.set_title(f"{result.inputs.steps:,} steps on {inst.name}, {result.inputs.scaling_law}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_batch_plot(plan: BatchPlan, path: str, measured: dict[int, float] | None = None) -> str:
    """Time and cost against the global batch, one line per device count (log-log); measured times as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({r.devices for r in plan.rows}):
        rows = [r for r in plan.rows if r.devices == n]
        ax_t.plot([r.batch for r in rows], [r.wall_s for r in rows], marker="o", label=f"N={n}")
        ax_c.plot([r.batch for r in rows], [r.cost_usd for r in rows], marker="o", label=f"N={n}")
    if measured:
        ax_t.scatter(list(measured), list(measured.values()), marker="x", s=80, color="black", zorder=5,
                     label="measured (N=1)")
    for ax, label in ((ax_t, "wall time to target, s"), (ax_c, "cost to target, USD")):
        ax.axvline(plan.b_noise, color="grey", ls="--", lw=1)
        ax.axvspan(DIMINISHING_FACTOR * plan.b_noise, max(r.batch for r in plan.rows) * 1.5, color="grey",
                   alpha=0.12, label=f"B > {DIMINISHING_FACTOR:g} B_noise")
        ax.set_xscale("log", base=2)
        if ax is ax_t or any(r.cost_usd > 0 for r in plan.rows):
            ax.set_yscale("log")
        ax.set_xlabel("global batch B")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax_t.set_title(f"B_noise = {plan.b_noise:,.0f} (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
