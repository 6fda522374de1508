"""The W&B logger, offline: its run files read back record by record with wandb's own protobufs (the scalars by
step, the config, the summary, the exit code; trainflow.loggers.wandb_files, as wandb 0.31 reads them only in its
Go core); a run stopped after a save and resumed is one W&B run id with each step once, and so is one killed
outright; a `python train.py` run without an API key or WANDB_MODE is offline, below its run directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import TINY_GPT, ok, train
from omegaconf import OmegaConf

from trainflow.config.schema import plain, typed_run
from trainflow.loggers import RunInfo
from trainflow.loggers.wandb import WandbLogger
from trainflow.loggers.wandb_files import offline_runs, records
from trainflow.loggers.writer import MetricsWriter

wandb = pytest.importorskip("wandb")  # the dev extra has it; a bare install of trainflow does not

# the typed config a run's writer gets (single, the schema's defaults, a learning rate of 0.1)
CONFIG = typed_run({"trainer": {"max_steps": 10}, "model": {}, "data": {}, "task": {}, "optim": {"lr": 0.1},
                    "logger": {}})


def of_kind(recs: list, kind: str) -> list:
    return [getattr(r, kind) for r in recs if r.WhichOneof("record_type") == kind]


def items(update) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update}


def run_records(folder: Path) -> list:
    return records(next(folder.glob("run-*.wandb")))


def history(recs: list, key: str = "train/loss") -> list[tuple[int, float]]:
    rows = [items(h.item) for h in of_kind(recs, "history")]
    return [(row["_step"], row[key]) for row in rows if key in row]


SUMMARY = {"steps": 10, "validation": {"loss": 1.25}, "steady_state": {"samples_per_sec": 80.0, "step_time_s": 0.1},
           "mfu": 0.02, "peak_memory_bytes": 3 * 2**20}


def writer(run_dir: Path, logger: WandbLogger) -> MetricsWriter:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(plain(CONFIG)))
    (run_dir / "summary.json").write_text(json.dumps(SUMMARY))
    return MetricsWriter(run_dir, True, {"wandb": logger})


def test_a_stopped_and_resumed_run_is_one_offline_wandb_run_with_each_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    run_dir = tmp_path / "run"
    keys = {"project": "vision", "tags": ["tiny"], "notes": "a smoke run"}
    stopped = writer(run_dir, WandbLogger(**keys))
    stopped.start(CONFIG, 1, None)
    for step in range(1, 6):
        stopped.write(step, {"train/loss": 10.0 - step})
    stopped.finish("KILLED")  # a stop on a signal after the save of step 5
    stopped.close()
    wandb.teardown()  # the W&B service writes the run files out when it stops, as at the stopped process's exit
    run_id = json.loads((run_dir / "loggers.json").read_text())["wandb"]
    resumed = writer(run_dir, WandbLogger(**keys))
    resumed.start(CONFIG, 1, 5)
    for step in range(5, 11):  # step 5 is in the tracked run already: not again
        resumed.write(step, {"train/loss": 100.0 + step})
    resumed.finish("FINISHED", SUMMARY)
    resumed.close()
    wandb.teardown()  # the W&B service writes the run files out when it stops, as at a training process's exit
    assert json.loads((run_dir / "loggers.json").read_text())["wandb"] == run_id
    folders = offline_runs(tmp_path / "wb" / "wandb", run_id)
    first, second = map(run_records, folders)
    assert history(first) == [(s, 10.0 - s) for s in range(1, 6)]
    assert history(second) == [(s, 100.0 + s) for s in range(6, 11)]
    assert [e.exit_code for e in of_kind(first, "exit")] == [75]  # not finished: W&B shows it as such
    assert [e.exit_code for e in of_kind(second, "exit")] == [0]
    for recs in (first, second):
        (run,) = of_kind(recs, "run")
        assert (run.run_id, run.project, list(run.tags), run.notes, run.display_name) == (
            run_id, "vision", ["tiny"], "a smoke run", "run")
        config = items(run.config.update)
        assert config["optim"] == plain(CONFIG)["optim"] and config["trainer"] == plain(CONFIG)["trainer"]
        assert config["optim"]["lr"] == 0.1 and config["trainer"]["max_steps"] == 10
    summary: dict = {}
    for update in of_kind(second, "summary"):
        summary.update(items(update.update))
    assert summary["summary/val_loss"] == 1.25 and summary["summary/peak_memory_mib"] == 3.0
    assert summary["train/loss"] == 110.0
    files = folders[1] / "files"
    assert json.loads((files / "summary.json").read_text()) == SUMMARY
    assert OmegaConf.load(files / "config.yaml") == plain(CONFIG)


def test_train_py_without_a_key_logs_offline_below_the_run_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No WANDB_MODE, no WANDB_API_KEY, no .netrc: offline, in <run dir>/wandb, with the group given; under DDP on
    2 ranks, one W&B run, rank 0's."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as proxy:  # every HTTP(S) request of the run, W&B's Go core included, would come here
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        address = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        env = {"NETRC": str(tmp_path / "no.netrc"), "HTTPS_PROXY": address, "HTTP_PROXY": address}
        run = ok(train(tmp_path / "run", *[o for o in TINY_GPT if o != "logger=none"], "logger=[tensorboard,wandb]",
                       "trainer.max_steps=3", "logger.wandb.group=ablation", "parallelism=ddp",
                       "parallelism.nproc_per_node=2", env=env))
        proxy.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached the network
            proxy.accept()
    run_id = json.loads((run.run_dir / "loggers.json").read_text())["wandb"]
    (folder,) = offline_runs(run.run_dir / "wandb", run_id)
    assert [d.name for d in (run.run_dir / "wandb").glob("*run-*")] == [folder.name]  # nothing of rank 1
    recs = run_records(folder)
    jsonl = {m["step"]: m["train/loss"] for m in run.metrics() if "train/loss" in m}
    assert dict(history(recs)) == pytest.approx(jsonl, rel=1e-12) and sorted(jsonl) == [1, 2, 3]
    (info,) = of_kind(recs, "run")
    assert info.run_group == "ablation" and items(info.config.update)["trainer"]["max_steps"] == 3
    summary: dict = {}
    for update in of_kind(recs, "summary"):
        summary.update(items(update.update))
    assert summary["summary/val_loss"] == pytest.approx(run.summary["validation"]["loss"])
    assert [e.exit_code for e in of_kind(recs, "exit")] == [0]
    assert (run.run_dir / "tensorboard").is_dir()


def test_a_sweep_job_is_grouped_by_its_sweep_and_named_by_its_swept_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sweep = tmp_path / "multirun" / "day" / "time"
    logger = WandbLogger()
    run_id = logger.start(RunInfo(sweep / "0", {"optim": {"lr": 0.001}}, "", {}, "optim.lr=0.001", sweep, None, None,
                                  1))
    logger.text("profiler", "| operator | self ms/step |", 3)
    logger.finish("FAILED")
    wandb.teardown()
    (folder,) = offline_runs(tmp_path / "wandb", run_id)
    recs = run_records(folder)
    (info,) = of_kind(recs, "run")
    assert (info.run_group, info.display_name, info.project) == ("day/time", "optim.lr=0.001", "trainflow")
    assert [e.exit_code for e in of_kind(recs, "exit")] == [1]
    assert (folder / "files" / "profiler.md").read_text() == "| operator | self ms/step |"


CRASH = """
import os, signal, sys
from pathlib import Path
from omegaconf import OmegaConf
from trainflow.config.schema import typed_run
from trainflow.loggers.wandb import WandbLogger
from trainflow.loggers.writer import MetricsWriter
run_dir = Path(sys.argv[1])
writer = MetricsWriter(run_dir, True, {"wandb": WandbLogger()})
writer.start(typed_run(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))), 1, None)
for step in range(1, 8):
    writer.write(step, {"train/loss": 10.0 - step})
