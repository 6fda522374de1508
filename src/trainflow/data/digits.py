"""scikit-learn's handwritten digits (1797 images of 8x8 pixels, 10 classes): real data shipped inside a package.

Read through `data._target_` exactly as a user's own data is: map-style datasets of (image, label) items,
collated by torch's default_collate.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from trainflow.errors import DataError

MAX_PIXEL = 16.0  # load_digits' pixels are counts 0..16


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, val): images as [1, 8, 8] floats in [0, 1], labels as int64; `val_fraction` of them held out."""
    try:
        from sklearn.datasets import load_digits  # lazy: scikit-learn is the vision extra
    except ImportError:
        raise DataError("data: data=digits reads scikit-learn's digits, and scikit-learn is not installed; run "
                        "pip install 'trainflow[vision]'") from None
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction: must be in (0, 1); got {val_fraction}")
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / MAX_PIXEL
    labels = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(len(labels) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])
