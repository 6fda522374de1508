"""A user's own model for the tests (by model._target_, with tests/ on PYTHONPATH): the GPT whose output turns
NaN at one training step, as a numerically unstable model does now and then."""

from __future__ import annotations

import torch

from trainflow.models.gpt import GPT


class GPTNaNAtStep(GPT):
    """GPT whose `nan_at_step`-th training forward returns NaN logits (steps count from 1 in each process)."""

    def __init__(self, nan_at_step: int, **gpt: object) -> None:
        super().__init__(**gpt)
        self.nan_at_step = nan_at_step
        self.training_forwards = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        if self.training and idx.device.type != "meta":  # trainflow's memory estimate runs it on the meta device
            self.training_forwards += 1
            if self.training_forwards == self.nan_at_step:
                return logits * float("nan")
        return logits
