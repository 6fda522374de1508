"""Evaluation: the task's validation loss and metrics at `trainer.eval_every` steps and at the end of the run."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

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


class Evaluation(Stage):
    """Evaluates every trainer.eval_interval() steps (0: only at the end) and at the last step; its time is not
    training time."""

    phase = Phase.REPORT
    summary_key = "validation"

    def __init__(self, trainer: TrainerConfig, env: DistEnv, data: DataBundle, autocast: Any, task: Task,
                 writer: MetricsWriter) -> None:
        self.trainer, self.env, self.data, self.autocast = trainer, env, data, autocast
        self.every = trainer.eval_interval()
        self.task, self.writer = task, writer
        self.enabled = data.val is not None  # a data factory may give no validation set
        self.result: dict[str, float] | None = None  # the latest evaluation
        self._paused_s = 0.0

    @classmethod
    def build(cls, ctx: StageContext) -> Evaluation:
        return cls(ctx.trainer, ctx.env, ctx.data, ctx.autocast, ctx.task, ctx.writer)

    def after_step(self, state: LoopState) -> bool:
        if not (state.done or (self.every and state.step % self.every == 0)):
            return False
        device_sync(self.env.device)  # the steps still queued on the device are training, not the pause
        start = time.perf_counter()
        with doing(Activity.EVALUATING):  # no step for a while, and no hang: the watchdog waits it out
            self.result = evaluate(state.model, self.data.val, self.task, self.trainer, self.env, self.autocast)
        state.validation = Validation(state.step, self.result)  # early stopping, the EMA's evaluation read it
        self.writer.write(state.step, {f"val/{k}": v for k, v in self.result.items()})
        if self.env.is_main:
            log.info("step %d: val %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in self.result.items()))
        state.model.train()
        self._paused_s += time.perf_counter() - start
        return False

    def take_paused_s(self) -> float:
        paused, self._paused_s = self._paused_s, 0.0
        return paused

    def summary(self, steady: dict[str, Any] | None) -> dict[str, float] | None:
        return self.result


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, task: Task, trainer: TrainerConfig, env: DistEnv,
             autocast) -> dict[str, float]:
    """The task's loss and metrics, means over the same held-out batches every time (rank-strided, in order)."""
    model.eval()
    pipeline = pipeline_of(model)
    sampler = StreamSampler(len(dataset), trainer.batch_size, env.dp_rank, env.dp_size, seed=0, shuffle=False)
    totals: dict[str, torch.Tensor] = {}
    for _, indices in zip(range(trainer.eval_steps), sampler, strict=False):
        batch = to_device(dataset[indices], env.device)
        with autocast, loss_context(model):
            loss, metrics = pipeline.evaluate(batch) if pipeline else task(model, batch)
        add_metrics(totals, {"loss": local_loss(loss), **metrics})
    names = list(totals)
    means = all_reduce_mean(torch.stack([totals[n] for n in names]) / trainer.eval_steps, env).tolist()
    return task.finish(dict(zip(names, means, strict=True)))
