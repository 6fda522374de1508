"""Loggers: where a run's figures go besides metrics.jsonl (always written), chosen as a list by `logger=[...]`.

Each chosen logger is the section `logger.<name>`, built by its `_target_` with the section's other keys, and
answers one small protocol (`Logger`). The metrics writer (loggers/writer.py, MetricsWriter) fans out to them on
rank 0 only. A tracked run (MLflow's, W&B's) keeps its id in <run dir>/loggers.json, so that the same command
after a stop, a crash or a requeue continues the same tracked run on one step axis.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from trainflow.config.schema import CalledSection, RunConfig, TrainerConfig, plain
from trainflow.errors import ConfigError
from trainflow.loggers.process import ANSWER_TIMEOUT_S, LOGGER_CLASS, ProcessLogger
from trainflow.util.rundir import run_identity
from trainflow.util.targets import arguments, call, import_target

IDS_FILE = "loggers.json"  # {logger name: its tracked run's id}, in the run directory
NAME_BYTES = 200  # a sweep job's folder name: one level, within the usual 255-byte limit of a file name
MIB = 2**20
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"  # KILLED: stopped on a signal after a save (exit 75)
HparamValue = str | float | int | bool


@dataclass(frozen=True)
class RunInfo:
    """What a logger is told at the start of a run."""

    run_dir: Path
    config: dict[str, Any]  # the composed config, resolved
    config_yaml: str  # the same, as config.yaml holds it
    hyperparameters: dict[str, HparamValue]  # group choices, headline knobs, typed overrides
    name: str  # the run's readable name: a sweep job's swept values, else its run directory's name
    sweep_dir: Path | None  # the sweep folder of a -m job
    resumed_step: int | None  # the step the run continues from (None: a fresh start)
    tracked_id: str | None  # this logger's run id from before the resume; None: start a new tracked run
    world_size: int
    # another run's checkpoint this run started from (checkpoint.resume=<path>): the new tracked run names it, and
    # that run's tracked run in this logger where the checkpoint names one; nothing is written into that one
    source_checkpoint: Path | None = None
    source_id: str | None = None


class Logger(Protocol):
    """One destination of a run's figures. Every call but `start` happens at a log step, never per step."""

    def start(self, run: RunInfo) -> str | None:
        """Record the config and hyperparameters; return the id of the tracked run to continue after a resume."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Finite numbers under their metrics.jsonl names, at `step` (the optimizer step)."""

    def text(self, tag: str, text: str, step: int) -> None:
        """Markdown under `tag` (the profiler's verdict and operator table)."""

    def artifacts(self, paths: list[Path]) -> None:
        """Files of the run directory to keep with the tracked run (config.yaml, summary.json, ...)."""

    def finish(self, status: str) -> None:
        """The run ended as FINISHED, FAILED or KILLED; flush and close."""


def build_loggers(sections: Mapping[str, CalledSection]) -> dict[str, Logger]:
    """Each `logger.<name>` section's `_target_` called with its other keys (imports only the chosen ones)."""
    loggers = {}
    for name, section in sections.items():
        if not section._target_:
            raise ConfigError(f"logger.{name}: no _target_; give logger.{name}._target_ the import path of a "
                              "logger class (see docs/loggers.md), or leave it out of logger=[...]")
        loggers[name] = build_logger(name, section._target_, dict(section.kwargs))
    return loggers


def build_logger(name: str, target: str, kwargs: dict[str, Any]) -> Logger:
    """`target(**kwargs)`; in a process of its own when its class says `in_own_process = True` (its client's cost
    stays out of the loop's process, and its calls are bounded in time: `answer_timeout_s`, loggers/process.py)."""
    logger_class = import_target(f"logger.{name}._target_", target, LOGGER_CLASS)
    if getattr(logger_class, "in_own_process", False):
        return ProcessLogger(name, target, kwargs, getattr(logger_class, "answer_timeout_s", ANSWER_TIMEOUT_S))
    try:
        return call(f"logger.{name}", target, logger_class, kwargs)
    except (SystemExit, GeneratorExit) as exc:  # the logger's failure, not the run's end
        raise ConfigError(f"logger.{name}: {target}({arguments(kwargs)}) failed: {type(exc).__name__}: {exc}; fix "
                          f"the logger.{name}.* values") from None


def run_info(cfg: RunConfig, run_dir: Path, world_size: int, resumed_step: int | None, tracked_id: str | None,
             source_checkpoint: Path | None = None, source_id: str | None = None) -> RunInfo:
    """What every logger is told at the start, from the config and what Hydra saved in the run directory."""
    mode, choices, overrides = saved_hydra(run_dir)
    job = job_name(overrides, run_dir) if mode == "MULTIRUN" else None
    sweep = next((d for d in run_dir.parents if (d / "multirun.yaml").exists()), None) if job else None
    hparams = hyperparameters(headline(cfg.trainer, float(cfg.optim.lr)), choices, overrides)
    return RunInfo(run_dir, plain(cfg), (run_dir / "config.yaml").read_text(),
                   hparams, job or readable_name(run_dir, overrides), sweep, resumed_step, tracked_id, world_size,
                   source_checkpoint, source_id)


def readable_name(run_dir: Path, overrides: list[str]) -> str:
    """A run's name for the trackers: its directory's, or, for outputs/<date>/<time> (a clock is no name), the run
    name trainflow makes from its overrides (or trainer.run_name)."""
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", run_dir.parent.name) and re.fullmatch(r"\d{2}-\d{2}-\d{2}", run_dir.name):
        return run_identity(overrides)
    return run_dir.name


