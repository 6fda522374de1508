"""`hydra/launcher=process`: every job of a sweep in a fresh Python process, one after the other.

Hydra's basic launcher runs every job inside the sweep's own process. Whatever
one job leaves behind (dynamo's compiled code and counters, inductor's worker
pools, CUDA state) reaches the next, and a job that exits (trainflow's user
errors exit 2) ends the whole sweep before any report is written. Here each job
is `python -m hydra_plugins.trainflow_launchers._worker JOB.pkl`: nothing is
shared but the files, a failed job is recorded as failed with the line that
says why, and the sweep goes on; Hydra reports the first failure once every job
ran. ddp/fsdp jobs start their own workers from there, as `python train.py` does.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.trainflow_launchers._worker import RESULT_NAME
from hydra_plugins.trainflow_launchers.common import JobFailed, SweepJob, compose_jobs, failure_reason, read_text

log = logging.getLogger(__name__)

JOB_FOLDER = ".process"  # inside each job's directory: the pickled job, its result and its console output


class ProcessLauncher(Launcher):
    def __init__(self, **_params: Any) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = compose_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        log.info("Launching %d jobs, each in a fresh process", len(jobs))
        state = Singleton.get_state()
        results = []
        for job in jobs:
            log.info("\t%s", job.describe())
            ret = self._run(job, state)
            log.info("\t#%d %s in %s%s", job.num, ret.status.name, job.dir,
                     f": {ret._return_value}" if ret.status == JobStatus.FAILED else "")
            results.append(ret)
        return results

    def _run(self, job: SweepJob, state: Any) -> JobReturn:
        assert self.hydra_context is not None and self.task_function is not None
        folder = job.dir / JOB_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        spec, result, console = folder / "job.pkl", folder / RESULT_NAME, folder / "console.log"
        result.unlink(missing_ok=True)
        spec.write_bytes(cloudpickle.dumps((self.hydra_context, self.task_function, job, state)))
        cmd = [sys.executable, "-m", "hydra_plugins.trainflow_launchers._worker", str(spec)]
        with console.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            assert proc.stdout is not None
            for line in proc.stdout:  # the job's output: to the console and to console.log
                sys.stdout.write(line)
                out.write(line)
            rc = proc.wait()
        ret = _load(result) if result.exists() else None
        if rc == 0 and ret is not None:
            return ret
        reason = (str(ret._return_value) if ret is not None and ret.status == JobStatus.FAILED else None) \
            or failure_reason(read_text(console)) or "see its output"
        failed = ret or JobReturn(overrides=job.overrides, working_dir=str(job.dir), cfg=job.config)
        failed.status = JobStatus.FAILED
        failed.return_value = JobFailed(f"job #{job.num} failed (exit code {rc}): {reason} [output: {console}]")
        if ret is None:  # the job's process exited before Hydra's on_job_end ran there: run it here
            self.hydra_context.callbacks.on_job_end(config=job.config, job_return=failed)
        return failed


def _load(path: Path) -> JobReturn | None:
    try:
        return cloudpickle.loads(path.read_bytes())
    except Exception:  # a torn or foreign file: the job counts as failed, with its output
        return None
