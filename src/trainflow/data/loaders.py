"""Loaders over whole micro-batches: the stream's index lists gathered at once, cut, pinned, moved to the device."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from trainflow.config.schema import DataSection
from trainflow.data.iterable import IterableBatches, IterableSource
from trainflow.data.stream import StreamSampler
from trainflow.data.worker_errors import from_workers

Batch = Any  # one micro-batch: (inputs, targets) for the built-in data; tensors in tuples, lists, dicts for a user's


def apply_to_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """`fn` applied to every tensor of a nested batch (tuples, lists, dicts), the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: apply_to_tensors(v, fn) for k, v in batch.items()}  # a plain dict: what model(**batch) takes
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(apply_to_tensors(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(apply_to_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """Every tensor of a batch on `device` (non_blocking: from pinned memory, without waiting)."""
    return apply_to_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


class VariableLengths:
    """Micro-batch k of the stream cut to `seq_lens[k % n]` tokens: the varying shapes real data has.

    k counts micro-batches of the whole stream (all ranks take theirs at the same k), so the length of a
    micro-batch depends only on its stream position: the same after a resume and on any number of ranks.
    """

    def __init__(self, loader: Iterable[Batch], seq_lens: list[int], sampler: StreamSampler) -> None:
        self.loader = loader
        self.seq_lens = seq_lens
        self.first = sampler.start // (sampler.batch_size * sampler.world_size)

    def __iter__(self) -> Iterator[Batch]:
        for k, batch in enumerate(self.loader, start=self.first):
            yield cut(batch, self.seq_lens[k % len(self.seq_lens)])


def cut(batch: tuple[torch.Tensor, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A language model's (inputs, targets) cut to their first `n` tokens, as data.seq_lens cuts them."""
    inputs, targets = batch
    return inputs[:, :n].contiguous(), targets[:, :n].contiguous()


class Pinned:
    """Batches copied into page-locked memory, so that `.to(cuda, non_blocking=True)` does not wait."""

    def __init__(self, loader: Iterable[Batch]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.loader:
            yield apply_to_tensors(batch, torch.Tensor.pin_memory)


class InProcessBatches:
    """Micro-batches gathered in this process: with no workers, DataLoader's machinery only adds ~0.1 ms a
    batch (7% of the seed MLP's step), so it is left out."""

    def __init__(self, dataset: Dataset, sampler: StreamSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def __iter__(self) -> Iterator[Batch]:
        for chunk in self.sampler.chunks():
            for indices in chunk:  # a view of the chunk: the gather copies, so no copy of the indices is needed
                yield self.dataset[indices]


class Batches:
    """A DataLoader's batches, its workers' trainflow errors in one line (worker_errors.py)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        return from_workers(self.loader)


def make_loader(
    dataset: Dataset, sampler: StreamSampler, data: DataSection, pin_memory: bool
) -> Iterable[Batch]:
    """A loader over whole micro-batches, as the data section's loader keys say: the sampler yields index lists the
    dataset gathers at once.

    Pinning comes last (cutting a pinned batch to a length would copy it back into pageable memory); with
    workers and no cutting, DataLoader pins in its own thread instead. An iterable dataset's loader reads this
    rank's share of its stream (data/iterable.py): the sampler gives it the rank, world size and micro-batch only.
    """
    loader: Iterable[Batch]
    if isinstance(dataset, IterableSource):  # the user's stream: batched by torchdata, sharded by rank and worker
        return IterableBatches(dataset, sampler.rank, sampler.world_size, sampler.batch_size, data, pin_memory)
    seq_lens, workers = data.seq_lens, data.num_workers
    if workers == 0:
        loader = InProcessBatches(dataset, sampler)
    else:
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=workers,
            pin_memory=pin_memory and not seq_lens,
            persistent_workers=data.persistent_workers,
            prefetch_factor=data.prefetch_factor,
        )
        loader = Batches(loader)
    if seq_lens:
        loader = VariableLengths(loader, list(seq_lens), sampler)
    if pin_memory and (workers == 0 or seq_lens):
        loader = Pinned(loader)
    return loader
