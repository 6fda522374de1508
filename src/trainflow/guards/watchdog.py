"""Hang reports: a thread on every rank notices when its rank stops making steps and says where it is stuck.

A hang at scale (a rank blocked in a collective, a user's dataset waiting on a dead mount, a stopped process)
shows nothing until the collective timeout ends the run, and then every rank only says that it waited. Here each
rank's thread beats a small file in `<run dir>/hang/` and, once the rank has made no step for
`watchdog.factor` times the median step time of the steady state (never sooner than `watchdog.min_s`, the bound
until there is a median), writes where its main thread is (the innermost
frame of the user's code, else trainflow's) and every thread's stack (`faulthandler`). Rank 0 then says in one
line which rank is stuck where, from those files: a rank whose beat went stale stopped answering (SIGSTOP, a
frozen node), a rank stuck in the user's code is named with its file and line. An evaluation or a recompile in
progress is not a hang: each declares itself (trainflow.util.activity), as a save does, and the watchdog reads
the declaration, never the file names on a stack. Each rank also dumps the last collectives it entered (torch's
flight recorder, on gloo and NCCL alike; the process group sizes it for the watchdog), and rank 0's line says which
ranks did not arrive at a collective the others entered. The report is also what the launcher adds to a collective
timeout's line.

A save is watched too, against a bound of its own: `watchdog.factor` times the longest step interval seen (the
intervals that held the previous saves), at least the step's bound, and early enough for rank 0 to speak before
the save's collectives time out. A rank in a save is named as stuck in it (its
disk, or the async upload's, stopped answering) or waiting in it (in a collective, for a rank that is stuck). A
save's collectives time out at `parallelism.timeout_s` (the checkpointer's groups have the run's timeout), which
ends a run whose save waits for a rank; a save on which no collective waits (every rank's disk stopped answering,
or one process) is ended by the watchdog itself once it has lasted twice `parallelism.timeout_s` without a step:
exit 124, as a collective timeout, with its one line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import sysconfig
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import trainflow
from trainflow.config.schema import WatchdogConfig
from trainflow.distributed import DistEnv
from trainflow.distributed.process_group import self_launched, watchdog_on
from trainflow.errors import print_error
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.util.activity import BUSY_ACTIVITIES, SAVE_ACTIVITIES, Activity, current, threads_doing
from trainflow.util.failures import SaveHung, hang_line, rank_list, record_failure
from trainflow.util.files import write_atomic

log = logging.getLogger("trainflow")

HANG_DIR = "hang"  # under the run directory
REPORT = "report.txt"  # rank 0's one line, which the launcher repeats when the run ends on a timeout
# torch's flight recorders: NCCL's own (in CUDA builds only) and the one gloo writes to (in CPU builds too)
_RECORDERS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
_MEDIAN_OF = 50  # recent step intervals the median is taken over
# A live rank beats every beat_s; a beat older than _STALE_BEATS of them (+1 s for a loaded machine) is a rank that
# stopped answering. Rank 0 speaks _SETTLE_BEATS after the bound (at least 4 beats: min_s / 4 each), when a rank
# stopped since the stall began has a beat at least 4 + _SETTLE_BEATS - 1 = 7 beats old.
_STALE_BEATS = 3
_SETTLE_BEATS = 4
_TRAINFLOW = os.path.dirname(trainflow.__file__)
_LIBRARIES = (os.path.dirname(torch.__file__), _TRAINFLOW, sysconfig.get_paths()["stdlib"])
_COLLECTIVES = "torch.distributed.distributed_c10d"  # the module whose frames wait in a collective (torch's own code)


class Watchdog(Stage):
    """A stage that only times steps (one clock read each); its thread does the rest."""

    phase = Phase.TIME

    def __init__(self, cfg: WatchdogConfig, env: DistEnv, run_dir: Path, timeout_s: float) -> None:
        self.cfg = cfg
        self.env = env
        self.enabled = watchdog_on(cfg, env.world_size)
        self.dir = run_dir / HANG_DIR
        self.beat_s = cfg.min_s / 4  # a stopped rank's beat is stale well before anyone calls it stuck
        self._settle_s = _SETTLE_BEATS * self.beat_s  # rank 0's wait for the other ranks' reports of a stall
        self.timeout_s = timeout_s  # parallelism.timeout_s: a collective, a save's too, waits no longer
        self.save_limit_s = 2 * timeout_s  # a save's collectives, which wait at most timeout_s, ended before
        self._intervals: deque[float] = deque(maxlen=_MEDIAN_OF)
        self._longest = 0.0  # the longest step interval of the steady state (it holds the saves)
        self._last = 0.0  # when the last step ended (monotonic)
        self._step = 0  # the last step that ended
        self._steps_seen = 0
        self._saving = False  # the main thread was in a save at the last beat
        self._since = 0.0  # when the watchdog started (wall clock): an older hang report is another run's
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports = 0

    @classmethod
    def build(cls, ctx: StageContext) -> Watchdog:
        return cls(ctx.cfg.parallelism.watchdog, ctx.env, ctx.run_dir, ctx.cfg.parallelism.timeout_s)

    def __enter__(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._last, self._since = time.monotonic(), time.time()
        self._beat()  # at once: a rank lost before the first interval still leaves its place
        self._thread = threading.Thread(target=self._watch, name="trainflow-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def after_step(self, state: LoopState) -> bool:
        now = time.monotonic()
        self._steps_seen += 1
        if self._steps_seen > state.meter.excluded_steps:  # warm-up and compile steps: not the steady state
            self._intervals.append(now - self._last)
            self._longest = max(self._longest, now - self._last)
        self._last, self._step = now, state.step
        return False

    def bound_s(self) -> float:
        """How long a step may take before the rank counts as stuck: min_s until the steady state gives a median
        (a first compile is told apart by its stack, not by time)."""
        return max(self.cfg.min_s, self.cfg.factor * self.median_s()) if self._intervals else self.cfg.min_s

    def median_s(self) -> float | None:
        return statistics.median(self._intervals) if self._intervals else None

    def save_bound_s(self) -> float:
        """How long a save may go without a step before the rank counts as stuck in it: the longest step interval
        seen (which held the previous saves) times watchdog.factor, at least a step's bound, at most what leaves
        rank 0 time to speak (the wait for the other ranks' reports) before the save's collectives time out."""
        return max(self.bound_s(), min(self.cfg.factor * self._longest, self.timeout_s - self._settle_s))

    # --- the thread -------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        reported_at = None  # the step a report was made in: one report per stall
        busy_seen = 0.0  # when the main thread was last seen evaluating or compiling: no stall before that
        while not self._done.wait(self.beat_s):
            main = threading.main_thread().ident
            frame = sys._current_frames().get(main)
            doing = current(main) if frame is not None else Activity.COMPILING  # no frame: between two bytecodes
            self._saving = doing in SAVE_ACTIVITIES
            self._beat()
            now = time.monotonic()
            if doing in BUSY_ACTIVITIES:
                busy_seen = now
                continue
            stalled = now - max(self._last, busy_seen)  # a long evaluation just over is not a stall of its length
            bound = self.save_bound_s() if self._saving else self.bound_s()
            if stalled >= bound and reported_at != self._step:
                reported_at = self._step
                self._report(frame, stalled, bound)
            if self._saving and stalled >= self.save_limit_s:
                self._end(frame, stalled)

    def _beat(self) -> None:
        _write(self.dir / f"rank_{self.env.rank}.beat", {"rank": self.env.rank, "pid": os.getpid(),
                                                          "host": socket.gethostname(), "step": self._step,
                                                          "saving": self._saving, "time": time.time()})

    def _report(self, frame: FrameType, stalled: float, bound: float) -> None:
        rank = self.env.rank
        with open(self.dir / f"rank_{rank}.stacks.txt", "w") as stacks:
            faulthandler.dump_traceback(stacks, all_threads=True)
        record = flight_record()
        _write(self.dir / f"rank_{rank}.collectives.json", record)
        place = save_place(frame) if self._saving else frame
        _write(self.dir / f"rank_{rank}.json", {"rank": rank, "step": self._step + 1, "where": where(place),
                                                "users": _users_frame(place) is not None, "save": self._saving,
                                                "waiting": place.f_globals.get("__name__") == _COLLECTIVES,
                                                "time": time.time(),
                                                "collectives": last_collectives(record["entries"])})
        self.reports += 1
        if rank != 0:
            return
        # the other ranks' reports of the same stall land meanwhile, and a stopped rank's beat grows older than any
        # live rank's can (_STALE_BEATS), however the stall and the beats fell
        self._done.wait(self._settle_s)
        self._beat()  # this rank's own beat, which the wait let age, is read as any other
        line = self._account(stalled, bound)
        (self.dir / REPORT).write_text(line + "\n")
        log.error("%s", line)

    def _basis(self) -> str:
        """What this rank's bound is made of, in words."""
        median = self.median_s()
        if self._saving and self.save_bound_s() > self.bound_s():
            if self.cfg.factor * self._longest > self.timeout_s - self._settle_s:
                return "a save's: parallelism.timeout_s less the wait for every rank's report"
            return f"a save's: {self.cfg.factor:g} x the longest step {self._longest:.3f} s, which held the saves"
        if median:
            return f"{self.cfg.factor:g} x the median step {median:.3f} s, at least parallelism.watchdog.min_s"
        return "parallelism.watchdog.min_s, until the steady state gives a median step"

    def _end(self, frame: FrameType, stalled: float) -> None:
        """End this rank, whose save has lasted save_limit_s without a step: no collective is left to end it (every
        rank's disk stopped answering, or one process). The launcher names it from its record; a rank that no
        trainflow launcher started says the one line itself. Exit 124, as a collective timeout."""
        error = SaveHung(f"rank {self.env.rank} was still in the save after step {self._step} {stalled:.0f} s "
                         f"later, past its limit of twice parallelism.timeout_s (2 x {self.timeout_s:g} s), at "
                         f"{where(save_place(frame))}: the watchdog ended it")
        record_failure(error)
        line = hang_line(str(error), hang_report(self.dir.parent, self._since), self.env.world_size)
        log.error("%s", line)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):  # a handler that cannot flush must not keep the rank alive
                handler.flush()
        if not self_launched():
            print_error(line)
        os._exit(SaveHung.exit_code)

    def _account(self, stalled: float, bound: float) -> str:
        """Rank 0's one line: who is stuck where, from every rank's beat and report."""
        now = time.time()
        stuck, waiting, entered = [], [], {}
        for rank in range(self.env.world_size):
            beat, report = _read(self.dir / f"rank_{rank}.beat"), _read(self.dir / f"rank_{rank}.json")
            fresh_report = report if report and now - report["time"] < 4 * self.beat_s + bound else None
            if fresh_report and fresh_report.get("collectives"):
                entered[rank] = fresh_report["collectives"]
            if beat is None or now - beat["time"] > _STALE_BEATS * self.beat_s + 1:
                doing = "in the save after" if beat and beat.get("saving") else "after"
                seen = f"last beat {now - beat['time']:.0f} s ago, {doing} step {beat['step']}, " \
                       f"{beat['host']} pid {beat['pid']}" if beat else "no beat at all"
                stuck.append(f"rank {rank} stopped answering ({seen})")
            elif fresh_report and fresh_report.get("save") and not fresh_report["waiting"]:
                stuck.append(f"rank {rank} is stuck in a save at {fresh_report['where']}")
            elif fresh_report and fresh_report.get("save"):
                waiting.append((rank, f"in a save at {fresh_report['where']}"))
            elif fresh_report and fresh_report["users"]:
                stuck.append(f"rank {rank} is stuck in step {fresh_report['step']} at {fresh_report['where']}")
            elif fresh_report:
                waiting.append((rank, f"at {fresh_report['where']}"))
            else:
                stuck.append(f"rank {rank} is busy (compiling, evaluating) or slow")
        waits = "; ".join(f"{rank_list(group)} waiting {at}" for at, group in _group(waiting).items())
        who = "; ".join(stuck) or "no rank is stuck in the user's code"
        last = arrivals(entered, self.env.world_size)
        return (f"hang: no step for {stalled:.0f} s after step {self._step} (the bound is {bound:.0f} s: "
                f"{self._basis()}): {who}"
                f"{'; ' + waits if waits else ''}{'; last collective: ' + last if last else ''}; "
                f"every rank's stacks: {self.dir}")


