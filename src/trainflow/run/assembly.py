"""The one training loop. Every option of every stage plugs in here; none forks it.

`assemble` builds everything, in order: distributed env -> data, model and task -> parallelize -> compile ->
optimizer -> per-rank seed -> resume -> stages. Then `train_loop` calls `train_step` (one optimizer step) and the
list of stages (stages.py) after it, and `summarize` writes summary.json.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.profiler import record_function

from trainflow.checkpoint import Checkpointer
from trainflow.checkpoint.store import resolve_dir
from trainflow.compile.compiler import Compiler
from trainflow.config.schema import CompileConfig, RunConfig, TrainerConfig, plain
from trainflow.data import IterableBatches, StreamSampler, build_datasets, make_loader, to_device
from trainflow.data.stream import STREAM_VERSION
from trainflow.distributed import DistEnv, memory_plan
from trainflow.distributed.parallelism import loss_context_of, parallelize, unwrap
from trainflow.distributed.pipeline import Pipeline, StageParts
from trainflow.distributed.process_group import per_rank_batch, process_group
from trainflow.guards.fault_tolerance import FaultTolerance, data_share, replica_groups
from trainflow.guards.nonfinite import NonFiniteGuard
from trainflow.guards.parity import ParityCheck, parallelism_summary
from trainflow.guards.stragglers import Stragglers
from trainflow.guards.watchdog import Watchdog
from trainflow.loggers import FAILED, FINISHED, KILLED, build_loggers
from trainflow.loggers.writer import MetricsWriter
from trainflow.loop.configured import configured_stages
from trainflow.loop.evaluation import Evaluation
from trainflow.loop.meter import PeakMemory, Throughput, host_load
from trainflow.loop.stages import Stage, StageContext, StepHooks, ordered, overrides
from trainflow.loop.state import LoopState
from trainflow.loop.step import Training, train_step, unnamed
from trainflow.loop.train_metrics import TrainMetrics
from trainflow.metrics.batch_fit import check_batch
from trainflow.metrics.flops import count_train_flops, mfu, peak_flops
from trainflow.models import build_model
from trainflow.optim import build_optimizer, schedule_changes_lr
from trainflow.profile.profiler import Profiler
from trainflow.record import ledger
from trainflow.record.cost import Cost
from trainflow.record.fingerprint import Fingerprint
from trainflow.record.kept import keep_summary_aside
from trainflow.record.summary_file import FORMAT as SUMMARY_FORMAT
from trainflow.tasks import build_task, probe
from trainflow.util.console import FILE_ONLY, RunFacts, end_lines, start_header
from trainflow.util.device import autocast_for, configure_matmul, matmul_math
from trainflow.util.failures import note_step
from trainflow.util.files import write_json_atomic
from trainflow.util.rundir import results_begin
from trainflow.util.seeding import SEED_STRIDE, seed_everything
from trainflow.util.targets import origins

log = logging.getLogger("trainflow")


def train(cfg: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train as the validated, typed `cfg` says, in this process as one rank (of one or of the launcher's many); return
    the summary on rank 0 (None on other ranks)."""
    with process_group(cfg) as env:
        summary = _assemble_and_train(cfg, run_dir, env)
        gc.collect()  # whatever a reference cycle still holds goes too, while the process group lives
        return summary


def _assemble_and_train(cfg: RunConfig, run_dir: Path, env: DistEnv) -> dict[str, Any] | None:
    """A function of its own so that the model is freed when it returns, before the process group is destroyed:
    a DDP reducer freed after that waits forever in gloo's destructor, and the worker never exits."""
    assembly = assemble(cfg, run_dir, env)
    with contextlib.closing(assembly.ctx.writer):  # the assembly built it: the run closes it, not a stage
        try:
            train_loop(assembly)
        except BaseException as exc:
            note_step(exc, assembly.training.state.step + 1)  # the step it failed in, for the launcher's account of it
            assembly.ctx.writer.finish(KILLED if isinstance(exc, KeyboardInterrupt) else FAILED)
            raise
    return summarize(assembly)


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
    training: Training
    stages: list[Stage]  # in the order they act after each step
    metric_names: list[str]  # what the task reports besides the loss (from a probe before training)
    parameters: int
    flops_absent: str | None  # why the FLOPs (and so MFU) are unknown
    auto_plan: Any  # parallelism=auto's plan, checked against the measured peak at the end
    resumed_from: int | None
    started: float  # time.monotonic() when the assembly began: the run's wall time is counted from there


