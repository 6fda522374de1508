"""A logger in a process of its own (trainflow.loggers.process): the calls arrive in order in another process, a
failure comes back to the next call, its log records reach the run's log, and the child never outlives the run.

Nothing a logger does stops training or a stop signal: real `train.py` runs with a logger that stalls in start,
in scalars or in finish, or raises SystemExit, KeyboardInterrupt or GeneratorExit, end as they would without it,
within seconds of a SIGTERM or a Ctrl-C, and leave no process behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import left_behind
from helpers.runs import ROOT, TINY_GPT, ok, start, train, wait_for, wait_for_log
from omegaconf import OmegaConf

from trainflow.config.schema import named_sections, plain, typed_run
from trainflow.loggers import RunInfo, build_loggers
from trainflow.loggers.process import ANSWER_TIMEOUT_S, MAX_UNANSWERED, ProcessLogger
from trainflow.loggers.writer import STOPPED_FINISH_S, MetricsWriter

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
    sections = named_sections("logger", {"recording": {"_target_": TARGET, "path": str(path)}})
    logger = build_loggers(sections)["recording"]
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


def test_a_child_that_stops_reading_never_holds_the_loop_its_missed_calls_are_counted(tmp_path: Path) -> None:
    """The child is stopped (SIGSTOP: it reads and answers nothing): MAX_UNANSWERED calls are sent, each one past
    them is dropped at once and counted, with the steps of the figures it carried."""
    logger = build(tmp_path / "calls.jsonl")
    logger.start(run_info(tmp_path))
    os.kill(logger._child.pid, signal.SIGSTOP)
    try:
        took = []
        for step in range(1, MAX_UNANSWERED + 31):
            began = time.perf_counter()
            logger.scalars(step, {"train/loss": 1.0 / step})
            took.append(time.perf_counter() - began)
        logger.text("profiler", "verdict", MAX_UNANSWERED + 30)
        assert (logger.missed, logger.missed_steps) == (31, (MAX_UNANSWERED + 1, MAX_UNANSWERED + 30))
        assert sorted(took)[-1] < 0.1 * ANSWER_TIMEOUT_S  # no call waited for the child (the last one, dropped)
    finally:
        os.kill(logger._child.pid, signal.SIGCONT)
    logger.finish("FINISHED")  # awake again, it answers what it got, in order
    assert [call[2] for call in calls(tmp_path / "calls.jsonl") if call[1] == "scalars"] == list(
        range(1, MAX_UNANSWERED + 1))


def test_a_run_stopped_on_a_signal_does_not_wait_again_for_a_child_silent_that_long(tmp_path: Path) -> None:
    """A child stopped (SIGSTOP) with a call to answer for longer than the stop's limit: `finish` is given up at
    once, not after the limit counted anew, and the child is killed."""
    logger = build(tmp_path / "calls.jsonl")
    logger.start(run_info(tmp_path))
    os.kill(logger._child.pid, signal.SIGSTOP)
    logger.scalars(1, {"train/loss": 1.0})
    limit_s = 2.0
    time.sleep(limit_s + 0.5)
    logger.limit(limit_s)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer finish within the 2 s a run stopped on a signal gives "
                                           r"it$"):
        logger.finish("KILLED")
    assert time.monotonic() - began < limit_s
    assert logger._child.wait(10) == -signal.SIGKILL


def test_a_failed_call_is_raised_by_the_next_and_the_child_goes(tmp_path: Path) -> None:
    logger = build(tmp_path / "calls.jsonl")
    logger.start(run_info(tmp_path))
    logger.scalars(1, {"fail": 1.0})  # not waited for
    with pytest.raises(ValueError, match="^cannot record step 1$"):
        logger.settle()
    assert logger._child.wait(10) is not None
    with pytest.raises(RuntimeError, match="the recording logger's process ended"):
        logger.scalars(2, {"train/loss": 0.5})
    assert [call[1] for call in calls(tmp_path / "calls.jsonl")] == ["start", "settle"]  # it sent what it held


def test_a_logger_that_cannot_be_built_stops_the_start_in_one_line(tmp_path: Path) -> None:
    keys = {"_target_": TARGET, "path": str(tmp_path), "colour": "red"}
    logger = build_loggers(named_sections("logger", {"recording": keys}))["recording"]
    with pytest.raises(Exception, match=r"^logger.recording: helpers.recording_logger.RecordingLogger\(path=.*, "
                                        r"colour=red\) failed: TypeError: .*colour.*; "
                                        r"fix the logger.recording.\* values$"):
        logger.start(run_info(tmp_path))


def test_the_child_ends_when_the_trainer_dies(tmp_path: Path) -> None:
    """A trainer killed outright (SIGKILL: no finish) closes the pipe by dying: its logger's process sends what it
    holds (`settle`) and exits too."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
              "from trainflow.config.schema import named_sections\n"
              "from trainflow.loggers import build_loggers, RunInfo\n"
              f"keys = {{'_target_': {TARGET!r}, 'path': {str(tmp_path / 'c')!r}}}\n"
              "logger = build_loggers(named_sections('logger', {'recording': keys}))['recording']\n"
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


