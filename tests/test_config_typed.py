"""Past `check_config` the run reads its config through the schema's types: no string-keyed read of a config
section outside trainflow.config (which types the composed config and settles a section's keys)."""

from __future__ import annotations

import ast
from dataclasses import fields

from helpers.runs import ROOT

from trainflow.config.schema import LadderRunConfig

SOURCES = [ROOT / "src" / "trainflow", ROOT / "src" / "hydra_plugins"]
CONFIG_PACKAGE = ROOT / "src" / "trainflow" / "config"
# what a config is read from: the run's config, and each of its sections (cfg.data, ctx.cfg.optim, self.cfg)
CONFIG_NAMES = {"cfg", *(f.name for f in fields(LadderRunConfig))}
READS = ("get", "pop", "setdefault")
# reads of received files that name their dict like the config (module, the read, why it is no config read)
RECEIVED = (("export.py", 'cfg.get("checkpoint")', "an earlier run's config.yaml, read as data"),
            ("runs.py", 'cfg.get("', "a run folder's summary.json: the config it recorded"),
            ("compare.py", '.profiler.get("top_ops")', "a summary.json's profiler figures"))


def _config_object(node: ast.expr) -> bool:
    """`cfg`, `<anything>.cfg` or `<anything>.<section>` (cfg.data, ctx.cfg.task): the typed config or a section."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in CONFIG_NAMES and (isinstance(node, ast.Attribute) or name == "cfg")


def _text(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def string_keyed_reads(source: str) -> list[int]:
    """The lines of `source` that read a config object by a string key: cfg.data["pin_memory"],
    cfg.task.get("_target_"), "vocab_size" in cfg.model."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if _read_by_string(node)})


def _read_by_string(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):  # cfg.data["pin_memory"]
        return _config_object(node.value) and _text(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # cfg.task.get("_target_")
        return node.func.attr in READS and _config_object(node.func.value) and bool(node.args) and _text(node.args[0])
    if isinstance(node, ast.Compare):  # "vocab_size" in cfg.model
        return _text(node.left) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
            and any(_config_object(c) for c in node.comparators)
    return False


def test_the_check_finds_each_form_of_a_string_keyed_read_and_no_read_of_other_data() -> None:
    """The forms the run's code had before its sections were typed, and reads of what is not the run's config."""
    found = string_keyed_reads('pin = cfg.data["pin_memory"] is not False\n'
                               'lm = "vocab_size" in cfg.model\n'
                               'seq_lens = ctx.cfg.data.get("seq_lens")\n'
                               'target = self.cfg.model["_target_"]\n'
                               'lr = float(cfg.optim["lr"])\n'
                               'section = cfg["model"]\n')
    assert found == [1, 2, 3, 4, 5, 6]
    assert string_keyed_reads('task, validation = summary["task"], summary.get("validation") or {}\n'
                              'check = (self.by_rung["compile"].summary.get("compile") or {}).get("check")\n'
                              'precision = run.config.get("trainer")\n'
                              'data["trainflow_rank"] = 1\n'
                              'lr = optimizer.param_groups[0]["lr"]\n'
                              'pin = cfg.data.pin_memory is not False\n') == []


def test_no_string_keyed_read_of_the_config_outside_the_config_package() -> None:
    """cfg.data["pin_memory"], "vocab_size" in cfg.model and the like read a key the schema types, by a string no
    checker sees: each is an attribute of the section's type instead (a user's keys: the section's `kwargs`)."""
    found = []
    for path in sorted(p for folder in SOURCES for p in folder.rglob("*.py") if not p.is_relative_to(CONFIG_PACKAGE)):
        text = path.read_text().splitlines()
        found += [f"{path.relative_to(ROOT)}:{line}: {text[line - 1].strip()}"
                  for line in string_keyed_reads("\n".join(text))
                  if not any(path.name == name and read in text[line - 1] for name, read, _ in RECEIVED)]
    assert found == []
