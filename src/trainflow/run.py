"""The one training loop. Every option of every stage plugs in here; none forks it.

Order of assembly: distributed env -> data, model and task -> parallelize -> compile
-> optimizer -> resume -> loop -> summary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.profiler import record_function
from torch.utils.data import Dataset

from trainflow.checkpoint import Checkpointer, TrainState
from trainflow.compiler import Compiler
from trainflow.config import TrainerConfig
from trainflow.data import StreamSampler, build_datasets, make_loader, to_device
from trainflow.distributed import DistEnv, memory_plan
from trainflow.distributed.parallelize import no_grad_sync, parallelize, unwrap
from trainflow.distributed.parity import ParityCheck, parallelism_summary
from trainflow.distributed.process_group import all_reduce_mean, process_group
from trainflow.limits import check_batch
from trainflow.metrics import (
    MetricsWriter,
    PeakMemory,
    Throughput,
    configure_matmul,
    count_train_flops,
    matmul_math,
    mfu,
    peak_flops,
    progress_reporter,
    sync,
    write_json,
)
from trainflow.models import build_model
from trainflow.nonfinite import NonFiniteGuard
from trainflow.optim import build_optimizer
from trainflow.profiling import Profiler
from trainflow.seeding import SEED_STRIDE, seed_everything
from trainflow.tasks import Task, build_task, probe
from trainflow.tensorboard import Dashboard

log = logging.getLogger("trainflow")


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train as the validated `cfg` says, in this process as one rank (of one or of the launcher's many); return
    the summary on rank 0 (None on other ranks)."""
    with process_group(cfg) as env:
        return _train(cfg, run_dir, env)


