"""The global sample stream: resumable, world-size-independent sampling.

The training stream is defined globally: position p of the stream is sample
`perm_e[p % n]` of epoch `e = p // n`, where `perm_e` is a permutation seeded by
(seed, e). Rank r of W takes, for its k-th micro-batch, the positions
`start + k*b*W + r*b + [0, b)`. So every rank reads a disjoint share, each epoch
is reshuffled, and the data position is a single number (samples consumed)
that any number of ranks can resume from without repeating or skipping.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainflow.seeding import SEED_STRIDE


class StreamSampler:
    """This rank's micro-batches of the global sample stream, forever, from a start position."""

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self._perm: tuple[int, torch.Tensor] | None = None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The reshuffled order of one epoch (the `set_epoch` of this sampler is implicit in the position)."""
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch)
                self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
            else:
                self._perm = (epoch, torch.arange(self.num_samples))
        return self._perm[1]

    def indices_at(self, first: int, count: int) -> torch.Tensor:
        """Sample indices at stream positions [first, first + count), crossing epochs as needed."""
        parts = []
        while count > 0:
            epoch, offset = divmod(first, self.num_samples)
            take = min(count, self.num_samples - offset)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            first, count = first + take, count - take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __iter__(self) -> Iterator[torch.Tensor]:
        b, k = self.batch_size, 0
        while True:
            first = self.start + k * b * self.world_size + self.rank * b
            yield self.indices_at(first, b)
            k += 1
