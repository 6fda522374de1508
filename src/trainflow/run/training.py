"""The one training loop, and a job around it. Every option of every stage plugs in here; none forks it.

`train` runs one rank's job: `assemble` (trainflow.run.assembly), then `train_loop` calls `train_step` (one optimizer
step) and the enabled stages after it, and `summarize` writes summary.json.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from pathlib import Path
from typing import Any

from trainflow.config.schema import RunConfig, plain
from trainflow.distributed import DistEnv, memory_plan
from trainflow.distributed.process_group import process_group
from trainflow.guards.parity import parallelism_summary
from trainflow.loggers import FAILED, FINISHED, KILLED
from trainflow.loop.meter import host_load
from trainflow.loop.stages import overrides
from trainflow.loop.step import train_step
from trainflow.metrics.flops import mfu, peak_flops
from trainflow.record import ledger
from trainflow.record.kept import keep_summary_aside
from trainflow.record.summary_file import FORMAT as SUMMARY_FORMAT
from trainflow.run.assembly import Assembly, assemble
from trainflow.util.console import end_lines
from trainflow.util.device import matmul_math
from trainflow.util.failures import note_step
from trainflow.util.files import write_json_atomic
from trainflow.util.rundir import results_begin

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
            note_step(exc, assembly.step_inputs.state.step + 1)  # the step it failed in: the launcher's account
            assembly.ctx.writer.finish(KILLED if isinstance(exc, KeyboardInterrupt) else FAILED)
            raise
    return summarize(assembly)


def train_loop(assembly: Assembly) -> None:
    """Steps until trainer.max_steps or a stage stops the run; after each, the enabled stages in order; the
    meter times it all, less what the stages report as paused. Then the stages close."""
    inputs = assembly.step_inputs
    state, max_steps, world_size = inputs.state, inputs.settings.max_steps, assembly.ctx.env.dp_size
    meter = state.meter
    enabled = [stage for stage in assembly.stages if stage.enabled]  # a stage that is off costs nothing per step
    pausing = [stage for stage in enabled if overrides(stage, "take_paused_s")]
    state.model.train()
    with contextlib.ExitStack() as entered:
        for stage in enabled:
            entered.enter_context(stage)
        results_begin()  # a failure from here on keeps the run directory with what the run wrote
        meter.begin()
        while state.step < max_steps:
            train_step(inputs)
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
    ctx, state = assembly.ctx, assembly.step_inputs.state
    env, settings, meter = ctx.env, ctx.cfg.trainer, state.meter
    steady = meter.steady_state()
    peak, flops_per_step = ctx.peak_flops, ctx.flops_per_step
    achieved = flops_per_step / steady["step_time_s"] if steady and flops_per_step else 0.0
    if peak and achieved > peak:  # MFU above 1: the cached CPU peak was measured under load
        peak = peak_flops(env.device, settings.precision, ctx.cfg.metrics.peak_flops, at_least=achieved)
    peak_memory = meter.memory.summary()  # the training peak (CUDA: after the warm-up), also auto's check
    summary = {
        "format": SUMMARY_FORMAT,  # readers tell the formats apart: trainflow.record.summary_file
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
        "global_batch": assembly.step_inputs.global_batch,
        "parallelism": parallelism_summary(ctx.cfg.parallelism, settings, env, steady),
        "device": str(env.device),
        "matmul_math": matmul_math(env.device, settings.precision),
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
    if assembly.step_inputs.pipeline:  # every rank takes part: the ranks' stages, time and memory are gathered
        summary["parallelism"]["pipeline"] = assembly.step_inputs.pipeline.summary(peak_memory["peak_memory_bytes"])
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
