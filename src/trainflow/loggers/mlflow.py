"""MLflow: one tracked run per trainflow run, continued across resumes (`pip install 'trainflow[mlflow]'`).

- params: the resolved config, flattened (`optim.lr`); a value over MLflow's length limit is shortened (said
  once), and params go in batches under its per-call limit;
- metrics: every scalar of metrics.jsonl at its step, buffered for `flush_s` seconds and sent in batches by
  MLflow's background thread (a SQLite store costs ~7 ms a call besides ~0.2 ms a metric; a failed batch
  surfaces at the next send); a resumed run logs only the steps past the last one its tracked run already holds
  (a crash replays a few), and again those of metrics.jsonl up to the resumed step that the crash kept from the
  store;
- tags: run name, run directory, host, world size, strategy, the working directory's git commit; for a run started
  from another run's checkpoint (a new tracked run: the other one is never written into), that checkpoint
  (`trainflow.resumed_from`) and the other run's id (`trainflow.resumed_from_run`);
- at the end: config.yaml, summary.json, compile_report.json, the profiler's verdict as profiler.md, and the
  status (FINISHED, FAILED, KILLED for a stop on a signal);
- a sweep job is a child run of one parent run per sweep folder (the sweep's report goes there at the end).

Without `tracking_uri` the store is a local SQLite file, outputs/mlflow.db (no server):
`mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainflow.errors import ConfigError, unwritable_reason
from trainflow.loggers import RunInfo, history
from trainflow.util.files import cannot_write
from trainflow.util.targets import first_line

log = logging.getLogger(__name__)

PARENT_FILE = "mlflow_parent.json"  # in a sweep folder: the parent run of its jobs
# A server that stops answering mid-run costs a few seconds once (then the logger is dropped), not minutes of the
# client's default retries; a user's own setting of these wins.
_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"  # MLflow 3's experiment types


def runs_table(uri: str, experiment_id: str) -> str:
    """Where MLflow 3's UI shows the experiment's runs table: its Model training view (the experiment page opens on
    the GenAI view by default, which shows no training run). A local store's UI is `mlflow ui` on port 5000."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def default_uri() -> str:
    """The server-less store: outputs/mlflow.db below the working directory (where Hydra puts outputs/)."""
    return f"sqlite:///{Path.cwd() / 'outputs' / 'mlflow.db'}"


