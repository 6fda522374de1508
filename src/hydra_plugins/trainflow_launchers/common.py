"""What both launchers share: composing each sweep job, running it in a rank, and turning failures into one line.

Each job's config is composed once, in the launching process (so `${now:}` in
the sweep directory and every other cached value is the same for all ranks
and nodes), then pickled with the task function to the processes that run it.
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, run_job
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from trainflow.cli import user_error
from trainflow.errors import TrainflowError
from trainflow.rundir import RUN_DIR_ENV


class JobFailed(TrainflowError, CompactHydraException):
    """A launched job failed. Hydra prints it as one line (its traceback lives in the job's logs)."""


@dataclass
class SweepJob:
    """One job of a sweep: its number, its overrides, its composed config and its directory."""

    num: int
    overrides: list[str]
    config: DictConfig
    dir: Path

    def describe(self) -> str:
        return f"#{self.num} : {' '.join(self.overrides)}"


def compose_jobs(hydra_context: HydraContext, config: DictConfig, job_overrides: Any, first_num: int) -> list[SweepJob]:
    """Compose every job's config as Hydra's own launcher does, and fix its directory now."""
    jobs = []
    for offset, overrides in enumerate(job_overrides):
        num = first_num + offset
        job_cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = str(num)
            job_cfg.hydra.job.num = num
        job_dir = Path(str(job_cfg.hydra.sweep.dir), str(job_cfg.hydra.sweep.subdir)).absolute()
        jobs.append(SweepJob(num, list(overrides), job_cfg, job_dir))
    return jobs


def run_job_here(hydra_context: HydraContext, task_function: TaskFunction, job: SweepJob) -> JobReturn:
    """Run `job` in this process (one rank), in the job's directory, with Hydra's logging and saved config.

    Every rank of the job calls this; rank-aware resolvers keep Hydra's files and
    the log file to rank 0, and TRAINFLOW_RUN_DIR points every rank to the same directory.
    """
    os.environ[RUN_DIR_ENV] = str(job.dir)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=job.config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


# trainflow's one-line user errors ("Error: <key>: ..."), also behind torchrun's "[rank0]:" prefix
_USER_ERROR = re.compile(r"(?:^|\]:)\s*Error: (.+)$")
# the last line of a Python traceback: "SomeError: message"
_EXCEPTION = re.compile(r"^(?:\[\w+\]:)?\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def failure_reason(*texts: str | None) -> str | None:
    """The line that says why a job failed: a trainflow user error, else the last exception line."""
    lines = [line.rstrip() for text in texts if text for line in text.splitlines()]
    for pattern in (_USER_ERROR, _EXCEPTION):
        for line in reversed(lines):
            match = pattern.search(line)
            if match:
                return match.group(1).strip()
    return None


def one_line(error: BaseException) -> str:
    """An exception as one line: trainflow's own errors are sentences already; others get their type."""
    first = (str(error).strip().splitlines() or [""])[0]
    return first if isinstance(error, TrainflowError) else f"{type(error).__name__}: {first}"


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class RunModeGuard(Callback):
    """Refuses `hydra/launcher=torchrun|slurm` without `-m`: Hydra would silently train here in one process."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = OmegaConf.select(config, "hydra.launcher._target_", default="")
        from hydra_plugins.trainflow_launchers.config import SlurmLauncherConf, TorchrunLauncherConf

        if target == SlurmLauncherConf._target_:
            user_error("hydra/launcher=slurm: the SLURM launcher submits sweeps, and this is a single run; "
                       "add -m (python train.py -m hydra/launcher=slurm ...) to submit it as a one-job sweep")
        if target == TorchrunLauncherConf._target_:
            user_error("hydra/launcher=torchrun: the torchrun launcher runs sweeps, and this is a single run; "
                       "add -m (python train.py -m hydra/launcher=torchrun ...) to run it as a one-job sweep")