def flight_record() -> dict[str, Any]:
    """The collectives this process entered last, as torch's flight recorders keep them: one record in torch's
    format (the first recorder's), the entries of both (NCCL's, and gloo's of a side group) in the order entered."""
    dumps = []
    for name in _RECORDERS:
        if (dump := getattr(torch._C._distributed_c10d, name, None)) is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # a recorder that cannot say: the others still can
                dumps.append(json.loads(dump(True, False)))
    record = dumps[0] if dumps else {}
    record["entries"] = sorted((entry for dump in dumps for entry in dump.get("entries", [])),
                               key=lambda entry: entry["time_created_ns"])
    return record


def last_collectives(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest collective this rank entered in each process group, by the group's name (the same on every rank):
    its operation, its number in the group (collective_seq_id) and when it was entered."""
    last: dict[str, dict[str, Any]] = {}
    for entry in entries:
        name, description = entry["process_group"]
        seq = entry["collective_seq_id"]
        if not entry["is_p2p"] and seq > last.get(name, {}).get("seq", -1):
            last[name] = {"op": entry["profiling_name"].split(":")[-1], "seq": seq, "group": description,
                          "ns": entry["time_created_ns"]}
    return last


def arrivals(entered: dict[int, dict[str, dict[str, Any]]], world_size: int) -> str:
    """Which ranks did not arrive at a collective that others entered, from each rank's newest collective per group;
    when all arrived, the newest collective they share. A rank without a record (a stopped process) is said apart."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, last in entered.items():
        for name, collective in last.items():
            groups.setdefault(name, {})[rank] = collective
    said = []
    for name, at in groups.items():
        top = max(at.values(), key=lambda collective: collective["seq"])
        behind = sorted(rank for rank, collective in at.items() if collective["seq"] < top["seq"])
        if behind:
            ahead = sorted(rank for rank in at if rank not in behind)
            seqs = ", ".join(f"#{seq}" for seq in sorted({at[rank]["seq"] for rank in behind}))
            said.append(f"{rank_list(ahead)} entered {top['op']} #{top['seq']} of {_group_name(name, top)}, "
                        f"{rank_list(behind)} did not ({'its' if len(behind) == 1 else 'their'} last: {seqs})")
    if not said and groups:
        name, at = max(groups.items(), key=lambda group: max(c["ns"] for c in group[1].values()))
        top = next(iter(at.values()))
        said.append(f"{rank_list(sorted(at))} entered {top['op']} #{top['seq']} of {_group_name(name, top)}")
    silent = [rank for rank in range(world_size) if rank not in entered]
    return "; ".join(said) + (f" ({rank_list(silent)} left no record)" if said and silent else "")


def _group_name(name: str, collective: dict[str, Any]) -> str:
    if collective["group"] == "default_pg":
        return "the default group"
    return f"group {name}" + (f" ({collective['group']})" if collective["group"] != "undefined" else "")


def where(frame: FrameType) -> str:
    """The place a stuck main thread is at: the user's innermost frame, else trainflow's, else the innermost."""
    chosen = _users_frame(frame) or _frame_in(frame, _TRAINFLOW) or frame
    return f"{chosen.f_code.co_filename}:{chosen.f_lineno} in {chosen.f_code.co_name}"


def _users_frame(frame: FrameType) -> FrameType | None:
    """The innermost frame of the user's code that trainflow called (a dataset, a model, a task): the frames
    outside trainflow's call (the entry point, Hydra) do not count."""
    current: FrameType | None = frame
    while current is not None and not current.f_code.co_filename.startswith(_TRAINFLOW):
        name = current.f_code.co_filename
        if not name.startswith("<") and not name.startswith(_LIBRARIES) and "site-packages" not in name:
            return current
        current = current.f_back
    return None


def _frame_in(frame: FrameType, folder: str) -> FrameType | None:
    current: FrameType | None = frame
    while current is not None and not current.f_code.co_filename.startswith(folder):
        current = current.f_back
    return current


def save_place(frame: FrameType) -> FrameType:
    """Where a save stands: the main thread's frame, or, while it waits for an async upload, the upload's own (the
    thread that declared it uploads), which is where a disk or a collective holds it."""
    if current(threading.main_thread().ident) is not Activity.WAITING_FOR_UPLOAD:
        return frame
    frames = sys._current_frames()
    uploads = [frames[ident] for ident in threads_doing(Activity.UPLOADING) if ident in frames]
    return uploads[0] if uploads else frame


def _group(waiting: list[tuple[int, str]]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, at in waiting:
        groups.setdefault(at, []).append(rank)
    return groups


def _write(path: Path, value: dict[str, Any]) -> None:
    """Replace `path` whole: a reader never sees half a beat."""
    write_atomic(path, json.dumps(value))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def hang_report(run_dir: Path, since: float) -> str | None:
    """Rank 0's hang line of this run, if it wrote one after `since` (for the launcher's final line)."""
    path = run_dir / HANG_DIR / REPORT
    try:
        if path.stat().st_mtime >= since:
            return path.read_text().strip()
    except OSError:
        pass
    return None
