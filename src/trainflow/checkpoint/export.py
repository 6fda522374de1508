"""`trainflow export`: a committed checkpoint's weights in a format other tools load, never at a checkpoint's cost.

Formats: `torch` (one `torch.load(weights_only=True)` file of the model's tensors).

Where an export goes: never inside a checkpoint folder (a step_N folder, a save in progress, a checkpoint dir
holding committed checkpoints; links followed), whatever `force` says; an existing output is refused unless
`force`, and even then only a file or an earlier export folder (one holding EXPORT_INFO) is replaced. Everything is
written beside the output under a temporary name and renamed into place once whole, so a failed export leaves the
old output (or nothing) behind.

The checkpoint is read in this one process (no process group), whatever the world size and strategy that saved
it: the keys are the model's own names (DCP's get_model_state_dict strips compile, DDP and FSDP wrappers at save).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainflow.checkpoint.safe_io import SafeReader, failure_cause, read_metadata, reraise_interrupt, root_error
from trainflow.checkpoint.store import (
    MANIFEST,
    MODEL_PREFIX,
    TMP_PREFIX,
    Committed,
    check_intact,
    list_committed,
    resolve_checkpoint,
)
from trainflow.errors import CheckpointError, unwritable_reason

FORMATS = ("torch",)
EXPORT_INFO = "trainflow_export.json"  # in an export folder: what it was exported from (and the run's config)


class Source:
    """A committed, intact checkpoint and the tensors it holds, read on demand without running code."""

    def __init__(self, checkpoint: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.ck: Committed = resolve_checkpoint(checkpoint)
        check_intact(self.ck, list_committed(self.ck.path.parent))
        self.metadata = read_metadata(self.ck.path)
        entries = self.metadata.state_dict_metadata
        pickled = [k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata)]
        if pickled:
            raise CheckpointError(f"{self.ck.path}: {pickled[0]} is stored as a pickled object, which trainflow "
                                  "does not load (it could run code); the checkpoint was tampered with or is not "
                                  "trainflow's")
        self.tensors = dict(entries)  # DCP key (app.model.<name>, app.optim.state.<name>.<slot>) -> metadata

    @property
    def model_keys(self) -> dict[str, str]:
        """The model's tensor names -> their DCP keys."""
        return {k.removeprefix(MODEL_PREFIX): k for k in self.tensors if k.startswith(MODEL_PREFIX)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """These DCP keys' tensors, whole (every rank's shards joined), in CPU memory."""
        import torch.distributed.checkpoint as dcp

        out = {k: torch.empty(self.tensors[k].size, dtype=self.tensors[k].properties.dtype) for k in keys}
        try:
            dcp.load(out, storage_reader=SafeReader(self.ck.path, set(self.ck.manifest["files"])), no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            reraise_interrupt(exc)
            if isinstance(root_error(exc), CheckpointError):
                raise root_error(exc) from None
            raise CheckpointError(f"{self.ck.path}: cannot be read ({failure_cause(exc)}); it is corrupt") from exc
        return out


def export_weights(checkpoint: Path, out: str | Path, fmt: str = "torch", force: bool = False) -> dict[str, Any]:
    """Write the checkpoint's weights to `out` in format `fmt`; return what was written."""
    if fmt not in FORMATS:
        raise CheckpointError(f"export --format: must be one of {', '.join(FORMATS)}; got {fmt!r}")
    source = Source(Path(checkpoint))
    target = check_output(out, force)
    weights = source.read(list(source.model_keys.values()))
    model = {name: weights[key] for name, key in source.model_keys.items()}
    write_whole(target, lambda tmp: save_file(tmp, lambda f: torch.save(model, f)))
    return {"path": str(target), "format": fmt, "step": source.ck.step, "tensors": len(model),
            "bytes": size_of(target), "checkpoint": str(source.ck.path)}


def check_output(out: str | Path, force: bool) -> Path:
    """The output path, once it is known that writing it destroys nothing it must not."""
    if not str(out).strip():
        raise CheckpointError("export: the output path is empty; give the file or folder to write, e.g. "
                              "model.safetensors")
    path = Path(out).expanduser()
    real = path.resolve()  # a link into a checkpoint folder is refused like the folder itself
    for folder in (real, *real.parents):
        if is_checkpoint_folder(folder):
            raise CheckpointError(f"{path}: inside the checkpoint folder {folder}; an export never writes into a "
                                  "checkpoint folder (it would damage the checkpoints): give a path outside it")
    if path.exists() or path.is_symlink():
        if not force:
            raise CheckpointError(f"{path} already exists; nothing was changed: give a new path, or add --force to "
                                  "replace it")
        if path.is_dir() and not (path / EXPORT_INFO).is_file():
            raise CheckpointError(f"{path} is a folder trainflow did not export (no {EXPORT_INFO} inside); "
                                  "--force replaces only a file or an earlier export: give a new path")
    return path


def is_checkpoint_folder(folder: Path) -> bool:
    """A committed checkpoint, a save in progress, or a checkpoint dir holding committed checkpoints."""
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).exists() or (folder / ".metadata").exists() or folder.name.startswith(TMP_PREFIX):
        return True
    return bool(list_committed(folder))


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes a temporary path beside `path`, renamed over it once whole (an earlier output goes only
    then); nothing is left behind when it fails. An OSError is one line naming the output."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    old = path.with_name(f".{path.name}.old{os.getpid()}")
    stepped_aside = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        if path.is_dir() and not path.is_symlink():
            os.rename(path, old)  # a folder cannot be renamed over: the earlier export steps aside first
            stepped_aside = True
        os.replace(tmp, path)
        stepped_aside = False
    except OSError as exc:
        if stepped_aside:
            os.rename(old, path)
        raise CheckpointError(f"{path}: cannot write the export ({unwritable_reason(path.parent, exc)}); give a "
                              "path on a writable disk") from None
    finally:
        for leftover in (tmp, old):
            _remove(leftover)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def save_file(path: Path, write: Callable[[Any], None]) -> None:
    """Open `path` for writing ourselves, so that an unwritable place is an OSError (torch.save raises a
    RuntimeError of its C++ layer for a path it cannot open), and fsync it before it is renamed into place."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def size_of(path: Path) -> int:
    """Bytes of a file, or of the files of a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
