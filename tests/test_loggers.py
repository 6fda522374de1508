"""Loggers: a real `mlflow server` on the loopback (SQLite backend) and the server-less SQLite default, read back
with MlflowClient; TensorBoard's events read back with TensorBoard's reader; metrics.jsonl. One tracked run across
a SIGTERM stop and the resume; replayed steps once; a server killed mid-run said once; a 2-job sweep as a parent
run with two children.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, start, wait_for
from omegaconf import OmegaConf

from trainflow.config.schema import named_sections, plain, typed_run
from trainflow.loggers.mlflow import MLflowLogger
from trainflow.loggers.tensorboard import TensorBoardLogger
from trainflow.loggers.writer import MetricsWriter

pytest.importorskip("mlflow")  # the dev extra has it; a bare install of trainflow does not

LOGGED = [o for o in TINY_GPT if o != "logger=none"] + ["trainer.eval_steps=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` on 127.0.0.1 with a SQLite backend and its own artifact folder, in its own process group."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{free_port()}"
        port = self.uri.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", port,
             "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--artifacts-destination", str(folder / "artifacts")],
            stdout=open(folder / "server.out", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115 (the child owns it)
            # no job runner (8 worker processes that trainflow never uses): the server starts in half the time
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, start_new_session=True)
        import requests

        def up() -> bool:
            try:
                return requests.get(f"{self.uri}/health", timeout=1).ok
            except requests.RequestException:
                return False

        wait_for(up, self.proc, "the MLflow server answers", timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("mlflow"))
    yield started
    started.stop()


def steps_of(history: list) -> list[int]:
    return [m.step for m in sorted(history, key=lambda m: m.step)]


@pytest.fixture(scope="module")
def resumed(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The issue's command, stopped with SIGTERM after its first checkpoint, then the same command again."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    command = [*LOGGED, "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={server.uri}", "checkpoint=dcp",
               "checkpoint.every_steps=5", "trainer.max_steps=20"]
    first = start(run_dir, *command)
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000005" / "manifest.json").is_file(), first, "checkpoint 5")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 75, (run_dir.parent / "run.out").read_text()[-3000:]
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "loggers.json").read_text())["mlflow"]
    assert MlflowClient(server.uri).get_run(run_id).info.status == "KILLED"  # stopped on a signal, saved
    second = start(run_dir, *command)
    assert second.wait(timeout=300) == 0, (run_dir.parent / "run.out").read_text()[-3000:]
    return run_dir


def test_a_stopped_and_resumed_run_is_one_mlflow_run_with_each_step_once(server: Server, resumed: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    assert run.info.run_id == json.loads((resumed / "loggers.json").read_text())["mlflow"]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    # marked as model training: MLflow 3's UI opens it on its runs table (its GenAI view would show no run)
    experiment = client.get_experiment_by_name("trainflow")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    link = f"{server.uri}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"  # the table
    assert f"mlflow: run run in experiment trainflow: {link}" in (resumed / "train.log").read_text()
    assert steps_of(client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, 21))
    jsonl = {r["step"]: r["train/loss"] for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r}
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(jsonl, rel=1e-12)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and 5 <= summary["resumed_from_step"] < 20
    assert run.data.metrics["summary/val_loss"] == pytest.approx(summary["validation"]["loss"])
    assert run.data.params["trainer.max_steps"] == "20" and run.data.params["checkpoint.every_steps"] == "5"
    assert run.data.params["optim.betas"] == "[0.9, 0.95]"  # lists as their JSON text
    tags = run.data.tags
    assert tags["trainflow.run_dir"] == str(resumed) and tags["trainflow.world_size"] == "1"
    assert tags["trainflow.strategy"] == "single" and tags["trainflow.host"] == socket.gethostname()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == commit
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.json"}
    saved = Path(client.download_artifacts(run.info.run_id, "summary.json", str(resumed.parent)))
    assert json.loads(saved.read_text())["steps"] == 20


def test_a_stopped_and_resumed_run_shows_each_step_once_in_tensorboard_and_metrics_jsonl(resumed: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/train")] == list(range(1, 21))
    assert len(list((resumed / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one a process, one run
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 21))


def writer(run_dir: Path, **loggers) -> MetricsWriter:
    """The metrics writer of a run directory holding a config.yaml, with `loggers`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(plain(CONFIG)))
    return MetricsWriter(run_dir, True, loggers)


# the typed config a run's writer gets (single, the schema's defaults, a learning rate of 0.1)
CONFIG = typed_run({"trainer": {"max_steps": 10}, "model": {}, "data": {}, "task": {}, "optim": {"lr": 0.1},
                    "logger": {}})


