"""Running a command to its end, as `subprocess.run` does, through the warm fork server where it can be forked; and
counting the processes a run leaves behind."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from helpers.forkserver import RUNTIME_VARIABLES

SERVER = Path(__file__).with_name("forkserver.py")
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphans of descendants become this process's children, not init's


class ForkServer:
    """The client of one warm interpreter (started at first use, stopped at exit)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._imported: set[str] = set()  # the server's top-level modules: a folder put on the path must not hide one
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def _ensure_started(self) -> None:
        """A server that runs, in this process's present environment: one started before the suite's process changed
        its own (an in-process test reaching code that sets HF_HUB_OFFLINE or TORCHINDUCTOR_CACHE_DIR, as a run
        does) is replaced, or no later run would fork."""
        if self._proc is not None and self._proc.poll() is None and _import_time_changes(os.environ, self._env):
            self.stop()
        if self._proc is None or self._proc.poll() is not None:
            self._start()

    def _start(self) -> None:
        self._env = dict(os.environ)
        self._proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=self._env)
        ready = json.loads(self._proc.stdout.readline())
        assert ready["ready"] is True
        self._imported = set(ready["modules"])

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:  # its runs are in process groups of their own: nothing of a test's is lost with the server
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # an interpreter with torch loaded, slow to exit on a loaded machine
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def can_fork(self, cmd: list[str], env: dict[str, str]) -> bool:
        """A script run by this interpreter, in an environment that differs from the server's only in variables
        read at run time, and in PYTHONPATH folders it may add (see _can_import_from)."""
        if _script_argv(cmd) is None:
            return False
        with self._lock:  # not while another thread's run is under way: a replaced server would end it
            self._ensure_started()
        kept = set(_path_folders(self._env)) <= set(_path_folders(env))
        return _import_time_changes(env, self._env) <= {"PYTHONPATH"} and kept and all(
            self._can_import_from(folder) for folder in self._added_path(env))

    def _added_path(self, env: dict[str, str]) -> list[str]:
        """The PYTHONPATH folders `env` adds to the server's, in their order."""
        known = set(_path_folders(self._env))
        return [p for p in _path_folders(env) if p not in known]

    def _can_import_from(self, folder: str) -> bool:
        """A folder the child may put on its path as PYTHONPATH would have at start-up: it runs no code at start-up
        (sitecustomize) and holds no module the server imported already (which the fresh process would import from
        the folder instead)."""
        names = {entry.split(".")[0] for entry in os.listdir(folder)} if os.path.isdir(folder) else set()
        return not names & ({"sitecustomize", "usercustomize"} | self._imported)

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory(prefix="trainflow-fork-") as tmp:
            self._ensure_started()
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            pid = self._send(cmd, cwd, env, out=str(out), err=str(err))
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

    def start(self, cmd: list[str], cwd: Path, env: dict[str, str], output: Path) -> ForkedRun:
        """Start `cmd` in a forked child without waiting; its stdout and stderr are appended to `output`."""
        status = Path(tempfile.mkdtemp(prefix="trainflow-fork-")) / "exit_code"
        with self._lock:
            self._ensure_started()
            pid = self._send(cmd, cwd, env, out=str(output), err=str(output), append=True, status=str(status))
        return ForkedRun(cmd, pid, status)

    def _send(self, cmd: list[str], cwd: Path, env: dict[str, str], **streams: object) -> int:
        """Ask the server for a child running `cmd`; its pid."""
        request = {"argv": _script_argv(cmd), "path": self._added_path(env), "cwd": str(cwd), "env": env, **streams}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())["pid"]


class ForkedRun:
    """A run started in the background by the warm interpreter: what the suite uses of `subprocess.Popen` (pid,
    returncode, poll, wait, send_signal, terminate, kill). The run is the server's grandchild: its exit code comes
    from the status file its keeper writes. Like every forked run, it leads a process group of its own."""

    def __init__(self, args: list[str], pid: int, status: Path) -> None:
        self.args, self.pid, self._status = args, pid, status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
            shutil.rmtree(self._status.parent, ignore_errors=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _import_time_changes(env: dict[str, str], base: dict[str, str]) -> set[str]:
    """The variables `env` sets otherwise than `base` that a process may read before it runs: all but those read at
    run time (RUNTIME_VARIABLES), pytest's own PYTEST_* (they change with every test) and TEST_* (read by the tests'
    own modules that a run imports, never by the server)."""
    return {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)
            and k not in RUNTIME_VARIABLES and not k.startswith(("PYTEST_", "TEST_"))}


def _path_folders(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _script_argv(cmd: list[str]) -> list[str] | None:
    """The script and its arguments, where `cmd` runs a script on this interpreter: `python script.py ...`, or a
    console script installed beside it (`trainflow ...`, whose first line names this interpreter); else None."""
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py") and not cmd[1].startswith("-"):
        return cmd[1:]
    if cmd and Path(cmd[0]).parent == Path(sys.executable).parent:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(cmd[0]) as script:
            first = script.readline()
            if first.startswith("#!") and os.path.realpath(first[2:].strip()) == os.path.realpath(sys.executable):
                return cmd
    return None


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


_SERVER = ForkServer()


def _forks(cmd: list[str], env: dict[str, str]) -> bool:
    """Whether `cmd` runs forked from the warm interpreter (TRAINFLOW_TEST_FORK=0: never)."""
    return os.environ.get("TRAINFLOW_TEST_FORK", "1") != "0" and _SERVER.can_fork(cmd, env)


def run_process(cmd: list[str], cwd: Path | str, env: dict[str, str] | None = None, timeout: float = 600,
                capture_output: bool = True, text: bool = True) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` (the only form the
    suite uses), in a child forked from the warm interpreter where that gives the same process (see _forks)."""
    assert capture_output and text, "run_process captures stdout and stderr as text"
    env = dict(os.environ) if env is None else env
    if _forks(cmd, env):
        return _SERVER.run(cmd, Path(cwd), env, timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_process(cmd: list[str], cwd: Path | str, env: dict[str, str], output: Path,
                  new_session: bool = False) -> subprocess.Popen | ForkedRun:
    """`subprocess.Popen(cmd, cwd=cwd, env=env, stdout=<output, appended>, stderr=subprocess.STDOUT,
    start_new_session=new_session)`, forked from the warm interpreter where that gives the same process (see
    run_process; a forked run always leads a process group of its own)."""
    if _forks(cmd, env):
        return _SERVER.start(cmd, Path(cwd), env, output)
    with open(output, "a") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=new_session)


def _live_children() -> dict[int, str]:
    """This process's children that still run (zombies left out), by pid, with their command lines; the warm
    interpreter is left out (it outlives every test by design)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state != "Z":
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(SERVER) not in command:
                    found[int(entry)] = command.strip()
    return found


@contextlib.contextmanager
def left_behind() -> Iterator[Callable[[float], dict[int, str]]]:
    """Inside the block, a process that outlives the parent that started it is adopted by this one
    (PR_SET_CHILD_SUBREAPER) instead of vanishing under init, so a test can count what a run left behind. The block
    yields `leftovers(grace_s)`: the processes adopted since the block began that still run after waiting up to
    `grace_s` for them to end (pid -> command line); they are killed once counted, so they outlive no test."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    before = set(_live_children())

    def leftovers(grace_s: float = 10.0) -> dict[int, str]:
        deadline = time.monotonic() + grace_s
        while (alive := {p: c for p, c in _live_children().items() if p not in before}) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return alive

    try:
        yield leftovers
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
