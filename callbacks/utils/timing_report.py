"""StepTiming's picture at the end of a run: ``time_breakdown.png``, and the labels its table shares."""

from __future__ import annotations

from pathlib import Path

from ..analysis.step_time import PARTS

__all__ = ["COLORS", "LABELS", "plot_breakdown"]

#: Row and legend labels of the parts of a step (and of the checkpoint stall).
LABELS = {"data": "data wait", "forward": "forward", "backward": "backward compute",
          "comm_exposed": "exposed comm", "optimizer": "optimizer", "checkpoint": "checkpoint"}
COLORS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868", "comm_exposed": "#c44e52",
          "optimizer": "#dd8452", "checkpoint": "#8172b3"}


def plot_breakdown(path: Path, windows: list[tuple[int, dict[str, float]]], mean: dict[str, float],
                   checkpoint_per_step: float, s: float) -> Path:
    """Stacked bars of the step's parts: one per logged window, and the run's mean with checkpoints.

    Args:
        path: PNG to write (its directory is created).
        windows: ``(global step, per-step means)`` of each logged window.
        mean: the run's per-step means.
        checkpoint_per_step: checkpoint stall amortized per step, stacked on the mean bar.
        s: the run's Amdahl serial fraction, for the title.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_w, ax_m = fig.subplots(1, 2, width_ratios=[4, 1])
    labels = [str(step) for step, _ in windows]
    bottoms = [0.0] * len(windows)
    for part in PARTS:
        heights = [m.get(part, 0.0) * 1e3 for _, m in windows]
        ax_w.bar(labels, heights, bottom=bottoms, color=COLORS[part], label=LABELS[part])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax_w.set_xlabel("global step (end of logged window)")
    ax_w.set_ylabel("ms per optimizer step")
    ax_w.set_title("per window")
    if len(labels) > 12:
        ax_w.set_xticks(range(0, len(labels), max(1, len(labels) // 12)))
    bottom = 0.0
    for part in (*PARTS, "checkpoint"):
        height = (checkpoint_per_step if part == "checkpoint" else mean.get(part, 0.0)) * 1e3
        ax_m.bar(["run mean"], [height], bottom=[bottom], color=COLORS[part], label=LABELS[part])
        bottom += height
    ax_m.set_title("whole run")
    ax_m.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    fig.suptitle(f"Where the time goes — serial fraction s = {s:.3f}, Amdahl ceiling "
                 f"{'inf' if s == 0 else f'x{1 / s:.1f}'}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
