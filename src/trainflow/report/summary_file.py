"""summary.json's format: the number each run writes, and any earlier format read under today's names.

Format 1 carried no number. Format 2 renamed `trainer.warmup_steps` to `trainer.excluded_steps` (warm-up is the
learning rate's) and the compile report's `warmup_step_times_s` to `excluded_step_times_s`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = 2
# (format that introduced the names, section path, old key, new key)
_RENAMES = ((2, ("config", "trainer"), "warmup_steps", "excluded_steps"),
            (2, ("compile",), "warmup_step_times_s", "excluded_step_times_s"))


def read_summary(path: Path) -> Any:
    """A run's summary.json under today's names (json's own errors and OSError pass through to the caller)."""
    return upgraded(json.loads(path.read_text()))


def upgraded(summary: Any) -> Any:
    """`summary` with the keys earlier formats named otherwise renamed, and today's format number."""
    if not isinstance(summary, dict) or summary.get("format", 1) >= FORMAT:
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
