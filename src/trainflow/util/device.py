"""The device and its arithmetic: TF32 for fp32 matmuls on CUDA, which arithmetic the matmuls use, bf16 autocast,
whether this CPU computes bf16 natively (emulated, it is slower than fp32: measured, then said), and waiting for the
device's queued work (on CUDA the host runs ahead of its kernels, so a clock read on the host measures the device's
work only after a sync: the meter and the stages that pause its clocks use `device_sync`)."""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU's model as /proc/cpuinfo names it, else what Python's platform module knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_for(device: torch.device, precision: str) -> Any:
    """The autocast context of a `trainer.precision` run, reusable: bf16 autocast (fp8 too: float8 layers cast
    their own matmuls, the rest runs in bf16), or for fp32 no autocast at all (even disabled, torch.autocast costs
    time on every entry)."""
    if precision in ("bf16", "fp8"):
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
    """The arithmetic a run's matmuls use, whose peak MFU divides by and whose rounding tolerances follow: fp8,
    bf16, tf32 (CUDA only) or fp32."""
    if precision in ("bf16", "fp8"):
        return precision
    if device.type != "cuda":
        return "fp32"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def cpu_flags() -> frozenset[str] | None:
    """The CPU feature flags Linux reports, or None where /proc/cpuinfo is not available."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_slowdown(size: int = 384, repeats: int = 5) -> float:
    """Time of a bf16 matmul over an fp32 one of the same size (best of a few): > 1 means bf16 is slower."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.bfloat16] / best[torch.float32]


def emulated_bf16_warning(keys: list[str], device: torch.device, flags: frozenset[str] | None = None) -> str | None:
    """A warning when the config `keys` ask for bf16 on a CPU without native bf16, with the slowdown measured."""
    if not keys or device.type != "cpu":
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is not None and flags & {"avx512_bf16", "amx_bf16"}:
        return None
    ratio = bf16_slowdown()
    return (f"{', '.join(keys)}=bf16: this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag), so bf16 is "
            f"emulated: a bf16 matmul measured {ratio:.2g}x the time of fp32 here; use fp32 on this machine")
