"""The stage interface: what the loop and the step ask of compile, profile, checkpoint, the parity check,
evaluation, the non-finite guard, the train metrics, the watchdog, the stragglers and fault tolerance, each by the
same names, and what a stage of your own answers.

Each stage builds itself from one `StageContext` (`build(ctx)`), so the assembly builds the list in a loop and a
new stage is one class added to it. The loop orders the stages by the phase each declares (`phase`), never by
looking one up. Before training, every stage may change the parallelized model (`wrap_model`: compile does), may
restore a saved run into the loop state (`resume`: the checkpointer) and then sees the state the run starts from
(`start`). Inside each step, the step asks the enabled stages what only they know: whether to name the step's
parts for a profiler (`names_step_parts`), the context the loss is computed in (`loss_context`), whether the
gradient norm is needed (`wants_grad_norm`) and whether the update is kept (`keeps_update`: a non-finite norm is
skipped, a replica group commits). After every optimizer step the loop calls `after_step(state)` on the enabled
ones, in phase order; the throughput meter leaves out of the steady state the most steps any stage asks for
(`excluded_steps()`) and the time they paused the clock (`take_paused_s()`); a stage's own sync points
(`syncs_after`: a save) are the loop's too. At the end each stage is closed and gives its part of summary.json
under `summary_key` (a dotted key nests it: `parallelism.check`). Stages tell each other things only through the
loop state (trainflow.loop.state).

Every stage has a `name` (trainflow's own: their key in trainflow.run.assembly.STAGES; a stage of the config's
`stages` list: its key there) and declares the stages it depends on, those it acts `before` and `after`: `ordered`
sorts by phase, then by those declarations, then by name (never by where a stage is listed: two stages whose order
matters say so), and refuses in one line a declaration that contradicts the phases or another. A stage from the
config (trainflow.loop.configured) is made by calling its `_target_` with its keys and is handed the run's context
once (`setup(ctx)`), before the model is parallelized. A stage whose own state a checkpoint must hold answers
`state_dict()` (tensors go to the shards, other values to state.json) and gets it back by `load_state_dict(saved)`
on a resume, before `start`.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainflow.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainflow.config.schema import RunConfig
    from trainflow.data import DataBundle
    from trainflow.distributed import DistEnv
    from trainflow.loggers.writer import MetricsWriter
    from trainflow.loop.state import LoopState, TrainState
    from trainflow.tasks import Task

__all__ = ["Phase", "Stage", "StageContext", "StepHooks", "ordered"]


class Phase(IntEnum):
    """When a stage acts after each step; the loop calls the stages in this order (a stage declares its phase)."""

    TIME = 10  # the watchdog: its beat marks the step done before any stage works
    OBSERVE = 20  # compile's report, the parity check, the profiler's schedule: the step as it was
    GUARD = 30  # the non-finite guard: before anything is logged or saved
    GATHER = 40  # collectives whose figures the log step writes (the ranks' own step times)
    REPORT = 50  # the train metrics and evaluation: the log step
    CONFIGURED = 55  # a stage of the config's `stages` list (early stopping, the EMA, yours) and any that declares
    # no other phase: after the log step, before the save
    SAVE = 60  # the checkpointer: the last of the stages that may stop the run (it saves before it stops)
    NEXT = 70  # fault tolerance: the quorum of the next step, once this one is saved


@dataclass
class StageContext:
    """Everything a stage is built from, built once by the assembly before the model is parallelized. A stage reads
    the config one way, through `cfg` (its sections: `ctx.cfg.trainer`, `ctx.cfg.parallelism`, ...); the run's
    clock comes with the loop state (`state.meter`, at `start`), once every stage said its excluded steps."""

    cfg: RunConfig  # the typed run config, as the run decided it (its per-rank batch, parallelism=auto's layout)
    run_dir: Path
    env: DistEnv
    data: DataBundle
    task: Task
    model: nn.Module  # on the device, not yet parallelized (the parity check copies it)
    example: Any  # a batch of trainer.batch_size items, on the host (compile.check runs it)
    autocast: Any  # the step's autocast context (reusable)
    writer: MetricsWriter  # closed by the assembly's owner, not by a stage
    flops_per_step: int | None
    peak_flops: float | None


class Stage:
    """The calls every stage answers; a stage subclasses it and overrides what it does (the defaults do nothing)."""

    enabled: bool = True  # False: the loop and the step never call it, and never enter it
    phase: Phase = Phase.CONFIGURED  # where it acts after each step
    summary_key: str | None = None  # its part of summary.json (None: it reports nothing; dotted: nested)
    names_step_parts: bool = False  # the step's parts (data, forward-backward, optimizer) are named for a profiler
    name: str = ""  # its key in STAGES or in the config's `stages` (set by the assembly)
    before: tuple[str, ...] = ()  # stages it acts before (by name): they depend on what it does first
    after: tuple[str, ...] = ()  # stages it acts after (by name): it depends on what they do first

    @classmethod
    def build(cls, ctx: StageContext) -> Stage:
        """The stage as the run's config says, from the context alone."""
        raise NotImplementedError(f"{cls.__name__} has no build(ctx)")

    def setup(self, ctx: StageContext) -> None:
        """A stage from the config (made by its `_target_`): the run's context, once, before the model is
        parallelized."""

    def state_dict(self) -> dict[str, Any] | None:
        """Its own state for each checkpoint (None: it keeps none); tensors go to the shards (sharded as they are)."""
        return None

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A resume: the state `state_dict()` gave at the save (its tensors already read into the live ones)."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The parallelized model before the optimizer is built; returns the model to train (compile changes it)."""
        return model

    def resume(self, state: LoopState) -> None:
        """Restore a saved run into the loop state, before the first step (the checkpointer does)."""

    def start(self, state: LoopState) -> None:
        """Once every stage resumed: the state the run starts from (its step, its optimizer), kept if needed."""

    def excluded_steps(self) -> int:
        """The first steps of the run (counted from its start) to leave out of the steady-state figures."""
        return 0

    # -- inside the step (asked of the enabled stages that override them; the others cost nothing) --------------

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context each micro-batch's forward and backward run in (entered with the other stages')."""
        return contextlib.nullcontext()

    def wants_grad_norm(self, step: int) -> bool:
        """Whether step `step` (counted from 1) must measure the gradients' norm (keeps_update reads it)."""
        return False

    def keeps_update(self, step: int, grad_norm: torch.Tensor | None) -> bool:
        """Whether step `step` applies its update; False drops it (its gradients go, the schedule moves on).
        Every such stage is asked every step, whatever the others answer."""
        return True

    def syncs_after(self, step: int) -> bool:
        """Whether the host reads the device after step `step` for this stage's own work (a save): values kept on
        the device (the non-finite guard's losses) are read there too."""
        return False

    # -- after the step ---------------------------------------------------------------------------------------

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


