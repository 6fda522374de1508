"""Stages of your own from the config (`stages=[...]`, `+stages.<name>._target_=...`), and trainflow's two built-in
ones: early stopping and the exponential moving average of the weights. Real runs of the seed MLP."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import torch
from helpers.runs import ok, one_line_error, train, trainflow

from trainflow.checkpoint.export import EMA_PREFIX, Source
from trainflow.checkpoint.store import MODEL_PREFIX, list_committed

SEED_MLP = ["experiment=seed_mlp", "logger=none", "trainer.eval_steps=2", "trainer.log_every=2",
            "trainer.excluded_steps=1"]

RECORDER = '''
from trainflow.loop.stages import Stage

CALLS = []  # (stage, step) of every after_step of the run, in the order the loop made them


class Recorder(Stage):
    """Records what each hook saw."""

    after = ("evaluation",)

    def __init__(self, every: int = 1, fail_at: int = 0) -> None:
        self.every, self.fail_at = every, fail_at
        self.seen = {"steps": [], "evaluated": []}

    def setup(self, ctx):
        self.summary_key = f"recorder_{self.name}"
        self.seen["setup"] = {"max_steps": ctx.cfg.trainer.max_steps, "run_dir": str(ctx.run_dir)}

    def wrap_model(self, model):
        self.seen["parameters"] = sum(p.numel() for p in model.parameters())
        return model

    def start(self, state):
        self.seen["started_at"] = state.step

    def after_step(self, state):
        if state.step == self.fail_at:
            raise RuntimeError("the stage broke on purpose")
        CALLS.append([self.name, state.step])
        if state.step % self.every == 0:
            self.seen["steps"].append(state.step)
        if state.validation is not None and state.validation.step == state.step:
            self.seen["evaluated"].append([state.step, round(state.validation.figures["loss"], 6)])
        return False

    def close(self, state):
        self.seen["closed_at"] = state.step

    def summary(self, steady):
        return {**self.seen, "calls": CALLS}
'''


def stage_package(tmp_path: Path) -> dict[str, str]:
    """A package of one's own (mystages, outside trainflow) and a config folder adding it as stages=[recorder]; the
    environment that puts it on PYTHONPATH."""
    (tmp_path / "code" / "mystages").mkdir(parents=True)
    (tmp_path / "code" / "mystages" / "__init__.py").write_text(RECORDER)
    (tmp_path / "conf" / "stages").mkdir(parents=True)
    (tmp_path / "conf" / "stages" / "recorder.yaml").write_text(textwrap.dedent("""\
        recorder:
          _target_: mystages.Recorder
          every: 2
        """))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "code"), os.environ.get("PYTHONPATH", "")])}


def test_a_stage_of_your_own_runs_from_yaml_and_the_command_line_through_every_hook_in_declared_order(
        tmp_path: Path) -> None:
    env = stage_package(tmp_path)
    run = ok(train(tmp_path / "run", "--config-dir", str(tmp_path / "conf"), *SEED_MLP, "trainer.max_steps=6",
                   "trainer.eval_every=3", "stages=[recorder]", "+stages.cli._target_=mystages.Recorder",
                   "+stages.cli.before=recorder", env=env))
    summary = run.summary
    yaml_stage, cli_stage = summary["recorder_recorder"], summary["recorder_cli"]
    assert yaml_stage["setup"] == cli_stage["setup"] == {"max_steps": 6, "run_dir": str(tmp_path / "run")}
    assert yaml_stage["parameters"] == cli_stage["parameters"] == summary["parameters"]
    assert yaml_stage["started_at"] == cli_stage["started_at"] == 0
    assert yaml_stage["steps"] == [2, 4, 6] and cli_stage["steps"] == [1, 2, 3, 4, 5, 6]  # every=2 from the YAML
    assert yaml_stage["closed_at"] == cli_stage["closed_at"] == 6
    # after the evaluation of the step (declared): the figures it logged
    val = {m["step"]: round(m["val/loss"], 6) for m in run.metrics() if "val/loss" in m}
    assert yaml_stage["evaluated"] == cli_stage["evaluated"] == [[3, val[3]], [6, val[6]]]
    # the command line's stage declared itself before the YAML's, listed after it: it acts first at every step
    assert cli_stage["calls"] == [[name, step] for step in range(1, 7) for name in ("cli", "recorder")]


def test_a_key_the_stage_does_not_take_a_target_that_is_no_stage_and_an_order_against_the_phases_are_one_line(
        tmp_path: Path) -> None:
    one_line_error(train(tmp_path / "key", *SEED_MLP, "trainer.max_steps=2", "stages=[early_stopping]",
                         "+stages.early_stopping.patiense=2"),
                   "stages.early_stopping.patiense: trainflow.stages.early_stopping.EarlyStopping takes no such "
                   "argument; did you mean stages.early_stopping.patience?")
    one_line_error(train(tmp_path / "target", *SEED_MLP, "trainer.max_steps=2",
                         "+stages.mine._target_=collections.OrderedDict"),
                   "stages.mine._target_: collections.OrderedDict is not a trainflow stage")
    one_line_error(train(tmp_path / "order", *SEED_MLP, "trainer.max_steps=2", "stages=[early_stopping]",
                         "+stages.early_stopping.before=watchdog"),
                   "stages.early_stopping.before: early_stopping (CONFIGURED) cannot act before watchdog (TIME)")


def test_a_stage_that_raises_is_one_line_naming_it_and_the_committed_checkpoints_resume(tmp_path: Path) -> None:
    env = stage_package(tmp_path)
    overrides = [*SEED_MLP, "checkpoint=dcp", "checkpoint.every_steps=2", "trainer.max_steps=6",
                 "trainer.run_name=boom"]  # the same run, with the stage and without
    failed = train(tmp_path / "run", *overrides, "+stages.boom._target_=mystages.Recorder", "+stages.boom.fail_at=5",
                   env=env)
    one_line_error(failed, "stages.boom: after_step at step 5 failed: RuntimeError: the stage broke on purpose",
                   exit_code=1, alone=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [c.path.name for c in list_committed(checkpoints)] == ["step_00000002", "step_00000004"]
    assert not any(p.name.startswith(".tmp") for p in checkpoints.iterdir())  # nothing half-written
    # the same run without the stage, and with one its checkpoints were saved without: that one starts afresh
    resumed = ok(train(tmp_path / "run", *overrides, "stages=[ema]"))
    assert resumed.summary["resumed_from_step"] == 4 and resumed.summary["steps"] == 6
    assert resumed.summary["ema"]["updates"] == 2  # steps 5 and 6
    log = (tmp_path / "run" / "train.log").read_text()
    assert "holds no state of stage ema (saved without it): it starts afresh" in log


def test_early_stopping_stops_when_val_loss_stops_improving_and_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    """Four steps that improve, then lr=1e-30 (the config's LR wins on a resume): every update rounds away, the
    weights stay, so val loss stops improving; with patience 2 the run stops at the second evaluation after the
    best, keeping the best checkpoint although checkpoint.keep_last=1."""
    overrides = [*SEED_MLP, "checkpoint=dcp", "checkpoint.every_steps=100", "checkpoint.keep_last=1",
                 "trainer.eval_every=2", "stages=[early_stopping]", "stages.early_stopping.patience=2",
                 "trainer.run_name=es"]
    run_dir = tmp_path / "run"
    first = ok(train(run_dir, *overrides, "trainer.max_steps=4")).summary
    val = {m["step"]: m["val/loss"] for m in train_metrics(run_dir)}
    assert val[4] < val[2] and first["early_stopping"]["best_step"] == 4
    second = ok(train(run_dir, *overrides, "trainer.max_steps=20", "optim.lr=1e-30")).summary
    stopped = second["early_stopping"]
    val = {m["step"]: m["val/loss"] for m in train_metrics(run_dir)}
    assert val[6] == val[8] == val[4]  # no improvement at all: the weights did not move
    assert second["resumed_from_step"] == 4 and second["steps"] == 8  # stopped at the evaluation of step 8
    assert stopped["best_step"] == 4 and stopped["stopped_at_step"] == 8 and stopped["best"] == val[4]
    assert stopped["best_checkpoint"] == str(run_dir / "checkpoints" / "step_00000004")
    assert "did not improve by more than 0 in 2 evaluations (best" in stopped["reason"]
    assert second["checkpoint"]["committed"] == ["step_00000004", "step_00000008"]  # the best and the newest
    assert second["checkpoint"]["stopped_by"] is None  # it ended as finished (exit 0), not as interrupted


def train_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "val/loss" in line]


def ema_tensors(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the average, the trained weights) a checkpoint holds, by weight name."""
    source = Source(checkpoint)
    averaged = source.read([k for k in source.tensors if k.startswith(EMA_PREFIX)])
    weights = source.read([k for k in source.tensors if k.startswith(MODEL_PREFIX)])
    return ({k.removeprefix(EMA_PREFIX): v for k, v in averaged.items()},
            {k.removeprefix(MODEL_PREFIX): v for k, v in weights.items()})


def test_the_ema_resumes_exactly_is_evaluated_and_exported(tmp_path: Path) -> None:
    overrides = [*SEED_MLP, "checkpoint=dcp", "checkpoint.every_steps=4", "trainer.eval_every=4", "stages=[ema]",
                 "stages.ema.decay=0.9", "stages.ema.start=2", "stages.ema.evaluate=true"]
    whole = ok(train(tmp_path / "whole", *overrides, "trainer.max_steps=8"))
    ok(train(tmp_path / "parts", *overrides, "trainer.max_steps=4"))
    resumed = ok(train(tmp_path / "parts", *overrides, "trainer.max_steps=8"))
    assert resumed.summary["resumed_from_step"] == 4
    averaged, weights = ema_tensors(tmp_path / "whole" / "checkpoints" / "step_00000008")
    averaged_resumed, _ = ema_tensors(tmp_path / "parts" / "checkpoints" / "step_00000008")
    assert averaged.keys() == weights.keys() and averaged
    assert all(torch.equal(averaged[k], averaged_resumed[k]) for k in averaged)  # bit for bit
    assert not any(torch.equal(averaged[k], weights[k]) for k in averaged)  # an average, not the weights
    assert whole.summary["ema"]["updates"] == resumed.summary["ema"]["updates"] == 7  # steps 2..8
    # evaluated with the average at each evaluation, beside the weights' own figures
    ema_loss = {m["step"]: m["val/ema_loss"] for m in whole.metrics() if "val/ema_loss" in m}
    assert sorted(ema_loss) == [4, 8] and ema_loss[8] != whole.summary["validation"]["loss"]
    assert whole.summary["ema"]["validation"]["loss"] == ema_loss[8]
    # exported in place of the weights
    exported = trainflow("export", tmp_path / "whole", tmp_path / "ema.pt", "--ema")
    assert exported.returncode == 0, exported.stderr
    loaded = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert loaded.keys() == averaged.keys() and all(torch.equal(loaded[k], averaged[k]) for k in averaged)
    refused = trainflow("export", tmp_path / "whole", tmp_path / "dcp", "--ema", "--format", "dcp")
    one_line_error(refused, "export --ema: --format dcp")
