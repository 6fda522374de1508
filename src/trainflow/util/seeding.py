"""Seeds: one seed for the whole run, and the seeds derived from it (per rank, per data epoch)."""

import random

import numpy as np
import torch

# A prime stride between derived seeds (seed + stride x rank, seed x stride + epoch): no two ranks or epochs of
# nearby seeds share a random stream.
SEED_STRIDE = 1_000_003


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators, so that a run is repeatable from its trainer.seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
