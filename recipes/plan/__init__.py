"""Plan a training run: how many devices, on which market, for what expected time and cost.

Given the time of one step on one device, the number of steps, a scaling law and an instance from the
price catalog (``callbacks/analysis/prices.yaml``), this tabulates, for each device count N and each market
(on-demand, spot), the expected wall time and cost of the run, and picks the cheapest plan that meets
a deadline and the fastest that fits a budget. The model:

* speedup ``C(N)`` from Amdahl (``--serial-fraction``) or the Universal Scalability Law
  (``--usl-a``/``--usl-b``), so the work takes ``W = steps x step_time / C(N)``;
* ``ceil(N / GPUs per instance)`` instances (a machine without GPUs counts as one device);
* on-demand: never interrupted. Spot: each instance is interrupted with probability
  ``--interruption-rate`` per ``--rate-period-h`` (Poisson; default: the catalog row's typical rate,
  with its source), any interruption stops the synchronous job, so its MTBF is
  ``M = 1 / (instances x -ln(1 - p) / period)``;
* a checkpoint every Daly-optimal interval (save cost ``--save-cost-s``), ``--restart-s`` per restart,
  and the exact expected wall time of Daly's exponential model (see ``callbacks/analysis/cost_model.py``);
  every instance is billed for the whole expected wall time. A job shorter than that interval needs
  no periodic checkpoint, and the table says so.

Examples::

    # 10,000 steps of 3 s on one H100, 5% serial: what do 8 GPUs cost, on which market?
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 \\
        --instance a3-highgpu-1g --interruption-rate 0.05 --rate-period-h 1 \\
        --save-cost-s 30 --restart-s 120

    # no --interruption-rate: the catalog row's typical spot rate (printed, with where it comes from)
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 --instance a3-highgpu-1g

    # the cheapest plan done within 2 h, the fastest within $50, and a cost-vs-time plot
    python -m recipes.plan --step-time 3 --steps 10000 --usl-a 0.02 --usl-b 0.0005 \\
        --instance a3-highgpu-8g --interruption-rate 0.05 --deadline-h 2 --budget-usd 50 --plot plan.png

    # an AWS instance (the catalog has on-demand prices only there): give a spot price, as JSON
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 --instance p5.48xlarge \\
        --price-spot 22.0 --interruption-rate 0.05 --json

From a finished run (``--run RUN_ID_OR_RUN_DIR``) the measured numbers replace ``--step-time`` and
``--steps``: the run's MLflow record (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``) gives

* the step time: StepTiming's run mean ``time/mean/step_s`` (compute only: checkpoints and validation
  excluded), else the mean of its ``time/step_s`` windows, else the all-in wall duration (MLflow run
  start to end) / steps. A run on ``W`` devices (``manifest.json``'s ``world_size``) measured the
  step at N = W, so one device's step time is that times ``C(W)``;
* the steps: the furthest step the run logged (and its newest checkpoint record, given a run
  directory); ``--steps`` overrides;
* the scaling law: ``--serial-fraction`` or ``--usl-a``/``--usl-b`` when given (the user's word wins),
  else the fit of a ``recipes.scale`` parent run (``--scale-run``: USL when it fitted best, else
  Amdahl), else the run's own ``amdahl/serial_fraction`` (StepTiming), else an error naming what is
  missing.

::

    # what would this run cost on 1-64 H100s, on which market, done within 1 h?
    python -m recipes.plan --run 3f2a...e1 --instance a3-highgpu-1g --interruption-rate 0.05 --deadline-h 1
    python -m recipes.plan --run runs/digits/20250601-120000-ab12 --scale-run 9c0d...77 \
        --instance a3-highgpu-8g --interruption-rate 0.05 --steps 100000 --json

Exit status: 0 with a plan; 1 when no row meets ``--deadline-h`` or ``--budget-usd`` (the answer
says so, naming the limit and the best achievable); 2 on bad input (one line on stderr naming the value).

**Which batch size** (``python -m recipes.plan batch ...``), on how many devices, reaches the same loss soonest
or cheapest.

From the gradient noise scale ``B_noise`` (McCandlish et al. 2018; ``GradientNoiseScale`` logs it as
``noise_scale/b_simple``), the steps one run took to a target at its batch, and step times measured at a
few batch sizes, this predicts for each global batch ``B`` and device count ``N``: the steps to the same
loss ``S(B) = S_min (1 + B_noise / B)``, the step time ``t(B/N) + comm(N)``, the wall time and the
dollars; it picks the fastest and the cheapest and marks batches past diminishing returns
(``B > 4 B_noise``: doubling the batch saves under 10 % of the steps). The math is in
:mod:`callbacks.analysis.batch_size`.

::

    # all by hand: B_noise 200, a run took 900 steps at batch 32, step times at 3 per-device batches
    python -m recipes.plan batch --b-noise 200 --ref-steps 900 --ref-batch 32 \\
        --step-times 32:0.011,64:0.015,128:0.024 --batches 32,64,128,256,512,1024 --devices 1,2,4,8 \\
        --params 1.2e6 --bandwidth-gbps 100 --instance a3-highgpu-8g --plot batch.png

    # from runs: B_noise and the steps to val/acc 0.97 from a run with GradientNoiseScale, step times from
    # other runs (each run's time/mean/step_s at its data.init_args.batch_size)
    python -m recipes.plan batch --run RUN_ID --target val/acc=0.97 --step-time-runs ID1,ID2,ID3

    # step times from a short sweep this command runs (recipes.fit, --sweep-steps steps per batch size)
    python -m recipes.plan batch --run RUN_ID --sweep configs/digits.yaml --batches 16,32,64,128

    # validate the prediction on a recipe: train to the target at each batch and compare (trains; minutes)
    python -m recipes.plan batch --validate configs/digits.yaml --batches 16,32,64,128 --ref-batch 32 \\
        --target val/acc=0.97

Only ``--sweep``/``--validate`` train (in ``python -m recipes.fit`` subprocesses, described in
:mod:`recipes.plan.batch_train`); the planner itself imports neither torch nor Lightning. Exit status: 0;
1 when ``--validate`` finds the predicted ranking differs from the measured one or a run missed the target; 2
on bad input (one line on stderr naming the value).

Where things live: this module is the command line of both (parsing flags into inputs, printing, exit
codes; ``__main__.py`` runs it). Its submodules hold the rest, and none parses a command line: the model
(:mod:`~recipes.plan.model`), a finished run's measurements from MLflow (:mod:`~recipes.plan.runs`), the table
and JSON (:mod:`~recipes.plan.report`), the figures (:mod:`~recipes.plan.plot`), and for the batch size: what a
run says (:mod:`~recipes.plan.batch_runs`), the training of ``--sweep``/``--validate``
(:mod:`~recipes.plan.batch_train`) and its tables (:mod:`~recipes.plan.batch_report`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from callbacks.analysis.batch_size import StepTimeModel, fit_step_time, plan_batches, s_min_from_reference
from callbacks.analysis.comm_model import gbps_to_bytes_per_s, ring_allreduce_time
from callbacks.analysis.keys import B_NOISE_KEY, SERIAL_KEY, STEP_KEY
from callbacks.analysis.prices import MARKETS, Instance, get_instance, load_catalog, price_for, with_overrides
from recipes.plan.batch_report import print_plan, print_validation
from recipes.plan.batch_runs import BATCH_PARAM, read_run, store_client
from recipes.plan.batch_train import sweep_step_times, validate
from recipes.plan.model import DEFAULT_DEVICES, PlanInputs, PlanResult, PlanRow, law_speedup, plan
from recipes.plan.plot import write_batch_plot, write_plot
from recipes.plan.report import print_overhead_check, print_table, projection_note, rich_console, to_json
from recipes.plan.runs import (
    RunMeasurement,
    device_caveat,
    interruption_record,
    law_from_scale_run,
    measure_run,
    resolve_run,
    tracking_client,
)
from recipes.run.common import (
    ArgumentParser,
    UsageError,
    check_output_file,
    human_duration,
    os_error_line,
    parse_or_exit,
    positive_ints,
    run_main,
)

__all__ = [
    "DEFAULT_DEVICES",
    "PlanInputs",
    "PlanResult",
    "PlanRow",
    "RunMeasurement",
    "batch_main",
    "human_duration",
    "main",
    "measure_run",
    "plan",
    "print_table",
    "to_json",
    "write_plot",
]

BATCH_PROG = "python -m recipes.plan batch"
DEFAULT_BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048)


# ------------------------------------------------------------------------------ python -m recipes.plan


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m recipes.plan",
        description="Expected wall time and cost per device count and market (on-demand vs spot). "
                    "For which batch size: python -m recipes.plan batch --help.",
    )
    p.add_argument("--run", metavar="RUN_ID_OR_RUN_DIR",
                   help="plan from a finished run: its MLflow run id or run directory (measured step time, steps, "
                        "scaling law)")
    p.add_argument("--step-time", type=float,
                   help="seconds per step on one device (required without --run; overrides the run's)")
    p.add_argument("--steps", type=int, help="steps in the run (required without --run; overrides the run's)")
    law = p.add_argument_group("scaling law (one of; with --run, else the run's amdahl/serial_fraction)")
    law.add_argument("--serial-fraction", type=float, help="Amdahl serial fraction s in [0, 1]")
    law.add_argument("--usl-a", type=float, help="USL contention coefficient a >= 0")
    law.add_argument("--usl-b", type=float, help="USL coherency coefficient b >= 0")
    law.add_argument("--scale-run", metavar="RUN_ID",
                     help="the fit logged by a recipes.scale parent run (USL if it fitted best, else Amdahl)")
    p.add_argument("--instance", required=True, help="instance name from the price catalog")
    p.add_argument("--catalog", help="price catalog YAML (default: callbacks/analysis/prices.yaml)")
    p.add_argument("--price-on-demand", type=float, help="override the on-demand USD per instance-hour")
    p.add_argument("--price-spot", type=float, help="override the spot USD per instance-hour")
    p.add_argument(
        "--interruption-rate",
        type=float,
        help="probability that one spot instance is interrupted per period, in [0, 1) (default: the catalog "
        "row's typical rate and period, with its source)",
    )
    p.add_argument("--rate-period-h", type=float,
                   help="period of --interruption-rate, hours (default 1 with --interruption-rate)")
    p.add_argument(
        "--save-cost-s", type=float, default=30.0, help="seconds to write a checkpoint"
    )
    p.add_argument(
        "--restart-s", type=float, default=120.0, help="seconds to restart and reload"
    )
    p.add_argument(
        "--devices",
        default=",".join(map(str, DEFAULT_DEVICES)),
        help="comma-separated device counts",
    )
    p.add_argument("--deadline-h", type=float, help="pick the cheapest plan done within this many hours")
    p.add_argument("--budget-usd", type=float, help="pick the fastest plan within this many USD")
    p.add_argument("--json", action="store_true", help="print rows and picks as JSON instead of a table")
    p.add_argument("--plot", help="write a PNG of cost vs wall time with the Pareto front")
    return p


def _explicit_law(args: argparse.Namespace) -> dict[str, float] | None:
    law = {"serial_fraction": args.serial_fraction, "usl_a": args.usl_a, "usl_b": args.usl_b}
    law = {k: v for k, v in law.items() if v is not None}
    if law and args.scale_run:
        flags = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in law.items())
        raise ValueError(f"give either --scale-run {args.scale_run} or {flags}, not both.")
    return law or None


def _interruption(args: argparse.Namespace, instance: Instance) -> tuple[float, float, str]:
    """``(rate, period in hours, where it comes from)``: the user's, else the catalog row's typical rate."""
    if args.interruption_rate is not None:
        period_h = 1.0 if args.rate_period_h is None else args.rate_period_h
        if not period_h > 0:
            raise ValueError(f"--rate-period-h {args.rate_period_h!r} must be a positive number of hours.")
        return args.interruption_rate, period_h, "--interruption-rate"
    if args.rate_period_h is not None:
        raise ValueError(f"--rate-period-h {args.rate_period_h:g} is the period of --interruption-rate: give both, "
                         "or neither for the catalog's typical rate.")
    if instance.spot_interruption_rate is not None:
        return (instance.spot_interruption_rate, instance.spot_interruption_period_h,
                f"catalog default for {instance.name} spot: {instance.spot_interruption_source}")
    if instance.spot_usd_per_h is None:
        return 0.0, 1.0, f"unused: the catalog has no spot price for {instance.name!r}"
    raise ValueError(f"--interruption-rate is required: the catalog has no spot interruption rate for "
                     f"{instance.name!r} (give its row spot_interruption_rate, spot_interruption_period_h and "
                     "spot_interruption_source, or pass --interruption-rate P [--rate-period-h H]).")


def _inputs_from_args(args: argparse.Namespace) -> tuple[PlanInputs, dict | None, str]:
    """The plan's inputs, (with ``--run``) where the measured ones come from, and where the interruption rate does."""
    catalog = load_catalog(args.catalog)
    instance = with_overrides(get_instance(catalog, args.instance), args.price_on_demand, args.price_spot)
    rate, period_h, rate_source = _interruption(args, instance)
    law = _explicit_law(args)
    law_source = "command line" if law else None
    source = None
    step_time, steps = args.step_time, args.steps
    client = uri = None
    if args.run or args.scale_run:
        client, uri = tracking_client()
    if law is None and args.scale_run:
        law, law_source = law_from_scale_run(client, args.scale_run, uri)
    if args.run:
        run, run_dir = resolve_run(client, args.run, uri)
        measured = measure_run(client, run, run_dir)
        if law is None and measured.serial_fraction is not None:
            key = measured.serial_fraction_key
            law_source = f"the run's {key}" + (f" (measured on {measured.world_size} devices)" if key != SERIAL_KEY
                                               else "")
            law = {"serial_fraction": measured.serial_fraction}
        if law is None:
            raise ValueError(f"no scaling law: run {measured.run_id} logged no {SERIAL_KEY}; give --scale-run "
                             "PARENT_RUN_ID (a recipes.scale sweep), --serial-fraction S or --usl-a A --usl-b B.")
        speedup = law_speedup(measured.world_size, law)
        note = projection_note(measured, law_source or "")
        source = asdict(measured)
        source["projection_note"] = note
        source["run_serial_fraction"] = source.pop("serial_fraction")  # what the run measured, used or not
        source.update(speedup_at_world_size=speedup, scaling_law_source=law_source)
        caveat = device_caveat(measured.measured_device, measured.device_source, instance)
        source["caveats"] = []
        if step_time is None:
            step_time = measured.measured_step_s * speedup  # one device's step: C(W) times longer
            source["step_time_source"] = measured.step_time_source
            source["caveats"] += [caveat] if caveat else []
        else:
            source["step_time_source"] = "--step-time"
        if steps is None:
            steps = measured.steps
        else:
            source["steps_source"] = "--steps"
        source["step_time_s"], source["steps"] = step_time, steps
        check = interruption_record(client, run)
        source["overhead_check"] = None if check is None else asdict(check)
    for flag, value in (("--step-time", step_time), ("--steps", steps)):
        if value is None:
            raise ValueError(f"{flag} is required (or plan from a finished run with --run RUN_ID_OR_RUN_DIR).")
    law = law or {}
    inputs = PlanInputs(
        step_time_s=step_time,
        steps=steps,
        instance=instance,
        serial_fraction=law.get("serial_fraction"),
        usl_a=law.get("usl_a"),
        usl_b=law.get("usl_b"),
        interruption_rate=rate,
        rate_period_s=period_h * 3600.0,
        save_cost_s=args.save_cost_s,
        restart_s=args.restart_s,
        devices=tuple(positive_ints("--devices", args.devices)),
        deadline_h=args.deadline_h,
        budget_usd=args.budget_usd,
    )
    return inputs, source, rate_source


