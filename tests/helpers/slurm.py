"""The SLURM launcher in tests: a sweep submitted to the local cluster as users type it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers.processes import run_process
from trainflow.data.synthetic import SyntheticTokens

ROOT = Path(__file__).resolve().parents[2]

SLURM = ["hydra/launcher=slurm", "hydra.launcher.poll_interval_s=0.5"]


def sweep_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PYTHONUNBUFFERED": "1"}


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    return run_process([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=ROOT, env=env or sweep_env(), capture_output=True, text=True, timeout=timeout)


class FirstAttemptSlow(torch.utils.data.Dataset):
    """Items read TEST_FIRST_ATTEMPT_ITEM_S seconds slower in a SLURM job's first attempt: still training when SLURM's
    notice before the time limit comes; the requeued attempt (SLURM_RESTART_COUNT >= 1) reads at full speed and
    finishes before its own notice. The same items either way, so the losses are an uninterrupted run's."""

    def __init__(self, inner: SyntheticTokens, slow: bool = True) -> None:
        self.inner = inner
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        self.sleep_s = float(os.environ.get("TEST_FIRST_ATTEMPT_ITEM_S", "0")) if first and slow else 0.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        inputs, targets = self.inner[torch.tensor([index])]
        return inputs[0], targets[0]


def first_attempt_slow(num_samples: int, seq_len: int, data_seed: int, vocab_size: int = 256
                       ) -> tuple[FirstAttemptSlow, FirstAttemptSlow]:
    """data=synthetic's random tokens (for a byte-level GPT) as a user's items; training reads them slowly in a
    job's first attempt."""
    make = lambda n, seed: SyntheticTokens(n, vocab_size, seq_len, seed)  # noqa: E731
    return FirstAttemptSlow(make(num_samples, data_seed)), FirstAttemptSlow(make(1024, data_seed + 1), slow=False)
