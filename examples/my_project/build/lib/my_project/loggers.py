"""A logger of one's own, chosen by `_target_` alone: every scalar as a `step,name,value` row of a CSV file.

It answers trainflow's logger protocol (trainflow.loggers.Logger): start, scalars, text, artifacts, finish.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class CSVLogger:
    def __init__(self, filename: str = "scalars.csv") -> None:
        self.filename = filename
        self._file: Any = None

    def start(self, run: Any) -> None:
        """`run`: trainflow.loggers.RunInfo (run_dir, config, hyperparameters, name, resumed_step, ...)."""
        self._file = open(Path(run.run_dir) / self.filename, "a", newline="")  # noqa: SIM115 (closed in finish)
        self._rows = csv.writer(self._file)
        if run.resumed_step is None:
            self._rows.writerow(["step", "name", "value"])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._rows.writerows([step, name, value] for name, value in values.items())

    def text(self, tag: str, text: str, step: int) -> None:
        """Text does not fit a CSV of numbers: left out."""

    def artifacts(self, paths: list[Path]) -> None:
        """The files stay in the run directory, next to the CSV."""

    def finish(self, status: str) -> None:
        self._rows.writerow(["", "status", status])
        self._file.close()
