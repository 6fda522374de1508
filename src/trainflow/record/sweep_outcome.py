"""A sweep job's outcome as Hydra's sweepers read it: its failure in one line, the value a finished job returns,
the line that says a job was skipped.

Torch-free, like what it imports: trainflow's launchers use it for the jobs of any Hydra app, and Hydra's plugin
scan imports them at the start of every Hydra app (trainflow.record.sweeps, which checks trainflow's configs, loads
torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from trainflow.errors import TrainflowError

FRESH = "for a fresh sweep, give it another trainer.sweep_name=<name> (or hydra.sweep.dir=<folder>)"


class JobFailed(TrainflowError, CompactHydraException):
    """A job of a sweep failed. Hydra prints it as one line (its traceback lives in the job's logs); under Hydra's
    own launcher, which runs every job in one process, it fails that job and not the sweep."""


def skip_line(num: Any, job_dir: Path, summary: dict[str, Any]) -> str:
    return (f"sweep: job #{num} finished already in {job_dir} (step {summary.get('steps')}, same config): skipped, "
            f"its results kept; {FRESH}")


def monitor_value(summary: dict[str, Any]) -> Any:
    """What train.py returns to sweepers for a finished job: the final value of task.monitor."""
    val, task = summary.get("validation") or {}, summary.get("task") or {}
    return val.get(task.get("monitor")) if val else None
