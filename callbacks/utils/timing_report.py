"""What StepTiming shows at the end of a run: the summary table's rows and ``time_breakdown.png``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis.scaling import amdahl_speedup
from ..analysis.timing import PARTS, amdahl_serial_fraction, serial_fraction

if TYPE_CHECKING:
    from ..timing import StepTiming

__all__ = ["COLORS", "LABELS", "plot_breakdown", "summary_rows"]

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


def summary_rows(timing: StepTiming) -> list[tuple[str, str]]:
    """Rows for the CLI's end table: the mean step and its parts, events, comm, serial fraction."""
    means = timing.mean_parts()
    if not means:
        return [("time/step", f"no step measured after the {timing.warmup_steps} warm-up steps")]
    step = sum(means[p] for p in PARTS)
    rate = timing.samples * timing.world_size / (step * timing.steps) if step > 0 else 0.0
    rows = [("time/step", f"{step * 1e3:.2f} ms mean over {timing.steps} steps, {rate:,.0f} samples/s")]
    for part in PARTS:
        share = means[part] / step if step > 0 else 0.0
        text = f"{means[part] * 1e3:.2f} ms ({share:.1%})"
        if part == "comm_exposed" and timing.comm_mode != "ddp":
            text = ("none (one process)" if timing.world_size == 1 else
                    "not measured (FSDP: inside backward)" if timing.comm_mode == "fsdp" else "not measured")
        rows.append((f"  {LABELS[part]}", text))
    if timing.checkpoints:
        rows.append(("  checkpoint", f"{timing.checkpoints} x {timing.checkpoint_s / timing.checkpoints:.3f} s "
                                     f"(loop stall; {timing.checkpoint_s / timing.steps * 1e3:.2f} ms per step)"))
    if timing.validations:
        rows.append(("  validation", f"{timing.validations} x {timing.validation_s / timing.validations:.3f} s"))
    if timing.comm_mode == "ddp":
        text = (f"{timing.comm.summary_name()}, {means['hook_calls']:.0f} bucket(s), "
                f"{means['bytes'] / 1e6:.3f} MB/step, "
                f"{means['comm'] * 1e3:.2f} ms/step in flight, {means['comm_exposed'] * 1e3:.2f} ms exposed")
        if timing.link is not None:
            gbps = timing.link.bandwidth_bytes_per_s * 8 / 1e9
            text += (f"; model {means['comm_predicted'] * 1e3:.2f} ms "
                     f"(B {gbps:.2f} Gbit/s, a {timing.link.latency_s * 1e6:.1f} us)")
        rows.append(("comm", text))
    elif timing.comm_mode == "fsdp":
        measured = (f"{sum(timing.fsdp_collective_s) / len(timing.fsdp_collective_s) * 1e3:.2f} ms collectives/step "
                    f"(torch.profiler, {len(timing.fsdp_collective_s)} sampled steps)"
                    if timing.fsdp_collective_s else "no step profiled")
        rows.append(("comm (FSDP)", f"{measured}; NOT measured under FSDP: exposed comm (counted as backward), "
                                    "bytes per step, model prediction"))
    share = serial_fraction(means, timing.checkpoint_s / timing.steps)
    s = amdahl_serial_fraction(share, timing.world_size)
    preds = ", ".join(f"x{amdahl_speedup(n, s):.2f} at N={n}" for n in (2, 4, 8))
    ceiling = "inf" if s == 0 else f"{1 / s:.1f}"
    where = "" if timing.world_size == 1 else f" (serial share {share:.3f} of a step on {timing.world_size} devices)"
    rows.append(("amdahl/serial_fraction", f"{s:.3f}{where} -> speedup {preds} (ceiling x{ceiling})"))
    if timing.plot_path is not None:
        rows.append(("time breakdown", str(timing.plot_path)))
    return rows
