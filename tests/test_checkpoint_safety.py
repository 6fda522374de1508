"""Checkpoints a user can trust: nothing non-finite committed, damage caught before loading, no code run on load,
resumes that say what they change. The Checkpointer in this process, on real DCP files damaged or booby-trapped on
disk; what a user sees of the same cases in a real process is in test_bad_inputs.py (one line, exit 2) and
test_checkpoint.py (signals).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import (
    SGD,
    checkpointer,
    committed,
    make_state,
    rewrite_manifest,
    shard,
    step,
    train_and_save,
    tree_hash,
)

from trainflow.checkpoint import TrainState, list_committed
from trainflow.errors import CheckpointError
from trainflow.util.locks import LOCK_FILE


def flip_a_byte_of(tensor: torch.Tensor, file: Path) -> None:
    """Flip one bit inside `tensor`'s bytes where the file stores them (found by content, as a disk would)."""
    data = bytearray(file.read_bytes())
    at = data.find(tensor.detach().numpy().tobytes())
    assert at >= 0  # found (a raw shard may start with it)
    data[at + 1] ^= 0x10
    file.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------------------------
# non-finite state


def test_a_non_finite_state_is_never_committed_and_the_newest_finite_one_stays(tmp_path: Path) -> None:
    state = train_and_save(tmp_path, 3, keep_last=1)
    ckpts = tmp_path / "ckpts"
    assert committed(ckpts) == ["step_00000003"]
    manifest = json.loads((ckpts / "step_00000003" / "manifest.json").read_text())
    assert manifest["finite"] is True
    before = tree_hash(ckpts)

    ck = checkpointer(tmp_path, keep_last=1, save_final=False)
    ck.resume(state)
    step(state)
    with torch.no_grad():
        state.model.net[2].weight[1, 3] = math.nan  # what a diverged step leaves behind
    with pytest.raises(CheckpointError) as exc:
        ck.after_step(state)
    ck.close(state)
    assert str(exc.value) == ("checkpoint: step 4 has non-finite values (model.net.2.weight); not committed, newest "
                              "finite checkpoint step_00000003 kept; the training diverged: lower optim.lr (or raise "
                              "optim.warmup_steps) and run again")
    assert tree_hash(ckpts) == before  # nothing written, nothing deleted
    assert committed(ckpts) == ["step_00000003"]

    with torch.no_grad():  # an infinite optimizer moment is refused the same way
        state.model.net[2].weight[1, 3] = 0.0
        next(iter(state.optimizer.state.values()))["exp_avg_sq"][0] = math.inf
    ck = checkpointer(tmp_path, keep_last=1, save_final=False)
    with pytest.raises(CheckpointError, match=r"step 4 has non-finite values \(optim\.state\.net\.0\.weight\."
                                              r"exp_avg_sq\)"):
        ck._save(state, blocking=True)
    ck.close(state)
    assert tree_hash(ckpts) == before


def test_large_finite_values_are_not_taken_for_non_finite_ones() -> None:
    from trainflow.checkpoint.state import first_nonfinite

    assert first_nonfinite({"big": torch.full((4,), 1e30), "ok": torch.ones(3)}) is None  # its L2 norm overflows
    assert first_nonfinite({"big": torch.full((4,), 1e30), "bad": torch.tensor([1.0, -math.inf])}) == "bad"
    assert first_nonfinite({"steps": torch.tensor([3]), "nan": torch.tensor([math.nan])}) == "nan"


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path: Path) -> None:
    train_and_save(tmp_path, 3)
    ckpts = tmp_path / "ckpts"
    for name in ("step_00000002", "step_00000003"):  # say these were not known finite
        path = ckpts / name / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "finite": False}))
    ck = checkpointer(tmp_path, keep_last=1)
    ck._retain()
    ck._deleter.wait()  # the retired folders' files are removed in a thread
    assert committed(ckpts) == ["step_00000001", "step_00000003"]  # the newest, and the newest finite


