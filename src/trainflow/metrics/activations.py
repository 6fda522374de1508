"""What autograd keeps for backward during one forward, split by block: the one meter behind the batch check
(batch_fit.py, on the meta device, before anything of the batch's size exists) and parallelism=auto's memory plan
(distributed/memory_estimate.py, on a real example).

With activation checkpointing each block keeps only its input, and one block's activations exist at a time
(while it is recomputed in backward): `checkpointed` counts that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Saved:
    """Bytes autograd saved: outside the blocks, in each block, and the blocks' inputs."""

    outside: int
    per_block: list[int]
    block_inputs: int

    @property
    def total(self) -> int:
        return self.outside + sum(self.per_block)

    @property
    def checkpointed(self) -> int:
        """With each block checkpointed: what lives outside them, every block's input and the largest block."""
        return self.outside + self.block_inputs + max(self.per_block, default=0)


def saved_for_backward(forward: Callable[[], Any], blocks: list[nn.Module],
                       size_of: Callable[[torch.Tensor], int]) -> Saved:
    """Run `forward` (the model's forward and loss) and count each tensor autograd saves with `size_of` (0: not an
    activation, such as a weight), by the block running when it was saved (blocks do not nest in each other)."""
    per_block = [0] * len(blocks)
    inputs = [0] * len(blocks)
    current: list[int] = []  # the block running now
    outside = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        size = size_of(t)
        if current:
            per_block[current[-1]] += size
        else:
            outside += size
        return t

    def enter(index: int) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            current.append(index)
            inputs[index] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        return hook

    def leave(*_: Any) -> None:  # a forward hook's return value would replace the block's output
        current.pop()

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return Saved(outside, per_block, sum(inputs))
