"""The SLURM launcher in tests: a sweep submitted to the local cluster as users type it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.processes import run_process

ROOT = Path(__file__).resolve().parents[2]

SLURM = ["hydra/launcher=slurm", "hydra.launcher.poll_interval_s=0.5"]


def sweep_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PYTHONUNBUFFERED": "1"}


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    return run_process([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=ROOT, env=env or sweep_env(), capture_output=True, text=True, timeout=timeout)