def test_retention_retires_at_once_and_deletes_in_a_thread(tmp_path: Path) -> None:
    from trainflow.checkpoint.store import Deleter, retain

    train_and_save(tmp_path, 3)
    ckpts = tmp_path / "ckpts"
    retired = retain(ckpts, 1, None)
    assert retired == [ckpts / ".tmp-deleting-step_00000001", ckpts / ".tmp-deleting-step_00000002"]
    assert [c.path.name for c in list_committed(ckpts)] == ["step_00000003"]  # no longer checkpoints, at once
    deleter = Deleter()
    deleter.delete(retired)
    deleter.wait()
    assert sorted(p.name for p in ckpts.iterdir() if p.name != LOCK_FILE) == ["step_00000003"]


def test_verify_compares_nan_as_equal_and_names_a_damaged_key(tmp_path: Path) -> None:
    from trainflow.checkpoint.state import differences as _differences

    a = torch.tensor([1.0, math.nan, math.inf])
    assert _differences({"x": a}, {"x": a.clone()}) == []  # torch.equal says they differ
    assert _differences({"x": a}, {"x": torch.tensor([1.0, math.nan, 0.0])}) == ["x"]

    # damaged between the write and the read-back: the self-check fails and names the key
    state = train_and_save(tmp_path, 2, verify=False)
    path = tmp_path / "ckpts" / "step_00000002"
    flip_a_byte_of(state.model.net[0].weight, shard(path))
    with pytest.raises(CheckpointError) as exc:
        checkpointer(tmp_path)._verify(state)
    assert str(exc.value) == (f"checkpoint.verify: {path} does not read back what was saved (model.net.0.weight); "
                              "the storage under checkpoint.dir is unreliable: use another disk")


# ---------------------------------------------------------------------------------------------------------------
# integrity: checksums, steps, folders without a manifest, renamed folders


def test_a_flipped_byte_is_refused_before_loading(tmp_path: Path) -> None:
    from trainflow.checkpoint import export_weights

    state = train_and_save(tmp_path, 3, keep_last=2)
    ckpts = tmp_path / "ckpts"
    manifest = json.loads((ckpts / "step_00000003" / "manifest.json").read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) >= {"__0_0.distcp", ".metadata", "state.json",
                                                                     "rng_rank00000.json"}
    flip_a_byte_of(state.model.net[2].bias, shard(ckpts / "step_00000003"))
    before = tree_hash(ckpts)
    expected = (rf"{ckpts}/step_00000003: corrupt checkpoint \(__0_0.distcp has checksum [0-9a-f]{{16}}, the manifest "
                rf"says {manifest['checksums']['__0_0.distcp']} \(its bytes changed after the save\)\); nothing was "
                rf"changed: move it out of {ckpts} to resume from step_00000002 \(the previous committed checkpoint\)")
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{expected}$"):
        ck.resume(make_state(seed=1))
    ck.close(make_state())
    with pytest.raises(CheckpointError, match=f"^{expected}$"):
        export_weights(ckpts / "step_00000003", tmp_path / "out.pt")
    assert tree_hash(ckpts) == before and not (tmp_path / "out.pt").exists()


def test_a_newest_step_folder_without_a_manifest_is_refused_not_skipped(tmp_path: Path) -> None:
    train_and_save(tmp_path, 3)
    ckpts = tmp_path / "ckpts"
    shutil.copytree(ckpts / "step_00000003", ckpts / "step_00000004")
    (ckpts / "step_00000004" / "manifest.json").unlink()
    before = tree_hash(ckpts)
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        ck.resume(make_state())
    ck.close(make_state())
    assert str(exc.value) == (f"{ckpts}/step_00000004: a checkpoint folder without manifest.json, newer than every "
                              "committed one (a save that never committed, or a manifest that was lost); nothing was "
                              f"changed: move it out of {ckpts} to resume from step_00000003")
    assert tree_hash(ckpts) == before


