"""The optional libraries (pyproject.toml's extras): imported when a choice needs them, and one line when one is
missing or broken, naming the key that needs it and the pip install that brings it."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from trainflow.errors import ConfigError


def require(module: str, extra: str, key: str) -> ModuleType:
    """`module`, for the config key (or command) `key`; the `extra` of trainflow that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:  # it is there, a need of it is not
            raise ConfigError(f"{key}: {module} is installed but cannot import {exc.name} ({exc}); reinstall it: "
                              f"pip install --force-reinstall 'trainflow[{extra}]'") from None
        raise ConfigError(f"{key}: needs the {module} library, which is not installed; run pip install "
                          f"'trainflow[{extra}]'") from None
    except Exception as exc:  # noqa: BLE001 (a library that raises while it imports: broken, whatever it raised)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"{key}: {module} is installed but fails to import ({type(exc).__name__}: {first}); "
                          f"reinstall it: pip install --force-reinstall 'trainflow[{extra}]'") from None


def import_hf(module: str, key: str) -> ModuleType:
    """A library of the `hf` extra, or one line naming the key that needs it and the pip install that brings it."""
    return require(module, "hf", key)


def torchft_installed() -> bool:
    """Whether torchft imports (its servers read RUST_LOG once, at import: quiet unless the user asks)."""
    os.environ.setdefault("RUST_LOG", "warn")  # they log every quorum and commit at info
    try:
        import torchft  # noqa: F401 (lazy: torchft is the ft extra)
    except ImportError:
        return False
    return True
