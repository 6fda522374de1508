"""Stop signals: caught while a run checkpoints, agreed on by every rank one step late, and the exit code after.

SIGTERM, SIGUSR2 or SIGHUP on any rank makes every rank agree (an all-reduce of the flag at each step boundary) to
save at that step boundary; the process then exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try again"); running the
same command again resumes. A second signal acts as it would without trainflow (terminates at once).

Before the first step there is nothing to save, and no step boundary may ever come (a resume waiting on a stuck
disk): a stop signal then ends the process at once, in one line, with EXIT_STOPPED.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__package__)  # one name for the package: lines read [trainflow.checkpoint]

EXIT_STOPPED = 75  # saved on SIGTERM/SIGUSR2/SIGHUP and stopped: run the same command again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)  # SIGHUP: the terminal or ssh session closed

_stopped_by: str | None = None  # the signal this process stopped on after saving (see stop_exit_code)


def mark_stopped(name: str) -> None:
    """This process stopped on signal `name` with its checkpoint committed: it exits with EXIT_STOPPED."""
    global _stopped_by
    _stopped_by = name


def stop_exit_code(summary: dict[str, Any] | None) -> int | None:
    """EXIT_STOPPED when the run stopped on a signal after committing a checkpoint, else None.

    This process's own flag covers every rank started by a launcher; rank 0's summary covers the process that
    launched local workers itself.
    """
    stopped = _stopped_by or ((summary or {}).get("checkpoint") or {}).get("stopped_by")
    return EXIT_STOPPED if stopped else None


class StopSignals:
    """Records the first stop signal from `install` to `restore`; only the handler writes `caught`."""

    def __init__(self) -> None:
        self.caught: int | None = None
        self._previous: dict[int, Any] = {}
        self._training = False  # from the first step on, a signal waits for the step boundary
        self._main = False

    def install(self, warn: bool) -> None:
        """Catch STOP_SIGNALS; outside the main thread (where Python delivers none) say so when `warn` (rank 0)."""
        self._main = warn
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        elif warn:
            log.warning("checkpoint: training runs outside the main thread: SIGTERM/SIGUSR2/SIGHUP will not save "
                        "and stop")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def training_starts(self) -> None:
        """The first step begins: from now on a stop signal saves at the next step boundary."""
        self._training = True

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self._training:
            self._exit_before_training(signum)
        self.caught = signum
        signal.signal(signum, self._previous[signum])  # a second signal acts as it would without us

    def _exit_before_training(self, signum: int) -> None:
        """At once, whatever the process waits on: threads blocked in a read would keep a normal exit waiting."""
        if self._main:
            print(f"Stopped by {signal.Signals(signum).name} before the first step: nothing to save yet, committed "
                  f"checkpoints are untouched; run the same command to resume (exit code {EXIT_STOPPED})",
                  file=sys.stderr, flush=True)
        os._exit(EXIT_STOPPED)


class LatePoll:
    """The ranks' flags, reduced (MAX) one step late.

    Each step starts a small asynchronous all-reduce of this rank's flags and reads the one started a step
    earlier, which finished while the step ran: no cross-rank wait in the step itself (between nodes a blocking
    one costs a network round trip every step). Decisions made from the reduced values alone are the same on
    every rank, one step after a flag was raised.
    """

    def __init__(self, group: Any) -> None:
        self._group = group
        self._in_flight: tuple[torch.Tensor, Any, Any] | None = None  # flags, work, what they were taken with

    def exchange(self, flags: list[int], taken_with: Any) -> tuple[torch.Tensor | None, Any]:
        """Start reducing `flags` (noting `taken_with`); return the previous poll's reduced flags and its note."""
        agreed = self.finish()
        tensor = torch.tensor(flags)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._in_flight = (tensor, work, taken_with)
        return agreed

    def finish(self) -> tuple[torch.Tensor | None, Any]:
        """Wait for the reduction in flight (it has normally finished): its flags and note; (None, None) if none."""
        if self._in_flight is None:
            return None, None
        flags, work, taken_with = self._in_flight
        self._in_flight = None
        work.wait()
        return flags, taken_with
