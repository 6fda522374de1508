"""Iterable datasets for the tests (tests/ on PYTHONPATH, named by data._target_): a finite stream of labelled
vectors for the seed MLP, with or without a state_dict of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset


def item(index: int, features: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Item `index` of the stream: a vector and its class (the largest of a fixed projection: learnable)."""
    x = torch.randn(features, generator=torch.Generator().manual_seed(seed * 100_003 + index))
    projection = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed))
    return x, (x @ projection).argmax()


class VectorStream(IterableDataset):
    """`size` items per pass, in order; no state of its own (a resume reads again and skips)."""

    def __init__(self, size: int, features: int, classes: int, seed: int) -> None:
        self.size, self.features, self.classes, self.seed = size, features, classes, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.size):
            yield item(index, self.features, self.classes, self.seed)


class StatefulVectorStream(VectorStream):
    """The same stream, keeping its position: a resume continues from it without reading again."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.position < self.size:
            self.position += 1
            yield item(self.position - 1, self.features, self.classes, self.seed)
        self.position = 0  # the next pass starts from the beginning

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def vector_stream(size: int = 20, features: int = 100, classes: int = 10, seed: int = 0,
                  stateful: bool = False) -> dict[str, IterableDataset]:
    """train: `size` items a pass; val: 16 items of another seed (an iterable too, read once)."""
    kind = StatefulVectorStream if stateful else VectorStream
    return {"train": kind(size, features, classes, seed), "val": VectorStream(16, features, classes, seed + 1)}
