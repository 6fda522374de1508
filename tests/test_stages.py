"""The stage interface: the loop calls only the enabled stages, any stage can stop the run, and the throughput
meter leaves out what the stages report (excluded steps, paused time). In-process, on the seed MLP."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from trainflow.checkpoint import Checkpointer
from trainflow.compile.compiler import Compiler
from trainflow.conf import CONFIG_DIR
from trainflow.config.checks import check_config
from trainflow.config.schema import RunConfig
from trainflow.guards.parity import ParityCheck
from trainflow.loop.evaluation import Evaluation
from trainflow.loop.meter import PeakMemory, Throughput
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.profile.profiler import Profiler
from trainflow.run.assembly import STAGES

CPU = torch.device("cpu")


def seed_mlp_cfg(*overrides: str) -> RunConfig:
    """The typed config `run` gets (validation's), of the seed MLP with `overrides`."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return check_config(compose("train", overrides=["experiment=seed_mlp", "logger=none", "trainer.eval_steps=1",
                                                    "trainer.progress=log", *overrides]))


class StopAndPause(Stage):
    """A stage from outside trainflow: records its calls, pauses the clock at one step, stops the run at another,
    and asks the meter to leave its first steps out."""

    summary_key = "stop_and_pause"
    built: list[StopAndPause] = []  # what build() made, for the test to inspect

    def __init__(self, pause_at: int, pause_s: float, stop_at: int, excluded: int = 0) -> None:
        self.pause_at, self.pause_s, self.stop_at, self.excluded = pause_at, pause_s, stop_at, excluded
        self.steps: list[int] = []
        self.paused_s = 0.0
        self.entered = self.closed = False
        self.started_at: int | None = None

    @classmethod
    def build(cls, ctx: StageContext) -> StopAndPause:
        """Its settings from the run's config, as a stage of trainflow's own would read them."""
        stage = cls(pause_at=6, pause_s=1.5, stop_at=12, excluded=ctx.cfg.trainer.excluded_steps + 3)
        cls.built.append(stage)
        return stage

    def excluded_steps(self) -> int:
        return self.excluded

    def start(self, state: LoopState) -> None:
        self.started_at = state.step

    def __enter__(self) -> StopAndPause:
        self.entered = True
        return self

    def after_step(self, state: LoopState) -> bool:
        self.steps.append(state.step)
        if state.step == self.pause_at:
            start = time.perf_counter()
            time.sleep(self.pause_s)
            self.paused_s += time.perf_counter() - start
        return state.step == self.stop_at

    def take_paused_s(self) -> float:
        paused, self.paused_s = self.paused_s, 0.0
        return paused

    def close(self, state: LoopState) -> None:
        self.closed = True

    def summary(self, steady: dict | None) -> dict:
        return {"steps": len(self.steps)}


class Off(Stage):
    """A stage that is off: the loop must neither enter nor call it."""

    enabled = False

    @classmethod
    def build(cls, ctx: StageContext) -> Off:
        return cls()

    def __enter__(self) -> Off:
        raise AssertionError("an off stage was entered")

    def after_step(self, state: LoopState) -> bool:
        raise AssertionError("an off stage was called after a step")


def test_the_loop_calls_only_enabled_stages_and_any_stage_can_stop_it_and_pause_the_clock(tmp_path: Path) -> None:
    from trainflow.cli import register_with_hydra
    from trainflow.distributed.process_group import process_group
    from trainflow.run.assembly import assemble
    from trainflow.run.training import summarize, train_loop

    register_with_hydra()
    cfg = seed_mlp_cfg("trainer.max_steps=40", "trainer.excluded_steps=2", "trainer.log_every=5")
    StopAndPause.built.clear()
    with process_group(cfg) as env:
        # plugged in like trainflow's own
        run = assemble(cfg, tmp_path, env, {**STAGES, "off": Off, "stop_and_pause": StopAndPause})
        enabled = [type(stage).__name__ for stage in run.stages if stage.enabled]
        # compile, the profiler, the parity check and checkpoints are off in this experiment, and a CPU has no
        # energy counter for the cost stage: never called
        assert enabled == ["Fingerprint", "NonFiniteGuard", "TrainMetrics", "Evaluation", "StopAndPause"]
        (extra,) = StopAndPause.built
        assert extra.started_at == 0
        train_loop(run)
        summary = summarize(run)
        run.ctx.writer.close()
    assert extra.entered and extra.closed and extra.steps == list(range(1, 13))
    assert summary["steps"] == summary["steps_this_run"] == 12 and summary["stop_and_pause"] == {"steps": 12}
    steady = summary["steady_state"]
    # the new stage's excluded steps (warm-up + 3) are the most any stage asked for: the meter honours them
    assert steady["excluded_steps"] == 5 and steady["steps"] == 7
    # the 1.5 s pause is out of the steady state: 10 steps of a 0.03M-parameter MLP take far less (~5 ms on an
    # idle machine, under 1 s on this shared one at its busiest)
    assert steady["step_time_s"] * steady["steps"] < 1.5
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # the log steps 5 and 10
    assert summary["train_loss"]["first"] > summary["train_loss"]["last"] > 0
    assert summary["validation"] is None  # stopped before the end: as after a stop signal, no final evaluation


