"""What `trainflow compare` compares: a side is a run folder, a sweep folder or a ledger selection, read as runs
(RunView: the headline figures, the fingerprint, the config, and from a folder the steady log intervals, the curves
and the profiler's summary); two sides are paired run by run (a sweep's jobs by their overrides)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainflow.errors import TrainflowError
from trainflow.metrics.noise import read_metrics_log, steady_intervals
from trainflow.record import ledger
from trainflow.report.ledger_list import parse_filters, select
from trainflow.report.runs import find_runs, load_run, read_overrides
from trainflow.util.shown import shown

LEDGER_PREFIX = "ledger:"


class CompareError(TrainflowError):
    """A side that cannot be compared, or sides that cannot be paired; the message says the fix."""


@dataclass
class RunView:
    """One run as compare reads it: from its folder (with its log intervals and curves) or from a ledger line."""

    name: str
    dir: Path | None
    figures: dict[str, Any]  # ledger.headline_figures
    fingerprint: dict[str, Any]
    config: dict[str, Any]
    intervals: dict[str, list[float]] = field(default_factory=dict)
    curves: dict[str, dict[int, float]] = field(default_factory=dict)  # train/loss, val/<metric> by step
    profiler: dict[str, Any] | None = None
    note: str = ""  # what its reading left out
    steady_from: int = 0  # the step after which its steady state began (its start or resume, then excluded steps)


@dataclass
class Side:
    """A side of a comparison: one run, a sweep's runs (paired one by one), or a ledger selection (pooled)."""

    text: str  # as given
    kind: str  # run | sweep | ledger
    runs: list[RunView]
    note: str = ""  # e.g. lines of the ledger that did not parse


def run_view(path: Path, root: Path) -> RunView:
    """A finished run's folder; a failed or unfinished one is refused in one line."""
    record = load_run(path, root)
    if record.summary is None or record.status != "finished":
        raise CompareError(f"{path}: the run has not finished ({record.status}: {record.error}); compare finished "
                           "runs (they hold summary.json)")
    summary = record.summary
    log_file = read_metrics_log(path / "metrics.jsonl")
    start = summary.get("resumed_from_step") or 0
    excluded = (summary.get("steady_state") or {}).get("excluded_steps") or 0
    curves: dict[str, dict[int, float]] = {}
    for entry in log_file.entries:
        for key, value in entry.items():
            if (key == "train/loss" or key.startswith("val/")) and value is not None:
                curves.setdefault(key, {})[entry["step"]] = float(value)
    note = (f"{shown(path / 'metrics.jsonl')}: {log_file.skipped} line(s) left out (cut off, or not of the shape "
            "trainflow writes)" if log_file.skipped else "")
    return RunView(record.name, path, ledger.headline_figures(summary), summary.get("fingerprint") or {},
                   summary.get("config") or {}, steady_intervals(log_file.entries, start, excluded), curves,
                   summary.get("profiler"), note, start + excluded)


def ledger_view(line: dict[str, Any]) -> RunView:
    return RunView(line.get("run", "?"), Path(line["run_dir"]) if line.get("run_dir") else None,
                   line.get("figures") or {}, line.get("fingerprint") or {}, line.get("config") or {})


def resolve_side(text: str, where: str, default_ledger: Path | None) -> Side:
    """A side from the command line: `ledger:<filters>`, a run folder, or a sweep folder (checkpoints are taken by
    trainflow.report.checkpoints before this); one line naming the side when it cannot be compared."""
    try:
        return _side(text, where, default_ledger)
    except TrainflowError as exc:
        raise CompareError(f"{where}: {exc}") from None


def _side(text: str, where: str, default_ledger: Path | None) -> Side:
    if text.startswith(LEDGER_PREFIX):
        words = [w for w in text.removeprefix(LEDGER_PREFIX).split(",") if w]
        filters, path = parse_filters(words)
        path = path or default_ledger or ledger.default_path()
        lines, skipped = ledger.read(path)
        chosen = select(lines, filters)
        if not chosen:
            raise CompareError(f"{text} selects no run of {path} ({len(lines)} line(s)); trainflow ledger {path} "
                               "lists them")
        note = f"{skipped} line(s) of {path} did not parse and were left out" if skipped else ""
        return Side(text, "ledger", [ledger_view(line) for line in chosen], note)
    root = Path(text).expanduser()
    found = find_runs(root)
    runs = [run_view(root, root.parent)] if found == [root] else [run_view(p, root) for p in found]
    return Side(text, "run" if found == [root] else "sweep", runs, "; ".join(r.note for r in runs if r.note))


def pairs(a: Side, b: Side) -> list[tuple[list[RunView], list[RunView]]]:
    """What is compared with what: a run or a ledger selection with the other side whole; a sweep's jobs one by one
    with the other sweep's, by their overrides (all of them, else those each sweep varies), else by their order."""
    if (a.kind == "sweep") != (b.kind == "sweep"):
        sweep, other = (a, b) if a.kind == "sweep" else (b, a)
        raise CompareError(f"{sweep.text} is a sweep of {len(sweep.runs)} run(s) and {other.text} is not; compare a "
                           f"sweep with a sweep, or give one of its job folders (e.g. {sweep.runs[0].dir})")
    if a.kind != "sweep":
        return [(a.runs, b.runs)]
    for key in (_overrides, _varied(a), _varied(b)):
        ka, kb = {key(r): r for r in a.runs}, {key(r): r for r in b.runs}
        if len(ka) == len(a.runs) and ka.keys() == kb.keys():
            return [([ka[k]], [kb[k]]) for k in ka]
    if len(a.runs) == len(b.runs):
        return [([ra], [rb]) for ra, rb in zip(a.runs, b.runs, strict=True)]
    raise CompareError(f"the sweeps {a.text} ({len(a.runs)} jobs) and {b.text} ({len(b.runs)} jobs) cannot be paired: "
                       "their jobs' overrides differ and their counts too; compare job folders one by one")


def _overrides(run: RunView) -> tuple[str, ...]:
    return tuple(_job_overrides(run))


def _job_overrides(run: RunView) -> list[str]:
    return read_overrides(run.dir / ".hydra" / "overrides.yaml") if run.dir else []


def _varied(side: Side) -> Callable[[RunView], tuple[str, ...]]:
    """A key of a sweep's job: its overrides less those every job of the sweep shares (the swept values)."""
    common = set.intersection(*(set(_job_overrides(r)) for r in side.runs)) if side.runs else set()
    return lambda run: tuple(o for o in _job_overrides(run) if o not in common)
