"""A disk that fills at the last moment of a save: the shards and JSON files fit, the manifest does not. The
Checkpointer in this process (an async save, so that the disk can be filled after the shards are written and
before the commit), on a real filesystem of its own."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from helpers.checkpoints import checkpointer, make_state, step, tree_hash
from helpers.runs import can_mount, tmpfs

from trainflow.errors import CheckpointError


def fill(disk: Path) -> None:
    """Write into `disk` until it has no byte left (a real ENOSPC, in 1 MB then 4 kB pieces)."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for piece in (b"\0" * (1 << 20), b"\0" * 4096, b"\0"):
            try:
                while True:
                    f.write(piece)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def wait_for_file(path: Path, timeout: float = 120) -> None:
    """Poll until the async upload has written `path` (the end of its data: DCP writes .metadata last)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.001)


@pytest.mark.skipif(not can_mount(), reason="needs a filesystem of its own (root with mount rights)")
def test_a_disk_full_only_for_the_manifest_names_the_step_and_the_path(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with tmpfs(disk, "16m"):
        ckpts = disk / "ckpts"
        state = make_state()
        ck = checkpointer(tmp_path, dir=str(ckpts), mode="async", verify=False, save_final=False)
        ck.resume(state)
        for _ in range(2):  # step 1 committed, the save of step 2 uploading
            step(state)
            ck.after_step(state)
        before = tree_hash(ckpts / "step_00000001")
        tmp = ckpts / ".tmp-step_00000002"
        wait_for_file(tmp / ".metadata")
        fill(disk)
        with pytest.raises(CheckpointError) as exc:
            ck.close(state)
        assert str(exc.value) == (
            f"checkpoint.dir: saving step 2 to {ckpts} failed writing {tmp}/manifest.json (No space left on device); "
            "free space or point checkpoint.dir at a writable disk; committed checkpoints are untouched (newest: "
            "step_00000001)")
        assert not tmp.exists()  # the unfinished save gave its space back
        assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".lock")) == ["step_00000001"]
        assert tree_hash(ckpts / "step_00000001") == before
        os.unlink(disk / "filler")
