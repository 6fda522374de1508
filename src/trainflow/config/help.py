"""`python train.py --help` (and `trainflow train --help`): every config group with one line per option, taken from the
option's own YAML (its first comment sentence) in trainflow's configs and a project's own (--config-dir), so the help
lists exactly the options that exist. It reads files only (no torch, no composition), so it answers at once."""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import hydra_plugins.trainflow_launchers  # noqa: F401 (registers the torchrun and slurm launchers' configs)
from trainflow.conf import CONFIG_DIR
from trainflow.errors import typed_command

SHOWN_HYDRA_GROUPS = ("hydra/launcher",)  # trainflow's launchers; Hydra's own groups are in --hydra-help
GROUP_WIDTH, OPTION_WIDTH = 15, 16


def option_files(folders: list[Path]) -> dict[str, dict[str, Path | None]]:
    """Each group's options, by group path, and the YAML each comes from (the first folder holding it); the
    launchers registered in code (no YAML) too."""
    groups: dict[str, dict[str, Path | None]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            group = path.parent.relative_to(folder).as_posix()
            if group != "." and (not group.startswith("hydra") or group in SHOWN_HYDRA_GROUPS):
                groups.setdefault(group, {}).setdefault(path.stem, path)
    for group in SHOWN_HYDRA_GROUPS:
        for name in ConfigStore.instance().list(group):
            groups.setdefault(group, {}).setdefault(Path(name).stem, None)
    return {group: dict(sorted(options.items())) for group, options in sorted(groups.items())}


def describe(group: str, option: str, path: Path | None) -> str:
    """The option's first comment sentence (Hydra's `@package` line left out); for an option registered in code,
    its schema's docstring."""
    if path is None:
        stored = ConfigStore.instance().load(f"{group}/{option}.yaml")
        return _first_sentence(" ".join((inspect.getdoc(OmegaConf.get_type(stored.node)) or "").split()))
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            if lines:
                break
            continue
        words = line.lstrip("#").strip()
        if not words.startswith("@package"):
            lines.append(words)
    return _first_sentence(" ".join(lines))


def _first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence (a '. ' outside brackets)."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0 and char == "." and text[i + 1:i + 2] in (" ", ""):
            return text[:i + 1]
    return text


def help_requested(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def print_help(argv: list[str]) -> None:
    """The help of `python train.py argv`: usage, then the groups of trainflow and of argv's --config-dir, with the
    options train.yaml picks by default (or argv gives) marked *."""
    given_dir = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config-dir", "-cd")), None)
    folders = [Path(given_dir).expanduser(), CONFIG_DIR] if given_dir else [CONFIG_DIR]
    chosen = _defaults(CONFIG_DIR / "train.yaml") | _given(argv)
    width = shutil.get_terminal_size((120, 24)).columns
    rows = []
    for group, options in option_files(folders).items():
        for i, (option, path) in enumerate(options.items()):
            mark = "*" if option in chosen.get(group, []) else " "
            head = f"{group if i == 0 else '':<{GROUP_WIDTH}}{mark}{option:<{OPTION_WIDTH}} "
            about = describe(group, option, path)
            room = max(width - len(head), 20)
            rows.append(head + (about if len(about) <= room else about[:room - 1] + "…"))
    try:
        print(USAGE.format(command=typed_command(), groups="\n".join(rows)), flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a complaint at exit


def _defaults(train_yaml: Path) -> dict[str, list[str]]:
    """The options train.yaml's defaults list gives each group (a list for a group that takes several)."""
    entries = OmegaConf.to_container(OmegaConf.load(train_yaml)).get("defaults", [])
    return {k: [str(o) for o in (v if isinstance(v, list) else [v])]
            for entry in entries if isinstance(entry, dict) for k, v in entry.items()}


def _given(argv: list[str]) -> dict[str, list[str]]:
    """The options argv picks: `group=option`, `group=[a,b]`."""
    return {key.lstrip("+"): [o.strip() for o in value.strip("[]").split(",")]
            for key, _, value in (a.partition("=") for a in argv if "=" in a)}


USAGE = """trainflow: train a model, every stage measured: baseline -> compile -> profile -> scale -> checkpoint.

  {command} [group=option ...] [key=value ...]
  {command} -m key=a,b [...]                 a sweep: one job per value, then a report
  {command} --cfg job [overrides]            the composed config: every key and its value
  {command} --config-dir DIR [overrides]     your own groups and experiments, from DIR

Groups: group=option (* the default, or the option given)
{groups}

Keys: any key of the composed config (--cfg job lists them), e.g. trainer.max_steps=200 trainer.batch_size=32
optim.lr=3e-4 parallelism.nproc_per_node=4 checkpoint.every_steps=50. Hydra's own options: --hydra-help."""
