"""torch.profiler on a schedule, traces per rank, and a verdict on what bounds the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trainflow.distributed import DistEnv


class Profiler:
    """Steps torch.profiler on its schedule when `profiler.enabled`; a no-op otherwise."""

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path, max_steps: int) -> None:
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        """Called once at the end of every training step."""

    def summary(self) -> dict[str, Any] | None:
        return None
