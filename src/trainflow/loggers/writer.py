"""The metrics writer: metrics.jsonl always, then each chosen logger, on rank 0; one step axis across resumes.

Nothing a logger does ends the run: whatever it raises (SystemExit and KeyboardInterrupt too, unless the user
pressed Ctrl-C: loggers/interrupts.py) drops it, in one line. A logger in a process of its own is bounded in time
as well, and never holds the loop: the calls it cannot take are dropped and counted (loggers/process.py), said once,
when it is dropped or finishes. A stop signal or Ctrl-C while the loggers close cuts their close short: the loggers
still open are left as they are (their processes killed), said in one line, and the run ends as it would have
(one that had finished training: exit code 0, its results are saved; one that stopped after a save: 75).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainflow.errors import ConfigError, TrainflowError
from trainflow.loggers import FINISHED, IDS_FILE, KILLED, final_figures, finite, kept_ids, profiler_text, run_info
from trainflow.loggers.interrupts import CtrlC, CutShort, stops_cut_short
from trainflow.loggers.process import MAX_UNANSWERED, ProcessLogger
from trainflow.util.files import run_dir_error, write_atomic, write_json_atomic
from trainflow.util.targets import first_line

if TYPE_CHECKING:
    from trainflow.config.schema import RunConfig
    from trainflow.loggers import Logger

log = logging.getLogger(__name__)
STOPPED_FINISH_S = 10.0  # a run stopped on a signal gives its loggers' processes this long to finish: a kill follows
NOT_STARTED_EXIT_S = 5.0  # a run that cannot start: its loggers' processes exit by themselves (their clients tidy up)


class MetricsWriter:
    """metrics.jsonl always; then each chosen logger (trainflow.loggers). Rank 0 only: other ranks get a writer
    that drops.

    A logger that fails mid-run is said once and dropped: the run trains on and metrics.jsonl keeps every value.
    """

    def __init__(self, run_dir: Path, enabled: bool, loggers: dict[str, Logger]) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        # unbuffered: each line reaches the file in one call, so a failed write can be taken back whole
        self._jsonl = open(run_dir / "metrics.jsonl", "ab", buffering=0) if enabled else None  # noqa: SIM115
        self.loggers = loggers  # the loggers still open
        self._ctrl_c = CtrlC()
        self._cut_by: int | None = None  # the signal that cut the loggers' close short

    def start(self, cfg: RunConfig, world_size: int, resumed_step: int | None,
              saved_ids: dict[str, str] | None = None, checkpoint: Path | None = None,
              checkpoint_dir: Path | None = None) -> dict[str, str]:
        """After the resume, before the first step: one step axis from here on (metrics.jsonl drops the lines a
        crashed process wrote past the resumed step); each logger starts, a resumed run's trackers continue their
        tracked runs, whose ids are kept in the run directory and in the checkpoint (`saved_ids`). Returns the
        tracked runs' ids, for the next checkpoints.

        A `checkpoint` outside this run's `checkpoint_dir` is another run's: its tracked runs (`saved_ids`) are
        never continued (that would write into another run's record); new ones start, naming it and them."""
        if not self.enabled:
            return {}
        if resumed_step is not None:
            self._keep_lines_up_to(resumed_step)
        source = checkpoint if checkpoint is not None and not _inside(checkpoint, checkpoint_dir) else None
        own, source_ids = (saved_ids or {}, {}) if source is None else ({}, saved_ids or {})
        kept = {**own, **kept_ids(self.run_dir)} if resumed_step is not None else {}
        ids = {}
        if self.loggers:
            self._ctrl_c.watch()
        for name, logger in self.loggers.items():
            info = run_info(cfg, self.run_dir, world_size, resumed_step, kept.get(name), source, source_ids.get(name))
            try:
                tracked = logger.start(info)
            except BaseException as exc:  # noqa: BLE001 (a logger's SystemExit cannot start it either)
                self._abandon(0.0 if self._ctrl_c.pressed(exc) else NOT_STARTED_EXIT_S)
                self._ctrl_c.unwatch()
                if isinstance(exc, TrainflowError) or self._ctrl_c.pressed(exc):
                    raise
                raise ConfigError(f"logger.{name}: could not start ({type(exc).__name__}: {first_line(exc)}); "
                                  f"fix the logger.{name}.* values, or leave {name} out of logger=[...]") from exc
            if tracked is not None:
                ids[name] = tracked
        if ids:
            write_json_atomic(self.run_dir / IDS_FILE, ids)
        return ids

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._append_line(json.dumps({"step": step, **values}) + "\n")
        if self.loggers:
            self._each("scalars", step, finite(values))

    def finish(self, status: str, summary: dict[str, Any] | None = None) -> None:
        """The run's end for every logger: its final figures, the profiler's text and the run's files (when it
        got to its summary), then its status. A stop signal or Ctrl-C meanwhile cuts it short (see above)."""
        if status == KILLED:
            for logger in self.loggers.values():
                if isinstance(logger, ProcessLogger):
                    logger.limit(STOPPED_FINISH_S)
        with contextlib.suppress(CutShort), stops_cut_short(self._cut):
            if summary is not None:
                step = summary["steps"]
                self._each("scalars", step, final_figures(summary))
                if text := profiler_text(summary.get("profiler")):
                    self._each("text", "profiler", text, step)
                files = ("config.yaml", "summary.json", "compile_report.json")
                self._each("artifacts", [self.run_dir / f for f in files if (self.run_dir / f).exists()])
            self._each("finish", status)
        if self._cut_by is not None and self.loggers:
            log.warning("%s", self._cut_line(status, summary is not None))
        self._abandon()
        self._ctrl_c.unwatch()

    def _each(self, method: str, *args: Any) -> None:
        for name, logger in list(self.loggers.items()):
            if self._cut_by is not None:
                return
            try:
                getattr(logger, method)(*args)
            except BaseException as exc:  # noqa: BLE001 (a logger's SystemExit is its failure, not the run's end)
                if isinstance(exc, CutShort) or self._cut_by is not None or self._ctrl_c.pressed(exc):
                    raise
                missed = _missed(logger)
                log.warning("logger.%s failed (%s: %s)%s; the run goes on without it, metrics.jsonl keeps every "
                            "value", name, type(exc).__name__, first_line(exc), f"; {missed}" if missed else "")
                del self.loggers[name]
                continue
            if method == "finish":
                del self.loggers[name]
                if missed := _missed(logger):
                    log.warning("logger.%s fell behind: %s; metrics.jsonl keeps every value", name, missed)

    def _cut(self, signum: int) -> None:
        self._cut_by = signum

    def _cut_line(self, status: str, summarized: bool) -> str:
        line = (f"{signal.Signals(self._cut_by).name} while the loggers closed: "
                f"{', '.join(f'logger.{name}' for name in self.loggers)} left unfinished (a tracked run may lack its "
                f"last figures, files and status; metrics.jsonl{' and summary.json' if summarized else ''} have them)")
        if status == FINISHED:
            line += "; training had finished and its results are saved: the run ends as finished, exit code 0"
        return line

    def _abandon(self, exit_within_s: float = 0.0) -> None:
        """The loggers still open are left as they are; a logger's process ends, killed after `exit_within_s`."""
        for logger in self.loggers.values():
            if isinstance(logger, ProcessLogger):
                logger.close(exit_within_s)
        self.loggers = {}

    def _keep_lines_up_to(self, step: int) -> None:
        """metrics.jsonl without the lines past `step` (replayed after a resume, they would appear twice), and
        without a last line a killed process left unfinished."""
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        kept = [line for line in lines if line.endswith(b"\n") and json.loads(line).get("step", 0) <= step]
        if len(kept) < len(lines):
            self._jsonl.close()
            try:
                write_atomic(path, b"".join(kept))
            except OSError as exc:
                raise run_dir_error(self.run_dir, "metrics.jsonl", exc) from None
            self._jsonl = open(path, "ab", buffering=0)  # noqa: SIM115

    def _append_line(self, line: str) -> None:
        """Whole lines only: a write the disk cuts short is taken back, and the run stops with one line."""
        data = line.encode()
        end = self._jsonl.seek(0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):
                written += self._jsonl.write(data[written:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._jsonl.truncate(end)
            raise run_dir_error(self.run_dir, "metrics.jsonl", exc) from None

    def close(self) -> None:
        """metrics.jsonl is closed; the loggers end with `finish`, once the run's summary is known (while they
        close, a Ctrl-C cuts their close short: no longer watched as one that lands in a logger)."""
        if self._jsonl is not None:
            self._jsonl.close()
        self._ctrl_c.unwatch()


def _missed(logger: Logger) -> str:
    """What a logger in its own process missed while it was too far behind (loggers/process.py), in words; "" if
    nothing."""
    if not isinstance(logger, ProcessLogger) or not logger.missed:
        return ""
    steps = f" (the figures of steps {logger.missed_steps[0]}-{logger.missed_steps[1]})" if logger.missed_steps else ""
    return f"{logger.missed} call(s) dropped while its process had {MAX_UNANSWERED} unanswered{steps}"


def _inside(path: Path, folder: Path | None) -> bool:
    """Whether `path` lies in `folder` (links resolved)."""
    return folder is not None and path.resolve().is_relative_to(folder.resolve())
