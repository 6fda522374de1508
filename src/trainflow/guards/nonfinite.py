"""Non-finite losses and gradient norms: stop before they reach a checkpoint, or skip the steps that have them.

`trainer.nonfinite=stop` (the default) costs no host sync of its own: each step's loss and gradient norm stay on
the device, in a list, until the loop syncs anyway (the first step, every log step, before a checkpoint save);
then they are read in one go and the first non-finite one stops the run, naming its step. Parameters a
non-finite update damaged are therefore never saved: the check comes before any save at that step.

`trainer.nonfinite=skip_step` must know before `optimizer.step()` whether the gradients are finite: one host
sync per step (on a GPU this costs the overlap of the next step's launch). A step whose gradient norm is not
finite is not applied (its gradients are dropped); a run that skips MAX_SKIPS_IN_A_ROW steps in a row has
diverged and stops.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from trainflow.checkpoint.store import list_committed, resolve_dir
from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import all_reduce_mean
from trainflow.errors import NonFiniteError
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState

log = logging.getLogger("trainflow")

MAX_SKIPS_IN_A_ROW = 10  # skip_step: this many non-finite steps in a row is divergence, not a glitch
_LISTED_SKIPS = 100  # skipped steps listed in summary.json (the count covers them all)


def _local(value: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly FSDP DTensor) gradient norm, detached."""
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()


class NonFiniteGuard(Stage):
    """What the loop does about non-finite values, as `trainer.nonfinite` says.

    `stop`: keeps every step's loss and checks where the loop syncs anyway (the first step, log steps, before a
    checkpoint is saved: `state.sync_due`); `skip_step` acts inside the step instead (`keeps_update`). The newest
    committed checkpoint in `checkpoint_dir` (the run's resume point) goes into the message.
    """

    phase = Phase.GUARD
    summary_key = "nonfinite"

    def __init__(self, mode: str, env: DistEnv, checkpoint_dir: Path | None = None) -> None:
        self.mode = mode
        self.skips = mode == "skip_step"
        self.env = env
        self.checkpoint_dir = checkpoint_dir  # None: checkpoints are off
        self._first_step = 0  # the losses noted since the last check are those of the steps from here on
        self._losses: list[torch.Tensor] = []  # on the device
        self._norms: dict[int, torch.Tensor] = {}  # of the steps that measured one
        self.skipped: list[int] = []
        self._skipped_count = 0
        self._in_a_row: list[int] = []

    @classmethod
    def build(cls, ctx: StageContext) -> NonFiniteGuard:
        checkpoint = ctx.cfg.checkpoint
        folder = resolve_dir(checkpoint.dir, ctx.run_dir) if checkpoint.enabled else None
        return cls(ctx.cfg.trainer.nonfinite, ctx.env, folder)

    # -- stop ----------------------------------------------------------------------------------------------------

    def after_step(self, state: LoopState) -> bool:
        """Keep the step's loss (and gradient norm, when the step measured one) on the device; check at a sync
        point, so nothing non-finite is logged as progress or saved."""
        if self.skips:
            return False
        if not self._losses:
            self._first_step = state.step
        self._losses.append(state.step_loss)
        if state.grad_norm is not None:
            self._norms[state.step] = state.grad_norm
        if state.sync_due:
            self.check()
        return False

    def check(self) -> None:
        """At a sync point, on every rank: raise NonFiniteError naming the first step whose loss (the mean over
        ranks) or gradient norm is not finite."""
        if not self._losses:
            return
        steps = range(self._first_step, self._first_step + len(self._losses))
        norm_steps = list(self._norms)
        losses = all_reduce_mean(torch.stack(self._losses).float(), self.env)  # a NaN on any rank makes it NaN
        norms = [_local(n).float().reshape(1).to(losses.device) for n in self._norms.values()]
        values = torch.cat([losses, *norms]).tolist()  # the one host read
        self._losses, self._norms = [], {}
        if all(map(math.isfinite, values)):  # the usual case: no step to name
            return
        loss_at = dict(zip(steps, values[:len(steps)], strict=True))
        norm_at = dict(zip(norm_steps, values[len(steps):], strict=True))
        for step in steps:
            loss, norm = loss_at[step], norm_at.get(step)
            if not math.isfinite(loss):
                what = f"the loss at step {step} is {loss}" + (f" (gradient norm {norm})" if norm is not None else "")
            elif norm is not None and not math.isfinite(norm):
                what = f"the gradient norm at step {step} is {norm} (loss {loss:.4g})"
            else:
                continue
            raise NonFiniteError(f"trainer.nonfinite: {what}; lower optim.lr, check the data, or set "
                                 f"trainer.nonfinite=skip_step to skip such steps; {self._saved()}")

    # -- skip_step -----------------------------------------------------------------------------------------------

    def wants_grad_norm(self, step: int) -> bool:
        return self.skips

    def keeps_update(self, step: int, grad_norm: torch.Tensor | None) -> bool:
        """skip_step: whether this step's update is kept (its gradient norm is finite).

        The norm is the same on every rank (taken after the gradients were reduced), so every rank decides alike.
        """
        if not self.skips:
            return True
        norm = float(_local(grad_norm))  # the host sync skip_step costs
        if math.isfinite(norm):
            self._in_a_row = []
            return True
        self._in_a_row.append(step)
        if len(self._in_a_row) >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(
                f"trainer.nonfinite: skip_step met {len(self._in_a_row)} steps in a row with a non-finite gradient "
                f"norm (steps {self._in_a_row[0]}-{step}; it stops at K={MAX_SKIPS_IN_A_ROW}): the run diverged; "
                f"lower optim.lr or check the data; {self._saved()}")
        self._skipped_count += 1
        if len(self.skipped) < _LISTED_SKIPS:
            self.skipped.append(step)
        if self.env.is_main:
            log.warning("step %d: the gradient norm is %s: update skipped (trainer.nonfinite=skip_step; %d skipped "
                        "so far)", step, norm, self._skipped_count)
        return False

    # -- reporting -----------------------------------------------------------------------------------------------

    def _saved(self) -> str:
        committed = list_committed(self.checkpoint_dir) if self.checkpoint_dir else []
        if not committed:
            return "no checkpoint holds this state"
        return f"no checkpoint holds this state (newest committed: {committed[-1].path.name})"

    def summary(self, steady: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"mode": self.mode, "skipped_steps": self._skipped_count, "skipped_at": self.skipped}
