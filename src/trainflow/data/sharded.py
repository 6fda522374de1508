"""Sharded streams: an iterable dataset that exposes its shards is read a whole shard per rank and worker.

A dataset is sharded when it has trainflow's protocol (`num_shards` and `shard(index)`, an iterable of that
shard's items) or is a Hugging Face `IterableDataset` (`n_shards`, `shard(num_shards=, index=)`). Of the W x K
readers (rank r of W, worker w of K: reader r*K + w), reader s reads the shards s, s + W*K, s + 2*W*K, ... in
order, each from its start, so every item of a pass is read once, by one reader.

Position: each item travels to the training process with its (shard, offset); what the loop took is counted
there, per shard, so the position of a pass is `{shard: items taken}` over all ranks (JSON). A resume merges every
rank's counts and hands the unfinished shards to the new readers (by the same rule on the new W x K), each from
its count on: a resume on any number of ranks or workers continues the pass with nothing repeated or skipped
(items a worker had prefetched but the loop had not taken are read again). The next pass starts fresh.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


def shard_count(dataset: Any) -> int | None:
    """How many shards the dataset exposes, or None when it cannot be sharded."""
    if not callable(getattr(dataset, "shard", None)):
        return None
    for name in ("n_shards", "num_shards"):  # a Hugging Face IterableDataset has both; trainflow's protocol the second
        if isinstance(getattr(dataset, name, None), int):
            return getattr(dataset, name)
    return None


def shard_items(dataset: Any, index: int) -> Iterable[Any]:
    if isinstance(getattr(dataset, "n_shards", None), int):  # Hugging Face: a dataset of that one shard, read by
        # `iter` (its own __iter__ would split the shard again among the loader's workers)
        one = dataset.shard(num_shards=dataset.n_shards, index=index)
        return ({key: values[0] for key, values in batch.items()} for batch in one.iter(batch_size=1))
    return dataset.shard(index)


class ShardedShare(IterableDataset):
    """This rank's workers' whole shards, each item tagged with (shard, offset); `taken` is where to start."""

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.num_shards = shard_count(dataset) or 0
        self.taken: dict[int, int] = {}  # items of each shard taken before (a resume); empty for a fresh pass

    def __iter__(self) -> Iterator[tuple[tuple[int, int], Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers, reader = self.world_size * workers, self.rank * workers + worker
        taken, self.taken = self.taken, {}  # a resume's counts hold for one pass (a persistent worker reads more)
        for shard in range(reader, self.num_shards, readers):
            start = taken.get(shard, 0)
            for offset, item in enumerate(itertools.islice(shard_items(self.dataset, shard), start, None), start):
                yield (shard, offset), item


def tagged_collate(collate: Callable[[list], Any]) -> Callable[[list], Any]:
    """The user's collate of the items, with the items' (shard, offset) tags beside the batch."""

    def collate_tagged(pairs: list) -> tuple[list[tuple[int, int]], Any]:
        return [tag for tag, _ in pairs], collate([item for _, item in pairs])

    return collate_tagged


def merged_position(states: list[dict[str, Any]]) -> tuple[int, dict[int, int]]:
    """(the pass, items taken of each shard) of every rank's saved position: the global position of the stream."""
    passes = {int(s["pass"]) for s in states}
    if len(passes) != 1:  # ranks finish a pass at different steps when their shards differ in size: the earliest
        earliest = min(passes)
        states = [s for s in states if int(s["pass"]) == earliest]
    taken: dict[int, int] = {}
    for state in states:
        for shard, count in state["taken"].items():
            taken[int(shard)] = max(taken.get(int(shard), 0), int(count))
    return int(states[0]["pass"]), taken
