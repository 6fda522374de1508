"""`--fail-on` gates: a threshold on a figure of `trainflow compare` that fails a CI job on a regression beyond
the noise, and warns where a busier machine is the likely cause."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from trainflow.errors import TrainflowError

PASS, FAIL, WARN, NOT_EVALUATED = "PASS", "FAIL", "WARN", "NOT EVALUATED"


class GateError(TrainflowError):
    """A --fail-on gate that cannot be read; the message gives its form and the figures."""


_GATE = re.compile(r"(?P<name>[a-z_]+)=(?P<sign>[+-]?)(?P<value>[0-9.]+(e-?[0-9]+)?)(?P<pct>%?)")


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
    (val_<metric>: larger is worse) or `tensors`."""
    match = _GATE.fullmatch(text.strip())
    if match is None:
        raise GateError(f"--fail-on {text}: not name=threshold; give e.g. step_time=+5% or val_loss=+0.01 "
                        f"(figures: {', '.join(figures)}, val_<metric>, tensors)")
    name = match["name"]
    if name not in figures and not name.startswith("val_") and name != "tensors":
        raise GateError(f"--fail-on {text}: {name!r} is no figure; use one of {', '.join(figures)}, "
                           "val_<metric> (a validation metric, e.g. val_loss) or tensors (checkpoints)")
    sign = {"+": 1, "-": -1, "": figures.get(name, 1)}[match["sign"]]
    return Gate(text, name, sign, float(match["value"]), bool(match["pct"]))


def evaluate_gate(gate: Gate, pair: dict[str, Any]) -> dict[str, Any]:
    """PASS, FAIL (past the threshold, beyond the noise, not a busy machine's doing), WARN (past it, but a busy
    machine is the likely cause, or compare could not tell: too few intervals) or NOT EVALUATED (a side lacks the
    figure)."""
    row = next((r for r in pair["figures"] if r["figure"] == gate.name), None)
    where = f"{', '.join(pair['a'])} -> {', '.join(pair['b'])}"
    if row is None:
        return {"gate": gate.text, "status": NOT_EVALUATED, "pair": where, "detail": "a side has no such figure"}
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
