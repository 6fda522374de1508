"""The ranks' agreement on a checkpoint: every rank reaches the same decision, or raises the same error.

Collectives run on the checkpointer's own gloo group (never the training group), so that they neither wait behind
training's collectives nor hang the async upload thread. Without a process group each call is the local answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainflow.checkpoint.safe_io import failure_cause
from trainflow.distributed import DistEnv
from trainflow.errors import CheckpointError, ConfigError


class RankAgreement:
    """Flags, names and outcomes shared by every rank over `group`."""

    def __init__(self, env: DistEnv, group: Any) -> None:
        self.env = env
        self.group = group

    def any(self, flag: bool) -> bool:
        """Whether the flag is set on any rank."""
        if not self.env.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, group=self.group)
        return bool(t.item())

    def first_named(self, name: str | None) -> str | None:
        """The name the lowest rank that has one reported (every rank calls this when any rank has one)."""
        if not self.env.distributed:
            return name
        names: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(names, name, group=self.group)
        return next(n for n in names if n is not None)

    def gather_checksums(self, checksums: dict[str, str]) -> dict[str, str]:
        """Every rank's file checksums, on every rank (this is also the barrier before the commit)."""
        if not self.env.distributed:
            return checksums
        everyone: list[dict[str, str] | None] = [None] * self.env.world_size
        dist.all_gather_object(everyone, checksums, group=self.group)
        return {name: digest for sums in everyone for name, digest in (sums or {}).items()}

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only; every rank gets its result, or raises the same one-line error."""
        result, error = None, None
        if self.env.is_main:
            try:
                result = fn()
            except (ConfigError, CheckpointError) as exc:
                error = exc
            except Exception as exc:  # any failure must reach the other ranks, or they wait for it forever
                error = CheckpointError(f"checkpoint.dir: {failure_cause(exc)}; committed checkpoints are untouched")
                error.__cause__ = exc
        if self.env.distributed:
            box = [(result, type(error).__name__ if error else None, str(error) if error else None)]
            dist.broadcast_object_list(box, src=0, group=self.group)
            result, kind, message = box[0]
            if kind is not None and not self.env.is_main:
                error = ConfigError(message) if kind == "ConfigError" else CheckpointError(message)
        if error is not None:
            raise error
        return result
