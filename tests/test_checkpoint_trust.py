"""What trainflow reads of a checkpoint folder: only the regular files its manifest names, inside that folder.

A manifest is data anyone who can write the folder can change: a name in it that leads outside the folder, a
link, a FIFO or a device is refused in one line before any file is opened (a FIFO or /dev/zero would hang the
checksum forever, a name like ../../x would be read and its checksum printed). The Checkpointer in this process,
on real checkpoints; the same in a real process is in test_bad_inputs.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
from helpers.checkpoints import checkpointer, make_state, records, rewrite_manifest, step, train_and_save, tree_hash

from trainflow.checkpoint import export_weights
from trainflow.checkpoint.safe_io import read_metadata
from trainflow.errors import CheckpointError


class FifoWriter:
    """A FIFO in the folder and a thread waiting to write into it: `opened` tells whether anyone opened it to read
    (the thread then closes it at once, so a reader sees an empty file instead of hanging)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path, self.opened = path, threading.Event()
        self._thread = threading.Thread(target=self._write, daemon=True)
        self._thread.start()

    def _write(self) -> None:
        with open(self.path, "wb"):  # blocks until a reader opens the FIFO
            self.opened.set()

    def close(self) -> None:
        if not self.opened.is_set():  # release the writer: open the read end ourselves
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            self._thread.join()
            os.close(fd)
            self.opened.clear()  # that open was ours
        self._thread.join()


def list_in_manifest(folder: Path, name: str, size: int, files: bool = True) -> None:
    """Add `name` to the manifest's checksums (and, with `files`, its files), as a tamperer could."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["checksums"][name] = "0123456789abcdef"
    if files:
        manifest["files"][name] = size
    path.write_text(json.dumps(manifest))


def refused(tmp_path: Path, folder: Path) -> list[str]:
    """What resume and export say of `folder` (each a CheckpointError); nothing on disk changes."""
    before = tree_hash(folder)
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as resume:
        ck.resume(make_state(seed=1))
    ck.close(make_state())
    with pytest.raises(CheckpointError) as export:
        export_weights(folder, tmp_path / "out.pt")
    assert tree_hash(folder) == before
    return [str(resume.value), str(export.value)]


def test_a_fifo_named_by_the_manifest_is_refused_unopened(tmp_path: Path) -> None:
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    fifo = FifoWriter(folder / "extra.bin")
    try:
        list_in_manifest(folder, "extra.bin", 0)
        messages = refused(tmp_path, folder)
        opened = fifo.opened.is_set()
    finally:
        fifo.close()
    assert not opened  # never opened: a writer that never writes would hang the read
    assert messages == [f"{folder}: corrupt checkpoint (extra.bin is a FIFO (named pipe), not a regular file); "
                        f"nothing was changed: move it out of {folder.parent} to resume from "
        "step_00000001 (the previous committed checkpoint)"] * 2


@pytest.mark.parametrize("name", ["../../secret.txt", "{absolute}", ".", "sub/../../../secret.txt"])
def test_a_name_leading_outside_the_folder_is_refused_unread(tmp_path: Path, name: str) -> None:
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    secret = tmp_path / "secret.txt"
    secret.write_text("not trainflow's")
    name = name.replace("{absolute}", str(secret))
    list_in_manifest(folder, name, secret.stat().st_size, files=name != str(secret))  # a checksum alone, too
    assert refused(tmp_path, folder) == [
        f"{folder}: corrupt checkpoint (manifest.json lists {name!r}, which is not a file name inside the checkpoint "
        f"folder); nothing was changed: move it out of {folder.parent} to resume from "
        "step_00000001 (the previous committed checkpoint)"] * 2


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_a_link_is_refused_not_followed(tmp_path: Path, target: str) -> None:
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    if target == "outside":  # a link in place of the shard, to a copy of it: the same bytes, not trainflow's file
        shard = folder / "__0_0.distcp"
        outside = tmp_path / "elsewhere.distcp"
        shard.rename(outside)
        shard.symlink_to(outside)
        name = shard.name
    else:
        name = "zeros"
        (folder / name).symlink_to(target)
        list_in_manifest(folder, name, 0)
    assert refused(tmp_path, folder) == [
        f"{folder}: corrupt checkpoint ({name} is a symbolic link, not a regular file); nothing was changed: move it "
        f"out of {folder.parent} to resume from step_00000001 (the previous committed checkpoint)"] * 2


def test_a_checksum_without_a_size_is_refused(tmp_path: Path) -> None:
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    (folder / "extra.bin").write_bytes(b"x" * 10)
    list_in_manifest(folder, "extra.bin", 10, files=False)
    assert refused(tmp_path, folder) == [
        f"{folder}: corrupt checkpoint (manifest.json gives extra.bin a checksum but no size); nothing was changed: "
        f"move it out of {folder.parent} to resume from "
        "step_00000001 (the previous committed checkpoint)"] * 2


def test_a_shard_the_manifest_does_not_list_is_not_read(tmp_path: Path) -> None:
    """.metadata may name any file as a shard: only one the manifest lists (and so checked) is opened."""
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    key = "app.model.net.0.weight"
    info = records(folder)[key]
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((folder / "__0_0.distcp").read_bytes())
    metadata = read_metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../outside.distcp")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)
    assert refused(tmp_path, folder) == [
        f"{folder}/.metadata: names '../../outside.distcp' as a shard, which the manifest does not list; the "
        "checkpoint is corrupt or was tampered with"] * 2


# ---------------------------------------------------------------------------------------------------------------
# what trainflow deletes in checkpoint.dir: only the .tmp- folders it can prove it made


def test_a_folder_in_the_way_of_a_save_is_refused_not_deleted(tmp_path: Path) -> None:
    """A `.tmp-step_N` of trainflow's naming without its marker (made by someone else) where a save must go."""
    state = make_state()
    ck = checkpointer(tmp_path, save_final=False)
    ck.resume(state)
    step(state)
    ck.after_step(state)  # step 1 committed
    in_the_way = tmp_path / "ckpts" / ".tmp-step_00000002"
    in_the_way.mkdir()
    (in_the_way / "data.csv").write_text("someone's data")
    step(state)
    with pytest.raises(CheckpointError) as exc:
        ck.after_step(state)
    ck.close(state)
    assert str(exc.value) == (
        f"checkpoint.dir: {in_the_way} is in the way of a save and trainflow did not make it (no "
        ".trainflow-unfinished inside); nothing was changed: move it away, or point checkpoint.dir at a folder of "
        "trainflow's own")
    assert (in_the_way / "data.csv").read_text() == "someone's data"
    assert [p.name for p in in_the_way.iterdir()] == ["data.csv"]


def test_retention_marks_a_checkpoint_before_retiring_it(tmp_path: Path) -> None:
    """A retired folder that outlives its deletion (a crash) is provably trainflow's at the next start."""
    from trainflow.checkpoint import store

    train_and_save(tmp_path, 3, keep_last=3)
    ckpts = tmp_path / "ckpts"
    assert not (ckpts / "step_00000001" / store.TMP_MARKER).exists()  # a committed checkpoint carries none
    retired = store.retain(ckpts, 1, None)
    assert retired == [ckpts / ".tmp-deleting-step_00000001", ckpts / ".tmp-deleting-step_00000002"]
    assert all((r / store.TMP_MARKER).is_file() for r in retired)
    store.remove_leftovers(ckpts)
    assert sorted(p.name for p in ckpts.iterdir() if p.name != ".lock") == ["step_00000003"]
