"""A failed rank, named: each rank records its failure where the elastic agent looks, and the launching process
reads every rank's record to say which one failed first and why."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from trainflow.errors import TrainflowError


class WorkerError(TrainflowError):
    """A rank of a launched run failed; the message names the rank and carries its traceback."""

    exit_code = 1  # a crash, not a usage error


def record_failure(exc: BaseException) -> None:
    """Write the exception where the elastic agent looks (TORCHELASTIC_ERROR_FILE), so the launcher can name it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or getattr(exc, "_trainflow_recorded", False):  # keep the first record: its time counts
        return
    with contextlib.suppress(AttributeError, TypeError):
        exc._trainflow_recorded = True
    data: dict[str, Any] = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        },
        "trainflow_time": time.time(),  # finer than the agent's seconds: which rank failed first
    }
    if isinstance(exc, TrainflowError):
        data["trainflow_user_error"] = str(exc)
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)


def _records(logs: Path) -> dict[int, dict[str, Any]]:
    """Every rank's error record of the last attempt: the agent itself reports only the first exit it saw,
    which may be a rank that merely lost its connection to the one that failed."""
    def attempt(path: Path) -> int:
        return int(path.parent.parent.name.removeprefix("attempt_"))

    files = list(logs.glob("*/attempt_*/*/error.json"))
    last = max(map(attempt, files), default=-1)
    records = {}
    for path in files:
        if attempt(path) == last:
            with contextlib.suppress(OSError, ValueError):
                records[int(path.parent.name)] = json.loads(path.read_text())
    return records


def explain_worker_failure(exc: Any, logs: Path | None = None) -> TrainflowError:
    """The root cause as one error: a user error (the lowest rank that hit it: usually all do), else the rank
    that failed first (the others were stopped after it), with its traceback."""
    records = _records(logs) if logs else {}
    for rank, failure in exc.failures.items():
        records.setdefault(rank, failure.error_file_data)

    def order(rank: int) -> tuple[int, float, int]:
        data = records[rank]
        if "trainflow_user_error" in data:
            return (0, 0.0, rank)
        return (1, data["trainflow_time"], rank) if "trainflow_time" in data else (2, 0.0, rank)

    rank = min(records, key=order)
    data, failure = records[rank], exc.failures.get(rank)
    if "trainflow_user_error" in data:
        return TrainflowError(f"{data['trainflow_user_error']} (rank {rank})")
    message = data.get("message")
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "").rstrip()
        return WorkerError(f"rank {rank} failed: {message.get('message')}; the other ranks were stopped\n"
                           f"--- traceback of rank {rank} ---\n{stack}")
    if failure is not None and failure.exitcode < 0:
        return WorkerError(f"rank {rank} (pid {failure.pid}) was killed by signal {failure.signal_name()}; "
                           "the other ranks were stopped")
    code = failure.exitcode if failure is not None else "?"
    return WorkerError(f"rank {rank} exited with code {code}; the other ranks were stopped; its output above says why")
