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


class ShardedVectorStream(VectorStream):
    """The same items in `num_shards` shards of consecutive items (trainflow's shard protocol)."""

    def __init__(self, num_shards: int, *args: Any) -> None:
        super().__init__(*args)
        self.num_shards = num_shards

    def shard(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        per_shard = self.size // self.num_shards
        for i in range(index * per_shard, (index + 1) * per_shard):
            yield item(i, self.features, self.classes, self.seed)


def vector_stream(size: int = 20, features: int = 100, classes: int = 10, seed: int = 0,
                  stateful: bool = False, shards: int = 0) -> dict[str, IterableDataset]:
    """train: `size` items a pass (in `shards` shards, when given); val: 16 items of another seed (an iterable too,
    read once)."""
    if shards:
        train = ShardedVectorStream(shards, size, features, classes, seed)
    else:
        train = (StatefulVectorStream if stateful else VectorStream)(size, features, classes, seed)
    return {"train": train, "val": VectorStream(16, features, classes, seed + 1)}


class ShardedNumbers(IterableDataset):
    """`num_shards` shards of `per_shard` items each, trainflow's shard protocol: item j of shard s is the number
    s * 1000 + j (so a test counts which were read)."""

    def __init__(self, num_shards: int = 8, per_shard: int = 8) -> None:
        self.num_shards, self.per_shard = num_shards, per_shard
        self.opened: list[int] = []  # shards this copy started reading (a worker's copy: its own)

    def shard(self, index: int) -> Iterator[torch.Tensor]:
        self.opened.append(index)
        for j in range(self.per_shard):
            yield torch.tensor(index * 1000 + j)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index in range(self.num_shards):
            yield from self.shard(index)
