"""Sets of points of varying size, each labelled with one number: dict items, batched by a padding collate."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class PointSets(Dataset):
    """Item i: {"points": [n_i, features], "target": scalar}; the target is the mean of the first feature plus
    half the largest second feature, so a model must pool over the set to predict it."""

    def __init__(self, size: int, features: int, max_points: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(2, max_points + 1, (size,), generator=g)
        self.points = [torch.randn(int(n), features, generator=g) for n in counts]
        self.targets = [p[:, 0].mean() + 0.5 * p[:, 1].max() for p in self.points]

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"points": self.points[index], "target": self.targets[index]}


class PadSets:
    """Collate: pad each set to `pad_to` points (a fixed shape: compiled code is reused) and mark the real ones."""

    def __init__(self, pad_to: int) -> None:
        self.pad_to = pad_to

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        features = items[0]["points"].shape[1]
        points = torch.zeros(len(items), self.pad_to, features)
        mask = torch.zeros(len(items), self.pad_to, dtype=torch.bool)
        for i, item in enumerate(items):
            n = len(item["points"])
            points[i, :n], mask[i, :n] = item["points"], True
        return {"points": points, "mask": mask, "target": torch.stack([item["target"] for item in items])}


def point_sets(train_size: int = 2048, val_size: int = 256, features: int = 4, max_points: int = 12,
               seed: int = 0) -> dict[str, PointSets]:
    """The factory `data._target_` names: trainflow calls it with the data section's own keys."""
    return {"train": PointSets(train_size, features, max_points, seed),
            "val": PointSets(val_size, features, max_points, seed + 1)}
