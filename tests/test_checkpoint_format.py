"""The bytes of a shard (format 3): each tensor's raw bytes back to back, read back with the dtype and shape of
DCP's metadata and no unpickling; records that disagree with their metadata are refused in one line; a checkpoint
of another format (2: one torch.save archive per tensor; a newer one) is refused in one line, by resume and export,
and a torch.save record never runs.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.checkpoints import checkpointer, make_state, records, rewrite_manifest, shard, train_and_save, tree_hash

from trainflow.checkpoint.safe_io import RAW_RECORD, ChecksummingWriter, SafeReader, file_checksum, read_metadata
from trainflow.checkpoint.state import FORMAT, flatten, split_state
from trainflow.config.schema import typed_section
from trainflow.errors import CheckpointError


def test_a_shard_is_the_tensors_raw_bytes_back_to_back(tmp_path: Path) -> None:
    state = train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    tensors = {f"app.{k}": v for k, v in flatten(split_state(state)[0]).items()}
    found = records(folder)
    assert found.keys() == tensors.keys()
    data = shard(folder).read_bytes()
    for key, tensor in tensors.items():
        info = found[key]
        assert (info.relative_path, list(info.transform_descriptors)) == ("__0_0.distcp", [RAW_RECORD])
        assert info.length == tensor.numel() * tensor.element_size()
        assert data[info.offset:info.offset + info.length] == tensor.detach().numpy().tobytes(), key
    assert len(data) == sum(t.numel() * t.element_size() for t in tensors.values())  # no archive, no header
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == FORMAT == 3
    assert manifest["checksums"]["__0_0.distcp"] == file_checksum(shard(folder))


def test_raw_records_round_trip_every_dtype_and_shape(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "bool": torch.tensor([True, False, True]),
             "empty": torch.empty(0, 4), "scalar": torch.tensor(7, dtype=torch.int64),
             "transposed": torch.randn(4, 6).t(), "float64": torch.randn(2, 3, 2, dtype=torch.float64),
             "complex": torch.randn(3, dtype=torch.complex64), "int8": torch.arange(-5, 5, dtype=torch.int8)}
    writer = ChecksummingWriter(tmp_path)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    assert writer.checksums == {p.name: file_checksum(p) for p in tmp_path.iterdir()}  # hashed as written
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=SafeReader(tmp_path), no_dist=True)
    assert {k: (v.dtype, v.shape) for k, v in loaded.items()} == {k: (v.dtype, v.shape) for k, v in saved.items()}
    assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == []


def test_the_writer_refuses_to_pickle_a_non_tensor(tmp_path: Path) -> None:
    from trainflow.checkpoint.safe_io import root_error

    with pytest.raises(BaseException) as exc:  # noqa: PT011 (DCP wraps what the writer raised in its own exception)
        dcp.save({"weight": torch.ones(2), "progress": {"step": 3}}, storage_writer=ChecksummingWriter(tmp_path),
                 no_dist=True)
    error = root_error(exc.value)
    assert isinstance(error, CheckpointError) and str(error) == (
        "progress.step: not a tensor; trainflow keeps non-tensor state out of the shards (in state.json), it never "
        "pickles it")
    assert list(tmp_path.iterdir()) == []  # no shard, no .metadata


def rewrite_metadata(folder: Path, key: str, **changes) -> None:
    """Change one record of `.metadata` (what damage or a tamperer could do), the manifest made to match."""
    import dataclasses

    metadata = read_metadata(folder)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)


@pytest.mark.parametrize("damage", ["length", "truncated"])
def test_a_record_that_disagrees_with_its_metadata_is_refused_in_one_line(tmp_path: Path, damage: str) -> None:
    train_and_save(tmp_path, 2)
    folder = tmp_path / "ckpts" / "step_00000002"
    key = "app.optim.state.net.2.weight.exp_avg_sq"
    info = records(folder)[key]
    if damage == "length":
        rewrite_metadata(folder, key, length=info.length - 4)
        expected = (f"{folder}/__0_0.distcp: {key} is recorded as 252 bytes, its shape [4, 16] torch.float32 needs "
                    "256; the checkpoint is corrupt")
    else:
        shard(folder).write_bytes(shard(folder).read_bytes()[:info.offset + 10])
        rewrite_manifest(folder)
        expected = f"{folder}/__0_0.distcp: ends inside {key} (truncated); the checkpoint is corrupt"
    before = tree_hash(tmp_path / "ckpts")
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        ck.resume(make_state(seed=1))
    ck.close(make_state())
    assert str(exc.value) == expected
    assert tree_hash(tmp_path / "ckpts") == before


def save_in_format_2(folder: Path) -> None:
    """Turn a committed checkpoint into what trainflow wrote before raw records: the same tensors, each as its own
    torch.save archive (DCP's stock writer), format 2 in the manifest."""
    metadata = read_metadata(folder)
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=True)
    for name in ("__0_0.distcp", ".metadata"):
        (folder / name).unlink()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    assert all(not info.transform_descriptors for info in records(folder).values())
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": 2}))
    rewrite_manifest(folder)


