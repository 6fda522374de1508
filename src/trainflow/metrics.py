"""Measured figures: FLOPs, peak FLOP/s, throughput, memory; written to jsonl, the chosen loggers and the log.

Step times are read at log boundaries only (with a device sync there), so
measuring does not put a sync in every step.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import platform
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainflow.data.loaders import to_device
from trainflow.device import device_sync
from trainflow.files import write_atomic
from trainflow.precision import matmul_math

if TYPE_CHECKING:

    from trainflow.loop_state import LoopState
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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


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
    key = f"{_cpu_name()}|threads={threads}|torch={torch.__version__}"
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


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by tensors. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory of the training steps: per log interval, and over the run.

    CUDA: the allocator's own peaks (allocated, and reserved by its cache), reset when training starts, when the
    steady state begins and after each log interval, so that the FLOP count's copy, compile.check's two passes and
    the parity check's reference do not hide what training holds (FSDP's savings). CPU: the process's peak
    resident set, which cannot be reset.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = 0  # the largest interval peak since the last reset()
        self.reserved = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated = self.reserved = 0

    def take(self) -> int:
        """The peak of the interval that ends now (CUDA) or of the process (CPU); the next interval starts."""
        if self.device.type != "cuda":
            return peak_memory_bytes(self.device)
        allocated = int(torch.cuda.max_memory_allocated(self.device))
        self.allocated = max(self.allocated, allocated)
        self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved(self.device)))
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated

    def summary(self) -> dict[str, int | None]:
        if self.device.type != "cuda":
            return {"peak_memory_bytes": peak_memory_bytes(self.device), "peak_memory_reserved_bytes": None}
        self.take()
        return {"peak_memory_bytes": self.allocated, "peak_memory_reserved_bytes": self.reserved}


@dataclass
class Counts:
    """What the steps of a stretch of the run did: steps, samples and tokens (of every rank), data wait."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    data_wait_s: float = 0.0

    def since(self, earlier: Counts) -> Counts:
        return Counts(self.steps - earlier.steps, self.samples - earlier.samples, self.tokens - earlier.tokens,
                      self.data_wait_s - earlier.data_wait_s)


class Throughput:
    """The run's clocks and counts: the steady state (after the excluded steps, less the stages' pauses) and each
    log interval.

    Timing and counting live here alone: the loop reports each step (`end_step`) and the time the stages paused
    the clock (`pause`); the train metrics read their interval as `counts()` since its start. A step is read with
    a device sync only while excluded steps run (the compile report's warm-up step times), never in the steady
    state. The peak memory restarts when the steady state does.
    """

    def __init__(self, excluded_steps: int, device: torch.device, memory: PeakMemory) -> None:
        self.excluded_steps = excluded_steps
        self.device = device
        self.memory = memory
        self.start: float | None = None  # when the steady state began (moved later by each pause)
        self.stopped_at: float | None = None
        self._steps = self._samples = self._tokens = 0  # every step's since the loop began
        self._data_wait_s = 0.0
        self._steady_from = Counts()  # the counts when the steady state began
        self._step_start = 0.0  # while excluded steps run
        self._interval_start = 0.0

    def counts(self) -> Counts:
        return Counts(self._steps, self._samples, self._tokens, self._data_wait_s)

    def begin(self) -> None:
        """Before the first step (after a device sync): the clocks start; the steady state too if nothing is
        excluded."""
        self.memory.reset()  # the FLOP count, compile.check and the parity copy are not training
        device_sync(self.device)
        self._step_start = self._interval_start = now = time.perf_counter()
        self._begin_if_due(0, now)

    def end_step(self, state: LoopState, samples: int, tokens: int) -> None:
        """After each optimizer step: an excluded step's synced wall time goes into `state.step_time_s`; a steady
        one is counted (`tokens`: of every rank)."""
        self._steps += 1
        self._samples += samples
        self._tokens += tokens
        self._data_wait_s += state.data_wait_s
        if state.steps_this_run > self.excluded_steps:
            state.step_time_s = None
            return
        device_sync(self.device)
        now = time.perf_counter()
        state.step_time_s = now - self._step_start
        self._step_start = now
        self._begin_if_due(state.steps_this_run, now)

    def _begin_if_due(self, steps_done: int, now: float) -> None:
        if self.start is None and steps_done >= self.excluded_steps:
            self.start, self._steady_from = now, self.counts()
            if steps_done:
                self.memory.reset()  # the steady state's peak leaves out compilation's

    def pause(self, seconds: float) -> None:
        """Leave `seconds` of non-training work (evaluation, a checkpoint save) out of every clock. A stage that
        pauses starts its own clock after `device_sync`: the training steps still queued on the device are training."""
        if self.start is not None:
            self.start += seconds
        self._step_start += seconds
        self._interval_start += seconds

    def interval_s(self) -> float:
        """Seconds of training since the log interval began (after a device sync)."""
        device_sync(self.device)
        return time.perf_counter() - self._interval_start

    def restart_interval(self) -> None:
        self._interval_start = time.perf_counter()

    def stop(self) -> None:
        """After the last step, once the device has run it (on CUDA the host is steps ahead of the device until
        something syncs: without this wait the steady state would end before its last steps did)."""
        device_sync(self.device)
        self.stopped_at = time.perf_counter()

    def steady_state(self) -> dict[str, float] | None:
        """The steady-state figures of the run (None: no step came after the excluded ones)."""
        steady = self.counts().since(self._steady_from)
        if self.start is None or steady.steps == 0:
            return None
        elapsed = self.stopped_at - self.start
        return {
            "steps": steady.steps,
            "excluded_steps": self.excluded_steps,
            "step_time_s": elapsed / steady.steps,
            "samples_per_sec": steady.samples / elapsed,
            "tokens_per_sec": steady.tokens / elapsed,
            "data_wait_fraction": steady.data_wait_s / elapsed,
        }


def mfu(flops_per_step: int | None, steady: dict | None, peak: float | None) -> float | None:
    if not (flops_per_step and steady and peak):
        return None
    return flops_per_step / steady["step_time_s"] / peak


def host_load() -> dict[str, Any]:
    """The machine's load at the end of a run (os.getloadavg: 1, 5 and 15 minutes) and its CPU cores: a load
    above the cores means the run's processes waited for a core, and its timings say so much about the machine."""
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"load_average": load, "cpu_cores": os.cpu_count()}
