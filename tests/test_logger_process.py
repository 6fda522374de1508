"""A logger in a process of its own (trainflow.loggers.process): the calls arrive in order in another process, a
failure comes back to the next call, its log records reach the run's log, and the child never outlives the run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from trainflow.loggers import RunInfo, build_loggers
from trainflow.loggers.process import ProcessLogger

TARGET = "helpers.recording_logger.RecordingLogger"


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child imports the logger from tests/, as a user's process imports theirs from PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))


def run_info(tmp_path: Path) -> RunInfo:
    return RunInfo(tmp_path, {}, "", {}, "a-run", None, None, None, 1)


def calls(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def build(path: Path) -> ProcessLogger:
    logger = build_loggers({"recording": {"_target_": TARGET, "path": str(path)}})["recording"]
    assert isinstance(logger, ProcessLogger)
    return logger


def test_calls_arrive_in_order_in_another_process_and_cost_the_loop_microseconds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger = build(tmp_path / "calls.jsonl")
    with caplog.at_level(logging.WARNING, logger="trainflow.tests"):
        assert logger.start(run_info(tmp_path)) == "tracked-1"
    assert [r.getMessage() for r in caplog.records if r.name == "trainflow.tests.recording_logger"] == [
        "recording to calls.jsonl"]  # logged in the child, said in this process
    os.kill(logger._child.pid, signal.SIGTERM)  # as a scheduler's stop reaches the whole process group
    took = []
    for step in range(1, 101):
        start = time.perf_counter()
        logger.scalars(step, {"train/loss": 1.0 / step})
        took.append(time.perf_counter() - start)
    logger.text("profiler", "verdict", 100)
    logger.artifacts([tmp_path / "summary.json"])
    logger.finish("KILLED")
    assert logger._child.returncode == 0  # the SIGTERM was ignored; the child ended when its stdin closed
    recorded = calls(tmp_path / "calls.jsonl")
    assert {pid for pid, *_ in recorded} == {logger._child.pid} != {os.getpid()}
    assert [call[1:] for call in recorded] == [
        ["start", "a-run"], *[["scalars", s, {"train/loss": 1.0 / s}] for s in range(1, 101)],
        ["text", "profiler", "verdict", 100], ["artifacts", ["summary.json"]], ["finish", "KILLED"]]
    assert sorted(took)[50] < 1e-3  # a pipe write, not the logger's work (its median call)


def test_a_failed_call_is_raised_by_the_next_and_the_child_goes(tmp_path: Path) -> None:
    logger = build(tmp_path / "calls.jsonl")
    logger.start(run_info(tmp_path))
    logger.scalars(1, {"fail": 1.0})  # not waited for
    with pytest.raises(ValueError, match="^cannot record step 1$"):
        logger.settle()
    assert logger._child.wait(10) is not None
    with pytest.raises(RuntimeError, match="the recording logger's process ended"):
        logger.scalars(2, {"train/loss": 0.5})
    assert [call[1] for call in calls(tmp_path / "calls.jsonl")] == ["start"]


def test_a_logger_that_cannot_be_built_stops_the_start_in_one_line(tmp_path: Path) -> None:
    logger = build_loggers({"recording": {"_target_": TARGET, "path": str(tmp_path), "colour": "red"}})["recording"]
    with pytest.raises(Exception, match=r"^logger.recording: helpers.recording_logger.RecordingLogger\(path=.*, "
                                        r"colour=red\) failed: TypeError: .*colour.*; "
                                        r"fix the logger.recording.\* values$"):
        logger.start(run_info(tmp_path))


def test_the_child_ends_when_the_trainer_dies(tmp_path: Path) -> None:
    """A trainer killed outright (SIGKILL: no finish) closes the pipe by dying: its logger's process sends what it
    holds (`settle`) and exits too."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
              "from trainflow.loggers import build_loggers, RunInfo\n"
              f"logger = build_loggers({{'recording': {{'_target_': {TARGET!r}, 'path': {str(tmp_path / 'c')!r}}}}})"
              "['recording']\n"
              f"logger.start(RunInfo({str(tmp_path)!r}, {{}}, '', {{}}, 'r', None, None, None, 1))\n"
              "print(logger._child.pid, flush=True)\n"
              "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    trainer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr
    child = int(trainer.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"the logger's process {child} outlived its trainer"
        time.sleep(0.05)
    assert [call[1:] for call in calls(tmp_path / "c")] == [["start", "r"], ["settle"]]
