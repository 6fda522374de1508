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
from trainflow.config.choices import Auto, FSDPWrap, LadderRung, Strategy
from trainflow.errors import ConfigError

# The group options typed by their own schema (model and data kinds); the others by RunConfig's section.
KIND_SCHEMAS = {"model/mlp": config.MLPConfig, "model/cnn": config.CNNConfig, "data/text": config.TextDataConfig,
                "data/synthetic": config.SyntheticDataConfig, "data/digits": config.DigitsDataConfig,
                "data/hf": config.HFDataConfig, "data/shards": config.ShardsDataConfig,
                "optim/adamw": config.AdamWConfig, "optim/sgd": config.SGDConfig}
SECTIONS = {f.name: f.default_factory for f in fields(config.RunConfig) if callable(f.default_factory)}
SECTIONS["task"] = config.BuiltinTaskConfig  # the built-in tasks' schema (task=custom: trainflow's keys only)
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


OPEN_SECTIONS = {"model": {"_target_": "trainflow.models.mlp.MLP", "hidden": 8}, "data": {"_target_": "mine.data"},
                 "task": {"monitor": "loss"}, "optim": {"_target_": "torch.optim.SGD", "lr": 0.1}, "logger": {},
                 "stages": {}}


def test_the_run_config_is_typed_once_from_plain_values() -> None:
    """The boundary (what validation returns, what a launched worker gets): trainflow's sections as their
    dataclasses, nested ones too, the schema's defaults filling what the values leave out, closed choices as their
    Enum members; the sections of your code as their section types (trainflow's keys typed, the keys your
    `_target_` is called with apart, in `kwargs`), written back as given; torchft's settings only in a run that uses
    it, the ladder's only in a ladder job."""
    run = config.typed_run({"trainer": {"max_steps": 7, "eval_every": 3},
                            "parallelism": {"strategy": "hsdp", "fsdp": {"wrap": "blocks"}, "hsdp": {"shard_size": 2}},
                            **OPEN_SECTIONS})
    assert type(run) is config.RunConfig and type(run.parallelism.fsdp) is config.FSDPConfig
    assert run.parallelism.strategy is Strategy.hsdp and run.parallelism.fsdp.wrap is FSDPWrap.blocks
    assert (run.parallelism.fsdp.min_params, run.parallelism.hsdp.shard_size, run.parallelism.timeout_s) == \
        (1_000_000, 2, 300.0)
    assert run.trainer.eval_interval() == 3 and run.trainer.batch_size == config.TrainerConfig.batch_size
    assert run.parallelism.watchdog.enabled is Auto.auto and run.parallelism.ft is None
    assert config.plain(run)["model"] == OPEN_SECTIONS["model"] and not hasattr(run, "ladder")
    assert type(run.model) is config.ModelSection and run.model.kwargs == {"hidden": 8}
    assert (run.optim._target_, run.optim.lr, run.optim.kwargs) == ("torch.optim.SGD", 0.1, {})
    assert (run.data._target_, run.data.num_workers, run.data.kwargs) == ("mine.data", 0, {})
    with_ft = config.typed_run({"parallelism": {"fault_tolerance": "torchft", "ft": {"replica_id": 1}},
                                "ladder": {"rung": "ddp"}, **OPEN_SECTIONS})
    assert type(with_ft) is config.LadderRunConfig and with_ft.ladder.rung is LadderRung.ddp
    assert (with_ft.parallelism.ft.replica_id, with_ft.parallelism.ft.replica_groups) == (1, 2)
    assert config.plain(with_ft)["parallelism"]["fault_tolerance"] == "torchft"  # config.yaml's words


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallelism.strategy=zero3"], "parallelism.strategy: must be one of single, ddp, fsdp, hsdp, auto; got 'zero3'"),
    (["parallelism=fsdp", "parallelism.fsdp.param_dtype=int8"],
     "parallelism.fsdp.param_dtype: must be one of fp32, bf16, fp16, or null; got 'int8'"),
    (["checkpoint=dcp", "checkpoint.mode=later"], "checkpoint.mode: must be one of sync, async; got 'later'"),
    (["compile.mode=fastest"], "compile.mode: must be one of default, max-autotune, max-autotune-no-cudagraphs, "
     "reduce-overhead, or null; got 'fastest'"),
    (["compile.scope=layers"], "compile.scope: must be one of model, blocks, or null; got 'layers'"),
    (["parallelism.watchdog.enabled=sometimes"], "parallelism.watchdog.enabled: must be auto, true or false; got "
     "'sometimes'"),
    (["task.mode=maximum"], "task.mode: must be one of min, max; got 'maximum'"),
    (["task=custom", "task.mode=maximum"], "task.mode: must be one of min, max; got 'maximum'"),  # your task too
])
def test_a_choice_outside_its_type_is_refused_while_hydra_composes(overrides: list[str], message: str) -> None:
    """One mechanism for every closed choice: the type refuses the value as Hydra composes, and the hint (what
    the key takes) is read from the type."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from trainflow.config.command_line import explain

    with initialize_config_dir(str(CONF), version_base="1.3"), pytest.raises(ConfigCompositionException) as err:
        compose("train", overrides=overrides)
    assert explain(err.value, overrides) == message


@pytest.mark.parametrize(("values", "message"), [
    ({"trainer": {"max_stepz": 1}}, "trainer.max_stepz: trainer has no such key; did you mean trainer.max_steps?"),
    ({"trainer": {"precision": "fp16"}}, "trainer.precision: must be one of fp32, bf16, fp8; got 'fp16'"),
    ({"trainer": {"eval_every": "often"}}, "trainer.eval_every: must be auto or an integer; got 'often'"),
    ({"checkpoint": {"stop_signals": ["SIGKILL"]}}, "checkpoint.stop_signals[0]: SIGKILL cannot be caught, so "
     "nothing can be saved on it; must be one of SIGTERM, SIGUSR1, SIGUSR2, SIGHUP; got 'SIGKILL'"),
])
def test_a_value_the_schema_refuses_is_one_line(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.typed_run({**values, **OPEN_SECTIONS})
    assert str(err.value) == message
