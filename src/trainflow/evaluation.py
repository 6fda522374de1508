"""Evaluation: the mean validation loss at `trainer.eval_every` steps and at the end of the run."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from trainflow.data import DataBundle, StreamSampler
from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import all_reduce_mean
from trainflow.metrics import MetricsWriter
from trainflow.stages import LoopState, Stage

log = logging.getLogger("trainflow")


class Evaluation(Stage):
    """Evaluates at every `every` steps (0: only at the end) and at the last step; its time is not training time."""

    summary_key = "val"

    def __init__(self, cfg: DictConfig, env: DistEnv, data: DataBundle, every: int, autocast: Any,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], writer: MetricsWriter) -> None:
        self.cfg, self.env, self.data, self.every, self.autocast = cfg, env, data, every, autocast
        self.loss_fn, self.writer = loss_fn, writer
        self.result: dict[str, float] | None = None  # the latest evaluation
        self._paused_s = 0.0

    def after_step(self, state: LoopState) -> bool:
        if not (state.done or (self.every and state.step % self.every == 0)):
            return False
        start = time.perf_counter()
        self.result = evaluate(state.model, self.data, self.cfg, self.env, self.autocast, self.loss_fn)
        self.writer.write(state.step, {f"val/{k}": v for k, v in self.result.items()})
        if self.env.is_main:
            log.info("step %d: val loss %.4f%s", state.step, self.result["loss"],
                     f", perplexity {self.result['perplexity']:.2f}" if "perplexity" in self.result else "")
        state.model.train()
        self._paused_s += time.perf_counter() - start
        return False

    def take_paused_s(self) -> float:
        paused, self._paused_s = self._paused_s, 0.0
        return paused

    def summary(self, steady: dict[str, Any] | None) -> dict[str, float] | None:
        return self.result


@torch.no_grad()
def evaluate(model: nn.Module, data: DataBundle, cfg: DictConfig, env: DistEnv, autocast,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Mean loss over the same held-out batches every time (rank-strided, in order)."""
    model.eval()
    t = cfg.trainer
    sampler = StreamSampler(len(data.val), t.batch_size, env.rank, env.world_size, seed=0, shuffle=False)
    total = torch.zeros((), device=env.device)
    for _, indices in zip(range(t.eval_steps), sampler, strict=False):
        inputs, targets = (x.to(env.device) for x in data.val[indices])
        with autocast:
            total += loss_fn(model(inputs), targets).float()
    loss = all_reduce_mean(total / t.eval_steps, env).item()
    result = {"loss": loss}
    if data.is_lm:
        result["perplexity"] = math.exp(min(loss, 50.0))
    return result