def test_the_child_of_a_dead_trainer_says_nothing_of_its_broken_pipe(tmp_path: Path) -> None:
    """The trainer dies while its logger's process works on a call (a second's sleep): the answer, and what the
    child sends after (its settle's log line), go nowhere, without a word: no BrokenPipeError on the console the
    two share."""
    keys = {"_target_": TARGET, "path": str(tmp_path / "c"), "stall": "scalars", "stall_s": 1.0}
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
              "from trainflow.config.schema import named_sections\n"
              "from trainflow.loggers import build_loggers, RunInfo\n"
              f"logger = build_loggers(named_sections('logger', {{'recording': {keys!r}}}))['recording']\n"
              f"logger.start(RunInfo({str(tmp_path)!r}, {{}}, '', {{}}, 'r', None, None, None, 1))\n"
              "logger.scalars(1, {'train/loss': 1.0})\n"
              "import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n")
    trainer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr  # returned once the child closed the console too
    assert "BrokenPipe" not in trainer.stderr and "Traceback" not in trainer.stderr, trainer.stderr
    assert [call[1:] for call in calls(tmp_path / "c")] == [
        ["start", "r"], ["stall", 1, "scalars"], ["scalars", 1, {"train/loss": 1.0}], ["settle"]]


def probe(calls_file: Path, cls: str = "RecordingLogger", **keys: object) -> list[str]:
    """The overrides of a run whose only logger is tests/helpers' recording logger `cls` (with `keys`)."""
    return [f"+logger.probe._target_=helpers.recording_logger.{cls}", f"+logger.probe.path={calls_file}",
            *(f"+logger.probe.{k}={v}" for k, v in keys.items())]


def kinds(calls_file: Path) -> list[list]:
    """Each call the logger got: its method, and its step where it has one."""
    return [call[1:3] if call[1] in ("scalars", "stall") else call[1:2] for call in calls(calls_file)]


def stalled(calls_file: Path) -> bool:
    return calls_file.exists() and any(call[1] == "stall" for call in calls(calls_file))


def log_lines(run_dir: Path, text: str) -> list[str]:
    return [line for line in (run_dir / "train.log").read_text().splitlines() if text in line]


