"""torch.distributed.checkpoint of the whole training state: committed or absent, resumable on any world size.

Layout of `checkpoint.dir` (default `<run dir>/checkpoints`):

    step_00000100/          a committed checkpoint: DCP shards, .metadata, state.json, rng_rankN.json, manifest.json
    .tmp-step_00000200/     a save in progress, or the leftover of a crashed one (removed at the next start)

A save writes into `.tmp-step_N`. Only after every rank finished (sync: `dcp.save` returned everywhere; async:
every rank's upload future completed) and the ranks exchanged their files' checksums, rank 0 writes manifest.json
(sizes and checksums of every file, `finite: true`) into it and renames it to `step_N` in one atomic rename.
Listing, resume and retention see only `step_N` folders holding a manifest, ordered by the manifest's step, so a
checkpoint is committed or absent; retention renames a doomed folder back to a `.tmp-` name before deleting it.

What is saved (FSDP/DDP-aware via get_state_dict/set_state_dict): the model and optimizer tensors as DCP shards;
as JSON beside them (see checkpoint_io.py: nothing is pickled, nothing loaded runs code) the optimizer's type and
hyperparameters, the LR scheduler, step, samples_seen (the position in data.py's world-size-independent sample
stream), and the RNG state of every rank (torch CPU and CUDA, Python, NumPy), one file per rank. A checkpoint
loads on any number of ranks and the sample stream continues exactly; RNG states are restored when the world size
is the same (on another world size each rank keeps its fresh per-rank seed, and a warning says so). A save whose
tensors hold a NaN or an infinity is refused before anything is written.

On resume the config's optimizer hyperparameters win (each change logged and listed in the summary); another
optimizer type is refused, with `checkpoint.load=model` (weights only, step 0) as the way to keep the weights.

Async (`mode=async`): `dcp.async_save` on a dedicated gloo group (on the default group it hangs training); the
loop waits only while the state is copied into CPU buffers that are reused from save to save (one extra copy of
the state stays resident); at most one save is in flight; the next save, a stop signal and the end of the run
wait for it, and its errors are raised there.

Stop signals: SIGTERM, SIGUSR2 or SIGHUP on any rank makes every rank agree (an all-reduce of the flag at each step
boundary) to save at that step boundary; the process then exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try
again"); running the same command again resumes. A second signal terminates at once.

One run at a time: rank 0 holds an exclusive `flock` on `checkpoint.dir/.lock` from the start to the end of the
run (the kernel drops it when the process dies, so a crash never leaves a stale lock). A second run pointed at
the same folder is refused before it removes anything, naming the run that holds it.

A corrupt committed checkpoint (a checksum or size that differs, a missing .metadata, a renamed folder, a newest
step folder without a manifest) is refused, never skipped: resuming from
an older one silently would hide lost training. The error names it and the previous committed checkpoint; nothing
on disk is changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from trainflow.checkpoint_io import (
    FORMAT,
    STATE_FILE,
    ChecksummingWriter,
    SafeReader,
    check_files,
    file_checksum,
    first_nonfinite,
    flatten,
    merge_tensors,
    read_json,
    read_metadata,
    rng_state,
    set_rng_state,
    split_tensors,
    write_json,
)
from trainflow.distributed import DistEnv
from trainflow.errors import CheckpointError, ConfigError
from trainflow.locks import LOCK_FILE, DirLock  # noqa: F401  (LOCK_FILE: the name the tests and tools see)

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # saved on SIGTERM/SIGUSR2/SIGHUP and stopped: run the same command again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)  # SIGHUP: the terminal or ssh session closed
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
MODEL_PREFIX = "app.model."  # where the model's tensors live in the flattened DCP keys
_STEP_DIR = re.compile(r"step_(\d+)")
_MAX_LISTED = 6  # mismatched keys named in an error before "and N more"

# A single-process run saves and loads without a process group on purpose: DCP's warning about it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")

_stopped_by: str | None = None  # the signal this process stopped on after saving (see stop_exit_code)


def stop_exit_code(summary: dict[str, Any] | None) -> int | None:
    """EXIT_STOPPED when the run stopped on a signal after committing a checkpoint, else None.

    This process's own flag covers every rank started by a launcher; rank 0's summary covers the process that
    launched local workers itself.
    """
    stopped = _stopped_by or ((summary or {}).get("checkpoint") or {}).get("stopped_by")
    return EXIT_STOPPED if stopped else None


@dataclass
class TrainState:
    """Everything a resumed run needs to continue as if it had never stopped."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    samples_seen: int = 0  # position in the global sample stream (see data.py)


# ---------------------------------------------------------------------------------------------------------------
# What goes into a checkpoint


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.json"


def split_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensors, for the DCP shards; every other value, for state.json): nothing in a checkpoint is pickled."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    tensors, aside = split_tensors({"model": model_sd, "optim": {"state": optim_sd["state"]}})
    plain = {"format": FORMAT, "step": state.step, "samples_seen": state.samples_seen,
             "optimizer": type(state.optimizer).__name__, "param_groups": optim_sd["param_groups"],
             "scheduler": state.scheduler.state_dict(), "non_tensor": aside}
    return tensors, plain