def _print_source(source: dict) -> None:
    where = source["run_id"] + (f" ({source['run_dir']})" if source["run_dir"] else "")
    world = source["world_size"]
    per_device = (f" x C({world}) = {source['speedup_at_world_size']:.3f} -> {source['step_time_s']:.6g} s on one "
                  "device" if world > 1 else "")
    print(f"from run {where}:")
    print(f"  step time  {source['measured_step_s']:.6g} s on {world} device(s) ({source['world_size_source']})"
          f"{per_device} [{source['step_time_source']}]")
    print(f"  steps      {source['steps']:,} [{source['steps_source']}]")
    print(f"  scaling    {source['scaling_law_source']}")
    if source.get("projection_note"):
        print(f"             {source['projection_note']}")
    for caveat in source["caveats"]:
        print(f"caveat: {caveat}")
    check = source.get("overhead_check")
    if check:
        print_overhead_check(check)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner from the command line.

    Args:
        argv: Arguments without the program name; None for ``sys.argv[1:]``.

    Returns:
        0 with a plan; 1 when no row meets the deadline or budget; 2 on bad input.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["batch"]:  # which batch size: batch_main below
        return batch_main(argv[1:])
    args = parse_or_exit(_parser(), argv)
    return run_main(lambda: _plan_main(args))  # a file that cannot be written: one line (run_main)


