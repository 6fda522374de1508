"""Stop signals: caught from a run's start to its end, agreed on by every rank one step late, and the exit code after.

The signals are `checkpoint.stop_signals` (by default all the schema's STOP_SIGNALS: SIGTERM, SIGUSR1 before a SLURM
time limit, SIGUSR2, SIGHUP when a terminal or ssh session closes). What one does depends on when it comes:

- While the loop trains with checkpointing on: every rank agrees (an all-reduce of the flag at each step boundary)
  to save at that step boundary; the process then exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try again"), and
  running the same command again resumes.
- Anywhere else (before the first step, where a resume waiting on a stuck disk may never reach one; after the
  loop; without checkpointing; a second signal while the first waits for its step boundary): nothing more is
  saved and the process ends at once, in one line: with EXIT_STOPPED when checkpointing is on (the committed
  checkpoints are what the same command resumes), else with 128 + the signal's number, as a shell reports a
  process a signal ended (nothing was saved: the run starts again from step 0). Where a handler was there before
  trainflow's (submitit's, which requeues a SLURM job), that handler acts instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__package__)  # one name for the package: lines read [trainflow.checkpoint]

EXIT_STOPPED = 75  # saved on a stop signal and stopped: run the same command to resume

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
    """A run's stop signals, caught from `install` to `restore`; only the handler writes `caught`."""

    def __init__(self, names: Sequence[str], resumable: bool, speak: bool) -> None:
        self.signals = [signal.Signals[name] for name in names]
        self.resumable = resumable  # checkpointing is on: the committed checkpoints resume the run
        self.speak = speak  # this process says the line (rank 0, where no launching process speaks for it)
        self.caught: int | None = None
        self._previous: dict[int, Any] = {}
        self._training = False  # the loop runs with checkpointing on: a signal waits for the step boundary
        self._trained = False

    def install(self) -> None:
        """Catch the signals; outside the main thread (where Python delivers none) say so."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}
        elif self.speak and self.signals:
            log.warning("checkpoint: training runs outside the main thread: %s will not save and stop",
                        ", ".join(s.name for s in self.signals))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def training_starts(self) -> None:
        """The first step begins, with checkpointing on: from now on a stop signal saves at the next step boundary."""
        self._training = self._trained = True

    def training_ends(self) -> None:
        """The loop and its last saves are over: a stop signal now ends the process at once."""
        self._training = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._training and self.caught is None:
            self.caught = signum
            return
        previous = self._previous.get(signum)
        if callable(previous):  # submitit's: it requeues the SLURM job and exits
            previous(signum, frame)
            return
        self._stop_at_once(signum)

    def _stop_at_once(self, signum: int) -> None:
        """At once, whatever the process waits on: threads blocked in a read would keep a normal exit waiting."""
        name = signal.Signals(signum).name
        code = EXIT_STOPPED if self.resumable else 128 + signum
        if not self.resumable:
            said = (f"Stopped by {name}: nothing was saved (checkpointing is off; with checkpoint=dcp a stop signal "
                    "saves at the next step boundary first); the same command starts again from step 0")
        elif not self._trained:
            said = (f"Stopped by {name} before the first step: nothing to save yet, committed checkpoints are "
                    "untouched; run the same command to resume")
        elif self.caught is not None:
            said = (f"Stopped by {name} again: ended at once, without the save at the step boundary (a save in "
                    "progress stays uncommitted); committed checkpoints are untouched; run the same command to resume")
        else:
            said = (f"Stopped by {name} after the last step: committed checkpoints are untouched; run the same "
                    "command to resume")
        if self.speak:
            print(f"{said} (exit code {code})", file=sys.stderr, flush=True)
        os._exit(code)


# The stop signals of the run in this process: none until its entry point catches them (catch_stop_signals).
_run_signals = StopSignals((), resumable=False, speak=False)


def catch_stop_signals(names: Sequence[str], resumable: bool, speak: bool) -> None:
    """Catch the run's stop signals from now on; a run's entry point calls it first (`train.py`, a launched worker)."""
    global _run_signals
    _run_signals.restore()
    _run_signals = StopSignals(names, resumable, speak)
    _run_signals.install()


def release_stop_signals() -> None:
    """The run is over: the handlers from before it are back (submitit's, which requeues a SLURM job after a stop)."""
    global _run_signals
    _run_signals.restore()
    _run_signals = StopSignals((), resumable=False, speak=False)


def run_stop_signals() -> StopSignals:
    """The stop signals this process's run catches (none caught when no entry point caught them: a test, a bench)."""
    return _run_signals


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