# optimizer param-group keys under the config key that sets them
_OPTIM_KEYS = {"initial_lr": "optim.lr", "weight_decay": "optim.weight_decay", "betas": "optim.betas",
               "momentum": "optim.momentum"}


def _hyperparameter_changes(saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer hyperparameters whose value in the config differs from the checkpoint's (the config's is used)."""
    changes, seen = [], set()
    for old, new in zip(saved, live, strict=False):
        for key in sorted(new.keys() - {"params", "lr"}):  # `lr` is the schedule's; `initial_lr` is optim.lr
            before, after = old.get(key), new[key]
            if isinstance(after, tuple):
                before = tuple(before) if isinstance(before, list) else before
            if key not in seen and before != after:
                seen.add(key)
                changes.append({"key": _OPTIM_KEYS.get(key, f"optim ({key})"), "checkpoint": before, "used": after})
    return changes


def _model_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every model tensor, under the names a checkpoint uses (wrappers stripped)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


def _state_bytes(state: TrainState) -> int:
    """Bytes of the model and optimizer tensors (whole, not this rank's shard): what a save writes, at least."""
    optim = [v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*state.model.parameters(), *optim])


def fingerprint(shapes: dict[str, tuple[tuple[int, ...], str]]) -> str:
    """A short hash of the model's tensor names, shapes and dtypes: equal fingerprints load into each other."""
    text = "\n".join(f"{k}:{list(s)}:{d}" for k, (s, d) in sorted(shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Committed checkpoints on disk


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


def _uncommitted_newer(ckpt_dir: Path, committed: list[Committed]) -> Path | None:
    """A `step_N` folder without a manifest, newer than every committed checkpoint: never skipped silently."""
    newest = committed[-1].step if committed else -1
    for child in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and not (child / MANIFEST).exists() and int(match.group(1)) > newest:
            return child
    return None


def check_intact(ck: Committed, others: list[Committed]) -> None:
    """Refuse a committed checkpoint whose files do not match its manifest (truncated, changed, missing, renamed)."""
    problem = None
    if ck.manifest is None:
        problem = f"{MANIFEST} is unreadable"
    elif ck.renamed:
        problem = f"the folder is named {ck.path.name} but its manifest says step {ck.step} (renamed by hand?)"
    elif not (ck.path / ".metadata").is_file():
        problem = ".metadata is missing"
    else:
        for name, size in ck.manifest.get("files", {}).items():
            f = ck.path / name
            if not f.is_file():
                problem = f"{name} is missing"
                break
            if f.stat().st_size != size:
                problem = f"{name} is {f.stat().st_size} bytes, the manifest says {size} (truncated)"
                break
        if problem is None and ck.manifest.get("format") == FORMAT:
            problem = check_files(ck.path, ck.manifest.get("checksums", {}))
            if problem is None and set(ck.manifest.get("checksums", {})) != set(ck.manifest.get("files", {})):
                problem = "the manifest lacks a checksum for some of its files"
            if problem is None and _read_state(ck.path)["step"] != ck.step:
                problem = f"{STATE_FILE} holds another step than the manifest's {ck.step}"
    if problem:
        raise CheckpointError(f"{ck.path}: corrupt checkpoint ({problem}); {_corrupt_fix(ck, others)}")


_STATE_KEYS = {"step": int, "samples_seen": int, "optimizer": str, "param_groups": list, "scheduler": dict}


def _read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's state.json, with the keys and types a resume needs."""
    plain = read_json(folder / STATE_FILE)
    wrong = [k for k, kind in _STATE_KEYS.items() if not isinstance(plain, dict) or not isinstance(plain.get(k), kind)]
    if wrong:
        raise CheckpointError(f"{folder / STATE_FILE}: not a trainflow training state ({wrong[0]} is missing or of "
                              "the wrong type); the checkpoint is corrupt")
    return plain


def _corrupt_fix(ck: Committed, others: list[Committed]) -> str:
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


def export_weights(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Write the model weights of a committed checkpoint as one `torch.load(weights_only=True)` file.

    Reads the DCP shards of any world size in this one process (no process group), so it works on a laptop
    for a checkpoint written by many ranks. Returns what was written.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ck = resolve_checkpoint(checkpoint)
    check_intact(ck, list_committed(ck.path.parent))
    metadata = read_metadata(ck.path)
    pickled = [k for k, m in metadata.state_dict_metadata.items()
               if k.startswith(MODEL_PREFIX) and not isinstance(m, TensorStorageMetadata)]
    if pickled:
        raise CheckpointError(f"{ck.path}: {pickled[0]} is stored as a pickled object, which trainflow does not load "
                              "(it could run code); the checkpoint was tampered with or is not trainflow's")
    weights = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    try:
        dcp.load(weights, storage_reader=SafeReader(ck.path), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        _reraise_interrupt(exc)
        if isinstance(_root(exc), CheckpointError):
            raise _root(exc) from None
        raise CheckpointError(f"{ck.path}: cannot be read ({_cause(exc)}); it is corrupt") from exc
    model = {k.removeprefix(MODEL_PREFIX): v for k, v in weights.items()}
    out = out.expanduser()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model, tmp)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{out}: cannot write the exported weights ({exc.strerror}); "
                              "give a writable file path") from exc
    return {"path": str(out), "step": ck.step, "tensors": len(model), "bytes": out.stat().st_size,
            "checkpoint": str(ck.path)}


def _root(exc: BaseException) -> BaseException:
    """The error a (possibly multi-rank) DCP failure wraps: the first rank's, following explicit causes."""
    failures = getattr(exc, "failures", None)
    if failures:
        return _root(next(iter(sorted(failures.items())))[1][0])
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _reraise_interrupt(exc: BaseException) -> None:
    """Ctrl-C or an exit inside DCP (which wraps whatever a rank raised) stays what it is: cli.py says one line."""
    root = _root(exc)
    if isinstance(root, KeyboardInterrupt | SystemExit):
        raise root from None
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        raise exc


def _cause(exc: BaseException) -> str:
    """The root error of a (possibly multi-rank) DCP failure, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {_cause(inner)}"
    while exc.__cause__ is not None and str(exc.__cause__):
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder without ever leaving a half-deleted committed one: rename first."""
    doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _staging_buffers(device: torch.device):
    """An async stager that copies the state into the same CPU buffers at every save.

    The loop waits only for this copy. Reusing the buffers halves it on CPU (no fresh 100s of MB to fault in)
    and keeps memory flat over many saves; it is safe because at most one save is in flight. From a GPU the
    buffers are pinned and every tensor is copied asynchronously, then one synchronize: device-to-host copies at
    the link's speed, not pageable memcpy's. The copies are complete when `stage` returns, before the upload
    thread reads them and before the next optimizer step changes the state. (DCP's own DefaultStager needs an
    accelerator for its default options; its caching variant pins memory, same.)
    """
    pin = device.type == "cuda"
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import AsyncStager

    class ReusedBuffers(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self) -> None:
            self.buffers: dict[str, Any] | None = None

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            if self.buffers is None:
                self.buffers = _create_cpu_state_dict(state_dict, pin_memory=pin)
            staged = _copy_state_dict(state_dict, self.buffers, non_blocking=pin)  # tensors into the buffers
            if pin:
                torch.cuda.synchronize()
            return staged

        def synchronize_staging(self) -> None:
            """`stage` returns with the copies done: nothing to wait for."""

        def close(self) -> None:
            self.buffers = None

    return ReusedBuffers()


# ---------------------------------------------------------------------------------------------------------------
# The checkpointer the loop calls


@dataclass
class _Pending:
    """An async save whose upload is in flight."""

    step: int
    samples_seen: int
    tmp: Path
    started: float
    future: Future
    staged_s: float
    writer: ChecksummingWriter
    checksums: dict[str, str]  # of the JSON files written beside the shards
    done_at: float | None = None

    def mark_done(self, _future: Future) -> None:
        self.done_at = time.perf_counter()


class Checkpointer:
    """Saves and restores TrainState when `checkpoint.enabled`; a no-op otherwise.

    All ranks call every method at the same step; rank 0 alone touches the folder structure (create, commit,
    delete) and shares the outcome, so a failure raises the same error on every rank instead of a hang.
    """

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path) -> None:
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir
        self.enabled = bool(cfg.enabled)
        if not self.enabled:
            return
        self.dir = self._resolve_dir(cfg.dir, run_dir)
        self._ctl = None  # gloo group for the main thread's collectives (flags, barriers, sync saves)
        self._async_group = None  # gloo group owned by the async upload thread (the default group hangs)
        if env.distributed:
            self._ctl = dist.new_group(backend="gloo")
            if cfg.mode == "async":
                self._async_group = dist.new_group(backend="gloo")
        self._pending: _Pending | None = None
        self._poll_in_flight: tuple[torch.Tensor, Any, _Pending | None] | None = None  # flags, work, pending save
        self._stager = None  # async: CPU buffers the state is copied into, reused save after save
        self._saves: list[dict[str, Any]] = []
        self._blocked_unreported = 0.0
        self._last_saved_step: int | None = None
        self._verified = not cfg.verify
        self._resumed_from: Committed | None = None
        self._changes: list[dict[str, Any]] = []  # optimizer hyperparameters the config changed on resume
        self._exported: dict[str, Any] | None = None
        self._fingerprint: str | None = None
        self._need_bytes = 0  # what a save writes, at least: to recognise a full disk
        self._signal: int | None = None  # set by the signal handler only
        self._stopped_by: str | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._lock: DirLock | None = None  # rank 0, from resume() to close()
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        elif env.is_main:
            log.warning("checkpoint: training runs outside the main thread: SIGTERM/SIGUSR2/SIGHUP will not save "
                        "and stop")

    # -- hooks called by run.py --------------------------------------------------------------------------------

    def resume(self, state: TrainState) -> None:
        """Restore the newest committed checkpoint into `state`, if there is one and resuming is on."""
        if not self.enabled:
            return
        self._fingerprint = fingerprint(_model_shapes(state.model))
        self._on_rank0(self._prepare_dir)
        target, weights_only = self._on_rank0(self._pick)
        if target is None:
            if self.env.is_main:
                log.info("checkpoint: no committed checkpoint in %s: fresh start", self.dir)
            return
        check_intact(target, list_committed(target.path.parent))
        self._check_fits(target, state.model)
        if weights_only:
            self._load_weights(target, state)
        else:
            self._load_all(target, state)
        self._resumed_from = target
        self._last_saved_step = state.step if not weights_only else None
        self._need_bytes = int(target.manifest.get("bytes", 0))

    def _load(self, target: Committed, tensors: dict[str, Any]) -> None:
        """Read the checkpoint's tensors into `tensors` in place (any world size; no pickle, no code)."""
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load({"app": tensors}, storage_reader=SafeReader(target.path), process_group=self._ctl)
        except BaseException as exc:
            _reraise_interrupt(exc)
            if isinstance(_root(exc), CheckpointError):
                raise _root(exc) from None
            raise CheckpointError(f"{target.path}: corrupt checkpoint, cannot be read ({_cause(exc)}); "
                                  f"{_corrupt_fix(target, list_committed(target.path.parent))}") from exc

    def _load_all(self, target: Committed, state: TrainState) -> None:
        """Model, optimizer, LR schedule, step, data position and (same world size) every rank's RNG."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if target.manifest.get("format") != FORMAT:
            raise CheckpointError(
                f"{target.path}: saved by an older trainflow, which pickled the RNG and optimizer settings into the "
                "shards; trainflow no longer unpickles checkpoints (that could run code from them); continue from "
                f"its weights only with checkpoint.load=model checkpoint.resume={target.path} and checkpoint.dir at "
                "a new folder (fresh optimizer from step 0), or export them with `trainflow export`")
        plain = _read_state(target.path)
        here = type(state.optimizer).__name__
        if plain.get("optimizer") != here:
            raise CheckpointError(
                f"{target.path}: saved with the {plain.get('optimizer')} optimizer, this run builds {here} "
                f"(optim.name); its optimizer state does not fit: to continue from its weights only (fresh "
                f"optimizer and LR schedule from step 0), run with checkpoint.load=model "
                f"checkpoint.resume={target.path} and checkpoint.dir at a new folder, or set optim.name back")
        tensors, live = split_state(state)
        self._load(target, tensors)
        loaded = merge_tensors(tensors, plain.get("non_tensor") or {})
        changes = _hyperparameter_changes(plain["param_groups"], live["param_groups"])
        groups = [{**new, "lr": old["lr"]} for old, new in zip(plain["param_groups"], live["param_groups"],
                                                                strict=True)]
        set_state_dict(state.model, state.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict={"state": loaded["optim"]["state"], "param_groups": groups})
        self._restore_schedule(state, plain["scheduler"], live["scheduler"])
        state.step, state.samples_seen = int(plain["step"]), int(plain["samples_seen"])
        same_world = target.manifest.get("world_size") == self.env.world_size
        if same_world:
            rng = target.path / _rng_file(self.env.rank)
            set_rng_state(read_json(rng), rng)
        self._changes = changes
        if self.env.is_main:
            log.info("resumed from step %d (%s, saved on %d rank(s); data position %d samples)", state.step,
                     target.path, target.manifest.get("world_size"), state.samples_seen)
            for c in changes:
                log.warning("resume: %s is %s in the config, %s in the checkpoint; using the config's %s",
                            c["key"], c["used"], c["checkpoint"], c["used"])
            if not same_world:
                log.warning("checkpoint: saved on %s rank(s), resumed on %d: model, optimizer and data position "
                            "are resharded exactly; the per-rank RNG states are not restored (fresh per-rank seeds)",
                            target.manifest.get("world_size"), self.env.world_size)

    @staticmethod
    def _restore_schedule(state: TrainState, saved: dict[str, Any], live: dict[str, Any]) -> None:
        """The LR schedule's position from the checkpoint, its base LRs from the config (optim.lr as typed)."""
        sched = state.scheduler
        sched.load_state_dict({k: saved.get(k, v) for k, v in live.items()})
        if list(sched.base_lrs) != list(live["base_lrs"]):
            sched.base_lrs = list(live["base_lrs"])
            lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
            for group, lr in zip(state.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            sched._last_lr = lrs

    def _load_weights(self, target: Committed, state: TrainState) -> None:
        """checkpoint.load=model: the model's weights only; optimizer, schedule, step and data start fresh."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        tensors, _ = split_tensors({"model": get_model_state_dict(state.model)})
        self._load(target, tensors)
        set_model_state_dict(state.model, tensors["model"])
        if self.env.is_main:
            log.warning("checkpoint.load=model: loaded the weights of step %d (%s); optimizer, LR schedule, step "
                        "and data position start fresh at step 0", target.step, target.path)

    def after_step(self, state: TrainState) -> bool:
        """Save when due; return True when the run must stop now (a stop signal was handled)."""
        if not self.enabled:
            return False
        stop_signal, uploaded = self._poll()
        start = time.perf_counter()
        if uploaded:
            self._finish_pending()
        if stop_signal:
            self._stop(state, stop_signal)
        elif state.step % self.cfg.every_steps == 0:
            self._save(state, blocking=self.cfg.mode == "sync")
        self._blocked_unreported += time.perf_counter() - start
        return stop_signal is not None

    def take_blocked_s(self) -> float:
        """Seconds the loop spent on checkpoints since the last call (to keep them out of throughput)."""
        if not self.enabled:
            return 0.0
        blocked, self._blocked_unreported = self._blocked_unreported, 0.0
        return blocked

    def close(self, state: TrainState) -> None:
        """Final save if asked for; wait for every pending save; export the weights if asked for."""
        if not self.enabled:
            return
        try:
            self._finish_poll()  # every rank started one at its last step: complete it before the group goes
            if self._pending is not None:
                self._finish_pending()
            if self._stopped_by is None:
                if self.cfg.save_final and state.step not in (0, self._last_saved_step):
                    self._save(state, blocking=True)
                if self.cfg.export:
                    self._exported = self._on_rank0(self._export)
        finally:
            self._stager = None  # the staging buffers: a whole copy of the state
            if self._lock is not None:
                self._lock.release()
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)

    def summary(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        blocked = [s["blocked_s"] for s in self._saves]
        written = [s["write_s"] for s in self._saves]
        return {
            "dir": str(self.dir),
            "mode": self.cfg.mode,
            "saves": len(self._saves),
            "blocked_s": {"total": round(sum(blocked), 4), "per_save": blocked},
            "write_s": {"total": round(sum(written), 4), "per_save": written},
            "bytes": self._saves[-1]["bytes"] if self._saves else 0,
            "steps_saved": [s["step"] for s in self._saves],
            "verified": self._verified and bool(self.cfg.verify),
            "resumed_from": str(self._resumed_from.path) if self._resumed_from else None,
            "load": self.cfg.load,
            "resume_changes": self._changes,  # each: key, the checkpoint's value, the value used (the config's)
            "committed": [c.path.name for c in list_committed(self.dir)],
            "stopped_by": self._stopped_by,
            "exported": self._exported,
        }

    # -- saving ------------------------------------------------------------------------------------------------

    def _save(self, state: TrainState, blocking: bool) -> None:
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:  # at most one save in flight: the next one waits for it
            self._finish_pending(wait=True)
        self._need_bytes = max(self._need_bytes, _state_bytes(state), self._saves[-1]["bytes"] if self._saves else 0)
        tensors, plain = split_state(state)
        self._refuse_nonfinite(tensors, state.step)
        tmp = self.dir / f"{TMP_PREFIX}step_{state.step:08d}"
        self._on_rank0(lambda: self._fresh(tmp))
        if self.env.is_main:
            log.info("checkpoint step %d: saving to %s", state.step, tmp)
        started = time.perf_counter()
        sums = self._write_plain(tmp, plain, state.step)
        if blocking:
            writer = ChecksummingWriter(tmp)
            error = None
            try:
                dcp.save({"app": tensors}, storage_writer=writer, process_group=self._ctl)
            except BaseException as exc:
                _reraise_interrupt(exc)
                error = exc
            self._raise_if_failed(error, tmp, state.step)
            write_s = time.perf_counter() - started
            self._commit(tmp, state.step, state.samples_seen, write_s, write_s, {**sums, **writer.checksums})
            self._verify(state)
            return
        if self._stager is None:
            self._stager = _staging_buffers(self.env.device)
        writer = ChecksummingWriter(tmp, per_thread_copy_ahead=0)  # the staged state is in CPU memory already
        future = dcp.async_save({"app": tensors}, storage_writer=writer, async_stager=self._stager,
                                process_group=self._async_group)
        pending = _Pending(state.step, state.samples_seen, tmp, started, future, time.perf_counter() - started,
                           writer, sums)
        future.add_done_callback(pending.mark_done)
        self._pending = pending
        if not self._verified:  # the first save is compared with the live state: wait for it once
            self._finish_pending(wait=True)
            self._verify(state)

    def _refuse_nonfinite(self, tensors: dict[str, Any], step: int) -> None:
        """Never commit NaN or infinite weights or optimizer state: every rank checks its shards, all agree."""
        bad = first_nonfinite(flatten(tensors))
        if not self._any(bad is not None):
            return
        if self.env.distributed:
            names: list[str | None] = [None] * self.env.world_size
            dist.all_gather_object(names, bad, group=self._ctl)
            bad = next(n for n in names if n is not None)
        finite = [c for c in list_committed(self.dir) if c.manifest and c.manifest.get("finite")]
        kept = f"newest finite checkpoint {finite[-1].path.name} kept" if finite else "there is no finite one yet"
        raise CheckpointError(f"checkpoint: step {step} has non-finite values ({bad}); not committed, {kept}; the "
                              "training diverged: lower optim.lr (or raise optim.warmup_steps) and run again")

    def _write_plain(self, tmp: Path, plain: dict[str, Any], step: int) -> dict[str, str]:
        """state.json (rank 0) and this rank's RNG state beside the shards; their checksums."""
        try:
            sums = {_rng_file(self.env.rank): write_json(tmp / _rng_file(self.env.rank), rng_state())}
            if self.env.is_main:
                sums[STATE_FILE] = write_json(tmp / STATE_FILE, plain)
            error = None
        except (OSError, TypeError, ValueError) as exc:
            sums, error = {}, exc
        self._raise_if_failed(error, tmp, step)
        return sums

    def _finish_pending(self, wait: bool = False) -> None:
        """Commit the in-flight async save (every rank's upload is done, or `wait` for it)."""
        p, self._pending = self._pending, None
        waited = time.perf_counter()
        error = None
        try:
            p.future.result()
        except BaseException as exc:
            _reraise_interrupt(exc)
            error = exc
        waited = time.perf_counter() - waited if wait else 0.0
        self._raise_if_failed(error, p.tmp, p.step)
        done = p.done_at or time.perf_counter()
        self._commit(p.tmp, p.step, p.samples_seen, done - p.started, p.staged_s + waited,
                     {**p.checksums, **p.writer.checksums})

    def _raise_if_failed(self, error: BaseException | None, tmp: Path, step: int) -> None:
        """Agree on a failed save: remove its temporary folder and raise one sentence on every rank."""
        if not self._any(error is not None):
            return
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _cause(error) if error is not None else "failed on another rank"
        with contextlib.suppress(OSError):  # a full disk shows up as many different errors: say only that
            free = shutil.disk_usage(self.dir).free
            if free < self._need_bytes:
                cause = (f"the disk is full: {free / 1e6:.1f} MB free, a checkpoint needs about "
                         f"{self._need_bytes / 1e6:.1f} MB")
        committed = list_committed(self.dir)
        newest = f"newest: {committed[-1].path.name}" if committed else "there are none yet"
        raise CheckpointError(f"checkpoint.dir: saving step {step} to {self.dir} failed ({cause}); free space or "
                              f"point checkpoint.dir at a writable disk; committed checkpoints are untouched "
                              f"({newest})") from error

    def _commit(self, tmp: Path, step: int, samples_seen: int, write_s: float, blocked_s: float,
                checksums: dict[str, str]) -> None:
        checksums = self._gather(checksums)
        commit_start = time.perf_counter()
        final = self.dir / f"step_{step:08d}"
        manifest = {
            "format": FORMAT,
            "step": step,
            "samples_seen": samples_seen,
            "world_size": self.env.world_size,
            "finite": True,  # _refuse_nonfinite checked every tensor before the save
            "checksum": "xxh3_64",
            "save_s": round(write_s, 4),
            "committed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "trainflow_version": _trainflow_version(),
            "torch_version": torch.__version__,
            "model_fingerprint": self._fingerprint,
        }
        nbytes = self._on_rank0(lambda: self._rename_committed(tmp, final, manifest, checksums))
        self._on_rank0(self._retain)
        blocked_s += time.perf_counter() - commit_start
        self._saves.append({"step": step, "blocked_s": round(blocked_s, 4), "write_s": round(write_s, 4),
                            "bytes": nbytes})
        self._last_saved_step = step
        if self.env.is_main:
            log.info("checkpoint step %d committed: %s (%.1f MB; loop blocked %.3f s, write %.3f s)", step, final,
                     nbytes / 1e6, blocked_s, write_s)

    def _gather(self, checksums: dict[str, str]) -> dict[str, str]:
        """Every rank's file checksums, on every rank (this is also the barrier before the commit)."""
        if not self.env.distributed:
            return checksums
        everyone: list[dict[str, str] | None] = [None] * self.env.world_size
        dist.all_gather_object(everyone, checksums, group=self._ctl)
        return {name: digest for sums in everyone for name, digest in (sums or {}).items()}

    @staticmethod
    def _rename_committed(tmp: Path, final: Path, manifest: dict[str, Any], checksums: dict[str, str]) -> int:
        """Rank 0: the manifest, then the atomic rename that commits the checkpoint."""
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        if ".metadata" not in files:
            raise CheckpointError(f"{tmp}: the save finished without a .metadata file; nothing was committed")
        if final.exists():
            raise CheckpointError(f"{final} already exists; point checkpoint.dir at a folder of one run")
        sums = {name: checksums.get(name) or file_checksum(tmp / name) for name in files}
        manifest = {**manifest, "files": files, "checksums": sums, "bytes": sum(files.values())}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        return manifest["bytes"] + (final / MANIFEST).stat().st_size

    def _retain(self) -> None:
        """Rank 0: delete the oldest committed checkpoints beyond keep_last; never the newest, the newest finite,
        the resumed one, nor a folder whose name and manifest disagree (renamed by hand: left alone)."""
        committed = [c for c in list_committed(self.dir) if c.manifest is not None and not c.renamed]
        keep = {c.path for c in committed[-self.cfg.keep_last:]}
        finite = [c for c in committed if c.manifest.get("finite") is True]
        if finite:
            keep.add(finite[-1].path)
        if self._resumed_from is not None:
            keep.add(self._resumed_from.path)
        for c in committed:
            if c.path not in keep:
                try:
                    _remove(c.path)
                    log.info("checkpoint: retention deleted %s (checkpoint.keep_last=%d)", c.path, self.cfg.keep_last)
                except OSError as exc:
                    log.warning("checkpoint: could not delete %s (%s); it stays", c.path, exc.strerror)

    def _verify(self, state: TrainState) -> None:
        """Reload the checkpoint just committed into fresh tensors and compare with the live state exactly."""
        if self._verified:
            return
        import torch.distributed.checkpoint as dcp

        path = self.dir / f"step_{state.step:08d}"
        live, _ = split_state(state)
        fresh = _blank_like(live)
        dcp.load({"app": fresh}, storage_reader=SafeReader(path), process_group=self._ctl)
        bad = _differences(live, fresh)
        if self._any(bool(bad)):
            raise CheckpointError(f"checkpoint.verify: {path} does not read back what was saved "
                                  f"({', '.join(bad[:_MAX_LISTED]) or 'on another rank'}); the storage under "
                                  "checkpoint.dir is unreliable: use another disk")
        self._verified = True
        if self.env.is_main:
            log.info("checkpoint step %d verified: reloaded into fresh tensors, all equal", state.step)

    def _stop(self, state: TrainState, signum: int) -> None:
        global _stopped_by
        name = signal.Signals(signum).name
        if self._pending is not None:
            self._finish_pending(wait=True)
        if state.step != self._last_saved_step:
            self._save(state, blocking=True)
        _stopped_by = self._stopped_by = name
        if self.env.is_main:
            log.warning("%s: stopped at step %d with checkpoint %s committed; exit code %d (run the same command "
                        "to resume)", name, state.step, self.dir / f"step_{state.step:08d}", EXIT_STOPPED)

    def _export(self) -> dict[str, Any]:
        info = export_weights(self.dir / f"step_{self._last_saved_step:08d}", self.run_dir / "model.pt")
        log.info("exported the model weights of step %d to %s (%.1f MB)", info["step"], info["path"],
                 info["bytes"] / 1e6)
        return info

    # -- resuming ----------------------------------------------------------------------------------------------

    @staticmethod
    def _resolve_dir(configured: str | None, run_dir: Path) -> Path:
        """`checkpoint.dir`: a checkpoint folder, or an earlier run's directory (its checkpoints/ is used)."""
        if configured is None:
            return run_dir / "checkpoints"
        path = Path(configured).expanduser()
        if (path / "checkpoints").is_dir() and not list_committed(path):
            return path / "checkpoints"
        return path

    def _prepare_dir(self) -> None:
        """Rank 0: the folder exists, is writable and is ours alone; leftovers of crashed saves are removed."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"checkpoint.dir: {self.dir} is a file, not a folder; point checkpoint.dir at a folder")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock = DirLock(self.dir, self.run_dir)
        except OSError as exc:
            raise ConfigError(f"checkpoint.dir: cannot write to {self.dir} ({exc.strerror}); "
                              "point checkpoint.dir at a writable folder") from exc
        for leftover in sorted(self.dir.glob(f"{TMP_PREFIX}*")):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
            log.info("checkpoint: removed %s, the leftover of a save that never finished", leftover)

    def _pick(self) -> tuple[Committed | None, bool]:
        """Rank 0: (the checkpoint to resume from, as checkpoint.resume says; whether to load its weights only)."""
        own = list_committed(self.dir)
        unfinished = _uncommitted_newer(self.dir, own)
        if unfinished is not None:
            older = f"resume from {own[-1].path.name}" if own else "start fresh"
            raise CheckpointError(f"{unfinished}: a checkpoint folder without {MANIFEST}, newer than every committed "
                                  f"one (a save that never committed, or a manifest that was lost); nothing was "
                                  f"changed: move it out of {self.dir} to {older}")
        for c in own:
            if c.manifest is not None and c.renamed:
                log.warning("checkpoint: %s holds step %d (its manifest says so): a renamed folder; it is ordered "
                            "by step %d and never deleted", c.path, c.step, c.step)
        resume = str(self.cfg.resume)
        if resume == "auto":
            return (own[-1] if own else None), False
        if resume == "never":
            if own:
                raise ConfigError(f"checkpoint.resume=never: {self.dir} already holds committed checkpoints (up to "
                                  f"{own[-1].path.name}) of an earlier run, and a fresh start there would mix two "
                                  "histories; point checkpoint.dir at an empty folder, or resume=auto to continue")
            return None, False
        if own and self.cfg.load == "model":  # this run's own checkpoints exist: the same command continues them
            log.info("checkpoint.load=model: %s already holds this run's checkpoints (up to %s): resuming them in "
                     "full", self.dir, own[-1].path.name)
            return own[-1], False
        try:
            target = resolve_checkpoint(Path(resume))
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.resume: {exc}") from None
        if own and own[-1].path.resolve() != target.path.resolve():
            raise ConfigError(f"checkpoint.resume: {self.dir} already holds checkpoints up to {own[-1].path.name}; "
                              f"continuing from {target.path} there would mix two histories; point checkpoint.dir "
                              "at a new folder to branch off")
        return target, self.cfg.load == "model" and not own

    def _check_fits(self, target: Committed, model: nn.Module) -> None:
        """Refuse a checkpoint of another model shape, listing the keys that differ (and unreadable metadata)."""
        metadata = read_metadata(target.path)  # here, not inside DCP, which would wrap its one-line error
        if target.manifest.get("model_fingerprint") == self._fingerprint:
            return
        shapes = _model_shapes(model)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = {k.removeprefix(MODEL_PREFIX): (tuple(m.size), str(m.properties.dtype).removeprefix("torch."))
                 for k, m in metadata.state_dict_metadata.items()
                 if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
        diffs = []
        for key in sorted(saved.keys() | shapes.keys()):
            if key not in shapes:
                diffs.append(f"{key} only in the checkpoint")
            elif key not in saved:
                diffs.append(f"{key} missing from the checkpoint")
            elif saved[key] != shapes[key]:
                diffs.append(f"{key} {list(saved[key][0])} {saved[key][1]} saved vs {list(shapes[key][0])} "
                             f"{shapes[key][1]} here")
        if diffs:
            more = f" and {len(diffs) - _MAX_LISTED} more" if len(diffs) > _MAX_LISTED else ""
            raise CheckpointError(f"{target.path} was saved from another model shape: {len(diffs)} mismatched "
                                  f"key(s): {'; '.join(diffs[:_MAX_LISTED])}{more}; resume with the model config it "
                                  "was saved with, or set checkpoint.dir to a new folder to start fresh")

    # -- signals and agreement ---------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum
        signal.signal(signum, self._previous_handlers[signum])  # a second signal acts as it would without us

    def _poll(self) -> tuple[int | None, bool]:
        """(the stop signal every rank agrees on, every rank's async upload is done), one step late.

        Each step starts a small asynchronous all-reduce of this rank's flags and reads the one started a step
        earlier, which finished while the step ran: no cross-rank wait in the step itself (between nodes a
        blocking one costs a network round trip every step). The decision uses only reduced values, so every rank
        stops at the same step, one step after the signal; a signal that lands meanwhile stays in `_signal` (only
        the handler writes it) and counts at the next poll.
        """
        uploading = self._pending is not None and not self._pending.future.done()
        if not self.env.distributed:
            return self._signal, self._pending is not None and not uploading
        agreed, polled_pending = self._finish_poll()
        flags = torch.tensor([self._signal or 0, int(uploading)])
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._ctl, async_op=True)
        self._poll_in_flight = (flags, work, self._pending)
        if agreed is None:
            return None, False
        # uploaded: the save that was pending when those flags were taken (still the pending one) is done everywhere
        uploaded = self._pending is not None and polled_pending is self._pending and not bool(agreed[1])
        return int(agreed[0]) or None, uploaded

    def _finish_poll(self) -> tuple[torch.Tensor | None, _Pending | None]:
        """Wait for the all-reduce started at the previous poll (it has normally finished): its reduced flags and
        the save that was pending when they were taken."""
        if self._poll_in_flight is None:
            return None, None
        flags, work, pending = self._poll_in_flight
        self._poll_in_flight = None
        work.wait()
        return flags, pending

    def _any(self, flag: bool) -> bool:
        if not self.env.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, group=self._ctl)
        return bool(t.item())

    def _barrier(self) -> None:
        if self.env.distributed:
            dist.barrier(group=self._ctl)

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only; every rank gets its result, or raises the same one-line error."""
        result, error = None, None
        if self.env.is_main:
            try:
                result = fn()
            except (ConfigError, CheckpointError) as exc:
                error = exc
            except Exception as exc:  # any failure must reach the other ranks, or they wait for it forever
                error = CheckpointError(f"checkpoint.dir: {_cause(exc)}; committed checkpoints are untouched")
                error.__cause__ = exc
        if self.env.distributed:
            box = [(result, type(error).__name__ if error else None, str(error) if error else None)]
            dist.broadcast_object_list(box, src=0, group=self._ctl)
            result, kind, message = box[0]
            if kind is not None and not self.env.is_main:
                error = ConfigError(message) if kind == "ConfigError" else CheckpointError(message)
        if error is not None:
            raise error
        return result

    def _fresh(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)


def _blank_like(obj: Any) -> Any:
    """The same nesting with zeroed CPU tensors and empty leaves: load targets that share nothing with the live state.

    In CPU memory, so that verifying the first save of a GPU run does not need a second copy of the state on the
    device; sharded tensors stay sharded (the same mesh and placements, a CPU local shard).
    """
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = torch.zeros(obj.to_local().shape, dtype=obj.dtype, device="cpu")
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        return torch.zeros(obj.shape, dtype=obj.dtype, device="cpu")
    if isinstance(obj, dict):
        return {k: _blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list) and any(isinstance(v, dict | list | torch.Tensor) for v in obj):
        return [_blank_like(v) for v in obj]
    return None


def _differences(live: Any, loaded: Any, path: str = "") -> list[str]:
    """Keys whose reloaded value is not exactly the live one (bit for bit, NaN equal to NaN, shard by shard)."""
    if isinstance(live, dict):
        return [d for k, v in live.items() for d in _differences(v, loaded.get(k), f"{path}{k}.")]
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [d for i, (a, b) in enumerate(zip(live, loaded, strict=True)) for d in _differences(a, b, f"{path}{i}.")]
    if isinstance(live, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (live, loaded))
        a = a.to(b.device)  # the live tensor, one at a time, next to the CPU copy read back
        if a.dtype != b.dtype or a.shape != b.shape:
            return [path.rstrip(".")]
        same = bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()) if a.is_floating_point() else torch.equal(a, b)
        return [] if same else [path.rstrip(".")]
    return [] if live == loaded else [path.rstrip(".")]


def _trainflow_version() -> str:
    from trainflow import __version__

    return __version__