def history(run_dir: Path, after: int, up_to: int) -> list[tuple[int, dict[str, float]]]:
    """(step, finite scalars) of each metrics.jsonl line of a step in (after, up_to]: what a tracker that lost the
    end of a crashed process's figures logs again when the run resumes at `up_to` (the metrics writer has kept
    metrics.jsonl up to there)."""
    lines = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            values = json.loads(line)
            step = values.pop("step", 0)
            if after < step <= up_to:
                lines.append((step, finite(values)))
    return lines


def kept_ids(run_dir: Path) -> dict[str, str]:
    """The tracked runs' ids an earlier process of this run kept."""
    try:
        return json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def headline(trainer: TrainerConfig, lr: float) -> dict[str, HparamValue]:
    """The knobs runs are most often compared by, under their config keys."""
    return {"optim.lr": lr, "trainer.batch_size": trainer.batch_size, "trainer.max_steps": trainer.max_steps,
            "trainer.precision": str(trainer.precision)}


def hyperparameters(headline_values: dict[str, HparamValue], choices: dict[str, Any],
                    overrides: list[str]) -> dict[str, HparamValue]:
    """A run's hyperparameters: its group choices, the headline knobs, then every typed override.

    The choices and headline knobs are recorded for every run, typed or not, so that a run left at the default
    learning rate still shows it next to one that changed it (TensorBoard compares only the values recorded).
    Overrides keep the type they were typed with; lists, dicts and null become their text.
    """
    values: dict[str, HparamValue] = {group: str(choice) for group, choice in choices.items()
                                      if choice is not None and not group.startswith("hydra/")}
    values.update(headline_values)
    for o in OverridesParser.create().parse_overrides(overrides):
        value = o.value()
        if o.is_delete():
            values[o.key_or_group] = "(deleted)"
        elif isinstance(value, (str, int, float, bool)):
            values[o.key_or_group] = value
        else:
            values[o.key_or_group] = o.get_value_element_as_str()
    return values


def swept_keys(multirun_yaml: Path) -> list[str]:
    """The keys a sweep varies: its comma/range overrides and the sweeper's `params`."""
    sweep = OmegaConf.load(multirun_yaml)
    keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(list(sweep.hydra.overrides.task))
            if o.is_sweep_override()]
    params = OmegaConf.select(sweep, "hydra.sweeper.params", default=None) or {}
    return keys + [str(k) for k in params if str(k) not in keys]


def job_name(overrides: list[str], run_dir: Path) -> str | None:
    """A sweep job's readable name, e.g. `optim.lr=0.001,trainer.batch_size=8`; None outside a sweep."""
    multirun_yaml = next((d / "multirun.yaml" for d in run_dir.parents if (d / "multirun.yaml").exists()), None)
    if multirun_yaml is None:
        return None
    keys = set(swept_keys(multirun_yaml))
    varied = [o.lstrip("+~") for o in overrides if o.lstrip("+~").split("=", 1)[0] in keys]
    return folder_name(",".join(varied).replace("/", "_")) or None


def folder_name(text: str, limit: int = NAME_BYTES) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 (a file name may have 255 bytes, whatever its characters),
    never inside a character."""
    return text.encode()[:limit].decode(errors="ignore")


def saved_hydra(run_dir: Path) -> tuple[str | None, dict[str, Any], list[str]]:
    """The run mode, the group choices and the typed overrides Hydra saved in the run directory (none: nothing)."""
    hydra_yaml, overrides_yaml = run_dir / ".hydra" / "hydra.yaml", run_dir / ".hydra" / "overrides.yaml"
    if not (hydra_yaml.exists() and overrides_yaml.exists()):
        return None, {}, []
    hydra = OmegaConf.load(hydra_yaml).hydra
    choices = OmegaConf.to_container(hydra.runtime.choices) if "runtime" in hydra else {}
    return hydra.get("mode"), choices, [str(o) for o in OmegaConf.load(overrides_yaml)]


def final_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The figures a run is judged by, as `summary/*` scalars: validation, steady throughput, MFU, peak memory."""
    steady = summary.get("steady_state") or {}
    figures = {f"summary/val_{k}": v for k, v in (summary.get("validation") or {}).items()}
    figures.update({
        "summary/samples_per_sec": steady.get("samples_per_sec"),
        "summary/tokens_per_sec": steady.get("tokens_per_sec") or None,  # 0 for non-language models
        "summary/step_time_s": steady.get("step_time_s"),
        "summary/mfu": summary.get("mfu"),
        "summary/peak_memory_mib": summary["peak_memory_bytes"] / MIB if summary.get("peak_memory_bytes") else None,
    })
    return finite(figures)


def finite(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of `values` (a bool is not a figure)."""
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def profiler_text(profiler: dict[str, Any] | None) -> str | None:
    """The verdict as printed at the end of a run, and the top operators as a Markdown table."""
    from trainflow.metrics.verdict import format_verdict  # it imports torch, which a logger's process needs not

    verdict = (profiler or {}).get("verdict")
    if not verdict:
        return None
    rank = verdict["rank"]
    lines = ["```", format_verdict(verdict, rank, profiler["windows"][str(rank)]), "```", "",
             f"Top operators of rank {rank} (self time per recorded step; traces: "
             f"{', '.join(profiler['traces'])}, for https://ui.perfetto.dev or chrome://tracing):", "",
             "| operator | calls/step | self ms/step | share of self time |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{op['name']}` | {op['calls_per_step']} | {op['self_ms_per_step']:.3f} | "
              f"{op['share_of_self_time'] * 100:.1f}% |" for op in profiler["top_ops"]]
    return "\n".join(lines)
