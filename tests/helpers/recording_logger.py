"""A logger that records each call it gets in a JSON-lines file, and runs in a process of its own; asked to, it
stalls in a call (records `stall` and sleeps, an hour unless told) or raises a BaseException of any kind there."""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("trainflow.tests.recording_logger")


class RecordingLogger:
    in_own_process = True

    def __init__(self, path: str, stall: str | None = None, stall_s: float = 3600.0, raises: str | None = None,
                 from_step: int = 0) -> None:
        self.path = Path(path)
        self.stall, self.stall_s, self.raises, self.from_step = stall, stall_s, raises, from_step

    def _record(self, *call: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps([os.getpid(), *call]) + "\n")

    def _misbehave(self, method: str, step: int | None = None) -> None:
        """Stall in `stall` (scalars: from step `from_step`), raise `raises` in scalars from step `from_step`."""
        due = step is None or step >= self.from_step
        if method == self.stall and due:
            self._record("stall", step or 0, method)
            time.sleep(self.stall_s)
        if self.raises and method == "scalars" and due:
            raise getattr(builtins, self.raises)(0)  # SystemExit(0), KeyboardInterrupt(0), GeneratorExit(0)

    def start(self, run: Any) -> str:
        log.warning("recording to %s", self.path.name)
        self._record("start", run.name)
        self._misbehave("start")
        return "tracked-1"

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if "fail" in values:
            raise ValueError(f"cannot record step {step}")
        self._misbehave("scalars", step)
        self._record("scalars", step, dict(values))

    def text(self, tag: str, text: str, step: int) -> None:
        self._record("text", tag, text, step)

    def artifacts(self, paths: list[Path]) -> None:
        self._record("artifacts", [p.name for p in paths])

    def finish(self, status: str) -> None:
        self._record("finish", status)
        self._misbehave("finish")

    def settle(self) -> None:
        """What a buffering logger does to send what it holds: recorded, so a test sees when it was asked, and said
        in the log (to a trainer that may be gone)."""
        self._record("settle")
        log.warning("settling")


class InProcessRecordingLogger(RecordingLogger):
    """The same, in the loop's process."""

    in_own_process = False


class ImpatientRecordingLogger(RecordingLogger):
    """The same, whose process is given up after 2 s without an answer."""

    answer_timeout_s = 2.0


class PatientRecordingLogger(RecordingLogger):
    """The same, whose process is given up only after an hour without an answer: a stop, not its timeout, ends it."""

    answer_timeout_s = 3600.0
