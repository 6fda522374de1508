"""The stage interface: what the loop asks of compile, profile, checkpoint, the parity check, evaluation, the
non-finite guard and the train metrics, each by the same names.

The loop knows stages only as a list. After every optimizer step it calls `after_step(state)` on the enabled
ones (a stage that is off is never called: it costs nothing per step); the throughput meter leaves out of the
steady state the first steps the stages ask for (`excluded_steps()`) and the time they paused the clock
(`take_paused_s()`); at the end each stage is closed and gives its part of summary.json under `summary_key`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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


class Stage(Protocol):
    """The calls every stage answers. A stage subclasses it for the defaults and overrides what it does; the
    checkpointer, which stages.py imports (for TrainState), answers them without subclassing."""

    enabled: bool = True  # False: the loop never calls after_step and never enters the stage
    summary_key: str | None = None  # its part of summary.json (None: the stage reports inside another part)

    def excluded_steps(self) -> int:
        """The first steps of the run (counted from its start) to leave out of the steady-state figures."""
        return 0

    def after_step(self, state: LoopState) -> bool:
        """Work after an optimizer step; True stops the run now (after the remaining stages of this step)."""
        return False

    def take_paused_s(self) -> float:
        """Seconds of non-training work since the last call (evaluation, a save): not training time."""
        return 0.0

    def __enter__(self) -> Stage:
        """Entered (enabled stages only) before the first step."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Left after the last step, also when the loop raises."""

    def close(self, state: TrainState) -> None:
        """After the loop, on a normal end: finish what is pending (a final save, open files)."""

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        """This stage's part of summary.json; every stage is asked, enabled or not (some gather from all ranks)."""
        return None
