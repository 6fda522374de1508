"""Checkpoints a user can trust: nothing non-finite committed, damage caught before loading, no code run on load,
resumes that say what they change. In-process Checkpointer runs on real DCP files, and real `train.py` /
`trainflow export` processes where the promise is about what a user sees.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_GPT, train
from omegaconf import OmegaConf
from test_checkpoint import KILL, committed, one_line_error, start, tree_hash, wait_for

from trainflow.checkpoint import Checkpointer, TrainState, list_committed
from trainflow.distributed import DistEnv
from trainflow.errors import CheckpointError, ConfigError
from trainflow.models.mlp import MLP
from trainflow.optim import build_optimizer

OPTIM = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "momentum": 0.9,
         "warmup_steps": 2, "min_lr_ratio": 0.1, "schedule": "cosine"}


def make_state(seed: int = 0, **optim) -> TrainState:
    torch.manual_seed(seed)
    model = MLP(in_features=8, hidden=16, out_features=4)
    return TrainState(model, *build_optimizer(model, OmegaConf.create({**OPTIM, **optim}), 100, torch.device("cpu")))


def step(state: TrainState) -> None:
    state.model(torch.randn(4, 8)).square().mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()
    state.step += 1
    state.samples_seen += 4


def checkpointer(tmp_path: Path, **overrides) -> Checkpointer:
    cfg = OmegaConf.create({"enabled": True, "mode": "sync", "dir": str(tmp_path / "ckpts"), "every_steps": 1,
                            "keep_last": 3, "resume": "auto", "save_final": True, "verify": True, "export": False,
                            "load": "all", **overrides})
    return Checkpointer(cfg, DistEnv(0, 1, 0, torch.device("cpu")), tmp_path)


def train_and_save(tmp_path: Path, steps: int, state: TrainState | None = None, **overrides) -> TrainState:
    state = state or make_state()
    ck = checkpointer(tmp_path, **overrides)
    ck.resume(state)
    for _ in range(steps):
        step(state)
        ck.after_step(state)
    ck.close(state)
    return state


def shard(folder: Path) -> Path:
    return folder / "__0_0.distcp"


def flip_a_byte_of(tensor: torch.Tensor, file: Path) -> None:
    """Flip one bit inside `tensor`'s bytes where the file stores them (found by content, as a disk would)."""
    data = bytearray(file.read_bytes())
    at = data.find(tensor.detach().numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x10
    file.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------------------------
# non-finite state


def test_a_non_finite_state_is_never_committed_and_the_newest_finite_one_stays(tmp_path: Path) -> None:
    state = train_and_save(tmp_path, 3, keep_last=1)
    ckpts = tmp_path / "ckpts"
    assert committed(ckpts) == ["step_00000003"]
    manifest = json.loads((ckpts / "step_00000003" / "manifest.json").read_text())
    assert manifest["finite"] is True
    before = tree_hash(ckpts)

    ck = checkpointer(tmp_path, keep_last=1, save_final=False)
    ck.resume(state)
    step(state)
    with torch.no_grad():
        state.model.net[2].weight[1, 3] = math.nan  # what a diverged step leaves behind
    with pytest.raises(CheckpointError) as exc:
        ck.after_step(state)
    ck.close(state)
    assert str(exc.value) == ("checkpoint: step 4 has non-finite values (model.net.2.weight); not committed, newest "
                              "finite checkpoint step_00000003 kept; the training diverged: lower optim.lr (or raise "
                              "optim.warmup_steps) and run again")
    assert tree_hash(ckpts) == before  # nothing written, nothing deleted
    assert committed(ckpts) == ["step_00000003"]

    with torch.no_grad():  # an infinite optimizer moment is refused the same way
        state.model.net[2].weight[1, 3] = 0.0
        next(iter(state.optimizer.state.values()))["exp_avg_sq"][0] = math.inf
    ck = checkpointer(tmp_path, keep_last=1, save_final=False)
    with pytest.raises(CheckpointError, match=r"step 4 has non-finite values \(optim\.state\.net\.0\.weight\."
                                              r"exp_avg_sq\)"):
        ck._save(state, blocking=True)
    ck.close(state)
    assert tree_hash(ckpts) == before


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path: Path) -> None:
    train_and_save(tmp_path, 3)
    ckpts = tmp_path / "ckpts"
    for name in ("step_00000002", "step_00000003"):  # say these were not known finite
        path = ckpts / name / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "finite": False}))
    checkpointer(tmp_path, keep_last=1)._retain()
    assert committed(ckpts) == ["step_00000001", "step_00000003"]  # the newest, and the newest finite


def test_verify_compares_nan_as_equal_and_names_a_damaged_key(tmp_path: Path) -> None:
    from trainflow.checkpoint import _differences

    a = torch.tensor([1.0, math.nan, math.inf])
    assert _differences({"x": a}, {"x": a.clone()}) == []  # torch.equal says they differ
    assert _differences({"x": a}, {"x": torch.tensor([1.0, math.nan, 0.0])}) == ["x"]

    # damaged between the write and the read-back: the self-check fails and names the key
    state = train_and_save(tmp_path, 2, verify=False)
    path = tmp_path / "ckpts" / "step_00000002"
    flip_a_byte_of(state.model.net[0].weight, shard(path))
    with pytest.raises(CheckpointError) as exc:
        checkpointer(tmp_path)._verify(state)
    assert str(exc.value) == (f"checkpoint.verify: {path} does not read back what was saved (model.net.0.weight); "
                              "the storage under checkpoint.dir is unreliable: use another disk")
