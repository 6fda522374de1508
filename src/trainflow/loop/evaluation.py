"""Evaluation: the task's validation loss and metrics at `trainer.eval_every` steps and at the end of the run."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainflow.config.choices import Auto
from trainflow.config.schema import TrainerConfig
from trainflow.data import DataBundle, StreamSampler, to_device
from trainflow.distributed import DistEnv
from trainflow.distributed.parallelism import local_loss, loss_context
from trainflow.distributed.pipeline import pipeline_of
from trainflow.distributed.process_group import all_reduce_mean
from trainflow.loggers.writer import MetricsWriter
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState, Validation
from trainflow.tasks import Task, add_metrics
from trainflow.util.activity import Activity, doing
from trainflow.util.device import device_sync

log = logging.getLogger("trainflow")


# trainer.eval_every=auto keeps evaluation within this share of the run's wall time (the final one comes on top)
EVAL_SHARE = 0.10


class Evaluation(Stage):
    """Evaluates every trainer.eval_interval() steps (0: only at the end) and at the last step; its time is not
    training time.

    With trainer.eval_every=auto those steps are candidates: one is evaluated only while the evaluations so far,
    and one more of the last one's measured cost, stay within EVAL_SHARE of the run's wall time so far (the first
    candidate measures that cost). A validation curve for a run whose evaluation is cheap, a few points for one
    whose evaluation is dear; every rank decides alike (rank 0's clock decides)."""

    phase = Phase.REPORT
    # after the train metrics: they time the log interval before this stage's pause is left out of the clocks (the
    # meter takes it after the step's stages), and the step's train line comes before its validation line
    after = ("train_metrics",)
    summary_key = "validation"

    def __init__(self, settings: TrainerConfig, env: DistEnv, data: DataBundle, autocast: Any, task: Task,
                 writer: MetricsWriter) -> None:
        self.settings, self.env, self.data, self.autocast = settings, env, data, autocast  # the trainer section
        self.every = settings.eval_interval()
        self.budgeted = settings.eval_every == Auto.auto
        self.task, self.writer = task, writer
        self.enabled = data.val is not None  # a data factory may give no validation set
        self.result: dict[str, float] | None = None  # the latest evaluation
        self._paused_s = 0.0
        self._started = time.perf_counter()
        self._spent_s = 0.0  # every evaluation of this run so far
        self._last_s: float | None = None  # the latest evaluation's cost; None: none measured yet
        self.skipped = 0  # candidate steps of eval_every=auto left out to keep within EVAL_SHARE

    @classmethod
    def build(cls, ctx: StageContext) -> Evaluation:
        return cls(ctx.cfg.trainer, ctx.env, ctx.data, ctx.autocast, ctx.task, ctx.writer)

    def start(self, state: LoopState) -> None:
        self._started = time.perf_counter()

    def after_step(self, state: LoopState) -> bool:
        if not (state.done or (self.every and state.step % self.every == 0 and self._within_budget())):
            return False
        device_sync(self.env.device)  # the steps still queued on the device are training, not the pause
        start = time.perf_counter()
        with doing(Activity.EVALUATING):  # no step for a while, and no hang: the watchdog waits it out
            self.result = evaluate(state.model, self.data.val, self.task, self.settings, self.env, self.autocast)
        state.validation = Validation(state.step, self.result)  # early stopping, the EMA's evaluation read it
        self.writer.write(state.step, {f"val/{k}": v for k, v in self.result.items()})
        if self.env.is_main:
            log.info("step %d: val %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in self.result.items()))
        state.model.train()
        self._last_s = time.perf_counter() - start
        self._spent_s += self._last_s
        self._paused_s += self._last_s
        return False

    def _within_budget(self) -> bool:
        """Whether an evaluation now keeps eval_every=auto within EVAL_SHARE of the wall time (always, for a number
        of steps the user chose)."""
        if not self.budgeted or self._last_s is None:
            return True
        elapsed = time.perf_counter() - self._started
        fits = self._spent_s + self._last_s <= EVAL_SHARE * (elapsed + self._last_s)
        decided = torch.tensor([float(fits and self.env.rank == 0)], device=self.env.device)
        within = bool(all_reduce_mean(decided, self.env).item() > 0)  # rank 0's answer, on every rank
        self.skipped += not within
        return within

    def close(self, state: LoopState) -> None:
        if self.skipped and self.env.is_main:
            log.info("evaluation: %d of the validation points of trainer.eval_every=auto left out, to keep "
                     "evaluation within %d%% of the run's time; trainer.eval_every=%d evaluates at every one",
                     self.skipped, EVAL_SHARE * 100, self.every)

    def take_paused_s(self) -> float:
        paused, self._paused_s = self._paused_s, 0.0
        return paused

    def summary(self, steady: dict[str, Any] | None) -> dict[str, float] | None:
        return self.result


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, task: Task, settings: TrainerConfig, env: DistEnv,
             autocast) -> dict[str, float]:
    """The task's loss and metrics, means over the same held-out batches every time (rank-strided, in order)."""
    model.eval()
    pipeline = pipeline_of(model)
    sampler = StreamSampler(len(dataset), settings.batch_size, env.dp_rank, env.dp_size, seed=0, shuffle=False)
    totals: dict[str, torch.Tensor] = {}
    for _, indices in zip(range(settings.eval_steps), sampler, strict=False):
        batch = to_device(dataset[indices], env.device)
        with autocast, loss_context(model):
            loss, metrics = pipeline.evaluate(batch) if pipeline else task(model, batch)
        add_metrics(totals, {"loss": local_loss(loss), **metrics})
    names = list(totals)
    means = all_reduce_mean(torch.stack([totals[n] for n in names]) / settings.eval_steps, env).tolist()
    return task.finish(dict(zip(names, means, strict=True)))
