"""The process group and the parallel wrapping of the model.

A run is one process (`parallelism=single`) or one of WORLD_SIZE ranks started
by torchrun, SLURM or our own local launch; the rest of the code asks this
module who it is (`DistEnv`) and never reads the environment itself.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from trainflow.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but no GPU is visible; use trainer.device=cpu or auto")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def setup(cfg: DictConfig, device: str) -> DistEnv:
    """Join the process group the launcher prepared (or stay a single process)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return DistEnv(rank, world_size, local_rank, dev)


def teardown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, cfg: DictConfig, env: DistEnv) -> nn.Module:
    """Wrap the model for the chosen strategy; a single process trains it as it is."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under any compile / DDP wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def no_grad_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on micro-steps that are not the last of an accumulation."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world_size
    return value
