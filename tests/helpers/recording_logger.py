"""A logger that records each call it gets in a JSON-lines file, and runs in a process of its own."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("trainflow.tests.recording_logger")


class RecordingLogger:
    in_own_process = True

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _record(self, *call: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps([os.getpid(), *call]) + "\n")

    def start(self, run: Any) -> str:
        log.warning("recording to %s", self.path.name)
        self._record("start", run.name)
        return "tracked-1"

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if "fail" in values:
            raise ValueError(f"cannot record step {step}")
        self._record("scalars", step, dict(values))

    def text(self, tag: str, text: str, step: int) -> None:
        self._record("text", tag, text, step)

    def artifacts(self, paths: list[Path]) -> None:
        self._record("artifacts", [p.name for p in paths])

    def finish(self, status: str) -> None:
        self._record("finish", status)

    def settle(self) -> None:
        """What a buffering logger does to send what it holds: recorded, so a test sees when it was asked."""
        self._record("settle")
