"""The global sample stream: resumable, world-size-independent sampling in constant memory.

The training stream is defined globally: position p of the stream is sample `perm_e(p % n)` of epoch
`e = p // n`, where `perm_e` is a permutation of [0, n) keyed by (seed, e). Rank r of W takes, for its k-th
micro-batch, the positions `start + k*b*W + r*b + [0, b)`. So every rank reads a disjoint share, each epoch is
reshuffled, and the data position is a single number (samples consumed) that any number of ranks can resume from
without repeating or skipping.

`perm_e` is computed per position (`FeistelPermutation`): no rank ever holds an epoch's order, so a corpus of 1e12
samples costs what one of 1e3 does. Checkpoints saved before this (stream version 1) drew the order with
`torch.randperm`; they resume with that order (`STREAM_VERSION` is saved with the position).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainflow.util.seeding import SEED_STRIDE

STREAM_VERSION = 2  # 1: an epoch's order was torch.randperm(n) (8 bytes a sample); 2: FeistelPermutation
STREAM_VERSIONS = (1, 2)
MAX_SAMPLES = 1 << 63  # the largest n the permutation takes: positions and indices are int64
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
CHUNK_BATCHES = 64  # micro-batches whose indices are computed together
# an epoch of at most this many samples keeps its order as a table (8 MiB at most), computed once per epoch by the
# same permutation: a small data set's batches then cost a lookup, not the permutation's few hundred tensor ops
TABLE_SAMPLES = 1 << 20


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x, c < 2**32, in int64 without overflow (the constant split into 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: every input bit flips about half the output bits (the round function)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _splitmix64(state: int) -> tuple[int, int]:
    """(next state, a 64-bit output) of SplitMix64: the round keys drawn from one seed."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


class FeistelPermutation:
    """A keyed bijection of [0, n), evaluated for a tensor of indices at once in O(1) memory and time each.

    Why a Feistel network with cycle-walking: a Feistel network is a bijection of [0, 2**2h) whatever its round
    function (each round maps (L, R) to (R, L ^ F(R)), which is undone by the same F), so the permutation holds by
    construction, not by the quality of the hash; with a good round function (MurmurHash3's finalizer of the
    half, keyed per round) and 6 rounds its outputs are indistinguishable from a random permutation for a shuffle
    (Luby-Rackoff: 4 rounds already give a pseudo-random permutation). Cycle-walking (re-applying the network to a
    value until it falls in [0, n)) turns that into a bijection of [0, n) for any n, and since 2**2h < 4n the
    expected number of walks is below 4. The alternatives are worse for a shuffle: an affine map (a*x + c) mod n is
    a bijection too but keeps neighbours at a fixed stride (consecutive positions read an arithmetic progression
    of samples), and a stored permutation costs 8 bytes a sample.

    The halves stay apart until the end, so n may be up to 2**63 with every intermediate in int64.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: int) -> None:
        if not 0 < n <= MAX_SAMPLES:
            raise ValueError(f"a permutation of {n} samples: n must be in [1, 2**63]")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # bits of each half: 2**(2*half) >= n
        self.mask = (1 << self.half) - 1
        self.n_high, self.n_low = n >> self.half, n & self.mask  # n's halves: in range iff (L, R) < these
        state, self.keys = key & _M64, []
        for _ in range(self.ROUNDS):
            state, k = _splitmix64(state)
            self.keys.append(k & _M32)

    def _network(self, left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for k in self.keys:
            left, right = right, left ^ (_mix32(right ^ k) & self.mask)
        return left, right

    def _outside(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return (left > self.n_high) | ((left == self.n_high) & (right >= self.n_low))

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        """perm(i) for each i of `indices` (int64, each in [0, n), any shape)."""
        flat = indices.flatten()
        left, right = self._network(flat >> self.half, flat & self.mask)
        walking = self._outside(left, right).nonzero().flatten()
        while walking.numel():  # cycle-walking: only the values that left [0, n) go round again
            wl, wr = self._network(left[walking], right[walking])
            left[walking], right[walking] = wl, wr
            walking = walking[self._outside(wl, wr)]
        return ((left << self.half) | right).view(indices.shape)


class StreamSampler:
    """This rank's micro-batches of the global sample stream, forever, from a start position."""

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0,
        shuffle: bool = True, version: int = STREAM_VERSION,
    ) -> None:
        if version not in STREAM_VERSIONS:
            raise ValueError(f"stream version {version}: this trainflow knows {STREAM_VERSIONS}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start = start
        self.shuffle = shuffle
        self.version = version
        self._order: tuple[int, FeistelPermutation | torch.Tensor] | None = None  # the current epoch's

    def epoch_order(self, epoch: int) -> FeistelPermutation | torch.Tensor:
        """What orders one epoch (reshuffled per epoch, keyed by the seed): a permutation computed per index, its
        table for a small data set, or the stored randperm of a stream of version 1."""
        if self._order is None or self._order[0] != epoch:
            key = self.seed * SEED_STRIDE + epoch
            if self.version == 1:
                self._order = (epoch, torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(key)))
            elif self.num_samples <= TABLE_SAMPLES:
                self._order = (epoch, FeistelPermutation(self.num_samples, key)(torch.arange(self.num_samples)))
            else:
                self._order = (epoch, FeistelPermutation(self.num_samples, key))
        return self._order[1]

    def indices_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Sample indices at the stream positions `positions` (int64, any shape), crossing epochs as needed."""
        epochs, offsets = positions // self.num_samples, positions % self.num_samples
        if not self.shuffle:
            return offsets
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:
            return self._ordered(first, offsets)
        out = torch.empty_like(offsets)
        for epoch in range(first, last + 1):
            where = epochs == epoch
            out[where] = self._ordered(epoch, offsets[where])
        return out

    def _ordered(self, epoch: int, offsets: torch.Tensor) -> torch.Tensor:
        order = self.epoch_order(epoch)
        return order[offsets] if isinstance(order, torch.Tensor) else order(offsets)

    def indices_at(self, first: int, count: int) -> torch.Tensor:
        """Sample indices at stream positions [first, first + count)."""
        return self.indices_of(torch.arange(first, first + count))

    def __iter__(self) -> Iterator[torch.Tensor]:
        """This rank's micro-batches of indices, each its own storage: a DataLoader worker receives one batch,
        not the chunk it is a row of."""
        for chunk in self.chunks():
            yield from (row.clone() for row in chunk)

    def chunks(self) -> Iterator[torch.Tensor]:
        """[micro-batches, batch size] index tensors, CHUNK_BATCHES micro-batches at a time (the permutation's cost
        is a few hundred tensor ops, whatever their length), each chunk spanning at most one epoch's positions, so
        it meets at most 2 epochs. Read in this process, the rows need no copy of their own."""
        b, span = self.batch_size, self.batch_size * self.world_size
        per_chunk = max(1, min(CHUNK_BATCHES, self.num_samples // span))
        within = torch.arange(b)
        k = 0
        while True:
            firsts = self.start + (k + torch.arange(per_chunk)) * span + self.rank * b
            yield self.indices_of(firsts[:, None] + within)
            k += per_chunk
