"""Stages of your own from the config: `stages=[early_stopping,ema]` or `+stages.mine._target_=mypkg.MyStage`.

Each section `stages.<name>` names a trainflow.loop.stages.Stage subclass by `_target_`, called with the section's
other keys, checked like any user `_target_`: a key the class does not take is one line naming the closest it takes.
`before` and `after` (a stage's name or a list of them) are the assembly's: they order the stage among the others.
Such a stage is handed the run's context once (`setup(ctx)`), and an error out of any of its hooks is one line naming
the stage, the hook and the step; the run then fails as for any other error (what it committed stays).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from trainflow.config.schema import ORDER_KEYS, StageSection
from trainflow.errors import ConfigError, StageError, TrainflowError
from trainflow.loop.stages import Stage, StageContext
from trainflow.util.targets import call, first_line, import_target

WHAT = "a trainflow.loop.stages.Stage subclass, e.g. mypackage.MyStage"
# the hooks a stage of the config may answer, each guarded: its error names the stage
HOOKS = ("setup", "wrap_model", "resume", "start", "load_state_dict", "state_dict", "loss_context", "wants_grad_norm",
         "keeps_update", "syncs_after", "after_step", "take_paused_s", "close", "summary")


def configured_stages(sections: Mapping[str, StageSection], ctx: StageContext, taken_names: set[str]) -> list[Stage]:
    """Each `stages.<name>` section's stage, made and set up (`taken_names`: trainflow's own stages' names)."""
    stages = []
    for name, settings in sections.items():
        if name in taken_names:
            raise ConfigError(f"stages.{name}: trainflow has a stage of that name; name yours otherwise")
        stage = make_stage(name, settings)
        stage.setup(ctx)
        stages.append(stage)
    return stages


def make_stage(name: str, settings: StageSection) -> Stage:
    """`_target_(**kwargs)` of `stages.<name>`, its keys checked, its order declarations set, its hooks guarded."""
    section, target, kwargs = f"stages.{name}", settings._target_, settings.kwargs
    if not target:
        raise ConfigError(f"{section}: no _target_; give {section}._target_ the import path of {WHAT}, or leave it "
                         "out of stages=[...]")
    order = {key: _names(section, key, value) for key, value in settings.order().items()}
    stage_class = import_target(f"{section}._target_", str(target), WHAT)
    if not (inspect.isclass(stage_class) and issubclass(stage_class, Stage)):
        raise ConfigError(f"{section}._target_: {target} is not a trainflow stage; give {WHAT}")
    _check_keys(section, str(target), stage_class, kwargs)
    stage = call(section, str(target), stage_class, kwargs)
    stage.name = name
    for key, names in order.items():
        setattr(stage, key, names)
    for hook in HOOKS:
        if getattr(stage_class, hook) is not getattr(Stage, hook):  # the defaults do nothing: nothing to guard
            setattr(stage, hook, _guarded(section, hook, getattr(stage, hook)))
    return stage


def _names(section: str, key: str, value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else list(value or [])
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{section}.{key}: {value!r} is not a stage's name or a list of them")
    return tuple(names)


def _check_keys(section: str, target: str, stage_class: type, kwargs: Mapping[str, Any]) -> None:
    """One line for the first key the class's signature does not name (none when it takes **kwargs)."""
    params = inspect.signature(stage_class).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return
    taken = sorted(p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY))
    for key in kwargs:
        if key not in taken:
            close = difflib.get_close_matches(key, taken, n=1)
            hint = f"did you mean {section}.{close[0]}? " if close else ""
            raise ConfigError(f"{section}.{key}: {target} takes no such argument; {hint}it takes "
                             f"{', '.join([*taken, *ORDER_KEYS])}")


def _guarded(section: str, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, its error (not trainflow's own one-line errors, nor an interrupt) as one line naming the stage."""
    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except TrainflowError:
            raise
        except Exception as exc:
            step = next((f" at step {a.step}" for a in args if isinstance(getattr(a, "step", None), int)), "")
            raise StageError(f"{section}: {hook}{step} failed: {type(exc).__name__}: {first_line(exc)}; fix the "
                             f"stage, or leave it out of stages=[...]") from exc
    return guarded
