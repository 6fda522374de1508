"""README's "Reliability" tables are rendered from the test tables, so they cannot drift from what is tested.

After changing a table: `python tests/test_reliability_readme.py` rewrites the section.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_bad_inputs import CASES, markdown_rows  # noqa: E402
from test_faults import FAULTS  # noqa: E402

README = TESTS.parent / "README.md"
BEGIN, END = "<!-- reliability table: begin (rendered by tests/test_reliability_readme.py) -->", \
    "<!-- reliability table: end -->"


def rendered() -> str:
    faults = ["| fault | what trainflow does | test |", "|---|---|---|"]
    faults += [f"| {f.fault} | {f.outcome} | `tests/{f.test}` |" for f in FAULTS]
    return "\n".join([
        BEGIN,
        f"{len(CASES)} bad inputs, each run as a real process by `tests/test_bad_inputs.py` (`<dir>` is a test "
        "folder, `<ckpts>` a checkpoint folder holding two committed checkpoints that must stay byte-identical):",
        "", *markdown_rows(), "",
        f"{len(FAULTS)} faults injected into real runs:", "", *faults, END,
    ])


def section(text: str) -> str:
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    assert match, f"README.md has no {BEGIN!r} ... {END!r} section"
    return match.group(0)


def test_readme_shows_the_tables_the_tests_run() -> None:
    assert section(README.read_text()) == rendered(), "run `python tests/test_reliability_readme.py` to update"


def test_every_fault_names_a_test_that_exists() -> None:
    for fault in FAULTS:
        file, name = fault.test.split("::")
        function = name.split("[")[0]
        assert f"def {function}(" in (TESTS / file).read_text(), fault.test
        if "[" in name:
            assert name.split("[")[1].rstrip("]") in {c.id for c in CASES}, fault.test


if __name__ == "__main__":
    text = README.read_text()
    README.write_text(text.replace(section(text), rendered()))
    print(f"README.md: {len(CASES)} bad inputs, {len(FAULTS)} faults")
