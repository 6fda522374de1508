"""One run directory for all ranks, however they were started.

Hydra names the run directory in every process it runs in. Under torchrun each
rank is such a process, and `${now:}` differs between them by a few
milliseconds: the well-known "one directory per rank" bug. Here the name is
agreed through torchrun's own key-value store (the first rank to ask sets it,
the others read it), so all ranks, nodes and restarts of a job share one
directory. Only rank 0 writes Hydra's saved config and the log file.

A checkpointed run (or one given `trainer.run_name`) has a stable identity instead:
`outputs/runs/<run name>`, the name made from the overrides that change what is
trained (folder_name: short and shell-safe; the identity itself is run_name's). The
same command therefore finds the same directory and resumes from its checkpoints, on
every rank, after any stop or crash.

trainflow writes only into what it owns: a run or sweep directory it made holds its
marker file (MARKER), written before anything else; a folder that holds anything
else but no marker (a folder of the user's, the current folder of an empty
`hydra.run.dir=`) is refused in one line before anything is created there. An
empty or missing folder becomes trainflow's. Sweep job folders lie inside a sweep
directory checked so, and are marked when their job claims them.

One run at a time: rank 0 locks the run directory (`<run dir>/.lock`) before
Hydra writes anything into it, so a second run there is refused without touching
the first one's files. One run per directory, too: a run directory that holds the
results (config.yaml, summary.json) of a run of another identity (run_identity) is
refused before anything is written there; the same run may continue in it.

A refused command leaves nothing on disk. Rank 0 notes the run directory as it was before anything is made there
(note_before); a refusal before training (results_begin marks its start) puts it back (undo_refused): a folder this
process made goes, with the parents it made; one that was there gets back the bytes of every file the start
rewrote (Hydra's .hydra/, config.yaml, the lock's holder line), its log cut to its length, and loses what was added.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainflow.errors import ConfigError, TrainflowError, user_error
from trainflow.util.files import SMALL_FILE_BYTES, cannot_write, not_a_file, read_regular
from trainflow.util.locks import LOCK_FILE, DirLock, held_by_another
from trainflow.util.rank import env_rank

RUN_DIR_ENV = "TRAINFLOW_RUN_DIR"  # set by our launchers for the processes they start
RUNS_DIR = "outputs/runs"  # where runs with a stable identity live, one folder per run name
MARKER = ".trainflow"  # in every run and sweep directory trainflow made, written before anything else there
_MARKER_TEXT = "trainflow writes into this folder (a run or sweep directory); it writes only into folders holding " \
               "this file, or empty ones\n"
# what rank 0's lock file says of its holder: a folder holding one was a trainflow run directory before MARKER existed
_LOCK_HOLDER = re.compile(r"pid \d+ on \S+(, run dir .+)?, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")

# Overrides that change how a run goes, not what it trains: left out of the run name, so that the same run
# continues with them (more steps, another logger, another world size, checkpoint settings, ...).
_NOT_IN_RUN_NAME = ("hydra", "checkpoint", "compile", "parallelism", "profiler", "logger", "metrics",
                    "trainer.max_steps", "trainer.log_every", "trainer.eval_every", "trainer.eval_steps",
                    "trainer.progress", "trainer.nonfinite", "trainer.device", "trainer.run_name",
                    "trainer.sweep_name")
_IN_RUN_NAME = ("checkpoint.dir",)  # another checkpoint folder is another history
_READABLE_CHARS = 160  # a folder name may have 255 bytes
FOLDER_CHARS = 80  # a run or sweep folder's name: at most this long, of characters a shell takes as they are
_NOT_IN_FOLDER = re.compile(r"[^A-Za-z0-9._-]+")


def _timestamp() -> str:
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def _agreed_under_torchrun() -> str:
    """The name rank 0's clock gives, shared through the elastic agent's store."""
    # lazy: only a run under torchrun needs the store, and this module must not load torch: Hydra's plugin scan
    # imports it (through trainflow's launchers) at the start of every Hydra app
    from torch.distributed import TCPStore

    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    mine = _timestamp()
    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30),
        )
        key = f"trainflow/run_name/{run_id}"
        if env_rank() == 0:
            store.compare_set(key, "", mine)
        agreed = store.get(key).decode()  # blocks until rank 0 has set it
    except Exception:  # no reachable store: fall back to a name every rank can derive
        agreed = datetime.now().strftime("%Y-%m-%d/%H-%M") + f"-torchrun-{run_id}"
    return agreed


def override_key(override: str) -> str:
    """`model.n_embd` of `model.n_embd=64`, `+x=1`, `~x`; `hydra/launcher` of a group choice."""
    return override.split("=", 1)[0].lstrip("~+").split("@", 1)[0]


def _names_the_run(override: str) -> bool:
    key = override_key(override)
    left_out = any(key == p or key.startswith((f"{p}.", f"{p}/")) for p in _NOT_IN_RUN_NAME)
    return key in _IN_RUN_NAME or not left_out


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot be a run's folder name (trainer.run_name), or None."""
    if name.strip() and "/" not in name and name not in (".", ".."):
        return None
    return f"{name!r} is not a folder name; give a name without '/', e.g. trainer.run_name=gpt-small-try2"


