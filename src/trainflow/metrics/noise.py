"""The noise of a run's speed: every steady log interval is one sample of it, and two runs' samples decide whether
a figure changed.

Two kinds of noise. Inside a run, the intervals show how much its figure wanders (each run's band: its 10th to 90th
percentile, as a share of its median). Between runs, the same command swings further than its intervals do (another
process placement, another load, a neighbour): that part only several runs show, so a comparison of single runs also
takes a run-to-run floor (trainflow.report.compare: the ledger's runs of the config, or a measured default). A
figure changed when its median moved further than both runs' bands together and that floor (never less than
MIN_BAND), and the intervals of one run beat the other's in at least CONFIDENT of all pairs (the probability of
superiority, Vargha and Delaney's A). A figure with one value per run (peak memory, compile time) has no band of its
own: its band is the figure's fixed tolerance, and no confidence is given.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainflow.util.files import LOG_FILE_BYTES, read_regular

MIN_BAND = 0.02  # a change below 2% is never called: timing a log interval is no finer than that here
CONFIDENT = 0.9  # the share of interval pairs in which one run must beat the other
MIN_SAMPLES = 3  # fewer intervals than this give no band: the figure is judged as one value per run

# metrics.jsonl's interval figures, by the name compare gives them
INTERVAL_KEYS = {"step_time_s": "perf/step_time_s", "step_time_device_s": "perf/step_time_device_s",
                 "samples_per_sec": "perf/samples_per_sec",
                 "tokens_per_sec": "perf/tokens_per_sec", "mfu": "perf/mfu",
                 "data_wait_fraction": "perf/data_wait_fraction"}


@dataclass(frozen=True)
class MetricsLog:
    """metrics.jsonl's entries, and how many of its lines were left out (see read_metrics_log)."""

    entries: list[dict[str, Any]]
    skipped: int


def read_metrics_log(path: Path) -> MetricsLog:
    """metrics.jsonl's entries (none when there is no file). Read only when it is a regular file of bounded size (a
    FIFO or a link to /dev/zero is one ReceivedFileError naming it). A line is kept when it is a JSON object with an
    integer `step` whose figures trainflow reads (FIGURE_PREFIXES) are numbers (or null); any other line is left out
    and counted: the log is appended to line by line, so one line cut off by a killed run, or of another shape, says
    nothing about the others, and the reader says how many it left out instead of refusing the run."""
    if not os.path.lexists(path):
        return MetricsLog([], 0)
    entries, skipped = [], 0
    for line in read_regular(path, LOG_FILE_BYTES).decode(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if _well_formed(entry):
            entries.append(entry)
        else:
            skipped += 1
    return MetricsLog(entries, skipped)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's well-formed entries (see read_metrics_log)."""
    return read_metrics_log(path).entries


FIGURE_PREFIXES = ("train/", "val/", "perf/")  # the figures of a metrics line that trainflow's readers take


def _well_formed(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("step"), int) or isinstance(entry["step"], bool):
        return False
    return all(value is None or (isinstance(value, int | float) and not isinstance(value, bool))
               for key, value in entry.items() if key.startswith(FIGURE_PREFIXES))


def steady_intervals(entries: list[dict[str, Any]], start_step: int, excluded_steps: int) -> dict[str, list[float]]:
    """Per figure, the values of the log intervals that lie wholly in the steady state: each interval ends at a
    logged step and begins after the previous one; those that begin before `start_step + excluded_steps` (the run's
    start or resume, then its warm-up and compile steps) are left out, and so are the lines of an earlier run that
    this one resumed."""
    out: dict[str, list[float]] = {name: [] for name in INTERVAL_KEYS}
    previous = start_step
    for entry in entries:
        if "perf/step_time_s" not in entry or entry["step"] <= start_step:
            continue
        if previous >= start_step + excluded_steps:
            for name, key in INTERVAL_KEYS.items():
                value = entry.get(key)
                if isinstance(value, int | float) and math.isfinite(value):
                    out[name].append(float(value))
        previous = entry["step"]
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, interpolated between the two nearest ranks."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@dataclass(frozen=True)
class Band:
    """A figure's samples summed up: how many, the median, and the 10th and 90th percentiles."""

    n: int
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Band:
        return cls(len(values), statistics.median(values), percentile(values, 0.1), percentile(values, 0.9))

    @property
    def spread(self) -> float | None:
        """Half the 10-90% range as a share of the median; None with fewer than MIN_SAMPLES samples."""
        if self.n < MIN_SAMPLES or self.median == 0:
            return None
        return (self.high - self.low) / 2 / abs(self.median)

    def as_dict(self) -> dict[str, float | int | None]:
        return {"n": self.n, "median": self.median, "p10": self.low, "p90": self.high, "spread": self.spread}


def superiority(a: list[float], b: list[float]) -> float:
    """The probability that a sample of `b` is larger than one of `a` (ties count half): 0.5 when they are alike,
    1 when every sample of b exceeds every sample of a."""
    ordered = sorted(a)
    above = 0.0
    for value in b:
        below = _count_below(ordered, value)
        ties = _count_below(ordered, value, inclusive=True) - below
        above += below + ties / 2
    return above / (len(a) * len(b))


def _count_below(ordered: list[float], value: float, inclusive: bool = False) -> int:
    return (bisect.bisect_right if inclusive else bisect.bisect_left)(ordered, value)


@dataclass(frozen=True)
class Judgement:
    """How B's figure stands to A's: the relative change of the medians, the band it must leave to count, the
    confidence (None without enough samples on both sides) and the direction: +1 larger, -1 smaller, 0 the same."""

    change: float
    band: float
    confidence: float | None
    direction: int


def judge(a: list[float], b: list[float], tolerance: float, spreads: tuple[float | None, float | None] = (None, None),
          floor: float = 0.0, values: tuple[float, float] | None = None) -> Judgement | None:
    """B's samples against A's (see the module's docstring). `tolerance`: the band of a figure without samples
    enough for one of its own; `spreads`: bands known beyond the samples (a ledger line keeps its run's, not its
    intervals); `floor`: the run-to-run noise the band never goes below; `values`: the sides' own figures when
    they are not the samples' medians (a run's step time is its steady state's, the figure its summary gives; its
    intervals tell the noise). None when A's figure is 0 (no relative change)."""
    base, other = Band.of(a), Band.of(b)
    centre_a, centre_b = values if values is not None else (base.median, other.median)
    if centre_a == 0:
        return None
    change = centre_b / centre_a - 1
    own = [s if s is not None else known for s, known in zip((base.spread, other.spread), spreads, strict=True)]
    band = max(sum(s for s in own if s is not None), MIN_BAND, floor) if all(s is not None for s in own) \
        else max(tolerance, floor)
    confidence = None
    if base.n >= MIN_SAMPLES and other.n >= MIN_SAMPLES:
        above = superiority(a, b)
        confidence = above if change >= 0 else 1 - above
    # a ratio of positive values is judged on its logarithm: a step 13% shorter is a throughput 15% higher, and the
    # two verdicts agree
    moved = abs(math.log1p(change)) > math.log1p(band) if centre_a > 0 and centre_b > 0 else abs(change) > band
    beyond = moved and (confidence is None or confidence >= CONFIDENT)
    return Judgement(change, band, confidence, (1 if change > 0 else -1) if beyond else 0)
