"""Nothing a run wrote is replaced unasked: a finished command run again changes nothing, another config never
writes over a folder's results (it continues from its own checkpoint and keeps the earlier summary, or is refused in
one line naming the difference), and a refused command leaves the folder as it was (trainflow.record.kept,
trainflow.util.rundir). Real runs of TINY_GPT in real folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, Run, one_line_error, train

from trainflow.record import kept

# 4 steps, a save at 2 and 4; the run's ledger beside it
CHECKPOINTED = [*TINY_GPT, "trainer.max_steps=4", "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp",
                "checkpoint.every_steps=2", "checkpoint.verify=false"]
PLAIN = [*TINY_GPT, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_steps=1"]


def every_byte(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (the lock and Hydra's files too), and every folder: the whole tree."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}


def with_ledger(run_dir: Path, *overrides: str) -> Run:
    return train(run_dir, *overrides, f"metrics.ledger={run_dir.parent / 'ledger.jsonl'}")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpointed run that finished its 4 steps."""
    run = with_ledger(tmp_path_factory.mktemp("finished") / "run", *CHECKPOINTED)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary["steps"] == 4
    return run.run_dir


def test_a_finished_command_run_again_changes_nothing(finished: Path) -> None:
    """On main: "nothing left to train", then summary.json rewritten with no figures and an empty ledger row."""
    results = [finished / "summary.json", finished / "metrics.jsonl", finished.parent / "ledger.jsonl"]
    before = [p.read_bytes() for p in results]
    again = with_ledger(finished, *CHECKPOINTED)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if "finished already" in line]
    assert said == [f"finished already in {finished} (step 4, the same config): nothing to do, its results kept "
                    "(summary.json, metrics.jsonl); to train again, give this run its own folder "
                    "(trainer.run_name=<new name> or hydra.run.dir=<new folder>)"]
    assert "nothing left to train" not in again.stdout + again.stderr
    assert [p.read_bytes() for p in results] == before
    assert len(before[2].splitlines()) == 1  # the ledger holds the first run's row only


def test_another_config_with_nothing_left_to_train_is_refused_and_changes_nothing(finished: Path) -> None:
    before = every_byte(finished)
    run = with_ledger(finished, *CHECKPOINTED, "trainer.log_every=2")
    one_line_error(run, f"hydra.run.dir: {finished} holds the summary.json and metrics.jsonl of an earlier run",
                   "finished at step 4 with other settings (trainer.log_every: 1 -> 2)", "nothing was changed",
                   "raise trainer.max_steps", "its own folder")
    assert every_byte(finished) == before


def test_another_config_that_would_start_over_is_refused_and_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    """No checkpoint to continue: on main the second run trained from step 0 in the same folder, replaced its
    summary.json and logged steps 1-2 into metrics.jsonl a second time, from another config."""
    first = train(tmp_path / "run", *PLAIN)
    assert first.returncode == 0, first.stderr[-3000:]
    before = every_byte(first.run_dir)
    run = train(first.run_dir, *PLAIN, "trainer.log_every=2")  # not in the run's name: the same folder
    one_line_error(run, f"hydra.run.dir: {first.run_dir} holds the summary.json and metrics.jsonl of an earlier run "
                        "with other settings (trainer.log_every: 1 -> 2)", "would start again at step 0",
                   "nothing was changed", "trainer.run_name=<new name>")
    assert every_byte(first.run_dir) == before


def test_a_continued_run_says_what_differs_and_keeps_the_earlier_summary(finished: Path, tmp_path: Path) -> None:
    """More steps and another log cadence continue the run from its checkpoint at step 4; what differs is one line
    at the start, and the 4-step summary.json stays beside the new one as summary.1.json."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir, symlinks=True)  # a copy: the module's finished run stays as it is
    earlier = (run_dir / "summary.json").read_bytes()
    run = train(run_dir, *CHECKPOINTED, "trainer.max_steps=6", "trainer.log_every=2")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "this run continues" in line]
    assert lines == [f"this run continues {run_dir} from step 4, with other settings than its last run: "
                     f"metrics.ledger: {finished.parent / 'ledger.jsonl'} -> auto, trainer.log_every: 1 -> 2, "
                     "trainer.max_steps: 4 -> 6"]
    assert (run_dir / "summary.1.json").read_bytes() == earlier
    assert (run.summary["steps"], run.summary["resumed_from_step"]) == (6, 4)
    assert [m["step"] for m in run.metrics() if "train/loss" in m] == [1, 2, 3, 4, 6]


def test_a_refused_command_leaves_no_folder_behind(tmp_path: Path) -> None:
    """From an empty folder, as a user types it: on main a misspelt key left outputs/<date>/<time> with .hydra,
    .lock and an empty train.log, which `trainflow report outputs` listed as INTERRUPTED."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    # a key no schema has exits 1, a value that cannot work 2 (README's exit codes)
    for bad, code in (("optim.learning_rate=1e-3", 1), ("trainer.max_steps=-1", 2),
                      ("data.paths=[/no/such/corpus]", 2)):
        proc = run_process([sys.executable, str(ROOT / "train.py"), *PLAIN, bad], tmp_path, env, 300)
        one_line_error(proc, exit_code=code)
        assert sorted(p.name for p in tmp_path.iterdir()) == [], bad


def test_differences_name_every_changed_leaf() -> None:
    old = {"compile": {"enabled": False, "mode": None}, "trainer": {"max_steps": 30}, "gone": 1}
    new = {"compile": {"enabled": True, "mode": None}, "trainer": {"max_steps": 30}, "added": {"a": 2}}
    assert kept.differences(old, new) == ["added.a: (none) -> 2", "compile.enabled: False -> True",
                                          "gone: 1 -> (none)"]
    assert kept.said([f"k{i}: 0 -> 1" for i in range(6)]) == "k0: 0 -> 1, k1: 0 -> 1, k2: 0 -> 1, k3: 0 -> 1 and 2 more"


def test_a_summary_of_another_config_is_kept_aside_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"config": {"a": 1}}))
    (tmp_path / "summary.1.json").write_text("an earlier one")
    assert kept.keep_summary_aside(tmp_path, {"a": 1}) is None  # the same config's: the run's own
    assert kept.keep_summary_aside(tmp_path, {"a": 2}) == tmp_path / "summary.2.json"
    assert json.loads((tmp_path / "summary.2.json").read_text()) == {"config": {"a": 1}}
    assert (tmp_path / "summary.1.json").read_text() == "an earlier one" and not (tmp_path / "summary.json").exists()