def run_name(overrides: list[str]) -> str:
    """The default trainer.run_name, a run's identity: the overrides that change what is trained, readable, plus a
    short hash of them all; their order does not matter."""
    kept = sorted(o for o in overrides if _names_the_run(o))
    readable = re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(kept))[:_READABLE_CHARS] or "default"
    return f"{readable}-{_digest(kept)}"


def _digest(kept: list[str]) -> str:
    return hashlib.sha256(chr(10).join(kept).encode()).hexdigest()[:8]


def folder_name(overrides: list[str]) -> str:
    """The folder of a run or sweep named by its overrides (those run_name keeps), for a shell: at most
    FOLDER_CHARS of [A-Za-z0-9._-], swept keys first, each as `<last part of the key>-<values>` (`lr-1e-3_3e-4`),
    joined by `__`, as many as fit, then run_name's hash (`lr-1e-3_3e-4__n_embd-64-9f3a1c2e`): the same overrides,
    in any order, give the same folder."""
    kept = sorted(o for o in overrides if _names_the_run(o))
    swept_first = sorted(kept, key=lambda o: ("," not in o.partition("=")[2], o))
    digest = _digest(kept)
    joined, room = "__".join(_short(o) for o in swept_first), FOLDER_CHARS - len(digest) - 1
    readable = joined if len(joined) <= room else (joined[:room].rpartition("__")[0] or joined[:room])  # whole items
    return f"{readable.rstrip('._-') or 'default'}-{digest}"


def _short(override: str) -> str:
    """`lr-1e-3_3e-4` of `optim.lr=1e-3,3e-4`, `model-gpt_small` of `model=gpt_small`, `no-dropout` of `~x.dropout`."""
    key, _, value = override.partition("=")
    leaf = re.split(r"[./]", override_key(key))[-1]
    if key.startswith("~"):
        return f"no-{leaf}"
    return f"{_NOT_IN_FOLDER.sub('_', leaf)}-{_NOT_IN_FOLDER.sub('_', value.replace(',', '_')).strip('_')}"


def existing_or_new(parent: str, overrides: list[str]) -> str:
    """`parent/<folder_name>`, or the folder an earlier trainflow named `parent/<run_name>` for the same overrides
    when only that one exists: the same command finds its folder across the change of names."""
    new, earlier = f"{parent}/{folder_name(overrides)}", f"{parent}/{run_name(overrides)}"
    return earlier if not Path(new).exists() and Path(earlier).is_dir() else new


