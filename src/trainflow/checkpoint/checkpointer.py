"""The Checkpointer the loop calls: saving (sync or async), resuming, stop signals, and the ranks' agreement.

A save writes into `.tmp-step_N` (see store.py). Only after every rank finished (sync: `dcp.save` returned
everywhere; async: every rank's upload future completed) and the ranks exchanged their files' checksums, rank 0
commits it. A save whose tensors hold a NaN or an infinity is refused before anything is written.

Async (`mode=async`): `dcp.async_save` on a dedicated gloo group (on the default group it hangs training); the
loop waits only while the state is copied into CPU buffers that are reused from save to save (one extra copy of
the state stays resident); at most one save is in flight; the next save, a stop signal and the end of the run
wait for it, and its errors are raised there.

Stop signals (stopping.py, checkpoint.stop_signals): one on any rank makes every rank save at the same step boundary
and stop; the process then exits with EXIT_STOPPED, and running the same command again resumes.

One run at a time: rank 0 holds an exclusive `flock` on `checkpoint.dir/.lock` from the start to the end of the
run (the kernel drops it when the process dies, so a crash never leaves a stale lock). A second run pointed at
the same folder is refused before it removes anything, naming the run that holds it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.profiler import record_function

from trainflow.checkpoint import resume as resuming
from trainflow.checkpoint import store
from trainflow.checkpoint.agreement import RankAgreement
from trainflow.checkpoint.export import export_weights, not_an_export
from trainflow.checkpoint.safe_io import (
    ChecksummingWriter,
    SafeReader,
    failure_cause,
    reraise_interrupt,
    write_json,
)
from trainflow.checkpoint.staging import reused_buffers
from trainflow.checkpoint.state import (
    STATE_FILE,
    TrainState,
    blank_like,
    data_file,
    differences,
    fingerprint,
    first_nonfinite,
    flatten,
    model_shapes,
    rng_file,
    rng_state,
    split_state,
    state_bytes,
    weights_layout,
)
from trainflow.checkpoint.stopping import EXIT_STOPPED, LatePoll, mark_stopped, run_stop_signals
from trainflow.checkpoint.store import TMP_PREFIX, Committed, check_intact, list_committed
from trainflow.config.schema import CheckpointConfig
from trainflow.distributed import DistEnv
from trainflow.errors import CheckpointError
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.metrics.regions import CHECKPOINT
from trainflow.util.activity import Activity, doing
from trainflow.util.device import device_sync
from trainflow.util.failures import note_save, says_peer_lost
from trainflow.util.locks import DirLock

log = logging.getLogger(__package__)  # one name for the package: lines read [trainflow.checkpoint]

EXPORT_FILE = "model.pt"  # checkpoint.export=true: the weights of the last save, in the run directory


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


class Checkpointer(Stage):
    """Saves and restores TrainState when `checkpoint.enabled`; a no-op otherwise.

    All ranks call every method at the same step; rank 0 alone touches the folder structure (create, commit,
    delete) and shares the outcome, so a failure raises the same error on every rank instead of a hang.
    """

    phase = Phase.SAVE
    summary_key = "checkpoint"

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, run_dir: Path, timeout_s: float | None = None) -> None:
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir
        self.enabled = cfg.enabled
        if not self.enabled:
            return
        self._every_steps = cfg.every_steps
        self._sync = cfg.mode == "sync"
        self.dir = store.resolve_dir(cfg.dir, run_dir)
        self._main_group = None  # gloo group for the main thread's collectives (flags, barriers, sync saves)
        self._async_group = None  # gloo group owned by the async upload thread (the default group hangs)
        if env.distributed:
            # the run's collective timeout (parallelism.timeout_s; a new group's own default is 30 min): a save
            # waiting for a rank that stopped answering ends the run as a step waiting for it does
            timeout = timedelta(seconds=timeout_s) if timeout_s else None
            self._main_group = dist.new_group(backend="gloo", timeout=timeout)
            if cfg.mode == "async":
                self._async_group = dist.new_group(backend="gloo", timeout=timeout)
        self._ranks = RankAgreement(env, self._main_group)
        self._pending: _Pending | None = None
        self._poll = LatePoll(self._main_group)  # each step: (stop signal, uploading) of every rank
        self._stager = None  # async: CPU buffers the state is copied into, reused save after save
        self._saves: list[dict[str, Any]] = []
        self._blocked_unreported = 0.0
        self._last_saved_step: int | None = None
        self._verified = not cfg.verify
        self._resumed_from: Committed | None = None
        self._changes: list[dict[str, Any]] = []  # optimizer hyperparameters the config changed on resume
        self._exported: dict[str, Any] | None = None
        self._fingerprint: str | None = None
        self._layout: int | None = None  # the model's weights_layout, saved in each manifest
        self._need_bytes = 0  # what a save writes, at least: to recognise a full disk
        self._signals = run_stop_signals()  # caught since the run's start; acted on here from the first step
        self._stopped_by: str | None = None
        self._lock: DirLock | None = None  # rank 0, from resume() to close()
        self._deleter = store.Deleter()  # rank 0: removes the checkpoints retention retired
        self._best_step: int | None = None  # the step whose checkpoint a stage keeps as the best

    # -- the stage interface -------------------------------------------------------------------------------------

    @classmethod
    def build(cls, ctx: StageContext) -> Checkpointer:
        return cls(ctx.cfg.checkpoint, ctx.env, ctx.run_dir, ctx.cfg.parallelism.timeout_s)

    def save_due(self, step: int) -> bool:
        """Whether a periodic save follows step `step` (the final one comes at close)."""
        return self.enabled and step % self._every_steps == 0

    def syncs_after(self, step: int) -> bool:
        return self.save_due(step)

    def resume(self, state: TrainState) -> None:
        """Restore the newest committed checkpoint into `state`, if there is one and resuming is on."""
        if not self.enabled:
            return
        self._fingerprint = fingerprint(model_shapes(state.model))
        self._layout = weights_layout(state.model)
        self._ranks.on_rank0(self._prepare_dir)
        target, weights_only = self._ranks.on_rank0(lambda: resuming.pick(self.dir, self.cfg))
        if target is None:
            if self.env.is_main:
                log.info("checkpoint: no committed checkpoint in %s: fresh start", self.dir)
            return
        if isinstance(target, Path):  # exported weights (a safetensors file or folder): the model's only
            resuming.load_exported(target, state, self.env)
            return
        check_intact(target, list_committed(target.path.parent))
        resuming.check_fits(target, state.model, self._fingerprint, self._layout)
        if weights_only:
            resuming.load_weights(target, state, self.env, self._main_group)
        else:
            self._changes = resuming.load_all(target, state, self.env, self._main_group, self.cfg.on_data_change)
        self._resumed_from = target
        state.resumed_checkpoint = target.path  # the metrics writer tells another run's checkpoint from its own
        self._last_saved_step = state.step if not weights_only else None
        self._need_bytes = int(target.manifest.get("bytes", 0))

    def after_step(self, state: TrainState) -> bool:
        """Save when due; return True when the run must stop now (a stop signal was handled)."""
        if not self.enabled:
            return False
        with record_function(CHECKPOINT):  # its collectives are the saves', not the training's communication
            return self._after_step(state)

    def _after_step(self, state: TrainState) -> bool:
        stop_signal, uploaded = self._agreed_flags()  # a collective of every step, not a save's
        # a stage's best step (early stopping; a bare TrainState has none): saved now, and kept by retention
        self._best_step = getattr(state, "best_step", None)
        due = self.save_due(state.step) or self._best_step == state.step != self._last_saved_step
        if not (stop_signal or due or uploaded):
            return False
        with doing(Activity.SAVING):  # the watchdog judges what follows against a save's bound
            if stop_signal or due:  # a save: the steps still queued on the device are training, not the pause
                device_sync(self.env.device)
            start = time.perf_counter()
            if uploaded:
                self._finish_pending()
            if stop_signal:
                self._stop(state, signal.Signals(stop_signal).name)
            elif due:
                self._save(state, blocking=self._sync)
            self._blocked_unreported += time.perf_counter() - start
        return stop_signal is not None

    def __enter__(self) -> Checkpointer:
        """The loop begins: a stop signal now saves at the step boundary (before, it ends the process at once)."""
        if self.enabled:
            self._signals.training_starts()
        return self

    def __exit__(self, *exc: object) -> None:
        """A failed run keeps what it committed; close() is for a normal end."""

    def take_paused_s(self) -> float:
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
            self._poll.finish()  # every rank started one at its last step: complete it before the group goes
            if self._pending is not None:
                self._finish_pending()
            # a stage after this one stopped the run (the loop state's stop_reason; a bare TrainState has none)
            if self._stopped_by is None and (reason := getattr(state, "stop_reason", None)):
                self._stop(state, reason)
            if self._stopped_by is None:
                if self.cfg.save_final and state.step not in (0, self._last_saved_step):
                    self._save(state, blocking=True)
                if self.cfg.export:
                    self._exported = self._ranks.on_rank0(self._export)
        finally:
            self._deleter.wait()
            self._stager = None  # the staging buffers: a whole copy of the state
            if self._lock is not None:
                self._lock.release()
            self._signals.training_ends()

    def summary(self, steady: dict[str, Any] | None = None) -> dict[str, Any] | None:
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
            "verified": self._verified and self.cfg.verify,
            "resumed_from": str(self._resumed_from.path) if self._resumed_from else None,
            "load": self.cfg.load,
            "resume_changes": self._changes,  # each: key, the checkpoint's value, the value used (the config's)
            "committed": [c.path.name for c in list_committed(self.dir)],
            "stopped_by": self._stopped_by,
            "exported": self._exported,
        }

    # -- saving ------------------------------------------------------------------------------------------------

    def _save(self, state: TrainState, blocking: bool) -> None:
        with _saving(state.step):
            if self._pending is not None:  # at most one save in flight: the next one waits for it
                self._finish_pending(wait=True)
            self._deleter.wait()  # the space of the checkpoints retention retired is free again
            self._need_bytes = max(self._need_bytes, state_bytes(state), self._saves[-1]["bytes"] if self._saves else 0)
            tensors, plain = split_state(state)
            self._refuse_nonfinite(tensors, state.step)
            tmp = self.dir / f"{TMP_PREFIX}step_{state.step:08d}"
            self._ranks.on_rank0(lambda: store.new_tmp(tmp))
            if self.env.is_main:
                log.info("checkpoint step %d: saving to %s", state.step, tmp)
            started = time.perf_counter()
            if blocking:
                self._save_now(state, tensors, plain, tmp, started)
                return
            sums, error = self._write_plain(tmp, plain, self._rank_files(state))
            self._raise_if_failed(error, tmp, state.step)
            if self._stager is None:
                self._stager = reused_buffers(self.env.device)
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

    def _save_now(self, state: TrainState, tensors: dict[str, Any], plain: dict[str, Any], tmp: Path,
                  started: float) -> None:
        """A sync save: the shards, and beside them (their fsyncs overlapping the shards' write) the JSON files."""
        writer = ChecksummingWriter(tmp)
        error = None
        with ThreadPoolExecutor(max_workers=1) as pool:
            plain_files = pool.submit(self._write_plain, tmp, plain, self._rank_files(state))
            try:
                dcp.save({"app": tensors}, storage_writer=writer, process_group=self._main_group)
            except BaseException as exc:
                reraise_interrupt(exc)
                error = exc
            finally:
                writer.end_upload()
        sums, plain_error = plain_files.result()
        self._raise_if_failed(plain_error or error, tmp, state.step)
        write_s = time.perf_counter() - started
        self._commit(tmp, state.step, state.samples_seen, write_s, write_s, {**sums, **writer.checksums})
        self._verify(state)

    def _refuse_nonfinite(self, tensors: dict[str, Any], step: int) -> None:
        """Never commit NaN or infinite weights or optimizer state: every rank checks its shards, all agree."""
        bad = first_nonfinite(flatten(tensors))
        if not self._ranks.any(bad is not None):
            return
        bad = self._ranks.first_named(bad)
        finite = [c for c in list_committed(self.dir) if c.manifest and c.manifest.get("finite")]
        kept = f"newest finite checkpoint {finite[-1].path.name} kept" if finite else "there is no finite one yet"
        raise CheckpointError(f"checkpoint: step {step} has non-finite values ({bad}); not committed, {kept}; the "
                              "training diverged: lower optim.lr (or raise optim.warmup_steps) and run again")

    def _rank_files(self, state: TrainState) -> dict[str, Any]:
        """This rank's own JSON files, taken at the step boundary: its RNG state and, for an iterable dataset, its
        stream position."""
        files = {rng_file(self.env.rank): rng_state()}
        if state.data_loader is not None:
            files[data_file(self.env.rank)] = state.data_loader.state_dict()
        return files

    def _write_plain(self, tmp: Path, plain: dict[str, Any],
                     rank_files: dict[str, Any]) -> tuple[dict[str, str], Exception | None]:
        """state.json (rank 0) and this rank's files beside the shards: (their checksums, the error if any).

        Runs beside the shards' write: file operations only, the ranks agree on the outcome afterwards.
        """
        try:
            sums = {name: write_json(tmp / name, value) for name, value in rank_files.items()}
            if self.env.is_main:
                sums[STATE_FILE] = write_json(tmp / STATE_FILE, plain)
            return sums, None
        except (OSError, TypeError, ValueError) as exc:
            return {}, exc

    def _finish_pending(self, wait: bool = False) -> None:
        """Commit the in-flight async save (every rank's upload is done, or `wait` for it)."""
        p, self._pending = self._pending, None
        with _saving(p.step):
            waited = time.perf_counter()
            error = None
            try:
                with doing(Activity.WAITING_FOR_UPLOAD):
                    p.future.result()
            except BaseException as exc:
                reraise_interrupt(exc)
                error = exc
            finally:
                p.writer.end_upload()
            waited = time.perf_counter() - waited if wait else 0.0
            self._raise_if_failed(error, p.tmp, p.step)
            done = p.done_at or time.perf_counter()
            self._commit(p.tmp, p.step, p.samples_seen, done - p.started, p.staged_s + waited,
                         {**p.checksums, **p.writer.checksums})

    def _raise_if_failed(self, error: BaseException | None, tmp: Path, step: int) -> None:
        """Agree on a failed save: remove its temporary folder and raise one sentence on every rank.

        A save that lost a rank (a collective timed out, a connection dropped) raises that error at once: agreeing
        would wait for the lost rank too. Its temporary folder stays, uncommitted, for the next start to remove.
        """
        if error is not None and self.env.distributed and says_peer_lost(str(error)):
            raise error
        if not self._ranks.any(error is not None):
            return
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = failure_cause(error) if error is not None else "failed on another rank"
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
        checksums = self._ranks.gather_checksums(checksums)
        commit_start = time.perf_counter()
        final = self.dir / f"step_{step:08d}"
        manifest = store.new_manifest(step, samples_seen, self.env.world_size, write_s, self._fingerprint,
                                      self._layout)
        nbytes = self._ranks.on_rank0(lambda: store.commit(tmp, final, manifest, checksums))
        self._ranks.on_rank0(self._retain)
        blocked_s += time.perf_counter() - commit_start
        self._saves.append({"step": step, "blocked_s": round(blocked_s, 4), "write_s": round(write_s, 4),
                            "bytes": nbytes})
        self._last_saved_step = step
        if self.env.is_main:
            log.info("checkpoint step %d committed: %s (%.1f MB; loop blocked %.3f s, write %.3f s)", step, final,
                     nbytes / 1e6, blocked_s, write_s)

    def _retain(self) -> None:
        """Rank 0: retention (store.retain) never deletes the checkpoint this run resumed from, nor the best."""
        self._deleter.delete(store.retain(self.dir, self.cfg.keep_last, self._resumed_from, self._best_step))

    def _verify(self, state: TrainState) -> None:
        """Reload the checkpoint just committed into fresh tensors and compare with the live state exactly."""
        if self._verified:
            return
        path = self.dir / f"step_{state.step:08d}"
        live, _ = split_state(state)
        fresh = blank_like(live)
        dcp.load({"app": fresh}, storage_reader=SafeReader(path), process_group=self._main_group)
        bad = differences(live, fresh)
        if self._ranks.any(bool(bad)):
            raise CheckpointError(f"checkpoint.verify: {path} does not read back what was saved "
                                  f"({', '.join(bad[:store.MAX_LISTED]) or 'on another rank'}); the storage under "
                                  "checkpoint.dir is unreliable: use another disk")
        self._verified = True
        if self.env.is_main:
            log.info("checkpoint step %d verified: reloaded into fresh tensors, all equal", state.step)

    def _stop(self, state: TrainState, name: str) -> None:
        """Save this step (unless saved) and stop; `name`: the signal, or the reason a stage gave."""
        if self._pending is not None:
            self._finish_pending(wait=True)
        if state.step != self._last_saved_step:
            self._save(state, blocking=True)
        mark_stopped(name)
        self._stopped_by = name
        if self.env.is_main:
            log.warning("%s: stopped at step %d with checkpoint %s committed; exit code %d (run the same command "
                        "to resume)", name, state.step, self.dir / f"step_{state.step:08d}", EXIT_STOPPED)

    def _export(self) -> dict[str, Any]:
        # the run's own model.pt, from an earlier invocation of the same run: replaced (a file of anyone else's not)
        info = export_weights(self.dir / f"step_{self._last_saved_step:08d}", self.run_dir / EXPORT_FILE, force=True)
        log.info("exported the model weights of step %d to %s (%.1f MB)", info["step"], info["path"],
                 info["bytes"] / 1e6)
        return info

    def _prepare_dir(self) -> None:
        """Rank 0: the folder exists, is writable and is ours alone; leftovers of crashed saves are removed; the
        end-of-run export, if asked for, would replace nothing but an earlier export (refused now, not after
        training)."""
        self._lock = store.lock_dir(self.dir, self.run_dir)
        store.remove_leftovers(self.dir)
        if self.cfg.export and (foreign := not_an_export(self.run_dir / EXPORT_FILE)) is not None:
            raise CheckpointError(f"checkpoint.export: {self.run_dir / EXPORT_FILE} {foreign}, and the export at the "
                                  "run's end would replace it; nothing was changed: move it away, or set "
                                  "checkpoint.export=false")

    def _agreed_flags(self) -> tuple[int | None, bool]:
        """(the stop signal every rank agrees on, every rank's async upload is done), one step late (LatePoll):
        every rank stops at the same step; a signal that lands meanwhile counts at the next poll."""
        uploading = self._pending is not None and not self._pending.future.done()
        if not self.env.distributed:
            return self._signals.caught, self._pending is not None and not uploading
        agreed, polled_pending = self._poll.exchange([self._signals.caught or 0, int(uploading)], self._pending)
        if agreed is None:
            return None, False
        # uploaded: the save that was pending when those flags were taken (still the pending one) is done everywhere
        uploaded = self._pending is not None and polled_pending is self._pending and not bool(agreed[1])
        return int(agreed[0]) or None, uploaded


@contextlib.contextmanager
def _saving(step: int) -> Iterator[None]:
    """An error out of the save of `step` says so, for the launcher's account of it (failures.note_save)."""
    try:
        yield
    except BaseException as exc:
        note_save(exc, step)
        raise