def assemble(cfg: RunConfig, run_dir: Path, env: DistEnv,
             stage_types: Mapping[str, type[Stage]] = STAGES) -> Assembly:
    """Build everything, in the order the parts depend on each other. What the run decides (the per-rank batch,
    parallelism=auto's layout) makes a new typed config: nothing writes into a config after validation."""
    started = time.monotonic()
    replicas = replica_groups(cfg.parallelism)  # torchft's replica groups share the data stream (1: none)
    auto = cfg.parallelism.strategy == "auto"  # measures memory and decides (below): its batch spans what it may pick
    ranks = memory_plan.probe_ranks(cfg, env.world_size) if auto else env.dp_size
    cfg = replace(cfg, trainer=replace(cfg.trainer, batch_size=per_rank_batch(cfg, ranks * replicas)))
    trainer = _set_up_process(cfg, run_dir, env)
    loggers = build_loggers(cfg.logger) if env.is_main else {}  # a missing extra stops the run here, in one line
    data = build_datasets(cfg.data, "vocab_size" in cfg.model)
    model = build_model(cfg.model).to(env.device)
    parameters = sum(p.numel() for p in model.parameters())
    task = build_task(cfg.task, data.is_lm)
    first_two = data.train[torch.arange(min(2, len(data.train)))]  # two: items the collate cannot batch show
    metric_names = probe(task, model, to_device(first_two, env.device), data.name, cfg.model["_target_"])
    check_batch(cfg, trainer.batch_size, model, data.train, task, env.device)  # before a batch of that size
    example = data.train[torch.arange(trainer.batch_size)]
    auto_plan = None
    if auto:  # the layout, and with tensor parallel a TP group's batch (the global batch stays)
        env, auto_plan = memory_plan.apply_auto(cfg, env, model, example, task)
        cfg = replace(cfg, parallelism=auto_plan.parallelism,
                      trainer=replace(trainer, batch_size=auto_plan.batch_size))
        if auto_plan.batch_size != trainer.batch_size:  # a TP group's batch: checked as the first one was
            trainer = cfg.trainer
            check_batch(cfg, trainer.batch_size, model, data.train, task, env.device)
            example = data.train[torch.arange(trainer.batch_size)]
    flops_per_step, flops_absent = count_train_flops(model, example, task)
    if flops_per_step is not None:  # per device: a TP group and a pipeline's stages share their batch's work
        flops_per_step = flops_per_step * trainer.grad_accum // (env.tp * env.pp)
    parallelism, optim = cfg.parallelism, cfg.optim  # after auto
    autocast = autocast_for(env.device, trainer.precision)
    meter = Throughput(trainer.excluded_steps, env.device, PeakMemory(env.device))
    ctx = StageContext(cfg, run_dir, env, trainer, parallelism, optim, data, task, model, example, autocast,
                       MetricsWriter(run_dir, env.is_main, loggers), meter, flops_per_step,
                       peak_flops(env.device, trainer.precision, cfg.metrics.peak_flops))
    stages = ordered([*_built(stage_types, ctx), *configured_stages(cfg.stages, ctx, set(stage_types))])
    meter.excluded_steps = max([trainer.excluded_steps, *(stage.excluded_steps() for stage in stages)])
    whole = model
    model = parallelize(model, parallelism, env, trainer.precision, trainer.fp8_recipe)
    for stage in stages:
        model = stage.wrap_model(model)  # compile; compile.check compares eager and compiled on `example`
    pipeline = Pipeline(model, parallelism.pp_schedule, task, trainer.batch_size, trainer.grad_accum,
                        parallelism.microbatches, metric_names, env, whole, meter.excluded_steps) \
        if isinstance(model, StageParts) else None
    optimizer, scheduler = build_optimizer(model, optim, trainer.max_steps, env.device)
    global_batch = trainer.batch_size * env.dp_size * replicas * trainer.grad_accum  # a TP group reads one batch
    state = LoopState(model, optimizer, scheduler, data_identity=data.identity,  # a resume compares them
                      stage_states={stage.name: stage for stage in stages if overrides(stage, "state_dict")},
                      layout={"trainer.batch_size": trainer.batch_size, "trainer.grad_accum": trainer.grad_accum,
                              "global batch": global_batch})
    # per-rank randomness (dropout) from here on; then a resume restores every rank's saved generators
    seed_everything(trainer.seed + SEED_STRIDE * env.rank)
    for stage in stages:
        stage.resume(state)
    resumed_from = state.step if state.step > 0 else None  # from a checkpoint (a heal from a peer says its own)
    for stage in stages:
        stage.start(state)
    checkpoint_dir = resolve_dir(cfg.checkpoint.dir, run_dir) if cfg.checkpoint.enabled else None
    # a tracker that cannot be reached stops the run here; the tracked runs' ids go into the next checkpoints
    state.tracked_runs = ctx.writer.start(cfg, env.world_size, resumed_from, state.tracked_runs,
                                          state.resumed_checkpoint, checkpoint_dir)
    if resumed_from and resumed_from >= trainer.max_steps and env.is_main:  # a finished run started again
        log.warning("the checkpoint is at step %d, trainer.max_steps is %d: nothing left to train; raise "
                    "trainer.max_steps to continue this run", resumed_from, trainer.max_steps)
    if env.is_main:
        log.info("%s", start_header(RunFacts(
            type(unwrap(whole)).__name__, parameters, data.name, len(data.train), _length(data.val), data.seq_len,
            type(task).__name__, task.monitor, task.mode, str(env.device), env.world_size, parallelism.strategy,
            trainer.precision, _compiled(cfg.compile), global_batch, trainer.max_steps, resumed_from, run_dir,
            checkpoint_dir, tuple(cfg.logger), origins(cfg))))
    pin = cfg.data["pin_memory"] is not False and env.device.type == "cuda"  # null: pinned on CUDA
    sampler = StreamSampler(len(data.train), trainer.batch_size, *data_share(parallelism, env), trainer.seed,
                            state.samples_seen, version=state.stream_version)
    if state.stream_version != STREAM_VERSION and env.is_main:
        log.info("data: the checkpoint's stream is of version %d (an epoch's order held in memory, 8 bytes a "
                 "sample): the run continues in that order; a fresh run computes it per sample", state.stream_version)
    loader = make_loader(data.train, sampler, cfg.data, pin)
    if isinstance(loader, IterableBatches):  # the user's stream: its position is checkpointed with the state
        loader.check(parallelism.global_batch, trainer.grad_accum)
        loader.restore(state.data_state, resumed_from is not None, env.is_main, state.data_states)
        state.data_loader = loader
    hooks = StepHooks.of(stages)
    training = Training(
        trainer, state, task, iter(loader), trainable=list(model.parameters()), autocast=autocast,
        name_part=record_function if hooks.name_parts else unnamed, hooks=hooks,
        batch_device=env.device if env.device.type != "cpu" else None, pin=pin,
        steps_schedule=schedule_changes_lr(optim), metrics_every_step=cfg.task["train_metrics"] == "every_step",
        global_batch=global_batch, loss_context=loss_context_of(model), pipeline=pipeline)
    return Assembly(ctx, training, stages, metric_names, parameters, flops_absent, auto_plan, resumed_from, started)


