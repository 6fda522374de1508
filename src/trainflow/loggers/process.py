"""A logger in a process of its own, for a tracker whose client costs the loop's process milliseconds a log step.

MLflow's client writes a SQLite store through SQLAlchemy at ~0.2-1 ms of Python per metric, under the GIL of
the process that calls it, whichever thread that is: in the training process it slows every step around a log
step (docs/performance.md). `ProcessLogger` runs such a logger in a child process: the loop's process only
pickles each call and hands it to a thread that writes the pipe. A logger class asks for this with
`in_own_process = True`.

- Nothing the child does holds the loop. `scalars`, `text` and `artifacts` never wait: while MAX_UNANSWERED calls
  are unanswered (a child that stopped reading, one that cannot keep up) a new one is dropped and counted
  (`missed`, `missed_steps`; the metrics writer says the count once, metrics.jsonl has every value). `start` and
  `finish` wait for the child's answer. A child that has had
  calls to answer for `answer_timeout_s` (a class attribute of the logger, ANSWER_TIMEOUT_S unless it says
  otherwise) without answering any has stopped answering: the waiting call, or the next call, raises
  TimeoutError and the child is killed. A failed call's error is raised by the next call, and the child's pipe
  closes (it sends what it holds and exits). Either way the writer drops the logger in one line, as it drops an
  in-process logger that raised. A run that stopped on a signal gives its loggers a time `limit` to finish,
  counted from the child's last answer when it has calls to answer: a child silent that long already is not
  waited for at all, so that the stop ends the run within seconds.
- A failure the child sends back is always an Exception: a logger's SystemExit or KeyboardInterrupt is its own
  failure, so a KeyboardInterrupt in the trainer is a Ctrl-C.
- The child's log records come back to the loop's process and are logged there (the run's log has them).
- The child leads a process group of its own (killed as one: whatever it started goes with it) and ignores
  SIGINT and SIGTERM: the trainer decides when it ends and still has to record KILLED through it. It ends after
  `finish`; when the trainer dies or closes the pipe, it sends what it holds (`settle`) and exits within
  ORPHAN_GRACE_S, whatever its logger is doing: it never outlives the run by more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from trainflow.util.targets import call_target

LOGGER_CLASS = "a logger class (see docs/loggers.md)"  # what a logger's _target_ must name, as errors say it
MAX_UNANSWERED = 1024  # calls in flight before a new one is dropped (a log step's call: ~1 KB)
ANSWER_TIMEOUT_S = 60.0  # a child silent this long with calls to answer has stopped answering
STARTUP_S = 60.0  # until its first answer (an interpreter starts, imports the logger) the child gets at least this
EXIT_S = 30.0  # after answering `finish`, the child exits (a tracker's client may write out at exit)
ORPHAN_GRACE_S = 10.0  # the child's time to send what it holds once its trainer is gone


class ProcessLogger:
    """The `Logger` protocol, forwarded to `target(**kwargs)` built in a child process."""

    def __init__(self, name: str, target: str, kwargs: dict[str, Any],
                 answer_timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.name = name
        self.answer_timeout_s = answer_timeout_s
        # unbuffered both ways: a thread blocked on a buffered pipe at the interpreter's exit aborts it
        self._child = subprocess.Popen([sys.executable, "-c", "from trainflow.loggers.process import main; main()"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                       start_new_session=True)
        self._lock = threading.Condition()
        self._sent = self._answered = 0
        self._busy_since: float | None = None  # the child's last answer, or the call it got when it had none
        self._patience = max(answer_timeout_s, STARTUP_S)  # answer_timeout_s from the child's first answer on
        self._answers: dict[int, Any] = {}  # a waited-for call's answer, by its number
        self._waited: set[int] = set()
        self._failure: BaseException | None = None  # of a call nobody waits for: raised by the next call
        self._ended = False  # the child's answers stopped (it exited)
        self._limit: tuple[float, float] | None = None  # (seconds given, the deadline) for what is left
        self.missed = 0  # calls dropped while MAX_UNANSWERED were unanswered
        self.missed_steps: tuple[int, int] | None = None  # the first and last step of the scalars dropped
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._write, name=f"trainflow-{name}-logger-out", daemon=True).start()
        self._reader = threading.Thread(target=self._read, name=f"trainflow-{name}-logger", daemon=True)
        self._reader.start()
        self._call("build", name, target, kwargs)  # the child imports while the run builds its model

    def start(self, run: Any) -> str | None:
        return self._call("start", run, wait=True)

    def scalars(self, step: int, values: Any) -> None:
        if not self._call("scalars", step, dict(values), droppable=True):
            first, _ = self.missed_steps or (step, step)
            self.missed_steps = (first, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self._call("text", tag, text, step, droppable=True)

    def artifacts(self, paths: list[Any]) -> None:
        self._call("artifacts", paths, droppable=True)

    def finish(self, status: str) -> None:
        try:
            self._call("finish", status, wait=True)
        except BaseException as exc:
            self.close(self._exit_within() if isinstance(exc, Exception) else 0.0)  # a Ctrl-C: at once
            raise
        self.close(self._exit_within())

    def limit(self, seconds: float) -> None:
        """From now on, what the child is waited for (its answers, its exit) takes `seconds` at most, in all, and
        no longer than `seconds` after its last answer while it has calls to answer (a stuck child gets no more)."""
        with self._lock:
            deadline = time.monotonic() + seconds
            if self._busy_since is not None:
                deadline = min(deadline, self._busy_since + seconds)
            self._limit = (seconds, deadline)

    def _exit_within(self) -> float:
        return EXIT_S if self._limit is None else self._limit[1] - time.monotonic()

    def settle(self) -> None:
        """Wait until the child has answered every call (a failure among them is raised)."""
        with self._lock:
            self._wait_until(lambda: self._answered >= self._sent, "settle")
        self._raise_failure()

    def close(self, exit_within_s: float = 0.0) -> None:
        """The child ends: its pipe closes (after `finish` it exits; else it sends what it holds, then exits), and
        it is killed if it has not within `exit_within_s`."""
        self._outbox.put(None)  # the pipe closes once what was sent is written
        try:
            self._child.wait(max(0.0, exit_within_s))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self._kill()  # nothing once it has exited
            self._child.wait()
            self._reader.join(EXIT_S)

    def _call(self, method: str, *args: Any, wait: bool = False, droppable: bool = False) -> Any:
        """Send one call; wait for its answer when `wait`. A `droppable` call that finds MAX_UNANSWERED calls
        unanswered is not sent but counted in `missed`, and False is returned (True when it was sent)."""
        self._check()
        with self._lock:
            if droppable and self._sent - self._answered >= MAX_UNANSWERED:
                self.missed += 1
                return False
            self._wait_until(lambda: self._sent - self._answered < MAX_UNANSWERED, method)
            number = self._sent
            self._outbox.put(frame((number, method, args)))  # may not pickle: then nothing was counted
            self._sent += 1
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            if wait:
                self._waited.add(number)
        if not wait:
            return True
        with self._lock:
            self._wait_until(lambda: number in self._answers, method)
            failure, value = self._answers.pop(number)
        self._raise_failure()
        if failure is not None:
            self._failure = failure
            self._raise_failure()
        return value

    def _wait_until(self, done: Callable[[], bool], method: str) -> None:
        """Under the lock, until `done()`; a child that ended, stopped answering or is past its `limit` raises
        (and is killed)."""
        while not done():
            if self._ended:
                raise self._gone()
            now, silent_at = time.monotonic(), self._silent_until()
            if self._limit is not None and self._limit[1] <= now:
                self._kill()
                raise TimeoutError(f"the {self.name} logger's process did not answer {method} within the "
                                   f"{self._limit[0]:.0f} s a run stopped on a signal gives it")
            if silent_at <= now:
                self._kill()
                raise self._silent()
            until = silent_at if self._limit is None else min(silent_at, self._limit[1])
            self._lock.wait(None if until == float("inf") else until - now)

    def _silent_until(self) -> float:
        """When the child will have been silent too long (infinite when it has nothing to answer)."""
        return float("inf") if self._busy_since is None else self._busy_since + self._patience

    def _check(self) -> None:
        """Before a call: a failed call's error, the child's end or its silence (the child is killed) is raised."""
        if self._failure is None and (self._ended or self._child.poll() is not None):
            self._failure = self._gone()
        elif self._failure is None and self._silent_until() <= time.monotonic():
            self._kill()
            self._failure = self._silent()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """A failed call's error, once; the child goes with it (the writer drops a logger that failed): its pipe
        closes, so it sends what it holds and exits by itself, within ORPHAN_GRACE_S (a child still retrying a
        dead server does not outlive that)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            self._outbox.put(None)
            raise failure

    def _silent(self) -> TimeoutError:
        return TimeoutError(f"the {self.name} logger's process has not answered for {self._patience:.0f} s")

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the {self.name} logger's process ended (exit code {self._child.poll()})")

    def _kill(self) -> None:
        """The child and whatever it started (its process group); it is ours to end only while it is unreaped."""
        if self._child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._child.pid, signal.SIGKILL)

    def _write(self) -> None:
        """The calls onto the pipe, in order, on a thread of their own: a child that stops reading blocks this
        thread, never the loop."""
        stdin = self._child.stdin
        while (message := self._outbox.get()) is not None:
            try:
                write_all(stdin, message)
            except (OSError, ValueError):  # the child is gone: its answers' end says so
                break
        with contextlib.suppress(OSError):
            stdin.close()

    def _read(self) -> None:
        """The child's answers and log records, as they come (a thread blocked on the pipe costs no CPU)."""
        out = self._child.stdout
        while True:
            try:
                kind, *message = read_frame(out)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            if kind == "log":
                level, name, text = message
                logging.getLogger(name).log(level, "%s", text)
                continue
            number, failure, value = message
            with self._lock:
                self._answered += 1
                self._patience = self.answer_timeout_s
                self._busy_since = time.monotonic() if self._answered < self._sent else None
                if number in self._waited:
                    self._waited.discard(number)
                    self._answers[number] = (failure, value)
                elif failure is not None and self._failure is None:
                    self._failure = failure
                self._lock.notify_all()
        with self._lock:
            self._ended = True
            self._lock.notify_all()


