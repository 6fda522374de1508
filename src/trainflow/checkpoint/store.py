"""The on-disk store: committed checkpoints, their manifest and checksums, the commit, retention.

Layout of `checkpoint.dir` (default `<run dir>/checkpoints`):

    step_00000100/          a committed checkpoint: DCP shards, .metadata, state.json, rng_rankN.json, manifest.json
    .tmp-step_00000200/     a save in progress, or the leftover of a crashed one (removed at the next start)
    .tmp-deleting-step_N/   a checkpoint retention retired, being deleted (removed at the next start if it stays)

Only what trainflow can prove it made is ever removed: a `.tmp-` folder of its own naming that holds its marker
file (TMP_MARKER, written first into every folder it makes or retires, under the folder's lock), or such a folder
left empty. Anything else named `.tmp-*` (checkpoint.dir may be a shared scratch folder) is left alone, and said.

A save writes into `.tmp-step_N`; its commit writes manifest.json (sizes and checksums of every file,
`finite: true`) into it and renames it to `step_N` in one atomic rename. Listing, resume and retention see only
`step_N` folders holding a manifest, ordered by the manifest's step, so a checkpoint is committed or absent;
retention renames a doomed folder back to a `.tmp-` name before deleting it (in a thread: see Deleter).

A corrupt committed checkpoint (a checksum or size that differs, a missing .metadata, a renamed folder, a newest
step folder without a manifest) is refused, never skipped: resuming from an older one silently would hide lost
training. The error names it and the previous committed checkpoint; nothing on disk is changed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from trainflow import __version__
from trainflow.checkpoint.safe_io import (
    check_files,
    file_checksum,
    read_json,
)
from trainflow.checkpoint.state import FORMAT, STATE_FILE
from trainflow.errors import CheckpointError, ConfigError
from trainflow.util.files import kind_of
from trainflow.util.locks import DirLock
from trainflow.util.shown import shown

log = logging.getLogger(__package__)  # one name for the package: lines read [trainflow.checkpoint]

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TMP_MARKER = ".trainflow-unfinished"  # in a .tmp- folder: trainflow made it (a save, or a retired checkpoint)
_TMP_DIR = re.compile(r"\.tmp-(deleting-)?step_\d+")  # the names trainflow gives its .tmp- folders
MODEL_PREFIX = "app.model."  # where the model's tensors live in the flattened DCP keys
MAX_LISTED = 6  # mismatched keys named in an error before "and N more"
_STEP_DIR = re.compile(r"step_(\d+)")
_links_said: set[Path] = set()  # symbolically linked step folders retention has warned of (once each per process)


@dataclass(frozen=True)
class Committed:
    path: Path
    step: int  # the manifest's step (the folder's name when the manifest is unreadable)
    manifest: dict[str, Any] | None  # None: the manifest is unreadable (the checkpoint is corrupt)

    @property
    def folder_step(self) -> int:
        return int(_STEP_DIR.fullmatch(self.path.name).group(1))

    @property
    def renamed(self) -> bool:
        """The folder's name says another step than its manifest (a folder renamed by hand)."""
        return self.step != self.folder_step


def list_committed(ckpt_dir: Path) -> list[Committed]:
    """The committed checkpoints in `ckpt_dir`, oldest first by the step their manifest names; unfinished saves
    (`.tmp-` folders, step folders without a manifest) are not listed."""
    found = []
    if not ckpt_dir.is_dir():
        return found
    for child in ckpt_dir.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if not (match and (child / MANIFEST).is_file()):
            continue
        try:
            manifest = json.loads((child / MANIFEST).read_text())
            step = manifest["step"] if isinstance(manifest, dict) and isinstance(manifest.get("step"), int) else None
        except (OSError, ValueError):
            manifest, step = None, None
        if step is None:
            manifest, step = None, int(match.group(1))
        found.append(Committed(child, step, manifest))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def uncommitted_newer(ckpt_dir: Path, committed: list[Committed]) -> Path | None:
    """A `step_N` folder without a manifest, newer than every committed checkpoint: never skipped silently."""
    newest = committed[-1].step if committed else -1
    for child in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and not (child / MANIFEST).exists() and int(match.group(1)) > newest:
            return child
    return None


