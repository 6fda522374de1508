"""The optimizer by `optim._target_`: the presets (adamw, sgd), any torch.optim class on a preset, and a user's own
class (optim=custom), each trained in a real process; trainflow's LR schedule and weight-decay groups around it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_GPT, ok, train

from trainflow.config.schema import typed_section
from trainflow.optim import build_optimizer

SHORT = [*TINY_GPT, "trainer.max_steps=6", "trainer.eval_steps=2", "checkpoint=dcp", "checkpoint.every_steps=6"]

MY_OPTIMIZER = '''
import json, os
import torch


class ScaledSGD(torch.optim.SGD):
    """SGD whose step is `scale` times as long; says what it was built with."""

    def __init__(self, params, lr, weight_decay=0.0, scale=1.0):
        super().__init__(params, lr=lr * scale, weight_decay=weight_decay)
        with open(os.environ["TEST_OPTIMIZER_RECORD"], "w") as record:
            json.dump({"lr": lr, "scale": scale, "groups": [g["weight_decay"] for g in self.param_groups]}, record)
'''


def saved_optimizer(run_dir: Path) -> dict:
    """The optimizer's class and parameter groups as the run's last checkpoint holds them."""
    step = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state = json.loads((step / "state.json").read_text())
    return {"optimizer": state["optimizer"], "param_groups": state["param_groups"]}


def test_a_torch_optimizer_on_the_default_preset_trains_and_the_presets_keys_it_does_not_take_are_dropped(
        run_dir: Path) -> None:
    run = ok(train(run_dir, *SHORT, "optim._target_=torch.optim.Adagrad", "optim.lr_decay=0.01", "optim.lr=0.05",
                   "optim.warmup_steps=0"))
    line = "optim._target_: torch.optim.Adagrad does not take optim=adamw's betas: dropped"
    assert (run.stdout + run.stderr).count(line) == 1
    saved = saved_optimizer(run_dir)
    assert saved["optimizer"] == "Adagrad"
    decay, no_decay = saved["param_groups"]  # weights decay, biases and norms do not: trainflow's groups
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["lr_decay"]) == (0.1, 0.0, 0.01)
    assert run.summary["train_loss"]["last"] < run.summary["train_loss"]["first"]


def test_sgd_preset_and_a_users_own_optimizer_class(run_dir: Path, tmp_path: Path) -> None:
    ok(train(run_dir, *SHORT, "optim=sgd"))
    saved = saved_optimizer(run_dir)
    assert saved["optimizer"] == "SGD" and saved["param_groups"][0]["momentum"] == 0.9

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_optim.py").write_text(MY_OPTIMIZER)
    record = tmp_path / "record.json"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "mine"), os.environ.get("PYTHONPATH")])),
           "TEST_OPTIMIZER_RECORD": str(record)}
    ok(train(tmp_path / "own", *SHORT, "optim=custom", "optim._target_=my_optim.ScaledSGD", "+optim.scale=0.5",
             "optim.lr=0.2", "optim.weight_decay=0.01", env=env))
    assert json.loads(record.read_text()) == {"lr": 0.2, "scale": 0.5, "groups": [0.01, 0.0]}
    assert saved_optimizer(tmp_path / "own")["optimizer"] == "ScaledSGD"


def test_the_schedule_and_groups_are_trainflows_whatever_the_optimizer() -> None:
    """Warm-up then cosine on the optimizer's own lr; one group when there is no weight decay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optim = {"_target_": "torch.optim.RMSprop", "lr": 0.1, "weight_decay": 0.0, "alpha": 0.9, "warmup_steps": 2,
             "min_lr_ratio": 0.1, "schedule": "cosine"}
    optimizer, scheduler = build_optimizer(model, typed_section("optim", optim), 10, torch.device("cpu"))
    assert type(optimizer) is torch.optim.RMSprop and len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["alpha"] == 0.9
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:2] == pytest.approx([0.05, 0.1]) and lrs[-1] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (
        1 + torch.cos(torch.tensor(torch.pi * 7 / 8)).item())))