def frame(message: Any) -> bytes:
    """`message` pickled, after its length: a pipe read unbuffered gives what it has, not what was asked."""
    data = pickle.dumps(message)
    return struct.pack("<Q", len(data)) + data


def read_frame(pipe: BinaryIO) -> Any:
    """The next message `frame` made; EOFError at the pipe's end."""
    return pickle.loads(_exactly(pipe, struct.unpack("<Q", _exactly(pipe, 8))[0]))


def _exactly(pipe: BinaryIO, size: int) -> bytes:
    chunks = []
    while size:
        chunk = pipe.read(size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def write_all(pipe: BinaryIO, data: bytes) -> None:
    """`data` whole onto an unbuffered pipe (a write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[pipe.write(view):]


class _ToParent(logging.Handler):
    """The child's log records, sent back to be logged in the trainer's process."""

    def __init__(self, send: Any) -> None:
        super().__init__(logging.INFO)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.send(("log", record.levelno, record.name, record.getMessage()))


def _portable(exc: BaseException) -> Exception:
    """`exc` when it is an Exception that survives pickling, else its type and text in a RuntimeError: a logger's
    SystemExit or KeyboardInterrupt is its failure, never the trainer's exit or a Ctrl-C."""
    if isinstance(exc, Exception):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:
            pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """The child's loop: build the logger, then answer each call in order, until `finish`, or until the trainer
    closes the pipe or dies: then a buffering logger's `settle` sends what it holds, within ORPHAN_GRACE_S."""
    lock = threading.Lock()
    gone = threading.Event()  # the trainer stopped reading: nothing more is sent
    finished = threading.Event()  # `finish` was answered: the trainer waits EXIT_S for this process to exit

    def send(message: tuple) -> None:
        data = frame(message)
        with lock:
            if gone.is_set():
                return
            try:
                write_all(answers, data)
            except OSError:
                gone.set()

    calls: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()

    def read() -> None:
        """The trainer's calls, read as they come (its pipe never fills while a call runs); at the pipe's end,
        the process exits within ORPHAN_GRACE_S (after `finish`: EXIT_S) whatever its logger does."""
        with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
            while True:
                calls.put(read_frame(requests))
        calls.put(None)
        timer = threading.Timer(EXIT_S if finished.is_set() else ORPHAN_GRACE_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    threading.Thread(target=read, name="trainflow-logger-calls", daemon=True).start()
    logging.getLogger().addHandler(_ToParent(send))
    logging.getLogger().setLevel(logging.WARNING)  # the libraries' warnings; their set-up lines are not news
    logging.getLogger("trainflow").setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings too, so that the run's log has them
    logger: Any = None
    while (call := calls.get()) is not None:
        number, method, args = call
        try:
            if method == "build":
                name, target, kwargs = args
                logger = call_target(f"logger.{name}", target, kwargs, LOGGER_CLASS)
                value = None
            else:
                value = getattr(logger, method)(*args)
            send(("answer", number, None, value))
        except BaseException as exc:  # noqa: BLE001 (every failure goes back to the trainer, which decides)
            send(("answer", number, _portable(exc), None))
        if method == "finish":  # the run has ended: nothing is left to send when the pipe closes
            finished.set()
            return
    with contextlib.suppress(BaseException):  # the trainer closed the pipe or died: what a logger buffers goes out
        getattr(logger, "settle", lambda: None)()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # unbuffered both ways: nothing to flush at exit (the trainer may be gone), no lock a reading thread holds
    requests = os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what a library prints cannot corrupt the answers
    serve(requests, answers)