def test_a_renamed_folder_neither_leads_nor_makes_retention_delete(tmp_path: Path, caplog) -> None:
    from trainflow.checkpoint import check_intact

    train_and_save(tmp_path, 3, keep_last=2)
    ckpts = tmp_path / "ckpts"
    os.rename(ckpts / "step_00000002", ckpts / "step_00000100")  # a folder renamed by hand
    assert [c.step for c in list_committed(ckpts)] == [2, 3]  # ordered by the manifest's step
    with pytest.raises(CheckpointError, match=r"the folder is named step_00000100 but its manifest says step 2"):
        check_intact(list_committed(ckpts)[0], list_committed(ckpts))

    state = make_state(seed=5)
    with caplog.at_level(logging.WARNING, logger="trainflow.checkpoint"):
        train_and_save(tmp_path, 3, state=state, keep_last=2)
    assert state.step == 6  # resumed from step 3, not from the folder named 100
    assert "step_00000100 holds step 2 (its manifest says so): a renamed folder" in caplog.text
    # keep_last=2 kept 5 and 6, 3 as the one resumed from; the folder named 100 is never deleted
    assert committed(ckpts) == ["step_00000003", "step_00000005", "step_00000006", "step_00000100"]


# ---------------------------------------------------------------------------------------------------------------
# loading runs no code


def trap(marker: Path) -> bytes:
    """A pickle that creates `marker` when it is unpickled."""

    class Trap:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    return pickle.dumps(Trap())


