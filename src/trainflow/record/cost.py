"""What the steady state costs: the device's energy (NVIDIA GPUs report it) and money (trainer.cost_per_hour).

Energy comes from the board's own counter (total energy since the driver loaded, in millijoules: NVML's
nvmlDeviceGetTotalEnergyConsumption, Volta and later), read through pynvml where it is installed
(`pip install 'trainflow[energy]'`), else through `nvidia-smi --query-gpu=total_energy_consumption` (its unit read
from its output). It is read
when the steady state begins and when the loop ends, on every rank for its own GPU; the ranks' mean powers add up,
and joules per sample (and per token) are that power over the steady throughput. The reads pause the clock. A CPU
run, a GPU without the counter, or a machine with neither pynvml nor nvidia-smi has no energy figure, and the
summary says which: absent with a reason, never zero.

Money: trainer.cost_per_hour is the price of one device (rank) for an hour, so the run's cost is the world size
times the hours from the assembly to the end, and the cost of a million tokens (samples, for models without tokens)
follows from the steady throughput.
"""

from __future__ import annotations

import math
import subprocess
import time
from typing import Any

import torch

from trainflow.distributed.process_group import DistEnv, all_reduce_mean
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState

SMI_TIMEOUT_S = 10.0


class EnergyCounter:
    """The energy counter of this rank's GPU, in joules, or the reason there is none (`absent`)."""

    def __init__(self, device: torch.device) -> None:
        self.absent: str | None = None
        self.source: str | None = None
        self._nvml: Any = None
        self._uuid = ""
        if device.type != "cuda":
            self.absent = (f"the device is a {device.type.upper()}: trainflow reads energy from NVIDIA GPUs' own "
                           "counters (NVML) only")
            return
        props = torch.cuda.get_device_properties(device)
        self._uuid = str(getattr(props, "uuid", "")).lower().removeprefix("gpu-")
        try:
            import pynvml  # lazy: pynvml is the energy extra

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._nvml_handle(device)
            self.source = "nvml"
        except ImportError:
            self.source = "nvidia-smi"
        except Exception as exc:  # noqa: BLE001 (NVML raises its own error types for a driver it cannot use)
            self.absent = f"NVML could not be used ({type(exc).__name__}: {exc})"
            return
        if self.read() is None and self.absent is None:
            self.absent = "the GPU reports no energy counter (NVML's total energy needs a Volta or later GPU)"

    def _nvml_handle(self, device: torch.device) -> Any:
        if self._uuid:
            return self._nvml.nvmlDeviceGetHandleByUUID(f"GPU-{self._uuid}")
        return self._nvml.nvmlDeviceGetHandleByIndex(device.index or 0)

    def read(self) -> float | None:
        """Joules since the driver loaded; None where the counter cannot be read."""
        if self.absent is not None:
            return None
        if self._nvml is not None:
            try:
                return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3
            except Exception:  # noqa: BLE001 (NVMLError_NotSupported and the like)
                return None
        return self._smi_read()

    def _smi_read(self) -> float | None:
        """nvidia-smi's counter for this GPU, in joules: it prints the unit (mJ, or J), which is read, not assumed."""
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,total_energy_consumption", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            self.absent = "neither pynvml (pip install 'trainflow[energy]') nor nvidia-smi is available"
            return None
        for line in out.stdout.splitlines():
            uuid, _, reading = (part.strip() for part in line.partition(","))
            if self._uuid and uuid.lower().removeprefix("gpu-") != self._uuid:
                continue
            number, _, unit = reading.partition(" ")
            try:
                return float(number) / (1.0 if unit.strip() == "J" else 1e3)  # NVML's own unit: mJ
            except ValueError:
                return None  # [N/A]: no counter on this GPU
        return None


class Cost(Stage):
    """Reads the energy counter when the steady state begins and when the loop ends (enabled only where there is
    one); the summary turns it and trainer.cost_per_hour into energy per sample and token and cost per million
    tokens (every rank takes part)."""

    phase = Phase.OBSERVE  # it only reads: the step as it was
    # entered after the profiler and left before it: the energy is the loop's, not the profiler's start-up and trace
    # export
    after = ("profiler",)
    summary_key = "cost"

    def __init__(self, env: DistEnv, cost_per_hour: float | None) -> None:
        self.env, self.cost_per_hour = env, cost_per_hour
        self.started = time.monotonic()
        self.counter = EnergyCounter(env.device)
        self.enabled = self.counter.absent is None
        self._paused = 0.0
        self._steady: tuple[float, float | None] | None = None  # (clock, joules)
        self._end: tuple[float, float | None] | None = None

    @classmethod
    def build(cls, ctx: StageContext) -> Cost:
        return cls(ctx.env, ctx.cfg.trainer.cost_per_hour)

    def _sample(self) -> tuple[float, float | None]:
        began = time.perf_counter()
        joules = self.counter.read()
        self._paused += time.perf_counter() - began
        return time.monotonic(), joules

    def __enter__(self) -> Cost:
        self._steady = self._sample()  # replaced when the steady state begins after excluded steps
        return self

    def after_step(self, state: LoopState) -> bool:
        if state.steps_this_run == state.meter.excluded_steps:
            self._steady = self._sample()
        return False

    def take_paused_s(self) -> float:
        paused, self._paused = self._paused, 0.0
        return paused

    def __exit__(self, *exc: object) -> None:
        self._end = self._sample()

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        watts = self._watts()
        if self.env.distributed and self.env.device.type == "cuda":  # every rank's GPU draws power: their sum
            total = torch.tensor([watts if watts is not None else float("nan")], dtype=torch.float64,
                                 device=self.env.device)
            watts = float(all_reduce_mean(total, self.env).item()) * self.env.world_size
            watts = None if math.isnan(watts) else watts  # a rank without a reading: no total
        if not self.env.is_main:
            return None
        return {"energy": self._energy(watts, steady), "money": self._money(steady)}

    def _watts(self) -> float | None:
        if self._steady is None or self._end is None or self._steady[1] is None or self._end[1] is None:
            return None
        seconds = self._end[0] - self._steady[0]
        return (self._end[1] - self._steady[1]) / seconds if seconds > 0 else None

    def _energy(self, watts: float | None, steady: dict[str, Any] | None) -> dict[str, Any]:
        if self.counter.absent is not None:
            return {"absent": self.counter.absent}
        if watts is None or not steady:
            return {"absent": "the counter gave no reading over a steady state (too few steps after the warm-up, or "
                              "a rank without one)"}
        tokens = steady["tokens_per_sec"]
        return {"source": self.counter.source, "watts": round(watts, 2),
                "joules_per_sample": watts / steady["samples_per_sec"],
                "joules_per_token": watts / tokens if tokens else None}

    def _money(self, steady: dict[str, Any] | None) -> dict[str, Any]:
        if self.cost_per_hour is None:
            return {"absent": "trainer.cost_per_hour is not set (the price of one device for an hour)"}
        per_second = self.cost_per_hour * self.env.world_size / 3600
        out: dict[str, Any] = {"per_hour": self.cost_per_hour, "devices": self.env.world_size,
                               "run": per_second * (time.monotonic() - self.started)}
        if steady:
            tokens = steady["tokens_per_sec"]
            out["per_million_tokens"] = per_second / tokens * 1e6 if tokens else None
            out["per_million_samples"] = per_second / steady["samples_per_sec"] * 1e6
        return out