def run_identity(overrides: list[str]) -> str:
    """What makes two runs one run: the trainer.run_name typed for it, else the name made from its overrides (the
    default run name): more steps or other checkpoint settings keep the identity, another model does not."""
    named = [o.split("=", 1)[1].strip("'\"") for o in overrides if override_key(o) == "trainer.run_name" and "=" in o]
    return named[-1] if named else run_name(overrides)


def run_dir(checkpointed: bool = False, name: str | None = None, overrides: Any = ()) -> str:
    """Hydra's run directory: ours when a trainflow launcher chose it; outputs/runs/<run name> for a checkpointed
    or named run (the same command, the same directory); else outputs/<date>/<time>."""
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    if name is not None:
        if problem := run_name_problem(name):
            user_error(f"trainer.run_name: {problem}")
        return f"{RUNS_DIR}/{name}"
    if checkpointed:
        return existing_or_new(RUNS_DIR, [str(o) for o in overrides])
    if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ:
        return f"outputs/{_agreed_under_torchrun()}"
    return f"outputs/{_timestamp()}"


def log_file(output_dir: str) -> str:
    return os.path.join(output_dir, "train.log") if env_rank() == 0 else os.devnull


def hydra_subdir() -> str | None:
    return ".hydra" if env_rank() == 0 else None


def register_resolvers() -> None:
    for name, fn in (
        ("trainflow_run_dir", run_dir),
        ("trainflow_log_file", log_file),
        ("trainflow_hydra_subdir", hydra_subdir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)


class OutputDirCheck(Callback):
    """Makes the run (or sweep) directory before Hydra does, once it is known to be trainflow's (see own_dir), so
    that a folder of the user's or an unwritable one is one line, not files written into it or a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = str(config.hydra.run.dir)
        if env_rank() == 0 and not os.environ.get(RUN_DIR_ENV):  # a launcher's job folder is the launcher's
            own_dir(folder, "hydra.run.dir")
        else:
            _check_writable("hydra.run.dir", folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        own_dir(str(config.hydra.sweep.dir), "hydra.sweep.dir")


def own_dir(folder: str, key: str) -> None:
    """Make `folder` trainflow's before anything is written there: stop in one line when it is empty as typed, or
    holds files but no MARKER (trainflow did not make it); else create it and write the marker."""
    fix = ("give this sweep its own folder (trainer.sweep_name=<new name>, or hydra.sweep.dir=<new folder>)"
           if key == "hydra.sweep.dir" else "give this run its own folder (hydra.run.dir=<new folder>)")
    if not folder.strip():
        user_error(f"{key}: is empty (an unset environment variable?), which would make the current folder "
                   f"{Path.cwd()} the output directory; nothing was written: {fix}, or leave {key} out")
    path = Path(folder).expanduser()
    note_before(path) if key == "hydra.run.dir" else note_before(path, depth=1, sweep=True)
    if path.is_dir() and not made_by_trainflow(path):
        try:
            entries = sorted(p.name for p in path.iterdir())
        except OSError as exc:
            user_error(f"{key}: cannot list {path.absolute()} ({exc.strerror}); {fix}")
        if entries:
            shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
            user_error(f"{key}: {path.absolute()} holds files trainflow did not write ({shown}) and no {MARKER}, "
                       f"the file trainflow keeps in the folders it writes into; nothing was changed: {fix}")
    _check_writable(key, folder)
    if path.is_dir() and held_by_another(path):
        return  # a live run holds it: nothing is written there; taking the lock says so in one line
    mark(path, key)


def made_by_trainflow(folder: Path) -> bool:
    """Whether `folder` holds trainflow's MARKER, or (a run directory from before the marker) its lock file naming
    the run that held it."""
    if (folder / MARKER).is_file():
        return True
    lock = folder / LOCK_FILE
    try:
        if not lock.is_file():
            return False
        with open(lock, "rb") as f:
            return _LOCK_HOLDER.match(f.read(4096).decode(errors="replace")) is not None
    except OSError:
        return False


def mark(folder: Path, key: str) -> None:
    """Leave MARKER in `folder` (a run, job or sweep directory trainflow writes into), unless it is there."""
    marker = folder / MARKER
    if marker.is_symlink():  # never written through, never taken for trainflow's
        user_error(f"{key}: {marker} is a symbolic link, not trainflow's marker; nothing was changed: remove it if it "
                   f"is yours, or point {key} at another folder")
    if not marker.is_file():
        try:  # created, never opened through a link planted after the check
            with os.fdopen(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
                f.write(_MARKER_TEXT)
        except OSError as exc:
            user_error(f"{key}: cannot write {marker} ({exc.strerror}); point {key} at a writable folder")


_claimed: dict[Path, DirLock] = {}  # this process's run-directory locks (DirLock), by folder


def claim_run_dir(folder: Path, key: str) -> None:
    """Rank 0: lock `folder` for this process's lifetime (and mark it trainflow's), or stop in one line naming the
    run that holds it.

    Other ranks write nothing Hydra-owned and take no lock; workers this process starts inherit its lock.
    """
    if env_rank() != 0:
        return
    folder = folder.absolute()
    if folder in _claimed:
        return
    fix = ("point hydra.sweep.dir at another folder" if key == "hydra.sweep.dir" else
           "give this run its own directory (another trainer.run_name, or hydra.run.dir=<folder>)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _claimed[folder] = DirLock(folder, key=key, fix=fix)
    except ConfigError as exc:
        undo_refused()
        user_error(str(exc))
    except OSError as exc:
        undo_refused()
        user_error(f"{key}: cannot create {folder} ({exc.strerror}); point {key} at a writable folder")
    mark(folder, key)


class RunDirLock(Callback):
    """Locks the run directory before Hydra writes its saved config, log file or anything else into it.

    A single run: at on_run_start, before Hydra's run_job. Jobs of trainflow's launchers lock in run_job_here
    (before run_job); Hydra's own basic launcher gives no earlier hook than on_job_start.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.run.dir))
        claim_run_dir(folder, "hydra.run.dir")
        if env_rank() == 0 and not os.environ.get(RUN_DIR_ENV):  # a launcher's job folder is the launcher's to name
            check_same_run(folder, [str(o) for o in config.hydra.overrides.task])

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        key = "hydra.run.dir" if config.hydra.mode == RunMode.RUN else "hydra.sweep.dir"
        claim_run_dir(Path(str(config.hydra.runtime.output_dir)), key)