def plant_in_a_shard(folder: Path, payload: bytes) -> None:
    """Declare a model tensor of `folder` as a pickled object stored in a shard of its own, holding `payload`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from trainflow.checkpoint.safe_io import read_metadata

    (folder / "__1_0.distcp").write_bytes(payload)
    metadata = read_metadata(folder)
    key = "app.model.net.0.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__1_0.distcp", 0, len(payload))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_the_traps_are_live(tmp_path: Path) -> None:
    """The payloads the next tests plant really run when read the usual way (pickle, stock DCP)."""
    import torch.distributed.checkpoint as dcp

    pickle.loads(trap(tmp_path / "unpickled"))
    assert (tmp_path / "unpickled").exists()
    state = train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    plant_in_a_shard(folder, trap(tmp_path / "loaded"))
    with pytest.raises(BaseException):  # noqa: B017,PT011 (the planted object is no tensor: DCP fails after running it)
        dcp.load({"app": {"model": state.model.state_dict()}}, checkpoint_id=folder, no_dist=True)
    assert (tmp_path / "loaded").exists()


@pytest.mark.parametrize("where", [".metadata", "shard payload", "rng", "state.json"])
def test_a_booby_trapped_checkpoint_is_refused_without_running_it(tmp_path: Path, where: str) -> None:
    from trainflow.checkpoint import export_weights

    train_and_save(tmp_path, 2)
    folder, marker = tmp_path / "ckpts" / "step_00000002", tmp_path / "ran"
    if where == ".metadata":
        (folder / ".metadata").write_bytes(trap(marker))
    elif where == "shard payload":  # a model tensor declared as a pickled object in a shard of its own
        plant_in_a_shard(folder, trap(marker))
    elif where == "rng":
        (folder / "rng_rank00000.json").write_bytes(trap(marker))
    else:
        (folder / "state.json").write_bytes(trap(marker))
    rewrite_manifest(folder)

    messages = []
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        ck.resume(make_state())
    ck.close(make_state())
    messages.append(str(exc.value))
    if where in (".metadata", "shard payload"):  # export reads these two as well
        with pytest.raises(CheckpointError) as exc:
            export_weights(folder, tmp_path / "out.pt")
        messages.append(str(exc.value))
    assert not marker.exists()
    assert all("\n" not in m and str(folder) in m for m in messages), messages
    if where == ".metadata":
        assert messages == [f"{folder}/.metadata: refused without running it: it refers to builtins.exec, which DCP "
                            "metadata never holds; the checkpoint is damaged or was tampered with: do not use it"] * 2
    expected = {".metadata": "refused without running it: it refers to builtins.exec",
                "shard payload": "app.model.net.0.weight is stored as a pickled object, which trainflow does not load",
                "rng": "rng_rank00000.json: unreadable", "state.json": "state.json: unreadable"}[where]
    assert all(expected in m for m in messages), messages


def save_in_the_format_before_checksums(state: TrainState, folder: Path) -> None:
    """A checkpoint as trainflow wrote it before this format (b7225b5): one DCP save of the whole AppState, with the
    optimizer's param_groups, the scheduler, the progress and a pickled RNG blob inside the shards."""
    import random

    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainflow.checkpoint import fingerprint
    from trainflow.checkpoint.state import model_shapes as _model_shapes

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    rng = pickle.dumps({"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.get_rng_state().numpy()})
    app = {"model": model_sd, "optim": optim_sd, "scheduler": state.scheduler.state_dict(),
           "progress": {"step": state.step, "samples_seen": state.samples_seen}, "rng": {"rank0": rng}}
    dcp.save({"app": app}, checkpoint_id=folder, no_dist=True)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / "manifest.json").write_text(json.dumps({
        "step": state.step, "samples_seen": state.samples_seen, "world_size": 1, "save_s": 0.1,
        "committed_at": "2026-11-29T13:53:40+00:00", "trainflow_version": "0.1.0", "torch_version": torch.__version__,
        "model_fingerprint": fingerprint(_model_shapes(state.model)), "files": files, "bytes": sum(files.values())}))


def test_a_checkpoint_from_before_checksums_is_refused_in_one_line(tmp_path: Path) -> None:
    """Format 1 pickled the RNG and optimizer settings into its shards: neither resumed nor exported (reading its
    torch.save records is gone with format 2's), in one line, the folder unchanged."""
    from trainflow import __version__
    from trainflow.checkpoint import export_weights

    old = make_state()
    for _ in range(3):
        step(old)
    folder = tmp_path / "old" / "step_00000003"
    save_in_the_format_before_checksums(old, folder)
    before = tree_hash(folder)
    messages = []
    for overrides in ({"dir": str(tmp_path / "old")}, {"dir": str(tmp_path / "new"), "resume": str(folder),
                                                      "load": "model"}):
        ck = checkpointer(tmp_path, **overrides)
        with pytest.raises(CheckpointError) as exc:
            ck.resume(make_state(seed=1))
        ck.close(make_state())
        messages.append(str(exc.value))
    with pytest.raises(CheckpointError) as exc:
        export_weights(folder, tmp_path / "weights.pt")
    messages.append(str(exc.value))
    assert messages == [
        f"{folder}: saved in checkpoint format 1 by trainflow 0.1.0, an older format: this trainflow ({__version__}) "
        "reads format 3 only; nothing was changed: export its weights with that trainflow, or point checkpoint.dir "
        "at a new folder to start fresh"] * 3
    assert tree_hash(folder) == before and not (tmp_path / "weights.pt").exists()


# ---------------------------------------------------------------------------------------------------------------
# resume says what it changes


def test_a_changed_learning_rate_is_applied_and_said(tmp_path: Path, caplog) -> None:
    saved = train_and_save(tmp_path, 3)
    same = make_state(seed=1)
    ck = checkpointer(tmp_path, save_final=False)
    ck.resume(same)
    ck.close(same)
    assert ck.summary()["resume_changes"] == []
    assert same.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]  # exactly, unchanged

    changed = make_state(seed=1, lr=5e-3, betas=[0.8, 0.95])
    ck = checkpointer(tmp_path, save_final=False)
    with caplog.at_level(logging.WARNING, logger="trainflow.checkpoint"):
        ck.resume(changed)
    ck.close(changed)
    assert ck.summary()["resume_changes"] == [
        {"key": "optim.betas", "checkpoint": (0.9, 0.95), "used": (0.8, 0.95)},
        {"key": "optim.lr", "checkpoint": 0.01, "used": 0.005}]
    assert "resume: optim.lr is 0.005 in the config, 0.01 in the checkpoint; using the config's 0.005" in caplog.text
    factor = saved.optimizer.param_groups[0]["lr"] / 1e-2  # where the schedule is at step 3
    groups = changed.optimizer.param_groups
    assert groups[0]["initial_lr"] == 5e-3 and groups[0]["lr"] == pytest.approx(5e-3 * factor, rel=1e-12)
    assert groups[0]["betas"] == (0.8, 0.95)
    assert changed.scheduler.base_lrs == [5e-3, 5e-3]
    step(changed)  # the schedule goes on from step 3 with the new base LR
    assert groups[0]["lr"] == pytest.approx(5e-3 * changed.scheduler.lr_lambdas[0](4), rel=1e-12)
    assert changed.step == 4


