"""What the launchers share: Hydra's setup, composing each sweep job, running a job in a child process or a
rank, and turning failures into one line.

Each job's config is composed once, in the launching process (so `${now:}` in
the sweep directory and every other cached value is the same for all ranks
and nodes), then pickled with the task function to the processes that run it.

Hydra's plugin scan imports the launchers at the start of every Hydra app, and
they run the jobs of any Hydra app: what they import at the top is torch-free
(hydra, omegaconf, trainflow's errors, files, run directory and failure records).
trainflow's rules for its own runs (the typed config, a finished job skipped, the
results kept) load torch: they are imported where a job is trainflow's.
"""

import contextlib
import copy
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from trainflow.errors import TrainflowError, typed_command, user_error
from trainflow.record.sweep_outcome import FRESH, JobFailed, monitor_value, skip_line
from trainflow.util.rundir import RUN_DIR_ENV, claim_run_dir, results_begin

log = logging.getLogger(__name__)

RESULT_NAME = "result.pkl"  # a job's pickled JobReturn, left beside its pickled spec by the process that ran it
PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when the thread that started it ends
# the type of a trainflow run's parallelism section, named rather than imported: importing it loads torch
TRAINFLOW_PARALLELISM = "trainflow.config.schema.ParallelismConfig"


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


