"""torch.compile applied on purpose, with a report of what it did (graphs, breaks, recompiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from trainflow.distributed import DistEnv


class Compiler:
    """Compiles the model when `compile.enabled`; reports after the warm-up steps."""

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path) -> None:
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def excluded_steps(self) -> int:
        """Steps that compile and must stay out of the steady-state figures (beyond trainer.warmup_steps)."""
        return 0

    def on_step_end(self, step: int, step_time_s: float) -> None:
        """Called after each step with its synced wall time while `excluded_steps` are running."""

    def summary(self) -> dict[str, Any] | None:
        return None
