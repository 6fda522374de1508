"""A set regressor: each point through an MLP, masked mean and max pooling, one number per set."""

from __future__ import annotations

import torch
from torch import nn


class SetRegressor(nn.Module):
    def __init__(self, features: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.point = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(2 * hidden, 1)

    def forward(self, points: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.point(points)
        keep = mask.unsqueeze(-1)
        mean = (h * keep).sum(1) / keep.sum(1)
        top = h.masked_fill(~keep, float("-inf")).amax(1)
        return self.head(torch.cat([mean, top], dim=-1)).squeeze(-1)
