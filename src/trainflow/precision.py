"""The run's arithmetic: TF32 for fp32 matmuls on CUDA, which arithmetic the matmuls use, and bf16 autocast."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def autocast_for(device: torch.device, precision: str) -> Any:
    """The autocast context of a `trainer.precision` run, reusable: bf16 autocast, or for fp32 no autocast at all
    (even disabled, torch.autocast costs time on every entry)."""
    if precision == "bf16":
        return torch.autocast(device.type, torch.bfloat16)
    return contextlib.nullcontext()


def configure_matmul(device: torch.device, precision: str, tf32: bool) -> None:
    """fp32 matmuls and convolutions on CUDA in TF32 (10-bit mantissa, ~8x the fp32 rate on tensor cores) when
    `tf32`; off, full fp32. bf16 runs are unaffected (autocast picks bf16 kernels)."""
    if device.type != "cuda":
        return
    mode = "tf32" if tf32 and precision == "fp32" else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:  # torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"


def matmul_math(device: torch.device, precision: str) -> str:
    """The arithmetic a run's matmuls use, whose peak MFU divides by and whose rounding tolerances follow: bf16,
    tf32 (CUDA only) or fp32."""
    if precision == "bf16":
        return "bf16"
    if device.type != "cuda":
        return "fp32"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
