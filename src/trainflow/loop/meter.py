"""The throughput meter: step times, samples and tokens per second, peak memory, the machine's load.

The wall-time figures are read at log boundaries only (with a device sync there), so measuring does not put a sync
in every step. Beside them the meter keeps each steady step's device time, the figure another process's load moves
least (docs/compare.md measures it): on CPU the process's CPU seconds (all its threads) of the step, which grow
only a little when other processes take turns on the cores, while the wall time grows with every turn they take;
on a GPU the device's time of the step, from CUDA events on its stream (read when the meter syncs anyway). It also
keeps the 10th percentile of single steps' times, the other candidate the measurement compared.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from array import array
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainflow.metrics.noise import percentile
from trainflow.util.device import device_sync

log = logging.getLogger(__name__)

LOW_PERCENTILE = 0.1  # step_time_p10_s: the step time that a tenth of the steady steps beat or equal

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


class EndedStep(Protocol):
    """What the meter reads of the loop state after a step (trainflow.loop.state.LoopState), and writes there: the
    loop state holds the meter, so the meter names only these fields."""

    steps_this_run: int
    data_wait_s: float
    step_time_s: float | None


class Throughput:
    """The run's clocks and counts: the steady state (after the excluded steps, less the stages' pauses) and each
    log interval.

    Timing and counting live here alone: the loop reports each step (`end_step`) and the time the stages paused
    the clock (`pause`); the train metrics read their interval as `counts()` since its start. A step is read with
    a device sync only while excluded steps run (the compile report's warm-up step times), never in the steady
    state. The peak memory restarts when the steady state does. Each steady step's times go into `SingleSteps`.
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
        self._step_start = 0.0  # the end of the previous step, less the pauses since
        self._interval_start = 0.0
        self.single = SingleSteps(device)
        self._paused = False  # a stage paused the clocks since the previous step ended

    def counts(self) -> Counts:
        return Counts(self._steps, self._samples, self._tokens, self._data_wait_s)

    def begin(self) -> None:
        """Before the first step (after a device sync): the clocks start; the steady state too if nothing is
        excluded."""
        self.memory.reset()  # the FLOP count, compile.check and the parity copy are not training
        device_sync(self.device)
        self._step_start = self._interval_start = now = time.perf_counter()
        self.single.mark()
        self._begin_if_due(0, now)

    def end_step(self, state: EndedStep, samples: int, tokens: int) -> None:
        """After each optimizer step: an excluded step's synced wall time goes into `state.step_time_s`; a steady
        one is counted (`tokens`: of every rank) and its own times go into `single`, without a sync."""
        self._steps += 1
        self._samples += samples
        self._tokens += tokens
        self._data_wait_s += state.data_wait_s
        paused, self._paused = self._paused, False
        if state.steps_this_run > self.excluded_steps:
            state.step_time_s = None
            self._step_start = self.single.step_ended(self._step_start, paused)
            return
        device_sync(self.device)
        now = time.perf_counter()
        state.step_time_s = now - self._step_start
        self._step_start = now
        self.single.mark()
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
        self._paused = self._paused or seconds > 0

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
        wall, device = self.single.all()
        return {
            "steps": steady.steps,
            "excluded_steps": self.excluded_steps,
            "step_time_s": elapsed / steady.steps,
            "step_time_device_s": sum(device) / len(device) if device else None,
            "step_time_device_of": self.single.device_of,
            "step_time_p10_s": percentile(list(wall), LOW_PERCENTILE) if wall else None,
            "samples_per_sec": steady.samples / elapsed,
            "tokens_per_sec": steady.tokens / elapsed,
            "data_wait_fraction": steady.data_wait_s / elapsed,
        }


class SingleSteps:
    """Each steady step's times: its wall time and its device time. CPU: the host's clock between the ends of two
    steps (a CPU step is done when its call returns; the stages' pauses left out), and the process's CPU seconds
    between them (all its threads; a step a stage paused in is left out: they hold the stage's work). CUDA: both
    are the device's time between two events recorded on its stream at the ends of two steps, read when the meter
    syncs anyway (a log boundary, the end), so that no step waits for the device; a step after a pause is left out.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device_of = "CUDA events" if self.cuda else "process CPU time"
        self._wall = array("d")  # every steady step's wall seconds, in order
        self._device = array("d")  # every steady step's device seconds (less those a stage paused in)
        self._taken = 0  # how many device times the log intervals have taken
        self._cpu_at = 0.0  # CPU: the process's CPU seconds at the end of the previous step
        self._last_event: Any = None  # CUDA: the event at the end of the previous step
        self._pending: list[tuple[Any, Any]] = []  # CUDA: (start, end) events not yet read

    def mark(self) -> None:
        """A step ended that is not timed (an excluded one), or the loop begins: the next timed step starts here."""
        if self.cuda:
            self._last_event = self._event()
        else:
            self._cpu_at = time.process_time()

    def step_ended(self, step_start: float, paused: bool) -> float:
        """A steady step ended; `step_start`: the host clock at its start (pauses left out); `paused`: a stage
        paused the clocks during it. Returns the host clock now."""
        now = time.perf_counter()
        if self.cuda:
            end = self._event()
            if not paused and self._last_event is not None:
                self._pending.append((self._last_event, end))
            self._last_event = end
            return now
        cpu = time.process_time()
        self._wall.append(now - step_start)
        if not paused:
            self._device.append(cpu - self._cpu_at)
        self._cpu_at = cpu
        return now

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read(self) -> None:
        """CUDA: the pending steps' device times (the meter synced the device before asking)."""
        for start, end in self._pending:
            seconds = start.elapsed_time(end) / 1e3
            self._wall.append(seconds)
            self._device.append(seconds)
        self._pending.clear()

    def take(self) -> list[float]:
        """The device times of the steady steps since the previous take (a log interval's), after a device sync."""
        self._read()
        taken, self._taken = self._device[self._taken:], len(self._device)
        return list(taken)

    def all(self) -> tuple[array, array]:
        """Every steady step's wall and device seconds (after the meter's final device sync)."""
        self._read()
        return self._wall, self._device


def host_load() -> dict[str, Any]:
    """The machine's load at the end of a run (os.getloadavg: 1, 5 and 15 minutes) and its CPU cores: a load
    above the cores means the run's processes waited for a core, and its timings say so much about the machine."""
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"load_average": load, "cpu_cores": os.cpu_count()}
