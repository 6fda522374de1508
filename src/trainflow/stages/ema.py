"""An exponential moving average of the weights (`stages=[ema]`): after each optimizer step that applied its update,
every `every` steps from step `start`, `ema = decay * ema + (1 - decay) * weight`, one foreach op over the (possibly
sharded) parameters; before `start` the average is the weights themselves.

The average lives beside the parameters, sharded as they are, and goes into every checkpoint (its tensors under
`stages.ema.weights.<parameter>`), so a resumed run's average is the uninterrupted run's, bit for bit.
`evaluate: true` evaluates it whenever the run evaluates (`val/ema_<figure>`, e.g. val/ema_loss);
`trainflow export <checkpoint> <out> --ema` writes it in place of the trained weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainflow.distributed.parallelism import unwrap
from trainflow.loop.evaluation import evaluate
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.util.activity import Activity, doing
from trainflow.util.device import device_sync


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shard of each tensor (itself when not sharded): the foreach ops' operands."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


class EMA(Stage):
    """The average of the weights, updated after the optimizer steps, saved and resumed with the run."""

    phase = Phase.CONFIGURED
    after = ("nonfinite",)  # a step the guard dropped applied no update: nothing to average
    before = ("checkpoint",)  # each save holds the average of its step
    summary_key = "ema"

    def __init__(self, decay: float = 0.999, every: int = 1, start: int = 0, evaluate: bool = False) -> None:
        if not 0.0 <= decay < 1.0 or every < 1 or start < 0:
            raise ValueError(f"decay must be in [0, 1), every at least 1 and start at least 0; got {decay}, {every}, "
                             f"{start}")
        self.decay, self.every, self.start_step, self.evaluates = decay, every, start, evaluate
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.average: list[torch.Tensor] = []
        self.updates = 0
        self.result: dict[str, float] | None = None
        self._paused_s = 0.0
        self._ctx: StageContext | None = None

    def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The parameters as they are trained (sharded by the parallelism); the average starts as their copy."""
        named = list(unwrap(model).named_parameters(remove_duplicate=False))  # a tied weight under each name
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]
        return model

    def after_step(self, state: LoopState) -> bool:
        if not state.skipped:
            self._update(state.step)
        validation = state.validation
        if self.evaluates and validation is not None and validation.step == state.step:
            self._evaluate(state)
        return False

    @torch.no_grad()
    def _update(self, step: int) -> None:
        if step < self.start_step:
            torch._foreach_copy_(_local(self.average), _local(self.params))
        elif (step - self.start_step) % self.every == 0:
            torch._foreach_lerp_(_local(self.average), _local(self.params), 1.0 - self.decay)
            self.updates += 1

    def _evaluate(self, state: LoopState) -> None:
        """Validation with the average in place of the weights (then the weights again, exactly)."""
        ctx = self._ctx
        device_sync(ctx.env.device)
        start = time.perf_counter()
        with torch.no_grad(), doing(Activity.EVALUATING):
            weights = [p.detach().clone() for p in _local(self.params)]
            torch._foreach_copy_(_local(self.params), _local(self.average))
            try:
                figures = evaluate(state.model, ctx.data.val, ctx.task, ctx.cfg.trainer, ctx.env, ctx.autocast)
            finally:
                torch._foreach_copy_(_local(self.params), weights)
        state.model.train()
        self.result = figures
        ctx.writer.write(state.step, {f"val/ema_{k}": v for k, v in figures.items()})
        self._paused_s += time.perf_counter() - start

    def take_paused_s(self) -> float:
        paused, self._paused_s = self._paused_s, 0.0
        return paused

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(zip(self.names, self.average, strict=True)), "updates": self.updates}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        with torch.no_grad():
            loaded = [saved["weights"][name] for name in self.names]
            torch._foreach_copy_(_local(self.average), _local(loaded))
        self.updates = int(saved["updates"])

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any]:
        return {"decay": self.decay, "every": self.every, "start": self.start_step, "updates": self.updates,
                "validation": self.result}
