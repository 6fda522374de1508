"""torch.distributed.checkpoint of the whole training state: committed or absent, resumable on any world size.

Layout of `checkpoint.dir` (default `<run dir>/checkpoints`):

    step_00000100/          a committed checkpoint: DCP shards, .metadata, manifest.json
    .tmp-step_00000200/     a save in progress, or the leftover of a crashed one (removed at the next start)

A save writes into `.tmp-step_N`. Only after every rank finished (sync: `dcp.save` returned everywhere, then a
barrier; async: every rank's upload future completed) rank 0 writes manifest.json into it and renames it to
`step_N` in one atomic rename. Listing, resume and retention see only `step_N` folders holding a manifest, so a
checkpoint is committed or absent; retention renames a doomed folder back to a `.tmp-` name before deleting it.

What is saved, through one Stateful app state (FSDP/DDP-aware via get_state_dict/set_state_dict): model,
optimizer, LR scheduler, step, samples_seen (the position in data.py's world-size-independent sample stream), and
the RNG state of every rank (torch CPU and CUDA, Python, NumPy) under per-rank keys. A checkpoint loads on any
number of ranks and the sample stream continues exactly; RNG states are restored when the world size is the same
(on another world size each rank keeps its fresh per-rank seed, and a warning says so).

Async (`mode=async`): `dcp.async_save` on a dedicated gloo group (on the default group it hangs training); the
loop waits only while the state is copied into CPU buffers that are reused from save to save (one extra copy of
the state stays resident); at most one save is in flight; the next save, a stop signal and the end of the run
wait for it, and its errors are raised there.

Stop signals: SIGTERM or SIGUSR2 on any rank makes every rank agree (an all-reduce of the flag at each step
boundary) to save at that step boundary; the process then exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try
again"); running the same command again resumes. A second signal terminates at once.

One run at a time: rank 0 holds an exclusive `flock` on `checkpoint.dir/.lock` from the start to the end of the
run (the kernel drops it when the process dies, so a crash never leaves a stale lock). A second run pointed at
the same folder is refused before it removes anything, naming the run that holds it.

A corrupt committed checkpoint (a truncated shard, a missing .metadata) is refused, never skipped: resuming from
an older one silently would hide lost training. The error names it and the previous committed checkpoint; nothing
on disk is changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from trainflow.distributed import DistEnv
from trainflow.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # saved on SIGTERM/SIGUSR2 and stopped: run the same command again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
MANIFEST = "manifest.json"
LOCK_FILE = ".lock"
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


def _rng_state() -> bytes:
    """This process's random generators, pickled: one opaque per-rank value in the checkpoint."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state().numpy()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy()
    return pickle.dumps(state)  # numpy, not tensors: pickled tensors carry a per-call id; equal states, equal bytes


def _set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.from_numpy(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(state["cuda"]))


