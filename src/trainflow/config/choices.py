"""The closed choices of the config, as types: Hydra refuses any other value while it composes, and the hint (the
values a key takes) is read from the same type (`allowed`).

Each choice is a StrEnum whose members are named exactly as users type the values (OmegaConf matches a value to a
member by its name; `max-autotune` and `async` are names only the functional API allows). A member equals its
string, so code compares with plain strings.

A field of the word auto or a number (`trainer.eval_every`, `parallelism.nproc_per_node`) or of auto or a bool
(`parallelism.watchdog.enabled`) is annotated `int | Auto` or `bool | Auto`. OmegaConf 2.3 takes such a Union but
checks its members strictly, so the word `auto` typed on a command line (a str) would never become `Auto.auto`:
`schema_node` holds those fields in an `AutoOr` node, which converts the word and refuses anything else.
"""

from __future__ import annotations

import dataclasses
import signal
import types
import typing
from enum import Enum, StrEnum
from typing import Any

from omegaconf import DictConfig, OmegaConf, ValueNode
from omegaconf.base import Metadata
from omegaconf.errors import ValidationError


def choice(name: str, values: str) -> type[StrEnum]:
    """A closed choice: a StrEnum of `values` (space-separated), each member named as it is typed."""
    return StrEnum(name, [(value, value) for value in values.split()], module=__name__)


Auto = choice("Auto", "auto")
Device = choice("Device", "auto cpu cuda")
Precision = choice("Precision", "fp32 bf16 fp8")  # the step's arithmetic
Fp8Recipe = choice("Fp8Recipe", "tensorwise rowwise")  # torchao's float8 scaling
Progress = choice("Progress", "auto bar log")
NonFinite = choice("NonFinite", "stop skip_step")
TokenizerKind = choice("TokenizerKind", "bytes bpe file")
BYTE_VOCAB = 256  # tokenizer=bytes: a token is a byte
FileFormat = choice("FileFormat", "json csv parquet text")  # data=hf: what the datasets library reads the files as
Items = choice("Items", "tuple dict")  # data=hf: what an item is
TaskKind = choice("TaskKind", "auto lm classify")
Direction = choice("Direction", "min max")  # the way task.monitor improves
TrainMetrics = choice("TrainMetrics", "log_step every_step")
Schedule = choice("Schedule", "cosine constant")
CompileMode = choice("CompileMode", "default max-autotune max-autotune-no-cudagraphs reduce-overhead")
CompileScope = choice("CompileScope", "model blocks")
Strategy = choice("Strategy", "single ddp fsdp hsdp auto")
Backend = choice("Backend", "auto gloo nccl")
ActivationCheckpointing = choice("ActivationCheckpointing", "off full selective budget")
PipelineSchedule = choice("PipelineSchedule", "1f1b gpipe interleaved_1f1b interleaved_zb zbv")
FSDPDtype = choice("FSDPDtype", "fp32 bf16 fp16")
FSDPWrap = choice("FSDPWrap", "auto blocks size")
FaultTolerance = choice("FaultTolerance", "off torchft")
NoQuorum = choice("NoQuorum", "stop alone")
CheckpointMode = choice("CheckpointMode", "sync async")
CheckpointLoad = choice("CheckpointLoad", "all model")
OnDataChange = choice("OnDataChange", "refuse restart")
LadderRung = choice("LadderRung", "baseline compile profile ddp fsdp checkpoint resume fp8")
WandbMode = choice("WandbMode", "online offline")


class StopSignal(StrEnum):
    """The signals a scheduler or a session sends to end a job (checkpoint.stop_signals: those that stop a run after
    a save at the step boundary; SIGUSR1: SLURM's --signal=USR1@N before a time limit; SIGHUP: a closed terminal)."""

    SIGTERM = "SIGTERM"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGHUP = "SIGHUP"

    @classmethod
    def why_not(cls, name: str) -> str:
        """Why `name` cannot be a stop signal, in words."""
        if name in ("SIGKILL", "SIGSTOP"):
            return f"{name} cannot be caught, so nothing can be saved on it"
        if name == "SIGINT":
            return "SIGINT is Ctrl-C, which stops at once (exit code 130)"
        if name in signal.Signals.__members__:
            return f"{name} is not sent to end a job"
        if f"SIG{name}" in signal.Signals.__members__:
            return f"{name!r} is not a signal's name: write SIG{name}"
        return f"{name!r} is not a signal's name (as signal(7) names them: SIGTERM, SIGUSR1, ...)"


