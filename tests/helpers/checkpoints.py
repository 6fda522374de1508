"""Checkpoints in tests: a small run saved and resumed in this process, and what a checkpoint folder holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trainflow.checkpoint import Checkpointer, TrainState
from trainflow.checkpoint.safe_io import read_metadata
from trainflow.config.schema import CheckpointConfig, typed_section
from trainflow.distributed import DistEnv
from trainflow.models.mlp import MLP
from trainflow.optim import build_optimizer
from trainflow.util.locks import LOCK_FILE


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"train/loss"' in line) if path.exists() else 0


def committed(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if (p / "manifest.json").is_file())


def tree_hash(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the run lock: to prove nothing already saved was touched."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def read_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer), read in this process without a process group
    (trainflow's reader: the shards hold raw tensor bytes, which DCP's stock reader does not know)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainflow.checkpoint.safe_io import SafeReader

    reader = SafeReader(ckpt)
    md = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = read_tensors(a), read_tensors(b)
    assert ta.keys() == tb.keys()
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


RESHARD_TOLERANCE = 1e-5  # per-step loss; measured <= 5e-7 here, against ~5e-2 between neighbouring batches


def assert_close_losses(resumed: dict[int, float], reference: dict[int, float], steps: range) -> None:
    diffs = {s: abs(resumed[s] - reference[s]) for s in steps}
    assert max(diffs.values()) < RESHARD_TOLERANCE, diffs
    neighbours = [abs(reference[s] - reference[s - 1]) for s in steps]
    assert sum(neighbours) / len(neighbours) > 100 * RESHARD_TOLERANCE  # it can tell one batch from another


def records(folder: Path) -> dict[str, object]:
    """Each tensor key of a checkpoint's shards: its _StorageInfo (file, offset, length, descriptors)."""
    metadata = read_metadata(folder)
    return {index.fqn: info for index, info in metadata.storage_data.items()}


OPTIM = {"_target_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95],
         "warmup_steps": 2, "min_lr_ratio": 0.1, "schedule": "cosine"}
SGD = {**{k: v for k, v in OPTIM.items() if k != "betas"}, "_target_": "torch.optim.SGD", "momentum": 0.9}


def make_state(seed: int = 0, base: dict = OPTIM, **optim) -> TrainState:
    torch.manual_seed(seed)
    model = MLP(in_features=8, hidden=16, out_features=4)
    optimizer = build_optimizer(model, typed_section("optim", {**base, **optim}), 100, torch.device("cpu"))
    return TrainState(model, *optimizer)


def step(state: TrainState) -> None:
    state.model(torch.randn(4, 8)).square().mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()
    state.step += 1
    state.samples_seen += 4


def checkpointer(tmp_path: Path, **overrides) -> Checkpointer:
    cfg = CheckpointConfig(**{"enabled": True, "mode": "sync", "dir": str(tmp_path / "ckpts"), "every_steps": 1,
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


def rewrite_manifest(folder: Path) -> None:
    """What a tamperer does: sizes and checksums made to match the new files."""
    from trainflow.checkpoint.safe_io import file_checksum

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}
    path.write_text(json.dumps({**manifest, "files": files, "checksums": {n: file_checksum(folder / n) for n in files},
                                "bytes": sum(files.values())}))


def model_tensors(run_dir: Path) -> int:
    """How many parameter tensors the run's model has (a tied one once), counted on a model built here from the
    run's config.yaml, apart from what the run says it compared."""
    return len(list(instantiate(OmegaConf.load(run_dir / "config.yaml").model).parameters()))


def assert_parity_checked(run: Any, layout: str, mesh: dict[str, int]) -> None:
    """The run's layout and mesh as given, and its parity check (parallelism.check: 3 steps) passed at 1e-5 of
    what training moved the parameters, having compared every tensor of the model (said in its line too)."""
    parallelism = run.summary["parallelism"]
    assert parallelism["layout"] == layout and parallelism["mesh"] == mesh, parallelism
    check = parallelism["check"]
    assert check["passed"] and check["steps"] == 3 and check["tolerance"] == 1e-5, check
    assert check["update_rel_diff"] <= 1e-5 and check["loss_rel_diff"] <= 1e-5, check
    assert check["param_rel_diff"] <= 1e-5, check
    tensors = model_tensors(run.run_dir)
    assert check["tensors"] == check["model_tensors"] == tensors > 0, (check, tensors)
    assert f"after 3 steps, {tensors} of the model's {tensors} tensors compared: " in (
        run.run_dir / "train.log").read_text()
