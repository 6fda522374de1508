"""What bounds the step: a recorded profiler window split into shares of step time, and the verdict.

How time is attributed, per recorded step (`ProfilerStep#N`), by precedence:
- CPU runs: the training thread's timeline. Data wait is `trainflow/data`;
  compilation is dynamo's `(dynamo_timed)` spans; compute is the self time of
  operators that run at least `SMALL_OP_US` (below that an operator's cost is
  its dispatch, not its arithmetic); the pipeline bubble is a pipeline stage's
  send or receive (activations, gradients) in flight while it computes nothing:
  it waits for the next or the previous stage; communication is any other
  gloo/NCCL collective in
  flight while the training thread computes nothing (exposed, not overlapped),
  the checkpoint stage's own collectives (its stop-flag poll, an async save's
  upload on its own gloo group) left out;
  the rest of `trainflow/forward_backward` and `trainflow/optimizer` is
  overhead (dispatch, Python, autograd bookkeeping); anything else is other.
- CUDA runs: the GPU's timeline. Compute is a kernel or copy running; the
  pipeline bubble is an NCCL send/receive kernel running alone; communication
  is any other NCCL kernel running alone; data wait is the GPU idle
  during `trainflow/data`; overhead is the GPU idle during forward/backward and
  the optimizer (launch gaps, syncs).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from torch.autograd import DeviceType

from trainflow.metrics.regions import CHECKPOINT, DATA, FWD_BWD, OPTIMIZER

SMALL_OP_US = 20.0  # on CPU, an operator whose self time is shorter than this is dispatch overhead
# A call this many times slower than the same call in the other recorded steps was descheduled (a busy
# machine), not computing: its time counts as "other", so contention does not pass for compute.
STALL_FACTOR = 20.0

# The partition of step time, in the order it is printed.
SHARES = ("data_wait", "forward_backward_compute", "optimizer_compute", "communication", "pipeline_bubble",
          "overhead", "compile", "other")

ACTIONS = {
    "data-bound": "the step waits for its batch: raise data.num_workers (with data.persistent_workers=true and "
                  "data.prefetch_factor to load ahead), set data.pin_memory=true on GPU, or make loading cheaper",
    "retracing": "compilation ran inside the profiled steps (recompiles on changing shapes): set "
                 "compile.dynamic=true or bucket input shapes to a few fixed sizes",
    "communication-bound": "collectives are exposed: give each all-reduce more compute to hide behind (a larger "
                           "per-rank trainer.batch_size or trainer.grad_accum), tune parallelism.ddp.bucket_cap_mb, "
                           "keep FSDP parameters gathered (parallelism.fsdp.reshard_after_forward=false), or use "
                           "fewer ranks",
    "pipeline-bound": "the pipeline's stages wait for each other (its bubble): more micro-batches "
                      "(parallelism.microbatches), an interleaved or zero-bubble schedule (parallelism.pp_schedule), "
                      "or a smaller parallelism.pp; summary.json['parallelism']['pipeline'] has the bubble measured "
                      "on every rank and the schedule's own",
}
# The remedies of the bounds whose cure depends on the run, each left out where the run already uses it (a
# requirement of None: always said). A bf16, compiled, compute-bound run is told about devices alone.
_REMEDIES = {
    "compute-bound": ("the step is arithmetic", (
        ("bf16", "use trainer.precision=bf16 on hardware with bf16 units"),
        ("compile", "compile to fuse kernels (compile.enabled=true)"),
        (None, "add devices (parallelism=ddp or fsdp); MFU shows the headroom left"))),
    "cpu-overhead-bound": ("the step is many small operations paying per-op dispatch cost", (
        ("compile", "compile the model (compile.enabled=true)"),
        (None, "raise trainer.batch_size so each operation does more work"),
        (None, "on one GPU capture CUDA graphs (compile.mode=reduce-overhead)"))),
    # CUDA graphs under DDP/FSDP hit open upstream bugs (cudagraph trees with DDP's hooks and FSDP's all-gathers):
    # across ranks the verdict recommends only what works there.
    "cpu-overhead-bound, several ranks": ("the step is many small operations paying per-op dispatch cost", (
        ("compile", "compile the model (compile.enabled=true)"),
        (None, "on GPU compile with compile.mode=max-autotune-no-cudagraphs"),
        (None, "raise trainer.batch_size so each operation does more work (CUDA graphs are not used with "
               "ddp/fsdp)"))),
}
VERDICT_GROUPS = {
    "data-bound": ("data_wait",),
    "communication-bound": ("communication",),
    "pipeline-bound": ("pipeline_bubble",),
    "cpu-overhead-bound": ("overhead", "compile"),
    "compute-bound": ("forward_backward_compute", "optimizer_compute"),
}

Interval = tuple[float, float]


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping union of intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _contains(merged: list[Interval], starts: list[float], t: float) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and merged[i][0] <= t < merged[i][1]


def attribute(steps: list[Interval], sets: dict[str, list[Interval]],
              label: Callable[[frozenset[str]], str]) -> dict[str, float]:
    """Split the time of `steps` into labels: each instant goes to `label(names of the sets covering it)`."""
    merged = {name: _merge(ivs) for name, ivs in sets.items()}
    starts = {name: [s for s, _ in ivs] for name, ivs in merged.items()}
    totals: dict[str, float] = {}
    for step_start, step_end in steps:
        points = {step_start, step_end}
        for ivs in merged.values():
            for s, e in ivs:
                if step_start < s < step_end:
                    points.add(s)
                if step_start < e < step_end:
                    points.add(e)
        ordered = sorted(points)
        for a, b in zip(ordered, ordered[1:], strict=False):
            mid = (a + b) / 2
            inside = frozenset(n for n, ivs in merged.items() if _contains(ivs, starts[n], mid))
            key = label(inside)
            totals[key] = totals.get(key, 0.0) + (b - a)
    return totals


def _covered(steps: list[Interval], intervals: list[Interval]) -> float:
    """How much of the steps' time the intervals cover (overlaps counted once)."""
    return attribute(steps, {"x": intervals}, lambda inside: "in" if inside else "out").get("in", 0.0)