def check_intact(ck: Committed, others: list[Committed]) -> None:
    """Refuse a committed checkpoint of another format, or whose files do not match its manifest (truncated,
    changed, missing, renamed, not regular files)."""
    if ck.manifest is not None:
        check_format(ck)
    problem = None
    if ck.manifest is None:
        problem = f"{MANIFEST} is unreadable"
    elif ck.renamed:
        problem = f"the folder is named {ck.path.name} but its manifest says step {ck.step} (renamed by hand?)"
    else:
        problem = listed_files_problem(ck.path, ck.manifest)
        if problem is None:
            problem = check_files(ck.path, ck.manifest["checksums"])
        if problem is None and read_state(ck.path)["step"] != ck.step:
            problem = f"{STATE_FILE} holds another step than the manifest's {ck.step}"
    if problem:
        raise CheckpointError(f"{ck.path}: corrupt checkpoint ({problem}); {corrupt_fix(ck, others)}")


def check_format(ck: Committed) -> None:
    """Only this trainflow's format is read: an older one (pickled state, torch.save records) is no longer read,
    a newer one may hold what this version cannot check; either is named with the trainflow that wrote it."""
    found = ck.manifest.get("format", 1)  # format 1 wrote no format
    if found == FORMAT:
        return
    wrote = f"trainflow {ck.manifest.get('trainflow_version', 'of unknown version')}"
    here = f"this trainflow ({_trainflow_version()}) reads format {FORMAT} only"
    if isinstance(found, int) and found > FORMAT:
        raise CheckpointError(f"{ck.path}: saved in checkpoint format {found} by {wrote}, a newer format: {here}; "
                              "nothing was changed: resume or export it with that trainflow or a newer one")
    raise CheckpointError(f"{ck.path}: saved in checkpoint format {found} by {wrote}, an older format: {here}; "
                          "nothing was changed: export its weights with that trainflow, or point checkpoint.dir at a "
                          "new folder to start fresh")


_READ_BY_NAME = (".metadata", STATE_FILE)  # files every resume and export opens: the manifest must list them


def listed_files_problem(folder: Path, manifest: dict[str, Any]) -> str | None:
    """Why the files a manifest lists cannot be trusted to read, as a phrase; None when they can.

    Every name is a plain file name inside `folder`, listed with its size and checksum, a regular file (a FIFO or
    a device would hang the read, a link may lead outside) of the size the manifest says: all checked with lstat,
    before any file is opened.
    """
    files, sums = manifest.get("files"), manifest.get("checksums")
    if not isinstance(files, dict) or not isinstance(sums, dict):
        return f"{MANIFEST} has no table of files and checksums"
    for name in sorted({*files, *sums}):
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            return f"{MANIFEST} lists {name!r}, which is not a file name inside the checkpoint folder"
    for name in _READ_BY_NAME:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    no_size = sorted(sums.keys() - files.keys())
    if no_size:
        return f"{MANIFEST} gives {no_size[0]} a checksum but no size"
    for name, size in sorted(files.items()):
        try:
            found = os.lstat(folder / name)
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(found.st_mode):
            return f"{name} is {kind_of(found.st_mode)}, not a regular file"
        if found.st_size != size:
            return f"{name} is {found.st_size} bytes, the manifest says {size} (truncated)"
    if set(sums) != set(files):
        return "the manifest lacks a checksum for some of its files"
    return None


_STATE_KEYS = {"step": int, "samples_seen": int, "optimizer": str, "param_groups": list, "scheduler": dict}


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's state.json, with the keys and types a resume needs."""
    plain = read_json(folder / STATE_FILE)
    wrong = [k for k, kind in _STATE_KEYS.items() if not isinstance(plain, dict) or not isinstance(plain.get(k), kind)]
    if wrong:
        raise CheckpointError(f"{folder / STATE_FILE}: not a trainflow training state ({wrong[0]} is missing or of "
                              "the wrong type); the checkpoint is corrupt")
    return plain


def corrupt_fix(ck: Committed, others: list[Committed]) -> str:
    older = [c for c in others if c.step < ck.step]
    if older:
        return (f"nothing was changed: move it out of {ck.path.parent} to resume from {older[-1].path.name} "
                "(the previous committed checkpoint)")
    return f"nothing was changed: move it out of {ck.path.parent} to start fresh"


