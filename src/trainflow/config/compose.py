"""The run config a command line composes, for the tools that read a run's settings without training
(`trainflow prepare`): the same groups `trainflow train` finds, a project's own folder added as --config-dir adds it."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from trainflow.errors import ConfigError


def compose_run(overrides: list[str], config_dir: Path | None = None) -> DictConfig:
    """`overrides` composed over trainflow's shipped groups and, first, those of `config_dir` (a project's own);
    the caller has registered trainflow's schemas (trainflow.cli.register_with_hydra)."""
    searchpath = []
    if config_dir is not None:
        if not config_dir.is_dir():
            raise ConfigError(f"--config-dir: {config_dir.resolve()} is not a folder; give the folder holding your "
                              "own config groups (experiment/, model/, ...), or leave --config-dir out")
        searchpath = [f"hydra.searchpath=[file://{config_dir.resolve()}]"]
    with initialize_config_module("trainflow.conf", version_base="1.3"):
        return compose("train", overrides=[*searchpath, *overrides])
