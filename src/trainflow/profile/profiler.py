"""torch.profiler on a schedule, traces per rank, and a verdict on what bounds the step.

The profiler records a few steps after the run's warm-up and compile steps
(`profiler.skip_first`, by default the steps the throughput figures exclude
too), writes each window as a Chrome/Perfetto trace and an operator table, and
splits the recorded step time into shares: waiting for data, forward/backward
compute, optimizer compute, exposed communication, per-op overhead and
compilation. The largest share names the bottleneck and the action to take.

The analysis of a recorded window (what bounds the step) is trainflow.metrics.verdict.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from trainflow.config.schema import ProfilerConfig
from trainflow.distributed import DistEnv
from trainflow.errors import ConfigError
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.metrics.verdict import analyze_window, format_verdict, verdict

# torch's profiler (kineto) prints `USDT: ... profiler_start` and `profiler_stop` on stderr around each recording,
# at a level above its errors: its log level 6 keeps them (and its own messages) off the console, unless the user
# set one (KINETO_LOG_LEVEL=0 shows all of kineto's messages).
KINETO_LOG_LEVEL, QUIET = "KINETO_LOG_LEVEL", "6"

log = logging.getLogger("trainflow")

TOP_OPS_IN_SUMMARY = 5

@dataclass
class _RankResult:
    """What one rank's profiler found; gathered to rank 0 for summary.json."""

    rank: int
    windows: list[list[int]] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    ops_table: str | None = None
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    verdict: dict[str, Any] | None = None
    memory_snapshot: str | None = None
    memory_snapshot_write_s: float | None = None  # pickling it after the loop (C++ stacks made this minutes)


