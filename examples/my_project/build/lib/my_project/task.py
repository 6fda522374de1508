"""The task: the loss to train on and the metrics to watch, from a model and a batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def regression(model, batch: dict[str, torch.Tensor], huber_delta: float = 1.0):
    """Huber loss; mean absolute error and the share of sets predicted within 0.25 as metrics."""
    prediction = model(batch["points"], batch["mask"])
    loss = F.huber_loss(prediction, batch["target"], delta=huber_delta)
    error = (prediction.detach() - batch["target"]).abs()
    return loss, {"mae": error.mean(), "within_0.25": (error < 0.25).float().mean()}
