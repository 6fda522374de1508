"""Sweeps that resume: a sweep's folder follows from what the sweep is, finished jobs are skipped, and every job
has a checkpoint folder of its own.

The sweep folder is `multirun/<sweep name>`: trainer.sweep_name, else a name made from the sweep's overrides
(swept and fixed, short and shell-safe as a run's folder is: rundir.folder_name; SweepFolder, a Hydra callback,
notes it at the sweep's start), so running the same `-m` command again finds the same folder. In it a job whose
summary.json is complete (not a stop on a signal) and whose config equals the job's is skipped with one line; any
other job runs, resuming from its committed checkpoint when it has one (trainflow.record.kept: never over the
results of another config). A sweep folder that holds another sweep (its multirun.yaml names other overrides) is
refused in one line.

A checkpoint.dir typed for a sweep is one folder per job: `<checkpoint.dir>/<sweep folder name>/<job number>`, as
the job directories are, so that jobs never resume each other's checkpoints. The folder names the run identity it
belongs to (`run_identity`); a job of another identity is refused there in one line rather than resume it (a fresh
start in that folder would mix two histories, and keep_last would delete the other run's checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainflow.config.checks import check_config
from trainflow.config.schema import RunConfig
from trainflow.errors import ConfigError, TrainflowError, user_error
from trainflow.record import kept
from trainflow.record.sweep_outcome import FRESH
from trainflow.util.files import write_atomic
from trainflow.util.rank import env_rank
from trainflow.util.rundir import existing_or_new, override_key, run_identity, run_name, run_name_problem

SWEEPS_DIR = "multirun"  # where sweeps without hydra.sweep.dir live, one folder per sweep name
IDENTITY_FILE = "run_identity"  # in a sweep job's checkpoint folder: the identity of the run it belongs to


def sweep_overrides(hydra_cfg: Any) -> list[str]:
    """What the sweep is: its command-line overrides and the sweeper's own params (`key=a,b`)."""
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None)
    swept = [f"{k}={v}" for k, v in params.items()] if isinstance(params, DictConfig) else []
    return [str(o) for o in hydra_cfg.overrides.task] + swept


def sweep_name(hydra_cfg: Any) -> str:
    """The default trainer.sweep_name: made from the sweep's overrides as a run's name is from a run's."""
    return run_name(sweep_overrides(hydra_cfg))


_sweep: list[str] = []  # the name made from this process's sweep, set by begin() before its folder is resolved


def begin(config: DictConfig) -> None:
    """At the start of a sweep, in the launching process (SweepFolder): note the folder name its overrides make."""
    _sweep[:] = [existing_or_new(SWEEPS_DIR, sweep_overrides(config.hydra)).removeprefix(f"{SWEEPS_DIR}/")]


def sweep_dir(name: str | None) -> str:
    """hydra.sweep.dir: multirun/<trainer.sweep_name, default made from the sweep's overrides>.

    Resolved first in the launching process, at the sweep's start (begin); Hydra copies that value into every
    job's config, as it does for `${now:}` (the resolver is cached). Outside a sweep (--cfg hydra) the time names it.
    """

    if name is not None and (problem := run_name_problem(name)):
        user_error(f"trainer.sweep_name: {problem.replace('trainer.run_name', 'trainer.sweep_name')}")
    if name is None:
        name = _sweep[0] if _sweep else datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return f"{SWEEPS_DIR}/{name}"


