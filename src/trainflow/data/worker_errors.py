"""Errors from loader workers in one line: torch's DataLoader (and torchdata's) re-raises an exception of a worker
process as the same type, its message `Caught DataError in DataLoader worker process 0.` followed by the worker's
traceback. A trainflow error raised there (a shard removed while the run trains, items a collate cannot batch) is
given back as it was raised: one sentence."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from trainflow.errors import TrainflowError

_WRAPPED = "in DataLoader worker process"


def from_workers(batches: Iterable[Any]) -> Iterator[Any]:
    """The batches of a loader with workers; a trainflow error of a worker re-raised with its own message."""
    try:
        yield from batches
    except TrainflowError as exc:
        text = str(exc).rstrip()
        if not (text.startswith("Caught ") and _WRAPPED in text.splitlines()[0]):
            raise
        last = text.splitlines()[-1]  # `trainflow.errors.DataError: <the message>`: the traceback's last line
        raise type(exc)(last.split(": ", 1)[1]) from None
