"""TensorBoard as the dashboard of runs and sweeps: scalars with units, hyperparameters, config and profiler text.

`tensorboard --logdir outputs` (or a sweep folder) shows every run below it. To compare them:

- each run records a session of TensorBoard's HParams plugin in its own event file: its hyperparameters are
  its group choices, a few headline knobs and the overrides typed for it (what Hydra saved in `.hydra/`), its
  metrics are its scalar tags, and at the end the run's final figures are written as `summary/*` scalars (the
  HParams table shows each tag's last value); no experiment summary is written, so TensorBoard builds the
  table from the union of all sessions (one written per run would hide the keys other runs override);
- a sweep job writes into `tensorboard/<the job's values of the swept keys>`, so the run list names it by what
  it varies, not only by its number;
- tag groups sort so that loss comes first: TensorBoard orders groups by name and opens the first two;
- a resumed run writes on in the same folder with `purge_step` at the step after the resumed one, so TensorBoard
  drops what a crashed process logged past its last checkpoint and each step shows once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.plugins.text.summary_v2 import text_pb

from trainflow.errors import ConfigError, unwritable_reason
from trainflow.loggers import FINISHED, MIB, HparamValue, RunInfo
from trainflow.util.files import cannot_write

EVENTS_DIR = "tensorboard"
# metrics.jsonl name -> TensorBoard tag, where the dashboard needs another group or unit than the log.
_TAGS = {"train/loss": "loss/train", "val/loss": "loss/val", "perf/memory_bytes": "perf/peak_memory_mib"}
_SCALE = {"perf/memory_bytes": 1 / MIB}


class TensorBoardLogger:
    """One run's TensorBoard event file (rank 0): scalars, the HParams session, the config and profiler text."""

    def __init__(self, flush_secs: int = 10) -> None:
        self.flush_secs = flush_secs
        self.dir: Path | None = None
        self._writer: Any = None
        self._step = 0  # the last step logged: the session ends there

    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # 2-3 s import: only when TensorBoard is on

        self.dir = run.run_dir / EVENTS_DIR / run.name if run.sweep_dir else run.run_dir / EVENTS_DIR
        _check_writable(self.dir)  # before the writer, whose thread would print its own traceback
        purge = run.resumed_step + 1 if run.resumed_step is not None else None
        self._writer = SummaryWriter(log_dir=str(self.dir), flush_secs=self.flush_secs, purge_step=purge)
        if purge is None:  # a resumed run's session and config were recorded at its start
            self._add(session_start_record(run.hyperparameters))
            self._add(_text_summary("config", f"```yaml\n{run.config_yaml}```"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log values under their dashboard tags and units."""
        self._step = step
        for key, value in values.items():
            self._writer.add_scalar(_TAGS.get(key, key), value * _SCALE.get(key, 1), step)

    def text(self, tag: str, text: str, step: int) -> None:
        self._step = step
        self._add(_text_summary(tag, text), step)

    def artifacts(self, paths: list[Path]) -> None:
        """Nothing: the files lie next to the event folder already."""

    def finish(self, status: str) -> None:
        """The HParams session ends (a success only if the run finished); the events reach the disk."""
        self._add(_session_end(api_pb2.STATUS_SUCCESS if status == FINISHED else api_pb2.STATUS_FAILURE),
                  self._step)
        self._writer.close()

    def _add(self, summary: Any, step: int = 0) -> None:
        self._writer.file_writer.add_summary(summary, step)


def _check_writable(folder: Path) -> None:
    if (exc := cannot_write(folder)) is not None:
        raise ConfigError(f"logger.tensorboard: cannot write TensorBoard's events in {folder} "
                          f"({unwritable_reason(folder, exc)}); make that a writable folder, or run with "
                          "logger=none") from None


def session_start_record(hparams: dict[str, HparamValue]) -> Any:
    """The HParams plugin's session start record: this run's hyperparameters."""
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        if isinstance(value, bool):  # before int: a bool is an int in Python
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = value
    return _hparams_record(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=info))


def _session_end(status: int) -> Any:
    """The HParams plugin's session end record: the run ended with `status`."""
    info = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
    return _hparams_record(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info))


def _hparams_record(tag: str, data: Any) -> Any:
    """A record the HParams plugin reads, built with TensorBoard's own protos (its summary API needs TensorFlow)."""
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data),
                                        tensor=metadata.NULL_TENSOR)])


def _text_summary(tag: str, markdown: str) -> Any:
    """A text record for TensorBoard's TEXT tab (rendered as Markdown), under exactly `tag`."""
    return text_pb(tag, markdown)