def test_a_logger_that_stops_answering_is_dropped_in_one_line_and_the_run_trains_on(tmp_path: Path) -> None:
    """Its scalars sleeps from step 5 (an hour): 2 s later (its answer_timeout_s) its process is killed, mid-run
    (at the latest when the calls it holds reach MAX_UNANSWERED), and the run trains all its steps."""
    run_dir, calls_file, steps = tmp_path / "run", tmp_path / "calls.jsonl", MAX_UNANSWERED + 100
    with left_behind() as leftovers:
        began = time.monotonic()
        run = ok(train(run_dir, *TINY_GPT, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                       *probe(calls_file, "ImpatientRecordingLogger", stall="scalars", from_step=5), timeout=300))
        took = time.monotonic() - began
        assert leftovers(15) == {}
    assert run.summary["steps"] == steps and [m["step"] for m in run.metrics() if "train/loss" in m] == list(
        range(1, steps + 1))
    assert kinds(calls_file) == [["start"], *[["scalars", s] for s in range(1, 5)], ["stall", 5]]
    (line,) = log_lines(run_dir, "logger.probe")
    assert line.endswith("logger.probe failed (TimeoutError: the probe logger's process has not answered for 2 s); "
                         "the run goes on without it, metrics.jsonl keeps every value")
    log = (run_dir / "train.log").read_text()
    assert log.index(line) < log.index(f"step {MAX_UNANSWERED + 10}/{steps}: ")  # mid-run
    assert took < 180  # seconds of training, not the hour the logger sleeps


def last_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last whole line (its tail only: the file grows by a line a step)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        lines = f.read().split(b"\n")[:-1]  # the last, unfinished or empty, is left out
    return json.loads(lines[-1])["step"] if lines and lines[-1].startswith(b"{") else 0


def chunk_times(run_dir: Path, proc: subprocess.Popen, steps: int, longest_s: float = 600.0,
                chunk: int = 50) -> tuple[list[float], int]:
    """The seconds each `chunk` steps of the next `steps` took, as a reader of metrics.jsonl sees them (polled every
    50 ms), none longer than `longest_s`; and the last step."""
    wait_for(lambda: last_step(run_dir) > 0, proc, "a first step", interval=0.05)
    first = last_step(run_dir)
    reached = [time.monotonic()]  # when the step count reached first + k * chunk
    while (step := last_step(run_dir)) < first + steps:
        assert proc.poll() is None, f"the run exited ({proc.returncode})"
        reached += [time.monotonic()] * max(0, (step - first) // chunk + 1 - len(reached))
        assert time.monotonic() - reached[-1] < longest_s, f"{chunk} steps from step {step} took over {longest_s} s"
        time.sleep(0.05)
    return [b - a for a, b in zip(reached, reached[1:], strict=False)], step


@pytest.mark.serial
def test_a_stuck_logger_holds_neither_the_steps_nor_a_stop(tmp_path: Path) -> None:
    """The logger's process stops (SIGSTOP: it reads and answers nothing, for good; its answer timeout is an hour,
    so that only the stop gives it up, however slow a busy machine makes the steps): the loop steps on at its pace,
    through the MAX_UNANSWERED calls queued for the logger and past them (then its figures are dropped and
    counted): no 50 steps take 20 times as long as the usual 50 steps did while it answered (a busy machine slows
    both alike; before, the loop stood still until the logger's answer timeout). A SIGTERM then saves and ends the run,
    exit 75, within seconds, without waiting on the logger (silent longer than a stop gives it). metrics.jsonl has
    every step; one line says what the logger missed."""
    run_dir, calls_file = tmp_path / "run", tmp_path / "calls.jsonl"
    with left_behind() as leftovers:
        proc = start(run_dir, *TINY_GPT, "trainer.max_steps=1000000", "trainer.eval_every=0", "checkpoint=dcp",
                     "checkpoint.every_steps=1000000", *probe(calls_file, "PatientRecordingLogger"))
        wait_for(lambda: last_step(run_dir) >= 50, proc, "step 50", interval=0.05)
        answering, _ = chunk_times(run_dir, proc, 500)
        usual = statistics.median(answering)
        os.kill(calls(calls_file)[0][0], signal.SIGSTOP)
        stopped = time.monotonic()
        # before: the loop stood still once 1,024 calls queued, until the logger's answer timeout (an hour here)
        _, stuck_at = chunk_times(run_dir, proc, MAX_UNANSWERED + 500, longest_s=20 * usual)
        time.sleep(max(0.0, STOPPED_FINISH_S - (time.monotonic() - stopped)))
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - signalled
        assert leftovers(15) == {}
    assert code == 75 and took < 15, (code, took)
    steps = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "manifest.json").is_file()
    assert [m["step"] for m in json.loads(f"[{','.join((run_dir / 'metrics.jsonl').read_text().splitlines())}]")
            if "train/loss" in m] == list(range(1, steps + 1))
    (line,) = log_lines(run_dir, "logger.probe")
    match = re.search(r"logger.probe failed \(TimeoutError: the probe logger's process did not answer finish within "
                      rf"the {STOPPED_FINISH_S:.0f} s a run stopped on a signal gives it\); "
                      rf"(\d+) call\(s\) dropped while its process had {MAX_UNANSWERED} unanswered \(the figures of "
                      r"steps (\d+)-(\d+)\); the run goes on without it, metrics.jsonl keeps every value$", line)
    assert match, line
    missed, first, last = map(int, match.groups())
    assert first < stuck_at <= last <= steps and missed >= last - first + 1, (missed, first, last, stuck_at, steps)


