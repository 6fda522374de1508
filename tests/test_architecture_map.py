"""docs/architecture.md is the map of the code: its layout names every module of trainflow and of its Hydra
launchers, under the package that holds it, and names no module that is gone; the layers it draws are the ones
pyproject.toml's import contract enforces."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"


def _layout() -> str:
    """The layout block: from the `src/trainflow/` line to the end of the launchers' entry."""
    text = MAP.read_text()
    start = text.index("    src/trainflow/\n")
    return text[start:text.index("\n## ", start)]


def _modules() -> dict[str, list[Path]]:
    """Every module file (packages' __init__.py aside), by its package folder relative to src/."""
    found: dict[str, list[Path]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            found.setdefault(str(path.parent.relative_to(ROOT / "src")), []).append(path)
    return found


def _package_entries(layout: str) -> dict[str, str]:
    """Each package's entry in the layout (its line and the continuation lines under it), by its folder."""
    entries: dict[str, str] = {}
    current = None
    for line in layout.splitlines():
        head = re.match(r"    (?:  )?(\S+/)(?:\s|$)", line)
        if head and not line.startswith(" " * 34):
            folder = head.group(1).rstrip("/")
            current = folder if folder.startswith(("src/", "trainflow")) else f"trainflow/{folder}"
            current = current.removeprefix("src/")
            entries[current] = line
        elif current is not None and line.startswith(" " * 34):
            entries[current] += "\n" + line
        elif re.match(r"      \S+\.py", line):
            entries.setdefault("trainflow", "")
            entries["trainflow"] += "\n" + line
            current = None
    return entries


def test_the_layout_names_every_module_under_its_package() -> None:
    entries = _package_entries(_layout())
    missing = [str(path.relative_to(ROOT)) for package, paths in _modules().items() for path in paths
               if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", entries.get(package, ""))]
    assert not missing, f"docs/architecture.md's layout does not name these modules where they live: {missing}"


def test_the_layout_names_no_module_that_is_gone() -> None:
    named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", _layout()))
    existing = {path.name for paths in _modules().values() for path in paths} | {"__main__.py", "train.py"}
    assert named <= existing, f"docs/architecture.md names modules that do not exist: {sorted(named - existing)}"


def _contract_layers() -> list[str]:
    """The layers of pyproject.toml's import contract, top to bottom, as written there."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"\[\[tool\.importlinter\.contracts\]\].*?^layers = \[(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml holds no [[tool.importlinter.contracts]] with a layers list"
    return re.findall(r'"([^"]+)"', block.group(1))


def test_the_layers_drawn_are_the_contracts() -> None:
    text = MAP.read_text()
    drawn = text[text.index("Top to bottom:\n\n"):].split("\n\n")[1]
    assert [layer.strip() for layer in drawn.split(">")] == _contract_layers()
