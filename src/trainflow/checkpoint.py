"""torch.distributed.checkpoint of the whole training state: committed or absent, resumable anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from trainflow.distributed import DistEnv


@dataclass
class TrainState:
    """Everything a resumed run needs to continue as if it had never stopped."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    samples_seen: int = 0  # position in the global sample stream (see data.py)


class Checkpointer:
    """Saves and restores TrainState when `checkpoint.enabled`; a no-op otherwise."""

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path) -> None:
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir

    def resume(self, state: TrainState) -> None:
        """Restore the newest committed checkpoint into `state`, if there is one and resuming is on."""

    def after_step(self, state: TrainState) -> bool:
        """Save when due; return True when the run must stop now (a stop signal was handled)."""
        return False

    def close(self, state: TrainState) -> None:
        """Final save if asked for; wait for every pending save."""

    def summary(self) -> dict[str, Any] | None:
        return None