def refusals(tmp_path: Path, folder: Path) -> list[str]:
    """What a resume (in full and weights only) and an export of `folder` say; the folder must stay as it was."""
    from trainflow.checkpoint import export_weights

    before = tree_hash(folder)
    messages = []
    for overrides in ({"dir": str(folder.parent)}, {"dir": str(tmp_path / "new"), "resume": str(folder),
                                                    "load": "model"}):
        ck = checkpointer(tmp_path, **overrides)
        with pytest.raises(CheckpointError) as exc:
            ck.resume(make_state(seed=1))
        ck.close(make_state())
        messages.append(str(exc.value))
    with pytest.raises(CheckpointError) as exc:
        export_weights(folder, tmp_path / "out.pt")
    messages.append(str(exc.value))
    assert tree_hash(folder) == before and not (tmp_path / "out.pt").exists()
    return messages


def test_a_format_2_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    from trainflow import __version__

    train_and_save(tmp_path, 3, save_final=False)
    folder = tmp_path / "ckpts" / "step_00000003"
    save_in_format_2(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "trainflow_version": "0.1.0.dev7"}))
    assert refusals(tmp_path, folder) == [
        f"{folder}: saved in checkpoint format 2 by trainflow 0.1.0.dev7, an older format: this trainflow "
        f"({__version__}) reads format 3 only; nothing was changed: export its weights with that trainflow, or point "
        "checkpoint.dir at a new folder to start fresh"] * 3


def test_a_newer_format_is_named_and_refused_by_resume_and_export(tmp_path: Path) -> None:
    """A newer trainflow may keep what this one cannot check: export must not skip the checks of a format it does
    not know (the checksums below no longer match either)."""
    from trainflow import __version__

    train_and_save(tmp_path, 3, save_final=False)
    folder = tmp_path / "ckpts" / "step_00000003"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(format=FORMAT + 1, trainflow_version="9.0.0", checksums={n: "0" for n in manifest["files"]})
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert refusals(tmp_path, folder) == [
        f"{folder}: saved in checkpoint format 4 by trainflow 9.0.0, a newer format: this trainflow ({__version__}) "
        "reads format 3 only; nothing was changed: resume or export it with that trainflow or a newer one"] * 3


def test_a_torch_save_record_is_refused_without_running_it(tmp_path: Path) -> None:
    """A record stored as a torch.save archive (what format 2 wrote), planted in a format-3 checkpoint with its
    manifest made to match: refused by the reader, its object never unpickled."""
    from trainflow.checkpoint import export_weights

    train_and_save(tmp_path, 2)
    folder, marker = tmp_path / "ckpts" / "step_00000002", tmp_path / "ran"

    class Trap:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    archive = io.BytesIO()
    torch.save(Trap(), archive)  # a torch.save archive whose object runs code when unpickled
    (folder / "__1_0.distcp").write_bytes(archive.getvalue())
    rewrite_metadata(folder, "app.model.net.0.weight", relative_path="__1_0.distcp", offset=0,
                     length=len(archive.getvalue()), transform_descriptors=None)
    pickle.loads(pickle.dumps(Trap()))  # the payload is live: read the usual way, it runs
    assert marker.exists()
    marker.unlink()

    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as resume_error:
        ck.resume(make_state(seed=1))
    ck.close(make_state())
    with pytest.raises(CheckpointError) as export_error:
        export_weights(folder, tmp_path / "out.pt")
    assert not marker.exists()
    assert str(resume_error.value) == str(export_error.value) == (
        f"{folder}: app.model.net.0.weight is a torch.save record, which checkpoint format 3 never writes; trainflow "
        "reads raw records only: the checkpoint is not of this format or was tampered with")


def test_weights_of_another_layout_are_refused_before_loading(tmp_path: Path) -> None:
    """Names and shapes cannot tell the order of the numbers behind them (the GPT's qkv rows went from q, k, v of
    all heads to head by head): a model that declares a weights_layout has it saved with each checkpoint, and one
    saved before (no layout: 1) or in another layout is refused in one line, nothing loaded."""
    from helpers.checkpoints import OPTIM

    from trainflow.checkpoint import TrainState
    from trainflow.models.gpt import GPT
    from trainflow.models.mlp import MLP
    from trainflow.optim import build_optimizer

    assert GPT.weights_layout == 2

    class LaidOut(MLP):
        weights_layout = 2

    def laid_out() -> TrainState:
        model = LaidOut(in_features=8, hidden=16, out_features=4)
        model.load_state_dict(make_state(seed=1).model.state_dict())
        return TrainState(model, *build_optimizer(model, typed_section("optim", OPTIM), 100, torch.device("cpu")))

    train_and_save(tmp_path, 2, laid_out(), save_final=False)
    folder = tmp_path / "ckpts" / "step_00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["weights_layout"] == 2
    del manifest["weights_layout"]  # what a trainflow before layouts wrote
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = tree_hash(folder)
    state = laid_out()
    untouched = {k: v.clone() for k, v in state.model.state_dict().items()}
    ck = checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        ck.resume(state)
    ck.close(state)
    assert str(refused.value) == (
        f"{folder} holds the model's weights in layout 1, and this trainflow's model reads layout 2 (the same names "
        "and shapes, their numbers in another order); resume it with the trainflow that saved it, or set "
        "checkpoint.dir to a new folder to start fresh")
    assert all(torch.equal(v, untouched[k]) for k, v in state.model.state_dict().items())
    assert tree_hash(folder) == before and state.step == 0
