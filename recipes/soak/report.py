"""The soak's report: one JSON over every chain, a table per fault kind, and the invariants' verdicts.

Per fault the JSON (``--out``) holds the kind, the moment, the exit code(s), the lost work in steps
(the furthest step the struck launch logged to MLflow's ``train/loss`` minus the step the next
launch resumed from, from its stderr; when the soak corrupted a checkpoint in between, the newest
good step right after the fault instead; a relaunch that finds the run already complete counts as
resuming from its final step) and the time to resume (the next launch's start to its first
logged training step, from MLflow's timestamps; ``null`` if it was stopped before one, its wall
time is kept).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from recipes.soak.faults import INVARIANTS, Fault, PlannedFault
from recipes.soak.observe import KEEP

if TYPE_CHECKING:
    from recipes.soak.soak import Soak


def build_report(soaks: Sequence[Soak], plan: Sequence[PlannedFault]) -> dict[str, Any]:
    """One report over every chain: faults in plan order, runs, per-kind figures and the invariants."""
    first, args = soaks[0], soaks[0].args
    faults = sorted((f for soak in soaks for f in soak.faults), key=lambda f: f.index)
    runs = [run for soak in soaks for run in soak.runs]
    problems: dict[str, list[str]] = {name: [] for name in INVARIANTS}
    for fault in faults:
        for p in fault.problems:
            problems[p["invariant"]].append(f"fault {fault.index + 1} ({fault.kind}): {p['detail']}")
    for run in runs:
        for p in run.problems:
            problems[p["invariant"]].append(f"{run.name}: {p['detail']}")
    stores = []
    for soak in soaks:
        running, broken, summary = soak.store_problems()
        problems["no_run_left_running"] += running
        problems["store_usable"] += broken
        stores.append(summary)
    invariants = {name: {"ok": not found, "problems": found} for name, found in problems.items()}
    return {
        "settings": {"faults": args.faults, "seed": args.seed, "kinds": list(args.kinds), "chains": args.chains,
                     "faults_per_run": args.faults_per_run, "ddp": args.ddp, "store": args.store, "epochs": args.epochs,
                     "batches": args.batches, "every": args.every, "keep": KEEP, "repo": str(first.repo),
                     "workdir": str(first.root), "command": first.command("<run name>")[1:]},
        "skipped_kinds": {k: v for soak in soaks for k, v in soak.skipped_kinds.items()},
        "reference": {k: v for k, v in first.reference.items() if k != "schema"},
        "plan": [asdict(p) for p in plan],
        "faults": [{**{k: v for k, v in asdict(f).items() if k != "corrupted_after"}, "held": f.held} for f in faults],
        "runs": [asdict(r) for r in runs],
        "by_kind": by_kind(faults),
        "stores": stores,
        "launches": sum(len(soak.launches) for soak in soaks),
        "invariants": invariants,
        "ok": all(v["ok"] for v in invariants.values()),
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def by_kind(faults: Sequence[Fault]) -> dict[str, dict[str, Any]]:
    """Per kind: count, struck, held/failed, lost steps mean/max, time to resume mean/max, exit codes."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(f.kind for f in faults):
        group = [f for f in faults if f.kind == kind]
        lost = [f.lost_steps for f in group if f.lost_steps is not None]
        resume = [f.time_to_resume_s for f in group if f.time_to_resume_s is not None]
        out[kind] = {"count": len(group), "struck": sum(f.struck for f in group),
                     "held": sum(f.held for f in group), "failed": sum(not f.held for f in group),
                     "lost_steps_mean": _mean(lost), "lost_steps_max": max(lost) if lost else None,
                     "time_to_resume_mean_s": _mean(resume), "time_to_resume_max_s": max(resume) if resume else None,
                     "exit_codes": sorted({str(c) for f in group for c in f.exit_codes})}
    return out


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Chaos soak — {len(report['faults'])} faults, seed {report['settings']['seed']}, "
                        f"{len(report['runs'])} run(s), {report['launches']} launches, {report['elapsed_s']:.0f} s")
    for column in ("kind", "faults", "struck", "held", "failed", "lost steps mean / max", "time to resume mean / max",
                   "exit codes"):
        table.add_column(column, justify="left" if column in ("kind", "exit codes") else "right")
    for kind, row in report["by_kind"].items():
        lost = "-" if row["lost_steps_mean"] is None else f"{row['lost_steps_mean']:.1f} / {row['lost_steps_max']}"
        resume = "-" if row["time_to_resume_mean_s"] is None else \
            f"{row['time_to_resume_mean_s']:.1f} s / {row['time_to_resume_max_s']:.1f} s"
        failed = f"[red]{row['failed']}[/]" if row["failed"] else "0"
        table.add_row(kind, str(row["count"]), str(row["struck"]), str(row["held"]), failed, lost, resume,
                      " ".join(row["exit_codes"]))
    console.print(table)
    checks = Table(title="Invariants")
    checks.add_column("invariant")
    checks.add_column("result")
    checks.add_column("first problems")
    for name, result in report["invariants"].items():
        checks.add_row(name, "[green]held[/]" if result["ok"] else f"[red]FAILED ({len(result['problems'])})[/]",
                       "\n".join(p[:300] for p in result["problems"][:3]))
    console.print(checks)
    for run in report["runs"]:
        found = run["checks"].get("ledger")
        if isinstance(found, dict) and found.get("ledger"):
            ledger, lost, startup = found["ledger"], found["lost_steps"], found["startup_s"]
            console.print(f"{run['name']}: goodput {ledger['share']:.1%} of {ledger['billed_s']:.1f} s billed; redone "
                          f"{ledger['seconds']['redone']:.2f} s (${ledger['usd']['redone']:.4f}) for "
                          f"{lost['ledger']} lost steps (loss history: {lost['faults']}); start-up "
                          f"{startup['ledger']:.2f} s (${ledger['usd']['startup']:.4f}) against "
                          f"{startup['launches_on_the_books']:.2f} s of {startup['launches']} launch(es) on the "
                          f"books (within {startup['bounds'][0]:.2f} .. {startup['bounds'][1]:.2f} s)",
                          highlight=False, markup=False)
    for kind, reason in report["skipped_kinds"].items():
        console.print(f"[yellow]{kind} skipped: {reason}[/]")
