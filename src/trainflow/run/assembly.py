"""Putting one run together: `assemble` builds everything in named steps, each returning what it made: the process
set up -> data, model and task -> the run decided (per-rank batch, parallelism=auto) -> the example batch and FLOPs ->
the stages -> the meter -> parallelize, compile, optimizer -> per-rank seed, resume -> loader -> the step inputs.
trainflow.run.training runs what it built.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.profiler import record_function

from trainflow.checkpoint import Checkpointer
from trainflow.checkpoint.store import resolve_dir
from trainflow.compile.compiler import Compiler
from trainflow.config.choices import Strategy
from trainflow.config.schema import CompileConfig, RunConfig, plain
from trainflow.data import DataBundle, IterableBatches, StreamSampler, build_datasets, make_loader, to_device
from trainflow.data.stream import STREAM_VERSION
from trainflow.distributed import DistEnv, memory_plan
from trainflow.distributed.parallelism import loss_context_of, parallelize, unwrap
from trainflow.distributed.pipeline import Pipeline, StageParts
from trainflow.distributed.process_group import per_rank_batch
from trainflow.guards.fault_tolerance import FaultTolerance, data_share, replica_groups
from trainflow.guards.nonfinite import NonFiniteGuard
from trainflow.guards.parity import ParityCheck
from trainflow.guards.stragglers import Stragglers
from trainflow.guards.watchdog import Watchdog
from trainflow.loggers import build_loggers
from trainflow.loggers.writer import MetricsWriter
from trainflow.loop.configured import configured_stages
from trainflow.loop.evaluation import Evaluation
from trainflow.loop.meter import PeakMemory, Throughput
from trainflow.loop.stages import Stage, StageContext, StepHooks, ordered, overrides
from trainflow.loop.state import LoopState
from trainflow.loop.step import StepInputs, no_region
from trainflow.loop.train_metrics import TrainMetrics
from trainflow.metrics.batch_fit import check_batch
from trainflow.metrics.flops import count_train_flops, peak_flops
from trainflow.models import build_model
from trainflow.optim import build_optimizer, schedule_changes_lr
from trainflow.profile.profiler import Profiler
from trainflow.record.cost import Cost
from trainflow.record.fingerprint import Fingerprint
from trainflow.tasks import Task, build_task, probe
from trainflow.util.console import FILE_ONLY, RunFacts, start_header
from trainflow.util.device import autocast_for, configure_matmul
from trainflow.util.seeding import SEED_STRIDE, seed_everything
from trainflow.util.targets import origins

log = logging.getLogger("trainflow")


# trainflow's own stages by name, each built from its own config section; the loop calls them in the order of the
# phase each declares (trainflow.loop.stages.Phase), then of their before/after declarations. The config's `stages`
# list adds yours (trainflow.loop.configured).
STAGES: dict[str, type[Stage]] = {
    "watchdog": Watchdog, "compile": Compiler, "parity": ParityCheck, "profiler": Profiler,
    "nonfinite": NonFiniteGuard, "stragglers": Stragglers, "train_metrics": TrainMetrics, "evaluation": Evaluation,
    "checkpoint": Checkpointer, "fault_tolerance": FaultTolerance, "fingerprint": Fingerprint, "cost": Cost}


@dataclass
class Assembly:
    """What the assembly built: the step's inputs, the stages and their context, and what the summary reports."""

    ctx: StageContext
    step_inputs: StepInputs
    stages: list[Stage]  # in the order they act after each step
    metric_names: list[str]  # what the task reports besides the loss (from a probe before training)
    parameters: int
    flops_absent: str | None  # why the FLOPs (and so MFU) are unknown
    auto_plan: memory_plan.AutoPlan | None  # parallelism=auto's plan, checked against the measured peak at the end
    resumed_from: int | None
    started: float  # time.monotonic() when the assembly began: the run's wall time is counted from there


