"""`hydra/launcher=process`: every job of a sweep in a fresh Python process, one after the other.

Hydra's basic launcher runs every job inside the sweep's own process. Whatever
one job leaves behind (dynamo's compiled code and counters, inductor's worker
pools, CUDA state) reaches the next, and a job that exits (trainflow's user
errors exit 2) ends the whole sweep before any report is written. Here each job
is `python -m hydra_plugins.trainflow_launchers._worker JOB.pkl`: nothing is
shared but the files, a failed job is recorded as failed with the line that
says why, and the sweep goes on; Hydra reports the first failure once every job
ran. ddp/fsdp jobs start their own workers from there, as `python train.py` does.
A job's process gets SIGTERM when the sweep's process dies, even by SIGKILL: it
saves at its next step boundary and stops, and the same sweep command resumes it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.trainflow_launchers.common import (
    SweepJob,
    SweepLauncher,
    die_with_parent,
    failure_reason,
    read_text,
)

log = logging.getLogger(__name__)

JOB_FOLDER = ".process"  # inside each job's directory: the pickled job, its result and its console output


class ProcessLauncher(SweepLauncher):
    def __init__(self, **_params: Any) -> None:
        super().__init__()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = self.compose(job_overrides, initial_job_idx)
        log.info("Launching %d jobs, each in a fresh process", len(jobs))
        return self.run_in_turn(jobs, self._run)

    def _run(self, job: SweepJob, state: Any) -> JobReturn:
        folder = job.dir / JOB_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        console = folder / "console.log"
        rc, ret = self.run_child(job, state, _worker_command, console, preexec_fn=die_with_parent())
        if rc == 0 and ret is not None:
            return ret
        reason = (str(ret._return_value) if ret is not None and ret.status == JobStatus.FAILED else None) \
            or failure_reason(read_text(console)) or "see its output"
        return self.failed(job, ret, f"job #{job.num} failed (exit code {rc}): {reason} [output: {console}]")


def _worker_command(spec: Path) -> list[str]:
    return [sys.executable, "-m", "hydra_plugins.trainflow_launchers._worker", str(spec)]