class EveryHook(Stage):
    """A stage from outside trainflow that answers every hook of the step: it names the step's parts, wraps the
    loss, wants the gradient norm on even steps, drops the update of step 3, and syncs after step 4."""

    phase = Phase.GUARD  # declared: after the non-finite guard, before the train metrics
    after = ("nonfinite",)
    names_step_parts = True
    summary_key = "every_hook"

    def __init__(self) -> None:
        self.wrapped = 0  # micro-batches computed inside its loss context
        self.asked_norm: list[int] = []
        self.seen: dict[int, dict] = {}  # per step: what the loop state said after it

    @classmethod
    def build(cls, ctx: StageContext) -> EveryHook:
        return cls()

    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        self.wrapped += 1
        yield

    def wants_grad_norm(self, step: int) -> bool:
        self.asked_norm.append(step)
        return step % 2 == 0

    def keeps_update(self, step: int, grad_norm: torch.Tensor | None) -> bool:
        return step != 3

    def syncs_after(self, step: int) -> bool:
        return step == 4

    def after_step(self, state: LoopState) -> bool:
        weights = torch.cat([p.detach().flatten() for p in state.model.parameters()]).clone()
        self.seen[state.step] = {"norm": state.grad_norm is not None, "skipped": state.skipped,
                                 "sync": state.sync_due, "weights": weights}
        return False

    def summary(self, steady: dict | None) -> dict:
        return {"wrapped": self.wrapped}


def test_a_stage_of_your_own_answers_every_hook_of_the_step_and_acts_in_its_declared_phase(tmp_path: Path) -> None:
    from trainflow.cli import register_with_hydra
    from trainflow.distributed.process_group import process_group
    from trainflow.loop.step import no_region
    from trainflow.run.assembly import assemble
    from trainflow.run.training import summarize, train_loop

    register_with_hydra()
    cfg = seed_mlp_cfg("trainer.max_steps=6", "trainer.grad_accum=2", "trainer.grad_clip=0",
                       "trainer.log_every=100", "parallelism.global_batch=null")
    with process_group(cfg) as env:
        run = assemble(cfg, tmp_path, env, {**STAGES, "every_hook": EveryHook})
        names = [type(stage).__name__ for stage in run.stages if stage.enabled]
        assert names == ["Fingerprint", "NonFiniteGuard", "EveryHook", "TrainMetrics", "Evaluation"]  # by phase
        assert run.step_inputs.name_part is not no_region  # it names the step's parts: the profiler's hook
        train_loop(run)
        summary = summarize(run)
        run.ctx.writer.close()
    (stage,) = [s for s in run.stages if isinstance(s, EveryHook)]
    assert summary["every_hook"] == {"wrapped": 12}  # 6 steps x 2 micro-batches, each inside its context
    assert stage.asked_norm == [1, 2, 3, 4, 5]  # step 6, the last, is a log step: its norm is measured anyway
    seen = stage.seen
    assert [seen[step]["norm"] for step in range(1, 7)] == [False, True, False, True, False, True]
    assert [seen[step]["skipped"] for step in range(1, 7)] == [False, False, True, False, False, False]
    assert torch.equal(seen[3]["weights"], seen[2]["weights"])  # the dropped update left the weights alone
    assert not torch.equal(seen[4]["weights"], seen[3]["weights"])
    # the first step and its own (step 4) are the sync points: no log or save step comes before the last
    assert [seen[step]["sync"] for step in range(1, 7)] == [True, False, False, True, False, True]