def _starts_in(spans: list[Interval], t: float) -> bool:
    return any(a <= t <= b for a, b in spans)


def _training_collectives(collectives: list[tuple[Any, Interval]], main_thread: Any, training: list[Interval],
                          saving: list[Interval]) -> list[Interval]:
    """The collectives that are the training's communication, not the checkpoint stage's.

    The checkpoint stage has gloo groups of its own (the stop-flag poll, the async upload): their ops run on
    those groups' worker threads, during the stage's turn (its `trainflow/checkpoint` annotation) or later, in the
    background. A thread whose collectives started in that turn and never in forward/backward or the optimizer is
    such a group's; its ops are left out, and so are the collectives started in the turn itself.
    """
    def started_in(spans: list[Interval]) -> set[Any]:
        return {thread for thread, (start, _) in collectives if _starts_in(spans, start)}

    checkpoint_threads = started_in(saving) - started_in(training) - {main_thread}
    return [span for thread, span in collectives
            if thread not in checkpoint_threads and not _starts_in(saving, span[0])]


def _is_collective(name: str) -> bool:
    low = name.lower()
    return low.startswith(("gloo:", "nccl:", "c10d::")) or "nccl" in low or "record_param_comms" in low


def _is_p2p(name: str) -> bool:
    """A point-to-point send or receive (a pipeline stage's activations or gradients), not a collective."""
    low = name.lower()
    return _is_collective(name) and ("send" in low or "recv" in low)


TRAINING = frozenset({"fwd_bwd", "optimizer"})


def _cpu_label(inside: frozenset[str]) -> str:
    if "data" in inside:
        return "data_wait"
    if "compile" in inside and inside & TRAINING:  # not evaluation's one-off compile under no_grad
        return "compile"
    if "stall" in inside:
        return "stalled"
    if "compute" in inside:
        return ("forward_backward_compute" if "fwd_bwd" in inside
                else "optimizer_compute" if "optimizer" in inside else "other")
    if "p2p" in inside:
        return "pipeline_bubble"
    if "comm" in inside:
        return "communication"
    return "overhead" if inside & TRAINING else "other"


def _gpu_label(inside: frozenset[str]) -> str:
    if "compute" in inside:
        return "compute"
    if "p2p" in inside:
        return "pipeline_bubble"
    if "comm" in inside:
        return "communication"
    if "data" in inside:
        return "data_wait"
    if "compile" in inside and inside & TRAINING:
        return "compile"
    return "overhead" if inside & TRAINING else "other"


def _self_intervals(event: Any) -> list[Interval]:
    """The parts of an event's span not covered by its children: where its own code ran."""
    start, end = event.time_range.start, event.time_range.end
    pieces, cursor = [], start
    for child in sorted(event.cpu_children, key=lambda c: c.time_range.start):
        if child.time_range.start > cursor:
            pieces.append((cursor, child.time_range.start))
        cursor = max(cursor, child.time_range.end)
    if end > cursor:
        pieces.append((cursor, end))
    return pieces


