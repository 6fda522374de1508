"""The smallest baseline (experiment=seed_mlp, the MLP of the hand-written PyTorch loop trainflow is measured
against): Linear(100, 256) -> ReLU -> Linear(256, 10)."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 100, hidden: int = 256, out_features: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
