"""TensorBoard as the dashboard of runs and sweeps: scalars with units, hyperparameters, config and profiler text.

`tensorboard --logdir outputs` (or a sweep folder) shows every run below it. To compare them:

- each run records a session of TensorBoard's HParams plugin in its own event file: its hyperparameters are
  its group choices, a few headline knobs and the overrides typed for it (what Hydra saved in `.hydra/`), its
  metrics are its scalar tags, and at the end the run's final figures are written as `summary/*` scalars (the
  HParams table shows each tag's last value); no experiment summary is written, so TensorBoard builds the
  table from the union of all sessions (one written per run would hide the keys other runs override);
- a sweep job writes into `tensorboard/<the job's values of the swept keys>`, so the run list names it by what
  it varies, not only by its number;
- tag groups sort so that loss comes first: TensorBoard orders groups by name and opens the first two.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainflow.config import OptimConfig, TrainerConfig
from trainflow.errors import ConfigError, unwritable_reason
from trainflow.profile_verdict import format_verdict

EVENTS_DIR = "tensorboard"
NAME_BYTES = 200  # a sweep job's folder name: one level, within the usual 255-byte limit of a file name
MIB = 2**20
# metrics.jsonl name -> TensorBoard tag, where the dashboard needs another group or unit than the log.
_TAGS = {"train/loss": "loss/train", "val/loss": "loss/val", "perf/memory_bytes": "perf/peak_memory_mib"}
_SCALE = {"perf/memory_bytes": 1 / MIB}
HparamValue = str | float | int | bool


def headline(trainer: TrainerConfig, optim: OptimConfig) -> dict[str, HparamValue]:
    """The knobs runs are most often compared by, under their config keys."""
    return {"optim.lr": optim.lr, "trainer.batch_size": trainer.batch_size, "trainer.max_steps": trainer.max_steps,
            "trainer.precision": trainer.precision}


def hyperparameters(headline_values: dict[str, HparamValue], choices: dict[str, Any],
                    overrides: list[str]) -> dict[str, HparamValue]:
    """A run's HParams values: its group choices, the headline knobs, then every typed override.

    The choices and headline knobs are recorded for every run, typed or not, so that a run left at the default
    learning rate still shows it next to one that changed it (TensorBoard compares only the values recorded).
    Overrides keep the type they were typed with; lists, dicts and null become their text.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

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
    from hydra.core.override_parser.overrides_parser import OverridesParser

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
    """The figures a run is judged by, for the HParams table: validation, steady throughput, MFU, peak memory."""
    steady = summary.get("steady_state") or {}
    figures = {f"summary/val_{k}": v for k, v in (summary.get("val") or {}).items()}
    figures.update({
        "summary/samples_per_sec": steady.get("samples_per_sec"),
        "summary/tokens_per_sec": steady.get("tokens_per_sec") or None,  # 0 for non-language models
        "summary/step_time_s": steady.get("step_time_s"),
        "summary/mfu": summary.get("mfu"),
        "summary/peak_memory_mib": summary["peak_memory_bytes"] / MIB if summary.get("peak_memory_bytes") else None,
    })
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def profiler_text(profiler: dict[str, Any] | None) -> str | None:
    """The verdict as printed at the end of a run, and the top operators as a Markdown table."""
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


class Dashboard:
    """One run's TensorBoard event file (rank 0): scalars, the HParams session, the config and profiler text."""

    def __init__(self, trainer: TrainerConfig, optim: OptimConfig, config_yaml: str, run_dir: Path) -> None:
        """`config_yaml`: the run's composed config, resolved, shown as text next to the figures."""
        from torch.utils.tensorboard import SummaryWriter  # 2-3 s import: only when TensorBoard is on

        mode, choices, overrides = saved_hydra(run_dir)
        name = job_name(overrides, run_dir) if mode == "MULTIRUN" else None
        self.dir = run_dir / EVENTS_DIR / name if name else run_dir / EVENTS_DIR
        _check_writable(self.dir)  # before the writer, whose thread would print its own traceback
        self._writer = SummaryWriter(log_dir=str(self.dir), flush_secs=10)  # a running run shows within seconds
        self._add(session_start_record(hyperparameters(headline(trainer, optim), choices, overrides)))
        self._add(_text_summary("config", f"```yaml\n{config_yaml}```"))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """Log values under their dashboard tags and units; non-finite and non-numeric ones are left out."""
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(_TAGS.get(key, key), value * _SCALE.get(key, 1), step)

    def finish(self, summary: dict[str, Any]) -> None:
        """The final figures and the profiler's findings at the last step; the session ends as a success."""
        step = summary["steps"]
        for tag, value in final_figures(summary).items():
            self._writer.add_scalar(tag, value, step)
        text = profiler_text(summary.get("profiler"))
        if text:
            self._add(_text_summary("profiler", text), step)
        self._add(_session_end(), step)
        self._writer.close()

    def _add(self, summary: Any, step: int = 0) -> None:
        self._writer.file_writer.add_summary(summary, step)


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"logger.tensorboard: cannot write TensorBoard's events in {folder} "
                          f"({unwritable_reason(folder, exc)}); make that a writable folder, or run with "
                          "logger=none") from None


def session_start_record(hparams: dict[str, HparamValue]) -> Any:
    """The HParams plugin's session start record: this run's hyperparameters."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        if isinstance(value, bool):  # before int: a bool is an int in Python
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = value
    return _hparams_record(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=info))


def _session_end() -> Any:
    """The HParams plugin's session end record: the run finished."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    return _hparams_record(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info))


def _hparams_record(tag: str, data: Any) -> Any:
    """A record the HParams plugin reads, built with TensorBoard's own protos (its summary API needs TensorFlow)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data),
                                        tensor=metadata.NULL_TENSOR)])


def _text_summary(tag: str, markdown: str) -> Any:
    """A text record for TensorBoard's TEXT tab (rendered as Markdown), under exactly `tag`."""
    from tensorboard.plugins.text.summary_v2 import text_pb

    return text_pb(tag, markdown)
