"""A logger in a process of its own, for a tracker whose client costs the loop's process milliseconds a log step.

MLflow's client writes a SQLite store through SQLAlchemy at ~0.2-1 ms of Python per metric, under the GIL of
the process that calls it, whichever thread that is: in the training process it slows every step around a log
step (docs/performance.md). `ProcessLogger` runs such a logger in a child process: the loop's process only
pickles each call onto a pipe. A logger class asks for this with `in_own_process = True`.

- `start` and `finish` wait for the child's answer (a tracker that cannot start stops the run before training;
  the run's status is recorded before the process exits); `scalars`, `text` and `artifacts` do not: a failure
  of one is raised by the next call, as an in-process logger's would be (the writer then drops the logger).
- The child's log records come back to the loop's process and are logged there (the run's log has them).
- The child ignores SIGINT and SIGTERM (a Ctrl-C or a scheduler's stop reaches the whole process group: the
  trainer still has to record KILLED through it) and ends when its stdin closes: at `finish`, or when the
  trainer dies, so it never outlives the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Any, BinaryIO

LOGGER_CLASS = "a logger class (see docs/loggers.md)"  # what a logger's _target_ must name, as errors say it
MAX_UNANSWERED = 64  # calls in flight before the loop waits for the child: the pipe's backlog stays bounded
FINISH_TIMEOUT_S = 120  # for `finish` (the last metrics, artifacts, the status) before the child is given up


class ProcessLogger:
    """The `Logger` protocol, forwarded to `target(**kwargs)` built in a child process."""

    def __init__(self, name: str, target: str, kwargs: dict[str, Any]) -> None:
        self.name = name
        self._child = subprocess.Popen([sys.executable, "-c", "from trainflow.loggers.process import main; main()"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Condition()
        self._sent = self._answered = 0
        self._answers: dict[int, Any] = {}  # a waited-for call's answer, by its number
        self._waited: set[int] = set()
        self._failure: BaseException | None = None  # of a call nobody waits for: raised by the next call
        self._ended = False  # the child's answers stopped (it exited)
        self._reader = threading.Thread(target=self._read, name=f"trainflow-{name}-logger", daemon=True)
        self._reader.start()
        self._call("build", name, target, kwargs)  # the child imports while the run builds its model

    def start(self, run: Any) -> str | None:
        return self._call("start", run, wait=True)

    def scalars(self, step: int, values: Any) -> None:
        self._call("scalars", step, dict(values))

    def text(self, tag: str, text: str, step: int) -> None:
        self._call("text", tag, text, step)

    def artifacts(self, paths: list[Any]) -> None:
        self._call("artifacts", paths)

    def finish(self, status: str) -> None:
        try:
            self._call("finish", status, wait=True, timeout=FINISH_TIMEOUT_S)
        except TimeoutError:
            self._child.kill()  # a child that hung at the end has nothing left to give
            raise
        finally:
            self.close()

    def settle(self) -> None:
        """Wait until the child has answered every call (a failure among them is raised)."""
        with self._lock:
            self._lock.wait_for(lambda: self._answered >= self._sent or self._ended)
        self._raise_failure()

    def close(self) -> None:
        """The child ends once it has read what was sent (its stdin closes)."""
        with contextlib.suppress(OSError):
            self._child.stdin.close()
        try:
            self._child.wait(FINISH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._reader.join(5)

    def _call(self, method: str, *args: Any, wait: bool = False, timeout: float | None = None) -> Any:
        self._raise_failure()
        with self._lock:
            self._lock.wait_for(lambda: self._sent - self._answered < MAX_UNANSWERED or self._ended)
            number = self._sent
            self._sent += 1
            if wait:
                self._waited.add(number)
        try:
            pickle.dump((number, method, args), self._child.stdin)
            self._child.stdin.flush()
        except (OSError, ValueError):
            raise self._gone() from None
        if not wait:
            return None
        with self._lock:
            if not self._lock.wait_for(lambda: number in self._answers or self._ended, timeout):
                raise TimeoutError(f"the {self.name} logger's process did not answer {method} in {timeout:.0f} s")
            if number not in self._answers:
                raise self._gone()
            failure, value = self._answers.pop(number)
        self._raise_failure()
        if failure is not None:
            self._child.kill()
            raise failure
        return value

    def _raise_failure(self) -> None:
        """A failed call's error, once; the child goes with it (the writer drops a logger that failed, and a
        child still retrying a dead server must not outlive that)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            self._child.kill()
            raise failure

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the {self.name} logger's process ended (exit code {self._child.poll()})")

    def _read(self) -> None:
        """The child's answers and log records, as they come (a thread blocked on the pipe costs no CPU)."""
        out = self._child.stdout
        while True:
            try:
                kind, *message = pickle.load(out)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            if kind == "log":
                level, name, text = message
                logging.getLogger(name).log(level, "%s", text)
                continue
            number, failure, value = message
            with self._lock:
                self._answered += 1
                if number in self._waited:
                    self._waited.discard(number)
                    self._answers[number] = (failure, value)
                elif failure is not None and self._failure is None:
                    self._failure = failure
                self._lock.notify_all()
        with self._lock:
            self._ended = True
            self._lock.notify_all()


class _ToParent(logging.Handler):
    """The child's log records, sent back to be logged in the trainer's process."""

    def __init__(self, send: Any) -> None:
        super().__init__(logging.INFO)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.send(("log", record.levelno, record.name, record.getMessage()))


def _portable(exc: BaseException) -> BaseException:
    """`exc` when it survives pickling, else its type and text in a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """The child's loop: build the logger, then answer each call in order, until `finish` or until the trainer
    closes the pipe (then a buffering logger's `settle` sends what it holds)."""
    from trainflow.config.targets import call_target

    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            pickle.dump(message, answers)
            answers.flush()

    logging.getLogger().addHandler(_ToParent(send))
    logging.getLogger().setLevel(logging.WARNING)  # the libraries' warnings; their set-up lines are not news
    logging.getLogger("trainflow").setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings too, so that the run's log has them
    logger: Any = None
    while True:
        try:
            number, method, args = pickle.load(requests)
        except EOFError:  # the trainer closed the pipe or died: what a logger buffers still goes out
            with contextlib.suppress(Exception):
                getattr(logger, "settle", lambda: None)()
            return
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
            return


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what a library prints cannot corrupt the answers
    serve(sys.stdin.buffer, answers)

