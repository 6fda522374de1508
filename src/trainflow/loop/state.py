"""The loop state: what the training step leaves for the stages, and the one way stages tell each other things."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainflow.checkpoint import TrainState


@dataclass
class LoopState(TrainState):
    """The checkpointed TrainState plus what the last step left for the stages (not saved)."""

    loss: torch.Tensor | None = None  # this rank's last micro-step loss, on the device
    step_loss: torch.Tensor | None = None  # this rank's loss of the whole step (micro-steps summed), on the device
    grad_norm: torch.Tensor | None = None  # None: the step measured no norm (no clipping, not a log step)
    samples: int = 0  # samples of this rank's micro-batches of the step, counted by the task
    tokens: int = 0  # tokens of this rank's micro-batches of the step, counted by the task
    metrics: dict[str, torch.Tensor] | None = None  # the task's metrics of the step, summed over micro-steps
    data_wait_s: float = 0.0  # seconds the step waited for its batches
    skipped: bool = False  # trainer.nonfinite=skip_step left the update out
    steps_this_run: int = 0
    log_due: bool = False  # a log step: the train metrics sync and are written
    done: bool = False  # the last step of the run
    step_time_s: float | None = None  # the synced wall time of the step, while excluded steps run; else None
    save_every: int = 0  # the checkpointer saves after every this many steps (0: no periodic saves)
    checkpoint_dir: Path | None = None  # where the committed checkpoints are (None: checkpoints are off)
    resumed_checkpoint: Path | None = None  # the committed checkpoint the run started from (None: a fresh start)
    rank_times: dict[str, float] | None = None  # log steps of 2+ ranks: the ranks' own step times (stragglers)
    straggler: dict[str, Any] | None = None  # the first rank named a straggler in this run (rank, host, ratio)
    # why a stage stopped the run (fault tolerance: no quorum): the checkpointer saves and stops as on a stop signal
    stop_reason: str | None = None

    def save_due(self) -> bool:
        """Whether a periodic checkpoint is saved after this step (the final save comes at a log step too)."""
        return self.save_every > 0 and self.step % self.save_every == 0