STOP_SIGNALS = tuple(StopSignal)


class AutoOr(ValueNode):
    """The value of an `X | Auto` field: the word auto (as `Auto.auto`) or a value of type `other` (int or bool, not
    converted from text); anything else is refused as OmegaConf refuses a value outside an Enum. Its reference type
    (the Union) makes OmegaConf set and merge values through it rather than replace it."""

    def __init__(self, other: type, value: Any = Auto.auto, key: Any = None, parent: Any = None) -> None:
        self.__dict__["other"] = other  # before ValueNode's __init__ sets (and so checks) the value
        super().__init__(parent=parent, value=value,
                         metadata=Metadata(ref_type=other | Auto, object_type=None, key=key, optional=False))

    def _validate_and_convert_impl(self, value: Any) -> Any:
        if value == Auto.auto:
            return Auto.auto
        if type(value) is self.other:
            return value
        raise ValidationError(f"Invalid value '$VALUE', expected {allowed(self.other | Auto)}")

    def __deepcopy__(self, memo: dict[int, Any]) -> AutoOr:
        copied = AutoOr(self.other)
        self._deepcopy_impl(copied, memo)
        return copied


def schema_node(schema: type) -> DictConfig:
    """`OmegaConf.structured(schema)` with its `X | Auto` fields (in nested sections too) held by AutoOr nodes."""
    node = OmegaConf.structured(schema)
    _hold_auto_fields(node, schema)
    return node


def _hold_auto_fields(node: DictConfig, schema: type) -> None:
    """Replace the nodes of `schema`'s `X | Auto` fields in `node` (a structured config of it) by AutoOr nodes."""
    for name, hint in typing.get_type_hints(schema).items():
        if (other := _auto_partner(hint)) is not None:
            node.__dict__["_content"][name] = AutoOr(other, node[name], key=name, parent=node)
        elif dataclasses.is_dataclass(hint) and isinstance(node[name], DictConfig):
            _hold_auto_fields(node[name], hint)


def _auto_partner(hint: Any) -> type | None:
    """X of a hint `X | Auto`; None for any other hint."""
    args = _union_args(hint)
    others = [a for a in args if a is not Auto]
    return others[0] if Auto in args and len(others) == 1 else None


def _union_args(hint: Any) -> tuple:
    """The members of a Union hint (X | Y); empty for any other hint."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else ()


_WORDS = {int: "auto or an integer", bool: "auto, true or false"}  # the values of `int | Auto`, `bool | Auto`


def allowed(hint: Any) -> str | None:
    """The values a type takes, as a hint says them ("one of fp32, bf16", "auto or an integer"); None for a type
    that is not a closed choice."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return f"one of {', '.join(hint.__members__)}"
    if (other := _auto_partner(hint)) is not None:
        return _WORDS.get(other, f"auto or a {other.__name__}")
    if typing.get_origin(hint) is list and (args := typing.get_args(hint)):
        return allowed(args[0])
    args = [a for a in _union_args(hint) if a is not type(None)]
    if len(args) == 1 and (values := allowed(args[0])):  # X | None
        return f"{values}, or null"
    return None


def refused_choice(error: ValidationError, section: str = "") -> str | None:
    """A value outside a closed choice, as one line naming the key (under `section`, for a section typed on its own)
    whose hint is read from the key's type; None for another validation error (a value of the wrong type)."""
    hint = _field_type(error)
    values = allowed(hint)
    if values is None:
        return None
    member_type = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
    why = getattr(member_type, "why_not", None)  # a choice may say why a value is not one of it (StopSignal)
    reason = f"{why(str(error.value))}; " if why else ""
    key = f"{section}.{error.full_key}" if section else error.full_key
    return f"{key}: {reason}must be {values}; got {error.value!r}"


def _field_type(error: ValidationError) -> Any:
    """The type of the field (or list) a value was refused by, as its schema declares it."""
    owner = error.object_type
    if dataclasses.is_dataclass(owner) and isinstance(error.key, str):
        return typing.get_type_hints(owner).get(error.key)
    return error.ref_type if typing.get_origin(error.ref_type) is list else None