def _typical_self_times(ops: list[Any], step_spans: list[Interval]) -> dict[int, float]:
    """Each operator call's median self time over the recorded steps, matching the k-th call of an operator in
    one step with the k-th call of it in the others (steps repeat the same sequence); needs 3 steps or more."""
    if len(step_spans) < 3:
        return {}
    starts = [a for a, _ in sorted(step_spans)]
    calls: dict[tuple[int, str], int] = {}
    position: dict[int, tuple[str, int]] = {}
    times: dict[tuple[str, int], list[float]] = {}
    for e in sorted(ops, key=lambda e: e.time_range.start):
        step = bisect.bisect_right(starts, e.time_range.start) - 1
        k = calls[(step, e.name)] = calls.get((step, e.name), 0) + 1
        position[id(e)] = (e.name, k)
        times.setdefault((e.name, k), []).append(e.self_cpu_time_total)
    return {op: statistics.median(times[key]) for op, key in position.items() if len(times[key]) >= 3}


def analyze_window(events: list[Any], on_gpu: bool, last_step: int) -> dict[str, Any]:
    """Seconds per share of step time in one recorded window (see the module docstring).

    Steps after `last_step` are left out: when a run ends inside a window, the step marker opened by the last
    `step()` is closed empty.
    """
    numbered = [(int(e.trace_name.rpartition("#")[2]), e) for e in events if e.name.startswith("ProfilerStep")]
    numbers = [n for n, _ in numbered if n <= last_step]
    steps = [e for n, e in numbered if n <= last_step]
    if not steps:
        return {"steps": 0, "first": None, "last": None, "step_s": 0.0, "step_ms": [], "seconds": {}, "covered": {}}
    main_thread = steps[0].thread
    sets: dict[str, list[Interval]] = {"data": [], "fwd_bwd": [], "optimizer": [], "comm": [], "p2p": [],
                                       "compute": [], "compile": [], "stall": []}
    annotations = {"data": DATA, "fwd_bwd": FWD_BWD, "optimizer": OPTIMIZER}  # the loop's, by set
    optimizer_device_us = 0.0
    ops: list[Any] = []  # the training thread's operators (CPU runs)
    collectives: list[tuple[Any, Interval]] = []  # (thread, span): sorted into the training's and the saves'
    saving: list[Interval] = []
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.device_type != DeviceType.CPU:
            if e.is_user_annotation or e.name.startswith("ProfilerStep") or e.name in annotations.values():
                continue  # an annotation mirrored on the GPU timeline spans idle gaps too
            if "nccl" in e.name.lower():
                sets["p2p" if "sendrecv" in e.name.lower() or _is_p2p(e.name) else "comm"].append(span)
            elif e.name.startswith("Memcpy HtoD"):
                sets["data"].append(span)
            else:
                sets["compute"].append(span)
            continue
        for key, name in annotations.items():
            if e.name == name and e.thread == main_thread:
                sets[key].append(span)
                if key == "optimizer" and on_gpu:
                    optimizer_device_us += e.device_time_total
        if e.name == CHECKPOINT and e.thread == main_thread:
            saving.append(span)
        if _is_p2p(e.name) and e.thread == main_thread and not on_gpu:
            sets["p2p"].append(span)
        elif _is_collective(e.name):
            if not on_gpu or e.name.lower().startswith("gloo:"):
                collectives.append((e.thread, span))
        elif e.name.endswith("(dynamo_timed)"):
            sets["compile"].append(span)
        elif (not on_gpu and e.thread == main_thread and not e.is_user_annotation and not e.is_async
              and not e.name.startswith("ProfilerStep")):
            ops.append(e)
    sets["comm"] += _training_collectives(collectives, main_thread, sets["fwd_bwd"] + sets["optimizer"], saving)
    step_spans = [(e.time_range.start, e.time_range.end) for e in steps]
    typical = _typical_self_times(ops, step_spans)
    for e in ops:
        if e.self_cpu_time_total >= SMALL_OP_US:
            stalled = e.self_cpu_time_total > STALL_FACTOR * max(typical.get(id(e), math.inf), 1.0)
            sets["stall" if stalled else "compute"].extend(_self_intervals(e))
    seconds = {k: v / 1e6 for k, v in attribute(step_spans, sets, _gpu_label if on_gpu else _cpu_label).items()}
    if on_gpu:  # the GPU timeline cannot tell which kernels the optimizer launched: its own events can
        compute = seconds.pop("compute", 0.0)
        seconds["optimizer_compute"] = min(compute, optimizer_device_us / 1e6)
        seconds["forward_backward_compute"] = compute - seconds["optimizer_compute"]
    step_ms = [(b - a) / 1e3 for a, b in step_spans]
    covered_sets = {"data": "data", "forward_backward": "fwd_bwd", "optimizer": "optimizer",
                    "communication_in_flight": "comm"}
    covered_s = {name: _covered(step_spans, sets[key]) / 1e6 for name, key in covered_sets.items()}
    return {"steps": len(steps), "first": min(numbers), "last": max(numbers), "step_s": sum(step_ms) / 1e3,
            "step_ms": step_ms, "seconds": seconds, "covered": covered_s}