def test_steps_replayed_after_a_crash_appear_once_in_every_logger(tmp_path: Path) -> None:
    """A crash at step 7 after the checkpoint of step 5: the resumed process logs 6 and 7 again."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    crashed = writer(run_dir, tensorboard=TensorBoardLogger(), mlflow=MLflowLogger(uri))
    crashed.start(CONFIG, 1, None)
    for step in range(1, 8):
        crashed.write(step, {"train/loss": 10.0 - step})
    crashed.loggers["tensorboard"]._writer.flush()  # what the crashed process had written (flush_secs)
    crashed.loggers["mlflow"].settle()  # and sent
    crashed.close()  # no finish: the process died
    resumed = writer(run_dir, tensorboard=TensorBoardLogger(), mlflow=MLflowLogger(uri))
    resumed.start(CONFIG, 1, 5)
    for step in range(6, 11):
        resumed.write(step, {"train/loss": 100.0 + step})
    resumed.finish("FINISHED")
    resumed.close()
    once = [(s, 10.0 - s) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 11)]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in jsonl] == once
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/train")] == once
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id == json.loads((run_dir / "loggers.json").read_text())[
        "mlflow"]
    # the tracked run keeps the crashed process's steps 1..7 (MLflow cannot take them back): 6 and 7 appear once
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, 10.0 - s) for s in range(1, 8)] + [
        (s, 100.0 + s) for s in range(8, 11)]


def test_steps_a_crash_kept_from_the_store_are_logged_again_from_metrics_jsonl(tmp_path: Path) -> None:
    """The crashed process's last batches (steps 4..7) never reached the store (its logger's process died with
    it): the resume at 5 logs 4 and 5 again from metrics.jsonl, then its own 6..10: each step once."""
    from mlflow.tracking import MlflowClient

    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    crashed = writer(run_dir, mlflow=MLflowLogger(uri))
    crashed.start(CONFIG, 1, None)
    for step in range(1, 4):
        crashed.write(step, {"train/loss": 10.0 - step})
    crashed.loggers["mlflow"].settle()
    crashed.loggers = {}  # what it wrote from here on reached metrics.jsonl only
    for step in range(4, 8):
        crashed.write(step, {"train/loss": 10.0 - step})
    crashed.close()
    resumed = writer(run_dir, mlflow=MLflowLogger(uri))
    resumed.start(CONFIG, 1, 5)
    for step in range(6, 11):
        resumed.write(step, {"train/loss": 100.0 + step})
    resumed.finish("FINISHED")
    resumed.close()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, 10.0 - s) for s in range(1, 6)] + [
        (s, 100.0 + s) for s in range(6, 11)]


def test_a_sweep_is_a_parent_run_with_its_jobs_as_children_in_the_sqlite_default(tmp_path: Path) -> None:
    """`-m` with logger=[mlflow] and no tracking_uri: outputs/mlflow.db below the working directory, no server."""
    from mlflow.tracking import MlflowClient

    sweep = tmp_path / "multirun" / "day" / "time"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *LOGGED, "logger=[mlflow]",
                        "trainer.max_steps=2", "optim.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                      key=lambda r: r.info.run_name)
    assert parent.info.run_name == "day/time" and parent.info.status == "FINISHED" and len(runs) == 3
    assert [r.info.run_name for r in children] == ["optim.lr=0.0003", "optim.lr=0.001"]
    assert [r.data.params["optim.lr"] for r in children] == ["0.0003", "0.001"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["train/loss"] > 0 for r in children)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"report.md", "report.json", "report.png"}


def test_two_ddp_ranks_log_once_through_rank_0(tmp_path: Path) -> None:
    """Under DDP on 2 ranks only rank 0 logs: one MLflow run (world size 2) and one TensorBoard event file, each
    step once; rank 1 writes nothing of its own."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = run_process([sys.executable, str(ROOT / "train.py"), *LOGGED, "logger=[tensorboard,mlflow]",
                        "parallelism=ddp", "parallelism.nproc_per_node=2", "trainer.max_steps=4",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    assert run.data.tags["trainflow.world_size"] == "2" and run.info.status == "FINISHED"
    assert steps_of(client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3, 4]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/train")] == [1, 2, 3, 4]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]


