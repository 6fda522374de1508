"""An IterableDataset by `data._target_`: each rank and worker reads its share of the stream, batched through
torchdata's StatefulDataLoader, whose `state_dict()` is the data position a checkpoint saves (JSON, beside the
shards, never pickled) and a resume restores.

Sharded streams (a dataset with `num_shards` + `shard(index)`, or a Hugging Face IterableDataset) are read a whole
shard per rank and worker, and resume from every rank's items taken of each shard on any layout (data/sharded.py).

Others: trainflow takes the share itself, so that any iterable dataset trains on any number of ranks and workers
without knowing of them: rank r of W, worker w of K keeps the items i of the stream with i % (W*K) == r*K + w. Every
worker reads the whole stream and keeps its share (simple and exact; a dataset whose items are expensive to read
is better split into map-style items). Each micro-batch holds `trainer.batch_size` items of one worker; a pass that
ends with fewer is dropped, and the stream starts its next pass (an epoch).

Resume: the dataset's own `state_dict()`/`load_state_dict()` where it has them (with trainflow's count of items
read, so the shares stay aligned); otherwise the loader reads again and skips the batches already taken, which is
exact when the dataset yields the same items in the same order on every pass. Another world size, worker count,
micro-batch or kind of dataset (with or without a state_dict) than the checkpoint's restarts the stream from its
beginning, and a line says so.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from trainflow.config.schema import DataSection
from trainflow.data.sharded import ShardedShare, merged_position, shard_count, tagged_collate
from trainflow.data.worker_errors import from_workers
from trainflow.errors import ConfigError, DataError

log = logging.getLogger("trainflow")

INSTALL = "pip install 'trainflow[iterable]'"


def is_stateful(obj: Any) -> bool:
    """torchdata's Stateful protocol: the object saves and restores its own position."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class IterableSource(Dataset):
    """The user's IterableDataset with its collate. Indexed by a tensor of n indices it returns the first n items
    of the stream collated (what the probes before training take: a model check, the FLOPs count, compile's check);
    its length is unknown to trainflow (the stream may be endless): the loader checks that it fills a micro-batch.
    """

    def __init__(self, dataset: IterableDataset, collate: Callable[[list], Any], name: str) -> None:
        try:
            import torchdata.stateful_dataloader  # noqa: F401 (lazy: torchdata is the iterable extra)
        except ImportError:
            raise ConfigError(f"data._target_: {name} returned an IterableDataset, which trainflow reads through "
                              f"torchdata, and torchdata is not installed; run {INSTALL}") from None
        self.dataset, self.name = dataset, name
        self.collate = collate  # a list of items -> a batch; a DataError naming the data when it cannot

    def __len__(self) -> int:
        return len(self.dataset) if hasattr(self.dataset, "__len__") else torch.iinfo(torch.int64).max

    def first_items(self, count: int) -> list:
        """The first `count` items of a pass (fewer if it ends), read from a copy: a stateful dataset keeps its
        position for the loader."""
        return list(itertools.islice(copy.deepcopy(self.dataset), count))

    def __getitem__(self, indices: torch.Tensor) -> Any:
        items = self.first_items(len(indices))
        if not items:
            raise DataError(f"data._target_: the train dataset of {self.name} yields no items; give it samples")
        return self.collate(items)