@contextlib.contextmanager
def as_job(job: SweepJob) -> Iterator[DictConfig]:
    """The task config Hydra's run_job hands the task function (the job's, without `hydra`), with Hydra's config
    set to the job's meanwhile, so that `${hydra:...}` in it resolves as it will when the job runs."""
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance()
    sweep_config = hydra_config.cfg
    try:
        hydra_config.set_config(job.config)
        task = copy.deepcopy(job.config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        yield task
    finally:
        hydra_config.cfg = sweep_config
        OmegaConf.set_readonly(job.config.hydra, None)  # set_config made it read-only: the launch still writes it


def job_tasks(jobs: list[SweepJob]) -> Iterator[tuple[int, DictConfig]]:
    """Each job's number and task config, with Hydra's config set to the job's while the caller looks at it."""
    for job in jobs:
        with as_job(job) as task:
            yield job.num, task


def finished_already(job: SweepJob) -> JobReturn | None:
    """A completed JobReturn for a job that finished in its directory with its config (the same -m command run
    again), said in one line; None for a job to run (trainflow.record.sweeps.finished says which)."""
    if not (job.dir / "summary.json").exists() or not trainflow_job(job):
        return None
    from trainflow.config.checks import check_config  # lazy: loads torch, and only a trainflow job is checked
    from trainflow.record import sweeps  # lazy: loads torch, and only a trainflow job is skipped when finished

    with as_job(job) as task:
        try:
            cfg = sweeps.with_job_checkpoint_dir(check_config(task), job.config.hydra)
        except Exception:  # the job itself will say what is wrong with it
            return None
    summary = sweeps.finished(job.dir, cfg)
    if summary is None:
        return None
    log.info("\t%s", skip_line(job.num, job.dir, summary))
    return JobReturn(overrides=job.overrides, cfg=task, working_dir=str(job.dir), status=JobStatus.COMPLETED,
                     _return_value=monitor_value(summary))


def check_results_kept(jobs: list[SweepJob]) -> None:
    """Refuse the sweep before its first job when a job would start again over the results of another config in
    its folder (trainflow.record.kept): one line naming the job and the difference, nothing changed."""
    trainflow_jobs = [job for job in jobs if trainflow_job(job)]
    if not trainflow_jobs:
        return
    from trainflow.config.checks import check_config  # lazy: loads torch, and only a trainflow job is checked
    from trainflow.record import kept, sweeps  # lazy: load torch, and only a trainflow run's results are kept

    for job in trainflow_jobs:
        earlier = kept.read_earlier(job.dir)
        if not earlier.results:
            continue
        with as_job(job) as task:
            try:
                cfg = sweeps.with_job_checkpoint_dir(check_config(task), job.config.hydra)
            except Exception:  # the job itself will say what is wrong with it
                continue
        try:
            kept.check_may_write(earlier, cfg, f"hydra.sweep.dir: job #{job.num}", FRESH)
        except TrainflowError as exc:
            user_error(str(exc))


def run_job_here(hydra_context: HydraContext, task_function: TaskFunction, job: SweepJob) -> JobReturn:
    """Run `job` in this process (one rank), in the job's directory, with Hydra's logging and saved config.

    Every rank of the job calls this; rank-aware resolvers keep Hydra's files and
    the log file to rank 0, and TRAINFLOW_RUN_DIR points every rank to the same directory.
    """
    if trainflow_job(job):
        from trainflow.cli import register_with_hydra  # lazy: loads torch, and only a trainflow job needs it

        register_with_hydra()  # the job's config uses trainflow's resolvers (a fresh worker process has none yet)
    os.environ[RUN_DIR_ENV] = str(job.dir)
    claim_run_dir(job.dir, "hydra.sweep.dir")  # rank 0, before Hydra writes the job's .hydra/ and log file
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=job.config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


class SweepLauncher(Launcher):
    """Hydra's launcher interface as every trainflow launcher takes it: settings checked at setup, each job
    composed here, jobs run in turn with their outcome logged."""

    def __init__(self, conf: Any = None) -> None:
        self.conf = conf
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.check()

    def check(self) -> None:
        """Refuse settings that cannot work, before any job is composed (launchers with settings override it)."""

    def compose(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[SweepJob]:
        """Hydra's logging and globals as its own launchers set them; the sweep folder; every job's config."""
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = compose_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        if any(trainflow_job(job) for job in jobs):
            from trainflow.record import sweeps  # lazy: loads torch, and only a trainflow sweep has rungs to check

            with contextlib.closing(job_tasks(jobs)) as tasks:  # Hydra's config is the sweep's again, even on a refusal
                sweeps.check_before_start(tasks)
        check_results_kept(jobs)
        return jobs

    def run_in_turn(self, jobs: list[SweepJob], run_one: Callable[[SweepJob, Any], JobReturn]) -> list[JobReturn]:
        """Run the jobs one after the other, each given Hydra's global state to take along; a job that finished
        already (the same sweep run again) is skipped."""
        state = Singleton.get_state()
        results_begin()  # the jobs start: a failure from here on keeps the sweep folder with what they wrote
        results = []
        for job in jobs:
            log.info("\t%s", job.describe())
            ret = finished_already(job) or run_one(job, state)
            log_outcome(f"#{job.num}", ret, job.dir)
            results.append(ret)
        return results

    def run_child(self, job: SweepJob, state: Any, cmd: Callable[[Path], list[str]], console: Path,
                  quiet_from: str | None = None, **popen: Any) -> tuple[int, JobReturn | None]:
        """Pickle the job beside `console`, run `cmd(spec)`, tee its output to this console and to `console`
        (from a line equal to `quiet_from` on, to `console` only); return its exit code and the JobReturn it left
        (None: it died first, or left a torn file)."""
        spec, result = console.with_name("job.pkl"), console.with_name(RESULT_NAME)
        result.unlink(missing_ok=True)
        spec.write_bytes(cloudpickle.dumps((self.hydra_context, self.task_function, job, state)))
        command = cmd(spec)
        with console.open("w") as out:
            out.write(" ".join(command) + "\n")
            out.flush()
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    **popen)
            assert proc.stdout is not None
            echo = True
            for line in proc.stdout:
                echo = echo and line.rstrip("\n") != quiet_from
                if echo:
                    sys.stdout.write(line)
                out.write(line)
            rc = proc.wait()
        try:
            return rc, cloudpickle.loads(result.read_bytes())
        except Exception:  # missing, torn or foreign: the job counts as failed, with its output
            return rc, None

    def failed(self, job: SweepJob, ret: JobReturn | None, message: str) -> JobReturn:
        """The job's JobReturn marked failed with one line; Hydra's on_job_end runs here if the job died first."""
        assert self.hydra_context is not None
        failed = ret or JobReturn(overrides=job.overrides, working_dir=str(job.dir), cfg=job.config)
        failed.status = JobStatus.FAILED
        failed.return_value = JobFailed(message)
        if ret is None:
            self.hydra_context.callbacks.on_job_end(config=job.config, job_return=failed)
        return failed


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn for a job's child process: SIGTERM it when this process dies, however it dies (a SIGKILL
    included), so that no job trains on, holding its run directory, after its launcher is gone; the child then
    stops as on any SIGTERM. It also stops at once if this process died before the child got that far. None where
    the kernel has no PR_SET_PDEATHSIG (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    parent, libc = os.getpid(), ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


@dataclass(frozen=True)
class JobShape:
    """How a launcher starts one job: ranks per node (a number, or a word torchrun takes) and restarts."""

    ranks_per_node: Any
    max_restarts: int


# The launchers' settings a trainflow job sets in its own config, by the launcher's key.
TRAINFLOW_KEYS = {"nproc_per_node": "parallelism.nproc_per_node", "tasks_per_node": "parallelism.nproc_per_node",
                  "max_restarts": "parallelism.max_restarts"}


def job_shape(job: SweepJob, ranks_key: str, settings: dict[str, Any], gpus: Callable[[], int]) -> JobShape:
    """A trainflow job's shape is its own config's: parallelism.nproc_per_node (auto decided by `local_ranks` with
    `gpus()` GPUs per node) and parallelism.max_restarts. Any other Hydra app's is the launcher's own `settings` (by
    key: `ranks_key` and max_restarts where the launcher has it; null: 1 rank, no restart). One knob each: a
    trainflow job given the launcher's setting too is refused in one line naming the key to set instead. A job
    whose shape cannot be made fails the sweep; any other bad value fails only its job, which says why itself."""
    if not trainflow_job(job):
        ranks = settings[ranks_key]
        return JobShape(1 if ranks is None else ranks, settings.get("max_restarts") or 0)
    from trainflow.config.checks import check_launch  # lazy: loads torch, and only a trainflow job's shape is typed
    from trainflow.config.schema import ParallelismConfig, typed  # lazy: as check_launch
    from trainflow.distributed.mesh import local_ranks  # lazy: as check_launch

    for key, value in settings.items():
        if value is not None:
            user_error(f"hydra.launcher.{key}: is for Hydra apps other than trainflow, and job #{job.num} is a "
                       f"trainflow run, which sets its own: drop hydra.launcher.{key} and set {TRAINFLOW_KEYS[key]}")
    with as_job(job) as task:
        try:
            p = typed(OmegaConf.to_container(task.parallelism, resolve=True), ParallelismConfig, "parallelism")
            check_launch(p)
        except TrainflowError as exc:
            user_error(str(exc))
    return JobShape(local_ranks(p.strategy, p.nproc_per_node, gpus()), p.max_restarts)


def trainflow_job(job: SweepJob) -> bool:
    """Whether `job` is a trainflow run: its config holds trainflow's typed parallelism section."""
    section = OmegaConf.select(job.config, "parallelism", default=None)
    kind = OmegaConf.get_type(section) if isinstance(section, DictConfig) else None
    return kind is not None and f"{kind.__module__}.{kind.__qualname__}" == TRAINFLOW_PARALLELISM


def log_outcome(name: str, ret: JobReturn, where: Path) -> None:
    log.info("\t%s %s in %s%s", name, ret.status.name, where,
             f": {ret._return_value}" if ret.status == JobStatus.FAILED else "")


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
    """Refuses `hydra/launcher=torchrun|slurm|ray|kubernetes` without `-m`: Hydra would silently train here in one
    process."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = OmegaConf.select(config, "hydra.launcher._target_", default="")
        from hydra_plugins.trainflow_launchers.config import (
            KubernetesLauncherConf,
            RayLauncherConf,
            SlurmLauncherConf,
            TorchrunLauncherConf,
        )

        for conf, name in ((RayLauncherConf, "ray"), (KubernetesLauncherConf, "kubernetes")):
            if target == conf._target_:
                user_error(f"hydra/launcher={name}: the {name} launcher runs sweeps, and this is a single run; add -m "
                           f"(python train.py -m hydra/launcher={name} ...) to run it as a one-job sweep")
        if target == SlurmLauncherConf._target_:
            user_error("hydra/launcher=slurm: the SLURM launcher submits sweeps, and this is a single run; "
                       f"add -m ({typed_command()} -m hydra/launcher=slurm ...) to submit it as a one-job sweep")
        if target == TorchrunLauncherConf._target_:
            user_error("hydra/launcher=torchrun: the torchrun launcher runs sweeps, and this is a single run; "
                       f"add -m ({typed_command()} -m hydra/launcher=torchrun ...) to run it as a one-job sweep")
