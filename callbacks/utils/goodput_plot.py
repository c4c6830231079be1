"""CostTracker's picture at the end of a run: ``goodput.png``, the goodput ledger as stacked bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..analysis.goodput import LABELS as GOODPUT_LABELS
from ..analysis.goodput import priced

__all__ = ["GOODPUT_COLORS", "plot_goodput"]


#: Colors of the goodput ledger's categories (productive green, the badputs apart).
GOODPUT_COLORS = {"productive": "#55a868", "startup": "#4c72b0", "redone": "#c44e52", "checkpoint": "#8172b3",
                  "validation": "#ccb974", "data_wait": "#8c8c8c", "comm_exposed": "#dd8452", "tail": "#64b5cd",
                  "restart": "#2f2f2f", "unattributed": "#dddddd"}


def plot_goodput(path: Path, ledger: Any, price: float, market: str, other_price: float | None,
                 other_market: str) -> Path:
    """CostTracker's ``goodput.png``: the ledger as stacked bars, in seconds and in dollars on both markets.

    Args:
        path: PNG to write (its directory is created).
        ledger: a :class:`callbacks.analysis.goodput.Ledger`.
        price: USD per instance-hour on the run's market.
        market: the run's market (``on_demand`` or ``spot``).
        other_price: USD per instance-hour on the other market (None: no such price; one dollar bar).
        other_market: the other market's name.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_s, ax_d = fig.subplots(1, 2)
    keys = [k for k in GOODPUT_COLORS if ledger.seconds.get(k, 0.0) > 0]
    bars = [(market.replace("_", "-"), priced(ledger, price))]
    if other_price is not None:
        bars.append((other_market.replace("_", "-"), priced(ledger, other_price)))
    bottom = 0.0
    bottoms = [0.0] * len(bars)
    for key in keys:
        seconds = ledger.seconds[key]
        ax_s.bar(["billed"], [seconds], bottom=[bottom], color=GOODPUT_COLORS[key], label=GOODPUT_LABELS[key])
        bottom += seconds
        heights = [usd.get(key, 0.0) for _, usd in bars]
        ax_d.bar([name for name, _ in bars], heights, bottom=bottoms, color=GOODPUT_COLORS[key])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax_s.set_ylabel("seconds billed (per instance)")
    ax_d.set_ylabel("USD")
    ax_d.legend(*ax_s.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    fig.suptitle(f"Where every dollar went — goodput {ledger.share():.1%} of {ledger.total_s():.1f} s billed")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
