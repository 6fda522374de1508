"""The ledger: one JSON line per finished run, appended by its rank 0, so that runs compare across time, commits and
machines (`trainflow ledger` lists and filters it; `trainflow compare` takes a selection of it).

Where: metrics.ledger. `auto` puts it at outputs/ledger.jsonl under the working directory for runs whose directory
lies under it (trainflow's own layouts: outputs/..., multirun/...), else beside the run directory when trainflow owns
the folder that holds it (a sweep folder elsewhere), else nowhere (trainflow writes only into folders it owns; the
log says so and how to name one). A path shares one ledger between runs anywhere, and between machines (a shared
filesystem). `off` writes none.

A line: the run's name and folder, when it ended, its status, the model, the overrides, the fingerprint
(trainflow.report.fingerprint: versions, device, host, commit, config and model hashes, the machine's load, the
step-time band, the replay command), the resolved config, and the headline figures. Many writers append at once (a
sweep's jobs, the rank 0s of runs on several nodes): each line is one write() to a file opened with O_APPEND, under
an exclusive flock of the file, so no two lines interleave and none is lost, on a local disk and on NFS (whose
O_APPEND alone is not atomic; its flock is a lock of the server's). A reader skips a line that does not parse (a
writer killed inside its write) and says how many it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainflow.config.schema import MetricsConfig
from trainflow.errors import TrainflowError
from trainflow.util.locks import flock_unsupported
from trainflow.util.rundir import made_by_trainflow

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"
VERSION = 1  # of a line's layout


class LedgerError(TrainflowError):
    """A ledger that cannot be read, or a selection of it that cannot be made; the message says the fix."""


def ledger_path(setting: str, run_dir: Path) -> Path | None:
    """The ledger a run appends to (metrics.ledger); None for `off`, and for `auto` where no folder of trainflow's
    is there to hold it."""
    if setting == "off":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    here, run = Path.cwd().resolve(), run_dir.resolve()
    if run.is_relative_to(here):
        return here / "outputs" / LEDGER_FILE
    return run.parent / LEDGER_FILE if made_by_trainflow(run.parent) else None


def default_path() -> Path:
    """The ledger `trainflow ledger` and `compare ledger:...` read when none is named: this folder's outputs/."""
    return Path("outputs") / LEDGER_FILE


def entry(summary: dict[str, Any], run_dir: Path, ledger: Path) -> dict[str, Any]:
    """The ledger line of a run whose summary.json was just written."""
    config = summary.get("config") or {}
    run = run_dir.resolve()
    name = (config.get("trainer") or {}).get("run_name")
    if not name:
        base = next((p for p in (ledger.parent.resolve(), Path.cwd().resolve()) if run.is_relative_to(p)), None)
        name = str(run.relative_to(base)) if base else str(run)
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(overrides_file)] if overrides_file.is_file() else []
    stopped = (summary.get("checkpoint") or {}).get("stopped_by")
    return {
        "ledger": VERSION,
        "run": name,
        "run_dir": str(run),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": f"stopped by {stopped}" if stopped else "finished",
        "model": str((config.get("model") or {}).get("_target_", "")),
        "overrides": overrides,
        "fingerprint": summary.get("fingerprint"),
        "figures": headline_figures(summary),
        "config": config,
    }


def headline_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What a ledger line keeps of a summary's figures, and what compare judges."""
    steady = summary.get("steady_state") or {}
    task = summary.get("task") or {}
    return {
        "steps": summary.get("steps"),
        "step_time_s": steady.get("step_time_s"),
        "step_time_device_s": steady.get("step_time_device_s"),
        "samples_per_sec": steady.get("samples_per_sec"),
        "tokens_per_sec": steady.get("tokens_per_sec"),
        "mfu": summary.get("mfu"),
        "peak_memory_bytes": summary.get("peak_memory_bytes"),
        "data_wait_fraction": summary.get("data_wait_fraction"),
        "compile_time_s": (summary.get("compile") or {}).get("compile_time_s"),
        "loss_first": (summary.get("train_loss") or {}).get("first"),
        "loss_last": (summary.get("train_loss") or {}).get("last"),
        "validation": summary.get("validation"),
        "monitor": task.get("monitor"),
        "mode": task.get("mode"),
        "world_size": summary.get("world_size"),
        "cost": summary.get("cost"),
    }