class AppState:
    """The DCP Stateful of a run: DCP calls state_dict() to save or to get load targets, then load_state_dict()."""

    def __init__(self, state: TrainState, rank: int, with_rng: bool = True) -> None:
        self.state = state
        self.rank = rank
        self.with_rng = with_rng

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        s = self.state
        model_sd, optim_sd = get_state_dict(s.model, s.optimizer)
        sd = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": s.scheduler.state_dict(),
            "progress": {"step": s.step, "samples_seen": s.samples_seen},
        }
        if self.with_rng:
            sd["rng"] = {f"rank{self.rank}": _rng_state()}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        s = self.state
        set_state_dict(s.model, s.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        s.scheduler.load_state_dict(sd["scheduler"])
        s.step = int(sd["progress"]["step"])
        s.samples_seen = int(sd["progress"]["samples_seen"])
        if self.with_rng:
            _set_rng_state(sd["rng"][f"rank{self.rank}"])


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
    step: int
    manifest: dict[str, Any] | None  # None: the manifest is unreadable (the checkpoint is corrupt)


def list_committed(ckpt_dir: Path) -> list[Committed]:
    """The committed checkpoints in `ckpt_dir`, oldest first; unfinished saves are not listed."""
    found = []
    if not ckpt_dir.is_dir():
        return found
    for child in ckpt_dir.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if not (match and (child / MANIFEST).is_file()):
            continue
        try:
            manifest = json.loads((child / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = None
        found.append(Committed(child, int(match.group(1)), manifest))
    return sorted(found, key=lambda c: c.step)


def check_intact(ck: Committed, others: list[Committed]) -> None:
    """Refuse a committed checkpoint whose files do not match its manifest (truncated, missing, unreadable)."""
    problem = None
    if ck.manifest is None:
        problem = f"{MANIFEST} is unreadable"
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
    if problem:
        raise CheckpointError(f"{ck.path}: corrupt checkpoint ({problem}); {_corrupt_fix(ck, others)}")


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
    metadata = dcp.FileSystemReader(ck.path).read_metadata()
    weights = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    try:
        dcp.load(weights, checkpoint_id=ck.path, no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
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


class DirLock:
    """An exclusive flock on `folder/.lock` for this process's lifetime; the file says who holds it."""

    def __init__(self, folder: Path, run_dir: Path | None = None) -> None:
        self.path = folder / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "a process"
            os.close(self._fd)
            raise ConfigError(f"checkpoint.dir: {folder} is in use by another run ({holder}); wait for it to end, "
                              "or point checkpoint.dir at another folder") from None
        os.ftruncate(self._fd, 0)
        started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        run = f", run dir {run_dir.resolve()}" if run_dir else ""
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}{run}, since {started}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1


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


def _staging_buffers():
    """An async stager that copies the state into the same CPU buffers at every save.

    The loop waits only for this copy. Reusing the buffers halves it on CPU (no fresh 100s of MB to fault in)
    and keeps memory flat over many saves; it is safe because at most one save is in flight. (DCP's own
    DefaultStager needs an accelerator for its default options; its caching variant pins memory, same.)
    """
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import AsyncStager

    class ReusedBuffers(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self) -> None:
            self.buffers: dict[str, Any] | None = None

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            if self.buffers is None:
                self.buffers = _create_cpu_state_dict(state_dict)
            return _copy_state_dict(state_dict, self.buffers)  # tensors into the buffers; other values fresh

        def synchronize_staging(self) -> None:
            """The copy above is synchronous: nothing to wait for."""

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
        self._stager = None  # async: CPU buffers the state is copied into, reused save after save
        self._saves: list[dict[str, Any]] = []
        self._blocked_unreported = 0.0
        self._last_saved_step: int | None = None
        self._verified = not cfg.verify
        self._resumed_from: Committed | None = None
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
            log.warning("checkpoint: training runs outside the main thread: SIGTERM/SIGUSR2 will not save and stop")

    # -- hooks called by run.py --------------------------------------------------------------------------------

    def resume(self, state: TrainState) -> None:
        """Restore the newest committed checkpoint into `state`, if there is one and resuming is on."""
        if not self.enabled:
            return
        self._fingerprint = fingerprint(_model_shapes(state.model))
        self._on_rank0(self._prepare_dir)
        target = self._on_rank0(self._pick)
        if target is None:
            if self.env.is_main:
                log.info("checkpoint: no committed checkpoint in %s: fresh start", self.dir)
            return
        check_intact(target, list_committed(target.path.parent))
        self._check_fits(target, state.model)
        import torch.distributed.checkpoint as dcp

        same_world = target.manifest.get("world_size") == self.env.world_size
        try:
            dcp.load({"app": AppState(state, self.env.rank, with_rng=same_world)}, checkpoint_id=target.path,
                     process_group=self._ctl)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            raise CheckpointError(f"{target.path}: corrupt checkpoint, cannot be read ({_cause(exc)}); "
                                  f"{_corrupt_fix(target, list_committed(target.path.parent))}") from exc
        self._resumed_from = target
        self._last_saved_step = state.step
        self._need_bytes = int(target.manifest.get("bytes", 0))
        if self.env.is_main:
            log.info("resumed from step %d (%s, saved on %d rank(s); data position %d samples)", state.step,
                     target.path, target.manifest.get("world_size"), state.samples_seen)
            if not same_world:
                log.warning("checkpoint: saved on %s rank(s), resumed on %d: model, optimizer and data position "
                            "are resharded exactly; the per-rank RNG states are not restored (fresh per-rank seeds)",
                            target.manifest.get("world_size"), self.env.world_size)

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
        tmp = self.dir / f"{TMP_PREFIX}step_{state.step:08d}"
        self._on_rank0(lambda: self._fresh(tmp))
        if self.env.is_main:
            log.info("checkpoint step %d: saving to %s", state.step, tmp)
        app = {"app": AppState(state, self.env.rank)}
        started = time.perf_counter()
        if blocking:
            error = None
            try:
                dcp.save(app, storage_writer=dcp.FileSystemWriter(tmp), process_group=self._ctl)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                error = exc
            self._raise_if_failed(error, tmp, state.step)
            write_s = time.perf_counter() - started
            self._commit(tmp, state.step, state.samples_seen, write_s, blocked_s=write_s)
            self._verify(state)
            return
        if self._stager is None:
            self._stager = _staging_buffers()
        writer = dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0)  # the staged state is in CPU memory already
        future = dcp.async_save(app, storage_writer=writer, async_stager=self._stager,
                                process_group=self._async_group)
        pending = _Pending(state.step, state.samples_seen, tmp, started, future, time.perf_counter() - started)
        future.add_done_callback(pending.mark_done)
        self._pending = pending
        if not self._verified:  # the first save is compared with the live state: wait for it once
            self._finish_pending(wait=True)
            self._verify(state)

    def _finish_pending(self, wait: bool = False) -> None:
        """Commit the in-flight async save (every rank's upload is done, or `wait` for it)."""
        p, self._pending = self._pending, None
        waited = time.perf_counter()
        error = None
        try:
            p.future.result()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            error = exc
        waited = time.perf_counter() - waited if wait else 0.0
        self._raise_if_failed(error, p.tmp, p.step)
        done = p.done_at or time.perf_counter()
        self._commit(p.tmp, p.step, p.samples_seen, done - p.started, blocked_s=p.staged_s + waited)

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

    def _commit(self, tmp: Path, step: int, samples_seen: int, write_s: float, blocked_s: float) -> None:
        self._barrier()
        commit_start = time.perf_counter()
        final = self.dir / f"step_{step:08d}"
        manifest = {
            "step": step,
            "samples_seen": samples_seen,
            "world_size": self.env.world_size,
            "save_s": round(write_s, 4),
            "committed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "trainflow_version": _trainflow_version(),
            "torch_version": torch.__version__,
            "model_fingerprint": self._fingerprint,
        }
        nbytes = self._on_rank0(lambda: self._rename_committed(tmp, final, manifest))
        self._on_rank0(self._retain)
        blocked_s += time.perf_counter() - commit_start
        self._saves.append({"step": step, "blocked_s": round(blocked_s, 4), "write_s": round(write_s, 4),
                            "bytes": nbytes})
        self._last_saved_step = step
        if self.env.is_main:
            log.info("checkpoint step %d committed: %s (%.1f MB; loop blocked %.3f s, write %.3f s)", step, final,
                     nbytes / 1e6, blocked_s, write_s)

    @staticmethod
    def _rename_committed(tmp: Path, final: Path, manifest: dict[str, Any]) -> int:
        """Rank 0: the manifest, then the atomic rename that commits the checkpoint."""
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        if ".metadata" not in files:
            raise CheckpointError(f"{tmp}: the save finished without a .metadata file; nothing was committed")
        if final.exists():
            raise CheckpointError(f"{final} already exists; point checkpoint.dir at a folder of one run")
        manifest = {**manifest, "files": files, "bytes": sum(files.values())}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        return manifest["bytes"] + (final / MANIFEST).stat().st_size

    def _retain(self) -> None:
        """Rank 0: delete the oldest committed checkpoints beyond keep_last; never the newest or the resumed one."""
        committed = list_committed(self.dir)
        keep = {c.path for c in committed[-self.cfg.keep_last:]}
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
        live = AppState(state, self.env.rank).state_dict()
        fresh = _blank_like(live)
        dcp.load({"app": fresh}, checkpoint_id=path, process_group=self._ctl)
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

    def _pick(self) -> Committed | None:
        """Rank 0: the checkpoint to resume from, as checkpoint.resume says."""
        own = list_committed(self.dir)
        resume = str(self.cfg.resume)
        if resume == "auto":
            return own[-1] if own else None
        if resume == "never":
            if own:
                raise ConfigError(f"checkpoint.resume=never: {self.dir} already holds committed checkpoints (up to "
                                  f"{own[-1].path.name}) of an earlier run, and a fresh start there would mix two "
                                  "histories; point checkpoint.dir at an empty folder, or resume=auto to continue")
            return None
        try:
            target = resolve_checkpoint(Path(resume))
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.resume: {exc}") from None
        if own and own[-1].path.resolve() != target.path.resolve():
            raise ConfigError(f"checkpoint.resume: {self.dir} already holds checkpoints up to {own[-1].path.name}; "
                              f"continuing from {target.path} there would mix two histories; point checkpoint.dir "
                              "at a new folder to branch off")
        return target

    def _check_fits(self, target: Committed, model: nn.Module) -> None:
        """Refuse a checkpoint of another model shape, listing the keys that differ."""
        if target.manifest.get("model_fingerprint") == self._fingerprint:
            return
        shapes = _model_shapes(model)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = dcp.FileSystemReader(target.path).read_metadata()
        except Exception as exc:
            raise CheckpointError(f"{target.path}: corrupt checkpoint, .metadata unreadable ({_cause(exc)}); "
                                  f"{_corrupt_fix(target, list_committed(target.path.parent))}") from exc
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
        """(the stop signal every rank agrees on, every rank's async upload is done): one small all-reduce a step.

        The decision uses only the reduced value, so every rank stops at the same step; a signal that lands
        during the all-reduce stays in `_signal` (only the handler writes it) and counts at the next step.
        """
        uploading = self._pending is not None and not self._pending.future.done()
        if not self.env.distributed:
            return self._signal, self._pending is not None and not uploading
        flags = torch.tensor([self._signal or 0, int(uploading)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._ctl)
        return int(flags[0]) or None, self._pending is not None and not bool(flags[1])

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
    """The same nesting with zeroed tensors and empty leaves: load targets that share nothing with the live state."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list) and any(isinstance(v, dict | list | torch.Tensor) for v in obj):
        return [_blank_like(v) for v in obj]
    return None


def _differences(live: Any, loaded: Any, path: str = "") -> list[str]:
    """Keys whose reloaded value is not exactly the live one (tensors compared bit for bit, shard by shard)."""
    if isinstance(live, dict):
        return [d for k, v in live.items() for d in _differences(v, loaded.get(k), f"{path}{k}.")]
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [d for i, (a, b) in enumerate(zip(live, loaded, strict=True)) for d in _differences(a, b, f"{path}{i}.")]
    if isinstance(live, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (live, loaded))
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [path.rstrip(".")]
    return [] if live == loaded else [path.rstrip(".")]


def _trainflow_version() -> str:
    from trainflow import __version__

    return __version__
