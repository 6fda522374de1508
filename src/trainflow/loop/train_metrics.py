"""The train metrics stage: each log interval's loss, learning rate, gradient norm, speed and memory, written to
metrics.jsonl (and TensorBoard) and the progress line; the run's first and last loss for summary.json.

Between log steps nothing is read from the device: the step losses stay there, in a list, until the log step.
Beside the interval's mean step time (its wall time over its steps) goes the mean of its steady steps' device time,
the figure another process's load moves least (trainflow.loop.meter).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import all_reduce_mean
from trainflow.loggers.writer import MetricsWriter
from trainflow.loop.meter import Counts, Throughput
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.tasks import Task
from trainflow.util.console import progress_reporter


class TrainMetrics(Stage):
    """Sums each step into the log interval; at log steps syncs once, writes the interval's figures and starts
    the next interval."""

    phase = Phase.REPORT
    summary_key = "train_loss"

    def __init__(self, env: DistEnv, writer: MetricsWriter, task: Task, grad_accum: int,
                 flops_per_step: int | None, peak_flops: float | None, max_steps: int, progress_mode: str) -> None:
        self.env, self.writer = env, writer
        self.is_lm, self.grad_accum = task.is_lm, grad_accum
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.max_steps, self.progress_mode = max_steps, progress_mode
        self.first_loss: float | None = None  # the first step's loss, the mean over ranks
        self.last: dict[str, float] = {}  # the figures of the latest log interval
        self._state: LoopState | None = None  # its optimizer's learning rate is logged; its step starts the progress

    @classmethod
    def build(cls, ctx: StageContext) -> TrainMetrics:
        t = ctx.cfg.trainer
        return cls(ctx.env, ctx.writer, ctx.task, t.grad_accum, ctx.flops_per_step, ctx.peak_flops,
                   t.max_steps, t.progress)

    def start(self, state: LoopState) -> None:
        self._state = state
        self._new_interval(state.meter)
        self.progress = progress_reporter(self.max_steps, self.progress_mode, self.env.is_main, state.step)

    def _new_interval(self, meter: Throughput) -> None:
        self._step_losses: list[torch.Tensor] = []  # the applied steps' losses, on the device
        self._step_metrics: list[dict[str, torch.Tensor]] = []  # task metrics of the steps that computed them
        self._counts_at_start = meter.counts()  # steps, samples, tokens and data wait: the meter counts

    def after_step(self, state: LoopState) -> bool:
        if not state.skipped:
            self._step_losses.append(state.step_loss)
        if state.metrics:  # summed at the log step, like the losses: a sum each step would cost an op per metric
            self._step_metrics.append(state.metrics)
        if self.first_loss is None:
            self.first_loss = all_reduce_mean(state.loss.detach().clone(), self.env).item()  # all ranks' mean
        if state.log_due:
            self._write(state)
        return False

    def _write(self, state: LoopState) -> None:
        meter = state.meter
        elapsed = meter.interval_s()
        counts = meter.counts().since(self._counts_at_start)
        self.last = self._interval_figures(elapsed, counts, state.grad_norm, meter.memory.take())
        device = meter.single.take()  # the interval's steady steps (none while excluded steps run)
        if device:
            self.last["perf/step_time_device_s"] = sum(device) / len(device)
        self.last.update(state.figures)  # what stages before this one gathered at this log step (the ranks' times)
        self.writer.write(state.step, self.last)
        self.progress(state.step, self.last)
        self._new_interval(meter)
        meter.restart_interval()

    def _interval_figures(self, elapsed: float, counts: Counts, grad_norm: torch.Tensor,
                          memory_bytes: int) -> dict[str, float]:
        applied = len(self._step_losses)  # skip_step: the loss is the mean over the steps that were applied
        names = sorted({name for metrics in self._step_metrics for name in metrics})
        # the sums of the losses and of the task's metrics: one all-reduce (a mean over ranks), one host read
        sums = [torch.stack(self._step_losses).sum().float() if applied
                else torch.full((), math.nan, device=self.env.device)]
        sums += [torch.stack([m[name] for m in self._step_metrics if name in m]).sum() for name in names]  # fp32
        loss_sum, *metric_sums = all_reduce_mean(torch.stack(sums), self.env).tolist()
        loss = loss_sum / max(applied, 1)
        micro_batches = len(self._step_metrics) * self.grad_accum  # the metrics are means per micro-batch
        step_time = elapsed / counts.steps
        figures = {
            "train/loss": loss,
            "train/lr": self._state.optimizer.param_groups[0]["lr"],
            "train/grad_norm": float(grad_norm),
            "perf/step_time_s": step_time,
            "perf/samples_per_sec": counts.samples / elapsed,
            "perf/data_wait_fraction": counts.data_wait_s / elapsed,
            "perf/memory_bytes": memory_bytes,
        }
        if self.is_lm:
            figures["perf/tokens_per_sec"] = counts.tokens / elapsed
        if self.flops_per_step and self.peak_flops:
            figures["perf/mfu"] = self.flops_per_step / step_time / self.peak_flops
        figures.update({f"train/{name}": total / micro_batches
                        for name, total in zip(names, metric_sums, strict=True)})
        return figures

    def close(self, state: LoopState) -> None:
        self.progress(None, None)

    def summary(self, steady: dict[str, Any] | None) -> dict[str, float | None]:
        return {"first": self.first_loss, "last": self.last.get("train/loss")}  # last: the last interval's mean
