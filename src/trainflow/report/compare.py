"""`trainflow compare A B`: two runs, two sweeps, two ledger selections or two checkpoints, every figure with its
noise, the reasons their fingerprints give, and gates that make a regression fail a CI job.

A side is a run folder (its summary.json, metrics.jsonl, profile), a sweep folder (its jobs, paired with the other
sweep's by their overrides), `ledger:<filters>` (runs of a ledger pooled as one side, e.g.
`ledger:config=3f2a9c01d4e5,last=5`), or a checkpoint (a step_N folder, or a checkpoint dir: its newest;
trainflow.report.checkpoints). Each figure of a pair of runs gets a verdict from trainflow.metrics.noise (faster,
slower or the same, with the confidence the intervals give), and a figure that changed gets its likely cause: the
first difference of the fingerprints that can explain it (the config, the code, the versions, the device, a busy
machine, the host). `--fail-on step_time=+5%` fails (exit 1) when B's step time is more than 5% above A's and beyond
the noise; a change that only a busy machine explains warns instead, and says to rerun on an idle one.

Honest on a busy machine: when either run was timed while other processes kept BUSY_SHARE of the cores busy, the
step time is judged on the steps' device time (the process's CPU time per step on CPU, the GPU's from CUDA events:
the figure the load moves least, docs/compare.md) and the row says so; the figures made of wall time
(samples/s, tokens/s, MFU, data wait) are then not judged. A change that only the machine's load explains is never
called slower or faster, and a run with fewer than MIN_SAMPLES steady log intervals gives "cannot tell" and the
steps it needs, not a verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainflow.config.schema import TrainerConfig
from trainflow.metrics.noise import MIN_SAMPLES, Band, judge
from trainflow.record import ledger
from trainflow.report import checkpoints, render_compare
from trainflow.report.bisect import bisect
from trainflow.report.causes import Note, likely_cause, notes
from trainflow.report.gates import FAIL, Gate, check_kind, check_validation, evaluate_gate, parse_gate
from trainflow.report.runs import EXIT_GATE_FAILED
from trainflow.report.sides import CompareError, RunView, Side, pairs, resolve_side
from trainflow.util.tolerance import TOLERANCE

# One run against one: how far the same command's step time swings from run to run, beyond its own intervals (8 runs
# of one command on a 2-core VM: medians 3.94-4.49 ms at a like load, docs/compare.md). The ledger's runs of a config
# measure it for that config (MIN_HISTORY of them), and --min-band sets it.
RUN_TO_RUN = 0.15
# On a busy machine the steps' device time swings further from run to run than on an idle one (the process loses its
# caches at each turn other processes take, and more often the more of them there are): the same command twice
# beside two spinning processes moved it by up to 23.9% in 11 pairs at steady load averages of 9-20, and by +67.4%
# and -38.5% where other jobs also started and stopped beside the two runs (load 4-7, docs/compare.md): its floor
# there is 100%. A model of 4x the FLOPs moved it by 190-447%; the tiny GPT twice as wide by 28%, which a busy
# machine cannot tell from its noise.
BUSY_RUN_TO_RUN = 1.00
MIN_HISTORY = 3
TOP_OPS = 8  # operators listed whose self time changed most


# --- figures -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A figure compare judges: its name (as --fail-on names it), where a run keeps it, which way is better, the words
    for larger and smaller, its band without samples enough for one (`tolerance`, relative), the absolute change
    below which it never counts (`min_abs`), and whether a machine's load or speed can explain it (`speed`)."""

    name: str
    label: str
    unit: str
    higher_is_better: bool
    words: tuple[str, str]  # (B larger, B smaller)
    tolerance: float
    min_abs: float = 0.0
    speed: bool = True
    interval: str | None = None  # the name of its log-interval samples (trainflow.metrics.noise.INTERVAL_KEYS)
    directed: bool = True  # False: neither way is better (a validation metric the task does not monitor)
    wall: bool = False  # made of wall time: a busy machine's load moves it (judged then on `robust`, or not at all)
    robust: str | None = None  # the figure judged in its place when a run was timed on a busy machine


