"""A user's callable named by `_target_`: imported, called with its section's own keys, its failures one line.

The model, the data factory, the task and the collate all come from a section with a `_target_`; this module is
the one place that imports it, calls it and says what went wrong (the key, the call as written, the fix).

Hydra's `instantiate` calls what it imports, so a function given as a task or a collate would run once at
build time instead of once per batch. `bound_callable` instantiates a class with the keys and binds a function to
them (functools.partial), so both forms of "a callable taking a batch" work from the same YAML.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainflow.errors import ConfigError, TrainflowError

# What the `_target_` of each section must name, as the one-line errors say it.
WHAT = {"model": "an nn.Module class, e.g. mypackage.models.MyNet",
        "data": "a function or class returning (train, val) datasets",
        "task": "a callable of (model, batch) returning (loss, metrics)",
        "optim": "a torch.optim.Optimizer class, e.g. torch.optim.AdamW or mypackage.MyOptimizer"}
OPTIMIZER = WHAT["optim"]


# The folder a command that builds your code ran in (trainflow train, export, prepare): set once by the command,
# inherited by every process it launches (trainflow's workers, torchrun's, SLURM's), which import from it too.
USER_FOLDER_ENV = "TRAINFLOW_USER_FOLDER"
# Whose `_target_` the header does not name a file for: trainflow's own options and torch's optimizers.
_NOT_YOURS = ("trainflow", "torch")


def user_folder_importable() -> None:
    """Your folder on the import path, as `python -m` and `python train.py` put theirs: a `_target_` such as
    mymodels.TinyNet imports from mymodels.py in the folder the command runs in. It goes after the installed
    packages, so that a file of the folder named like one of them (torch.py) does not replace it."""
    folder = os.environ.setdefault(USER_FOLDER_ENV, os.getcwd())
    if folder not in sys.path:
        sys.path.append(folder)


def origin(target: str) -> str | None:
    """`target` and the file its module was imported from, as the start header says it (`mymodels.TinyNet from
    ./mymodels.py`); None for trainflow's and torch's own, or before the target was imported."""
    parts = str(target).split(".")
    if parts[0] in _NOT_YOURS:
        return None
    for end in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, "__file__", None):
            path = Path(module.__file__).resolve()
            with_cwd = Path.cwd().resolve()
            shown = f"./{path.relative_to(with_cwd)}" if path.is_relative_to(with_cwd) else str(path)
            return f"{target} from {shown}"
    return None


def origins(cfg: Any) -> dict[str, str]:
    """Per section of your code in the run's config (model, data, task), what its `_target_` imported and from
    where (`origin`)."""
    found = {name: origin(str(getattr(cfg, name)._target_ or "")) for name in ("model", "data", "task")}
    return {name: text for name, text in found.items() if text}


def import_target(key: str, target: str, what: str) -> Any:
    """The object at dotted path `target`; a one-line error naming `key` when it cannot be imported."""
    try:
        return _locate(target)
    except Exception as exc:  # ImportError, AttributeError, or an error inside the user's module
        detail = "" if isinstance(exc, ImportError | AttributeError) else f" ({type(exc).__name__}: {exc})"
        folder = os.environ.get(USER_FOLDER_ENV, os.getcwd())
        raise ConfigError(f"{key}: cannot import {target!r}{detail}; give the import path of {what} (a module of "
                          f"{folder}, the folder the command runs in, or of a folder on PYTHONPATH)") from None


def _locate(path: str) -> Any:
    """`package.module.Name` (or a nested attribute): the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:end]).startswith(exc.name):
                raise  # a module the target's own module imports is missing: say so, not "cannot find"
            continue
        for attribute in parts[end:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"no module of {path!r} can be imported")


def call_target(section: str, target: str, kwargs: Mapping[str, Any], what: str) -> Any:
    """`target(**kwargs)`: imported as `what`, called once. A call that raises is one line naming `section`, the call
    as written and its error; a trainflow error raised inside (a missing extra, a misspelt key) is its own line."""
    return call(section, target, import_target(f"{section}._target_", target, what), kwargs)


def call(section: str, target: str, obj: Callable, kwargs: Mapping[str, Any]) -> Any:
    """`obj(**kwargs)` with the failure of `call_target` (for a callable already imported)."""
    try:
        return obj(**kwargs)
    except TrainflowError:
        raise
    except Exception as exc:
        raise ConfigError(f"{section}: {target}({arguments(kwargs)}) failed: {type(exc).__name__}: "
                          f"{first_line(exc)}; fix the {section}.* values") from exc


def bound_callable(section: str, target: str, kwargs: Mapping[str, Any], what: str) -> Callable:
    """A class instantiated with `kwargs`, or a function with `kwargs` bound: either way, call it per batch."""
    obj = import_target(f"{section}._target_", target, what)
    if inspect.isclass(obj):
        obj = call(section, target, obj, kwargs)
    elif kwargs:
        obj = functools.partial(obj, **kwargs)
    if not callable(obj):
        raise ConfigError(f"{section}._target_: {target} is a {type(obj).__name__}, not a callable; give {what}")
    return obj


def arguments(kwargs: Mapping[str, Any]) -> str:
    """The keyword arguments of a call as the user wrote them in YAML: k=v, ..."""
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
