"""Signals while loggers run: a Ctrl-C told from a KeyboardInterrupt that a logger's own code raised, and a stop
signal or Ctrl-C that cuts the loggers' close short.

Both change a handler only on the main thread (the only one Python delivers signals to), only while the loggers
are open or closing, and put back what was there.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from trainflow.config.choices import STOP_SIGNALS


class CutShort(BaseException):
    """A stop signal or Ctrl-C while the loggers close: the rest of their close is given up."""


class CtrlC:
    """Whether SIGINT came while the loggers were open: a KeyboardInterrupt is then the user's Ctrl-C, else a
    logger's own code raised it (its failure, not the run's end). Watched from the loggers' start to their close:
    a handler put in once costs the log steps nothing."""

    def __init__(self) -> None:
        self.came = False
        self._watching: tuple[Any, Any] | None = None  # (our handler, the one it wraps)

    def pressed(self, exc: BaseException) -> bool:
        """Whether `exc` is the user's Ctrl-C."""
        return isinstance(exc, KeyboardInterrupt) and self.came

    def watch(self) -> None:
        """From now on SIGINT's handler first notes that it came, then does what it did."""
        previous = signal.getsignal(signal.SIGINT)
        if self._watching or not callable(previous) or threading.current_thread() is not threading.main_thread():
            return

        def noted(signum: int, frame: Any) -> None:
            self.came = True
            previous(signum, frame)

        signal.signal(signal.SIGINT, noted)
        self._watching = (noted, previous)

    def unwatch(self) -> None:
        """SIGINT's handler as it was, unless something replaced ours meanwhile (then that stays)."""
        if self._watching is None:
            return
        noted, previous = self._watching
        self._watching = None
        if signal.getsignal(signal.SIGINT) is noted:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def stops_cut_short(on_cut: Callable[[int], None]) -> Iterator[None]:
    """Inside the block, the first stop signal or Ctrl-C calls `on_cut(signum)` and raises CutShort; a second one
    does what it did before. A signal this process ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: h for s in (signal.SIGINT, *(signal.Signals[name] for name in STOP_SIGNALS))
                if (h := signal.getsignal(s)) is not None and h != signal.SIG_IGN}
    cut_by: list[int] = []

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def cut(signum: int, _frame: Any) -> None:
        cut_by.append(signum)
        restore()
        on_cut(signum)
        raise CutShort

    for sig in previous:
        signal.signal(sig, cut)
    try:
        yield
    finally:
        if not cut_by:
            restore()
