"""What ``CostTracker`` (``callbacks/cost.py``) tells at a run's end: the end table's rows (the bill, both markets, the
launches by instance, the goodput ledger), the launches tag and the goodput plot on the run.

Kept apart from the tracker's accounting: these read its final metrics and state and say them for a person.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..analysis import goodput, keys
from ..analysis.prices import price_for

__all__ = ["CostRows", "segments_text", "usd_text"]

log = logging.getLogger(__name__)


def usd_text(value: float) -> str:
    """Dollars as the end table shows them: cents above a dollar, four decimals below."""
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}"


def segments_text(segments: list[dict[str, Any]]) -> str:
    """``a2-highgpu-1g spot x1: 8.0 s, $0.0029; a3-highgpu-1g spot x1: 46.0 s, $0.0565``."""
    return "; ".join(f"{s['instance']} {str(s['market']).replace('_', '-')} x{s['instances']}: "
                     f"{float(s['billed_s']):.1f} s, {usd_text(float(s['usd']))}" for s in segments)


class CostRows:
    """The rows ``CostTracker`` adds to the end table (mixed into it; reads its ``_final`` metrics and state)."""

    _final: dict[str, float]
    market: str
    instance: Any
    price: float
    lost_steps: int
    restart_s_total: float
    plot_path: Any
    _clock: Any
    _final_instance_s: float | None

    def mean_step_s(self) -> float | None:
        raise NotImplementedError

    def segments(self, instance_s: float | None = None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def ledger(self) -> goodput.Ledger:
        raise NotImplementedError

    @staticmethod
    def _progress_dir(trainer: Any) -> Path:
        raise NotImplementedError

    def _tag_segments(self, trainer: Any) -> None:
        """Which launches ran where (when more than one instance, market or count did), as a tag of the run."""
        segments = self.segments(self._final_instance_s)
        if len(segments) < 2:
            return
        for logger in trainer.loggers:
            run_id, experiment = getattr(logger, "run_id", None), getattr(logger, "experiment", None)
            if run_id and hasattr(experiment, "set_tag"):
                experiment.set_tag(run_id, keys.COST_SEGMENTS_TAG, json.dumps(segments))

    #: Hold the train end's plot until :meth:`after_fit` (a caller that calls it once ``trainer.fit`` returned sets
    #: this): matplotlib took 0.16 s of the digits recipe's 7 s ``trainer.fit``.
    defer_plot = False
    _plot_trainer: Any = None

    def plot_at_train_end(self, trainer: Any) -> None:
        """Write the goodput plot now, or hold it for :meth:`after_fit` (``defer_plot``)."""
        if self.defer_plot:
            self._plot_trainer = trainer
        else:
            self.plot_path = self._write_plot(trainer)

    def after_fit(self, trainer: Any) -> None:
        """After ``trainer.fit`` (``callbacks.utils.run_report.AfterFit``): the plot ``defer_plot`` held back."""
        held, self._plot_trainer = self._plot_trainer, None
        if held is not None:
            self.plot_path = self._write_plot(held)

    def _write_plot(self, trainer: Any) -> Path | None:
        from .goodput_plot import plot_goodput  # matplotlib: only when a plot is drawn

        path = self._progress_dir(trainer).parent / "goodput.png"
        ledger = self.ledger()
        other = "spot" if self.market == "on_demand" else "on_demand"
        try:
            other_price = price_for(self.instance, other)
        except ValueError:
            other_price = None
        try:
            plot_goodput(path, ledger, self.price, self.market, other_price, other)
        except (OSError, ValueError) as err:
            log.warning("CostTracker: could not write %s (%s).", path, err)
            return None
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            experiment = getattr(logger, "experiment", None)
            if run_id and hasattr(experiment, "log_artifact"):
                experiment.log_artifact(run_id, str(path))
        return path

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the CLI's end table: the bill, both markets, and what interruptions wasted."""
        final = self._final
        if not final:
            return []
        hours = final[keys.BILLED_KEY] / 3600.0
        instances = int(final[keys.INSTANCES_KEY])
        rows = [("cost", f"{usd_text(final[keys.COST_KEY])} {self.market.replace('_', '-')} "
                         f"({instances} x {self.instance.name}, {hours:.3f} h billed)")]
        if keys.COST_SPOT_KEY in final:
            saving = f", spot saves {final[keys.SAVINGS_KEY]:.1f}%" if keys.SAVINGS_KEY in final else ""
            rows.append(("cost on-demand / spot",
                         f"{usd_text(final[keys.COST_ON_DEMAND_KEY])} / {usd_text(final[keys.COST_SPOT_KEY])}{saving}"))
        segments = self.segments(self._final_instance_s)
        if len(segments) > 1:  # relaunched on another instance, market or count: each at its own rate
            rows.append(("cost by launch", segments_text(segments)))
        if self.lost_steps or self.restart_s_total:
            rows.append(("cost of interruptions",
                         f"{usd_text(final[keys.LOST_WORK_KEY])} lost work ({self.lost_steps} steps redone x "
                         f"{(self.mean_step_s() or 0.0) * 1e3:.1f} ms mean step), "
                         f"{self.restart_s_total:.0f} s of restarts billed"))
        rows.extend(self.goodput_rows())
        return rows

    def goodput_rows(self) -> list[tuple[str, str]]:
        """The ledger's rows: the goodput share and every non-zero badput, largest first, in seconds and dollars on
        both markets: with the productive time they sum to the billed time."""
        final = self._final
        if keys.GOODPUT_SHARE_KEY not in final:
            return []
        seconds = {k[len(keys.GOODPUT_PREFIX):-2]: v for k, v in final.items()
                   if k.startswith(keys.GOODPUT_PREFIX) and k.endswith("_s")}
        usd = {k: final[keys.goodput_usd_key(k)] for k in seconds}
        other = "spot" if self.market == "on_demand" else "on_demand"
        try:
            ratio = price_for(self.instance, other) / self.price if self.price > 0 else None
        except ValueError:
            ratio = None
        rows = [("goodput", f"{final[keys.GOODPUT_SHARE_KEY]:.1%} of {final[keys.BILLED_KEY]:.1f} s billed bought "
                            f"steps that count ({seconds['productive']:.1f} s, {usd_text(usd['productive'])})")]
        # every non-zero badput, so that the rows add up to the billed time (the top three left ~2 % unnamed);
        # on a free instance (cpu-local) every badput is $0: they are then ranked by time
        ranked = goodput.largest_badputs(usd if any(v > 0 for v in usd.values()) else seconds, n=None)
        for category, _ in ranked:
            dollars = usd[category]
            text = f"{usd_text(dollars)} {self.market.replace('_', '-')}"
            if ratio is not None:
                text += f" / {usd_text(dollars * ratio)} {other.replace('_', '-')}"
            rows.append((f"  badput: {goodput.LABELS[category]}", f"{seconds[category]:.1f} s, {text}"))
        clock = self._clock
        if self.lost_steps and clock.rerun_steps:
            rows.append(("  reruns measured", f"{clock.rerun_steps} steps in {clock.rerun_s:.1f} s "
                                              f"({clock.rerun_s / clock.rerun_steps * 1e3:.1f} ms a step; the lost "
                                              f"first runs are charged at the {(self.mean_step_s() or 0) * 1e3:.1f} "
                                              "ms mean step)"))
        if self.plot_path is not None:
            rows.append(("goodput ledger", str(self.plot_path)))
        return rows
