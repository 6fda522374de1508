"""What `compile.dynamic=true` cost a run whose input shape never changed: the same model compiled static at the end
of the run, timed on one batch against the dynamic graphs the run already has.

Dynamic graphs cost more to compile (symbolic shapes, guards on them) and may run slower; on shapes that never
change they buy nothing. The passes here change nothing of the training state: the random numbers are forked, the
gradients zeroed after each pass, the buffers (batch-norm statistics) restored, and the compiled modules get their
own calls back. Each pass takes a fresh copy of the batch: dynamo marks the dimensions it made dynamic on the
tensors it saw, and a static compile given those very tensors would compile them dynamic again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from trainflow.data.loaders import apply_to_tensors
from trainflow.distributed.parallelism import local_loss, loss_context
from trainflow.tasks import Task
from trainflow.util.device import autocast_for, device_sync

Calls = Sequence[Callable[..., Any]]  # one compiled call per compiled module, in the order of the modules


class Passes:
    """Forward and backward passes of `model` on `batch`, with given compiled calls put in its compiled modules."""

    def __init__(self, model: nn.Module, compiled: Sequence[nn.Module], task: Task, batch: Any,
                 device: torch.device, precision: str) -> None:
        self.model = model
        self.compiled = list(compiled)
        self.task = task
        self.batch = batch
        self.device = device
        self.autocast = autocast_for(device, precision)
        self.own_calls: Calls = [m._compiled_call_impl for m in self.compiled]
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rng: Any = None

    def __enter__(self) -> Passes:
        self._buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        self._rng = torch.random.fork_rng(devices=devices, device_type=self.device.type)
        self._rng.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for module, call in zip(self.compiled, self.own_calls, strict=True):
            module._compiled_call_impl = call
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
        self._rng.__exit__(kind, exc, tb)

    def run(self, calls: Calls) -> float:
        """Seconds of one forward and backward with `calls` in the compiled modules (a compile included, if any)."""
        for module, call in zip(self.compiled, calls, strict=True):
            module._compiled_call_impl = call
        batch = apply_to_tensors(self.batch, torch.clone)
        torch.manual_seed(0)  # the same dropout masks every pass
        device_sync(self.device)
        start = time.perf_counter()
        with loss_context(self.model):
            with self.autocast:
                loss, _ = self.task(self.model, batch)
            local_loss(loss).backward()
        device_sync(self.device)
        seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return seconds

    def steady_ms(self, first: Calls, second: Calls, passes: int) -> tuple[float, float]:
        """The median milliseconds of `passes` passes of each, alternating (a noisy machine slows both alike)."""
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(passes):
            times[0].append(self.run(first))
            times[1].append(self.run(second))
        return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3
