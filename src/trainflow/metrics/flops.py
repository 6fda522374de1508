"""FLOPs and MFU: the FLOPs of one training micro-step (counted on the meta device), the device's peak FLOP/s (a
known GPU's datasheet, or a measured CPU), and the share of that peak a run achieved."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainflow.data.loaders import to_device
from trainflow.util.device import cpu_name, matmul_math
from trainflow.util.files import write_atomic

if TYPE_CHECKING:
    from trainflow.tasks import Task

log = logging.getLogger(__name__)

# Dense (no sparsity) datasheet peaks in TFLOP/s by the math a run uses: fp32 (CUDA cores), tf32 and bf16 (tensor
# cores), fp8. Matched against the whole device name (vendor words dropped): "H100 PCIe" is not an H100 SXM, "L40"
# is not an L4. None: the device has no such units (V100 and T4 have no bf16 or tf32).
_HOPPER_SXM = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp8": 1978.9}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp8": None}
_A10 = {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp8": None}
_GPU_PEAKS_TFLOPS: list[tuple[str, dict[str, float | None]]] = [
    (r"H100( 80GB HBM3| SXM5? ?\d*GB)?", _HOPPER_SXM),
    (r"H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp8": 1513.0}),
    (r"H100 NVL", _HOPPER_NVL),
    (r"H200( \d+GB HBM3e)?", _HOPPER_SXM),
    (r"H200 NVL", _HOPPER_NVL),
    (r"GH200 \d+GB", _HOPPER_SXM),
    (r"B200", {"fp32": None, "tf32": 1100.0, "bf16": 2250.0, "fp8": 4500.0}),
    (r"A100[- ].*", _A100),
    (r"A10G?", _A10),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp8": 733.0}),
    (r"L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp8": 362.0}),
    (r"L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp8": 242.5}),
    (r"V100-SXM2-\d+GB", {"fp32": 15.7, "tf32": None, "bf16": None, "fp8": None}),
    (r"V100S?-PCIE-\d+GB", {"fp32": 14.0, "tf32": None, "bf16": None, "fp8": None}),
    (r"T4", {"fp32": 8.1, "tf32": None, "bf16": None, "fp8": None}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp8": 330.3}),
    (r"RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp8": None}),
]
_PEAK_CACHE = Path("~/.cache/trainflow/peak_flops.json").expanduser()


def count_train_flops(model: nn.Module, batch: Any, task: Task) -> tuple[int | None, str | None]:
    """FLOPs of one forward + backward micro-step, counted on a meta-device copy (no compute, no RNG use); or None
    and why not (summary.json says it where MFU is absent)."""
    try:
        meta_model = copy.deepcopy(model).to("meta")
        with FlopCounterMode(display=False) as counter:
            loss, _ = task(meta_model, to_device(batch, torch.device("meta")))
            loss.backward()
        flops = int(counter.get_total_flops())
    except Exception as exc:  # a user op without a meta kernel: MFU is then unknown, not wrong
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"FlopCounterMode could not count {type(model).__name__} on the meta device ({type(exc).__name__}: " \
                 f"{text})"
        log.warning("%s; MFU will be missing", reason)
        return None, reason
    if flops == 0:
        return None, f"FlopCounterMode counted no FLOPs in {type(model).__name__} (no matmul or convolution it knows)"
    return flops, None


def _measure_cpu_peak(threads: int) -> float:
    """Best of a few large fp32 matmuls: what this CPU really sustains with these threads."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, precision: str, override: float | None, at_least: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override, a known GPU's datasheet, or a cached CPU measurement.

    `at_least`: FLOP/s a run achieved. A cached CPU peak below it was measured under load: it is measured again
    and the higher figure kept, so MFU never rests on a stale, low peak.
    """
    if override is not None:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        math_used = matmul_math(device, precision)
        peak = gpu_peak_flops(name, math_used)
        if peak is None:
            log.warning("no %s peak known for the GPU %r: set metrics.peak_flops to get MFU", math_used, name)
        return peak
    threads = torch.get_num_threads()
    key = f"{cpu_name()}|threads={threads}|torch={torch.__version__}"
    try:
        cache = json.loads(_PEAK_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache or cache[key] < at_least:
        cache[key] = max(cache.get(key, 0.0), _measure_cpu_peak(threads))
        if at_least:
            log.info("the cached CPU peak was below the FLOP/s this run achieved: measured again, %.1f GFLOP/s",
                     cache[key] / 1e9)
        try:
            _PEAK_CACHE.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(_PEAK_CACHE, json.dumps(cache, indent=1))
        except OSError:
            pass  # an unwritable home only costs a re-measurement next time
    return cache[key]


def gpu_peak_flops(name: str, math_used: str) -> float | None:
    """The datasheet's dense peak FLOP/s of the GPU named `name` for `math_used` (fp32, tf32, bf16, fp8)."""
    model = re.sub(r"^(NVIDIA |Tesla )*(GeForce )?", "", name.strip())
    for pattern, peaks in _GPU_PEAKS_TFLOPS:
        if re.fullmatch(pattern, model):
            tflops = peaks.get(math_used)
            return tflops * 1e12 if tflops else None
    return None


def mfu(flops_per_step: int | None, steady: dict | None, peak: float | None) -> float | None:
    if not (flops_per_step and steady and peak):
        return None
    return flops_per_step / steady["step_time_s"] / peak
