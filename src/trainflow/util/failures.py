"""A failed rank, named: each rank records its failure where the elastic agent looks, and the launching process
reads every rank's record to say which one failed first and why."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

from trainflow.errors import TrainflowError


class WorkerError(TrainflowError):
    """A rank of a launched run failed; the message names the rank and carries its traceback."""

    exit_code = 1  # a crash, not a usage error


class CollectiveTimeout(WorkerError):
    """A collective waited parallelism.timeout_s for a rank that never came: a hang, not a crash."""

    exit_code = 124  # as timeout(1) exits


class SaveHung(CollectiveTimeout):
    """The watchdog ended a rank whose save outlasted its limit (a disk that stopped answering, where
    no collective waits for the rank and so none times out)."""


# What a collective says when a peer process went away or stopped answering (gloo, NCCL, the c10d store): the
# rank that says it only lost its neighbour, it is never the cause when another rank failed by itself.
_TIMED_OUT = ("timed out waiting", "application timeout caused pair closure")  # gloo's words for a timeout
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket timeout",
              "communicator was aborted", "remote process exited", "connection refused", *_TIMED_OUT)


# How long a rank that lost a peer waits before it exits: the agent then sees the lost rank's own exit (its signal)
# first, and reports that one, instead of this rank's error about it. A few of the agent's 0.1 s polls.
_LINGER_S = 2.0


def linger_if_peer_lost(exc: BaseException) -> None:
    """Let the rank that caused this error be found first: wait a moment when `exc` only says a peer went away."""
    if says_peer_lost(str(exc)):
        time.sleep(_LINGER_S)


def note_step(exc: BaseException, step: int) -> None:
    """Remember on the exception the step the loop was in, so that the rank's record can say where it failed."""
    with contextlib.suppress(AttributeError, TypeError):
        exc._trainflow_step = step


def noted_step(exc: BaseException) -> int | None:
    """The step note_step remembered on `exc` (it travels with the exception when a launcher unpickles it)."""
    return getattr(exc, "_trainflow_step", None)


def note_save(exc: BaseException, step: int) -> None:
    """Remember on the exception that it ended the save of `step` (a hang there is a save's, not a step's); the
    innermost save noted wins (a save waits for the one before it first)."""
    with contextlib.suppress(AttributeError, TypeError):
        if getattr(exc, "_trainflow_save_step", None) is None:
            exc._trainflow_save_step = step


def record_failure(exc: BaseException) -> None:
    """Write the exception where the elastic agent looks (TORCHELASTIC_ERROR_FILE), so the launcher can name it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or recorded(exc):  # keep the first record: its time counts
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
    if "RANK" in os.environ:  # the global rank: another node's launcher may read this record without its agent
        data["trainflow_rank"] = int(os.environ["RANK"])
    if isinstance(exc, CollectiveTimeout):
        data["trainflow_hang"] = str(exc)
    elif isinstance(exc, TrainflowError):
        data["trainflow_user_error"] = str(exc)
    if (step := getattr(exc, "_trainflow_step", None)) is not None:
        data["trainflow_step"] = step
    if (step := getattr(exc, "_trainflow_save_step", None)) is not None:
        data["trainflow_save_step"] = step
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)


def recorded(exc: BaseException) -> bool:
    """Whether record_failure wrote `exc` into the rank's error file (whoever raises it on must not overwrite it)."""
    return getattr(exc, "_trainflow_recorded", False)


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


def _peer_lost(data: dict[str, Any]) -> bool:
    return says_peer_lost(record_message(data))


def record_message(data: dict[str, Any]) -> str:
    """The message of a rank's error record (torch's or record_failure's)."""
    message = data.get("message")
    return message.get("message", "") if isinstance(message, dict) else str(message or "")


def ranks_records(log_root: Path, since: float) -> dict[int, dict[str, Any]]:
    """The error records trainflow's ranks wrote (record_failure) under `log_root` since `since`, by global rank,
    whatever their agent did with them: an agent whose rendezvous store went down with another node's never
    reports its ranks, but their records are on disk."""
    records = {}
    for path in log_root.glob("**/attempt_*/*/error.json"):
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_mtime >= since and "trainflow_rank" in (data := json.loads(path.read_text())):
                records[int(data["trainflow_rank"])] = data
    return records


def what_it_said(data: dict[str, Any]) -> tuple[str, int | None]:
    """A rank's error record as lost_rank_error takes it: its message and the step it failed in."""
    return record_message(data), data.get("trainflow_step")


def says_peer_lost(text: str) -> bool:
    """Whether an error only says that a peer went away (the rank saying it is not the cause)."""
    return any(words in text.lower() for words in _PEER_LOST)


