"""How the correctness checks measure a difference (compiled vs eager, many ranks vs one process, a ladder rung vs
the baseline), and how much of one each accepts."""

import torch

# The relative error each check accepts by default, by the matmuls' arithmetic (trainflow.util.device.matmul_math):
# TF32 and bf16 keep 10 and 7 mantissa bits, so fused and unfused kernels, and differently ordered reductions, round
# visibly differently. compile.check: one batch, compiled against eager. parallelism.check: the ranks against one
# process (bf16 gradients of 2-sample shards round differently from the one-process batch). ladder: every logged
# loss of a rung against the baseline's; in bf16 two runs drift apart most where the loss falls fastest, just after
# the learning-rate warm-up (docs/gpu.md: 3.4e-2 for compiled vs eager gpt_small on an H200). compare: a tensor of two
# checkpoints (trainflow compare, --bisect), weights and optimizer state: the same code on the same machine saves them
# bit for bit alike; another reduction order moves fp32 weights by ~1e-7 a step, which a few steps keep far below 1e-5.
# fp8 (float8 matmuls, 3 mantissa bits, scaled per tensor or row): twice bf16's, a bound still to be measured on a
# GPU (docs/gpu.md); the ladder's fp8 rung compares fp8 with bf16 by "ladder.fp8_rtol": bf16's own run-to-run drift
# (5e-2) plus as much again for float8's rounding of every linear layer's inputs, weights and gradients.
TOLERANCE = {
    "compile.check": {"fp32": 1e-4, "tf32": 1e-2, "bf16": 1e-2, "fp8": 2e-2},
    "parallelism.check": {"fp32": 1e-4, "tf32": 1e-2, "bf16": 2e-2, "fp8": 4e-2},
    "ladder.loss_rtol": {"fp32": 1e-3, "tf32": 1e-2, "bf16": 5e-2, "fp8": 1e-1},
    "ladder.fp8_rtol": {"bf16": 1e-1},
    "compare.rtol": {"fp32": 1e-5, "tf32": 1e-3, "bf16": 1e-2},
}


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The norm of the difference over the norm of the reference, all elements as one vector (one figure per
    tensor, whatever its size); the norm of the difference itself where the reference is all zeros."""
    diff = torch.linalg.vector_norm(got - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    return diff / scale if scale > 0 else diff
