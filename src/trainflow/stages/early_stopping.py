"""Early stopping (`stages=[early_stopping]`): stop the run when the task's monitored validation figure has not
improved by more than `min_delta` for `patience` evaluations in a row.

It reads each evaluation from the loop state (`state.validation`, written by the evaluation stage) and the task's
`monitor` and `mode`. At each best evaluation it names that step the best (`state.best_step`): the checkpointer saves
it (when checkpoints are on) and retention never deletes it. It stops the run as finished, not as interrupted: the
loop ends, and the checkpointer's final save and export follow as at trainer.max_steps. Its count is in each
checkpoint, so a resumed run goes on counting; run again after it stopped, it trains on until `patience` more
evaluations bring no improvement.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from trainflow.checkpoint.store import resolve_dir
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState

log = logging.getLogger("trainflow")


class EarlyStopping(Stage):
    """Stops the run after `patience` evaluations without an improvement of more than `min_delta`."""

    phase = Phase.CONFIGURED
    after = ("evaluation",)  # it reads the evaluation of the step
    before = ("checkpoint",)  # the checkpointer saves the best step
    summary_key = "early_stopping"

    def __init__(self, patience: int = 3, min_delta: float = 0.0) -> None:
        if patience < 1 or min_delta < 0:
            raise ValueError(f"patience must be at least 1 and min_delta at least 0, got {patience} and {min_delta}")
        self.patience, self.min_delta = patience, min_delta
        self.monitor, self.mode = "loss", "min"
        self.best: float | None = None
        self.best_step: int | None = None
        self.without_improvement = 0  # evaluations since the best
        self.stopped_at: int | None = None
        self.reason: str | None = None
        self.checkpoint_dir: Path | None = None

    def setup(self, ctx: StageContext) -> None:
        self.monitor, self.mode = ctx.task.monitor, ctx.task.mode
        self.enabled = ctx.data.val is not None  # nothing to monitor without a validation set
        if ctx.cfg.checkpoint.enabled:
            self.checkpoint_dir = resolve_dir(ctx.cfg.checkpoint.dir, ctx.run_dir)

    def start(self, state: LoopState) -> None:
        state.best_step = self.best_step  # a resumed run keeps its best checkpoint

    def after_step(self, state: LoopState) -> bool:
        validation = state.validation
        if validation is None or validation.step != state.step:
            return False
        value = validation.figures.get(self.monitor)
        if value is None:
            raise KeyError(f"the evaluation reports no {self.monitor!r} (it reports {', '.join(validation.figures)})")
        if self._improves(value):
            self.best, self.best_step, self.without_improvement = value, state.step, 0
            state.best_step = state.step
            return False
        self.without_improvement += 1
        if self.without_improvement < self.patience or state.done:
            return False
        self.stopped_at = state.step
        self.reason = (f"val {self.monitor} did not improve by more than {self.min_delta:g} in {self.patience} "
                       f"evaluations (best {self.best:.6g} at step {self.best_step})")
        log.info("early stopping at step %d: %s", state.step, self.reason)
        return True

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "without_improvement": self.without_improvement}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.best, self.best_step = saved["best"], saved["best_step"]
        self.without_improvement = int(saved["without_improvement"])

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any]:
        best_checkpoint = None
        if self.checkpoint_dir is not None and self.best_step is not None:
            folder = self.checkpoint_dir / f"step_{self.best_step:08d}"
            best_checkpoint = str(folder) if folder.is_dir() else None
        return {"monitor": self.monitor, "mode": self.mode, "patience": self.patience, "min_delta": self.min_delta,
                "best": self.best, "best_step": self.best_step, "best_checkpoint": best_checkpoint,
                "stopped_at_step": self.stopped_at, "reason": self.reason}
