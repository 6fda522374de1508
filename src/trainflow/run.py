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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.profiler import record_function

from trainflow.checkpoint import Checkpointer
from trainflow.compiler import Compiler
from trainflow.config import (
    CheckpointConfig,
    CompileConfig,
    OptimConfig,
    ParallelismConfig,
    ProfilerConfig,
    TrainerConfig,
    typed,
)
from trainflow.data import DataBundle, IterableBatches, StreamSampler, build_datasets, make_loader, to_device
from trainflow.distributed import DistEnv, memory_plan
from trainflow.distributed.failures import note_step
from trainflow.distributed.parallelism import no_grad_sync, parallelize, unwrap
from trainflow.distributed.parity import ParityCheck, parallelism_summary
from trainflow.distributed.process_group import process_group
from trainflow.distributed.watchdog import Watchdog
from trainflow.evaluation import Evaluation
from trainflow.limits import check_batch
from trainflow.metrics import (
    MetricsWriter,
    PeakMemory,
    Throughput,
    configure_matmul,
    count_train_flops,
    host_load,
    matmul_math,
    mfu,
    peak_flops,
    progress_reporter,
    write_json,
)
from trainflow.models import build_model
from trainflow.nonfinite import NonFiniteGuard
from trainflow.optim import build_optimizer, gradient_norm, lr_moves
from trainflow.profiler import Profiler
from trainflow.seeding import SEED_STRIDE, seed_everything
from trainflow.stages import LoopState, Stage
from trainflow.tasks import Task, add_metrics, build_task, probe
from trainflow.tensorboard import Dashboard
from trainflow.train_metrics import TrainMetrics

