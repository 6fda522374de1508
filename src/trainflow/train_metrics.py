"""The train metrics stage: each log interval's loss, learning rate, gradient norm, speed and memory, written to
metrics.jsonl (and TensorBoard) and the progress line; the run's first and last loss for summary.json.

Between log steps nothing is read from the device: the step losses stay there, in a list, until the log step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import all_reduce_mean
from trainflow.metrics import MetricsWriter, Throughput
from trainflow.stages import LoopState, Stage
from trainflow.tasks import Task


class TrainMetrics(Stage):
    """Sums each step into the log interval; at log steps syncs once, writes the interval's figures and starts
    the next interval."""

    summary_key = "loss"

    def __init__(self, env: DistEnv, meter: Throughput, writer: MetricsWriter,
                 progress: Callable[[int | None, dict | None], None], optimizer: torch.optim.Optimizer,
                 task: Task, flops_per_step: int | None, peak_flops: float | None) -> None:
        self.env, self.meter, self.writer, self.progress, self.optimizer = env, meter, writer, progress, optimizer
        self.is_lm = task.is_lm
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.first_loss: float | None = None  # the first step's loss, the mean over ranks
        self.last: dict[str, float] = {}  # the figures of the latest log interval
        self._new_interval()

    def _new_interval(self) -> None:
        self._step_losses: list[torch.Tensor] = []  # the applied steps' losses, on the device
        self._steps = 0
        self._data_wait_s = 0.0
        self._samples = 0  # of this rank
        self._tokens = 0  # of this rank
        self._step_metrics: list[dict[str, torch.Tensor]] = []  # each step's task metrics, on the device
        self._micro_steps = 0

    def after_step(self, state: LoopState) -> bool:
        if not state.skipped:
            self._step_losses.append(state.step_loss)
        self._steps += 1
        self._data_wait_s += state.data_wait_s
        self._samples += state.samples
        self._tokens += state.tokens
        if state.metrics:  # summed at the log step, like the losses: a sum each step would cost an op per metric
            self._step_metrics.append(state.metrics)
            self._micro_steps += state.micro_steps
        if self.first_loss is None:
            self.first_loss = all_reduce_mean(state.loss.detach().clone(), self.env).item()  # all ranks' mean
        if state.log_due:
            self._write(state)
        return False

    def _write(self, state: LoopState) -> None:
        elapsed = self.meter.interval_s()
        self.last = self._interval_figures(elapsed, state.grad_norm, self.meter.memory.take())
        self.writer.write(state.step, self.last)
        self.progress(state.step, self.last)
        self._new_interval()
        self.meter.restart_interval()

    def _interval_figures(self, elapsed: float, grad_norm: torch.Tensor, memory_bytes: int) -> dict[str, float]:
        applied = len(self._step_losses)  # skip_step: the loss is the mean over the steps that were applied
        loss = all_reduce_mean(torch.stack(self._step_losses).sum() / applied, self.env).item() if applied \
            else math.nan
        step_time = elapsed / self._steps
        figures = {
            "train/loss": loss,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/grad_norm": float(grad_norm),
            "perf/step_time_s": step_time,
            "perf/samples_per_sec": self._samples * self.env.world_size / elapsed,
            "perf/data_wait_fraction": self._data_wait_s / elapsed,
            "perf/memory_bytes": memory_bytes,
        }
        if self.is_lm:
            figures["perf/tokens_per_sec"] = self._tokens * self.env.world_size / elapsed
        if self.flops_per_step and self.peak_flops:
            figures["perf/mfu"] = self.flops_per_step / step_time / self.peak_flops
        names = sorted({name for metrics in self._step_metrics for name in metrics})
        if names:  # one all-reduce for all of them
            sums = [torch.stack([m[n] for m in self._step_metrics if n in m]).sum() for n in names]
            means = torch.stack(sums) / self._micro_steps
            figures.update({f"train/{n}": v for n, v in
                            zip(names, all_reduce_mean(means, self.env).tolist(), strict=True)})
        return figures

    def close(self, state: LoopState) -> None:
        self.writer.close()
        self.progress(None, None)

    def summary(self, steady: dict[str, Any] | None) -> dict[str, float | None]:
        return {"first": self.first_loss, "last": self.last.get("train/loss")}  # last: the last interval's mean
