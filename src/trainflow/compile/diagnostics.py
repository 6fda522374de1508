"""What dynamo did, in words a user can act on: graph-break sites with the user's own file and line and a hint,
the frames left eager, recompiles named by function; read from dynamo's records after the steps ran (compiler.py
reports them and turns a failure into one line).
"""

from __future__ import annotations

import contextlib
import re
import sysconfig
from pathlib import Path
from typing import Any

import torch

_TORCH_DIR = str(Path(torch.__file__).parent)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


def eager_frames(compiles: Any, limit: int) -> list[dict[str, Any]]:
    """Functions dynamo gave up on as a whole (no graph break recorded): they run uncompiled."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in compiles:
        if c["failure"]:
            seen.setdefault((c["function"], c["location"], c["failure"]),
                            {"function": c["function"], "location": c["location"], "reason": c["failure"]})
    return list(seen.values())[:limit]


def graph_breaks() -> list[dict[str, Any]]:
    """Distinct graph-break sites from dynamo's records, each with a short label, a user location and a hint."""
    # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it
    from torch._dynamo.utils import graph_break_reasons

    sites: dict[tuple[str, str], dict[str, Any]] = {}
    for r in graph_break_reasons:
        label = reason_label(r.reason)
        frame = user_frame(r.user_stack)
        location = source_location(frame.filename, frame.lineno) if frame else "unknown"
        site = sites.setdefault((label, location), {
            "reason": label, "location": location, "code": frame.line.strip() if frame and frame.line else "",
            "hint": reason_hint(r.reason, label), "count": 0,
        })
        site["count"] += 1
    return list(sites.values())


def reason_label(reason: str) -> str:
    line = first_line(reason)
    if line.startswith("generic_jump"):  # dynamo's internal name for a Python branch on a tensor's value
        return "Data-dependent branching"
    return line


def reason_hint(reason: str, label: str) -> str:
    if label == "Data-dependent branching":
        return "make the branch tensor-valued (torch.where) or use torch.cond"
    for line in reason.splitlines():
        if line.strip().startswith("Hint:"):
            return line.strip()[len("Hint:"):].strip().rstrip(".")
    return "move the unsupported call out of the compiled module"


def user_frame(stack: list[Any]) -> Any:
    """The innermost frame outside torch and the standard library: where the user can change something."""
    def stdlib(filename: str) -> bool:
        return filename.startswith(_STDLIB_DIR) and "-packages" not in filename

    for frame in reversed(stack):
        if not (frame.filename.startswith(_TORCH_DIR) or stdlib(frame.filename)):
            return frame
    for frame in reversed(stack):  # all inside torch: name torch's line, not contextlib's
        if not stdlib(frame.filename):
            return frame
    return stack[-1] if stack else None


def source_location(filename: str, lineno: int | None) -> str:
    path = Path(filename).resolve()
    with contextlib.suppress(ValueError):
        path = path.relative_to(Path.cwd())
    return f"{path}:{lineno}"


def function_name(co_name: str | None) -> str:
    """dynamo names the code after a graph break `torch_dynamo_resume_in_<fn>_at_<line>`: say it plainly."""
    match = re.fullmatch(r"torch_dynamo_resume_in_(.+)_at_(\d+)", co_name or "")
    return f"{match[1]} (resumed after line {match[2]})" if match else co_name or "?"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def recompile_limit() -> int:
    from torch._dynamo import config  # lazy: torch._dynamo costs ~0.4 s at start; only compiled runs need it

    return int(config.recompile_limit)