def _remedy_action(bound: str, applied: frozenset[str]) -> str:
    intro, remedies = _REMEDIES[bound]
    return f"{intro}: " + "; ".join(text for needs, text in remedies if needs not in applied)


def verdict(totals: dict[str, Any], device: str, distributed: bool = False,
            straggler: dict[str, Any] | None = None, rank: int = 0,
            applied: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """Name the bottleneck from accumulated window seconds; None when nothing was recorded.

    `distributed`: the run has several ranks, so the action never recommends CUDA graphs (see above).
    `applied`: what the run already does ("bf16", "compile"), left out of the action.
    `straggler`: the rank the stragglers stage named in this run: when this rank (another one) is
    communication-bound, its collectives wait for that rank, and the cause is the straggler, not the collectives.
    """
    step_s = totals["step_s"]
    if totals["steps"] == 0 or step_s <= 0:
        return None
    seconds = totals["seconds"]
    shares = {k: round((seconds.get(k, 0.0) + (seconds.get("stalled", 0.0) if k == "other" else 0.0)) / step_s, 4)
              for k in SHARES}
    groups = {bound: sum(shares[k] for k in keys) for bound, keys in VERDICT_GROUPS.items()}
    bound = max(groups, key=groups.__getitem__)
    retracing = shares["compile"] > 0
    cause = "retracing" if bound == "cpu-overhead-bound" and shares["compile"] > shares["overhead"] else None
    key = cause or bound
    if key in _REMEDIES:
        several = distributed and key == "cpu-overhead-bound"
        action = _remedy_action(key + (", several ranks" if several else ""), applied)
    else:
        action = ACTIONS[key]
    if straggler and bound == "communication-bound" and straggler["rank"] != rank:
        cause = "a straggler rank"
        action = (f"the collectives wait for rank {straggler['rank']} on {straggler['host']}, a straggler "
                  f"({straggler['ratio']:g}x the other ranks' own time per step, summary.json['stragglers']): "
                  "look at that host's load, its data path and its device before tuning the collectives")
    if retracing and cause is None:
        action += f"; also: {ACTIONS['retracing']}"
    result: dict[str, Any] = {
        "bound": bound,
        "action": action,
        "step_time_ms": round(step_s / totals["steps"] * 1e3, 3),
        "median_step_ms": round(statistics.median(totals["step_ms"]), 3),
        "slowest_step_ms": round(max(totals["step_ms"]), 3),
        "profiled_steps": totals["steps"],
        "shares": shares,
        "stalled": round(seconds.get("stalled", 0.0) / step_s, 4),  # part of "other": descheduled operators
        "groups": {k: round(v, 4) for k, v in groups.items()},
        "covered": {k: round(v / step_s, 4) for k, v in totals["covered"].items()},  # overlaps included
        "timeline": "gpu" if device == "cuda" else "cpu",
    }
    if cause:
        result["cause"] = cause
    return result


def format_verdict(v: dict[str, Any], rank: int, windows: list[list[int]]) -> str:
    """The lines printed once at the end of a run."""
    steps = ", ".join(f"{a}-{b}" for a, b in windows)
    shares = " | ".join(f"{k.replace('_', ' ')} {v['shares'][k] * 100:.0f}%" for k in SHARES)
    cause = f" ({v['cause']})" if "cause" in v else ""
    note = f"\n  note: {v['note']}" if "note" in v else ""
    return (f"profiler verdict (rank {rank}, steps {steps}, {v['step_time_ms']:.1f} ms/step): {v['bound']}{cause}\n"
            f"  shares of step time: {shares}\n  action: {v['action']}{note}")
