"""The ledger: one JSON line per finished run, appended by its rank 0, so that runs compare across time, commits and
machines. This module is the line's format, its append and its reading; `trainflow ledger` (listing and filtering
it) and `trainflow compare`'s selections of it read it through trainflow.report.ledger_list.

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

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainflow.config.schema import MetricsConfig
from trainflow.errors import ReceivedFileError, TrainflowError
from trainflow.util.files import LOG_FILE_BYTES, kind_of, read_regular
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
