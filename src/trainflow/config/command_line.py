"""A command line Hydra cannot compose, said in one line: the key, option, override or file at fault and the closest
valid name ("did you mean trainer.max_steps?"), never Hydra's report (a `+key` hint that leads to a traceback, the
config search path, a stack).

A key that `+` or `++` would add where no schema has it (`+optimizer.lr=1e-3`) is the same error as the key without
the `+`: RunStarts refuses it before any run directory exists, with the same exit code (errors.EXIT_COMMAND_LINE).

Hydra reports composition errors itself and exits, unless HYDRA_FULL_ERROR=1 makes it raise them. `raised_errors`
sets it while Hydra composes; the RunStarts callback takes it back as soon as a run or sweep starts, so that nothing
after composition (the task, a launcher's workers) sees it unless the user set it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

import yaml
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from trainflow.config.choices import refused_choice
from trainflow.config.schema import LadderConfig, LadderRunSchema, RunSchema
from trainflow.errors import UnknownKeyError, print_error, typed_command

FULL_ERROR = "HYDRA_FULL_ERROR"
_SET_BY_US = "TRAINFLOW_RAISED_HYDRA_ERRORS"  # marks a FULL_ERROR that raised_errors set, not the user
# The sections a `+key` may add to: the keys of your own code's `_target_` (trainflow.config.sections decides which
# it takes) and of your own loggers. Every other key comes from a schema.
OPEN_SECTIONS = ("model", "data", "task", "optim", "logger")


@contextlib.contextmanager
def raised_errors() -> Iterator[None]:
    """Hydra raises what it cannot compose inside this block (HYDRA_FULL_ERROR=1), unless the run starts first."""
    if os.environ.get(FULL_ERROR) == "1":  # the user wants Hydra's tracebacks
        yield
        return
    os.environ[FULL_ERROR] = os.environ[_SET_BY_US] = "1"
    try:
        yield
    finally:
        _take_back()


def _take_back() -> None:
    if os.environ.pop(_SET_BY_US, None):
        os.environ.pop(FULL_ERROR, None)


class RunStarts(Callback):
    """Composition is over: Hydra reports errors its own way again, and workers inherit no HYDRA_FULL_ERROR."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _take_back()
        _refuse_in_one_line(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _take_back()
        _refuse_in_one_line(config)


def _refuse_in_one_line(config: DictConfig) -> None:
    """One line and exit 1 for a key no schema has (Hydra turns a callback's exception into a warning and goes on,
    so this exits itself, before any run directory exists)."""
    try:
        refuse_unknown_keys(config)
    except UnknownKeyError as exc:
        print_error(str(exc))
        sys.exit(exc.exit_code)


def refuse_unknown_keys(config: DictConfig) -> None:
    """Before any run directory exists: a key that `+` or `++` adds where no schema has it (a new top-level section
    such as `+optimizer.lr`, a misspelt `+trainer.max_stpes`), in a run or a sweep, is refused in one line with the
    closest valid key, as Hydra refuses the same key without the `+`. The sections of your own code take new keys
    (OPEN_SECTIONS); `+group=option` is Hydra's to check."""
    typed_ladder = "ladder" in config and OmegaConf.get_type(config, "ladder") is LadderConfig
    schema = LadderRunSchema if typed_ladder else RunSchema
    overrides = [str(o) for o in OmegaConf.to_container(config.hydra.overrides.task, resolve=False)]
    groups = set(_loader().list_groups(""))
    for given in overrides:
        key = given.lstrip("+").split("=")[0]
        if not given.startswith("+") or "/" in key or "@" in key or key in groups:
            continue
        if _unknown(key.split("."), schema):
            close = _closest_key(key, [o for o in overrides if not o.startswith("+")])
            hint = f"did you mean {close}{given[len(given.split('=')[0]):]}?" if close else every_key()
            raise UnknownKeyError(f"{key}: the config has no such key (+ adds keys only to the sections of your own "
                                  f"code: {', '.join(OPEN_SECTIONS)}); {hint}")


def _unknown(path: list[str], schema: type) -> bool:
    """Whether the dotted `path` leaves the dataclass `schema`'s fields; a section of your own code (typed Any or
    a mapping) takes any key below it."""
    name, *rest = path
    hints = typing.get_type_hints(schema)
    if name not in hints:
        return True
    inner = _dataclass_of(hints[name])
    return bool(rest) and inner is not None and _unknown(rest, inner)


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (through Optional), or None for a plain value or an open mapping."""
    candidates = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


_TWICE = re.compile(r"Multiple values for ([\w/.]+)\. To override a value use 'override \1: ([^']+)'")
_ONE_MODE = "Only one of --run, --multirun, --cfg"  # how Hydra refuses two of its modes in one command


def every_key() -> str:
    """The hint for a key with no close valid name."""
    return f"{typed_command()} --cfg job lists every key"


# Keys that took another name, with what the new one means where the old name meant more than one thing.
RENAMED = {"trainer.warmup_steps": "trainer.excluded_steps (the first steps, left out of the steady-state figures; "
                                   "the learning rate's warm-up is optim.warmup_steps)"}


def explain(exc: BaseException, overrides: list[str]) -> str | None:
    """One line for a command line that did not compose, or None when `exc` is not such a failure."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, option = exc.missing_cfg_file.rsplit("/", 1)
        options = list(exc.options or group_options(group))
        close = difflib.get_close_matches(option, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return (f"{group}={option}: Could not find {group}/{option}; {hint}the options of {group}: "
                f"{', '.join(options)} ({typed_command()} --help describes them)")
    in_file = re.match(r"In '([^']+)'", str(exc))  # a key of a YAML file (an experiment of one's own) no schema has
    if isinstance(exc, ConfigCompositionException) and in_file and isinstance(exc.__context__, ConfigKeyError):
        key = exc.__context__.full_key or _quoted(str(exc.__context__)) or ""
        if key in RENAMED:
            return f"{in_file[1]}: {key}: the key is now {RENAMED[key]}"
        close = _closest_key(key, overrides)
        hint = f"did you mean {close}?" if close else every_key()
        return f"{in_file[1]}: {key}: the config has no such key; {hint}"
    if isinstance(exc, ConfigCompositionException) and isinstance(exc.__cause__, ConfigAttributeError | ConfigKeyError):
        key = _quoted(str(exc)) or ""
        if key in RENAMED:
            return f"{key}: Could not override it: the key is now {RENAMED[key]}"
        given = next((o for o in overrides if o.lstrip("+~").split("=")[0] == key), key)
        close = _closest_key(key, [o for o in overrides if o != given])
        hint = f"did you mean {close}{given[len(given.split('=')[0]):]}?" if close else every_key()
        return f"{key}: Could not override it: the config has no such key; {hint}"
    if isinstance(exc, ConfigCompositionException) and (twice := _TWICE.match(str(exc))):  # +experiment=x
        group, option = twice[1], twice[2]
        return (f"+{group}={option}: {group} is a group of the defaults already, and + adds a second one; write "
                f"{group}={option}")
    if isinstance(exc, ConfigCompositionException) and isinstance(exc.__cause__, ValidationError):
        override = str(exc).removeprefix("Error merging override ").strip()
        return refused_choice(exc.__cause__) or f"{override}: {str(exc.__cause__).splitlines()[0]}"
    if isinstance(exc, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), None)
        reason = str(exc).splitlines()[0]
        return (f"{bad or 'the command line'}: Hydra cannot parse it ({reason}); write key=value, group=option or "
                "key=[a,b], quoting values with spaces or brackets: 'key=[1, 2]'")
    if isinstance(exc, ValueError) and str(exc).startswith(_ONE_MODE):  # e.g. -m with --cfg job
        given = [o for o in overrides if o in ("-m", "--multirun", "-c", "--cfg", "-i", "--info", "--run", "-r")
                 or o.startswith("--shell-completion")]
        return (f"{' and '.join(given) or 'the command line'}: Hydra takes one of -m, --cfg, --info at a time; to see "
                f"a job's config, drop -m and give each swept key one value ({typed_command()} --cfg job "
                "optim.lr=1e-3)")
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return (f"{mark.name}:{mark.line + 1}:{mark.column + 1}: not valid YAML ({exc.problem}); fix the file, or "
                "leave out the option that reads it")
    return None


def _quoted(text: str) -> str | None:
    match = re.search(r"'([^']+)'", text)
    return match.group(1) if match else None


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([override])
        return True
    except OverrideParseException:
        return False


def _loader() -> Any:
    """Hydra's config loader over trainflow's configs (Hydra let go of its own when composition failed)."""
    if not GlobalHydra.instance().is_initialized():
        initialize_config_module("trainflow.conf", version_base="1.3").__enter__()  # for this one error's hints
    return GlobalHydra.instance().config_loader()


def group_options(group: str) -> list[str]:
    """The options of `group` in Hydra's config repository: trainflow's, and those of a project's own folder
    (--config-dir, hydra.searchpath) when Hydra composed with it."""
    return _loader().get_group_options(group)


def command_line_keys() -> set[str]:
    """The keys this run's command line sets (model.dropout from `model.dropout=0.1` or `+model.dropout=0.1`)."""
    if not HydraConfig.initialized():
        return set()
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: ${...} too
    return {str(o).lstrip("+~").split("=", 1)[0] for o in overrides}


def single_run() -> bool:
    """Whether this is one `python train.py` run (not a job of a -m sweep, whose typed keys are every job's)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN


def _closest_key(key: str, overrides: list[str]) -> str | None:
    """The key of the config (composed without the one that failed) or the group closest to `key`."""
    loader = _loader()
    cfg = None
    for attempt in (overrides, []):  # another bad override among the rest: the defaults alone still list the keys
        with contextlib.suppress(Exception):
            cfg = loader.load_configuration("train", [o for o in attempt if not o.startswith("-")], RunMode.RUN)
            break
    keys = [k for k in _dotted_keys(cfg) if not k.startswith("hydra")] if cfg is not None else []
    keys += [g for g in loader.list_groups("") if g not in ("hydra", "schema")]
    parent, _, leaf = key.rpartition(".")
    if parent in keys:  # a misspelt key of a section that exists: only its siblings are candidates
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        return f"{parent}.{close[0]}" if close else None
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.7)
    return close[0] if close else None


def _dotted_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every key of `cfg`, sections and leaves, as dotted paths (interpolations left unresolved)."""
    if not isinstance(cfg, DictConfig):
        return []
    keys = []
    for name in cfg:
        path = f"{prefix}{name}"
        keys.append(path)
        node = cfg._get_node(name)
        if OmegaConf.is_dict(node):
            keys += _dotted_keys(node, f"{path}.")
    return keys
