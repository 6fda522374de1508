"""What differs between two sides' fingerprints, in words, most decisive first, and which difference is the likely
cause of a figure's change (trainflow compare).

Most decisive first: another config (the keys that differ), another model shape, other code (another commit, another
PYTHONPATH), another trainflow, torch, CUDA, driver or Python, another device, a busier machine (one side's other
processes kept BUSY_SHARE of the cores more busy: it explains speed only), the same commit with other uncommitted
changes (they may touch no code that runs), another host. Both sides on an equally busy machine is a note, no cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainflow.record.fingerprint import BUSY_SHARE, hashed_config

if TYPE_CHECKING:
    from trainflow.report.sides import RunView

MAX_LISTED = 6  # config keys named in a note before "and N more"


@dataclass(frozen=True)
class Note:
    """A difference of the two sides' fingerprints, in words; `speed_only`: it explains speed, never numbers;
    `cause`: it can explain a difference at all (both sides on an equally busy machine: only noise)."""

    kind: str
    text: str
    speed_only: bool = False
    cause: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, "speed_only": self.speed_only, "cause": self.cause}


def _values(runs: list[RunView], get: Any) -> list[Any]:
    seen: list[Any] = []
    for run in runs:
        value = get(run)
        if value not in seen:
            seen.append(value)
    return seen


def _shown(values: list[Any]) -> str:
    return " or ".join(str(v) for v in values) if values else "unknown"


def notes(a: list[RunView], b: list[RunView]) -> list[Note]:
    """What differs between the sides' fingerprints, most decisive first: the config, the model's shape, the code
    (another commit or PYTHONPATH), the versions, the device, a busier machine, uncommitted changes, the host."""
    out: list[Note] = []
    changed = config_changes(a[0].config, b[0].config) if a[0].config and b[0].config else []
    configs = [_values(runs, lambda r: r.fingerprint.get("config_hash")) for runs in (a, b)]
    if changed or configs[0] != configs[1]:
        more = f" and {len(changed) - MAX_LISTED} more" if len(changed) > MAX_LISTED else ""
        listed = "; ".join(changed[:MAX_LISTED]) + more if changed else f"{_shown(configs[0])} -> {_shown(configs[1])}"
        out.append(Note("config", f"another config: {listed}"))
    models = [_values(runs, lambda r: r.fingerprint.get("model_hash")) for runs in (a, b)]
    if models[0] != models[1]:
        out.append(Note("model", f"another model shape (hash {_shown(models[0])} -> {_shown(models[1])})"))
    code, uncommitted = _code_notes(a, b)
    out += code
    for key, label in (("trainflow", "trainflow"), ("torch", "torch"), ("cuda", "CUDA"), ("driver", "driver"),
                       ("python", "Python")):
        va, vb = (_values(runs, lambda r, k=key: r.fingerprint.get(k)) for runs in (a, b))
        if va != vb:
            out.append(Note("environment", f"another {label}: {_shown(va)} -> {_shown(vb)}"))
    devices = [_values(runs, lambda r: _device(r.fingerprint)) for runs in (a, b)]
    if devices[0] != devices[1]:
        out.append(Note("device", f"another device: {_shown(devices[0])} -> {_shown(devices[1])}"))
    if (load := load_note(a, b)) is not None:
        out.append(load)
    if uncommitted is not None:
        out.append(uncommitted)
    hosts = [_values(runs, lambda r: r.fingerprint.get("host")) for runs in (a, b)]
    if hosts[0] != hosts[1]:
        out.append(Note("host", f"another host: {_shown(hosts[0])} -> {_shown(hosts[1])}", speed_only=True))
    return out


def _device(fp: dict[str, Any]) -> str | None:
    d = fp.get("device")
    return f"{d.get('count')} x {d.get('name')} ({d.get('type')})" if d else None


def _code_notes(a: list[RunView], b: list[RunView]) -> tuple[list[Note], Note | None]:
    """(what says the code differs: another commit, another PYTHONPATH; the same commit with other uncommitted
    changes, a weaker sign: they may touch no code that runs)."""
    def code(r: RunView, key: str) -> Any:
        return (r.fingerprint.get("code") or {}).get(key)

    out = []
    ca, cb = (_values(runs, lambda r: (code(r, "commit") or "")[:10] or None) for runs in (a, b))
    if ca != cb:
        out.append(Note("code", f"other code: project commit {_shown(ca)} -> {_shown(cb)}"))
    pa, pb = (_values(runs, lambda r: ((r.fingerprint.get("replay") or {}).get("env") or {}).get("PYTHONPATH"))
              for runs in (a, b))
    if pa != pb:
        out.append(Note("code", f"another PYTHONPATH (other code may be imported): {_shown(pa)} -> {_shown(pb)}"))
    changes = [_values(runs, lambda r: code(r, "diff") if code(r, "dirty") else None) for runs in (a, b)]
    weak = None
    if ca == cb and changes[0] != changes[1]:
        shown = [" or ".join("uncommitted changes " + d if d else "none" for d in c) for c in changes]
        weak = Note("uncommitted changes", f"the same commit with other uncommitted changes: {shown[0]} -> {shown[1]}")
    return out, weak


def _other_cores(runs: list[RunView]) -> float | None:
    """The most cores other processes kept busy while a side's runs were timed (None: not measured)."""
    known = [v for r in runs if (v := (r.fingerprint.get("load") or {}).get("other_cores")) is not None]
    return max(known) if known else None


def load_note(a: list[RunView], b: list[RunView]) -> Note | None:
    """A busy machine: a cause of a speed difference when one side's machine was busier than the other's by
    BUSY_SHARE of the cores; when both were alike busy, only a warning that their speeds carry its noise."""
    busy = [any((r.fingerprint.get("load") or {}).get("busy") for r in runs) for runs in (a, b)]
    others = [_other_cores(a), _other_cores(b)]
    if not any(busy) or None in others:
        return None
    cores = (a[0].fingerprint.get("load") or {}).get("cpu_cores") or 1
    shown = (f"other processes kept {others[1]:.1f} of {cores} cores busy while B's steps were timed "
             f"(A: {others[0]:.1f})")
    if abs(others[1] - others[0]) >= BUSY_SHARE * cores:
        who = "B" if others[1] > others[0] else "A"
        return Note("machine load", f"{who} ran on a busier machine: {shown}; rerun on an idle machine before trusting "
                                    "the speed", speed_only=True)
    return Note("machine load", f"both ran on a busy machine: {shown}; their speeds carry its noise",
                speed_only=True, cause=False)


def config_changes(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The config keys whose values differ (those that only say where outputs go left out), as `key: a -> b`."""
    flat_a, flat_b = _flatten(hashed_config(a)), _flatten(hashed_config(b))
    return [f"{k}: {flat_a.get(k, '(none)')} -> {flat_b.get(k, '(none)')}"
            for k in sorted(flat_a.keys() | flat_b.keys()) if flat_a.get(k) != flat_b.get(k)]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()} or \
            ({prefix.rstrip("."): {}} if prefix else {})
    return {prefix.rstrip("."): tree}


def likely_cause(speed: bool, found: list[Note]) -> Note | None:
    """The first difference that can explain a change of a figure (of speed: a busier machine or another host too)."""
    return next((n for n in found if n.cause and (speed or not n.speed_only)), None)