def test_stages_act_in_the_order_their_dependencies_declare_whatever_order_they_are_listed_in(
        tmp_path: Path) -> None:
    """The order of trainflow's stages comes from their phases and their before/after declarations (then their
    names), never from where STAGES lists them: listed the other way round, they act in the same order."""
    from trainflow.cli import register_with_hydra
    from trainflow.distributed.process_group import process_group
    from trainflow.run.assembly import assemble

    register_with_hydra()
    cfg = seed_mlp_cfg("trainer.max_steps=2")
    orders = []
    with process_group(cfg) as env:
        for listed in (STAGES, dict(reversed(STAGES.items()))):
            (tmp_path / str(len(orders))).mkdir()
            run = assemble(cfg, tmp_path / str(len(orders)), env, listed)
            run.ctx.writer.close()
            orders.append([stage.name for stage in run.stages])
    # the fingerprint and the cost measure the loop's window without the profiler's start and export (entered after
    # it, left before it); the train metrics time the log interval before the evaluation's pause is taken
    assert orders[0] == orders[1] == ["watchdog", "compile", "parity", "profiler", "cost", "fingerprint", "nonfinite",
                                      "stragglers", "train_metrics", "evaluation", "checkpoint", "fault_tolerance"]


def test_meter_times_only_the_excluded_steps_and_leaves_pauses_out_of_every_clock() -> None:
    meter = Throughput(2, CPU, PeakMemory(CPU))
    state = LoopState(nn.Linear(1, 1), None, None)
    meter.begin()
    step_times = []
    for step in range(1, 6):
        state.steps_this_run, state.data_wait_s = step, 0.001
        time.sleep(0.002)  # the step's work
        meter.end_step(state, samples=64, tokens=0)
        step_times.append(state.step_time_s)
        if step in (1, 3):  # paused work after an excluded step and after a steady one
            start = time.perf_counter()
            time.sleep(0.3)
            meter.pause(time.perf_counter() - start)
    meter.stop()
    assert step_times[2:] == [None, None, None]  # steady steps are not synced and timed one by one
    assert 0 < step_times[1] < 0.3  # the pause after step 1 is not step 2's time
    steady = meter.steady_state()
    assert steady["steps"] == 3 and steady["excluded_steps"] == 2
    assert steady["samples_per_sec"] == pytest.approx(3 * 64 / (3 * steady["step_time_s"]))
    assert steady["step_time_s"] * 3 < 0.3  # the pause after step 3 is out too
    assert steady["data_wait_fraction"] == pytest.approx(0.003 / (3 * steady["step_time_s"]))


def test_the_parity_check_refuses_a_model_parallelize_already_wrapped() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainflow.distributed.process_group import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="before parallelize"):
            cfg = seed_mlp_cfg()
            ParityCheck(cfg.parallelism, cfg.trainer, cfg.optim, cfg.data, DistEnv(0, 1, 0, CPU, "ddp"), wrapped,
                        None, None)
    finally:
        dist.destroy_process_group()