def _plan_main(args: argparse.Namespace) -> int:
    try:
        if args.plot:  # before the table: a plot that cannot be written is bad input, not a traceback after it
            check_output_file("--plot", args.plot)
        inputs, source, rate_source = _inputs_from_args(args)
    except (KeyError, ValueError, FileNotFoundError, UsageError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    try:
        result = plan(inputs)
    except ValueError as err:  # inputs each valid whose products overflow (a step time of 1e308 s)
        print(f"error: --step-time {inputs.step_time_s:g} s x --steps {inputs.steps} gives no finite plan "
              f"({err.args[0] if err.args else err}); give a real step time and step count.", file=sys.stderr)
        return 2
    if args.json:
        out = to_json(result)
        out["interruption_rate_source"] = rate_source
        if source is not None:
            out["run"] = source
        print(json.dumps(out, indent=2))
    else:
        if source is not None:
            _print_source(source)
        if rate_source.startswith("catalog default"):
            rich_console().print(f"interruption rate {inputs.interruption_rate:g} per {inputs.rate_period_s / 3600:g} "
                                 f"h ({rate_source}; pass --interruption-rate to override)", markup=False,
                                 highlight=False)
        print_table(result)
    if args.plot:
        written = write_plot(result, args.plot)
        if not args.json:
            print(f"wrote {written}")
    return 0 if result.feasible else 1


def _one_line(err: Exception) -> str:
    """The message of a refusal: a ``KeyError``'s or ``ValueError``'s text, an ``OSError``'s file and reason."""
    if isinstance(err, OSError):
        return os_error_line(err)
    return str(err.args[0]) if err.args else str(err)


# ------------------------------------------------------------------------ python -m recipes.plan batch


def _step_times(text: str) -> tuple[list[int], list[float]]:
    """``"32:0.011,64:0.015"`` -> per-device batches and seconds."""
    batches, seconds = [], []
    for part in text.split(","):
        b, sep, t = part.strip().partition(":")
        try:
            bb, tt = int(b), float(t)
        except ValueError:
            raise UsageError(f"--step-times: {part.strip()!r} is not BATCH:SECONDS (e.g. 32:0.011).") from None
        if not sep or bb < 1 or not (math.isfinite(tt) and tt > 0):
            raise UsageError(f"--step-times: {part.strip()!r} needs a batch >= 1 and a positive time in seconds.")
        batches.append(bb)
        seconds.append(tt)
    return batches, seconds


def _target(text: str) -> tuple[str, float]:
    """``"val/acc=0.97"`` -> (metric, value); a metric reaches it when at least it (``val/loss<=0.1`` for at most)."""
    for sep in ("<=", ">=", "="):
        if sep in text:
            key, _, value = text.partition(sep)
            try:
                return key.strip() + ("<=" if sep == "<=" else ""), float(value)
            except ValueError:
                break
    raise UsageError(f"--target: {text!r} is not METRIC=VALUE (e.g. val/acc=0.97, or val/loss<=0.1).")


def _batch_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=BATCH_PROG, description="Steps, wall time and cost to the same loss per batch size and "
                                              "device count (McCandlish et al. 2018).")
    src = p.add_argument_group("noise scale and reference (by hand, or from --run)")
    src.add_argument("--b-noise", type=float, help="gradient noise scale B_noise, examples")
    src.add_argument("--ref-steps", type=float, help="steps a run took to the target at --ref-batch")
    src.add_argument("--ref-batch", type=int, help="that run's global batch (with --validate: the reference batch)")
    src.add_argument("--s-min", type=float, help="S_min directly, instead of --ref-steps/--ref-batch")
    src.add_argument("--run", help="MLflow run with GradientNoiseScale: B_noise, its batch and steps (to --target)")
    src.add_argument("--target", help="METRIC=VALUE the steps are counted to (val/acc=0.97; val/loss<=0.1); "
                                      "default: the run's last step. --validate: several, comma-separated, "
                                      "ascending (the runs stop at the last)")
    st = p.add_argument_group("step times (one of)")
    st.add_argument("--step-times", help="per-device BATCH:SECONDS pairs, e.g. 32:0.011,64:0.015")
    st.add_argument("--step-time-runs", help="comma-separated MLflow run ids: each one's time/mean/step_s at its batch")
    st.add_argument("--sweep", metavar="CONFIG", help="run short recipes.fit runs of CONFIG at each of --batches")
    st.add_argument("--sweep-steps", type=int, default=60, help="steps per sweep run")
    p.add_argument("--validate", metavar="CONFIG", help="train CONFIG to --target at each of --batches and compare")
    p.add_argument("--val-every-examples", type=int, default=320, help="--validate: validate every this many examples")
    p.add_argument("--max-epochs", type=int, default=20, help="--validate: give up after this many epochs")
    p.add_argument("--stamp", help="--validate: reuse the finished runs of this stamp (printed at the end)")
    p.add_argument("--batches", help=f"global batch sizes (default {','.join(map(str, DEFAULT_BATCHES))})")
    p.add_argument("--devices", default="1", help="data-parallel device counts, e.g. 1,2,4,8")
    comm = p.add_argument_group("gradient communication per step on N > 1 devices (ring all-reduce)")
    comm.add_argument("--params", type=float, help="model parameters")
    comm.add_argument("--bytes-per-param", type=float, default=4.0, help="bytes per gradient element")
    comm.add_argument("--bandwidth-gbps", type=float, help="link bandwidth, Gbit/s")
    comm.add_argument("--latency-us", type=float, default=5.0, help="per-hop latency, microseconds")
    p.add_argument("--instance", default="cpu-local", help="instance from the price catalog")
    p.add_argument("--catalog", help="price catalog YAML (default callbacks/analysis/prices.yaml)")
    p.add_argument("--market", default="on_demand", choices=MARKETS, help="which price")
    p.add_argument("--price-per-h", type=float, help="override the instance's price per hour, USD")
    p.add_argument("--json", action="store_true", help="print the rows and picks as JSON")
    p.add_argument("--plot", help="write time and cost vs batch size to this PNG")
    return p


