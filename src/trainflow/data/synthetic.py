"""Random tensors with something to learn: the MLP baseline's classification data and random tokens."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticClassification(Dataset):
    """The MLP baseline's random inputs, labelled by a fixed random teacher so the loss can fall."""

    def __init__(self, num_samples: int, in_features: int, num_classes: int, task_seed: int, input_seed: int) -> None:
        teacher = torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(task_seed))
        self.x = torch.randn(num_samples, in_features, generator=torch.Generator().manual_seed(input_seed))
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at a 1-D tensor of indices; index_select gathers them at half the cost of `x[indices]`."""
        return self.x.index_select(0, indices), self.y.index_select(0, indices)


class SyntheticTokens(Dataset):
    """Random token sequences (a language-model shape with nothing to learn beyond unigram)."""

    def __init__(self, num_samples: int, vocab_size: int, seq_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab_size, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens.index_select(0, indices)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
