"""summary.json's format: the number each run writes, any earlier format read under today's names, and the shape of
the fields that compare, report and the ladder read, checked once as the file is read.

Format 1 carried no number. Format 2 renamed `trainer.warmup_steps` to `trainer.excluded_steps` (warm-up is the
learning rate's) and the compile report's `warmup_step_times_s` to `excluded_step_times_s`.

A summary.json may come from someone else (a colleague's run folder, a CI artifact): it is read only when it is a
regular file of bounded size, and a field of the wrong type is one line naming the file and the field, never a
traceback in whatever reads it later. Every field may be null (a run writes null for what it did not measure).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainflow.errors import ReceivedFileError
from trainflow.util.files import SMALL_FILE_BYTES, read_regular
from trainflow.util.shown import shown

FORMAT = 2
# (format that introduced the names, section path, old key, new key)
_RENAMES = ((2, ("config", "trainer"), "warmup_steps", "excluded_steps"),
            (2, ("compile",), "warmup_step_times_s", "excluded_step_times_s"))


@dataclass(frozen=True)
class Kind:
    """What a field must be, in words, and the test of a value."""

    words: str
    holds: Callable[[Any], bool]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


NUMBER = Kind("a number", _is_number)
INTEGER = Kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
TEXT = Kind("text", lambda v: isinstance(v, str))
FLAG = Kind("true or false", lambda v: isinstance(v, bool))
SECTION = Kind("a section (a JSON object)", lambda v: isinstance(v, dict))
NUMBERS = Kind("a list of numbers", lambda v: isinstance(v, list) and all(_is_number(x) for x in v))
SECTIONS = Kind("a list of sections", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v))
NUMBER_TABLE = Kind("a section of numbers", lambda v: isinstance(v, dict)
                    and all(_is_number(x) or x is None for x in v.values()))

# The fields compare, report and the ladder read, by path: `*` is every key of a section, `[]` every item of a list.
# A parent comes before its children; a child is checked only where its parent is present.
SHAPE: dict[str, Kind] = {
    "format": INTEGER, "steps": INTEGER, "resumed_from_step": INTEGER, "world_size": INTEGER,
    "global_batch": INTEGER, "device": TEXT, "matmul_math": TEXT, "mfu": NUMBER, "peak_memory_bytes": NUMBER,
    "data_wait_fraction": NUMBER,
    "steady_state": SECTION, "steady_state.excluded_steps": INTEGER, "steady_state.step_time_s": NUMBER,
    "steady_state.samples_per_sec": NUMBER, "steady_state.tokens_per_sec": NUMBER,
    "steady_state.data_wait_fraction": NUMBER,
    "task": SECTION, "task.monitor": TEXT, "task.mode": TEXT,
    "train_loss": SECTION, "train_loss.first": NUMBER, "train_loss.last": NUMBER,
    "validation": NUMBER_TABLE,
    "compile": SECTION, "compile.enabled": FLAG, "compile.graphs": INTEGER, "compile.compile_time_s": NUMBER,
    "compile.graph_breaks": SECTION, "compile.graph_breaks.count": INTEGER,
    "compile.recompiles": SECTION, "compile.recompiles.count": INTEGER, "compile.check": SECTION,
    "profiler": SECTION, "profiler.verdict": SECTION, "profiler.verdict.bound": TEXT, "profiler.verdict.action": TEXT,
    "profiler.verdict.shares": NUMBER_TABLE, "profiler.top_ops": SECTIONS, "profiler.top_ops[].name": TEXT,
    "profiler.top_ops[].self_ms_per_step": NUMBER,
    "checkpoint": SECTION, "checkpoint.saves": INTEGER, "checkpoint.stopped_by": TEXT, "checkpoint.verified": FLAG,
    "checkpoint.blocked_s": SECTION, "checkpoint.blocked_s.total": NUMBER,
    "checkpoint.write_s": SECTION, "checkpoint.write_s.total": NUMBER,
    "cost": SECTION, "cost.energy": SECTION, "cost.energy.absent": TEXT, "cost.energy.watts": NUMBER,
    "cost.energy.joules_per_sample": NUMBER, "cost.energy.joules_per_token": NUMBER,
    "cost.money": SECTION, "cost.money.absent": TEXT, "cost.money.run": NUMBER,
    "cost.money.per_million_tokens": NUMBER, "cost.money.per_million_samples": NUMBER,
    "host": SECTION, "host.load_average": NUMBERS, "host.cpu_cores": INTEGER,
    "parallelism": SECTION, "parallelism.check": SECTION, "parallelism.plan": SECTION,
    "parallelism.plan.choice": TEXT, "parallelism.plan.budget_bytes": NUMBER, "parallelism.plan.budget_source": TEXT,
    "parallelism.plan.reason": TEXT, "parallelism.plan.table": SECTION, "parallelism.plan.table.*": SECTION,
    "parallelism.plan.table.*.total": NUMBER, "parallelism.plan.check": SECTION,
    "parallelism.plan.check.peak_over_estimate": NUMBER,
    "config": SECTION, "config.trainer": SECTION, "config.trainer.precision": TEXT, "config.model": SECTION,
    "config.data": SECTION,
    "config.checkpoint": SECTION, "config.ladder": SECTION, "config.ladder.rung": TEXT,
    "fingerprint": SECTION, "fingerprint.config_hash": TEXT, "fingerprint.model_hash": TEXT,
    "fingerprint.host": TEXT, "fingerprint.device": SECTION, "fingerprint.code": SECTION,
    "fingerprint.code.commit": TEXT, "fingerprint.code.dirty": FLAG, "fingerprint.code.diff": TEXT,
    "fingerprint.load": SECTION, "fingerprint.load.busy": FLAG, "fingerprint.load.other_cores": NUMBER,
    "fingerprint.load.cpu_cores": INTEGER, "fingerprint.step_time": SECTION, "fingerprint.step_time.median": NUMBER,
    "fingerprint.step_time.spread": NUMBER, "fingerprint.trainflow": TEXT, "fingerprint.torch": TEXT,
    "fingerprint.cuda": TEXT, "fingerprint.driver": TEXT, "fingerprint.python": TEXT, "fingerprint.replay": SECTION,
    "fingerprint.replay.env": SECTION, "fingerprint.replay.env.PYTHONPATH": TEXT,
}
REQUIRED = ("steps",)  # every summary.json trainflow writes has them


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json under today's names, its fields of the SHAPE they must have. FileNotFoundError when there
    is none; ReceivedFileError (one line naming the file, and the field where one is wrong) for anything that is not
    a summary.json trainflow wrote whole: not a regular file, too large, cut off, of another shape."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no such file")
    data = read_regular(path, SMALL_FILE_BYTES)
    try:
        summary = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReceivedFileError(f"{shown(path)}: not valid JSON ({shown(exc)}); the run was cut off while writing "
                                f"it: rerun it, or move {shown(path.parent)} out of the folder") from None
    return checked(upgraded(summary), path)


def checked(summary: Any, path: Path) -> dict[str, Any]:
    """`summary` when it is an object whose fields have their SHAPE; else one ReceivedFileError naming the field."""
    fix = "it is not a summary.json trainflow wrote: rerun the run, or leave its folder out"
    if not isinstance(summary, dict):
        raise ReceivedFileError(f"{shown(path)}: holds {_what(summary)}, not a section (a JSON object); {fix}")
    for name in REQUIRED:
        if summary.get(name) is None:
            raise ReceivedFileError(f"{shown(path)}: {name} is missing; {fix}")
    for field, kind in SHAPE.items():
        for where, value in _values(summary, field.split(".")):
            if value is not None and not kind.holds(value):
                raise ReceivedFileError(f"{shown(path)}: {shown(where)} is {_what(value)}, not {kind.words}; {fix}")
    return summary


def _values(section: Any, parts: list[str], where: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of each field `parts` names under `section` (`*`: every key; `[]`: every item of a list),
    skipping where a parent is absent or not a container (the parent's own check says so)."""
    head, rest = parts[0], parts[1:]
    if head.endswith("[]"):
        items = section.get(head[:-2]) if isinstance(section, dict) else None
        found = [(f"{where}{head[:-2]}[{i}]", item) for i, item in enumerate(items)] if isinstance(items, list) else []
    elif head == "*":
        found = [(f"{where}{key}", value) for key, value in section.items()] if isinstance(section, dict) else []
    else:
        found = [(f"{where}{head}", section.get(head))] if isinstance(section, dict) and head in section else []
    for name, value in found:
        if rest:
            yield from _values(value, rest, f"{name}.")
        else:
            yield name, value


def _what(value: Any) -> str:
    """A value as a line says what it is: its kind and (short) itself."""
    kind = {bool: "true or false", str: "text", list: "a list", dict: "a section", type(None): "null"}.get(
        type(value), "a number" if _is_number(value) else type(value).__name__)
    text = json.dumps(value) if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    return f"{kind} ({shown(text[:40] + ('...' if len(text) > 40 else ''))})"


def upgraded(summary: Any) -> Any:
    """`summary` with the keys earlier formats named otherwise renamed, and today's format number."""
    if not isinstance(summary, dict) or not isinstance(summary.get("format", 1), int) \
            or summary.get("format", 1) >= FORMAT:
        return summary
    found = summary.get("format", 1)
    for since, where, old, new in _RENAMES:
        section = summary
        for name in where:
            section = section.get(name) if isinstance(section, dict) else None
        if found < since and isinstance(section, dict) and old in section:
            section[new] = section.pop(old)
    summary["format"] = FORMAT
    return summary
