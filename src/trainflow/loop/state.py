"""The state of a run: what a checkpoint saves (TrainState) and what the loop keeps beside it for one step
(LoopState): the facts of the loop itself, never a field that only one stage writes or reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from trainflow.data.stream import STREAM_VERSION

if TYPE_CHECKING:
    from trainflow.loop.meter import Throughput


class KeepsState(Protocol):
    """A stage whose own state a checkpoint holds (trainflow.loop.stages.Stage.state_dict)."""

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Validation:
    """An evaluation's figures (the task's loss and metrics, means over the validation batches) and its step."""

    step: int
    figures: dict[str, float]


@dataclass
class TrainState:
    """Everything a resumed run needs to continue as if it had never stopped."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    samples_seen: int = 0  # position in the global sample stream (see data/stream.py)
    stream_version: int = STREAM_VERSION  # how that stream orders its samples; a resume keeps the checkpoint's
    data_loader: Any = None  # an iterable dataset's loader: its state_dict() is this rank's stream position
    data_state: dict[str, Any] | None = None  # that position as a resume read it, restored when the loader is built
    data_states: list[dict[str, Any]] | None = None  # every rank's (a sharded stream resumes from all of them)
    # the trackers' run ids ({logger: id}, as loggers.json holds them): a resume continues those tracked runs even
    # where the run directory's own copy is gone
    tracked_runs: dict[str, str] = field(default_factory=dict)
    # what the data is (trainflow.data.identity): a resume on other data is refused (None: not known, not checked)
    data_identity: dict[str, Any] | None = None
    # how many samples a step takes, by the key that sets it (trainer.batch_size, trainer.grad_accum, global batch):
    # a resume lists what changed (None: not known)
    layout: dict[str, int] | None = None
    # the stages whose own state each checkpoint holds, by name (an EMA of the weights): saved and resumed with it
    stage_states: dict[str, KeepsState] = field(default_factory=dict)


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
    skipped: bool = False  # a stage kept the update out (keeps_update: a non-finite norm, a lost replica group)
    steps_this_run: int = 0
    # the run's clock (trainflow.loop.meter), built once every stage said which first steps to leave out of the
    # steady state (its excluded_steps): the stages that read it, or its counts, take it from here
    meter: Throughput | None = None
    log_due: bool = False  # a log step: the train metrics sync and are written
    sync_due: bool = False  # the step ends at a point where the host reads the device anyway (a log step, the first
    # step of the run, a stage's own: a save): device values kept for later are read then
    done: bool = False  # the last step of the run
    step_time_s: float | None = None  # the synced wall time of the step, while excluded steps run; else None
    # a log step's figures that stages other than the train metrics add (the ranks' own step times): written with
    # the interval's figures, then cleared
    figures: dict[str, float] = field(default_factory=dict)
    # the rank the others wait for, as the stragglers stage named it (rank, host, step, ratio, own and data wait
    # times); the profiler's verdict names it as the cause of their waiting (None: no rank named)
    straggler: dict[str, Any] | None = None
    resumed_checkpoint: Path | None = None  # the committed checkpoint the run started from (None: a fresh start)
    # why a stage stopped the run (fault tolerance: no quorum): the checkpointer saves and stops as on a stop signal
    stop_reason: str | None = None
    validation: Validation | None = None  # the latest evaluation (the evaluation stage writes it)
    # the step whose checkpoint is kept as the best (early stopping writes it at a best evaluation): the checkpointer
    # saves that step and retention never deletes it
    best_step: int | None = None
