"""One optimizer step, and what it reads: the loop's (trainflow.loop.run) and the parity check's reference."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainflow.config.schema import TrainerConfig
from trainflow.data import to_device
from trainflow.distributed.parallelism import local_loss, no_grad_sync
from trainflow.loop.nonfinite import NonFiniteGuard
from trainflow.loop.state import LoopState
from trainflow.optim import gradient_norm
from trainflow.tasks import Task, add_metrics


@dataclass
class Training:
    """What `train_step` reads, as plain attributes: a DictConfig read costs tens of microseconds."""

    trainer: TrainerConfig
    state: LoopState  # the model, optimizer and scheduler, and what the step leaves for the stages
    task: Task
    batches: Iterator[Any]
    trainable: list[nn.Parameter]  # the model's parameters, listed once rather than walked every step
    autocast: Any
    name_part: Callable[[str], Any]  # names a part of the step for the profiler (a no-op when it is off)
    guard: NonFiniteGuard  # trainer.nonfinite=skip_step decides inside the step
    batch_device: torch.device | None  # where batches are moved (None: the loader's tensors are already there)
    pin: bool  # batches are pinned and copied asynchronously
    steps_schedule: bool  # False: a constant schedule without warm-up is not stepped
    metrics_every_step: bool  # task.train_metrics=every_step; else the task's metrics at log steps only
    global_batch: int
    commit: Callable[[], bool] | None = None  # torchft: False drops the update (a replica group lost in the step)
    loss_context: Callable[[], Any] = contextlib.nullcontext  # loss parallel under TP (distributed.parallelism)


def train_step(training: Training) -> None:
    """One optimizer step: the micro-batches' forward and backward, the gradient norm (clipping), the update."""
    trainer, state, name_part, task = training.trainer, training.state, training.name_part, training.task
    model = state.model
    state.log_due = (state.step + 1) % trainer.log_every == 0 or state.step + 1 >= trainer.max_steps
    with_metrics = state.log_due or training.metrics_every_step
    data_wait, samples, tokens = 0.0, 0, 0  # of this rank's micro-batches, counted by the task
    step_loss = None  # this rank's loss of the step, on the device
    step_metrics: dict[str, torch.Tensor] = {}  # the task's metrics summed over the micro-steps, on the device
    for micro in range(trainer.grad_accum):
        with name_part("trainflow/data"):
            start = time.perf_counter()
            batch = next(training.batches)
            data_wait += time.perf_counter() - start  # the copy below may wait for the GPU: not data
            if training.batch_device is not None:
                batch = to_device(batch, training.batch_device, non_blocking=training.pin)
            counted = task.count(batch)  # shapes only (data.seq_lens varies the tokens)
            samples, tokens = samples + counted[0], tokens + counted[1]
        with name_part("trainflow/forward_backward"), no_grad_sync(model, micro == trainer.grad_accum - 1), \
                training.loss_context():
            with training.autocast:
                loss, metrics = task(model, batch, with_metrics)
            loss = local_loss(loss)
            loss_share = loss / trainer.grad_accum if trainer.grad_accum > 1 else loss
            loss_share.backward()
        step_loss = loss_share.detach() if step_loss is None else step_loss + loss_share.detach()
        if with_metrics:  # a user's task computes its metrics every step: kept as task.train_metrics says
            add_metrics(step_metrics, metrics)
    guard = training.guard
    with name_part("trainflow/optimizer"):
        norm_due = trainer.grad_clip or state.log_due or guard.skips  # the norm is a pass over all gradients
        state.grad_norm = gradient_norm(training.trainable, trainer.grad_clip) if norm_due else None
        state.skipped = guard.skips and guard.skip_update(state.step + 1, state.grad_norm)
        if training.commit is not None and not training.commit():  # asked every step: the Manager counts them
            state.skipped = True
        if state.skipped:
            guard.drop_update(state.optimizer, state.scheduler)
        else:
            state.optimizer.step()
            if training.steps_schedule:
                state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen += training.global_batch
    state.steps_this_run += 1
    state.done = state.step >= trainer.max_steps
    state.loss, state.step_loss, state.data_wait_s = loss, step_loss, data_wait
    state.samples, state.tokens, state.metrics = samples, tokens, step_metrics


def unnamed(_name: str) -> contextlib.nullcontext:
    """A part of the step left unnamed: the profiler is off."""
    return _NO_REGION


_NO_REGION = contextlib.nullcontext()  # reusable: it holds no state
