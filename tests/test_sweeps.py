"""Sweeps that resume: the same `python train.py -m ...` after an interruption skips the finished jobs, resumes the
interrupted one from its checkpoint and runs the rest; a failing job fails only itself; jobs never share a
checkpoint folder. Real sweeps of TINY_GPT under Hydra's own launcher and trainflow's process launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import left_behind, run_process, start_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, wait_for

from trainflow.errors import ConfigError
from trainflow.record.sweeps import FRESH, IDENTITY_FILE, claim_checkpoint_dir
from trainflow.report import runs as report
from trainflow.util.rundir import FOLDER_CHARS, existing_or_new, folder_name, run_name

STEPS = 8
# 4 jobs: seeds 1,1,2,2; keep_last changes no loss, so job 0 is an uninterrupted twin of job 1
SWEEP = [*TINY_GPT, "checkpoint=dcp", "checkpoint.every_steps=100", "checkpoint.verify=false",
         f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.eval_steps=2",
         "trainer.seed=1,2", "checkpoint.keep_last=2,3"]


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PYTHONUNBUFFERED": "1"}


def command(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "-m", *overrides]


def multirun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_process(command(*overrides), cwd, _env())


def skipped(output: str) -> list[str]:
    return [line.split("job #")[1].split()[0] for line in output.splitlines() if "sweep: job #" in line]


@dataclass
class Resumed:
    sweep: Path
    ckpt_root: Path
    first_rc: int
    first_output: str
    while_running: dict  # the report built while job 1 trained
    after_stop: dict  # the report built after the interruption
    stopped: dict  # job 1's summary.json after the interruption
    job0_metrics: bytes
    second: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    """The sweep, interrupted by SIGTERM while job 1 trains (jobs 2-3 not started), then the same command again."""
    cwd = tmp_path_factory.mktemp("sweeps")
    ckpt_root = cwd / "ck"
    overrides = [*SWEEP, f"checkpoint.dir={ckpt_root}"]  # one explicit folder for the whole sweep
    sweep = cwd / "multirun" / folder_name(overrides)  # named by the sweep's overrides: the same command, the same one
    out = cwd / "first.out"
    proc = start_process(command(*overrides), cwd, _env(), out)
    try:
        metrics = sweep / "1" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and max(losses_by_step(sweep / "1"), default=0) >= 2, proc, "job 1 step 2")
        proc.send_signal(signal.SIGSTOP)  # job 1 cannot finish its 8 steps while the report is built
        while_running = report.build(sweep)
        proc.send_signal(signal.SIGTERM)  # delivered when it continues
        proc.send_signal(signal.SIGCONT)
        first_rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    after_stop = report.build(sweep)
    stopped = json.loads((sweep / "1" / "summary.json").read_text())
    job0_metrics = (sweep / "0" / "metrics.jsonl").read_bytes()
    second = multirun(cwd, *overrides)
    return Resumed(sweep, ckpt_root, first_rc, out.read_text(), while_running, after_stop, stopped, job0_metrics,
                   second)


def _statuses(built: dict) -> dict[str, str]:
    return {row["name"]: row["status"] for row in built["runs"]}


def test_interrupted_sweep_stops_with_a_checkpoint_and_reports_it(resumed: Resumed) -> None:
    assert resumed.first_rc == 75, resumed.first_output[-3000:]  # trainflow's stopped-with-a-checkpoint code
    assert _statuses(resumed.while_running) == {"0": "finished", "1": "running"}
    assert _statuses(resumed.after_stop) == {"0": "finished", "1": "interrupted"}  # jobs 2-3 never started
    assert "stopped by SIGTERM" in resumed.after_stop["runs"][1]["error"]
    stopped = resumed.stopped
    assert stopped["checkpoint"]["stopped_by"] == "SIGTERM" and 2 <= stopped["steps"] < STEPS
    assert stopped["resumed_from_step"] is None  # a fresh start: not job 0's checkpoint of the same folder


def test_the_same_command_skips_resumes_and_runs_the_rest(resumed: Resumed) -> None:
    second, sweep = resumed.second, resumed.sweep
    assert second.returncode == 0, second.stderr[-3000:]
    assert skipped(second.stdout + second.stderr) == ["0"]  # one line, for job 0 only
    assert "trainer.sweep_name=<name>" in second.stdout  # the skip line says how to start afresh
    assert (sweep / "0" / "metrics.jsonl").read_bytes() == resumed.job0_metrics
    summaries = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(4)]
    assert [s["steps"] for s in summaries] == [STEPS] * 4
    assert summaries[1]["resumed_from_step"] == resumed.stopped["steps"]
    assert summaries[2]["resumed_from_step"] is None and summaries[3]["resumed_from_step"] is None
    assert losses_by_step(sweep / "1") == losses_by_step(sweep / "0")  # resumed = its uninterrupted twin
    assert losses_by_step(sweep / "2") != losses_by_step(sweep / "0")  # (another seed: the test can tell)
    written = json.loads((sweep / "report.json").read_text())
    assert [(r["name"], r["status"]) for r in written["runs"]] == [(str(n), "finished") for n in range(4)]


def test_jobs_have_checkpoint_folders_of_their_own(resumed: Resumed) -> None:
    """An explicit checkpoint.dir: <dir>/<sweep folder>/<job>, each naming the run identity it belongs to (on main,
    job 1 resumed job 0's last checkpoint there and trained nothing)."""
    folders = sorted(p for p in (resumed.ckpt_root / resumed.sweep.name).iterdir())
    assert [p.name for p in folders] == ["0", "1", "2", "3"]
    identities = [(p / IDENTITY_FILE).read_text().strip() for p in folders]
    # keep_last is how a run is kept, not what it trains: jobs 0 and 1 are one run identity, in two folders
    assert identities[0] == identities[1] != identities[2] == identities[3]
    saves = [sorted(c.name for c in p.glob("step_*")) for p in folders]
    stop = f"step_{resumed.stopped['steps']:08d}"
    assert saves == [[f"step_{STEPS:08d}"], [stop, f"step_{STEPS:08d}"], [f"step_{STEPS:08d}"], [f"step_{STEPS:08d}"]]
    summary = json.loads((resumed.sweep / "1" / "summary.json").read_text())
    assert summary["config"]["checkpoint"]["dir"] == str(folders[1])


@pytest.mark.serial
def test_a_job_ends_with_its_killed_sweep_and_the_same_sweep_resumes_it(tmp_path: Path) -> None:
    """hydra/launcher=process, its sweep process SIGKILLed while the job trains: the job's process gets SIGTERM
    from the kernel, saves and ends within seconds instead of training on, orphaned, for hours while it holds the
    job's directory; the same sweep command then resumes the job from that save (not "in use")."""
    overrides = [*TINY_GPT, "checkpoint=dcp", "checkpoint.every_steps=100000", "trainer.max_steps=100000",
                 "trainer.eval_every=0", "trainer.eval_steps=1", "hydra/launcher=process", "trainer.sweep_name=orphan"]
    job = tmp_path / "multirun" / "orphan" / "0"

    def trained(step: int) -> Callable[[], bool]:
        return lambda: (job / "train.log").exists() and f"step {step}/100000:" in (job / "train.log").read_text()

    with left_behind() as leftovers:
        first = start_process(command(*overrides), tmp_path, _env(), tmp_path / "first.out")
        wait_for(trained(2), first, "the job's step 2")
        first.kill()  # the sweep's own process only: its job is the kernel's to stop
        first.wait()
        killed = time.monotonic()
        assert leftovers(60) == {}
        ended_s = time.monotonic() - killed
    assert ended_s < 30
    stopped = json.loads((job / "summary.json").read_text())
    assert stopped["checkpoint"]["stopped_by"] == "SIGTERM" and stopped["checkpoint"]["committed"] == \
        [f"step_{stopped['steps']:08d}"]

    with left_behind() as leftovers:
        again = start_process(command(*overrides), tmp_path, _env(), tmp_path / "again.out")
        wait_for(trained(stopped["steps"] + 2), again, "the resumed job's second step")
        again.kill()
        again.wait()
        assert leftovers(60) == {}
    log = (job / "train.log").read_text()
    assert f"resumed from step {stopped['steps']} (" in log and "in use" not in (tmp_path / "again.out").read_text()


def test_a_folder_of_another_run_is_refused(tmp_path: Path) -> None:
    claim_checkpoint_dir(tmp_path, "run-a")
    claim_checkpoint_dir(tmp_path, "run-a")  # the same run continues there
    with pytest.raises(ConfigError, match=r"holds the checkpoints of another run \(run-a; this job is run-b\); "
                                          r"nothing was changed and nothing is resumed"):
        claim_checkpoint_dir(tmp_path, "run-b")
    assert (tmp_path / IDENTITY_FILE).read_text() == "run-a\n"


def test_a_failing_job_fails_only_itself_and_the_sweep(tmp_path: Path) -> None:
    """Job 1 cannot run: jobs 0 and 2 still train, the report names job 1's failure, the sweep exits non-zero.
    The same sweep again (under the process launcher: still the same sweep) skips 0 and 2 and runs 1 again."""
    overrides = [*TINY_GPT, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_steps=1",
                 "trainer.batch_size=4,0,8", "trainer.sweep_name=failing"]
    first = multirun(tmp_path, *overrides)
    sweep = tmp_path / "multirun" / "failing"
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    rows = json.loads((sweep / "report.json").read_text())["runs"]
    assert [(r["name"], r["status"], r["steps"]) for r in rows] == [("0", "finished", 2), ("1", "failed", None),
                                                                    ("2", "finished", 2)]
    assert rows[1]["error"] == "job #1 failed (exit code 2): trainer.batch_size: must be a positive integer; got 0"
    assert "1 failed" in (sweep / "report.md").read_text()

    again = multirun(tmp_path, *overrides, "hydra/launcher=process")
    assert again.returncode == 1, again.stderr[-3000:]
    assert skipped(again.stdout + again.stderr) == ["0", "2"]
    rows = json.loads((sweep / "report.json").read_text())["runs"]
    assert [r["status"] for r in rows] == ["finished", "failed", "finished"]
    assert rows[1]["error"].startswith("job #1 failed (exit code 2): trainer.batch_size: must be a positive")


def test_a_failed_optuna_trial_is_told_to_optuna_as_failed(tmp_path: Path) -> None:
    """hydra/sweeper=optuna under Hydra's own launcher: a trial that cannot run comes back to Optuna as a failed
    trial (its max_failure_rate decides whether the sweep goes on), not as an exit of the whole sweep."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    tiny = [o for o in TINY_GPT if not o.startswith("trainer.batch_size=")]  # the sampled key, not fixed
    proc = multirun(tmp_path, *tiny, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                    "hydra.sweeper.max_failure_rate=1.0", "hydra.sweeper.sampler.seed=1",
                    "trainer.batch_size=choice(0,8)", "trainer.max_steps=2", "trainer.eval_steps=1",
                    "trainer.sweep_name=optuna")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "multirun" / "optuna"
    rows = json.loads((sweep / "report.json").read_text())["runs"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(rows) == 3 and [r["overrides"] for r in failed] == [["trainer.batch_size=0"]]
    assert f"Failed experiment: job #{failed[0]['name']} failed (exit code 2): trainer.batch_size:" in proc.stdout
    assert "best_params:\n  trainer.batch_size: 8" in (sweep / "optimization_results.yaml").read_text()


def test_a_sweep_with_another_setting_never_writes_over_the_earlier_sweeps_results(tmp_path: Path) -> None:
    """`-m compile=off optim.lr=...`, then the same sweep without compile=off: compile is left out of the sweep's
    name, so both land in one folder. On main the second sweep reran both jobs there, replaced their eager
    summary.json and logged their steps into metrics.jsonl a second time. Here each job is refused in one line
    naming the difference (Hydra's own launcher), or the whole sweep before its first job (the process launcher),
    and the eager figures stay byte for byte."""
    lr = [*TINY_GPT, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_steps=1", "optim.lr=1e-3,3e-4"]
    eager = [o for o in lr if o != "compile=off"]  # TINY_GPT has compile=off
    first = multirun(tmp_path, *lr)
    assert first.returncode == 0, first.stderr[-3000:]
    sweep = tmp_path / "multirun" / folder_name(lr)
    assert sweep.is_dir() and sweep == tmp_path / "multirun" / folder_name(eager)  # one folder: what the rule is for
    results = {p: p.read_bytes() for n in ("0", "1") for p in (sweep / n / "summary.json", sweep / n / "metrics.jsonl")}

    compiled = multirun(tmp_path, *eager)
    assert compiled.returncode == 1, compiled.stderr[-3000:]
    refusals = [line for line in compiled.stderr.splitlines() if line.startswith("Error: hydra.sweep.dir: job #")]
    assert refusals == [f"Error: hydra.sweep.dir: job #{n}: {sweep / str(n)} holds the summary.json and metrics.jsonl "
                        "of an earlier run with other settings (compile.enabled: False -> True), and this run would "
                        f"start again at step 0 over its figures; nothing was changed: {FRESH}" for n in (0, 1)]
    assert {p: p.read_bytes() for p in results} == results

    process = multirun(tmp_path, *eager, "hydra/launcher=process")
    assert process.returncode == 2, process.stderr[-3000:]
    assert [line for line in process.stderr.splitlines() if line.strip()] == [refusals[0]]
    assert "#0 :" not in process.stdout  # refused before its first job
    assert {p: p.read_bytes() for p in results} == results


def test_folder_names_are_short_shell_safe_readable_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep and run folders a shell takes as they are (on main: `model.block_size=32,...,optim.lr=1e-3,3e-4,...`,
    commas and equals signs, 160 characters and more): the swept keys first, in a short form, then the hash."""
    swept = [*TINY_GPT, "optim.lr=1e-3,3e-4"]
    name = folder_name(swept)
    assert len(name) <= FOLDER_CHARS and re.fullmatch(r"[A-Za-z0-9._-]+", name), name
    assert name.startswith("lr-1e-3_3e-4__block_size-32__n_embd-64") and name.endswith(run_name(swept)[-9:])
    assert folder_name(list(reversed(swept))) == name  # the order fixed overrides are typed in does not matter
    assert folder_name([*swept, "trainer.max_steps=9", "compile=default"]) == name  # what a resume may change
    assert folder_name([*TINY_GPT, "optim.lr=1e-3,1e-4"]) != name
    odd = ["data.paths=[/data/my corpus.txt]", "~model.dropout", "+x.y='a=b'"]
    assert folder_name(odd) == f"y-a_b__paths-data_my_corpus.txt__no-dropout-{run_name(odd)[-8:]}"
    monkeypatch.chdir(tmp_path)  # a folder an earlier trainflow named is still found by the same command
    assert existing_or_new("multirun", swept) == f"multirun/{name}"
    (tmp_path / "multirun" / run_name(swept)).mkdir(parents=True)
    assert existing_or_new("multirun", swept) == f"multirun/{run_name(swept)}"
    (tmp_path / "multirun" / name).mkdir()
    assert existing_or_new("multirun", swept) == f"multirun/{name}"