DEVICE_STEP_TIME = "step_time_device"
NOT_JUDGED_BUSY = "not judged: a busy machine (its wall time carries the load; see step time)"
ONLY_LOAD = "cannot tell: only the machine's load explains the change"
OTHER_THREADS = "not judged: other OMP_NUM_THREADS (a process's CPU time counts every thread's)"
SPINNING = ("not judged: a busy machine, and torch's threads spin while they wait (a process's CPU time counts it): "
            "rerun with OMP_NUM_THREADS=1, or on an idle machine")


FIGURES = (
    Figure("step_time", "step time", "s", False, ("slower", "faster"), 0.05, interval="step_time_s", wall=True,
           robust=DEVICE_STEP_TIME),
    Figure(DEVICE_STEP_TIME, "step time on its device", "s", False, ("slower", "faster"), 0.05,
           interval="step_time_device_s"),
    Figure("samples_per_sec", "samples/s", "", True, ("faster", "slower"), 0.05, interval="samples_per_sec",
           wall=True),
    Figure("tokens_per_sec", "tokens/s", "", True, ("faster", "slower"), 0.05, interval="tokens_per_sec", wall=True),
    Figure("mfu", "MFU", "", True, ("higher", "lower"), 0.05, interval="mfu", wall=True),
    Figure("data_wait", "data wait", "of the step", False, ("waits more", "waits less"), 0.25, min_abs=0.01,
           interval="data_wait_fraction", wall=True),
    Figure("peak_memory", "peak memory", "B", False, ("more", "less"), 0.10, speed=False),  # CPU: the RSS wanders
    Figure("compile_time", "compile time", "s", False, ("slower", "faster"), 0.25, min_abs=0.5),
    Figure("energy_per_sample", "energy per sample", "J", False, ("more", "less"), 0.05),
    Figure("cost_per_mtok", "cost per million tokens", "", False, ("dearer", "cheaper"), 0.05),
)
LOSS = Figure("loss", "final train loss", "", False, ("higher", "lower"), 0.0, speed=False)  # band: the arithmetic's
FIGURE_NAMES = {f.name: f for f in (*FIGURES, LOSS)}


def headline(run: RunView, figure: Figure) -> float | None:
    """A run's whole-run value of `figure` (None where it has none)."""
    s = run.figures
    value = {"step_time": s.get("step_time_s"), DEVICE_STEP_TIME: s.get("step_time_device_s"),
             "samples_per_sec": s.get("samples_per_sec"),
             "tokens_per_sec": s.get("tokens_per_sec") or None, "mfu": s.get("mfu"),
             "data_wait": s.get("data_wait_fraction"), "peak_memory": s.get("peak_memory_bytes"),
             "compile_time": s.get("compile_time_s") or (0.0 if s.get("steps") else None),  # not compiled: none spent
             "energy_per_sample": ((s.get("cost") or {}).get("energy") or {}).get("joules_per_sample"),
             "cost_per_mtok": ((s.get("cost") or {}).get("money") or {}).get("per_million_tokens"),
             "loss": s.get("loss_last")}.get(figure.name)
    if figure.name.startswith("val_"):
        value = (s.get("validation") or {}).get(figure.name.removeprefix("val_"))
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def validation_figures(a: list[RunView], b: list[RunView], loss_rtol: float) -> list[Figure]:
    """A figure per validation metric both sides have: the monitored one better in the task's direction, the loss
    lower, others neither (their words say larger and smaller)."""
    common = set.intersection(*(set(r.figures.get("validation") or {}) for r in (*a, *b)))
    monitor, mode = a[0].figures.get("monitor"), a[0].figures.get("mode")
    out = []
    for name in sorted(common):
        directed = name in (monitor, "loss")
        higher = mode == "max" if name == monitor else False
        out.append(Figure(f"val_{name}", f"validation {name}", "", higher, ("higher", "lower"), loss_rtol, speed=False,
                          directed=directed))
    return out


# --- judging a pair ----------------------------------------------------------------------------------------------


