"""Built-in models; any other nn.Module is reachable through `model._target_`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from trainflow.errors import ConfigError
from trainflow.util.targets import WHAT, call_target


def build_model(target: str, arguments: Mapping[str, Any]) -> nn.Module:
    """`model._target_(**model.kwargs)`, with a one-line error naming the key when the class or its arguments are
    wrong. An argument that is itself a section with a `_target_` (a backbone, say) is instantiated first, as Hydra
    would."""
    kwargs = {k: _built(f"model.{k}", v) for k, v in arguments.items()}
    model = call_target("model", target, kwargs, WHAT["model"])
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {target} is not an nn.Module (it made a {type(model).__name__} "
                          "object); point it at an nn.Module class")
    return model


def model_blocks(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """`model.blocks`, the repeated layers that activation checkpointing, FSDP's shard units and per-block compile
    work on: a non-empty ModuleList or Sequential, else None (the model is then taken whole, or by size)."""
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0 else None


def _built(key: str, value: Any) -> Any:
    """A nested section with a `_target_` (model.backbone, say), built the same way; any other value as it is."""
    if not (isinstance(value, Mapping) and "_target_" in value):
        return value
    kwargs = {k: _built(f"{key}.{k}", v) for k, v in value.items() if k != "_target_"}
    return call_target(key, value["_target_"], kwargs, "a class or function")
