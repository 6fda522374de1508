"""The model, data and task sections of a composed run: a built-in option's keys, or the user's callable's.

Options such as model=gpt_tiny or data=text bring their schema's keys; model=custom, data=custom and task=custom
bring only `_target_` and the keys the user adds. The built-in options' schemas are open (trainflow.config.schema), so a
user's `_target_` or key set on one composes instead of stopping in Hydra's composer, and is settled here, once,
before the values are checked:

- a `_target_` other than the option's own keeps the option's keys it takes (named in its signature, or every key
  when it extends the option's own class, as a GPT subclass does) and those typed on the command line; the others
  are dropped, and one line says which (`python train.py model._target_=torchvision.models.resnet18
  model.num_classes=10` trains a ResNet, not a ResNet given gpt_tiny's vocab_size);
- with the option's own `_target_`, a key the schema does not have is a misspelling: one line names it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainflow.config.schema import LOADER_KEYS, SCHEDULE_KEYS, TaskConfig
from trainflow.config.targets import WHAT, import_target
from trainflow.errors import ConfigError

log = logging.getLogger(__name__)

# Keys trainflow reads itself whatever the _target_ (the loaders', the task's): never dropped.
OWN_KEYS = {"model": frozenset(), "data": frozenset(LOADER_KEYS), "task": frozenset(TaskConfig.__dataclass_fields__),
            "optim": frozenset({*SCHEDULE_KEYS, "lr", "weight_decay"})}  # per parameter group: trainflow sets them


def settle_sections(cfg: DictConfig) -> None:
    """Settle model, data and task as the module docstring says (in place: the run saves and uses the result)."""
    given = command_line_keys()
    for group in ("model", "data", "task", "optim"):
        section = cfg[group]
        if OmegaConf.is_missing(section, "_target_"):
            raise ConfigError(f"{group}._target_: missing: {group}={_option(group, 'custom')} calls your own code; "
                              f"set {group}._target_ to the import path of {WHAT[group]}")
        schema = OmegaConf.get_type(section)
        if not dataclasses.is_dataclass(schema):
            continue  # an open section: model=custom, a user's own option file, a config loaded back from YAML
        fields = schema.__dataclass_fields__
        own = fields["_target_"].default if "_target_" in fields else None  # data=text and synthetic have none
        target = section.get("_target_")
        if target == own:
            _refuse_unknown_keys(group, section, fields)
        else:
            _keep_what_the_target_takes(cfg, group, str(target), own, fields, given)


def _refuse_unknown_keys(group: str, section: DictConfig, fields: dict[str, Any]) -> None:
    unknown = [k for k in section if k not in fields]
    if unknown:
        known = ", ".join(k for k in fields if k != "_target_")
        raise ConfigError(f"{group}.{unknown[0]}: {group}={_option(group)} has no such key (it has {known}); fix "
                          f"the name, or for your own code use {group}=custom {group}._target_=<import path> "
                          f"{group}.{unknown[0]}=<value>")


def _keep_what_the_target_takes(cfg: DictConfig, group: str, target: str, own: str | None, fields: dict[str, Any],
                                given: set[str]) -> None:
    """Drop the option's keys that `target` does not take (and the user did not type)."""
    taken = _taken_keys(import_target(f"{group}._target_", target, WHAT[group]), own)
    if taken is None:
        return
    option_keys = [k for k in fields if k != "_target_" and k not in OWN_KEYS[group]]
    dropped = [k for k in option_keys if k in cfg[group] and k not in taken and f"{group}.{k}" not in given]
    if not dropped:
        return
    kept = {k: v for k, v in OmegaConf.to_container(cfg[group], resolve=False).items() if k not in dropped}
    cfg[group] = OmegaConf.create(kept)
    log.warning("%s._target_: %s does not take %s=%s's %s: dropped (%s=custom starts without them)",
                group, target, group, _option(group), ", ".join(dropped), group)


def _taken_keys(obj: Any, own: str | None) -> set[str] | None:
    """The keyword arguments `obj` names in its signature; None (all keys) when it extends the option's own class
    (its **kwargs are that class's arguments) or has no signature to read."""
    if own and inspect.isclass(obj):
        base = import_target("_target_", own, "a class")
        if inspect.isclass(base) and issubclass(obj, base):
            return None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in named}


def command_line_keys() -> set[str]:
    """The keys this run's command line sets (model.dropout from `model.dropout=0.1` or `+model.dropout=0.1`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: ${...} too
    return {str(o).lstrip("+~").split("=", 1)[0] for o in overrides}


def single_run() -> bool:
    """Whether this is one `python train.py` run (not a job of a -m sweep, whose typed keys are every job's)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN


def _option(group: str, default: str = "") -> str:
    """The option of `group` this run composed (gpt_tiny), as Hydra recorded it."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group) or default)
    return default or "<option>"
