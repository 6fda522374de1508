"""Stragglers: every rank's own time per step, gathered at log steps, and a rank that keeps the others waiting named.

In synchronous training every rank's step takes as long as the slowest rank's: the others wait for it in the
gradient sync. So the wall time of a step says nothing about who is slow; what differs is how long each rank
waited. Each rank measures, with clock marks only (no sync, no device read between log steps):
- its step time (from one step's end to the next, on this rank's clock);
- its wait in the gradient sync: from the moment its backward computed its last gradient (a hook on the parameter
  whose gradient comes last, found in the first step) to the end of backward, after DDP's wait for its
  all-reduces (FSDP's for its reduce-scatters) — CUDA events on GPUs, as the host does not wait for NCCL there;
- its data wait (the step's own clock around the batch).
Its *own time* is the step time less the wait: what the rank itself computed and loaded. At each log step one
all-gather of those three means (24 bytes a rank) gives every rank the same table; the log line and
summary.json show the median and the max of the own times and the slowest rank. A rank whose own time is
`parallelism.straggler.factor` times the median of the other ranks' in `straggler.intervals` log intervals in a
row (in the steady state) is named once, with its host (one more gather, on that path only).
Under FSDP the forward's and backward's all-gathers wait for peers too, and that wait counts as own time: a slow
rank's lead shows there only through its data wait and the last reduce-scatter. Only runs of 2 or more ranks
measure; one process is never called.
"""

from __future__ import annotations

import functools
import logging
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.config.schema import StragglerConfig
from trainflow.distributed import DistEnv
from trainflow.distributed.pipeline import StageParts
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.util.failures import rank_list

log = logging.getLogger("trainflow")

MEASURE = ("own time = step time less the wait in the gradient sync (from the last gradient of backward to the "
           "end of its all-reduce), mean per step over each log interval, per rank")


