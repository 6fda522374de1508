"""The ledger: one JSON line per finished run, appended by its rank 0, so that runs compare across time, commits and
machines (`trainflow ledger` lists and filters it; `trainflow compare` takes a selection of it).

Where: metrics.ledger. `auto` puts it at outputs/ledger.jsonl under the working directory for runs whose directory
lies under it (trainflow's own layouts: outputs/..., multirun/...), else beside the run directory when trainflow owns
the folder that holds it (a sweep folder elsewhere), else nowhere (trainflow writes only into folders it owns; the
log says so and how to name one). A path shares one ledger between runs anywhere, and between machines (a shared
filesystem). `off` writes none.

A line: the run's name and folder, when it ended, its status, the model, the overrides, the fingerprint
(trainflow.record.fingerprint: versions, device, host, commit, config and model hashes, the machine's load, the
step-time band, the replay command), the resolved config, and the headline figures.

A ledger loses only what was cut. Many writers append at once (a sweep's jobs, the rank 0s of runs on several
nodes): each append holds an exclusive flock of the file while it ends a cut last line (a full disk, a writer killed
inside its write: the fragment then stays alone and the new line is whole), writes its line in one write() to a file
opened with O_APPEND, and, should the write fail (a full disk, a file-size limit), truncates the file back to where
it was, so the line is whole or absent. The lock is what makes these steps one: without it another writer's line
lands between a check and a write (glued to a line still being written, or cut by another's truncation); on NFS,
whose O_APPEND alone is not atomic, its flock is a lock of the server's.

A ledger may be shared, and received: a line is appended only to a regular file that is empty or begins with a
ledger line, never through a link (O_NOFOLLOW): a file of something else (a shell's rc file named by mistake) is
left byte for byte as it was, and the run says so in one warning. A reader takes the file as data: a regular file of
bounded size (LOG_FILE_BYTES), each line checked against the shape trainflow writes (LINE), what does not fit
skipped and counted, and every field printed through `shown` (a run name holding a terminal escape or a newline
prints as its escaped text).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainflow.config.schema import MetricsConfig
from trainflow.errors import ReceivedFileError, TrainflowError
from trainflow.util.files import LOG_FILE_BYTES, SMALL_FILE_BYTES, kind_of, read_regular
from trainflow.util.locks import flock_unsupported
from trainflow.util.rundir import made_by_trainflow
from trainflow.util.shown import shown

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"
VERSION = 1  # of a line's layout
_LINE_START = b'{"ledger":'  # how every line trainflow writes begins, whole or cut
_HEAD_BYTES = 1 << 20  # of a ledger's first line read to tell a ledger from a file of something else

NUMBER = "number"  # in a shape: an int or a float, never a bool


class MapOf:
    """In a shape: a dict of string keys whose every value fits `values`."""

    def __init__(self, values: Any) -> None:
        self.values = values


_OPTIONAL_NUMBER = (NUMBER, None)
_OPTIONAL_STR = (str, None)
# The shape of a line as trainflow writes it (entry): a dict's keys are checked where present, a tuple is "one of",
# a list holds items of its one shape. The top level's keys must all be there.
LINE: dict[str, Any] = {
    "ledger": int, "run": str, "run_dir": str, "time": str, "status": str, "model": str, "overrides": [str],
    "fingerprint": (None, {
        "trainflow": _OPTIONAL_STR, "torch": _OPTIONAL_STR, "cuda": _OPTIONAL_STR, "driver": _OPTIONAL_STR,
        "python": _OPTIONAL_STR, "host": str, "cpu_cores": (int, None), "config_hash": str, "model_hash": _OPTIONAL_STR,
        "device": {"type": str, "name": str, "count": int, "nodes": int},
        "code": (None, {"commit": _OPTIONAL_STR, "dirty": (bool, None)}),
        "load": (None, {"busy": (bool, None), "other_cores": _OPTIONAL_NUMBER, "cpu_cores": (int, None),
                        "load_average": (None, [NUMBER])}),
        "step_time": (None, {"n": int, "median": NUMBER, "p10": NUMBER, "p90": NUMBER, "spread": _OPTIONAL_NUMBER}),
        "replay": (None, dict),
    }),
    "figures": {"validation": (None, MapOf(_OPTIONAL_NUMBER)), "monitor": _OPTIONAL_STR, "mode": _OPTIONAL_STR,
                "cost": (None, dict)},
    "config": dict,
}
_FIGURE = _OPTIONAL_NUMBER  # every figure that LINE does not name (steps, step_time_s, mfu, ...)


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
    except LedgerError as exc:
        log.warning("metrics.ledger: %s; this run's summary.json is whole", exc)
        return None
    except OSError as exc:
        log.warning("metrics.ledger: could not append this run to %s (%s); nothing of it was left there and its "
                    "summary.json is whole: point metrics.ledger at a writable file, or set it to off", shown(path),
                    exc.strerror or exc)
        return None
    return path


def append(path: Path, line: dict[str, Any]) -> None:
    """Append one line, whole or not at all, to the ledger at `path` (created when absent): see the module's
    docstring. A path that is no ledger is a LedgerError naming it, with nothing written."""
    data = (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_ledger(path)
    try:
        with _locked(fd) as locked:
            size = os.fstat(fd).st_size
            if not _begins_as_ledger(os.pread(fd, _HEAD_BYTES, 0)):
                raise LedgerError(f"{shown(path)}: is not a ledger (a file of something else: its first line is no "
                                  "ledger line); nothing was written to it: point metrics.ledger at a ledger or a new "
                                  "file, or set it to off")
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a cut last line ends alone: the new line is not glued to it
            try:
                written = 0
                while written < len(data):  # a short write (a filling disk) continues under the lock
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            except OSError:
                if locked:  # the line is whole or absent; without the lock another writer's line may follow it
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                raise
    finally:
        os.close(fd)


def _open_ledger(path: Path) -> int:
    """The ledger opened to read and append (created when absent), never through a link, only a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise LedgerError(f"{shown(path)}: is a symbolic link; trainflow appends to a ledger file itself, never "
                          "through a link it did not make, and nothing was written: give the ledger's own path "
                          "(metrics.ledger=<the file>), or remove the link") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LedgerError(f"{shown(path)}: is {kind_of(mode)}, not a ledger file; nothing was written: point "
                          "metrics.ledger at a file, or set it to off")
    return fd


