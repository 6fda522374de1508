"""The global sample stream's order: a keyed bijection computed per position, in constant memory, on any world
size; and the order of checkpoints saved before it (stream version 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainflow.checkpoint.state import saved_stream_version
from trainflow.data.stream import FeistelPermutation, StreamSampler
from trainflow.errors import CheckpointError
from trainflow.util.seeding import SEED_STRIDE


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 97, 127, 128, 1000, 1024, 4096, 4099, 65537])
def test_the_permutation_is_a_bijection_of_every_small_domain(n: int) -> None:
    """Exhaustively, for several keys: 1, 2, odd, primes (97, 127, 4099, 65537), powers of two (and 4 and 16, where
    the network's domain is exactly n: no walk)."""
    orders = []
    for key in (0, 1, 2**64 - 1):
        order = FeistelPermutation(n, key)(torch.arange(n))
        assert order.dtype == torch.int64 and torch.equal(order.sort().values, torch.arange(n))
        orders.append(order[:64].tolist())
    if n >= 16:  # the key reshuffles (tiny domains have few permutations to choose from)
        assert orders[0] != orders[1] != orders[2]
        assert orders[0] != list(range(n))


def test_the_permutation_takes_the_largest_domain() -> None:
    """n = 2**63: halves of 32 bits whose joined value would overflow int64 outside [0, n); none comes out."""
    f = FeistelPermutation(2**63, 7)
    x = torch.tensor([0, 1, 2**62, 2**63 - 1, 12345678901234567])
    y = f(x)
    assert bool((y >= 0).all()) and len(set(y.tolist())) == len(x)
    assert torch.equal(f(x[2:3]), y[2:3])  # each index alone: computed per position, not from its neighbours
    with pytest.raises(ValueError, match="must be in"):
        FeistelPermutation(2**63 + 1, 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_trillion_samples_on_1024_ranks_in_constant_memory() -> None:
    """n = 1e12, 1,024 simulated ranks: their first batches are disjoint, memory does not grow with n, and a
    resume at another world size (256 ranks, 4x the micro-batch: the same global batch) finds the same positions."""
    n, world, b, steps = 10**12, 1024, 8, 3
    samplers = [StreamSampler(n, b, r, world, seed=11) for r in range(world)]
    before = rss_bytes()
    batches = [[batch.tolist() for batch, _ in zip(iter(s), range(steps), strict=False)] for s in samplers]
    grown = rss_bytes() - before
    everything = [i for rank in batches for batch in rank for i in batch]
    assert len(everything) == world * b * steps == len(set(everything))  # disjoint across ranks and steps
    assert all(0 <= i < n for i in everything)
    assert grown < 10 << 20, f"RSS grew {grown / 2**20:.1f} MiB"  # randperm(1e12) would be 8 TB
    # the global micro-batch of step k is the concatenation of the ranks' batches of step k, whatever the layout
    step_two = [i for rank in batches for i in rank[2]]
    start = 2 * world * b  # samples consumed after two steps: the one integer a checkpoint saves
    resumed = [next(iter(StreamSampler(n, b * 4, r, world // 4, seed=11, start=start))).tolist()
               for r in range(world // 4)]
    assert [i for batch in resumed for i in batch] == step_two
    assert StreamSampler(n, 1, 0, 1, seed=11).indices_at(start, world * b).tolist() == step_two


def test_each_epoch_is_reshuffled_and_every_sample_comes_once() -> None:
    n, b = 1000, 64  # chunks of micro-batches straddle epoch boundaries
    sampler = iter(StreamSampler(n, b, 0, 1, seed=3))
    seen = [i for _ in range(3 * n // b + 1) for i in next(sampler).tolist()]
    epochs = [seen[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert StreamSampler(n, b, 0, 1, seed=4).indices_at(0, n).tolist() != epochs[0]  # the seed reshuffles


def test_a_checkpoint_from_before_the_version_resumes_in_its_randperm_order(tmp_path: Path) -> None:
    """No stream_version saved: version 1, whose order is what the sampler drew before (torch.randperm keyed by
    seed x SEED_STRIDE + epoch), so the resumed run reads what it would have read; an unknown one is refused."""
    assert saved_stream_version({"step": 4, "samples_seen": 64}, tmp_path) == 1
    assert saved_stream_version({"stream_version": 2}, tmp_path) == 2
    n, seed = 50, 5
    old = [torch.randperm(n, generator=torch.Generator().manual_seed(seed * SEED_STRIDE + e)) for e in range(2)]
    resumed = iter(StreamSampler(n, 4, 1, 2, seed=seed, start=40, version=1))  # rank 1 of 2 from position 40
    assert next(resumed).tolist() == old[0][44:48].tolist()
    assert next(resumed).tolist() == old[1][2:6].tolist()  # positions 52..55: the next epoch's order
    with pytest.raises(CheckpointError, match=r"sample stream version 3, and this trainflow knows versions 1, 2; "):
        saved_stream_version({"stream_version": 3}, tmp_path)
