"""Counts the prepared shards each process memory-maps (tests/test_data_shards.py puts this folder on PYTHONPATH).

An audit hook (`sys.addaudithook`) sees every `mmap.mmap` the interpreter makes, and forked ranks keep it; for each
one of a `shard_*.bin` file it appends `<RANK> <main|worker> <path>` to $TRAINFLOW_TEST_MAPS at once (a rank
may end by os._exit, which runs no atexit handler); `worker`: a DataLoader worker process of that rank.
"""

from __future__ import annotations

import os
import sys

_OUT = os.environ.get("TRAINFLOW_TEST_MAPS")


def _count(event: str, args: tuple) -> None:
    if event != "mmap.__new__" or not _OUT or args[0] < 0:
        return
    path = os.readlink(f"/proc/self/fd/{args[0]}")
    if os.path.basename(path).startswith("shard_"):
        data = sys.modules.get("torch.utils.data")
        process = "worker" if data is not None and data.get_worker_info() is not None else "main"
        with open(_OUT, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {process} {path}\n")


if _OUT:
    sys.addaudithook(_count)
