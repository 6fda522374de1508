"""One optimizer step, and what it reads: the loop's (trainflow.run.training) and the parity check's reference."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainflow.config.schema import TrainerConfig
from trainflow.data import to_device
from trainflow.distributed.parallelism import local_loss, no_grad_sync
from trainflow.distributed.pipeline import Pipeline
from trainflow.loop.stages import StepHooks
from trainflow.loop.state import LoopState
from trainflow.metrics.regions import DATA, FWD_BWD, OPTIMIZER
from trainflow.optim import gradient_norm
from trainflow.tasks import Task, add_metrics


@dataclass
class StepInputs:
    """What `train_step` reads, as plain attributes: a DictConfig read costs tens of microseconds."""

    settings: TrainerConfig  # the trainer section: steps, micro-batches, accumulation, clipping, log steps
    state: LoopState  # the model, optimizer and scheduler, and what the step leaves for the stages
    task: Task
    batches: Iterator[Any]
    trainable: list[nn.Parameter]  # the model's parameters, listed once rather than walked every step
    autocast: Any
    name_part: Callable[[str], Any]  # names a part of the step for the profiler (a no-op when it is off)
    hooks: StepHooks  # what the enabled stages answer inside the step
    batch_device: torch.device | None  # where batches are moved (None: the loader's tensors are already there)
    pin: bool  # batches are pinned and copied asynchronously
    steps_schedule: bool  # False: a constant schedule without warm-up is not stepped
    metrics_every_step: bool  # task.train_metrics=every_step; else the task's metrics at log steps only
    global_batch: int
    pipeline: Pipeline | None = None  # parallelism.pp > 1: the schedule runs each micro-batch's forward and backward


def train_step(inputs: StepInputs) -> None:
    """One optimizer step: the micro-batches' forward and backward, the gradient norm (clipping), the update."""
    settings, state, name_part, task = inputs.settings, inputs.state, inputs.name_part, inputs.task
    model, hooks = state.model, inputs.hooks
    if state.figures:  # the last log step's: written by now
        state.figures = {}
    state.log_due = (state.step + 1) % settings.log_every == 0 or state.step + 1 >= settings.max_steps
    with_metrics = state.log_due or inputs.metrics_every_step
    data_wait, samples, tokens = 0.0, 0, 0  # of this rank's micro-batches, counted by the task
    step_loss = None  # this rank's loss of the step, on the device
    step_metrics: dict[str, torch.Tensor] = {}  # the task's metrics summed over the micro-steps, on the device
    for micro in range(settings.grad_accum):
        with name_part(DATA):
            start = time.perf_counter()
            batch = next(inputs.batches)
            data_wait += time.perf_counter() - start  # the copy below may wait for the GPU: not data
            if inputs.batch_device is not None:
                batch = to_device(batch, inputs.batch_device, non_blocking=inputs.pin)
            counted = task.count(batch)  # shapes only (data.seq_lens varies the tokens)
            samples, tokens = samples + counted[0], tokens + counted[1]
        last_micro = micro == settings.grad_accum - 1
        with name_part(FWD_BWD), no_grad_sync(model, last_micro), \
                _loss_contexts(hooks.loss_contexts) if hooks.loss_contexts else _NO_REGION:
            if inputs.pipeline is not None:  # the stages' forward and backward, by the schedule
                with inputs.autocast:
                    loss, metrics = inputs.pipeline.run(batch, with_metrics)
                if last_micro:
                    inputs.pipeline.sync_shared()
            else:
                with inputs.autocast:
                    loss, metrics = task(model, batch, with_metrics)
                loss = local_loss(loss)
            loss_share = loss / settings.grad_accum if settings.grad_accum > 1 else loss
            if inputs.pipeline is None:
                loss_share.backward()
        step_loss = loss_share.detach() if step_loss is None else step_loss + loss_share.detach()
        if with_metrics:  # a user's task computes its metrics every step: kept as task.train_metrics says
            add_metrics(step_metrics, metrics)
    with name_part(OPTIMIZER):
        step = state.step + 1
        norm_due = settings.grad_clip or state.log_due or bool(hooks.grad_norm) and any(
            s.wants_grad_norm(step) for s in hooks.grad_norm)
        state.grad_norm = None
        if norm_due:  # a pipeline stage's norm is summed over the stages
            state.grad_norm = inputs.pipeline.gradient_norm(settings.grad_clip) if inputs.pipeline \
                else gradient_norm(inputs.trainable, settings.grad_clip)
        if hooks.updates:  # every one asked, always (a stage counts what it was asked)
            state.skipped = not all([stage.keeps_update(step, state.grad_norm) for stage in hooks.updates])
        else:
            state.skipped = False
        if state.skipped:
            _drop_update(state.optimizer, state.scheduler)
        else:
            state.optimizer.step()
            if inputs.steps_schedule:
                state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen += inputs.global_batch
    state.steps_this_run += 1
    state.done = state.step >= settings.max_steps
    state.sync_due = state.log_due or state.steps_this_run == 1 or bool(hooks.syncs) and any(
        s.syncs_after(state.step) for s in hooks.syncs)
    state.loss, state.step_loss, state.data_wait_s = loss, step_loss, data_wait
    state.samples, state.tokens, state.metrics = samples, tokens, step_metrics


@contextlib.contextmanager
def _loss_contexts(makers: tuple[Callable[[], contextlib.AbstractContextManager[Any]], ...]) -> Iterator[None]:
    """The loss contexts (the parallelism's, then the stages'), entered in their order."""
    with contextlib.ExitStack() as stack:
        for make in makers:
            stack.enter_context(make())
        yield


def _drop_update(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Drop a step's gradients; the schedule still advances with the step count (as a resume does)."""
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a dropped first step: torch warns that the schedule ran before the optimizer
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def no_region(_name: str) -> contextlib.nullcontext:
    """A part of the step named for no profiler (none records it)."""
    return _NO_REGION


_NO_REGION = contextlib.nullcontext()  # reusable: it holds no state