class SweepFolder(Callback):
    """At a sweep's start, before anything resolves hydra.sweep.dir: notes the sweep's name, then refuses a folder
    that holds another sweep (before Hydra rewrites its multirun.yaml)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        begin(config)
        check_same_sweep(Path(str(config.hydra.sweep.dir)), config.hydra)


def check_same_sweep(folder: Path, hydra_cfg: Any) -> None:
    """Stop in one line when `folder` holds another sweep (its multirun.yaml has other overrides); the same sweep
    (more steps, other launcher settings) continues there."""
    saved = folder / "multirun.yaml"
    if not saved.exists():
        return
    try:
        theirs: str | None = sweep_name(OmegaConf.load(saved).hydra)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        theirs = None
    ours = sweep_name(hydra_cfg)
    if theirs != ours:
        user_error(f"hydra.sweep.dir: {folder} holds another sweep ({theirs or 'an unreadable multirun.yaml'}; "
                   f"this one is {ours}); nothing was changed: give this sweep its own folder "
                   "(trainer.sweep_name=<new name> or hydra.sweep.dir=<new folder>)")


def check_before_start(jobs: Iterable[tuple[int, DictConfig]]) -> None:
    """What refuses a whole sweep before its first job starts, given each job's number and task config as it will
    run: a ladder rung that cannot run (check_rungs). Other sweeps run their good jobs and report the bad."""
    check_rungs(jobs)


def check_rungs(jobs: Iterable[tuple[int, DictConfig]]) -> None:
    """Check every rung of a ladder sweep before the first starts: a rung that cannot run as composed (a
    profiler window past trainer.max_steps, say) fails the sweep at once, in one line naming the rung, rather
    than after the rungs before it trained. `jobs`: each job's number and task config; jobs that are no rung
    are left to themselves."""
    for num, task in jobs:
        rung = OmegaConf.select(task, "ladder.rung")
        if not rung:
            continue
        try:
            check_config(task)
        except TrainflowError as exc:
            user_error(f"ladder={rung} (job #{num}): {exc}")


def is_sweep_job(hydra_cfg: Any) -> bool:
    return hydra_cfg.mode == RunMode.MULTIRUN


def typed_checkpoint_dir(hydra_cfg: Any) -> bool:
    """Whether this is a sweep job given checkpoint.dir on the command line (a folder a config sets, as the
    ladder's checkpoint rung does for its resume rung, is the config's own choice and stays as set)."""
    return is_sweep_job(hydra_cfg) and any(override_key(str(o)) == "checkpoint.dir" for o in hydra_cfg.overrides.task)


def with_job_checkpoint_dir(cfg: RunConfig, hydra_cfg: Any) -> RunConfig:
    """A sweep job's config with the checkpoint.dir typed for the sweep made the job's own folder under it."""
    base = cfg.checkpoint.dir
    if base is None or not typed_checkpoint_dir(hydra_cfg):
        return cfg
    own = Path(str(base)) / Path(str(hydra_cfg.sweep.dir)).name / str(hydra_cfg.sweep.subdir)
    return replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(own)))


def job_identity(hydra_cfg: Any) -> str:
    return run_identity([str(o) for o in hydra_cfg.overrides.task])


def claim_checkpoint_dir(ckpt_dir: Path, identity: str) -> None:
    """A sweep job's own checkpoint folder: refuse it (one line, nothing changed) when it belongs to a run of
    another identity; else name this job's identity there (rank 0)."""
    marker = ckpt_dir / IDENTITY_FILE
    if marker.is_symlink():  # never read nor replaced: trainflow did not make it
        raise ConfigError(f"checkpoint.dir: {marker} is a symbolic link, not trainflow's; nothing was changed: remove "
                          "it if it is yours, or point checkpoint.dir at another folder")
    try:
        theirs = marker.read_text().strip() if marker.exists() else None
    except OSError:
        theirs = None
    if theirs is not None and theirs != identity:
        raise ConfigError(f"checkpoint.dir: {ckpt_dir} holds the checkpoints of another run ({theirs}; this job is "
                          f"{identity}); nothing was changed and nothing is resumed: point checkpoint.dir at "
                          f"another folder, or {FRESH}")
    if theirs is None and env_rank() == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, identity + "\n")
        except OSError as exc:
            raise ConfigError(f"checkpoint.dir: cannot write to {ckpt_dir} ({exc.strerror}); point checkpoint.dir "
                              "at a writable folder") from None


def finished(job_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The summary of a job that finished in `job_dir` with the config `cfg` (the checked one), else None: no
    summary, a cut-off one, a stop on a signal (it resumes), or another config (see trainflow.record.kept)."""
    return kept.finished(kept.read_earlier(job_dir), cfg)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("trainflow_sweep_dir"):
        OmegaConf.register_new_resolver("trainflow_sweep_dir", sweep_dir, use_cache=True)