class MLflowLogger:
    """One MLflow run (rank 0), through `MlflowClient` (no global active run: the user's own code keeps its own)."""

    in_own_process = True  # its store's client costs ~0.2-1 ms of Python a metric: not in the loop's process

    def __init__(self, tracking_uri: str | None = None, experiment: str = "trainflow",
                 tags: Mapping[str, str] | None = None, flush_s: float = 5.0) -> None:
        try:
            import mlflow  # noqa: F401 (the extra, checked before any training)
        except ImportError:
            raise ConfigError("logger.mlflow: the mlflow package is not installed; pip install 'trainflow[mlflow]', "
                              "or leave mlflow out of logger=[...]") from None
        for key, value in _CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.uri = tracking_uri or default_uri()
        self.experiment = experiment
        self.tags = dict(tags or {})
        self.client: Any = None
        self.run_id: str | None = None
        self._logged_to = 0  # steps up to here are in the tracked run already (a resume after a crash replays)
        self.flush_s = flush_s
        self._buffer: list[Any] = []  # metrics not sent yet: a SQLite store costs ~7 ms a call besides its metrics
        self._buffered_since: float | None = None
        self._pending: list[Any] = []  # the last batches sent, still being written by MLflow's thread

    def start(self, run: RunInfo) -> str:
        from mlflow.tracking import MlflowClient  # lazy: mlflow is the mlflow extra

        _check_store(self.uri)
        self.client = MlflowClient(self.uri)
        experiment_id = self._experiment_id()
        if run.tracked_id and self._continue(run.tracked_id, run.run_dir, run.resumed_step or 0):
            return self.run_id
        tags = {"trainflow.run_dir": str(run.run_dir), "trainflow.host": socket.gethostname(),
                "trainflow.world_size": str(run.world_size),
                "trainflow.strategy": str(run.config.get("parallelism", {}).get("strategy")), **self.tags}
        if commit := _git_commit():
            tags["mlflow.source.git.commit"] = commit
        tags.update(source_tags(run))
        if run.sweep_dir is not None:
            tags["mlflow.parentRunId"] = self._parent_run(experiment_id, run.sweep_dir)
        self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
        self._log_params(flatten(run.config))
        log.info("mlflow: run %s in experiment %s: %s", run.name, self.experiment, runs_table(self.uri, experiment_id))
        return self.run_id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric  # lazy: mlflow is the mlflow extra
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH  # lazy: mlflow is the mlflow extra

        if step <= self._logged_to:
            return
        now = time.time()
        self._buffer += [Metric(key, float(value), int(now * 1000), step) for key, value in values.items()]
        self._buffered_since = self._buffered_since or now
        if now - self._buffered_since >= self.flush_s or len(self._buffer) >= MAX_METRICS_PER_BATCH:
            self._send()

    def _send(self) -> None:
        """The buffered metrics, in batches under MLflow's per-call limit, to its background thread (the batches
        sent before are waited for first: one that failed raises here)."""
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH  # lazy: mlflow is the mlflow extra

        self._wait()
        metrics, self._buffer, self._buffered_since = self._buffer, [], None
        self._pending = [self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH],
                                               synchronous=False)
                         for i in range(0, len(metrics), MAX_METRICS_PER_BATCH)]

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for operations in pending:
            operations.wait()

    def settle(self) -> None:
        """Send what is buffered and wait until it is written; a batch that failed raises here."""
        if self._buffer:
            self._send()
        self._wait()

    def text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{tag}.md")

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self.settle()
        self.client.set_terminated(self.run_id, status)

    def _experiment_id(self) -> str:
        """The experiment by name, created when missing (a SQLite store: its artifacts in a folder beside it), and
        marked as model training (MLflow 3's experiment kind) where nothing says what it is."""
        experiment_id = self._found_or_created()
        if EXPERIMENT_KIND not in self.client.get_experiment(experiment_id).tags:
            self.client.set_experiment_tag(experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return experiment_id

    def _found_or_created(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).resolve().parent / "mlflow-artifacts").as_uri()
        try:
            return self.client.create_experiment(self.experiment, artifact_location=location)
        except Exception:  # another job of the sweep created it meanwhile
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _continue(self, run_id: str, run_dir: Path, resumed_step: int) -> bool:
        """Continue the tracked run of an earlier process of this run: the steps up to `resumed_step` that it does
        not hold (a crash lost the last batches) are logged again from metrics.jsonl, the later ones skipped."""
        from mlflow.exceptions import MlflowException  # lazy: mlflow is the mlflow extra

        try:
            tracked = self.client.get_run(run_id)
        except MlflowException:
            log.warning("logger.mlflow: the run %s kept in %s is not in %s: a new MLflow run starts", run_id,
                        "loggers.json", self.uri)
            return False
        self.run_id = run_id
        self._logged_to = max((m.step for key in tracked.data.metrics
                               for m in self.client.get_metric_history(run_id, key)), default=0)
        self.client.update_run(run_id, status="RUNNING")
        for step, values in history(run_dir, self._logged_to, resumed_step):  # what a crash kept from the store
            self.scalars(step, values)
        self._logged_to = max(self._logged_to, resumed_step)
        return True

    def _log_params(self, params: dict[str, str]) -> None:
        """All params, values shortened to MLflow's limit (said once), in batches of its per-call limit."""
        from mlflow.entities import Param  # lazy: mlflow is the mlflow extra

        # lazy: mlflow is the mlflow extra
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        long = [key for key, value in params.items() if len(value) > MAX_PARAM_VAL_LENGTH]
        if long:
            log.warning("logger.mlflow: %s shortened to MLflow's %d characters (config.yaml, an artifact of the run, "
                        "has them whole)", ", ".join(long), MAX_PARAM_VAL_LENGTH)
        items = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in params.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def _parent_run(self, experiment_id: str, sweep_dir: Path) -> str:
        """The sweep's parent run: created by its first job, under a lock (jobs may start together)."""
        with open(sweep_dir / ".mlflow_parent.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            kept = sweep_dir / PARENT_FILE
            if kept.exists():
                return json.loads(kept.read_text())["run_id"]
            parent = self.client.create_run(experiment_id, run_name=sweep_name(sweep_dir),
                                            tags={"trainflow.sweep_dir": str(sweep_dir)}).info.run_id
            kept.write_text(json.dumps({"run_id": parent, "tracking_uri": self.uri}))
            return parent


def source_tags(run: RunInfo) -> dict[str, str]:
    """For a run started from another run's checkpoint: that checkpoint, and that run's tracked run where known."""
    tags = {}
    if run.source_checkpoint is not None:
        tags["trainflow.resumed_from"] = str(run.source_checkpoint)
    if run.source_id is not None:
        tags["trainflow.resumed_from_run"] = run.source_id
    return tags


def sweep_name(sweep_dir: Path) -> str:
    """A sweep's readable name: its folder below multirun/ (`2026-11-30/22-29-39`), else the folder's name."""
    parts = sweep_dir.parts
    return "/".join(parts[parts.index("multirun") + 1:]) if "multirun" in parts[:-1] else sweep_dir.name


def finish_sweep(sweep_dir: Path, files: list[Path]) -> None:
    """The sweep's report on its parent run, which then ends as FINISHED (nothing when no job tracked one)."""
    kept = sweep_dir / PARENT_FILE
    if not kept.exists():
        return
    from mlflow.tracking import MlflowClient  # lazy: mlflow is the mlflow extra

    parent = json.loads(kept.read_text())
    client = MlflowClient(parent["tracking_uri"])
    try:
        for path in files:
            if path.exists():
                client.log_artifact(parent["run_id"], str(path))
        client.set_terminated(parent["run_id"], "FINISHED")
    except Exception as exc:  # the jobs' runs are complete: a store gone at the end costs only the report there
        log.warning("logger.mlflow: the sweep's report did not reach its parent run %s (%s: %s)", parent["run_id"],
                    type(exc).__name__, first_line(exc))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"optim": {"lr": 0.001}}` -> `{"optim.lr": "0.001"}`; lists and null as their text."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)
    return flat


def _check_store(uri: str) -> None:
    """A store that cannot work is one line before training: a server that does not answer, an unwritable file."""
    if uri.startswith(("http://", "https://")):
        import requests  # lazy: requests comes with the mlflow extra

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=5).raise_for_status()
        except requests.RequestException as exc:
            raise ConfigError(f"logger.mlflow.tracking_uri: no MLflow server answers at {uri} ({type(exc).__name__}); "
                              "start it (mlflow server --backend-store-uri sqlite:///mlflow.db), or leave "
                              "logger.mlflow.tracking_uri unset for the local store outputs/mlflow.db") from None
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if (exc := cannot_write(folder)) is not None:
            raise ConfigError(f"logger.mlflow.tracking_uri: cannot write the MLflow store in {folder} "
                              f"({unwritable_reason(folder, exc)}); point logger.mlflow.tracking_uri at "
                              "sqlite:///<a writable path>, or run with a writable outputs/") from None


def _git_commit() -> str | None:
    """The working directory's commit, where it is a git checkout."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    return None