@pytest.mark.serial
@pytest.mark.parametrize("stall", ["start", "scalars", "finish"])
def test_sigterm_ends_the_run_within_seconds_wherever_its_logger_stalls(tmp_path: Path, stall: str) -> None:
    """A logger in its own process sleeps an hour in start (before the first step: the run ends at once, exit 75),
    in scalars from step 5 (the run saves at the next step boundary, gives the logger STOPPED_FINISH_S to record
    KILLED, exit 75) or in finish after the last step (the run had finished: its close is cut short, exit 0).
    Each time one line says what happened, and no process is left."""
    run_dir, calls_file = tmp_path / "run", tmp_path / "calls.jsonl"
    steps = 30 if stall == "finish" else 100_000
    with left_behind() as leftovers:
        proc = start(run_dir, *TINY_GPT, f"trainer.max_steps={steps}", "trainer.eval_every=0", "checkpoint=dcp",
                     "checkpoint.every_steps=1000", *probe(calls_file, stall=stall, from_step=5))
        wait_for(lambda: stalled(calls_file), proc, f"the logger stalls in {stall}")
        if stall == "scalars":
            wait_for_log(run_dir, "step 20/", proc)  # the loop trains on while the logger sleeps
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - signalled
        assert leftovers(15) == {}
    output = (tmp_path / "run.out").read_text()
    assert "Traceback" not in output and "BrokenPipe" not in output, output[-3000:]
    if stall == "start":
        assert code == 75 and took < 10, (code, took)
        assert "Stopped by SIGTERM before the first step: nothing to save yet" in output
        return
    if stall == "scalars":
        assert code == 75 and took < STOPPED_FINISH_S + 20, (code, took)
        assert (run_dir / "checkpoints" / f"step_{json.loads((run_dir / 'summary.json').read_text())['steps']:08d}"
                / "manifest.json").is_file()
        (line,) = log_lines(run_dir, "logger.probe")
        assert "logger.probe failed (TimeoutError: the probe logger's process did not answer finish within the " \
               f"{STOPPED_FINISH_S:.0f} s a run stopped on a signal gives it)" in line
        return
    assert code == 0 and took < 10, (code, took)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30
    (line,) = log_lines(run_dir, "while the loggers closed")
    assert line.endswith("SIGTERM while the loggers closed: logger.probe left unfinished (a tracked run may lack "
                         "its last figures, files and status; metrics.jsonl and summary.json have them); training "
                         "had finished and its results are saved: the run ends as finished, exit code 0")
    assert kinds(calls_file)[-3:] == [["artifacts"], ["finish"], ["stall", 0]]


