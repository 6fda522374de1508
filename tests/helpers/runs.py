"""Running trainflow as users do (a real `python train.py` process) and reading what it wrote; the checks every test
makes of a run (it succeeded; it failed in one line), waiting on a run in progress, and small real filesystems."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.processes import ForkedRun, run_process, start_process

ROOT = Path(__file__).resolve().parents[2]

# Small, fast settings for tests: a 2-layer byte-level GPT on a slice of the standard library.
TINY_GPT = [
    "model=gpt_tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32",
    "trainer.batch_size=8", "trainer.log_every=1", "trainer.excluded_steps=2", "logger=none", "compile=off",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def losses(self) -> list[float]:
        return [m["train/loss"] for m in self.metrics() if "train/loss" in m]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """train/loss of every step; a step logged twice (before a crash and after the resume) keeps its last value."""
    return logged_by_step(run_dir, "train/loss")


def logged_by_step(run_dir: Path, key: str) -> dict[int, float]:
    """The value metrics.jsonl holds under `key` at every step that logged it (the last, for a step logged twice)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            out[record["step"]] = record[key]
    return out


def train(run_dir: Path, *overrides: str, env: dict | None = None, timeout: float = 600,
          command: list[str] | None = None) -> Run:
    """Run `python train.py` (or `command`) with overrides, writing into run_dir."""
    cmd = command or [sys.executable, str(ROOT / "train.py")]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if "HYDRA_FULL_ERROR" not in (env or {}):
        full_env.pop("HYDRA_FULL_ERROR", None)  # tests see what users see: no traceback
    proc = run_process([*cmd, *overrides, f"hydra.run.dir={run_dir}"], ROOT, full_env, timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, Path(run_dir))


def trainflow(*args: str | Path, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """The `trainflow` console command, as a user types it (no HYDRA_FULL_ERROR: one line per error)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return run_process([str(Path(sys.executable).parent / "trainflow"), *map(str, args)], cwd, env, timeout)


def start(run_dir: Path, *overrides: str, new_session: bool = False) -> subprocess.Popen | ForkedRun:
    """Start `python train.py` without waiting; its output goes to a file beside the run directory.

    `new_session`: the run and every worker it starts form one process group, to be killed together.
    """
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = start_process([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"], ROOT, env,
                         run_dir.parent / f"{run_dir.name}.out", new_session)
    _STARTED.append((proc, new_session))
    return proc


_STARTED: list[tuple[subprocess.Popen | ForkedRun, bool]] = []


def stop_started() -> None:
    """Kill the runs a test started and did not see end (an assertion failed first), with what they started."""
    while _STARTED:
        proc, own_group = _STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL) if own_group else proc.kill()
            proc.wait()


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen | ForkedRun, what: str, timeout: float = 300,
             interval: float = 0.01) -> None:
    """Poll every `interval` until `condition` holds; fail if the process ends first (or kill it at the timeout).
    A millisecond where a test must act inside a short window (a save's stage): reading a 100 KB log a thousand
    times a second costs 13% of a core."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


def wait_for_log(run_dir: Path, line: str, proc: subprocess.Popen | ForkedRun, timeout: float = 300) -> None:
    """Wait until the run's own train.log holds `line`: a marker of its progress, not a guess at its timing."""
    log = run_dir / "train.log"
    wait_for(lambda: log.exists() and line in log.read_text(), proc, f"it logged {line!r}", timeout)


def one_line_error(result: Run | subprocess.CompletedProcess, *fragments: str, exit_code: int = 2,
                   alone: bool = True) -> str:
    """The run failed the way users should see it: `exit_code`, one `Error:` line naming what the `fragments` say, no
    traceback; `alone`: that line is all of stderr (else other lines, such as warnings, may stand beside it)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert result.returncode == exit_code, (result.stdout or "")[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and (not alone or lines == errors), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a small filesystem of its own (root, outside restricted containers)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(tempfile.mkdtemp(prefix="trainflow-mount-probe-"))
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=False)
    probe.rmdir()
    return ok


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A small real filesystem: a disk that fills up, or one that refuses writes (needs can_mount())."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""), "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
