"""The batch-size plan in words: its table, picks and caveats, and the predicted-vs-measured table.

Printing only, on plain stdout (the validation table is Markdown, to paste): :func:`print_plan` reads a
:class:`~callbacks.analysis.batch_size.BatchPlan`, :func:`print_validation` the rows
:func:`recipes.plan.batch_train.validate` measured, and says whether the predicted rankings by time and
by steps agree with the measured ones. The figure is :func:`recipes.plan.plot.write_batch_plot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.analysis.batch_size import DIMINISHING_FACTOR
from recipes.run.common import human_duration

if TYPE_CHECKING:
    from callbacks.analysis.batch_size import BatchPlan, StepTimeModel
    from recipes.plan.batch_train import ValidationRow

__all__ = ["print_plan", "print_validation"]


def _ranking(values: dict[int, float]) -> list[int]:
    return [b for b, _ in sorted(values.items(), key=lambda kv: kv[1])]


def print_validation(rows: list[ValidationRow], info: dict[str, Any]) -> bool:
    """Print the predicted-vs-measured table (Markdown); True when the rankings by time and by steps agree."""
    print(f"\ntarget {info['target']}; B_noise {info['b_noise']:.1f} (noise-scale run {info['noise_run']}); "
          f"reference: batch {info['ref_batch']} took {info['ref_steps']} steps -> S_min {info['s_min']:.1f}; "
          "step time t(b) = "
          f"{info['step_time_model']['t0'] * 1e3:.2f} ms + {info['step_time_model']['per_example_s'] * 1e6:.1f} us x b "
          f"(fit within {info['step_time_model']['max_rel_error']:.0%} of the sweep)\n")
    print("| batch | steps predicted | steps measured | error | step predicted | step measured "
          "| time predicted | time measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:+.0%}"
        ms = "not reached" if r.measured_steps is None else str(r.measured_steps)
        mt = "-" if r.measured_s is None else f"{r.measured_s:.2f} s"
        mss = "-" if r.measured_step_s is None else f"{r.measured_step_s * 1e3:.1f} ms"
        print(f"| {r.batch}{' (ref)' if r.reference else ''} | {r.predicted_steps:.0f} | {ms} | "
              f"{'(fitted)' if r.reference else pct(r.steps_error)} | {r.predicted_step_s * 1e3:.1f} ms | {mss} | "
              f"{r.predicted_s:.2f} s | {mt} | {pct(r.time_error)} |")
    done = [r for r in rows if r.measured_s is not None and r.measured_steps is not None]
    agree = len(done) == len(rows)
    if not agree:
        print("\nsome runs did not reach the target: no ranking.")
        return False
    for what, pred, meas in (("time", {r.batch: r.predicted_s for r in rows}, {r.batch: r.measured_s for r in rows}),
                             ("steps", {r.batch: r.predicted_steps for r in rows},
                              {r.batch: float(r.measured_steps) for r in rows})):
        p, m = _ranking(pred), _ranking(meas)
        errs = [abs(pred[b] / meas[b] - 1) for b in pred]
        print(f"ranking by {what}: predicted {p}, measured {m} -> {'agree' if p == m else 'DIFFER'}; "
              f"mean |error| {sum(errs) / len(errs):.0%}, max {max(errs):.0%}")
        agree = agree and p == m
    return agree


def _fmt_s(seconds: float) -> str:
    return human_duration(seconds)


def print_plan(plan: BatchPlan, model: StepTimeModel, caption: str) -> None:
    """The plan as a table (one row per batch and device count), the picks and the caveats."""
    measured_max = max((b for b, _ in model.points), default=0.0)
    print(f"B_noise {plan.b_noise:,.1f}, S_min {plan.s_min:,.1f} steps; step time t(b) = {model.t0 * 1e3:.3g} ms + "
          f"{model.per_example_s * 1e6:.3g} us x b per device (fit within {model.max_rel_error:.0%} of "
          f"{len(model.points)} measured points). {caption}")
    header = ("batch", "N", "steps", "S/S_min", "E/E_min", "x2 saves", "step", "wall", "cost $", "")
    lines = [header]
    for r in plan.rows:
        marks = []
        if r is plan.fastest:
            marks.append("fastest")
        if r is plan.cheapest:
            marks.append("cheapest")
        if r.diminishing:
            marks.append(f"diminishing (B > {DIMINISHING_FACTOR:g} B_noise)")
        if r.batch / r.devices > measured_max:
            marks.append("step time extrapolated")
        lines.append((str(r.batch), str(r.devices), f"{r.steps:,.0f}", f"{r.steps_over_min:.2f}",
                      f"{r.examples_over_min:.2f}", f"{r.doubling_saves:.0%}", _fmt_s(r.step_s), _fmt_s(r.wall_s),
                      f"{r.cost_usd:.4g}", ", ".join(marks)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) if i < len(header) - 1 else cell for i, (cell, w) in
                        enumerate(zip(line, widths, strict=True))).rstrip())
    for key, r in (("fastest", plan.fastest), ("cheapest", plan.cheapest)):
        print(f"{key}: batch {r.batch} on {r.devices} device(s): {r.steps:,.0f} steps x {_fmt_s(r.step_s)} = "
              f"{_fmt_s(r.wall_s)}, ${r.cost_usd:.4g}")
    past = sorted({r.batch for r in plan.rows if r.diminishing})
    if past:
        print(f"past diminishing returns: batch {', '.join(map(str, past))} (> {DIMINISHING_FACTOR:g} x B_noise = "
              f"{DIMINISHING_FACTOR * plan.b_noise:,.0f}): doubling them saves under 10 % of the steps for twice "
              "the examples.")
    for b, n, why in plan.skipped:
        print(f"skipped batch {b} on {n} devices: {why}.")