def _built(stage_types: Mapping[str, type[Stage]], ctx: StageContext) -> list[Stage]:
    """trainflow's own stages, each named by its key (before parallelize: the parity check copies the model)."""
    stages = []
    for name, stage_type in stage_types.items():
        stage = stage_type.build(ctx)
        stage.name = name
        stages.append(stage)
    return stages


def _length(dataset: Any) -> int | None:
    return len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None


def _compiled(compile_cfg: CompileConfig) -> str:
    if not compile_cfg.enabled:
        return "eager"
    shapes = {None: "static shapes until one changes", True: "dynamic shapes", False: "a graph per shape"}
    mode = f" {compile_cfg.mode}" if compile_cfg.mode else ""
    return f"compiled ({compile_cfg.backend}{mode}, {shapes[compile_cfg.dynamic]})"


def _set_up_process(cfg: RunConfig, run_dir: Path, env: DistEnv) -> TrainerConfig:
    """The run's config (logged and saved), determinism, matmul precision, and the seed every rank shares."""
    trainer = cfg.trainer
    if env.is_main:
        text = OmegaConf.to_yaml(plain(cfg))
        log.info("config:\n%s", text, extra=None if trainer.print_config else FILE_ONLY)
        (run_dir / "config.yaml").write_text(text)
    if trainer.deterministic != torch.are_deterministic_algorithms_enabled():  # the call imports inductor: 1.5 s
        torch.use_deterministic_algorithms(trainer.deterministic)
    configure_matmul(env.device, trainer.precision, trainer.tf32)
    seed_everything(trainer.seed)  # the same initial weights on every rank
    return trainer