os.kill(os.getpid(), signal.SIGKILL)  # a crash after the checkpoint of step 5: W&B gets no chance to write out
"""


def test_a_run_killed_outright_and_resumed_holds_each_step_once(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What the killed process's W&B run holds (its service dies with it: often nothing) is read back; the resumed
    process logs again the steps up to the resumed one from metrics.jsonl, then its own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    run_dir = tmp_path / "run"
    writer(run_dir, WandbLogger())  # the run directory's files
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(run_dir)], capture_output=True, text=True,
                             timeout=120, env=os.environ)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    run_id = json.loads((run_dir / "loggers.json").read_text())["wandb"]
    resumed = writer(run_dir, WandbLogger())
    resumed.start(CONFIG, 1, 5)  # the checkpoint of step 5; metrics.jsonl keeps the crashed process's 1..5
    for step in range(6, 11):
        resumed.write(step, {"train/loss": 100.0 + step})
    resumed.finish("FINISHED")
    resumed.close()
    wandb.teardown()
    logged = [row for folder in offline_runs(tmp_path / "wb" / "wandb", run_id) for row in history(run_records(folder))]
    assert sorted(logged) == [(s, 10.0 - s) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 11)]


def test_a_run_resumed_from_another_runs_checkpoint_is_a_new_wandb_run_that_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run B resumes run A's checkpoint of step 5 (outside B's checkpoint folder), whose state names A's W&B run: B
    is a new W&B run whose config names that checkpoint and A's id; A's run folders hold A's steps only. A
    checkpoint of B's own continues B's run, as every resume does."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    source = tmp_path / "a" / "checkpoints" / "step_00000005"
    a = writer(tmp_path / "a", WandbLogger())
    a_id = a.start(CONFIG, 1, None)["wandb"]
    for step in range(1, 6):
        a.write(step, {"train/loss": 10.0 - step})
    a.finish("FINISHED")
    a.close()
    wandb.teardown()
    b = writer(tmp_path / "b", WandbLogger())
    b_id = b.start(CONFIG, 1, 5, {"wandb": a_id}, source, tmp_path / "b" / "checkpoints")["wandb"]
    for step in range(6, 9):
        b.write(step, {"train/loss": 100.0 + step})
    b.finish("FINISHED")
    b.close()
    wandb.teardown()
    assert b_id != a_id
    (a_folder,) = offline_runs(tmp_path / "wb" / "wandb", a_id)
    assert history(run_records(a_folder)) == [(s, 10.0 - s) for s in range(1, 6)]
    (b_folder,) = offline_runs(tmp_path / "wb" / "wandb", b_id)
    recs = run_records(b_folder)
    assert history(recs) == [(s, 100.0 + s) for s in range(6, 9)]
    config = items(of_kind(recs, "run")[0].config.update)
    assert config["trainflow.resumed_from"] == str(source) and config["trainflow.resumed_from_run"] == a_id
    own = writer(tmp_path / "b", WandbLogger())  # B again, from its own checkpoint of step 8
    assert own.start(CONFIG, 1, 8, {"wandb": b_id}, tmp_path / "b" / "checkpoints" / "step_00000008",
                     tmp_path / "b" / "checkpoints")["wandb"] == b_id
    own.finish("FINISHED")
    own.close()
    wandb.teardown()