def resolve_checkpoint(path: Path) -> Committed:
    """A committed checkpoint from a user path: step_N itself, a checkpoint dir, or a run dir (their newest)."""
    path = path.expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a committed checkpoint (a step_N folder), "
                              "a checkpoint dir holding some, or a run dir")
    if _STEP_DIR.fullmatch(path.name) or path.name.startswith(TMP_PREFIX):
        listed = [c for c in list_committed(path.parent) if c.path.name == path.name]
        if not listed:
            raise CheckpointError(f"{path} is not a committed checkpoint (no {MANIFEST}: a save that never "
                                  "finished); pick a step_N folder that has one")
        return listed[0]
    for folder in (path, path / "checkpoints"):
        listed = list_committed(folder)
        if listed:
            return listed[-1]
    raise CheckpointError(f"{path} holds no committed checkpoint (no step_N folder with {MANIFEST})")


def resolve_dir(configured: str | None, run_dir: Path) -> Path:
    """`checkpoint.dir`: a checkpoint folder, or an earlier run's directory (its checkpoints/ is used)."""
    if configured is None:
        return run_dir / "checkpoints"
    path = Path(configured).expanduser()
    if (path / "checkpoints").is_dir() and not list_committed(path):
        return path / "checkpoints"
    return path


def new_manifest(step: int, samples_seen: int, world_size: int, save_s: float,
                 model_fingerprint: str | None, weights_layout: int | None) -> dict[str, Any]:
    """What a committed checkpoint says of itself; commit() adds its files, their checksums and the total bytes."""
    return {
        "format": FORMAT,
        "step": step,
        "samples_seen": samples_seen,
        "world_size": world_size,
        "finite": True,  # the checkpointer checked every tensor before the save
        "checksum": "xxh3_64",
        "save_s": round(save_s, 4),
        "committed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "trainflow_version": _trainflow_version(),
        "torch_version": torch.__version__,
        "model_fingerprint": model_fingerprint,
        "weights_layout": weights_layout,
    }


def commit(tmp: Path, final: Path, manifest: dict[str, Any], checksums: dict[str, str]) -> int:
    """Rank 0: the manifest, then the atomic rename that commits the checkpoint."""
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != TMP_MARKER}
    if ".metadata" not in files:
        raise CheckpointError(f"{tmp}: the save finished without a .metadata file; nothing was committed")
    if final.exists():
        raise CheckpointError(f"{final} already exists; point checkpoint.dir at a folder of one run")
    sums = {name: checksums.get(name) or file_checksum(tmp / name) for name in files}
    manifest = {**manifest, "files": files, "checksums": sums, "bytes": sum(files.values())}
    try:
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # the shards fit, the last small file did not: a full disk, a quota
        shutil.rmtree(tmp, ignore_errors=True)  # never committed: its space goes back at once
        committed = list_committed(final.parent)
        newest = f"newest: {committed[-1].path.name}" if committed else "there are none yet"
        raise CheckpointError(f"checkpoint.dir: saving step {manifest['step']} to {final.parent} failed writing "
                              f"{tmp / MANIFEST} ({exc.strerror}); free space or point checkpoint.dir at a writable "
                              f"disk; committed checkpoints are untouched ({newest})") from None
    (tmp / TMP_MARKER).unlink()  # a committed checkpoint is no leftover
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return manifest["bytes"] + (final / MANIFEST).stat().st_size