def test_a_resume_fits_the_configs_parameter_groups_and_puts_the_schedule_at_the_step(tmp_path: Path) -> None:
    """Two groups saved (weight decay), one resumed (optim.weight_decay=0): the optimizer state follows each
    parameter by name. A constant schedule is not stepped by the loop: the resume puts a cosine one at the step."""
    saved = train_and_save(tmp_path, 3)
    assert len(saved.optimizer.param_groups) == 2
    one_group = make_state(seed=1, weight_decay=0.0, schedule="constant", warmup_steps=0)
    ck = checkpointer(tmp_path, save_final=False)
    ck.resume(one_group)
    ck.close(one_group)
    assert ck.summary()["resume_changes"] == [{"key": "optim.weight_decay", "checkpoint": 0.1, "used": 0.0}]
    assert len(one_group.optimizer.param_groups) == 1 and one_group.optimizer.param_groups[0]["lr"] == 1e-2
    names = [n for n, _ in saved.model.named_parameters()]
    for name, before, after in zip(names, saved.model.parameters(), one_group.model.parameters(), strict=True):
        assert torch.equal(before, after), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved.optimizer.state[before][key], one_group.optimizer.state[after][key]), name

    constant = make_state(seed=2, schedule="constant", warmup_steps=0)  # saved at step 3, schedule never stepped
    for _ in range(3):
        constant.model(torch.randn(4, 8)).square().mean().backward()
        constant.optimizer.step()
        constant.step += 1
    ck = checkpointer(tmp_path / "constant", every_steps=100)
    ck.resume(constant)
    ck.close(constant)
    cosine = make_state(seed=2)
    ck = checkpointer(tmp_path / "constant", save_final=False)
    ck.resume(cosine)
    ck.close(cosine)
    assert cosine.step == 3 and cosine.scheduler.last_epoch == 3
    assert cosine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * cosine.scheduler.lr_lambdas[0](3))


def test_a_changed_optimizer_says_so_and_loads_weights_only_when_asked(tmp_path: Path) -> None:
    saved = train_and_save(tmp_path, 3)
    path = tmp_path / "ckpts" / "step_00000003"
    sgd = make_state(seed=1, base=SGD)
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        ck.resume(sgd)
    ck.close(sgd)
    assert str(exc.value) == (
        f"{path}: saved with the AdamW optimizer, this run builds SGD (optim._target_); its optimizer state does not "
        "fit: to continue from its weights only (fresh optimizer and LR schedule from step 0), run with "
        f"checkpoint.load=model checkpoint.resume={path} and checkpoint.dir at a new folder, or set optim._target_ "
        "back")

    ck = checkpointer(tmp_path, dir=str(tmp_path / "sgd"), resume=str(path), load="model", every_steps=2)
    ck.resume(sgd)
    assert (sgd.step, sgd.samples_seen, sgd.scheduler.last_epoch) == (0, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(sgd.model.state_dict().values(), saved.model.state_dict().values(),
                                                 strict=True))
    for _ in range(2):
        step(sgd)
        ck.after_step(sgd)
    ck.close(sgd)
    assert committed(tmp_path / "sgd") == ["step_00000002"]

    again = make_state(seed=2, base=SGD)  # the same command again: this run's own checkpoint, in full
    ck = checkpointer(tmp_path, dir=str(tmp_path / "sgd"), resume=str(path), load="model")
    ck.resume(again)
    ck.close(again)
    assert again.step == 2 and ck.summary()["resumed_from"] == str(tmp_path / "sgd" / "step_00000002")
