"""One source of truth for defaults: the schemas in trainflow.config.schema hold them, a conf/ option lists only what it
changes (a value repeated in YAML could drift from the schema's unnoticed, and hides what the option is about)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from helpers.runs import ROOT
from omegaconf import OmegaConf

from trainflow.conf import CONFIG_DIR as CONF
from trainflow.config import schema as config

# The group options typed by their own schema (model and data kinds); the others by RunConfig's section.
KIND_SCHEMAS = {"model/mlp": config.MLPConfig, "model/cnn": config.CNNConfig, "data/text": config.TextDataConfig,
                "data/synthetic": config.SyntheticDataConfig, "data/digits": config.DigitsDataConfig,
                "data/hf": config.HFDataConfig, "data/shards": config.ShardsDataConfig,
                "optim/adamw": config.AdamWConfig, "optim/sgd": config.SGDConfig}
SECTIONS = {f.name: f.default_factory for f in fields(config.RunConfig) if callable(f.default_factory)}
SECTIONS["task"] = config.TaskConfig  # the built-in tasks' schema (a user's task._target_ has none)
OPTIONS = sorted(p for group in ("checkpoint", "compile", "data", "logger", "model", "optim", "parallelism",
                                 "profiler", "task", "tokenizer") for p in (CONF / group).glob("*.yaml"))


def schema_of(option: Path) -> Any:
    name = f"{option.parent.name}/{option.stem}"
    if option.stem == "custom":
        return {}  # model=custom, data=custom, task=custom, optim=custom: open sections, no defaults but the user's
    if option.parent.name == "logger":  # each logger's keys under logger.<name>, typed by its own schema
        return {option.stem: config.LOGGER_SCHEMAS[option.stem]} if option.stem in config.LOGGER_SCHEMAS else {}
    if option.parent.name == "model" and option.stem.startswith("gpt"):
        return config.GPTConfig
    return KIND_SCHEMAS.get(name) or SECTIONS[option.parent.name]


def repeated_defaults(values: dict, defaults: dict, prefix: str = "") -> list[str]:
    """The keys of `values` that hold exactly the schema's default (nested sections included)."""
    found = []
    for key, value in values.items():
        if key == "defaults" or key not in defaults:
            continue
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            found += repeated_defaults(value, defaults[key], f"{prefix}{key}.")
        elif value == defaults[key]:
            found.append(f"{prefix}{key}: {value!r}")
    return found


@pytest.mark.parametrize("option", OPTIONS, ids=[f"{p.parent.name}/{p.stem}" for p in OPTIONS])
def test_group_option_lists_only_what_it_changes(option: Path) -> None:
    values = OmegaConf.to_container(OmegaConf.load(option) or OmegaConf.create()) or {}
    defaults = OmegaConf.to_container(OmegaConf.create(schema_of(option)))
    assert repeated_defaults(values, defaults) == [], f"{option.relative_to(ROOT)} repeats its schema's defaults"


def test_train_yaml_leaves_the_trainer_defaults_to_the_schema() -> None:
    assert "trainer" not in OmegaConf.load(CONF / "train.yaml")


def test_typed_builds_the_schema_from_untyped_sections_with_defaults_and_interpolations() -> None:
    """What a launched worker holds (plain YAML) becomes the schema's dataclass, nested sections too; the schema
    fills what the section leaves out, and interpolations resolve against the whole config."""
    cfg = OmegaConf.create({"trainer": {"max_steps": 7, "eval_every": 3},
                            "parallelism": {"strategy": "hsdp", "check_steps": "${trainer.max_steps}",
                                            "fsdp": {"wrap": "blocks"}, "hsdp": {"shard_size": 2}}})
    parallelism = config.typed(cfg.parallelism, config.ParallelismConfig)
    assert type(parallelism) is config.ParallelismConfig and type(parallelism.fsdp) is config.FSDPConfig
    assert (parallelism.strategy, parallelism.check_steps, parallelism.fsdp.wrap) == ("hsdp", 7, "blocks")
    assert (parallelism.fsdp.min_params, parallelism.hsdp.shard_size, parallelism.timeout_s) == (1_000_000, 2, 300.0)
    trainer = config.typed(cfg.trainer, config.TrainerConfig)
    assert trainer.eval_interval() == 3 and trainer.batch_size == config.TrainerConfig.batch_size
    assert config.typed(config.ProfilerConfig(ranks="all"), config.ProfilerConfig).ranks == "all"  # typed already
    with pytest.raises(Exception, match="max_stepz"):  # a key the schema lacks is not silently dropped
        config.typed({"max_stepz": 1}, config.TrainerConfig)