class RankShare(IterableDataset):
    """This rank's and this worker's share of the stream: items i with i % (world_size * workers) == its slot."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.read = 0  # items of the current pass read from the dataset (this worker's copy)
        self._resume_at: int | None = None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        parts, slot = self.world_size * workers, self.rank * workers + worker
        self.read, self._resume_at = self._resume_at or 0, None
        for item in self.dataset:
            self.read += 1
            if (self.read - 1) % parts == slot:
                yield item


class StatefulRankShare(RankShare):
    """A share of a dataset that saves its own position: its state and the count of items read (the alignment of
    the shares after a resume)."""

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset.state_dict(), "read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self._resume_at = int(state["read"])


class IterableBatches:
    """This rank's micro-batches of an iterable dataset, pass after pass, through a StatefulDataLoader."""

    def __init__(self, source: IterableSource, rank: int, world_size: int, batch_size: int, data: DataSection,
                 pin_memory: bool) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader  # IterableSource checked it is installed

        if data.seq_lens:
            raise ConfigError("data.seq_lens: cuts the micro-batches of the global sample stream by their position, "
                              f"and {source.name} is an iterable dataset whose batches its collate makes; remove "
                              "data.seq_lens, or vary the lengths in data.collate_fn")
        self.source, self.world_size, self.batch_size = source, world_size, batch_size
        self.num_workers = int(data.num_workers)
        readers = world_size * max(1, self.num_workers)
        self.sharded = shard_count(source.dataset) is not None
        self.stateful = is_stateful(source.dataset) and not self.sharded
        # a stateful dataset's position belongs to one loader (the parity check reads another): a copy of its own.
        # Others are only read; a Hugging Face dataset is not copied, as deepcopy fails on its filesystem cache.
        dataset = copy.deepcopy(source.dataset) if self.stateful else source.dataset
        share: IterableDataset
        if self.sharded:
            share, collate = ShardedShare(dataset, rank, world_size), tagged_collate(source.collate)
            if rank == 0 and share.num_shards < readers:
                log.warning("data: %s has %d shards for %d readers (%d rank(s) x %d worker(s)): %d of them read "
                            "nothing", source.name, share.num_shards, readers, world_size,
                            max(1, self.num_workers), readers - share.num_shards)
        else:
            share = (StatefulRankShare if self.stateful else RankShare)(dataset, rank, world_size)
            collate = source.collate
            if rank == 0 and readers > 1:
                log.info("data: %s exposes no shards (num_shards and shard(index)): each of its %d readers (%d "
                         "rank(s) x %d worker(s)) reads the whole stream and keeps 1 item in %d: %dx the reading",
                         source.name, readers, world_size, max(1, self.num_workers), readers, readers)
        self.share = share
        self.pass_number, self.taken = 0, {}  # a sharded stream's position: its pass, items taken of each shard
        workers = self.num_workers > 0
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch function: noise for the user
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = StatefulDataLoader(
                share, batch_size=batch_size, drop_last=True, collate_fn=collate, num_workers=self.num_workers,
                pin_memory=pin_memory, persistent_workers=workers and data.persistent_workers,
                prefetch_factor=data.prefetch_factor if workers else None)
        self._resumed = False
        self._skip = 0  # micro-batches to read and drop before the next one is yielded (skip)

    def skip(self, micro_batches: int) -> None:
        """Read and drop the next `micro_batches` micro-batches: a replica group that took a peer's step (fault
        tolerance) continues its own share where it would be had it trained those steps."""
        self._skip += micro_batches

    def check(self, global_batch: int | None, grad_accum: int) -> None:
        """Refuse, before training, a stream that ends before every rank has one micro-batch (saying what it can
        fill), and a dataset position a checkpoint could not hold as JSON."""
        if self.stateful:
            try:
                json.dumps(self.source.dataset.state_dict())
            except (TypeError, ValueError) as exc:
                raise DataError(f"data._target_: the state_dict() of the train dataset of {self.source.name} cannot "
                                f"be saved as JSON ({exc}); return plain values (numbers, strings, lists, dicts) "
                                "from it") from None
        needed = self.batch_size * self.world_size
        count = len(self.source.first_items(needed))
        if count >= needed:
            return
        per_rank = count // self.world_size
        ranks = f"{self.world_size} rank(s) x {self.batch_size} items"
        if global_batch is not None:
            fix = (f"set parallelism.global_batch to at most {per_rank * self.world_size * grad_accum} ("
                   f"{self.world_size} rank(s) x {per_rank} items x trainer.grad_accum={grad_accum}), or give more "
                   "data" if per_rank else f"give more data (at least {self.world_size} items)")
            raise ConfigError(f"parallelism.global_batch: {global_batch} cannot be honoured: the train stream of "
                              f"{self.source.name} ends after {count} items, before one micro-batch per rank "
                              f"({ranks}); {fix}")
        fix = f"lower trainer.batch_size to at most {per_rank}" if per_rank else "run on fewer ranks"
        raise ConfigError(f"trainer.batch_size: the train stream of {self.source.name} ends after {count} items, "
                          f"before one micro-batch per rank ({ranks}); {fix}, or give more data")

    def __iter__(self) -> Iterator[Any]:
        while True:
            taken = 0
            for batch in from_workers(self.loader):
                taken += 1
                if self.sharded:
                    tags, batch = batch
                    for shard, offset in tags:
                        self.taken[shard] = max(self.taken.get(shard, 0), offset + 1)
                if self._skip:
                    self._skip -= 1
                    continue
                yield batch
            if self.sharded:  # the next pass reads every shard from its start
                self.pass_number, self.taken, self.share.taken = self.pass_number + 1, {}, {}
            if taken == 0 and not self._resumed:  # a pass too short for a micro-batch of any of this rank's workers
                split = f", split among {self.num_workers} workers" if self.num_workers else ""
                raise ConfigError(f"trainer.batch_size: a pass of the train stream of {self.source.name} gave this "
                                  f"rank no micro-batch of {self.batch_size} items (its share{split}); lower "
                                  f"trainer.batch_size{' or data.num_workers' if split else ''}, or give more data")
            self._resumed = False

    def state_dict(self) -> dict[str, Any]:
        """The position of this rank's stream, as JSON values (the checkpoint writes it beside the shards)."""
        if self.sharded:  # the pass and the items taken of each shard this rank read (any layout resumes from
            # them), and the loader's own state (the same layout resumes in the same order of workers' batches)
            return {"sharded": True, "pass": self.pass_number, "taken": {str(k): v for k, v in self.taken.items()},
                    "layout": [self.world_size, self.num_workers, self.batch_size], "loader": self.loader.state_dict()}
        return {"world_size": self.world_size, "num_workers": self.num_workers, "batch_size": self.batch_size,
                "stateful": self.stateful, "loader": self.loader.state_dict()}

    def restore(self, saved: dict[str, Any] | None, resumed: bool, is_main: bool,
                every_rank: list[dict[str, Any]] | None = None) -> None:
        """Continue where the checkpoint's stream stopped; say what happens instead where that cannot be exact.

        A sharded stream continues from the position of all ranks together (`every_rank`), on any layout."""
        if not resumed:
            return
        name = self.source.name
        if self.sharded:
            states = [s for s in every_rank or [] if s.get("sharded")]
            if not states:
                if is_main:
                    log.warning("data: the checkpoint holds no position of the sharded stream of %s: the stream "
                                "restarts from its beginning", name)
                return
            self.pass_number, taken = merged_position(states)
            self.taken = {shard: count for shard, count in taken.items()
                          if shard % (self.world_size * max(1, self.num_workers)) // max(1, self.num_workers)
                          == self.share.rank}
            if saved and saved.get("layout") == [self.world_size, self.num_workers, self.batch_size]:
                self.loader.load_state_dict(saved["loader"])  # reads its shards again to the same batch
            else:  # another layout: the unfinished shards, each from its count, shared out anew
                self.share.taken = taken
            self._resumed = True
            return
        if saved is None:
            if is_main:
                log.warning("data: the checkpoint holds no position of the iterable stream of %s (saved from "
                            "other data, or on another world size): the stream restarts from its beginning", name)
            return
        here = {"world_size": self.world_size, "num_workers": self.num_workers, "batch_size": self.batch_size,
                "stateful": self.stateful}
        changed = [f"{k} {saved.get(k)} -> {v}" for k, v in here.items() if saved.get(k) != v]
        if changed:
            if is_main:
                log.warning("data: the iterable stream of %s was checkpointed with other settings (%s): its "
                            "position does not carry over; the stream restarts from its beginning", name,
                            ", ".join(changed))
            return
        if not self.stateful and is_main:
            log.warning("data: %s has no state_dict()/load_state_dict(): each rank reads its stream again and "
                        "skips the batches already taken (exact only if the dataset yields the same items in the "
                        "same order on every pass)", name)
        self.loader.load_state_dict(saved["loader"])
        self._resumed = True