def _begins_as_ledger(head: bytes) -> bool:
    """Whether a file's first bytes are a ledger's: none, or a first line that is a ledger line (whole, or cut)."""
    first = head.split(b"\n", 1)[0]
    if not head or first.startswith(_LINE_START):
        return True
    try:
        line = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(line, dict) and "ledger" in line


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[bool]:
    """An exclusive flock of the open file, where the filesystem has flock (else False: O_APPEND alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        if not flock_unsupported(exc):
            raise
        yield False
        return
    try:
        yield True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The ledger's lines in the order they were written, and how many lines were left out: those that do not
    parse (a writer killed inside its line) or do not fit LINE (a line of a newer trainflow, or edited)."""
    if not (path.exists() or path.is_symlink()):
        raise LedgerError(f"{shown(path)}: no ledger there; each finished run appends to one (metrics.ledger, by "
                          f"default outputs/{LEDGER_FILE} under the folder it ran from): run from that folder or give "
                          "the ledger's path")
    if path.is_dir():
        raise LedgerError(f"{shown(path)}: is a folder; give the ledger file (outputs/{LEDGER_FILE}), not its folder")
    try:
        data = read_regular(path, LOG_FILE_BYTES)
    except ReceivedFileError as exc:
        raise LedgerError(str(exc)) from None
    lines, skipped = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            skipped += 1
            continue
        if well_formed(line):
            lines.append(line)
        else:
            skipped += 1
    return lines, skipped


def well_formed(line: Any) -> bool:
    """Whether a parsed line has the shape and types trainflow writes (LINE): every reader may then take its fields
    as they are."""
    if not (isinstance(line, dict) and _fits(line, LINE) and line["ledger"] == VERSION and LINE.keys() <= line.keys()):
        return False
    return all(_fits(value, _FIGURE) for key, value in line["figures"].items() if key not in LINE["figures"])


def _fits(value: Any, shape: Any) -> bool:
    if isinstance(shape, tuple):
        return any(_fits(value, one) for one in shape)
    if isinstance(shape, dict):
        return isinstance(value, dict) and all(_fits(value[key], one) for key, one in shape.items() if key in value)
    if isinstance(shape, list):
        return isinstance(value, list) and all(_fits(item, shape[0]) for item in value)
    if isinstance(shape, MapOf):
        return isinstance(value, dict) and all(_fits(item, shape.values) for item in value.values())
    if shape is None:
        return value is None
    if shape is NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, shape) and not (shape is int and isinstance(value, bool))


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


# --- trainflow ledger --------------------------------------------------------------------------------------------


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