def assemble(cfg: RunConfig, run_dir: Path, env: DistEnv,
             stage_types: Mapping[str, type[Stage]] = STAGES) -> Assembly:
    """Build everything, one step after another in the order the parts depend on each other; each step returns
    what it made, and nothing is made twice. What the run decides (the per-rank batch, parallelism=auto's layout)
    makes one new typed config, in one step: nothing writes into a config after validation."""
    started = time.monotonic()
    _set_up_process(cfg, env)
    parts = _build_parts(cfg, env)
    run = _decide_run(cfg, env, parts)
    _record_config(run.cfg, run_dir, run.env)
    example = _example_batch(run, parts)
    flops = _count_flops(run, parts, example)
    ctx = _stage_context(run, run_dir, parts, example, flops)
    stages = _stages(stage_types, ctx)
    meter = _meter(run, stages)
    trainable = _trainable(run, parts, stages, meter)
    state = _loop_state(run, parts, stages, trainable, meter)
    resumed_from = _resume_and_start(run, stages, state)
    checkpoint_dir = resolve_dir(run.cfg.checkpoint.dir, run_dir) if run.cfg.checkpoint.enabled else None
    _start_trackers(run, ctx, state, resumed_from, checkpoint_dir)
    _announce(run, run_dir, parts, resumed_from, checkpoint_dir)
    feed = _feed(run, parts, state, resumed_from)
    step_inputs = _step_inputs(run, ctx, stages, trainable, state, feed)
    return Assembly(ctx, step_inputs, stages, parts.metric_names, parts.parameters, flops.absent, run.auto_plan,
                    resumed_from, started)


def _set_up_process(cfg: RunConfig, env: DistEnv) -> None:
    """Determinism, matmul precision, and the seed every rank shares (the same initial weights on every rank)."""
    settings = cfg.trainer
    if settings.deterministic != torch.are_deterministic_algorithms_enabled():  # the call imports inductor: 1.5 s
        torch.use_deterministic_algorithms(settings.deterministic)
    configure_matmul(env.device, settings.precision, settings.tf32)
    seed_everything(settings.seed)


@dataclass(frozen=True)
class Parts:
    """What the config builds before the run decides its layout."""

    loggers: dict[str, Any]
    data: DataBundle
    model: nn.Module  # as build_model made it, on the device: before parallelize
    task: Task
    metric_names: list[str]  # what the task reports besides the loss (a probe on two items)
    parameters: int


def _build_parts(cfg: RunConfig, env: DistEnv) -> Parts:
    """The loggers (rank 0), the data, the model on the device and the task, which a probe on two items checks."""
    loggers = build_loggers(cfg.logger) if env.is_main else {}  # a missing extra stops the run here, in one line
    data = build_datasets(cfg.data, cfg.model.vocab_size is not None)
    model = build_model(str(cfg.model._target_), cfg.model.kwargs).to(env.device)
    task = build_task(cfg.task, data.is_lm)
    two_items = data.train[torch.arange(min(2, len(data.train)))]  # two: items the collate cannot batch show
    metric_names = probe(task, model, to_device(two_items, env.device), data.name, str(cfg.model._target_))
    return Parts(loggers, data, model, task, metric_names, sum(p.numel() for p in model.parameters()))


@dataclass(frozen=True)
class Decided:
    """What the run decides itself: the typed config it trains by, and the env and plan of parallelism=auto."""

    cfg: RunConfig  # the per-rank batch (of a global batch), parallelism=auto's layout
    env: DistEnv  # with auto: the strategy and degrees it chose
    auto_plan: memory_plan.AutoPlan | None  # parallelism=auto's plan (None: a strategy was named)
    global_batch: int  # the samples of one optimizer step (a TP group reads one batch)


def _decide_run(cfg: RunConfig, env: DistEnv, parts: Parts) -> Decided:
    """The per-rank batch and parallelism=auto's layout, decided once into one new config. auto measures the model
    on the micro-batch of the most data-parallel ranks it may pick (checked first: a batch the data cannot fill or
    the memory cannot hold is one line) and may give a TP group a larger one (the global batch stays)."""
    replicas = replica_groups(cfg.parallelism)  # torchft's replica groups share the data stream (1: none)
    if cfg.parallelism.strategy != Strategy.auto:
        batch = per_rank_batch(cfg, env.dp_size * replicas)
        decided = replace(cfg, trainer=replace(cfg.trainer, batch_size=batch))
        return Decided(decided, env, None, batch * env.dp_size * replicas * cfg.trainer.grad_accum)
    measured_batch = per_rank_batch(cfg, memory_plan.probe_ranks(cfg, env.world_size) * replicas)
    measured = replace(cfg, trainer=replace(cfg.trainer, batch_size=measured_batch))
    check_batch(measured, measured_batch, parts.model, parts.data.train, parts.task, env.device)
    auto_env, plan = memory_plan.apply_auto(measured, env, parts.model,
                                            parts.data.train[torch.arange(measured_batch)], parts.task)
    decided = replace(cfg, parallelism=plan.parallelism, trainer=replace(cfg.trainer, batch_size=plan.batch_size))
    return Decided(decided, auto_env, plan, plan.batch_size * auto_env.dp_size * replicas * cfg.trainer.grad_accum)