def record(metrics: MetricsConfig, run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """Rank 0, once summary.json is written: append the run's line to its ledger. A ledger that cannot be written
    is said in one warning: the run itself finished, and its summary.json is whole."""
    path = ledger_path(metrics.ledger, run_dir)
    if path is None:
        if metrics.ledger == "auto":
            log.info("ledger: none written: the run directory lies outside the working folder, in a folder trainflow "
                     "did not make; name one with metrics.ledger=PATH (e.g. one shared by every run)")
        return None
    try:
        append(path, entry(summary, run_dir, path))
    except OSError as exc:
        log.warning("metrics.ledger: could not append this run to %s (%s); its summary.json is whole: point "
                    "metrics.ledger at a writable file, or set it to off", path, exc.strerror or exc)
        return None
    return path


def append(path: Path, line: dict[str, Any]) -> None:
    """One line, in one write under an exclusive lock of the file, then fsync'd."""
    data = (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with _locked(fd):
            written = 0
            while written < len(data):  # a regular file takes it whole; a short write continues under the lock
                written += os.write(fd, data[written:])
            os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    """An exclusive flock of the open file, where the filesystem has flock (else O_APPEND alone: a local disk)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        if not flock_unsupported(exc):
            raise
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The ledger's lines in the order they were written, and how many lines did not parse (left out)."""
    if not path.exists():
        raise LedgerError(f"{path}: no ledger there; each finished run appends to one (metrics.ledger, by default "
                          f"outputs/{LEDGER_FILE} under the folder it ran from): run from that folder or give the "
                          "ledger's path")
    if not path.is_file():
        raise LedgerError(f"{path}: not a file; give the ledger file (outputs/{LEDGER_FILE}), not its folder")
    lines, skipped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                skipped += 1
                continue
            if isinstance(line, dict) and line.get("ledger") == VERSION:
                lines.append(line)
            else:
                skipped += 1
    return lines, skipped


@dataclass
class Filters:
    """What selects lines: a config hash (or a run folder, whose config's hash is taken), part of the model's name,
    of the device's, of the host's or of the run's name, a date range (inclusive, YYYY-MM-DD or ISO time), the last N
    of what is left."""

    config: str | None = None
    model: str | None = None
    device: str | None = None
    host: str | None = None
    run: str | None = None
    since: str | None = None
    until: str | None = None
    last: int | None = None

    def describe(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)


def select(lines: list[dict[str, Any]], filters: Filters) -> list[dict[str, Any]]:
    """The lines the filters keep, in order."""
    config = config_of(filters.config) if filters.config else None
    since, until = (_moment(text, end, key) if text else None for text, end, key in ((filters.since, False, "since"),
                                                                                   (filters.until, True, "until")))
    kept = []
    for line in lines:
        fp = line.get("fingerprint") or {}
        device = fp.get("device") or {}
        moment = _moment(line.get("time", ""), False)
        if ((config and not str(fp.get("config_hash", "")).startswith(config))
                or (filters.model and filters.model.lower() not in line.get("model", "").lower())
                or (filters.device and filters.device.lower() not in
                    f"{device.get('type', '')} {device.get('name', '')}".lower())
                or (filters.host and filters.host.lower() not in str(fp.get("host", "")).lower())
                or (filters.run and filters.run not in line.get("run", ""))
                or (since and (moment is None or moment < since))
                or (until and (moment is None or moment > until))):
            continue
        kept.append(line)
    return kept[-filters.last:] if filters.last else kept


def config_of(text: str) -> str:
    """A config hash as given, or the hash of the run whose folder is named."""
    folder = Path(text).expanduser()
    if (folder / "summary.json").is_file():
        try:
            return json.loads((folder / "summary.json").read_text())["fingerprint"]["config_hash"]
        except (ValueError, KeyError, TypeError):
            raise LedgerError(f"config={text}: that run's summary.json holds no fingerprint (a run of an older "
                              "trainflow); give a config hash instead (trainflow ledger lists them)") from None
    return text


def _moment(text: str, end_of_day: bool, key: str | None = None) -> datetime | None:
    """A date (YYYY-MM-DD: its start, or its end for `until`) or an ISO time, in UTC; what does not parse is None
    (a line's), or one line naming the filter `key`."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        if key is not None:
            raise LedgerError(f"{key}={text}: not a date; give YYYY-MM-DD or an ISO time (2026-01-31T12:00)") from None
        return None
    if len(text) == 10 and end_of_day:
        when = when.replace(hour=23, minute=59, second=59)
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def parse_filters(pairs: list[str]) -> tuple[Filters, Path | None]:
    """Filters from `key=value` words (and `ledger=PATH`, the file to read); one line naming a wrong key."""
    known = {f.name for f in fields(Filters)}
    values: dict[str, Any] = {}
    path = None
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise LedgerError(f"ledger:{pair}: not key=value; give e.g. ledger:config=3f2a9c01d4e5,last=5")
        if key == "ledger":
            path = Path(value).expanduser()
        elif key not in known:
            raise LedgerError(f"ledger:{key}: no such filter; use {', '.join(sorted(known))} (and ledger=PATH)")
        elif key == "last":
            if not value.isdigit() or int(value) < 1:
                raise LedgerError(f"ledger:last={value}: give a number of runs >= 1")
            values[key] = int(value)
        else:
            values[key] = value
    return Filters(**values), path


# --- trainflow ledger --------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def table_row(line: dict[str, Any]) -> list[str]:
    fp, figures = line.get("fingerprint") or {}, line.get("figures") or {}
    band = fp.get("step_time") or {}
    spread = f" ±{band['spread'] * 100:.0f}%" if band.get("spread") is not None else ""
    load = fp.get("load") or {}
    commit = (fp.get("code") or {}).get("commit")
    device = fp.get("device") or {}
    validation = figures.get("validation") or {}
    monitor = figures.get("monitor") or "loss"
    return [line.get("time", "")[:19].replace("T", " "), line.get("run", ""), line.get("model", "").rsplit(".", 1)[-1],
            f"{device.get('type', '?')} x{device.get('count', '?')}", str(fp.get("config_hash", "-")),
            (commit[:8] + ("+" if (fp.get("code") or {}).get("dirty") else "")) if commit else "-",
            _ms(figures.get("step_time_s")) + spread,
            "-" if figures.get("samples_per_sec") is None else f"{figures['samples_per_sec']:.1f}",
            "-" if figures.get("mfu") is None else f"{figures['mfu'] * 100:.2f}%",
            f"{monitor} {validation[monitor]:.4f}" if monitor in validation else "-",
            "busy" if load.get("busy") else "", line.get("status", "")]


HEADER = ["time (UTC)", "run", "model", "device", "config", "commit", "step time", "samples/s", "MFU", "val",
          "machine", "status"]


def render_table(lines: list[dict[str, Any]]) -> str:
    rows = [HEADER, *(table_row(line) for line in lines)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def command(args: argparse.Namespace) -> int:
    """List the runs of a ledger (every finished run appends a line: metrics.ledger), oldest first, filtered by
    config hash, model, device, host, run name and date; --json prints the lines themselves."""
    path = args.ledger or default_path()
    lines, skipped = read(path)
    filters = Filters(args.config, args.model, args.device, args.host, args.run, args.since, args.until, args.last)
    kept = select(lines, filters)
    if args.json:
        for line in kept:
            print(json.dumps(line))
    else:
        print(render_table(kept))
        print(f"{len(kept)} of {len(lines)} run(s) in {path}" + (f" ({filters.describe()})" if filters.describe()
                                                                  else ""))
    if skipped:
        print(f"WARNING {path}: {skipped} line(s) did not parse and were left out (a writer killed mid-line, or a line "
              "of a newer trainflow)")
    return 0


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"give a number of runs >= 1; got {text}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", type=Path, nargs="?", default=None,
                   help=f"the ledger file (default: outputs/{LEDGER_FILE} under this folder)")
    p.add_argument("--config", help="a config hash (or its first characters), or a run folder: its config's runs")
    p.add_argument("--model", help="part of the model's _target_, e.g. GPT")
    p.add_argument("--device", help="part of the device's type or name, e.g. cuda or H100")
    p.add_argument("--host", help="part of the host's name")
    p.add_argument("--run", help="part of the run's name")
    p.add_argument("--since", help="runs that ended on or after this date (YYYY-MM-DD, UTC)")
    p.add_argument("--until", help="runs that ended on or before this date (YYYY-MM-DD, UTC)")
    p.add_argument("--last", type=_count, help="only the last N of the runs selected")
    p.add_argument("--json", action="store_true", help="print the selected lines as JSON, one per line")