def train_loop(assembly: Assembly) -> None:
    """Steps until trainer.max_steps or a stage stops the run; after each, the enabled stages in order; the
    meter times it all, less what the stages report as paused. Then the stages close."""
    training, meter = assembly.training, assembly.ctx.meter
    state, max_steps, world_size = training.state, training.trainer.max_steps, assembly.ctx.env.dp_size
    enabled = [stage for stage in assembly.stages if stage.enabled]  # a stage that is off costs nothing per step
    pausing = [stage for stage in enabled if overrides(stage, "take_paused_s")]
    state.model.train()
    with contextlib.ExitStack() as entered:
        for stage in enabled:
            entered.enter_context(stage)
        results_begin()  # a failure from here on keeps the run directory with what the run wrote
        meter.begin()
        while state.step < max_steps:
            train_step(training)
            meter.end_step(state, state.samples * world_size, state.tokens * world_size)
            stop = False
            for stage in enabled:
                stop = stage.after_step(state) or stop
            for stage in pausing:
                meter.pause(stage.take_paused_s())
            if stop:
                break
        meter.stop()
    for stage in enabled:
        stage.close(state)


def summarize(assembly: Assembly) -> dict[str, Any] | None:
    """summary.json (rank 0; every rank takes part in the stages' summaries, some of which gather)."""
    ctx, state = assembly.ctx, assembly.training.state
    env, trainer = ctx.env, ctx.trainer
    steady = ctx.meter.steady_state()
    peak, flops_per_step = ctx.peak_flops, ctx.flops_per_step
    achieved = flops_per_step / steady["step_time_s"] if steady and flops_per_step else 0.0
    if peak and achieved > peak:  # MFU above 1: the cached CPU peak was measured under load
        peak = peak_flops(env.device, trainer.precision, ctx.cfg.metrics.peak_flops, at_least=achieved)
    peak_memory = ctx.meter.memory.summary()  # the training peak (CUDA: after the warm-up), also auto's check
    summary = {
        "format": SUMMARY_FORMAT,  # readers tell the formats apart: trainflow.report.summary_file
        "steps": state.step,
        "steps_this_run": state.steps_this_run,
        "resumed_from_step": assembly.resumed_from,
        "steady_state": steady,
        "mfu": mfu(flops_per_step, steady, peak),
        "mfu_absent": assembly.flops_absent,  # why MFU is missing, when the FLOPs could not be counted
        "data_wait_fraction": steady["data_wait_fraction"] if steady else None,
        **peak_memory,
        "task": {"name": type(ctx.task).__name__, "monitor": ctx.task.monitor, "mode": ctx.task.mode,
                 "metrics": assembly.metric_names},
        "flops_per_step": flops_per_step,
        "peak_flops": peak,
        "parameters": assembly.parameters,
        "world_size": env.world_size,
        "global_batch": assembly.training.global_batch,
        "parallelism": parallelism_summary(ctx.parallelism, trainer, env, steady),
        "device": str(env.device),
        "matmul_math": matmul_math(env.device, trainer.precision),
    }
    for stage in assembly.stages:  # every stage is asked, enabled or not: some gather from all ranks
        if stage.summary_key:
            *outer, key = stage.summary_key.split(".")
            place = summary
            for name in outer:
                place = place.setdefault(name, {})
            place[key] = stage.summary(steady)
    summary["host"] = host_load()  # a report warns of figures measured on an overloaded machine
    summary["config"] = plain(ctx.cfg)
    if assembly.training.pipeline:  # every rank takes part: the ranks' stages, time and memory are gathered
        summary["parallelism"]["pipeline"] = assembly.training.pipeline.summary(peak_memory["peak_memory_bytes"])
    if assembly.auto_plan:
        summary["parallelism"]["plan"] = memory_plan.finish(assembly.auto_plan, env.device, state.model,
                                                            state.optimizer, peak_memory["peak_memory_bytes"])
    if not env.is_main:
        return None
    if aside := keep_summary_aside(ctx.run_dir, summary["config"]):  # an earlier config's figures stay
        log.info("the earlier summary.json of this folder (another config) is kept as %s", aside)
    write_json_atomic(ctx.run_dir / "summary.json", summary)
    ledger.record(ctx.cfg.metrics, ctx.run_dir, summary)  # the run's line, for trainflow ledger and compare
    ctx.writer.finish(KILLED if (summary.get("checkpoint") or {}).get("stopped_by") else FINISHED, summary)
    committed = bool((summary.get("checkpoint") or {}).get("committed"))
    wall_s = time.monotonic() - assembly.started
    log.info("%s", end_lines(summary, ctx.run_dir, wall_s, tuple(ctx.cfg.logger), committed))
    return summary
