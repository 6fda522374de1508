"""An offline W&B run's files, read back: which steps a crashed process's run holds, so that its resume logs again
exactly the steps that did not reach them (W&B 0.31 reads its `.wandb` files only in its Go core).

A `.wandb` file is a 7-byte header (`:W&B`, version) then blocks of 32 KiB in LevelDB's log format: chunks with a
7-byte header (checksum, length, type) whose FULL, or FIRST + MIDDLE... + LAST, payloads are W&B's protobuf
`Record`s.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb file, in order; a chunk cut short at the end (a killed writer) is left out."""
    from wandb.proto.wandb_internal_pb2 import Record  # lazy: wandb is the wandb extra

    data, pos, pending, out = path.read_bytes(), HEADER, b"", []
    if data[:4] != b":W&B":
        return out
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if pos + HEADER + length > len(data):
            break
        chunk, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending + chunk)
            out.append(record)
            pending = b""
        elif kind in (FIRST, MIDDLE):
            pending += chunk
    return out


def offline_runs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline run folders of `run_id`, oldest first: `offline-run-<start time>-<id>`, with `-1`, `-2`, ...
    for a resume started within the same second."""
    stamp = len("offline-run-YYYYmmdd_HHMMSS")
    return sorted(wandb_dir.glob(f"offline-run-*-{run_id}*"), key=lambda d: (d.name[:stamp], len(d.name), d.name))


def last_step(folder: Path) -> int:
    """The last history step an offline run folder holds (0: none)."""
    steps = [0]
    for path in folder.glob("run-*.wandb"):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                steps += [int(json.loads(i.value_json)) for i in record.history.item
                          if (i.key or "/".join(i.nested_key)) == "_step"]
    return max(steps)