def overrides(stage: Stage, hook: str) -> bool:
    """Whether the stage's class answers `hook` itself (the default does nothing, and is not worth a call)."""
    return getattr(type(stage), hook) is not getattr(Stage, hook)


@dataclass(frozen=True)
class StepHooks:
    """The enabled stages that answer each hook of the step, listed once before the first step."""

    name_parts: bool  # a stage names the step's parts (record_function: a profiler records them)
    loss_contexts: tuple[Callable[[], contextlib.AbstractContextManager[Any]], ...]  # each micro-step enters them
    grad_norm: tuple[Stage, ...]
    updates: tuple[Stage, ...]
    syncs: tuple[Stage, ...]

    @classmethod
    def of(cls, stages: list[Stage], parallel_loss: Callable[[], contextlib.AbstractContextManager[Any]]
           = contextlib.nullcontext) -> StepHooks:
        """`parallel_loss`: the loss context the parallelism asks for (loss parallel under TP:
        trainflow.distributed.parallelism.loss_context_of), entered before the stages' own."""
        enabled = [stage for stage in stages if stage.enabled]
        answering = {hook: tuple(s for s in enabled if overrides(s, hook))
                     for hook in ("loss_context", "wants_grad_norm", "keeps_update", "syncs_after")}
        parallel = () if parallel_loss is contextlib.nullcontext else (parallel_loss,)
        return cls(any(stage.names_step_parts for stage in enabled),
                   (*parallel, *(stage.loss_context for stage in answering["loss_context"])),
                   answering["wants_grad_norm"], answering["keeps_update"], answering["syncs_after"])


def ordered(stages: Sequence[Stage]) -> list[Stage]:
    """The stages in the order they act: by phase, then by their `before`/`after` declarations, then by name, so
    that where a stage is listed never orders it. A declaration naming no stage, one across phases the other way
    round, or a cycle is one line."""
    by_name = {stage.name: i for i, stage in enumerate(stages)}
    follows: list[set[int]] = [set() for _ in stages]  # follows[i]: the stages that must act before stage i
    for i, stage in enumerate(stages):
        for word, names in (("before", stage.before), ("after", stage.after)):
            for name in names:
                if name not in by_name:
                    raise ConfigError(f"stages.{stage.name}.{word}: no stage is named {name!r}; the stages are "
                                      f"{', '.join(s.name for s in stages)}")
                first, then = (i, by_name[name]) if word == "before" else (by_name[name], i)
                if stages[first].phase > stages[then].phase:
                    raise ConfigError(f"stages.{stage.name}.{word}: {stage.name} ({stage.phase.name}) cannot act "
                                      f"{word} {name} ({stages[by_name[name]].phase.name}): the phases order them "
                                      f"the other way; drop the declaration or give {stage.name} another phase")
                follows[then].add(first)
    order: list[int] = []
    ready = [(stage.phase, stage.name, i) for i, stage in enumerate(stages) if not follows[i]]
    heapq.heapify(ready)
    while ready:
        *_, i = heapq.heappop(ready)
        order.append(i)
        for j, before in enumerate(follows):
            if i in before:
                before.discard(i)
                if not before:
                    heapq.heappush(ready, (stages[j].phase, stages[j].name, j))
    if len(order) < len(stages):
        cycle = [stages[i].name for i in range(len(stages)) if i not in order]
        raise ConfigError(f"stages: {', '.join(cycle)} declare before/after each other in a cycle; drop one of "
                          "those declarations")
    return [stages[i] for i in order]
