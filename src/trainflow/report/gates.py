"""`--fail-on` gates: a threshold on a figure of `trainflow compare` that fails a CI job on a regression beyond
the noise, and warns where a busier machine is the likely cause."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from trainflow.errors import TrainflowError

PASS, FAIL, WARN, NOT_EVALUATED = "PASS", "FAIL", "WARN", "NOT EVALUATED"


class GateError(TrainflowError):
    """A --fail-on gate that cannot be read; the message gives its form and the figures."""


_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_THRESHOLD = re.compile(r"(?P<sign>[+-]?)(?P<value>([0-9]+(\.[0-9]*)?|\.[0-9]+)(e[+-]?[0-9]+)?)(?P<pct>%?)")
TENSORS = "tensors"  # the gate of two checkpoints


@dataclass(frozen=True)
class Gate:
    """`name=+5%`: fail when B's figure is more than 5% above A's (a sign: the direction that fails; none: the
    figure's worse one); without %, an absolute difference in the figure's unit (`val_loss=+0.01`)."""

    text: str
    name: str
    sign: int  # +1: an increase fails; -1: a decrease
    value: float
    relative: bool


def parse_gate(text: str, figures: dict[str, int]) -> Gate:
    """A gate from `--fail-on`, on one of `figures` (by name: the sign of its worse direction), a validation metric
    (val_<metric>: larger is worse; which metrics there are, only the runs tell: see check_validation) or `tensors`.
    A name that is none of them, or a threshold that is no number, is refused in one line: a gate that cannot be
    evaluated must never pass a CI job."""
    name, equals, threshold = text.strip().partition("=")
    if not equals or not _NAME.fullmatch(name):
        raise GateError(f"--fail-on {text}: not name=threshold; give e.g. step_time=+5% or val_loss=+0.01 "
                        f"(figures: {', '.join(figures)}, val_<metric>, {TENSORS})")
    if name not in figures and not name.startswith("val_") and name != TENSORS:
        raise GateError(f"--fail-on {text}: {name!r} is no figure{_closest(name, [*figures, TENSORS, 'val_loss'])}; "
                        f"use one of {', '.join(figures)}, val_<metric> (a validation metric, e.g. val_loss) or "
                        f"{TENSORS} (checkpoints)")
    match = _THRESHOLD.fullmatch(threshold)
    if match is None:
        raise GateError(f"--fail-on {text}: the threshold {threshold!r} is not a number with an optional sign and %; "
                        f"give e.g. {name}=+5% or {name}=0.01")
    sign = {"+": 1, "-": -1, "": figures.get(name, 1)}[match["sign"]]
    return Gate(text, name, sign, float(match["value"]), bool(match["pct"]))


def check_kind(gates: list[Gate], checkpoints: bool) -> None:
    """Checkpoints are gated on `tensors` only, runs on their figures only: any other gate is refused before any
    work (it would be evaluated on nothing)."""
    for gate in gates:
        if checkpoints and gate.name != TENSORS:
            raise GateError(f"--fail-on {gate.text}: {gate.name} is a figure of runs; two checkpoints are gated on "
                            f"{TENSORS}=RTOL (e.g. {TENSORS}=1e-5)")
        if not checkpoints and gate.name == TENSORS:
            raise GateError(f"--fail-on {gate.text}: {TENSORS} gates two checkpoints; give checkpoints (step_N "
                            "folders or checkpoint dirs), or gate a figure of the runs (e.g. step_time=+5%)")


def check_validation(gates: list[Gate], metrics: set[str]) -> None:
    """A val_<metric> gate on a metric no run of either side has: refused with the closest one they have."""
    have = sorted(f"val_{m}" for m in metrics)
    for gate in gates:
        if gate.name.startswith("val_") and gate.name not in have:
            raise GateError(f"--fail-on {gate.text}: no run of either side has the validation metric "
                            f"{gate.name.removeprefix('val_')!r}{_closest(gate.name, have)}; they have "
                            f"{', '.join(have) or 'none (no validation ran: trainer.eval_every)'}")


def _closest(name: str, names: list[str]) -> str:
    found = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {found[0]}?)" if found else ""


def evaluate_gate(gate: Gate, pair: dict[str, Any], allow_missing: bool = False) -> dict[str, Any]:
    """PASS, FAIL (past the threshold, beyond the noise, not a busy machine's doing), WARN (past it, but a busy
    machine is the likely cause, or compare could not tell: too few intervals); a figure a side lacks
    (pair["lacking"]: which side) FAILs, or is NOT EVALUATED with `allow_missing` (--allow-missing)."""
    row = next((r for r in pair["figures"] if r["figure"] == gate.name), None)
    where = f"{', '.join(pair['a'])} -> {', '.join(pair['b'])}"
    if row is None:
        lacking = (pair.get("lacking") or {}).get(gate.name)
        if lacking is None:  # both sides have it, and it is 0 on both (a compile time of runs not compiled)
            return {"gate": gate.text, "status": PASS, "pair": where, "detail": f"{gate.name} is 0 on both sides"}
        missing = f"{lacking} {'have' if ' and ' in lacking else 'has'} no {gate.name}"
        if allow_missing:
            return {"gate": gate.text, "status": NOT_EVALUATED, "pair": where, "detail": f"{missing} (--allow-missing)"}
        return {"gate": gate.text, "status": FAIL, "pair": where,
                "detail": f"{missing}, so the gate cannot tell; --allow-missing lets such a gate pass as NOT EVALUATED"}
    moved = (row["change"] if gate.relative else row["diff"]) * gate.sign
    limit = gate.value / 100 if gate.relative else gate.value
    shown = (f"{row['change'] * 100:+.1f}%" if math.isfinite(row["change"]) else f"{row['diff']:+.4g}") \
        if gate.relative else f"{row['diff']:+.4g}"
    if moved <= limit:
        status, detail = PASS, f"{row['label']} {shown}, within {gate.text.split('=', 1)[1]}"
    elif row["verdict"] == "same":
        status, detail = PASS, (f"{row['label']} {shown}, past {gate.text.split('=', 1)[1]} but within the noise "
                                f"(band ±{row['band'] * 100:.1f}%)")
    elif row.get("undecided"):
        status, detail = WARN, f"{row['label']} {shown}, but {row['undecided']}" + (
            f"; {row['likely_cause']}" if row["likely_cause"] else "")
    else:
        status, detail = FAIL, f"{row['label']} {shown} ({row['verdict']}), past {gate.text.split('=', 1)[1]}" + (
            f"; likely cause: {row['likely_cause']}" if row["likely_cause"] else "")
    return {"gate": gate.text, "status": status, "pair": where, "detail": detail}
