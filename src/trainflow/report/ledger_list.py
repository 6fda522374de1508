"""`trainflow ledger`: the ledger's lines selected (by config hash, model, device, host, run name and date) and
listed as a table; `trainflow compare ledger:...` selects its runs through the same filters. The ledger's format and
its reading are trainflow.record.ledger, what a run writes."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainflow.errors import ReceivedFileError
from trainflow.record.ledger import LEDGER_FILE, LedgerError, default_path, read
from trainflow.util.files import SMALL_FILE_BYTES, read_regular
from trainflow.util.shown import shown


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
    """A config hash as given, or the hash of the run whose folder is named (its summary.json read as data)."""
    summary = Path(text).expanduser() / "summary.json"
    if not (summary.exists() or summary.is_symlink()):
        return text
    try:
        found = json.loads(read_regular(summary, SMALL_FILE_BYTES))
    except ReceivedFileError as exc:
        raise LedgerError(f"config={shown(text)}: {exc}") from None
    except (ValueError, UnicodeDecodeError):
        found = None
    fingerprint = found.get("fingerprint") if isinstance(found, dict) else None
    config_hash = fingerprint.get("config_hash") if isinstance(fingerprint, dict) else None
    if not isinstance(config_hash, str):
        raise LedgerError(f"config={shown(text)}: that run's summary.json holds no fingerprint.config_hash (a run of "
                          "an older trainflow, or not a summary.json); give a config hash instead (trainflow ledger "
                          "lists them)")
    return config_hash


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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def table_row(line: dict[str, Any]) -> list[str]:
    """A well-formed line's cells, each as shown (a field holding a terminal escape or a newline prints escaped)."""
    fp, figures = line.get("fingerprint") or {}, line.get("figures") or {}
    band = fp.get("step_time") or {}
    spread = f" ±{band['spread'] * 100:.0f}%" if band.get("spread") is not None else ""
    load = fp.get("load") or {}
    commit = (fp.get("code") or {}).get("commit")
    device = fp.get("device") or {}
    validation = figures.get("validation") or {}
    monitor = figures.get("monitor") or "loss"
    value = validation.get(monitor)
    cells = [line["time"][:19].replace("T", " "), line["run"], line["model"].rsplit(".", 1)[-1],
             f"{device.get('type', '?')} x{device.get('count', '?')}", str(fp.get("config_hash", "-")),
             (commit[:8] + ("+" if (fp.get("code") or {}).get("dirty") else "")) if commit else "-",
             _ms(figures.get("step_time_s")) + spread,
             "-" if figures.get("samples_per_sec") is None else f"{figures['samples_per_sec']:.1f}",
             "-" if figures.get("mfu") is None else f"{figures['mfu'] * 100:.2f}%",
             f"{monitor} {value:.4f}" if value is not None else "-",
             "busy" if load.get("busy") else "", line["status"]]
    return [shown(cell) for cell in cells]


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
        described = shown(filters.describe())
        print(f"{len(kept)} of {len(lines)} run(s) in {shown(path)}" + (f" ({described})" if described else ""))
    if skipped:
        print(f"WARNING {shown(path)}: {skipped} line(s) did not parse and were left out (a writer killed mid-line, "
              "or a line of a newer trainflow or of another shape)")
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