def _batch_main(args: argparse.Namespace) -> int:
    if args.plot:  # before any table or training run
        check_output_file("--plot", args.plot)
    targets = [_target(t) for t in args.target.split(",")] if args.target else []
    target = targets[-1] if targets else None
    batches = positive_ints("--batches", args.batches, "16,32,64") if args.batches else None
    devices = positive_ints("--devices", args.devices)
    for flag in ("sweep_steps", "val_every_examples", "max_epochs"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1.")
    if args.validate:
        if target is None or batches is None or args.ref_batch is None:
            raise UsageError("--validate needs --target, --batches and --ref-batch.")
        tables = validate(args.validate, batches, args.ref_batch, targets, sweep_steps=args.sweep_steps,
                          val_every_examples=args.val_every_examples, max_epochs=args.max_epochs, stamp=args.stamp)
        agree = all([print_validation(rows, info) for rows, info in tables])
        print(f"\nruns: experiment {tables[0][1]['experiment']!r}, --stamp {tables[0][1]['stamp']} (re-print without "
              "training: the same command with --stamp)")
        rows, info = tables[-1]
        if args.plot:
            model = StepTimeModel(info["step_time_model"]["t0"], info["step_time_model"]["per_example_s"])
            plan = plan_batches(info["b_noise"], info["s_min"], batches, model)
            measured = {r.batch: r.measured_s for r in rows if r.measured_s is not None}
            print(f"wrote {write_batch_plot(plan, args.plot, measured)}")
        return 0 if agree else 1
    # the noise scale and S_min
    b_noise, s_min, ref_batch, ref_steps = args.b_noise, args.s_min, args.ref_batch, args.ref_steps
    client = uri = None
    if args.run or args.step_time_runs:
        client, uri = store_client()
    if args.run:
        ref = read_run(client, args.run, uri, target)
        b_noise = b_noise if b_noise is not None else ref.b_noise
        ref_batch = ref_batch if ref_batch is not None else ref.batch
        ref_steps = ref_steps if ref_steps is not None else ref.steps
        if b_noise is None:
            raise UsageError(f"run {args.run} logged no {B_NOISE_KEY} (add callbacks.noise_scale.GradientNoiseScale "
                             "to the run) and no --b-noise was given.")
        if ref_steps is None:
            raise UsageError(f"run {args.run} never reached {args.target}: give another --target or --ref-steps.")
    if b_noise is None:
        raise UsageError("give --b-noise B (or --run RUN_ID of a run with GradientNoiseScale).")
    if not (math.isfinite(b_noise) and b_noise > 0):
        raise UsageError(f"--b-noise {b_noise!r} must be a positive number of examples.")
    if s_min is None:
        if ref_steps is None or ref_batch is None:
            raise UsageError("give --ref-steps S --ref-batch B (a run's steps to the target at its batch), or --s-min.")
        try:
            s_min = s_min_from_reference(ref_steps, ref_batch, b_noise)
        except ValueError as err:
            raise UsageError(f"--ref-steps/--ref-batch: {err}") from None
    # step times
    given = [f for f in ("step_times", "step_time_runs", "sweep") if getattr(args, f)]
    if len(given) != 1:
        raise UsageError("give exactly one source of step times: --step-times, --step-time-runs or --sweep "
                         f"(got {', '.join('--' + g.replace('_', '-') for g in given) or 'none'}).")
    if args.step_times:
        sb, stimes = _step_times(args.step_times)
    elif args.step_time_runs:
        sb, stimes = [], []
        for rid in [r.strip() for r in args.step_time_runs.split(",") if r.strip()]:
            ref = read_run(client, rid, uri, None)
            if not ref.step_s or not ref.per_device_batch:
                raise UsageError(f"--step-time-runs: run {rid} has no {STEP_KEY} or no {BATCH_PARAM} param.")
            sb.append(ref.per_device_batch)
            stimes.append(ref.step_s)
    else:
        sweep = batches or list(DEFAULT_BATCHES[:4])
        sb, stimes, _ = sweep_step_times(args.sweep, sweep, args.sweep_steps, time.strftime("%Y%m%d-%H%M%S"),
                                         Path("runs/plan-batch"))
    model = fit_step_time(sb, stimes)
    # communication and price
    comm_s = None
    if (args.params is None) != (args.bandwidth_gbps is None):
        raise UsageError("give both --params and --bandwidth-gbps for the communication per step, or neither.")
    if args.params is not None:
        if not (args.params > 0 and args.bandwidth_gbps > 0 and args.bytes_per_param > 0 and args.latency_us >= 0):
            raise UsageError(f"--params {args.params:g}, --bandwidth-gbps {args.bandwidth_gbps:g}, --bytes-per-param "
                             f"{args.bytes_per_param:g} must be positive and --latency-us {args.latency_us:g} >= 0.")
        size, bw = args.params * args.bytes_per_param, gbps_to_bytes_per_s(args.bandwidth_gbps)
        lat = args.latency_us * 1e-6

        def comm_s(n: int) -> float:
            return ring_allreduce_time(size, n, bw, lat)
    elif max(devices) > 1:
        print("note: no --params/--bandwidth-gbps: communication on N > 1 devices is taken as free.")
    catalog = load_catalog(args.catalog)
    instance = get_instance(catalog, args.instance)
    if args.price_per_h is not None:
        instance = with_overrides(instance, **{"on_demand" if args.market == "on_demand" else "spot": args.price_per_h})
    price = price_for(instance, args.market)
    plan = plan_batches(b_noise, s_min, batches or list(DEFAULT_BATCHES), model, devices, comm_s, price,
                        instance.devices_per_instance)
    caption = f"{instance.name} {args.market} ${price:g}/h per instance ({instance.source}, {instance.date})."
    if args.json:
        print(json.dumps({"b_noise": plan.b_noise, "s_min": plan.s_min, "price_per_instance_h": price,
                          "step_time_model": {"t0": model.t0, "per_example_s": model.per_example_s},
                          "rows": [r.as_dict() for r in plan.rows], "fastest": plan.fastest.as_dict(),
                          "cheapest": plan.cheapest.as_dict(),
                          "skipped": [list(s) for s in plan.skipped]}, indent=2))
    else:
        print_plan(plan, model, caption)
    if args.plot:
        written = write_batch_plot(plan, args.plot)
        if not args.json:
            print(f"wrote {written}")
    return 0


def batch_main(argv: Sequence[str] | None = None) -> int:
    """``python -m recipes.plan batch ...``: 0 with a plan; 1 (``--validate``) when rankings differ; 2 on bad input."""
    def body() -> int:
        try:
            args = _batch_parser().parse_args(argv)
            return _batch_main(args)
        except (UsageError, ValueError, KeyError, FileNotFoundError) as err:
            print(f"error: {_one_line(err)}", file=sys.stderr)
            return 2
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1

    return run_main(body)  # a file that cannot be written (say the plot's folder, removed since the check): one line