def _record_config(cfg: RunConfig, run_dir: Path, env: DistEnv) -> None:
    """The config the run trains by, logged and saved as config.yaml (rank 0)."""
    if env.is_main:
        text = OmegaConf.to_yaml(plain(cfg))
        log.info("config:\n%s", text, extra=None if cfg.trainer.print_config else FILE_ONLY)
        (run_dir / "config.yaml").write_text(text)


def _example_batch(run: Decided, parts: Parts) -> Any:
    """A micro-batch of the decided size, on the host (the FLOPs are counted and compile.check runs on it), once
    that size is checked against the data and the memory."""
    batch_size = run.cfg.trainer.batch_size
    check_batch(run.cfg, batch_size, parts.model, parts.data.train, parts.task, run.env.device)
    return parts.data.train[torch.arange(batch_size)]


@dataclass(frozen=True)
class Flops:
    """The FLOPs of one optimizer step on one device and the device's peak: MFU."""

    per_step: int | None  # per device: a TP group and a pipeline's stages share their batch's work
    absent: str | None  # why the FLOPs are unknown
    peak: float | None


def _count_flops(run: Decided, parts: Parts, example: Any) -> Flops:
    counted, absent = count_train_flops(parts.model, example, parts.task)
    settings, env = run.cfg.trainer, run.env
    per_step = counted * settings.grad_accum // (env.tp * env.pp) if counted is not None else None
    return Flops(per_step, absent, peak_flops(env.device, settings.precision, run.cfg.metrics.peak_flops))


def _stage_context(run: Decided, run_dir: Path, parts: Parts, example: Any, flops: Flops) -> StageContext:
    return StageContext(run.cfg, run_dir, run.env, parts.data, parts.task, parts.model, example,
                        autocast_for(run.env.device, run.cfg.trainer.precision),
                        MetricsWriter(run_dir, run.env.is_main, parts.loggers), flops.per_step, flops.peak)


def _stages(stage_types: Mapping[str, type[Stage]], ctx: StageContext) -> list[Stage]:
    """trainflow's own stages, each named by its key, and the config's, in the order they act; built before
    parallelize (the parity check copies the model)."""
    own = []
    for name, stage_type in stage_types.items():
        stage = stage_type.build(ctx)
        stage.name = name
        own.append(stage)
    return ordered([*own, *configured_stages(ctx.cfg.stages, ctx, set(stage_types))])


def _meter(run: Decided, stages: list[Stage]) -> Throughput:
    """The run's clock: it leaves out of the steady state the most first steps the config or a stage asks for."""
    excluded = max([run.cfg.trainer.excluded_steps, *(stage.excluded_steps() for stage in stages)])
    return Throughput(excluded, run.env.device, PeakMemory(run.env.device))


@dataclass(frozen=True)
class Trainable:
    """The model as it trains and what updates it."""

    model: nn.Module  # parallelized, then wrapped by the stages (compile)
    pipeline: Pipeline | None  # parallelism.pp > 1: the schedule over this rank's stages
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def _trainable(run: Decided, parts: Parts, stages: list[Stage], meter: Throughput) -> Trainable:
    """The model parallelized, then wrapped by each stage in order (compile; compile.check compares eager and
    compiled on the example batch); its pipeline schedule; the optimizer on its final parameters."""
    settings, parallelism, env = run.cfg.trainer, run.cfg.parallelism, run.env
    parallel = parallelize(parts.model, parallelism, env, settings.precision, settings.fp8_recipe)
    model = functools.reduce(lambda wrapped, stage: stage.wrap_model(wrapped), stages, parallel)
    pipeline = Pipeline(model, parallelism.pp_schedule, parts.task, settings.batch_size, settings.grad_accum,
                        parallelism.microbatches, parts.metric_names, env, parts.model, meter.excluded_steps) \
        if isinstance(model, StageParts) else None
    optimizer, scheduler = build_optimizer(model, run.cfg.optim, settings.max_steps, env.device)
    return Trainable(model, pipeline, optimizer, scheduler)


def _loop_state(run: Decided, parts: Parts, stages: list[Stage], trainable: Trainable,
                meter: Throughput) -> LoopState:
    settings = run.cfg.trainer
    return LoopState(trainable.model, trainable.optimizer, trainable.scheduler,
                     data_identity=parts.data.identity,  # a resume compares them
                     stage_states={stage.name: stage for stage in stages if overrides(stage, "state_dict")},
                     layout={"trainer.batch_size": settings.batch_size, "trainer.grad_accum": settings.grad_accum,
                             "global batch": run.global_batch}, meter=meter)