def test_stages_hold_their_typed_sections_in_a_launched_worker(tmp_path: Path) -> None:
    """A launched worker gets the typed config, pickled, as `launch` hands it over (no Hydra, no YAML): each stage
    gets its section as the schema's dataclass, with the composed values and the schema's defaults, and the run
    trains with them. What the run decides (the per-rank batch) makes a new config; the one it got is unchanged."""
    import pickle

    from trainflow.cli import register_with_hydra
    from trainflow.config.schema import CheckpointConfig, CompileConfig, ProfilerConfig, TrainerConfig
    from trainflow.distributed.process_group import process_group
    from trainflow.run.assembly import assemble
    from trainflow.run.training import summarize, train_loop

    register_with_hydra()
    validated = seed_mlp_cfg("trainer.max_steps=6", "trainer.eval_every=3", "trainer.excluded_steps=1",
                             "checkpoint.enabled=true", "checkpoint.every_steps=4", "checkpoint.keep_last=5",
                             "profiler.enabled=true", "profiler.skip_first=0", "profiler.wait=0", "profiler.warmup=1",
                             "profiler.active=2", "profiler.row_limit=7", "compile.backend=aot_eager",
                             "compile.fullgraph=true", "parallelism.check_tolerance=0.25", "optim.lr=0.03",
                             "logger=tensorboard")
    cfg = pickle.loads(pickle.dumps(validated))  # as the worker unpickles it (spawn)
    with process_group(cfg) as env:
        run = assemble(cfg, tmp_path, env)
        assert run.ctx.cfg is not cfg and cfg == validated  # what the run decides is a new config; cfg is as given
        stage = {type(stage): stage for stage in run.stages}
        compiler, parity, profiler = stage[Compiler], stage[ParityCheck], stage[Profiler]
        evaluation, checkpointer = stage[Evaluation], stage[Checkpointer]
        assert type(compiler.cfg) is CompileConfig and compiler.cfg.backend == "aot_eager" and compiler.cfg.fullgraph
        assert not compiler.enabled and compiler.cfg.check is False  # compile=off, check from the schema
        assert type(profiler.cfg) is ProfilerConfig and profiler.cfg.row_limit == 7 and profiler.cfg.ranks == [0]
        assert type(checkpointer.cfg) is CheckpointConfig
        assert (checkpointer.cfg.every_steps, checkpointer.cfg.keep_last, checkpointer.cfg.mode) == (4, 5, "sync")
        assert type(evaluation.settings) is TrainerConfig and evaluation.settings is run.step_inputs.settings
        assert (evaluation.every, evaluation.settings.eval_steps, evaluation.settings.batch_size) == (3, 1, 64)
        assert parity.tolerance == 0.25 and not parity.enabled  # one process: nothing to compare
        train_loop(run)
        summary = summarize(run)
        run.ctx.writer.close()
    assert summary["checkpoint"]["saves"] == 2  # step 4 and the final step 6
    assert summary["profiler"]["schedule"] == {"skip_first": 0, "wait": 0, "warmup": 1, "active": 2, "repeat": 1}
    assert summary["parallelism"]["per_rank_batch"] == 64 and summary["parallelism"]["global_batch"] == 64
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={TENSORS: 0})
    events.Reload()
    start = events.SummaryMetadata("_hparams_/session_start_info")
    hparams = metadata.parse_session_start_info_plugin_data(start.plugin_data.content).hparams
    assert hparams["optim.lr"].number_value == 0.03 and hparams["trainer.max_steps"].number_value == 6


def test_device_work_still_queued_counts_as_training_not_as_the_stages_pauses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host runs steps ahead of the device. Evaluation and a save wait for the device before they
    start their pause clocks, and the meter waits before it stops: a device sync that drains 0.25 s of queued
    steps here (each stage's sync, faked: no GPU on this machine) must land in the steady state's time, not in
    a pause that the steady state leaves out (the first GPU run's throughput was measured this way)."""
    import trainflow.checkpoint.checkpointer as checkpointer
    import trainflow.loop.evaluation as evaluation
    import trainflow.loop.meter as metrics
    from trainflow.cli import register_with_hydra
    from trainflow.distributed.process_group import process_group
    from trainflow.run.assembly import assemble
    from trainflow.run.training import summarize, train_loop

    drains: list[str] = []

    def drain_queue(module: str):
        def sync(device: torch.device) -> None:
            drains.append(module)
            time.sleep(0.25)
        return sync

    monkeypatch.setattr(evaluation, "device_sync", drain_queue("evaluation"))
    monkeypatch.setattr(checkpointer, "device_sync", drain_queue("checkpoint"))
    register_with_hydra()
    cfg = seed_mlp_cfg("trainer.max_steps=12", "trainer.excluded_steps=0", "trainer.log_every=100",
                       "trainer.eval_every=4", "checkpoint=dcp", "checkpoint.every_steps=4",
                       "checkpoint.save_final=false", f"checkpoint.dir={tmp_path / 'checkpoints'}")
    with process_group(cfg) as env:
        run = assemble(cfg, tmp_path, env)
        monkeypatch.setattr(metrics, "device_sync", drain_queue("meter"))  # after the set-up's own syncs
        train_loop(run)
        summary = summarize(run)
        run.ctx.writer.close()
    # the meter's start; steps 4 and 8: each stage before its clock; step 12: the last log's interval, the
    # evaluation, the save; the meter's stop
    assert drains == ["meter", *["evaluation", "checkpoint"] * 2, "meter", "evaluation", "checkpoint", "meter"]
    steady = summary["steady_state"]
    assert steady["steps"] == 12
    # every drain after the clock started is training time: 8 x 0.25 s (12 MLP steps take ~10 ms)
    assert steady["step_time_s"] * 12 >= 8 * 0.25
    assert summary["checkpoint"]["saves"] == 3