class Profiler(Stage):
    """Steps torch.profiler on its schedule when `profiler.enabled` (and this rank is one of `profiler.ranks`).

    `skip_first` is the number of steps this run excludes from its figures (warm-up + compile), used when
    `profiler.skip_first` is null; `start_step` is the step the run resumed at (file names use global steps).
    Built from a run's context, it reads both when the run starts: the meter's excluded steps, the state's step.
    """

    phase = Phase.OBSERVE
    summary_key = "profiler"

    def __init__(self, cfg: ProfilerConfig, env: DistEnv, run_dir: Path, max_steps: int, skip_first: int = 0,
                 start_step: int = 0, planned_at_start: bool = False, applied: frozenset[str] = frozenset()) -> None:
        self.cfg = cfg
        self.applied = applied  # what the run already does ("bf16", "compile"): the verdict does not advise it
        self.env = env
        self.run_dir = run_dir
        self.max_steps = max_steps
        self._planned_at_start = planned_at_start  # a run's: the window is planned at start(), from its excluded steps
        self._prof: Any = None
        self._steps = 0  # steps of this run so far
        self._windows_done = 0
        self._totals: dict[str, Any] = {"steps": 0, "step_s": 0.0, "step_ms": [], "seconds": {}, "covered": {}}
        self._ops: dict[str, list[float]] = {}  # name -> [calls, self time us]
        self._memory_history = False
        self._snapshot: dict[str, Any] | None = None  # the CUDA allocator history, written after the loop
        self._load = 0.0  # the highest 1-minute load average seen at the end of a window
        self._straggler: dict[str, Any] | None = None  # the rank the stragglers stage named, if any
        self.result = _RankResult(env.rank)
        self.enabled = cfg.enabled and self._selected(cfg.ranks, env)  # this rank records
        self.names_step_parts = self.enabled  # the step names its parts for the recorded window
        self.device = env.device.type
        self.dir = run_dir / "profile"
        if cfg.enabled and not planned_at_start:
            self._plan(skip_first, start_step)

    @classmethod
    def build(cls, ctx: StageContext) -> Profiler:
        applied = frozenset(name for name, used in (("bf16", ctx.cfg.trainer.precision == "bf16"),
                                                    ("compile", ctx.cfg.compile.enabled)) if used)
        return cls(ctx.cfg.profiler, ctx.env, ctx.run_dir, ctx.cfg.trainer.max_steps,
                   planned_at_start=True, applied=applied)

    def start(self, state: LoopState) -> None:
        if self.cfg.enabled and self._planned_at_start:  # every rank checks the window, recording or not
            self._plan(state.meter.excluded_steps, state.step)

    def _plan(self, skip_first: int, start_step: int) -> None:
        """The schedule's first skipped steps and the last window's end; refuse a window past the end of the run."""
        cfg, max_steps = self.cfg, self.max_steps
        self.start_step = start_step
        self.skip, end = cfg.window(skip_first)
        self._last_window_end = end if cfg.repeat > 0 else math.inf  # no torch.profiler step() after it
        if end > max_steps - start_step:
            message = (f"trainer.max_steps: the profiler window ends at step {start_step + end} (skip_first "
                       f"{self.skip} + {max(cfg.repeat, 1)} x (wait {cfg.wait} + warmup {cfg.warmup} + active "
                       f"{cfg.active})) but the run stops at step {max_steps}")
            if start_step == 0:
                raise ConfigError(f"{message}; raise trainer.max_steps to >= {end} or shorten the window "
                                  "(profiler.skip_first, profiler.wait, profiler.warmup, profiler.active)")
            if self.env.is_main:
                log.warning("%s after resuming at step %d: the window may not complete", message, start_step)

    @staticmethod
    def _selected(ranks: Any, env: DistEnv) -> bool:
        if ranks == "all":
            return True
        missing = [r for r in ranks if r >= env.world_size]
        if missing:
            raise ConfigError(f"profiler.ranks: rank {missing[0]} does not exist in a world of {env.world_size} "
                              f"rank(s) (0..{env.world_size - 1}); use ranks within it or profiler.ranks=all")
        return env.rank in ranks

    def __enter__(self) -> Profiler:
        if not self.enabled:
            return self
        c = self.cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        if c.memory_snapshot:
            if self.device == "cuda":
                # Python stacks only: C++ stacks ("all") make the dump symbolize every frame, minutes on 8 GPUs.
                torch.cuda.memory._record_memory_history(max_entries=c.memory_history_entries, stacks="python")
                self._memory_history = True
            elif self.env.is_main:
                log.warning("profiler.memory_snapshot: the allocator history needs CUDA and this run is on %s; "
                            "continuing without a memory snapshot (traces, profile_memory and the verdict still "
                            "work)", self.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        os.environ.setdefault(KINETO_LOG_LEVEL, QUIET)  # read when the profiler first starts: before profile()
        by_run_step = schedule(skip_first=self.skip, wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat)
        first = self.start_step + 1  # torch numbers steps from its step_num: make ProfilerStep#N our step N
        self._prof = profile(
            activities=activities,
            schedule=lambda n: by_run_step(max(n - first, 0)),
            on_trace_ready=self._on_window,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
            with_flops=c.with_flops,
        )
        self._prof.step_num = first
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)  # a window cut short by the end of the run is saved here
        if self._memory_history:
            self._take_memory_snapshot()
        if self._snapshot is not None:
            self._write_memory_snapshot()
        if self._windows_done == 0 and self.env.is_main:
            log.warning("profiler: the run ended after %d steps, before the first profiling window closed; "
                        "no trace or verdict was recorded", self._steps)

    def step(self) -> None:
        """Called once at the end of every training step."""
        if self._prof is not None:
            self._steps += 1
            if self._steps <= self._last_window_end:
                self._prof.step()

    def after_step(self, state: LoopState) -> bool:
        self.step()
        return False

    def close(self, state: LoopState) -> None:
        self._straggler = state.straggler  # a rank the others waited for: the verdict's cause

    def _on_window(self, prof: Any) -> None:
        """After each window: the trace, the ops table, and this window's share of the verdict."""
        window = analyze_window(list(prof.events()), self.device == "cuda", self.start_step + self._steps)
        if window["steps"] == 0:
            return
        n, first, last = window["steps"], window["first"], window["last"]
        self._windows_done += 1
        self.result.windows.append([first, last])

        name = f"rank{self.env.rank}.{first}.pt.trace.json" + (".gz" if self.cfg.gzip else "")
        prof.export_chrome_trace(str(self.dir / name))
        self.result.traces.append(f"profile/{name}")

        sort_by = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=self.cfg.row_limit)
        ops_path = self.dir / f"ops_rank{self.env.rank}.txt"
        with ops_path.open("w" if self._windows_done == 1 else "a") as f:
            f.write(f"rank {self.env.rank}, steps {first}-{last}, sorted by {sort_by}\n{table}\n")
        self.result.ops_table = f"profile/ops_rank{self.env.rank}.txt"
        for avg in averages:
            if avg.is_user_annotation or avg.key.startswith("ProfilerStep"):
                continue
            calls_time = self._ops.setdefault(avg.key, [0, 0.0])
            calls_time[0] += avg.count
            calls_time[1] += getattr(avg, sort_by)

        totals = self._totals
        totals["steps"] += n
        totals["step_s"] += window["step_s"]
        totals["step_ms"] += window["step_ms"]
        for key, seconds in window["seconds"].items():
            totals["seconds"][key] = totals["seconds"].get(key, 0.0) + seconds
        for key, seconds in window["covered"].items():
            totals["covered"][key] = totals["covered"].get(key, 0.0) + seconds
        if hasattr(os, "getloadavg"):
            self._load = max(self._load, os.getloadavg()[0])
        if self._memory_history:
            self._take_memory_snapshot()

    def _take_memory_snapshot(self) -> None:
        """The allocator history from the first step to the end of the first window, kept in memory.

        Only taken here, inside the loop; pickling it to disk waits for the end of the run (`_write_memory_snapshot`),
        so the loop's timing does not include a dump of seconds.
        """
        self._snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self._memory_history = False
        entries = sum(len(trace) for trace in self._snapshot.get("device_traces", []))
        if entries >= self.cfg.memory_history_entries and self.env.is_main:
            log.warning("profiler.memory_snapshot: the allocator history holds only its last %d events, so the first "
                        "steps are missing from it; raise profiler.memory_history_entries", entries)

    def _write_memory_snapshot(self) -> None:
        """Pickle the snapshot for pytorch.org/memory_viz, after the loop."""
        path = self.dir / f"memory_rank{self.env.rank}.pickle"
        start = time.perf_counter()
        with path.open("wb") as f:
            pickle.dump(self._snapshot, f)
        self._snapshot = None
        self.result.memory_snapshot = f"profile/{path.name}"
        self.result.memory_snapshot_write_s = round(time.perf_counter() - start, 3)

    def _finish(self) -> _RankResult | None:
        if not self.enabled:
            return None
        r = self.result
        r.verdict = verdict(self._totals, self.device, self.env.distributed, self._straggler, self.env.rank,
                            self.applied)
        cores = os.cpu_count() or 1
        if r.verdict and self.device == "cpu" and self._load > cores:
            r.verdict["note"] = (f"the machine was oversubscribed (load average {self._load:.1f} on {cores} cores): "
                                 "operator times include waiting for a core, so compute and overhead are inflated; "
                                 "profile on a quieter machine or with fewer threads (OMP_NUM_THREADS)")
        total = sum(t for _, t in self._ops.values()) or 1.0
        top = sorted(self._ops.items(), key=lambda kv: kv[1][1], reverse=True)[:TOP_OPS_IN_SUMMARY]
        per_step = max(self._totals["steps"], 1)
        r.top_ops = [{"name": name, "calls_per_step": round(calls / per_step, 2),
                      "self_ms_per_step": round(us / per_step / 1e3, 3), "share_of_self_time": round(us / total, 4)}
                     for name, (calls, us) in top]
        return r

    def summary(self, steady: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Every rank's findings, gathered on rank 0 (a collective: all ranks call it); prints the verdict once."""
        if not self.cfg.enabled:
            return None
        mine = self._finish()
        results: list[_RankResult | None] = [mine]
        if self.env.distributed:
            results = [None] * self.env.world_size
            dist.all_gather_object(results, mine)
        profiled = [r for r in results if r is not None]
        if not self.env.is_main:
            return None
        c = self.cfg
        with_verdict = [r for r in profiled if r.verdict]
        head = with_verdict[0] if with_verdict else None
        out: dict[str, Any] = {
            "schedule": {"skip_first": self.skip, "wait": c.wait, "warmup": c.warmup, "active": c.active,
                         "repeat": c.repeat},
            "ranks": [r.rank for r in profiled],
            "windows": {str(r.rank): r.windows for r in profiled},
            "traces": [t for r in profiled for t in r.traces],
            "ops_tables": [r.ops_table for r in profiled if r.ops_table],
            "memory_snapshots": [r.memory_snapshot for r in profiled if r.memory_snapshot],
            "memory_snapshot_write_s": max((r.memory_snapshot_write_s or 0.0 for r in profiled), default=0.0),
            "top_ops": head.top_ops if head else [],
            "verdict": {"rank": head.rank, **head.verdict} if head else None,
        }
        if len(with_verdict) > 1:
            out["per_rank"] = {str(r.rank): {"bound": r.verdict["bound"], "shares": r.verdict["shares"]}
                               for r in with_verdict}
        if head:
            others = "".join(f"\n  rank {r.rank}: {r.verdict['bound']}" for r in with_verdict[1:])
            log.info("%s%s", format_verdict(head.verdict, head.rank, head.windows), others)
        return out