def _resume_and_start(run: Decided, stages: list[Stage], state: LoopState) -> int | None:
    """Per-rank randomness (dropout) from here on; then a resume restores every rank's saved generators and the
    state, and every stage sees the state the run starts from. Returns the step resumed from (None: a fresh
    start; a heal from a peer says its own)."""
    seed_everything(run.cfg.trainer.seed + SEED_STRIDE * run.env.rank)
    for stage in stages:
        stage.resume(state)
    resumed_from = state.step if state.step > 0 else None
    for stage in stages:
        stage.start(state)
    return resumed_from


def _start_trackers(run: Decided, ctx: StageContext, state: LoopState, resumed_from: int | None,
                    checkpoint_dir: Path | None) -> None:
    """The loggers start (a resume continues its tracked runs); a tracker that cannot be reached stops the run
    here. The tracked runs' ids go into the state, for the next checkpoints."""
    state.tracked_runs = ctx.writer.start(run.cfg, run.env.world_size, resumed_from, state.tracked_runs,
                                          state.resumed_checkpoint, checkpoint_dir)


def _announce(run: Decided, run_dir: Path, parts: Parts, resumed_from: int | None,
              checkpoint_dir: Path | None) -> None:
    """The run's header (rank 0), and a warning for a finished run started again."""
    cfg, env, settings, data = run.cfg, run.env, run.cfg.trainer, parts.data
    if not env.is_main:
        return
    if resumed_from and resumed_from >= settings.max_steps:
        log.warning("the checkpoint is at step %d, trainer.max_steps is %d: nothing left to train; raise "
                    "trainer.max_steps to continue this run", resumed_from, settings.max_steps)
    log.info("%s", start_header(RunFacts(
        type(unwrap(parts.model)).__name__, parts.parameters, data.name, len(data.train), _length(data.val),
        data.seq_len, type(parts.task).__name__, parts.task.monitor, parts.task.mode, str(env.device),
        env.world_size, cfg.parallelism.strategy, settings.precision, _compiled(cfg.compile), run.global_batch,
        settings.max_steps, resumed_from, run_dir, checkpoint_dir, tuple(cfg.logger), origins(cfg))))


@dataclass(frozen=True)
class Feed:
    """Where the step's batches come from."""

    loader: Iterable[Any]
    pin: bool  # batches are pinned and copied asynchronously


def _feed(run: Decided, parts: Parts, state: LoopState, resumed_from: int | None) -> Feed:
    """The loader of this rank's share of the stream, from the position the state resumed at."""
    cfg, env, settings = run.cfg, run.env, run.cfg.trainer
    pin = cfg.data.pin_memory is not False and env.device.type == "cuda"  # null: pinned on CUDA
    sampler = StreamSampler(len(parts.data.train), settings.batch_size, *data_share(cfg.parallelism, env),
                            settings.seed, state.samples_seen, version=state.stream_version)
    if state.stream_version != STREAM_VERSION and env.is_main:
        log.info("data: the checkpoint's stream is of version %d (an epoch's order held in memory, 8 bytes a "
                 "sample): the run continues in that order; a fresh run computes it per sample", state.stream_version)
    loader = make_loader(parts.data.train, sampler, cfg.data, pin)
    if isinstance(loader, IterableBatches):  # the user's stream: its position is checkpointed with the state
        loader.check(cfg.parallelism.global_batch, settings.grad_accum)
        loader.restore(state.data_state, resumed_from is not None, env.is_main, state.data_states)
        state.data_loader = loader
    return Feed(loader, pin)


def _step_inputs(run: Decided, ctx: StageContext, stages: list[Stage], trainable: Trainable, state: LoopState,
                 feed: Feed) -> StepInputs:
    """What `train_step` reads, each listed once before the first step."""
    cfg, device = run.cfg, run.env.device
    hooks = StepHooks.of(stages, loss_context_of(trainable.model))
    return StepInputs(
        cfg.trainer, state, ctx.task, iter(feed.loader), trainable=list(trainable.model.parameters()),
        autocast=ctx.autocast, name_part=record_function if hooks.name_parts else no_region, hooks=hooks,
        batch_device=device if device.type != "cpu" else None, pin=feed.pin,
        steps_schedule=schedule_changes_lr(cfg.optim), metrics_every_step=cfg.task.train_metrics == "every_step",
        global_batch=run.global_batch, pipeline=trainable.pipeline)


def _length(dataset: Any) -> int | None:
    return len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None


def _compiled(compile_cfg: CompileConfig) -> str:
    if not compile_cfg.enabled:
        return "eager"
    shapes = {None: "static shapes until one changes", True: "dynamic shapes", False: "a graph per shape"}
    mode = f" {compile_cfg.mode}" if compile_cfg.mode else ""
    return f"compiled ({compile_cfg.backend}{mode}, {shapes[compile_cfg.dynamic]})"
