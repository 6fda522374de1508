"""Process-level behaviour of the entry points: user errors become one line and a non-zero exit."""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig

from trainflow.errors import TrainflowError

EXIT_USER_ERROR = 2


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Run one training job for `train.py`; return the final validation loss (what sweepers optimise)."""
    from trainflow.run import run

    try:
        summary = run(cfg)
    except TrainflowError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    return summary["val"]["loss"] if summary and summary.get("val") else None
