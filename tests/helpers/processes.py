"""Running a command to its end, as `subprocess.run` does, through the warm fork server where it can be forked."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from helpers.forkserver import RUNTIME_VARIABLES

SERVER = Path(__file__).with_name("forkserver.py")


class ForkServer:
    """The client of one warm interpreter (started at first use, stopped at exit)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def _start(self) -> None:
        self._env = dict(os.environ)
        self._proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=self._env)
        assert json.loads(self._proc.stdout.readline()) == {"ready": True}

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        self._proc = None

    def can_fork(self, cmd: list[str], env: dict[str, str]) -> bool:
        """A script run by this interpreter, in an environment that differs from the server's only in variables
        read at run time (pytest's own PYTEST_* change with every test)."""
        if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py") or cmd[1].startswith("-"):
            return False
        base = self._env if self._proc is not None else dict(os.environ)
        changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k) and not k.startswith("PYTEST_")}
        return changed <= RUNTIME_VARIABLES

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory(prefix="trainflow-fork-") as tmp:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": cmd[1:], "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            pid = json.loads(self._proc.stdout.readline())["pid"]
            timer = threading.Timer(timeout, _kill_group, (pid,))
            timer.start()
            try:
                code = json.loads(self._proc.stdout.readline())["code"]
            finally:
                timed_out = not timer.is_alive()
                timer.cancel()
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            if timed_out:
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


_SERVER = ForkServer()


def run_process(cmd: list[str], cwd: Path | str, env: dict[str, str] | None = None, timeout: float = 600,
                capture_output: bool = True, text: bool = True) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` (the only form the
    suite uses), in a child forked from the warm interpreter where that gives the same process
    (TRAINFLOW_TEST_FORK=0: never)."""
    assert capture_output and text, "run_process captures stdout and stderr as text"
    env = dict(os.environ) if env is None else env
    if os.environ.get("TRAINFLOW_TEST_FORK", "1") != "0" and _SERVER.can_fork(cmd, env):
        return _SERVER.run(cmd, Path(cwd), env, timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