def retain(ckpt_dir: Path, keep_last: int, resumed_from: Committed | None, best_step: int | None = None) -> list[Path]:
    """Retire the oldest committed checkpoints beyond keep_last; never the newest, the newest finite, the resumed
    one, the best (`best_step`: early stopping's), nor a folder whose name and manifest disagree (renamed by hand:
    left alone).

    A retired folder is renamed to a `.tmp-` name at once (from then on it is no checkpoint: never listed, removed
    at the next start if it is still there) and returned, for Deleter to remove its files.
    """
    committed = [c for c in list_committed(ckpt_dir) if c.manifest is not None and not c.renamed]
    keep = {c.path for c in committed[-keep_last:]}
    finite = [c for c in committed if c.manifest.get("finite") is True]
    if finite:
        keep.add(finite[-1].path)
    if resumed_from is not None:
        keep.add(resumed_from.path)
    keep.update(c.path for c in committed if c.step == best_step)
    retired = []
    for c in committed:
        if c.path not in keep and c.path.is_symlink():  # its files lie elsewhere: never marked, renamed or deleted
            if c.path not in _links_said:
                _links_said.add(c.path)
                log.warning("checkpoint: retention left %s alone: it is a symbolic link (to %s), and trainflow "
                            "deletes nothing through a link; remove it yourself once it is not needed",
                            shown(c.path), shown(os.readlink(c.path)))
        elif c.path not in keep:
            doomed = c.path.with_name(f"{TMP_PREFIX}deleting-{c.path.name}")
            try:
                _mark(c.path)  # so that the next start may remove it, should it stay
                os.rename(c.path, doomed)
            except OSError as exc:
                log.warning("checkpoint: could not delete %s (%s); it stays", c.path, exc.strerror)
                continue
            retired.append(doomed)
            log.info("checkpoint: retention deleted %s (checkpoint.keep_last=%d)", c.path, keep_last)
    return retired


class Deleter:
    """Removes retired checkpoint folders in a thread, so that the loop does not wait for their files to be
    unlinked (0.07 s for 230 MB here); the next save waits for it first, so the disk never holds more than it
    would have."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def delete(self, folders: list[Path]) -> None:
        self.wait()
        if folders:
            self._thread = threading.Thread(target=_remove_all, args=(folders,), name="trainflow-retention")
            self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _remove_all(folders: list[Path]) -> None:
    for folder in folders:
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            log.warning("checkpoint: could not remove %s (%s); the next start removes it", folder, exc.strerror)


def lock_dir(ckpt_dir: Path, run_dir: Path) -> DirLock:
    """The folder exists, is writable and is this run's alone while the returned lock is held."""
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise ConfigError(f"checkpoint.dir: {ckpt_dir} is a file, not a folder; point checkpoint.dir at a folder")
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        return DirLock(ckpt_dir, run_dir)
    except OSError as exc:
        raise ConfigError(f"checkpoint.dir: cannot write to {ckpt_dir} ({exc.strerror}); "
                          "point checkpoint.dir at a writable folder") from exc


def new_tmp(tmp: Path) -> None:
    """Rank 0: an empty `.tmp-` folder for a save, marked as trainflow's first; a leftover of ours in the way goes,
    anything else there is refused (never deleted)."""
    if tmp.exists() or tmp.is_symlink():
        if not _ours(tmp):
            raise CheckpointError(f"checkpoint.dir: {tmp} is in the way of a save and trainflow did not make it (no "
                                  f"{TMP_MARKER} inside); nothing was changed: move it away, or point "
                                  "checkpoint.dir at a folder of trainflow's own")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _mark(tmp)


def remove_leftovers(ckpt_dir: Path) -> None:
    """Rank 0, under the folder's lock: remove what crashed saves and deletions of trainflow left (never committed,
    never resumed); say what else named `.tmp-*` is left alone."""
    for leftover in sorted(ckpt_dir.glob(f"{TMP_PREFIX}*")):
        if _ours(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
            log.info("checkpoint: removed %s, the leftover of a save that never finished", leftover)
        else:
            log.warning("checkpoint: left %s alone: trainflow did not make it (not a folder of its naming holding "
                        "%s); it is no checkpoint and trainflow never reads it", leftover, TMP_MARKER)


def _mark(folder: Path) -> None:
    """Write TMP_MARKER into a folder of trainflow's; never through a link planted in its place (ELOOP)."""
    fd = os.open(folder / TMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(f"made by trainflow, pid {os.getpid()}: a save that has not finished, or a retired checkpoint being "
                "deleted\n")


def _ours(path: Path) -> bool:
    """A `.tmp-` folder of trainflow's naming (not a link) holding its regular marker file, or left empty (a save
    stopped between the mkdir and the marker: nothing to lose)."""
    if not _TMP_DIR.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
        return False
    marker = path / TMP_MARKER
    return (marker.is_file() and not marker.is_symlink()) or not any(path.iterdir())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _trainflow_version() -> str:
    return __version__