class Stragglers(Stage):
    """Marks the clocks each step (a hook and two callbacks at the end of backward); gathers at log steps."""

    phase = Phase.GATHER
    summary_key = "stragglers"

    def __init__(self, cfg: StragglerConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.enabled = env.world_size > 1
        self._params: list[nn.Parameter] = []
        self._hooks: list[Any] = []
        self._order: list[int] = []  # the first step: the order in which the parameters got their gradients
        self._last_gradient: Any = None  # the clock mark of this backward's last gradient
        self._waits: list[tuple[Any, Any]] = []  # (last gradient, end of the sync) of each backward this interval
        self._steps, self._step_s, self._data_s = 0, 0.0, 0.0  # this log interval's, on this rank
        self._previous = 0.0  # when the last step ended
        self._streak = (-1, 0)  # (rank, log intervals in a row it was a factor slower than the others)
        self._gather_s: list[float] = []
        self.last: dict[str, Any] | None = None  # the latest log interval's table
        self.named: list[dict[str, Any]] = []

    @classmethod
    def build(cls, ctx: StageContext) -> Stragglers:
        return cls(ctx.cfg.parallelism.straggler, ctx.env)

    # --- the marks, every step -------------------------------------------------------------------------------

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # a pipeline's stages reduce their gradients after the schedule's last backward, outside autograd: no wait
        # to mark there (its waits are the pipeline's bubble, summary.json["parallelism"]["pipeline"])
        if self.enabled and not isinstance(model, StageParts):
            self._params = [p for p in model.parameters() if p.requires_grad]
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._first_gradients, i))
                           for i, p in enumerate(self._params)]
        return model

    def _first_gradients(self, index: int, _param: nn.Parameter) -> None:
        self._order.append(index)

    def _keep_the_last_gradients_hook(self) -> None:
        """After the first step: one hook, on the parameter whose gradient came last."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = [self._params[self._order[-1]].register_post_accumulate_grad_hook(self._on_last_gradient)] \
            if self._order else []
        self._params, self._order = [], []

    def _on_last_gradient(self, _param: nn.Parameter) -> None:
        self._last_gradient = self._mark()
        # DDP queues the wait for its all-reduces after this hook returns: a callback queued from inside the first
        # end-of-backward callback runs after it
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._on_sync_done))

    def _on_sync_done(self) -> None:
        self._waits.append((self._last_gradient, self._mark()))

    def _mark(self) -> Any:
        if self.env.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wait_s(self) -> float:
        if not self._waits:
            return 0.0
        if self.env.device.type == "cuda":
            self._waits[-1][1].synchronize()  # the log step reads the device anyway
            return sum(start.elapsed_time(end) for start, end in self._waits) / 1e3
        return sum(end - start for start, end in self._waits)

    def __enter__(self) -> Stragglers:
        self._previous = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def after_step(self, state: LoopState) -> bool:
        now = time.perf_counter()
        if state.steps_this_run == 1:
            self._keep_the_last_gradients_hook()
        self._steps += 1
        self._step_s += now - self._previous
        self._data_s += state.data_wait_s
        if state.log_due:
            state.figures.update(self._gather(state))
            if self.named:
                state.straggler = self.named[0]
            now = time.perf_counter()  # the gather is not the next step's time
        self._previous = now
        return False

    # --- the log step ----------------------------------------------------------------------------------------

    def _gather(self, state: LoopState) -> dict[str, float]:
        """The one collective: every rank's (step, wait, data wait) means of the interval, to every rank."""
        n = self._steps
        mine = torch.tensor([self._step_s / n, self._wait_s() / n, self._data_s / n], dtype=torch.float64,
                            device=self.env.device)
        table = torch.empty(self.env.world_size * 3, dtype=torch.float64, device=self.env.device)
        start = time.perf_counter()
        dist.all_gather_single(table, mine)
        rows = table.view(-1, 3).tolist()
        self._gather_s.append(time.perf_counter() - start)
        self._steps, self._step_s, self._data_s, self._waits = 0, 0.0, 0.0, []
        own = [max(step - wait, 0.0) for step, wait, _ in rows]
        slowest = max(range(len(own)), key=own.__getitem__)
        others = statistics.median(own[:slowest] + own[slowest + 1:])
        ratio = own[slowest] / others if others > 0 else 1.0
        self.last = {"step": state.step, "slowest_rank": slowest, "own_s_median": statistics.median(own),
                     "own_s_max": own[slowest], "others_own_s_median": others, "ratio_to_the_others": ratio,
                     "own_s": own, "wait_s": [wait for _, wait, _ in rows], "data_wait_s": [d for _, _, d in rows]}
        if state.steps_this_run - n >= state.meter.excluded_steps:  # intervals of compile or warm-up steps: not judged
            self._judge(slowest, ratio, state.step)
        return {"perf/slowest_rank": slowest, "perf/own_time_median_s": self.last["own_s_median"],
                "perf/own_time_max_s": own[slowest]}

    def _judge(self, slowest: int, ratio: float, step: int) -> None:
        """Every rank decides alike (they hold the same table), so all of them enter the host gather below."""
        rank, streak = self._streak
        streak = (streak + 1 if rank == slowest else 1) if ratio >= self.cfg.factor else 0
        self._streak = (slowest, streak)
        if streak < self.cfg.intervals or any(named["rank"] == slowest for named in self.named):
            return
        hosts: list[str] = [""] * self.env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        last = self.last
        named = {"rank": slowest, "host": hosts[slowest], "step": step, "ratio": round(ratio, 2),
                 "own_s": last["own_s"][slowest], "others_own_s": last["others_own_s_median"],
                 "data_wait_s": last["data_wait_s"][slowest]}
        self.named.append(named)
        if self.env.is_main:
            log.warning("straggler: %s on %s took %.1fx the other ranks' median own time per step (%.0f ms against "
                        "%.0f ms; %.0f ms of it waiting for its data) in %d log intervals in a row, up to step %d; "
                        "every other rank waits for it at each gradient sync: look at that host's load, its data "
                        "path and its device (parallelism.straggler.factor sets when a rank is named)",
                        rank_list([slowest]), named["host"], ratio, named["own_s"] * 1e3, named["others_own_s"] * 1e3,
                        named["data_wait_s"] * 1e3, streak, step)

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"measure": MEASURE, "factor": self.cfg.factor, "intervals": self.cfg.intervals,
                "last_interval": self.last, "named": self.named,
                "gather_ms": statistics.median(self._gather_s) * 1e3 if self._gather_s else None}