RESULTS = ("config.yaml", "summary.json")  # what a run leaves in its directory, rewritten by the next run there


def check_same_run(folder: Path, overrides: list[str]) -> None:
    """Rank 0, holding the folder's lock: stop in one line when `folder` holds the results of another run, whose
    identity its saved overrides (.hydra/overrides.yaml) give; nothing there is changed."""
    results = [name for name in RESULTS if (folder / name).exists()]
    if not results:
        return
    saved = folder / ".hydra" / "overrides.yaml"
    try:  # never opened unless a regular file: a FIFO would wait forever
        theirs: str | None = None if not_a_file(saved) else run_identity([str(o) for o in OmegaConf.load(saved)])
    except (OSError, ValueError, TypeError, yaml.YAMLError):
        theirs = None
    ours = run_identity(overrides)
    if theirs == ours:
        return
    undo_refused()  # the lock's holder line goes back to what it said
    held = f"holds the {' and '.join(results)} of"
    if theirs is None:
        user_error(f"hydra.run.dir: {folder} {held} a run trainflow cannot identify (no readable "
                   ".hydra/overrides.yaml); nothing was changed: give this run its own directory "
                   "(hydra.run.dir=<new folder>)")
    user_error(f"hydra.run.dir: {folder} {held} another run ({theirs}; this one is {ours}); nothing was changed: "
               f"give this run its own directory (hydra.run.dir=<new folder>), or continue that run with "
               f"trainer.run_name='{theirs}'")