def test_a_resume_continues_the_tracked_run_that_its_checkpoint_names(tmp_path: Path) -> None:
    """The tracked run's id is saved in each checkpoint too: a resume whose run directory lost loggers.json (a
    checkpoint.dir elsewhere, a cleaned folder) continues the same MLflow run, each step once."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"

    def command(steps: int) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), *LOGGED, "logger=[mlflow]", "checkpoint=dcp",
                "checkpoint.every_steps=2", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]

    first = run_process(command(2), cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    tracked = json.loads((run_dir / "loggers.json").read_text())
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["tracked_runs"] == tracked
    (run_dir / "loggers.json").unlink()
    again = run_process(command(4), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("trainflow").experiment_id])
    assert run.info.run_id == tracked["mlflow"] and run.info.status == "FINISHED"
    assert steps_of(client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3, 4]


def test_resuming_another_runs_checkpoint_starts_a_new_mlflow_run_that_names_it(tmp_path: Path) -> None:
    """Run B resumes run A's last checkpoint (checkpoint.resume=<A's step_4>) in a run directory of its own: a new
    MLflow run, tagged with that checkpoint and A's run id; A's run keeps exactly what A logged (its steps, its
    summary.json, its params and status). B's own checkpoints name B's run, so B's own resume continues it."""
    from mlflow.tracking import MlflowClient

    source = tmp_path / "a" / "checkpoints" / "step_00000004"

    def command(run_dir: Path, steps: int, *more: str) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), *LOGGED, "logger=[mlflow]", "checkpoint=dcp",
                "checkpoint.every_steps=2", f"trainer.max_steps={steps}", "trainer.eval_every=0",
                f"hydra.run.dir={run_dir}", *more]

    first = run_process(command(tmp_path / "a", 4), cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    a_id = json.loads((tmp_path / "a" / "loggers.json").read_text())["mlflow"]

    def record(run_id: str) -> dict:
        run = client.get_run(run_id)
        summary = Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / run_id)))
        return {"steps": steps_of(client.get_metric_history(run_id, "train/loss")), "status": run.info.status,
                "max_steps": run.data.params["trainer.max_steps"], "summary_steps": json.loads(summary.read_text())[
                    "steps"], "tags": {k: v for k, v in run.data.tags.items() if k.startswith("trainflow.")}}

    before = record(a_id)
    assert before["steps"] == [1, 2, 3, 4] and before["summary_steps"] == 4
    second = run_process(command(tmp_path / "b", 6, f"checkpoint.resume={source}"), cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    b_id = json.loads((tmp_path / "b" / "loggers.json").read_text())["mlflow"]
    assert b_id != a_id and record(a_id) == before
    b = record(b_id)
    assert b["steps"] == [5, 6] and b["summary_steps"] == 6 and b["status"] == "FINISHED"
    assert b["max_steps"] == "6" and b["tags"]["trainflow.run_dir"] == str(tmp_path / "b")
    assert b["tags"]["trainflow.resumed_from"] == str(source) and b["tags"]["trainflow.resumed_from_run"] == a_id
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_00000006" / "state.json").read_text())
    assert state["tracked_runs"] == {"mlflow": b_id}


def test_a_server_killed_mid_run_is_said_once_and_the_run_goes_on(server: Server, resumed: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Last: it stops the module's server (after the resumed run, which it waits for). The logger is built as a
    run builds it, in a process of its own: its failure comes back to the writer as it would in-process."""
    from trainflow.loggers import build_loggers
    from trainflow.loggers.process import ProcessLogger

    loggers = build_loggers(named_sections("logger", {"mlflow": {"_target_": "trainflow.loggers.mlflow.MLflowLogger",
                                                                 "tracking_uri": server.uri}}))
    assert isinstance(loggers["mlflow"], ProcessLogger)
    run = writer(tmp_path / "run", **loggers)
    run.start(CONFIG, 1, None)
    run.write(1, {"train/loss": 1.0})
    server.stop()
    with caplog.at_level(logging.WARNING, logger="trainflow.loggers.writer"):
        for step in range(2, 5):
            run.write(step, {"train/loss": float(step)})
        run.finish("FINISHED")
    run.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainflow.loggers.writer"]
    assert len(warnings) == 1 and warnings[0].startswith("logger.mlflow failed (MlflowException: ")
    assert warnings[0].endswith("the run goes on without it, metrics.jsonl keeps every value")
    assert run.loggers == {}
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        1, 2, 3, 4]


def test_a_logger_of_ones_own_is_one_yaml_with_a_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/my_project's CSV logger, built from its YAML as `logger=[csv]` composes it, fed by the writer."""
    from trainflow.loggers import build_loggers

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "my_project"))
    section = OmegaConf.load(ROOT / "examples" / "my_project" / "conf" / "logger" / "csv.yaml")
    run = writer(tmp_path / "run", **build_loggers(named_sections("logger", OmegaConf.to_container(section))))
    run.start(CONFIG, 1, None)
    run.write(2, {"train/loss": 1.5, "perf/mfu": float("nan"), "note": "text"})  # finite numbers only
    run.finish("FINISHED")
    run.close()
    rows = (tmp_path / "run" / "scalars.csv").read_text().splitlines()
    assert rows == ["step,name,value", "2,train/loss,1.5", ",status,FINISHED"]


def test_a_run_in_a_folder_named_by_the_clock_is_named_by_what_it_trains_in_the_trackers() -> None:
    from trainflow.loggers import readable_name
    from trainflow.util.rundir import run_identity

    overrides = ["model=mlp", "optim.lr=0.01"]
    assert readable_name(Path("outputs/2026-12-06/17-55-19"), overrides) == run_identity(overrides)
    assert run_identity(overrides).startswith("model=mlp,optim.lr=0.01-")
    assert readable_name(Path("outputs/2026-12-06/17-55-19"), ["trainer.run_name=mine"]) == "mine"
    assert readable_name(Path("/data/runs/baseline"), overrides) == "baseline"  # a folder of one's own: its name