@pytest.mark.serial
@pytest.mark.parametrize("cls", ["RecordingLogger", "InProcessRecordingLogger"])
def test_ctrl_c_ends_the_run_within_seconds_while_its_logger_sleeps_in_a_call(tmp_path: Path, cls: str) -> None:
    """The logger sleeps an hour in scalars from step 5. Ctrl-C (twice, for the logger in its own process: the
    second lands while the run waits for the logger to record KILLED) ends the run in its one line, exit 130. In
    the loop's process the KeyboardInterrupt is raised inside the logger's code: still the user's Ctrl-C."""
    run_dir, calls_file = tmp_path / "run", tmp_path / "calls.jsonl"
    with left_behind() as leftovers:
        proc = start(run_dir, *TINY_GPT, "trainer.max_steps=100000", "trainer.eval_every=0",
                     *probe(calls_file, cls, stall="scalars", from_step=5))
        wait_for(lambda: stalled(calls_file), proc, "the logger stalls in scalars")
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        if cls == "RecordingLogger":
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
        took = time.monotonic() - interrupted
        assert leftovers(15) == {}
    output = (tmp_path / "run.out").read_text()
    assert code == 130 and took < 10, (code, took, output[-3000:])
    assert [line for line in output.splitlines() if line.startswith(("Interrupted:", "Error:"))] == [
        "Interrupted: stopped at once, without a save; committed checkpoints are untouched (a stop signal, SIGTERM "
        "say, saves at the next step boundary, then stops)"]
    assert "Traceback" not in output, output[-3000:]


# the typed config a run's writer gets (single, the schema's defaults, a learning rate of 0.1)
CONFIG = typed_run({"trainer": {"max_steps": 3}, "model": {}, "data": {}, "task": {}, "optim": {"lr": 0.1},
                    "logger": {}})


@pytest.mark.parametrize("raised", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_a_logger_raising_any_base_exception_is_dropped_and_the_run_goes_on(
        tmp_path: Path, raised: str, caplog: pytest.LogCaptureFixture) -> None:
    """SystemExit(0), KeyboardInterrupt or GeneratorExit raised by a logger's own code at step 2, in the loop's
    process or in its own: that logger's failure, said once; the writer and the other logger go on."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(plain(CONFIG)))
    loggers = build_loggers(named_sections("logger", {
        name: {"_target_": f"helpers.recording_logger.{cls}", "path": str(tmp_path / f"{name}.jsonl"),
               "raises": raised, "from_step": 2}
        for name, cls in (("here", "InProcessRecordingLogger"), ("apart", "RecordingLogger"))}))
    steady = {"_target_": "helpers.recording_logger.InProcessRecordingLogger", "path": str(tmp_path / "steady.jsonl")}
    loggers["steady"] = build_loggers(named_sections("logger", {"steady": steady}))["steady"]
    writer = MetricsWriter(run_dir, True, loggers)
    with caplog.at_level(logging.WARNING, logger="trainflow.loggers.writer"):
        writer.start(CONFIG, 1, None)
        for step in (1, 2, 3):
            writer.write(step, {"train/loss": 1.0 / step})
        writer.finish("FINISHED")
    writer.close()
    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "trainflow.loggers.writer")
    assert warnings == [
        f"logger.apart failed (RuntimeError: {raised}: 0); the run goes on without it, metrics.jsonl keeps every value",
        f"logger.here failed ({raised}: 0); the run goes on without it, metrics.jsonl keeps every value"]
    assert kinds(tmp_path / "here.jsonl") == [["start"], ["scalars", 1]]
    assert [call for call in kinds(tmp_path / "apart.jsonl") if call[0] == "scalars"] == [["scalars", 1]]
    assert kinds(tmp_path / "steady.jsonl") == [["start"], ["scalars", 1], ["scalars", 2], ["scalars", 3],
                                                ["finish"]]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_logger_exiting_mid_run_ends_neither_the_run_nor_its_summary(tmp_path: Path) -> None:
    """A logger of one's own, in the loop's process, calls sys.exit(0) from step 5 of 20: one line, and the run
    trains to its end and writes its summary."""
    run_dir = tmp_path / "run"
    run = ok(train(run_dir, *TINY_GPT, "trainer.max_steps=20", "trainer.eval_every=0",
                   *probe(tmp_path / "calls.jsonl", "InProcessRecordingLogger", raises="SystemExit", from_step=5)))
    assert run.summary["steps"] == 20
    (line,) = log_lines(run_dir, "logger.probe")
    assert line.endswith("logger.probe failed (SystemExit: 0); the run goes on without it, metrics.jsonl keeps "
                         "every value")
