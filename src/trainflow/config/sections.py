"""The model, data, task and optim sections: a `_target_` and the keys it is called with.

Options such as model=gpt_tiny or data=text bring their schema's keys; model=custom, data=custom, task=custom and
optim=custom bring only `_target_`, trainflow's own keys (the loader's, the task's, the schedule's) and the keys you
add. One rule decides what a section's `_target_` is called with, settled once, before any work, whichever way a key
got there (an option, an experiment file, the command line):

- the option's keys it takes are given to it; the option's keys it does not take are dropped, in one line
  (`model._target_=mypkg.Net` on model=gpt_tiny is not given gpt_tiny's vocab_size; model=custom starts without);
- every key you add is given to it, so one it does not take is refused, in one line naming the key and the closest
  it takes (on a built-in option with its own `_target_`: a key the option does not have).

A target takes the keys its signature names, or every key when it takes **kwargs or extends the option's own
class. trainflow's own keys are never given to it: the loader reads the data section's, the task its own, the
schedule the optim section's. Nothing here writes into the config: the settled sections are what the typed config
the run reads holds.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainflow.config.command_line import group_options
from trainflow.config.schema import CALLED_SECTIONS, OWN_KEYS
from trainflow.errors import ConfigError, UnknownKeyError
from trainflow.util.targets import WHAT, import_target

log = logging.getLogger(__name__)


def check_targets_given(cfg: DictConfig) -> None:
    """Every section names its `_target_` (a built-in task needs none): model=custom and the like say to set it
    (before anything is resolved, which would only say that a mandatory value is missing); an option of one's own
    that names none says which options there are (Hydra's repository: the project's own folder's too)."""
    for group in CALLED_SECTIONS:
        if OmegaConf.is_missing(cfg[group], "_target_"):
            raise ConfigError(f"{group}._target_: missing: {group}={_option(group, 'custom')} calls your own code; "
                              f"set {group}._target_ to the import path of {WHAT[group]}")
        if group != "task" and "_target_" not in cfg[group]:
            raise ConfigError(f"{group}._target_: missing: pick one of {group}={','.join(group_options(group))}, "
                              f"or set {group}._target_ to the import path of {WHAT[group]}")


def settled_sections(cfg: DictConfig, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The model, data, task and optim sections as their `_target_` is called (the module docstring's rule): from
    the composed `cfg` (which option each section comes from) and its resolved `values`."""
    settled = {}
    for group in CALLED_SECTIONS:
        schema = OmegaConf.get_type(cfg[group])
        option = schema.__dataclass_fields__ if dataclasses.is_dataclass(schema) else {}
        settled[group] = _settle(group, dict(values[group]), option)
    return settled


def _settle(group: str, section: dict[str, Any], option: dict[str, Any]) -> dict[str, Any]:
    own_target = option["_target_"].default if "_target_" in option else None  # data=text and synthetic have none
    target = section.get("_target_")
    yours = [k for k in section if k != "_target_" and k not in option and k not in OWN_KEYS[group]]
    if target == own_target:  # the option's own code: it takes the option's keys, and no other
        if yours:
            known = ", ".join(k for k in option if k != "_target_")
            raise UnknownKeyError(f"{group}.{yours[0]}: {group}={_option(group)} has no such key (it has {known}); fix "
                              f"the name, or for your own code use {group}=custom {group}._target_=<import path> "
                              f"{group}.{yours[0]}=<value>")
        return section
    taken = _taken_keys(import_target(f"{group}._target_", str(target), WHAT[group]), own_target)
    if taken is None:
        return section
    for key in yours:
        if key not in taken:
            close = difflib.get_close_matches(key, sorted(taken), n=1)
            hint = f"did you mean {group}.{close[0]}? " if close else ""
            raise UnknownKeyError(f"{group}.{key}: {target} takes no such argument; {hint}it takes "
                              f"{', '.join(sorted(taken)) or 'none'}")
    dropped = [k for k in option if k in section and k != "_target_" and k not in OWN_KEYS[group] and k not in taken]
    if dropped:
        log.warning("%s._target_: %s does not take %s=%s's %s: dropped (%s=custom starts without them)",
                    group, target, group, _option(group), ", ".join(dropped), group)
    return {k: v for k, v in section.items() if k not in dropped}


def _taken_keys(obj: Any, own: str | None) -> set[str] | None:
    """The keyword arguments `obj` names in its signature; None (all keys) when it takes **kwargs, extends the
    option's own class (its **kwargs are that class's arguments) or has no signature to read."""
    if own and inspect.isclass(obj):
        base = import_target("_target_", own, "a class")
        if inspect.isclass(base) and issubclass(obj, base):
            return None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in named}


def _option(group: str, default: str = "") -> str:
    """The option of `group` this run composed (gpt_tiny), as Hydra recorded it."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group) or default)
    return default or "<option>"