def _train(cfg: DictConfig, run_dir: Path, env: DistEnv) -> dict[str, Any] | None:
    # A plain dataclass (also in launched workers, whose config is untyped): DictConfig reads cost ~20 us each.
    t = TrainerConfig(**OmegaConf.to_container(cfg.trainer, resolve=True))
    if env.is_main:
        log.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if t.deterministic != torch.are_deterministic_algorithms_enabled():  # the call imports inductor: 1.5 s
        torch.use_deterministic_algorithms(t.deterministic)
    configure_matmul(env.device, t.precision, t.tf32)
    seed_everything(t.seed)  # the same initial weights on every rank

    data = build_datasets(cfg.data, cfg.model)
    model = build_model(cfg.model).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    task = build_task(cfg.task, data.is_lm)
    first_two = data.train[torch.arange(min(2, len(data.train)))]  # two: items the collate cannot batch show
    metric_names = probe(task, model, to_device(first_two, env.device), data.name, cfg.model._target_)
    check_batch(cfg, t.batch_size, model, data.train, task, env.device)  # before a batch of that size exists
    example = data.train[torch.arange(t.batch_size)]
    flops_per_step, flops_absent = count_train_flops(model, example, task)
    if flops_per_step is not None:
        flops_per_step *= t.grad_accum
    auto = None
    if cfg.parallelism.strategy == "auto":  # measures memory, decides, writes the decision into cfg.parallelism
        env, auto = memory_plan.apply_auto(cfg, env, model, example, task)
    parity = ParityCheck(cfg, env, model, data.train, task)  # copies the model before wrapping
    model = parallelize(model, cfg.parallelism, env, t.precision)
    compiler = Compiler(cfg, env, run_dir)
    model = compiler.apply(model, example, task)  # compile.check compares eager and compiled on `example`
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps, env.device)

    seed_everything(t.seed + SEED_STRIDE * env.rank)  # per-rank randomness (dropout) from here on
    state = TrainState(model, optimizer, scheduler)
    checkpointer = Checkpointer(cfg.checkpoint, env, run_dir)
    guard = NonFiniteGuard(t.nonfinite, env, checkpointer.summary)
    checkpointer.resume(state)  # restores every rank's RNG too, so it comes after the seeding
    resumed_from = state.step if state.step > 0 else None
    if resumed_from and resumed_from >= t.max_steps and env.is_main:  # a finished run started again: nothing to do
        log.warning("the checkpoint is at step %d, trainer.max_steps is %d: nothing left to train; raise "
                    "trainer.max_steps to continue this run", resumed_from, t.max_steps)

    global_batch = t.batch_size * env.world_size * t.grad_accum
    sampler = StreamSampler(len(data.train), t.batch_size, env.rank, env.world_size, t.seed, state.samples_seen)
    pin = cfg.data.pin_memory is not False and env.device.type == "cuda"  # null: pinned on CUDA
    batches = iter(make_loader(data.train, sampler, cfg.data, pin))
    peak = peak_flops(env.device, t.precision, cfg.metrics.peak_flops)
    # even disabled, torch.autocast costs a few us a step: ~1% of the seed MLP's step, so fp32 skips it
    autocast = torch.autocast(env.device.type, torch.bfloat16) if t.precision == "bf16" else contextlib.nullcontext()
    dashboard = Dashboard(cfg, run_dir) if env.is_main and cfg.logger.tensorboard else None
    writer = MetricsWriter(run_dir, env.is_main, dashboard)
    progress = progress_reporter(t.max_steps, t.progress, env.is_main, state.step)
    throughput = Throughput(max(t.warmup_steps + compiler.excluded_steps(), parity.steps))
    profiler = Profiler(cfg.profiler, env, run_dir, t.max_steps, throughput.excluded_steps, state.step)
    label = record_function if profiler.on else _unlabelled  # region names only where a profiler records them
    if env.is_main:
        log.info("model %s: %.2fM parameters; world size %d; global batch %d; task %s (monitor: val %s, %s); %s",
                 type(unwrap(model)).__name__, n_params / 1e6, env.world_size, global_batch, type(task).__name__,
                 task.monitor, task.mode, f"resumed at step {resumed_from}" if resumed_from else "fresh start")
        if data.val is None:
            log.info("%s gives no validation set: no evaluation", data.name)

    first_loss: float | None = None
    interval = _new_interval(env.device)
    eval_every = t.eval_interval()
    val: dict[str, float] | None = None
    memory = PeakMemory(env.device)
    memory.reset()  # the FLOP count, compile.check and the parity copy are not training
    sync(env.device)
    tick = last_log = time.perf_counter()
    throughput.begin_if_due(0, tick)
    steps_this_run = 0
    values: dict[str, float] = {}
    save_every = int(cfg.checkpoint.every_steps) if checkpointer.enabled else 0
    grad_norm = None
    model.train()
    with profiler:
        while state.step < t.max_steps:
            data_wait, samples, tokens = 0.0, 0, 0  # of this rank's micro-batches, counted by the task
            step_loss = None  # this rank's loss of the step, on the device
            for micro in range(t.grad_accum):
                with label("trainflow/data"):
                    t0 = time.perf_counter()
                    batch = next(batches)
                    data_wait += time.perf_counter() - t0  # the copy below may wait for the GPU: not data
                    batch = to_device(batch, env.device, non_blocking=pin)
                    counted = task.count(batch)  # shapes only (data.seq_lens varies the tokens)
                    samples, tokens = samples + counted[0], tokens + counted[1]
                last = micro == t.grad_accum - 1
                with label("trainflow/forward_backward"), no_grad_sync(model, last):
                    with autocast:
                        loss, metrics = task(model, batch)
                    share = loss / t.grad_accum if t.grad_accum > 1 else loss
                    share.backward()
                step_loss = share.detach() if step_loss is None else step_loss + share.detach()
                _add_metrics(interval, metrics)
            log_due = (state.step + 1) % t.log_every == 0 or state.step + 1 >= t.max_steps
            with label("trainflow/optimizer"):
                norm_due = t.grad_clip or log_due or guard.skips  # the norm is a pass over all gradients
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf) if norm_due \
                    else None
                if guard.skips and guard.skip_update(state.step + 1, grad_norm):
                    guard.drop_update(optimizer, scheduler)
                    interval["skipped"] += 1
                else:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    interval["loss"] += step_loss
            state.step += 1
            guard.note(state.step, step_loss, grad_norm)
            parity.after_step(state.step, model, loss)
            state.samples_seen += global_batch
            steps_this_run += 1
            interval["steps"] += 1
            interval["data_wait"] += data_wait
            interval["tokens"] += tokens * env.world_size
            interval["samples"] += samples * env.world_size
            profiler.step()

            if steps_this_run <= throughput.excluded_steps:
                sync(env.device)
                now = time.perf_counter()
                compiler.on_step_end(state.step, now - tick)
                throughput.begin_if_due(steps_this_run, now)
                if steps_this_run == throughput.excluded_steps:
                    memory.reset()  # the steady state's peak leaves out compilation's
            else:
                throughput.add(samples * env.world_size, tokens * env.world_size, data_wait)
            tick = time.perf_counter()
            done = state.step >= t.max_steps
            if log_due or steps_this_run == 1 or (save_every and (done or state.step % save_every == 0)):
                guard.check()  # where the loop syncs anyway: nothing non-finite is logged as progress or saved
            if first_loss is None:
                first_loss = all_reduce_mean(loss.detach().clone(), env).item()  # all ranks' mean

            if log_due:
                sync(env.device)
                now = time.perf_counter()
                values = _interval_values(interval, now - last_log, optimizer, grad_norm, env, task,
                                          flops_per_step, peak, memory.take())
                writer.write(state.step, values)
                progress(state.step, values)
                interval = _new_interval(env.device)
                last_log = time.perf_counter()
            if data.val is not None and (done or (eval_every and state.step % eval_every == 0)):
                eval_start = time.perf_counter()
                val = evaluate(model, data.val, task, cfg, env, autocast)
                writer.write(state.step, {f"val/{k}": v for k, v in val.items()})
                if env.is_main:
                    log.info("step %d: val %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in val.items()))
                model.train()
                paused = time.perf_counter() - eval_start  # evaluation is not training time
                throughput.pause(paused)
                last_log += paused
            stop = checkpointer.after_step(state)
            paused = checkpointer.take_blocked_s()  # saving is not training time either
            throughput.pause(paused)
            last_log += paused
            if stop:
                break
    end = time.perf_counter()
    checkpointer.close(state)
    writer.close()
    progress(None, None)

    steady = throughput.figures(end)
    achieved = flops_per_step / steady["step_time_s"] if steady and flops_per_step else 0.0
    if peak and achieved > peak:  # MFU above 1: the cached CPU peak was measured under load
        peak = peak_flops(env.device, t.precision, cfg.metrics.peak_flops, at_least=achieved)
    peak_memory = memory.summary()  # the training peak (CUDA: after the warm-up), also what auto's plan is checked by
    summary = {
        "steps": state.step,
        "steps_this_run": steps_this_run,
        "resumed_from_step": resumed_from,
        "steady_state": steady,
        "mfu": mfu(flops_per_step, steady, peak),
        "mfu_absent": flops_absent,  # why MFU is missing, when the FLOPs could not be counted
        "data_wait_fraction": steady["data_wait_fraction"] if steady else None,
        **peak_memory,
        "loss": {"first": first_loss, "last": values.get("train/loss")},  # last: mean of the last log interval
        "val": val,
        "task": {"name": type(task).__name__, "monitor": task.monitor, "mode": task.mode, "metrics": metric_names},
        "flops_per_step": flops_per_step,
        "peak_flops": peak,
        "parameters": n_params,
        "world_size": env.world_size,
        "global_batch": global_batch,
        "parallelism": parallelism_summary(cfg, env, steady, parity),
        "device": str(env.device),
        "matmul_math": matmul_math(env.device, t.precision),
        "compile": compiler.summary(steady),
        "profiler": profiler.summary(),
        "checkpoint": checkpointer.summary(),
        "nonfinite": guard.summary(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if auto:
        summary["parallelism"]["plan"] = memory_plan.finish(auto, env.device, model, optimizer,
                                                            peak_memory["peak_memory_bytes"])
    if dashboard is not None:
        dashboard.finish(summary)
    if not env.is_main:
        return None
    write_json(run_dir / "summary.json", summary)
    log.info("done: %d steps; steady state %s", state.step,
             f"{steady['samples_per_sec']:.1f} samples/s, {steady['step_time_s'] * 1e3:.1f} ms/step"
             if steady else "not reached (too few steps after warm-up)")
    return summary


def _new_interval(device: torch.device) -> dict[str, Any]:
    """What the loop sums between two log steps (the loss stays on the device: no sync per step)."""
    return {"loss": torch.zeros((), device=device), "steps": 0, "skipped": 0, "data_wait": 0.0, "tokens": 0,
            "samples": 0, "metrics": {}, "micro_steps": 0}


def _add_metrics(interval: dict[str, Any], metrics: dict[str, torch.Tensor]) -> None:
    """Sum the task's metrics of a micro-step on the device (read, as a mean, at the next log step)."""
    for name, value in metrics.items():
        total = interval["metrics"].get(name)
        value = value.detach().float()
        interval["metrics"][name] = value if total is None else total + value
    interval["micro_steps"] += 1


def _unlabelled(_name: str) -> contextlib.nullcontext:
    return _NO_LABEL


_NO_LABEL = contextlib.nullcontext()  # reusable: it holds no state


def _interval_values(interval: dict, elapsed: float, optimizer, grad_norm: torch.Tensor, env: DistEnv,
                     task: Task, flops_per_step: int | None, peak: float | None, memory_bytes: int) -> dict:
    steps = interval["steps"]
    applied = steps - interval["skipped"]  # skip_step: the loss is the mean over the steps that were applied
    loss = all_reduce_mean(interval["loss"] / applied, env).item() if applied else math.nan
    step_time = elapsed / steps
    values = {
        "train/loss": loss,
        "train/lr": optimizer.param_groups[0]["lr"],
        "train/grad_norm": float(grad_norm),
        "perf/step_time_s": step_time,
        "perf/samples_per_sec": interval["samples"] / elapsed,
        "perf/data_wait_fraction": interval["data_wait"] / elapsed,
        "perf/memory_bytes": memory_bytes,
    }
    if task.is_lm:
        values["perf/tokens_per_sec"] = interval["tokens"] / elapsed
    if flops_per_step and peak:
        values["perf/mfu"] = flops_per_step / step_time / peak
    names = sorted(interval["metrics"])
    if names:  # one all-reduce for all of them
        sums = torch.stack([interval["metrics"][n] for n in names]) / interval["micro_steps"]
        values.update({f"train/{n}": v for n, v in zip(names, all_reduce_mean(sums, env).tolist(), strict=True)})
    return values


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, task: Task, cfg: DictConfig, env: DistEnv,
             autocast) -> dict[str, float]:
    """The task's loss and metrics, means over the same held-out batches every time (rank-strided, in order)."""
    model.eval()
    t = cfg.trainer
    sampler = StreamSampler(len(dataset), t.batch_size, env.rank, env.world_size, seed=0, shuffle=False)
    totals: dict[str, torch.Tensor] = {}
    for _, indices in zip(range(t.eval_steps), sampler, strict=False):
        batch = to_device(dataset[indices], env.device)
        with autocast:
            loss, metrics = task(model, batch)
        for name, value in {"loss": loss, **metrics}.items():
            value = value.detach().float()
            totals[name] = totals[name] + value if name in totals else value
    names = list(totals)
    means = all_reduce_mean(torch.stack([totals[n] for n in names]) / t.eval_steps, env).tolist()
    return task.finish(dict(zip(names, means, strict=True)))
