"""The tables of docs/reliability.md are rendered from the test tables, so they cannot drift from what is tested.

After changing a table: `python tests/test_reliability_readme.py` rewrites them. README links to the page.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_bad_inputs import CASES, markdown_rows  # noqa: E402
from test_faults import FAULTS  # noqa: E402
from test_received_files import RECEIVED, Cited  # noqa: E402
from test_received_files import markdown_rows as received_rows  # noqa: E402

README = TESTS.parent / "README.md"
RELIABILITY = TESTS.parent / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability table: begin (rendered by tests/test_reliability_readme.py) -->", \
    "<!-- reliability table: end -->"


def _needs_cluster(file: str, name: str) -> bool:
    """Whether a test asks for the `cluster` fixture (which skips without SLURM), itself or through its fixtures."""
    functions = {n.name: n for n in ast.parse((TESTS / file).read_text()).body if isinstance(n, ast.FunctionDef)}
    assert name in functions, f"tests/{file} has no test {name}"

    def needs(function: ast.FunctionDef) -> bool:
        if "needs_cluster" in {ast.unparse(d) for d in function.decorator_list}:
            return True
        return any(a.arg == "cluster" or (a.arg in functions and needs(functions[a.arg])) for a in function.args.args)

    return needs(functions[name])


def why_not_by_default(test: str) -> str | None:
    """Why `make test` (the default suite) may not run a cited test here: marked slow, or skipped without something."""
    file, name = test.split("::")
    function, _, param = name.partition("[")
    source = (TESTS / file).read_text()
    if re.search(r"@pytest\.mark\.slow\n(@.*\n)*def " + function + r"\(", source):
        return "slow: `pytest -m slow`"
    if _needs_cluster(file, function):
        return "skipped without a SLURM cluster"
    if re.search(r"@pytest\.mark\.skipif\(not can_mount\(\).*\n(@.*\n)*def " + function + r"\(", source):
        return "skipped without mount rights"
    needs = {c.id: c.needs for c in CASES}.get(param.rstrip("]"))
    return {"mount": "skipped without mount rights", "no-gpu": "skipped where a GPU is visible"}.get(needs or "")


def cited(test: str) -> str:
    why = why_not_by_default(test)
    return f"`tests/{test}`" + (f" ({why})" if why else "")


def rendered() -> str:
    faults = ["| fault | what trainflow does | test |", "|---|---|---|"]
    faults += [f"| {f.fault} | {f.outcome} | {cited(f.test)} |" for f in FAULTS]
    return "\n".join([
        BEGIN,
        f"{len(CASES)} bad inputs, each run as a real process by `tests/test_bad_inputs.py` (`<dir>` is a test "
        "folder, `<ckpts>` a checkpoint folder holding two committed checkpoints that must stay byte-identical). "
        "The test asserts the exit code, one line that names the key or path shown and then says the words "
        "shown, in their order (… stands for the rest of the sentence), and that nothing new is left on disk: no "
        "run folder, lock or log, and a folder that was there as it was (a row whose error comes once training "
        "began, or that fills a cache the next run reuses, keeps those):",
        "", *markdown_rows(), "",
        f"{len(FAULTS)} faults injected into real runs:", "", *faults, "",
        f"{len(RECEIVED)} hostile files a user may receive (a colleague's run folder, a CI artifact, a shared outputs "
        "folder), each tried as a real `trainflow` process by `tests/test_received_files.py` (`<dir>` holds `a` and "
        "`b`, two copies of one finished run, and the row's change) or by the test the row names. A row asserts the "
        "exit code within 90 s (a hang fails it), no traceback, one line naming the file or option shown and then "
        "saying the words shown, no forged line and no terminal escape on the console or in the pages, nothing the "
        "files name run, and nothing written unless its pages are the point:", "", *received_rows(cited), END,
    ])


def section(text: str) -> str:
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.S)
    assert match, f"docs/reliability.md has no {BEGIN!r} ... {END!r} section"
    return match.group(0)


def test_reliability_page_shows_the_tables_the_tests_run() -> None:
    assert section(RELIABILITY.read_text()) == rendered(), "run `python tests/test_reliability_readme.py` to update"


def test_readme_links_to_the_reliability_page() -> None:
    assert "(docs/reliability.md)" in README.read_text()


def cited_tests() -> list[str]:
    """Every test a table cites: the faults' and the received inputs' tried in another file."""
    return [f.test for f in FAULTS] + [r.test for r in RECEIVED if isinstance(r, Cited)]


def test_every_cited_test_exists() -> None:
    """Each fault's and each cited received input's test is defined, and a row of a table it names is in it."""
    rows = {c.id for c in CASES} | {r.id for r in RECEIVED if not isinstance(r, Cited)}
    for test in cited_tests():
        file, name = test.split("::")
        function = name.split("[")[0]
        assert f"def {function}(" in (TESTS / file).read_text(), test
        if "[" in name:
            assert name.split("[")[1].rstrip("]") in rows, test


def test_every_cited_test_is_in_the_default_suite_or_says_slow() -> None:
    """Collected by a plain `pytest` (what `make test` runs) exactly when its row does not say "slow"."""
    files = sorted({f"tests/{test.split('::')[0]}" for test in cited_tests()})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.removeprefix("tests/") for line in proc.stdout.splitlines() if "::" in line}
    for test in cited_tests():
        slow = (why_not_by_default(test) or "").startswith("slow")
        runs = any(found == test or found.startswith(f"{test}[") for found in collected)  # or a param of it
        assert runs is not slow, (test, "slow" if slow else "not collected")
        assert ("(slow" in cited(test)) == slow


if __name__ == "__main__":
    text = RELIABILITY.read_text()
    RELIABILITY.write_text(text.replace(section(text), rendered()))
    print(f"docs/reliability.md: {len(CASES)} bad inputs, {len(FAULTS)} faults, {len(RECEIVED)} received inputs")