def loss_tolerance(runs: list[RunView]) -> float:
    """The relative loss difference the arithmetic allows (tolerance.py's ladder table, by the runs' matmuls)."""
    precision = ((runs[0].config.get("trainer") or {}).get("precision")) or TrainerConfig.precision
    return TOLERANCE["ladder.loss_rtol"].get(precision, TOLERANCE["ladder.loss_rtol"]["fp32"])


def samples(runs: list[RunView], figure: Figure) -> tuple[list[float], float | None]:
    """A side's samples of `figure` and the band known beyond them: one run's log intervals, or each pooled run's
    value with the median of their recorded step-time bands."""
    if len(runs) == 1 and figure.interval and len(runs[0].intervals.get(figure.interval, [])) >= 1:
        return runs[0].intervals[figure.interval], None
    values = [v for r in runs if (v := headline(r, figure)) is not None]
    spreads = [s for r in runs if (s := (r.fingerprint.get("step_time") or {}).get("spread")) is not None]
    known = sorted(spreads)[len(spreads) // 2] if spreads and figure.interval else None
    return values, known


def own_value(runs: list[RunView], figure: Figure, values: list[float]) -> float | None:
    """A side's figure: one run's own (its summary's, as its `done:` line gives it), else the median of `values`
    (pooled runs, or a run whose summary lacks it)."""
    value = headline(runs[0], figure) if len(runs) == 1 else None
    return value if value is not None else Band.of(values).median if values else None


def was_busy(runs: list[RunView]) -> bool:
    """Whether a side's runs were timed on a busy machine (trainflow.record.fingerprint.machine_load)."""
    return any((r.fingerprint.get("load") or {}).get("busy") for r in runs)


def same_threads(a: list[RunView], b: list[RunView]) -> bool:
    """Whether the runs' device times compare: on a GPU (the device's time), or on CPU with the same OMP_NUM_THREADS
    (a process's CPU time per step counts each of its threads, and torch's spin while they wait)."""
    runs = (*a, *b)
    if all(_on_cuda(r) for r in runs):
        return True
    return len({_omp_threads(r) for r in runs}) == 1


def threads_spin(runs: list[RunView]) -> bool:
    """Whether a CPU run had more than one intra-op thread (OMP_NUM_THREADS other than 1, or unset: torch takes a
    thread per core): its threads spin at each operator's barrier while another process holds a core, and that is CPU
    time. The seed MLP beside one busy core of two, idle otherwise: its CPU time per step 2.1-12x the idle run's with
    torch's two threads, 0.96-1.08x with one (benchmarks/noise_figures.py, docs/compare.md)."""
    return any(not _on_cuda(r) and _omp_threads(r) != "1" for r in runs)


def _on_cuda(run: RunView) -> bool:
    return (run.fingerprint.get("device") or {}).get("type") == "cuda"


def _omp_threads(run: RunView) -> str | None:
    """The OMP_NUM_THREADS the run was started with (its fingerprint's replay); None: unset."""
    return ((run.fingerprint.get("replay") or {}).get("env") or {}).get("OMP_NUM_THREADS")


def too_few_intervals(runs: list[RunView], figure: Figure) -> str | None:
    """`cannot tell: N intervals; run at least M steps` for one run from its folder whose steady log intervals are
    fewer than MIN_SAMPLES: two intervals cannot tell a change from noise."""
    run = runs[0]
    if len(runs) != 1 or run.dir is None or not figure.interval:
        return None
    found = len(run.intervals.get(figure.interval, []))
    if found >= MIN_SAMPLES:
        return None
    every = max(int((run.config.get("trainer") or {}).get("log_every") or 1), 1)
    first = -(-run.steady_from // every) * every  # the first log step at or after the steady state's start
    return f"cannot tell: {found} intervals; run at least {first + MIN_SAMPLES * every} steps"


def judge_figure(figure: Figure, a: list[RunView], b: list[RunView], found: list[Note],
                 floor: tuple[float, str]) -> dict[str, Any] | None:
    """One figure's row: both sides' values (the runs' own), the change, the band (a speed figure's never below the
    run-to-run `floor`), the confidence and the verdict (None when a side lacks the figure). On a busy machine a
    wall-time figure is judged on its robust one, or not at all."""
    busy = was_busy(a) or was_busy(b)
    comparable = busy and figure.robust is not None and same_threads(a, b)
    spinning = comparable and threads_spin([*a, *b])  # its device time carries the load too
    judged_as = FIGURE_NAMES[figure.robust] if comparable and not spinning else figure
    (sa, known_a), (sb, known_b) = samples(a, judged_as), samples(b, judged_as)
    if judged_as is not figure and not (sa and sb):  # runs from before the device time: the wall time, not judged
        judged_as = figure
        (sa, known_a), (sb, known_b) = samples(a, figure), samples(b, figure)
    if busy and judged_as.name == DEVICE_STEP_TIME and floor[0] < BUSY_RUN_TO_RUN:
        floor = (BUSY_RUN_TO_RUN, "run to run on a busy machine")
    va, vb = own_value(a, judged_as, sa), own_value(b, judged_as, sb)
    if va is None or vb is None:
        return None
    if va == vb == 0:
        return None  # neither has any (a compile time of runs that did not compile)
    diff = vb - va
    too_few = too_few_intervals(a, judged_as) or too_few_intervals(b, judged_as)
    if va == 0:
        judged = None
        change = math.inf if diff > 0 else -math.inf if diff < 0 else 0.0
        direction = (1 if diff > 0 else -1) if abs(diff) > figure.min_abs else 0
        band, confidence = figure.tolerance, None
    else:
        judged = judge(sa, sb, figure.tolerance, (known_a, known_b), floor[0] if figure.speed else 0.0, (va, vb))
        change, band, confidence = judged.change, judged.band, judged.confidence
        direction = judged.direction if abs(diff) > figure.min_abs else 0
    cause = likely_cause(figure.speed, found) if direction else None
    only_load = bool(cause and cause.kind == "machine load")
    # what keeps a verdict back: the wall time of a busy machine, too few intervals, a change only the load explains
    undecided = SPINNING if spinning else NOT_JUDGED_BUSY if busy and figure.wall and judged_as is figure \
        else OTHER_THREADS if judged_as.name == DEVICE_STEP_TIME and not same_threads(a, b) \
        else too_few if figure.speed and too_few else ONLY_LOAD if only_load else None
    if undecided is not None:
        direction, cause = 0, cause if only_load else None
    verdict = undecided or ("same" if direction == 0 else figure.words[0] if direction > 0 else figure.words[1])
    better = None if direction == 0 or not figure.directed else (direction > 0) == figure.higher_is_better
    label = f"{figure.label} (its device time: a busy machine)" if judged_as is not figure else figure.label
    return {"figure": figure.name, "label": label, "unit": figure.unit, "a": va, "b": vb,
            "judged_on": judged_as.name, "a_samples": len(sa), "b_samples": len(sb), "diff": diff, "change": change,
            "band": band,
            "band_from": floor[1] if figure.speed and judged is not None and band == floor[0] else None,
            "confidence": confidence, "verdict": verdict, "better": better,
            "likely_cause": cause.text if cause else ("no difference of the fingerprints explains it: rerun both "
                                                      "to see whether it holds" if direction else None),
            "busy_only": undecided in (NOT_JUDGED_BUSY, ONLY_LOAD, SPINNING), "undecided": undecided}


def curve_rows(a: RunView, b: RunView, rtol: float) -> list[dict[str, Any]]:
    """Each curve both runs logged (train loss, validation metrics), aligned by step: the steps in common, the
    largest difference and where, the last step's difference, and the first step where they part by more than the
    arithmetic's tolerance (relative to A's value)."""
    rows = []
    for key in sorted(a.curves.keys() & b.curves.keys()):
        steps = sorted(a.curves[key].keys() & b.curves[key].keys())
        if not steps:
            continue
        diffs = {s: b.curves[key][s] - a.curves[key][s] for s in steps}
        worst = max(steps, key=lambda s: abs(diffs[s]))
        apart = next((s for s in steps if abs(diffs[s]) > rtol * max(abs(a.curves[key][s]), 1e-12)), None)
        rows.append({"curve": key, "steps": len(steps), "max_abs_diff": abs(diffs[worst]), "at_step": worst,
                     "final_diff": diffs[steps[-1]], "final_step": steps[-1], "apart_from_step": apart,
                     "verdict": "same" if apart is None else f"apart from step {apart}"})
    return rows


def profiler_rows(a: RunView, b: RunView) -> dict[str, Any] | None:
    """The profiler verdicts' shares side by side and the operators whose self time per step changed most (when both
    runs were profiled)."""
    va, vb = ((r.profiler or {}).get("verdict") for r in (a, b))
    if not va or not vb:
        return None
    sa, sb = va.get("shares") or {}, vb.get("shares") or {}
    shares = {k: {"a": sa.get(k), "b": sb.get(k), "points": round((sb.get(k) or 0) - (sa.get(k) or 0), 4)}
              for k in sa.keys() | sb.keys()}
    ops_a = {o["name"]: o["self_ms_per_step"] for o in a.profiler.get("top_ops") or []}
    ops_b = {o["name"]: o["self_ms_per_step"] for o in b.profiler.get("top_ops") or []}
    ops = sorted(({"name": n, "a_ms": ops_a.get(n), "b_ms": ops_b.get(n),
                   "change_ms": (ops_b.get(n) or 0.0) - (ops_a.get(n) or 0.0)} for n in ops_a.keys() | ops_b.keys()),
                 key=lambda o: -abs(o["change_ms"]))[:TOP_OPS]
    return {"bound": [va.get("bound"), vb.get("bound")], "shares": dict(sorted(shares.items())), "ops": ops}


def history_spread(run: RunView, history: list[dict[str, Any]]) -> tuple[float, int] | None:
    """The spread of the step-time medians of the ledger's runs of `run`'s config on its host and device (and their
    count), when it holds MIN_HISTORY of them or more; runs on a busy machine left out (a busier machine is a cause
    of its own, named apart)."""
    fp = run.fingerprint
    medians = [m for line in history if (f := line.get("fingerprint") or {}).get("config_hash") == fp.get("config_hash")
               and f.get("host") == fp.get("host") and f.get("device") == fp.get("device")
               and not (f.get("load") or {}).get("busy") and (m := (f.get("step_time") or {}).get("median"))]
    spread = Band.of(medians).spread if len(medians) >= MIN_HISTORY else None
    return (spread, len(medians)) if spread is not None else None


def run_to_run(a: list[RunView], b: list[RunView], history: list[dict[str, Any]], min_band: float | None
               ) -> tuple[float, str]:
    """The floor of a speed figure's band, and where it comes from: --min-band; else, for each side of a single run,
    the run-to-run spread of its config in the ledger (MIN_HISTORY runs or more), the larger of the two; else
    RUN_TO_RUN. Sides of several pooled runs need none: their samples are runs."""
    if min_band is not None:
        return min_band, "--min-band"
    measured = []
    for runs in (a, b):
        if len(runs) >= MIN_HISTORY:
            continue
        found = history_spread(runs[0], history)
        if found is None:
            return RUN_TO_RUN, "run to run, default"
        measured.append(found)
    if not measured:
        return 0.0, "pooled runs"
    spread, count = max(measured)
    return spread, f"run to run, {count} runs of the ledger"


def compare_pair(a: list[RunView], b: list[RunView], history: list[dict[str, Any]] | None = None,
                 min_band: float | None = None) -> dict[str, Any]:
    """B's runs against A's: every figure's row, the fingerprints' notes and, for one run each, the curves and the
    profiler's findings."""
    found = notes(a, b)
    rtol = loss_tolerance(a)
    floor = run_to_run(a, b, history or [], min_band)
    figures = [*FIGURES, dataclasses.replace(LOSS, tolerance=rtol), *validation_figures(a, b, rtol)]
    rows = [row for f in figures if (row := judge_figure(f, a, b, found, floor)) is not None]
    single = len(a) == 1 and len(b) == 1
    return {"a": [r.name for r in a], "b": [r.name for r in b], "figures": rows, "notes": [n.as_dict() for n in found],
            "curves": curve_rows(a[0], b[0], rtol) if single else [], "loss_rtol": rtol,
            "profiler": profiler_rows(a[0], b[0]) if single else None}


# --- the command -------------------------------------------------------------------------------------------------


def history_of(sides: list[Side], given: Path | None) -> list[dict[str, Any]]:
    """The ledger lines that can tell the run-to-run noise: of the ledger given (or outputs/ledger.jsonl here) and of
    the ledgers beside the runs' folders (where metrics.ledger=auto puts them for runs outside the working folder)."""
    beside = (r.dir.parent / ledger.LEDGER_FILE for side in sides for r in side.runs if r.dir)
    paths = {given or ledger.default_path(), *beside}
    lines: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        if path.is_file():
            for line in ledger.read(path)[0]:
                lines[(str(line.get("run_dir")), str(line.get("time")))] = line
    return list(lines.values())


def build(a_text: str, b_text: str, gates: list[Gate], default_ledger: Path | None,
          min_band: float | None = None, allow_missing: bool = False) -> dict[str, Any]:
    """The comparison of two run-like sides: every pair's figures, curves, profiler and notes, and the gates (a
    val_<metric> gate on a metric neither side has is refused once the runs are read, before any work)."""
    a, b = (resolve_side(text, name, default_ledger) for text, name in ((a_text, "compare A"), (b_text, "compare B")))
    check_validation(gates, {m for r in (*a.runs, *b.runs) for m in r.figures.get("validation") or {}})
    matched = pairs(a, b)
    history = history_of([a, b], default_ledger)
    compared = [compare_pair(ra, rb, history, min_band) for ra, rb in matched]
    for pair, (ra, rb) in zip(compared, matched, strict=True):
        pair["lacking"] = {g.name: who for g in gates if (who := lacking(g.name, ra, rb))}
    results = [evaluate_gate(g, p, allow_missing) for g in gates for p in compared]
    return {"kind": "runs", "written": time.strftime("%Y-%m-%d %H:%M:%S"), "title": f"{a.text} -> {b.text}",
            "a": {"text": a.text, "kind": a.kind, "runs": [r.name for r in a.runs]},
            "b": {"text": b.text, "kind": b.kind, "runs": [r.name for r in b.runs]},
            "pairs": compared, "gates": results, "passed": not any(r["status"] == FAIL for r in results),
            "warnings": [s.note for s in (a, b) if s.note],
            "_curves": [(ra[0].curves, rb[0].curves) for ra, rb in matched]}


def lacking(name: str, a: list[RunView], b: list[RunView]) -> str | None:
    """Which side has no value of the figure `name` (A, B, A and B), or None when both have one."""
    figure = FIGURE_NAMES.get(name) or dataclasses.replace(LOSS, name=name)  # val_<metric>: read by its name
    without = [side for side, runs in (("A", a), ("B", b)) if not samples(runs, figure)[0]]
    return " and ".join(without) or None


def command(args: argparse.Namespace) -> int:
    """`trainflow compare` (see trainflow.cli): the report of the kind the sides are, its pages, its exit code."""
    worse = {name: -1 if f.higher_is_better else 1 for name, f in FIGURE_NAMES.items()}
    gates = [parse_gate(g, worse) for text in args.fail_on or [] for g in text.split(",") if g.strip()]
    if not args.bisect:
        check_kind(gates, checkpoints.is_checkpoint(args.a) or checkpoints.is_checkpoint(args.b))
    if args.bisect:
        if gates:
            raise CompareError("--fail-on: --bisect takes no gates (it names where two runs part); leave --fail-on "
                               "out, or gate the runs' checkpoints: trainflow compare A/checkpoints B/checkpoints "
                               "--fail-on tensors=1e-5")
        out = render_compare.out_folder(args.out, args.force)  # the replays go there: settled first
        report = bisect(Path(args.a), Path(args.b), out, args.rtol, args.trust_targets,
                        (args.pythonpath_a, args.pythonpath_b))
    elif checkpoints.is_checkpoint(args.a) or checkpoints.is_checkpoint(args.b):
        if not (checkpoints.is_checkpoint(args.a) and checkpoints.is_checkpoint(args.b)):
            one, other = (args.a, args.b) if checkpoints.is_checkpoint(args.a) else (args.b, args.a)
            raise CompareError(f"compare: {one} is a checkpoint and {other} is not; compare a checkpoint with a "
                               "checkpoint (a step_N folder, or a checkpoint dir), or runs with runs")
        report = checkpoints.compare(Path(args.a), Path(args.b), args.rtol)
        report["title"] = f"{args.a} -> {args.b}"
        report["gates"] = [checkpoints.evaluate_gate(g, report) for g in gates]
        report["passed"] = not any(r["status"] == FAIL for r in report["gates"])
    else:
        report = build(args.a, args.b, gates, args.ledger, args.min_band, args.allow_missing)
    if not args.bisect:  # a bisect's was settled before its replays
        out = render_compare.out_folder(args.out, args.force)
    written = render_compare.write(report, out)
    for line in render_compare.console_lines(report):
        print(line)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return EXIT_GATE_FAILED if not report.get("passed", True) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="A, the reference: a run folder, a sweep folder, ledger:<filters> (e.g. "
                             "ledger:config=3f2a9c01d4e5,last=5) or a checkpoint (step_N, or a checkpoint dir)")
    p.add_argument("b", help="B, compared with A: the same kinds")
    p.add_argument("--out", type=Path, default=None,
                   help="the folder to write compare.md, compare.json, compare.png to (default: the next free "
                        "outputs/compare/N here); one that holds an earlier comparison is refused without --force")
    p.add_argument("--force", action="store_true", help="replace the earlier comparison in --out")
    p.add_argument("--fail-on", action="append", metavar="FIGURE=THRESHOLD",
                   help="a gate, e.g. step_time=+5%% (B's step time more than 5%% above A's, beyond the noise), "
                        "val_loss=+0.01, mfu=-10%%, tensors=1e-5 (checkpoints); repeat or separate with commas")
    p.add_argument("--allow-missing", action="store_true",
                   help="a --fail-on gate on a figure one side lacks (e.g. mfu of a run without a peak FLOPs figure) "
                        "is NOT EVALUATED instead of failing")
    p.add_argument("--ledger", type=Path, default=None,
                   help=f"the ledger ledger: selections read (default: outputs/{ledger.LEDGER_FILE} here)")
    p.add_argument("--min-band", type=_share, default=None, metavar="SHARE",
                   help="the least band of a speed figure, e.g. 3%% on a quiet GPU node (default: the run-to-run "
                        "spread of the config's runs in the ledger, else 15%%)")
    p.add_argument("--rtol", type=float, default=None,
                   help="checkpoints and --bisect: the relative difference of a tensor that counts (default: "
                        "tolerance.py's compare table, by the runs' arithmetic)")
    p.add_argument("--bisect", action="store_true",
                   help="A and B are checkpointed runs that should agree: replay each (trainflow train in this "
                        "Python, with the run's overrides) from their last equal checkpoint, and name the first step "
                        "and tensor where they part")
    p.add_argument("--trust-targets", action="store_true",
                   help="--bisect: replay runs whose overrides name code (a _target_) or configs of their own "
                        "(--config-dir): only for runs you trust")
    p.add_argument("--pythonpath-a", metavar="DIR", default=None,
                   help="--bisect: the code folder(s) A's replay imports first (put before your PYTHONPATH)")
    p.add_argument("--pythonpath-b", metavar="DIR", default=None, help="--bisect: the same for B's replay")


def _share(text: str) -> float:
    """`3%` or `0.03`."""
    try:
        value = float(text.removesuffix("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a share: {text!r}; give e.g. 3% or 0.03") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (or 0-100%); got {text}")
    return value