def _check_writable(key: str, folder: str) -> None:
    if (exc := cannot_write(folder)) is not None:
        user_error(f"{key}: cannot create {folder} ({exc.strerror}); point {key} at a writable folder")


_DEPTH = 2  # how deep a start writes into a run directory: .hydra/*, checkpoints/.lock, tensorboard/<events>


@dataclass
class _Before:
    """A run directory as it was before this process made or claimed it."""

    folder: Path
    made: list[Path]  # the folder and the parents this process makes, innermost first (empty: it was there)
    entries: dict[Path, bytes | int | None]  # what it held: a file's bytes (a bigger one: its size), else None
    depth: int  # how deep it was noted
    sweep: bool  # a sweep folder: once a job's folder appeared there, what the jobs did is kept

    def restore(self) -> None:
        if held_by_another(self.folder):
            return  # another run holds it (the refusal may be that very lock): what it holds is its own
        now = _entries(self.folder, self.depth)
        added = now.keys() - self.entries.keys()
        if self.sweep and any(path.is_dir() and not path.is_symlink() for path in added):
            return  # a job's folder: the jobs began
        if self.made:
            shutil.rmtree(self.folder, ignore_errors=True)
            for parent in self.made[1:]:
                try:
                    parent.rmdir()  # only while empty: another run may have made its own folder there meanwhile
                except OSError:
                    break
            return
        for path in sorted(added, key=lambda p: len(p.parts), reverse=True):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path, was in self.entries.items():
            if was is None or now.get(path) == was or not _regular(path):
                continue
            try:
                if isinstance(was, bytes):
                    path.write_bytes(was)
                elif path.stat().st_size > was:  # a log too big to keep whole only grows: cut it back
                    os.truncate(path, was)
            except OSError:
                continue


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _entries(folder: Path, depth: int = _DEPTH) -> dict[Path, bytes | int | None]:
    """Everything in `folder` down to `depth` levels, links not followed: a regular file's bytes (one bigger than
    SMALL_FILE_BYTES: its size), None for anything else."""
    found: dict[Path, bytes | int | None] = {}
    try:
        children = list(folder.iterdir())
    except OSError:
        return found
    for child in children:
        if _regular(child):
            try:
                size = child.stat().st_size
                found[child] = read_regular(child) if size <= SMALL_FILE_BYTES else size
            except (OSError, TrainflowError):  # gone or swapped meanwhile: nothing to put back
                found[child] = None
            continue
        found[child] = None
        if depth > 1 and child.is_dir() and not child.is_symlink():
            found.update(_entries(child, depth - 1))
    return found


_noted: dict[Path, _Before] = {}  # rank 0's run directories as they were, until training begins
_began: list[bool] = []  # set once training began (or workers took over): a failure keeps what is there


def note_before(folder: Path, depth: int = _DEPTH, sweep: bool = False) -> None:
    """Rank 0, before anything is made in `folder`: note it as it is, `depth` levels deep, for undo_refused (a
    checkpoint folder: 1, its lock and markers; its checkpoints a start never writes)."""
    folder = folder.absolute()
    if folder in _noted or _began:
        return
    made, missing = [], folder
    while not missing.exists() and not missing.is_symlink() and missing != missing.parent:
        made.append(missing)
        missing = missing.parent
    _noted[folder] = _Before(folder, made, {} if made else _entries(folder, depth), depth, sweep)


def results_begin() -> None:
    """Training begins (or workers this process cannot see begin it): from here on a failure keeps the run
    directory as it is, with what the run wrote."""
    _began.append(True)
    _noted.clear()


def undo_refused() -> None:
    """A command refused before training: every folder noted is as it was before this process (see note_before)."""
    if _began:
        return
    for before in reversed(_noted.values()):  # a folder noted inside another (checkpoints/) first
        before.restore()
    _noted.clear()