def explain_worker_failure(exc: Any, logs: Path | None = None, hang: str | None = None) -> TrainflowError:
    """The root cause as one error: a user error (the lowest rank that hit it: usually all do), else the rank
    that failed by itself first (the others were stopped after it), with its traceback; else a rank lost to a
    signal (an OOM kill), named without a traceback, since the others' errors only say that they lost it.
    `hang` is the watchdog's account of a stall, which says who a timed-out collective waited for."""
    records = _records(logs) if logs else {}
    for rank, failure in exc.failures.items():
        records.setdefault(rank, failure.error_file_data)

    def killed(rank: int) -> bool:
        failure = exc.failures.get(rank)
        return "trainflow_time" not in records[rank] and failure is not None and failure.exitcode < 0

    def order(rank: int) -> tuple[int, float, int]:
        data = records[rank]
        if "trainflow_user_error" in data:
            return (0, 0.0, rank)
        if "trainflow_time" in data:
            return (3 if _peer_lost(data) else 1, data["trainflow_time"], rank)
        return (2, 0.0, rank) if killed(rank) else (4, 0.0, rank)

    rank = min(records, key=order)
    data, failure = records[rank], exc.failures.get(rank)
    if "trainflow_user_error" in data:
        return TrainflowError(f"{data['trainflow_user_error']} (rank {rank})")
    if "trainflow_hang" in data:
        return CollectiveTimeout(hang_line(data["trainflow_hang"], hang))
    if killed(rank):
        others = {other: what_it_said(data) for other, data in records.items()}
        return lost_rank_error(rank, failure.signal_name(), others, pid=failure.pid)
    message = data.get("message")
    if isinstance(message, dict) and _peer_lost(data):
        said = _first_line(message.get("message"))
        if "timed out" in said.lower() or any(words in said.lower() for words in _TIMED_OUT):
            return CollectiveTimeout(hang_line(f"rank {rank} waited parallelism.timeout_s in a collective{_at(data)} "
                                               f"and another rank never arrived ({said})", hang))
        return WorkerError(f"rank {rank} lost its connection to another rank{_at(data)} and no rank said why: "
                           f"{said}; the other ranks were stopped")
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "").rstrip()
        return WorkerError(f"rank {rank} failed: {message.get('message')}; the other ranks were stopped\n"
                           f"--- traceback of rank {rank} ---\n{stack}")
    code = failure.exitcode if failure is not None else "?"
    return WorkerError(f"rank {rank} exited with code {code}; the other ranks were stopped; its output above says why")


def hang_line(what: str, hang: str | None, world_size: int = 2) -> str:
    """The one line that ends a hung run: what ended it, the watchdog's account of who hung where, and the way on."""
    return (f"{what}{'; ' + hang if hang else ''}{'; the other ranks were stopped' if world_size > 1 else ''}; "
            "committed checkpoints are intact: the same command resumes from the newest")


def _at(data: dict[str, Any]) -> str:
    if "trainflow_save_step" in data:
        return f" in the save of step {data['trainflow_save_step']}"
    return f" in step {data['trainflow_step']}" if "trainflow_step" in data else ""


def lost_rank_error(rank: int, signal_name: str, others: dict[int, tuple[str, int | None]],
                    pid: int | None = None) -> WorkerError:
    """A rank lost to a signal (an OOM kill), named without a traceback, with the step the others noticed it in:
    `others` holds each other rank's error and step, and their errors only say that they lost it. Every launcher
    says it in these words."""
    noticed = {other: step for other, (said, step) in others.items() if other != rank and says_peer_lost(said)}
    steps = sorted(step for step in noticed.values() if step is not None)
    where = f" ({rank_list(sorted(noticed))} lost {'their' if len(noticed) > 1 else 'its'} connection to it" \
            f"{' in step ' + str(steps[0]) if steps else ''})" if noticed else ""
    return WorkerError(f"rank {rank}{f' (pid {pid})' if pid is not None else ''} was lost: killed by signal "
                       f"{signal_name}{where}; the other ranks were stopped; committed checkpoints are intact: the "
                       "same command resumes from the newest")


def rank_list(ranks: list[int], limit: int = 8) -> str:
    """Ranks as every one-line account names them: "rank 3", "ranks 0, 2", and past `limit` "ranks 0, ..., 7, ..."."""
    shown = ", ".join(map(str, ranks[:limit])) + (", ..." if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _first_line(text: Any) -> str:
    """A collective's error, short: its first sentence, without the source location gloo puts in front."""
    line = str(text).splitlines()[0] if text else "no message"
    return _SOURCE_PREFIX.sub(r"\1", line).split(". ")[0]


# "RuntimeError: [.../pair.cc:537] Read error" -> "RuntimeError: Read error"
_SOURCE_PREFIX = re.compile(r"^(\w+: )\[[^\]]*\] ")
