"""What each thread of this process is doing, declared by the code that does it.

The watchdog tells a hang from work that legitimately makes no step for a while (an evaluation, a compile, a save)
and says where a save stands (writing, or waiting for its upload on another thread). It reads that here, from
markers the evaluation, the compiler and the checkpointer set around their work, never from the file names of the
frames on a stack (a package that moves would silently change what the watchdog concludes).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from enum import StrEnum


class Activity(StrEnum):
    """A thread's declared work; a thread that declared nothing is training (a step, or the poll between steps)."""

    STEP = "step"
    EVALUATING = "evaluating"
    COMPILING = "compiling"
    SAVING = "saving"  # the checkpointer's save, commit, retention or final save, on the main thread
    WAITING_FOR_UPLOAD = "waiting for an upload"  # a save waiting for the async upload of the previous one
    UPLOADING = "uploading"  # writing a checkpoint's files (the async upload's thread, or a sync save's)


# A save in any of its forms: judged against the save's bound, not the step's.
SAVE_ACTIVITIES = frozenset({Activity.SAVING, Activity.WAITING_FOR_UPLOAD, Activity.UPLOADING})
# Work that makes no step for a while and is never a hang.
BUSY_ACTIVITIES = frozenset({Activity.EVALUATING, Activity.COMPILING})

_stacks: dict[int, list[Activity]] = {}  # by thread id: the innermost declaration last


@contextlib.contextmanager
def doing(activity: Activity) -> Iterator[None]:
    """Declare `activity` for the current thread while the block runs (nested declarations restore the outer)."""
    started(activity)
    try:
        yield
    finally:
        ended(activity)


def started(activity: Activity) -> None:
    """Declare `activity` for the current thread until `ended` (for work announced by callbacks, a compile)."""
    _stacks.setdefault(threading.get_ident(), []).append(activity)


def ended(activity: Activity, thread_id: int | None = None) -> None:
    """End the innermost declaration of `activity` by the current thread (or by `thread_id`: the main thread ends
    what an upload's thread declared once it has the upload's result, whether that thread got to end it or not).
    One not declared is ignored."""
    ident = threading.get_ident() if thread_id is None else thread_id
    stack = _stacks.get(ident)
    if stack and activity in stack:
        del stack[len(stack) - 1 - stack[::-1].index(activity)]
        if not stack:
            _stacks.pop(ident, None)


def current(thread_id: int) -> Activity:
    """What the thread of `thread_id` declared last (STEP when nothing): read from another thread, so it reads a
    snapshot of the stack, never the live list."""
    stack = tuple(_stacks.get(thread_id, ()))
    return stack[-1] if stack else Activity.STEP


def threads_doing(activity: Activity) -> list[int]:
    """The ids of the threads whose innermost declaration is `activity` (the upload a save waits for)."""
    return [ident for ident, stack in list(_stacks.items()) if tuple(stack)[-1:] == (activity,)]
