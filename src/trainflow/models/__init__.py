"""Built-in models; any other nn.Module is reachable through `model._target_`."""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from trainflow.errors import ConfigError


def build_model(cfg: DictConfig) -> nn.Module:
    """`model._target_(**model)`, with a one-line error naming the key when the class or its arguments are wrong."""
    target = cfg.get("_target_")
    try:
        model = instantiate(cfg)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ImportError) or cause is None:
            raise ConfigError(f"model._target_: cannot import {target!r}; give the import path of an nn.Module "
                              "class, e.g. mypackage.models.MyNet (its folder on PYTHONPATH)") from exc
        raise ConfigError(f"model: {target}({_arguments(cfg)}) failed: {type(cause).__name__}: {cause}; fix the "
                          "model.* values") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {target} is not an nn.Module (it made a {type(model).__name__} "
                          "object); point it at an nn.Module class")
    return model


def model_blocks(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """`model.blocks`, the repeated layers that activation checkpointing, FSDP's shard units and per-block compile
    work on: a non-empty ModuleList or Sequential, else None (the model is then taken whole, or by size)."""
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0 else None


def _arguments(cfg: DictConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "_target_")
