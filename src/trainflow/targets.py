"""A user's callable named by `_target_`: imported, and bound to the section's own keys.

Hydra's `instantiate` calls what it imports, so a function given as a task or a collate would run once at
build time instead of once per batch. Here a class is instantiated with the keys and a function is bound to
them (functools.partial), so both forms of "a callable taking a batch" work from the same YAML.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object

from trainflow.errors import ConfigError


def import_target(key: str, target: str, what: str) -> Any:
    """The object at dotted path `target`; a one-line error naming `key` when it cannot be imported."""
    try:
        return get_object(target)
    except Exception as exc:  # ImportError, or Hydra's wrapper of it, or an error inside the user's module
        cause = exc.__cause__ or exc
        detail = "" if isinstance(cause, ImportError | AttributeError) else f" ({type(cause).__name__}: {cause})"
        raise ConfigError(f"{key}: cannot import {target!r}{detail}; give the import path of {what} (its folder on "
                          "PYTHONPATH)") from None


def bound_callable(key: str, target: str, kwargs: dict[str, Any], what: str) -> Callable:
    """A class instantiated with `kwargs`, or a function with `kwargs` bound: either way, call it per batch."""
    obj = import_target(key, target, what)
    if inspect.isclass(obj):
        try:
            obj = obj(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{key}: {target}({_arguments(kwargs)}) failed: {exc}; fix the keys next to "
                              f"{key}") from None
    elif kwargs:
        obj = functools.partial(obj, **kwargs)
    if not callable(obj):
        raise ConfigError(f"{key}: {target} is a {type(obj).__name__}, not a callable; give {what}")
    return obj


def _arguments(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
