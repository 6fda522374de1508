"""The stage interface: what the loop asks of compile, profile, checkpoint, the parity check, evaluation, the
non-finite guard and the train metrics, each by the same names.

Each stage builds itself from one `StageContext` (`build(ctx)`), so the assembly builds the list in a loop and a
new stage is one class added to it. Before training, every stage may change the parallelized model (`prepare`:
compile does), may restore a saved run into the loop state (`resume`: the checkpointer) and then sees the state
the run starts from (`start`). After every
optimizer step the loop calls `after_step(state)` on the enabled ones (a stage that is off is never called: it
costs nothing per step); the throughput meter leaves out of the steady state the most steps any stage asks for
(`excluded_steps()`) and the time they paused the clock (`take_paused_s()`); at the end each stage is closed and
gives its part of summary.json under `summary_key`. Stages talk to each other only through the loop state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from trainflow.checkpoint import TrainState
from trainflow.loop.state import LoopState

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from trainflow.config.schema import ParallelismConfig, TrainerConfig
    from trainflow.data import DataBundle
    from trainflow.distributed import DistEnv
    from trainflow.loggers.writer import MetricsWriter
    from trainflow.metrics.meter import Throughput
    from trainflow.tasks import Task

__all__ = ["LoopState", "Stage", "StageContext"]

Schema = TypeVar("Schema")


@dataclass
class StageContext:
    """Everything a stage is built from, built once by the assembly before the model is parallelized."""

    cfg: DictConfig  # the validated run config, read-only
    run_dir: Path
    env: DistEnv
    trainer: TrainerConfig
    parallelism: ParallelismConfig  # as parallelism=auto decided it
    optim: dict[str, Any]  # the optim section: the optimizer's keys and the schedule's (trainflow.optim)
    data: DataBundle
    task: Task
    model: nn.Module  # on the device, not yet parallelized (the parity check copies it)
    example: Any  # a batch of trainer.batch_size items, on the host (compile.check runs it)
    autocast: Any  # the step's autocast context (reusable)
    writer: MetricsWriter  # closed by the assembly's owner, not by a stage
    meter: Throughput  # its excluded steps are set once every stage is built
    flops_per_step: int | None
    peak_flops: float | None

    def section(self, name: str, schema: type[Schema]) -> Schema:
        """The config section `name` as its schema's dataclass (plain attributes: no DictConfig cost per read)."""
        from trainflow.config.schema import typed

        return typed(self.cfg[name], schema)


class Stage(Protocol):
    """The calls every stage answers. A stage subclasses it for the defaults and overrides what it does; the
    checkpointer, which stages.py imports (for TrainState), answers them without subclassing."""

    enabled: bool = True  # False: the loop never calls after_step and never enters the stage
    summary_key: str | None = None  # its part of summary.json (None: the stage reports inside another part)

    @classmethod
    def build(cls, ctx: StageContext) -> Stage:
        """The stage as the run's config says, from the context alone."""
        raise NotImplementedError(f"{cls.__name__} has no build(ctx)")

    def prepare(self, model: nn.Module) -> nn.Module:
        """The parallelized model before the optimizer is built; returns the model to train (compile changes it)."""
        return model

    def resume(self, state: LoopState) -> None:
        """Restore a saved run into the loop state, before the first step (the checkpointer does)."""

    def start(self, state: LoopState) -> None:
        """Once every stage resumed: the state the run starts from (its step, its optimizer), kept if needed."""

    def excluded_steps(self) -> int:
        """The first steps of the run (counted from its start) to leave out of the steady-state figures."""
        return 0

    def after_step(self, state: LoopState) -> bool:
        """Work after an optimizer step; True stops the run now (after the remaining stages of this step)."""
        return False

    def take_paused_s(self) -> float:
        """Seconds of non-training work since the last call (evaluation, a save): not training time."""
        return 0.0

    def __enter__(self) -> Stage:
        """Entered (enabled stages only) before the first step."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Left after the last step, also when the loop raises."""

    def close(self, state: TrainState) -> None:
        """After the loop, on a normal end: finish what is pending (a final save, open files)."""

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        """This stage's part of summary.json; every stage is asked, enabled or not (some gather from all ranks)."""
        return None