log = logging.getLogger("trainflow")


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train as the validated `cfg` says, in this process as one rank (of one or of the launcher's many); return
    the summary on rank 0 (None on other ranks)."""
    with process_group(cfg) as env:
        summary = _train(cfg, run_dir, env)
        gc.collect()  # whatever a reference cycle still holds goes too, while the process group lives
        return summary


def _train(cfg: DictConfig, run_dir: Path, env: DistEnv) -> dict[str, Any] | None:
    """A function of its own so that the model is freed when it returns, before the process group is destroyed:
    a DDP reducer freed after that waits forever in gloo's destructor, and the worker never exits."""
    training = assemble(cfg, run_dir, env)
    try:
        train_loop(training)
    except BaseException as exc:
        note_step(exc, training.state.step + 1)  # the step it failed in, for the launcher's account of it
        raise
    return summarize(training)


@dataclass
class Training:
    """What the assembly built: the loop, `train_step` and the summary read it."""

    cfg: DictConfig
    run_dir: Path
    env: DistEnv
    trainer: TrainerConfig  # a plain dataclass: DictConfig reads cost ~20 us each, too much for every step
    parallelism: ParallelismConfig  # as parallelism=auto decided it
    data: DataBundle
    task: Task
    metric_names: list[str]  # what the task reports besides the loss (from a probe before training)
    model: nn.Module
    trainable: list[nn.Parameter]  # the model's parameters, listed once (a generator each step costs ~3 us)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lr_moves: bool  # False: a constant schedule without warm-up is not stepped (~8 us a step)
    metrics_every_step: bool  # task.train_metrics=every_step; else the task's metrics at log steps only
    state: LoopState
    batches: Iterator[Any]
    pin: bool  # batches are pinned and copied asynchronously
    moves_batches: bool  # False on the CPU: the loader's tensors are already there, and the walk costs ~5 us a step
    autocast: Any
    region: Callable[[str], Any]  # names a part of the step for the profiler
    guard: NonFiniteGuard
    meter: Throughput
    stages: list[Stage]  # in the order they act after each step
    global_batch: int
    parameters: int
    flops_per_step: int | None
    flops_absent: str | None  # why the FLOPs (and so MFU) are unknown
    peak_flops: float | None
    parity: ParityCheck
    auto_plan: Any  # parallelism=auto's plan, checked against the measured peak at the end
    dashboard: Dashboard | None
    resumed_from: int | None


def assemble(cfg: DictConfig, run_dir: Path, env: DistEnv) -> Training:
    """Build everything, in the order the parts depend on each other."""
    trainer = _prepare(cfg, run_dir, env)
    data = build_datasets(cfg.data, cfg.model)
    model = build_model(cfg.model).to(env.device)
    parameters = sum(p.numel() for p in model.parameters())
    task = build_task(cfg.task, data.is_lm)
    first_two = data.train[torch.arange(min(2, len(data.train)))]  # two: items the collate cannot batch show
    metric_names = probe(task, model, to_device(first_two, env.device), data.name, cfg.model._target_)
    check_batch(cfg, trainer.batch_size, model, data.train, task, env.device)  # before a batch of that size
    example = data.train[torch.arange(trainer.batch_size)]
    flops_per_step, flops_absent = count_train_flops(model, example, task)
    if flops_per_step is not None:
        flops_per_step *= trainer.grad_accum
    auto_plan = None
    if cfg.parallelism.strategy == "auto":  # measures memory, decides, writes the decision into cfg.parallelism
        env, auto_plan = memory_plan.apply_auto(cfg, env, model, example, task)
    parallelism, optim = typed(cfg.parallelism, ParallelismConfig), typed(cfg.optim, OptimConfig)  # after auto
    parity = ParityCheck(parallelism, trainer, optim, cfg.data, env, model, data.train, task)  # refuses a wrapped model
    model = parallelize(model, parallelism, env, trainer.precision)
    seq_lens = cfg.data.get("seq_lens")  # a user's data section may have no such key
    compiler = Compiler(typed(cfg.compile, CompileConfig), trainer, list(seq_lens) if seq_lens else None, env, run_dir)
    model = compiler.apply(model, example, task)  # compile.check compares eager and compiled on `example`
    optimizer, scheduler = build_optimizer(model, optim, trainer.max_steps, env.device)
    state = LoopState(model, optimizer, scheduler)
    checkpointer = Checkpointer(typed(cfg.checkpoint, CheckpointConfig), env, run_dir)
    _seed_rank_then_resume(trainer.seed, env, checkpointer, state)
    resumed_from = state.step if state.step > 0 else None
    if resumed_from and resumed_from >= trainer.max_steps and env.is_main:  # a finished run started again
        log.warning("the checkpoint is at step %d, trainer.max_steps is %d: nothing left to train; raise "
                    "trainer.max_steps to continue this run", resumed_from, trainer.max_steps)

    global_batch = trainer.batch_size * env.world_size * trainer.grad_accum
    sampler = StreamSampler(len(data.train), trainer.batch_size, env.rank, env.world_size, trainer.seed,
                            state.samples_seen)
    pin = cfg.data.pin_memory is not False and env.device.type == "cuda"  # null: pinned on CUDA
    peak = peak_flops(env.device, trainer.precision, cfg.metrics.peak_flops)
    # even disabled, torch.autocast costs a few us a step: ~1% of the seed MLP's step, so fp32 skips it
    autocast = torch.autocast(env.device.type, torch.bfloat16) if trainer.precision == "bf16" \
        else contextlib.nullcontext()
    dashboard = Dashboard(trainer, optim, (run_dir / "config.yaml").read_text(), run_dir) \
        if env.is_main and cfg.logger.tensorboard else None  # config.yaml: written by _prepare on rank 0
    writer = MetricsWriter(run_dir, env.is_main, dashboard)
    guard = NonFiniteGuard(trainer.nonfinite, env, checkpointer)
    meter = Throughput(max([trainer.warmup_steps, compiler.excluded_steps(), parity.excluded_steps()]), env.device,
                       PeakMemory(env.device))
    profiler = Profiler(typed(cfg.profiler, ProfilerConfig), env, run_dir, trainer.max_steps, meter.excluded_steps,
                        state.step)
    train_metrics = TrainMetrics(env, meter, writer, progress_reporter(trainer.max_steps, trainer.progress,
                                                                       env.is_main, state.step),
                                 optimizer, task, trainer.grad_accum, flops_per_step, peak)
    evaluation = Evaluation(trainer, env, data, autocast, task, writer)
    watchdog = Watchdog(parallelism.watchdog, env, run_dir, meter.excluded_steps)
    # the guard checks before anything is logged or saved; the checkpointer comes last: it may stop the run
    stages: list[Stage] = [watchdog, compiler, parity, profiler, guard, train_metrics, evaluation, checkpointer]
    if env.is_main:
        log.info("model %s: %.2fM parameters; world size %d; global batch %d; task %s (monitor: val %s, %s); %s",
                 type(unwrap(model)).__name__, parameters / 1e6, env.world_size, global_batch, type(task).__name__,
                 task.monitor, task.mode, f"resumed at step {resumed_from}" if resumed_from else "fresh start")
        if data.val is None:
            log.info("%s gives no validation set: no evaluation", data.name)
    loader = make_loader(data.train, sampler, cfg.data, pin)
    if isinstance(loader, IterableBatches):  # the user's stream: its position is checkpointed with the state
        loader.check(parallelism.global_batch, trainer.grad_accum)
        loader.restore(state.data_state, resumed_from is not None, env.is_main)
        state.data_loader = loader
    return Training(
        cfg, run_dir, env, trainer, parallelism, data, task, metric_names, model, trainable=list(model.parameters()),
        optimizer=optimizer, scheduler=scheduler, lr_moves=lr_moves(optim),
        metrics_every_step=cfg.task.get("train_metrics") == "every_step", state=state, batches=iter(loader), pin=pin,
        moves_batches=env.device.type != "cpu", autocast=autocast,
        region=record_function if profiler.enabled else _unnamed, guard=guard, meter=meter, stages=stages,
        global_batch=global_batch, parameters=parameters, flops_per_step=flops_per_step, flops_absent=flops_absent,
        peak_flops=peak, parity=parity, auto_plan=auto_plan, dashboard=dashboard, resumed_from=resumed_from)


def _prepare(cfg: DictConfig, run_dir: Path, env: DistEnv) -> TrainerConfig:
    """The run's config (logged and saved), determinism, matmul precision, and the seed every rank shares."""
    trainer = typed(cfg.trainer, TrainerConfig)
    if env.is_main:
        log.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if trainer.deterministic != torch.are_deterministic_algorithms_enabled():  # the call imports inductor: 1.5 s
        torch.use_deterministic_algorithms(trainer.deterministic)
    configure_matmul(env.device, trainer.precision, trainer.tf32)
    seed_everything(trainer.seed)  # the same initial weights on every rank
    return trainer


def _seed_rank_then_resume(seed: int, env: DistEnv, checkpointer: Checkpointer, state: LoopState) -> None:
    """Per-rank randomness (dropout) from here on; then the resume, which restores every rank's generators, so
    that a resumed run continues their saved state instead of a fresh seed. One call, in this order only."""
    seed_everything(seed + SEED_STRIDE * env.rank)
    checkpointer.resume(state)


def train_step(training: Training) -> None:
    """One optimizer step: the micro-batches' forward and backward, the gradient norm (clipping), the update."""
    trainer, state, model, region, env, pin = (training.trainer, training.state, training.model, training.region,
                                               training.env, training.pin)
    task = training.task
    state.log_due = (state.step + 1) % trainer.log_every == 0 or state.step + 1 >= trainer.max_steps
    with_metrics = state.log_due or training.metrics_every_step
    data_wait, samples, tokens = 0.0, 0, 0  # of this rank's micro-batches, counted by the task
    step_loss = None  # this rank's loss of the step, on the device
    step_metrics: dict[str, torch.Tensor] = {}  # the task's metrics summed over the micro-steps, on the device
    for micro in range(trainer.grad_accum):
        with region("trainflow/data"):
            start = time.perf_counter()
            batch = next(training.batches)
            data_wait += time.perf_counter() - start  # the copy below may wait for the GPU: not data
            if training.moves_batches:
                batch = to_device(batch, env.device, non_blocking=pin)
            counted = task.count(batch)  # shapes only (data.seq_lens varies the tokens)
            samples, tokens = samples + counted[0], tokens + counted[1]
        with region("trainflow/forward_backward"), no_grad_sync(model, micro == trainer.grad_accum - 1):
            with training.autocast:
                loss, metrics = task(model, batch, with_metrics)
            loss_share = loss / trainer.grad_accum if trainer.grad_accum > 1 else loss
            loss_share.backward()
        step_loss = loss_share.detach() if step_loss is None else step_loss + loss_share.detach()
        if with_metrics:  # a user's task computes its metrics every step: kept as task.train_metrics says
            add_metrics(step_metrics, metrics)
    guard = training.guard
    with region("trainflow/optimizer"):
        norm_due = trainer.grad_clip or state.log_due or guard.skips  # the norm is a pass over all gradients
        state.grad_norm = gradient_norm(training.trainable, trainer.grad_clip) if norm_due else None
        state.skipped = guard.skips and guard.skip_update(state.step + 1, state.grad_norm)
        if state.skipped:
            guard.drop_update(training.optimizer, training.scheduler)
        else:
            training.optimizer.step()
            if training.lr_moves:
                training.scheduler.step()
            training.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen += training.global_batch
    state.steps_this_run += 1
    state.done = state.step >= trainer.max_steps
    state.loss, state.step_loss, state.data_wait_s = loss, step_loss, data_wait
    state.samples, state.tokens, state.metrics = samples, tokens, step_metrics


def train_loop(training: Training) -> None:
    """Steps until trainer.max_steps or a stage stops the run; after each, the enabled stages in order; the
    meter times it all, less what the stages report as paused. Then the stages close."""
    state, meter, max_steps = training.state, training.meter, training.trainer.max_steps
    world_size = training.env.world_size
    enabled = [stage for stage in training.stages if stage.enabled]  # a stage that is off costs nothing per step
    pausing = [stage for stage in enabled if type(stage).take_paused_s is not Stage.take_paused_s]
    training.model.train()
    with contextlib.ExitStack() as entered:
        for stage in enabled:
            entered.enter_context(stage)
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


def summarize(training: Training) -> dict[str, Any] | None:
    """summary.json (rank 0; every rank takes part in the stages' summaries, some of which gather)."""
    tr, env, trainer = training, training.env, training.trainer
    steady = tr.meter.steady_state()
    peak, flops_per_step = tr.peak_flops, tr.flops_per_step
    achieved = flops_per_step / steady["step_time_s"] if steady and flops_per_step else 0.0
    if peak and achieved > peak:  # MFU above 1: the cached CPU peak was measured under load
        peak = peak_flops(env.device, trainer.precision, tr.cfg.metrics.peak_flops, at_least=achieved)
    peak_memory = tr.meter.memory.summary()  # the training peak (CUDA: after the warm-up), also auto's check
    summary = {
        "steps": tr.state.step,
        "steps_this_run": tr.state.steps_this_run,
        "resumed_from_step": tr.resumed_from,
        "steady_state": steady,
        "mfu": mfu(flops_per_step, steady, peak),
        "mfu_absent": tr.flops_absent,  # why MFU is missing, when the FLOPs could not be counted
        "data_wait_fraction": steady["data_wait_fraction"] if steady else None,
        **peak_memory,
        "task": {"name": type(tr.task).__name__, "monitor": tr.task.monitor, "mode": tr.task.mode,
                 "metrics": tr.metric_names},
        "flops_per_step": flops_per_step,
        "peak_flops": peak,
        "parameters": tr.parameters,
        "world_size": env.world_size,
        "global_batch": tr.global_batch,
        "parallelism": parallelism_summary(tr.parallelism, trainer, env, steady, tr.parity),
        "device": str(env.device),
        "matmul_math": matmul_math(env.device, trainer.precision),
        **{stage.summary_key: stage.summary(steady) for stage in tr.stages if stage.summary_key},
        "host": host_load(),  # a report warns of figures measured on an overloaded machine
        "config": OmegaConf.to_container(tr.cfg, resolve=True),
    }
    if tr.auto_plan:
        summary["parallelism"]["plan"] = memory_plan.finish(tr.auto_plan, env.device, tr.model, tr.optimizer,
                                                            peak_memory["peak_memory_bytes"])
    if tr.dashboard is not None:
        tr.dashboard.finish(summary)
    if not env.is_main:
        return None
    write_json(tr.run_dir / "summary.json", summary)
    log.info("done: %d steps; steady state %s", tr.state.step,
             f"{steady['samples_per_sec']:.1f} samples/s, {steady['step_time_s'] * 1e3:.1f} ms/step"
             if steady else "not reached (too few steps after warm-up)")
    return summary


def _unnamed(_name: str) -> contextlib.nullcontext:
    return _NO_REGION


_NO_REGION = contextlib.nullcontext()  # reusable: it holds no state
