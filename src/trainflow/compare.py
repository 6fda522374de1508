"""How the correctness checks measure a difference (compiled vs eager, many ranks vs one process)."""

import torch


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The norm of the difference over the norm of the reference, all elements as one vector (one figure per
    tensor, whatever its size); the norm of the difference itself where the reference is all zeros."""
    diff = torch.linalg.vector_norm(got - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    return diff / scale if scale > 0 else diff
