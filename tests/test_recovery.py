"""Recovery a user can trust: a diverging run stops before it saves, the same command resumes, one run per folder.

Every test runs `python train.py` in real processes; checkpoints are really written, signals really sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import run_process, start_process
from helpers.runs import ROOT, TINY_GPT, train, wait_for

SHORT = [*TINY_GPT, "trainer.eval_every=0", "trainer.eval_steps=2"]
DIVERGES = ["optim.lr=1e30", "optim.warmup_steps=0"]  # the first update throws the weights to ~1e30: NaN at step 2


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def committed(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if (p / "manifest.json").is_file()) if ckpt_dir.is_dir() else []


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def clean_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


# ---------------------------------------------------------------------------------------------------------------
# non-finite loss and gradients


def test_a_diverging_run_stops_before_saving_and_the_same_command_resumes_from_the_last_good_checkpoint(
        run_dir: Path) -> None:
    args = [*SHORT, *DIVERGES, "trainer.max_steps=6", "checkpoint=dcp", "checkpoint.every_steps=1"]
    expected = ("Error: trainer.nonfinite: the loss at step 2 is nan (gradient norm nan); lower optim.lr, check the "
                "data, or set trainer.nonfinite=skip_step to skip such steps; no checkpoint holds this state (newest "
                "committed: step_00000001)")
    first = train(run_dir, *args)
    assert first.returncode == 2, first.stderr[-3000:]
    assert errors(first.stderr) == [expected] and "Traceback" not in first.stderr
    ckpts = run_dir / "checkpoints"
    assert committed(ckpts) == ["step_00000001"]  # step 1's update made the weights huge but finite
    assert sorted(p.name for p in ckpts.iterdir() if p.name != ".lock") == ["step_00000001"]  # no save begun
    losses = first.losses()
    assert len(losses) == 1 and math.isfinite(losses[0])  # the NaN step stopped the run before it was logged
    good = tree_hash(ckpts / "step_00000001")

    again = train(run_dir, *args)
    assert again.returncode == 2 and errors(again.stderr) == [expected], again.stderr[-3000:]
    assert "resumed from step 1 " in again.stdout + again.stderr
    assert committed(ckpts) == ["step_00000001"] and tree_hash(ckpts / "step_00000001") == good


def test_a_nonfinite_gradient_norm_on_a_save_step_is_caught_before_the_save(run_dir: Path) -> None:
    """log_every=4 and a save every 2: the first check after the NaN is the save at step 2, not a log step."""
    args = [*SHORT, *DIVERGES, "trainer.log_every=4", "trainer.max_steps=8", "checkpoint=dcp",
            "checkpoint.every_steps=2"]
    run = train(run_dir, *args)
    assert run.returncode == 2, run.stderr[-3000:]
    assert errors(run.stderr) == [
        "Error: trainer.nonfinite: the loss at step 2 is nan (gradient norm nan); lower optim.lr, check the data, or "
        "set trainer.nonfinite=skip_step to skip such steps; no checkpoint holds this state"]
    assert committed(run_dir / "checkpoints") == []


def test_skip_step_skips_the_one_nonfinite_update_and_the_run_recovers(run_dir: Path) -> None:
    args = [*SHORT, "trainer.max_steps=6", "trainer.nonfinite=skip_step", "model._target_=unstable_model.GPTNaNAtStep",
            "+model.nan_at_step=3"]
    run = train(run_dir, *args, env={"PYTHONPATH": str(ROOT / "tests")})
    assert run.returncode == 0, run.stderr[-3000:]
    skipped = [line for line in (run.stdout + run.stderr).splitlines() if "update skipped" in line]
    assert len(skipped) == 1 and skipped[0].endswith(
        "step 3: the gradient norm is nan: update skipped (trainer.nonfinite=skip_step; 1 skipped so far)")
    assert run.summary["nonfinite"] == {"mode": "skip_step", "skipped_steps": 1, "skipped_at": [3]}
    losses = {m["step"]: m["train/loss"] for m in run.metrics() if "train/loss" in m}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert math.isnan(losses[3])  # the only step of its interval was skipped: no applied loss to average
    # Had the NaN gradients reached the weights (applied, or left to accumulate), every later loss would be NaN.
    assert all(math.isfinite(losses[s]) for s in (1, 2, 4, 5, 6))
    assert run.summary["steps"] == 6 and math.isfinite(run.summary["validation"]["loss"])


def test_skip_step_stops_a_run_that_keeps_diverging(run_dir: Path) -> None:
    run = train(run_dir, *SHORT, *DIVERGES, "trainer.max_steps=15", "trainer.nonfinite=skip_step")
    assert run.returncode == 2, run.stderr[-3000:]
    assert errors(run.stderr) == [
        "Error: trainer.nonfinite: skip_step met 10 steps in a row with a non-finite gradient norm (steps 2-11; it "
        "stops at K=10): the run diverged; lower optim.lr or check the data; no checkpoint holds this state"]
    assert "Traceback" not in run.stderr
    warned = [line for line in (run.stdout + run.stderr).splitlines() if "update skipped" in line]
    assert len(warned) == 9 and "step 2: " in warned[0] and "step 10: " in warned[-1]


# ---------------------------------------------------------------------------------------------------------------
# the same command resumes


def test_the_same_command_resumes_a_stopped_checkpointed_run(tmp_path: Path) -> None:
    """No hydra.run.dir: a checkpointed run's directory follows from its command, so repeating it resumes."""
    def command(*extra: str) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), *SHORT, "checkpoint=dcp", "checkpoint.every_steps=2", *extra]

    runs = tmp_path / "outputs" / "runs"
    with open(tmp_path / "first.out", "w") as out:
        proc = subprocess.Popen(command("trainer.max_steps=60"), cwd=tmp_path, env=clean_env(), stdout=out,
                                stderr=subprocess.PIPE, text=True)
        wait_for(lambda: any(runs.glob("*/checkpoints/step_*/manifest.json")), proc, "the first checkpoint")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    (run,) = list(runs.iterdir())
    assert re.fullmatch(r"block_size-32__n_embd-64__n_head-2__n_layer-2__model-gpt_tiny-[0-9a-f]{8}", run.name)
    stopped_at = json.loads((run / "summary.json").read_text())["steps"]
    assert 2 <= stopped_at < 60
    hint = [line for line in stderr.splitlines() if "to resume, run the same command" in line]
    assert hint == ["Stopped after a committed checkpoint; to resume, run the same command: "
                    f"{shlex.join(command('trainer.max_steps=60'))}"]

    again = run_process(command("trainer.max_steps=60"), cwd=tmp_path, env=clean_env(), capture_output=True,
                        text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert list(runs.iterdir()) == [run]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == 60

    fresh = run_process(command("trainer.max_steps=2", "trainer.run_name=try2"), cwd=tmp_path, env=clean_env(),
                        capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    summary = json.loads((runs / "try2" / "summary.json").read_text())
    assert summary["resumed_from_step"] is None and summary["steps"] == 2


def test_runs_without_checkpoints_keep_their_timestamped_folders(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "train.py"), *SHORT, "trainer.max_steps=1"]
    run = run_process(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (tmp_path / "outputs" / "runs").exists()
    (summary,) = list((tmp_path / "outputs").glob("*/*/summary.json"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", str(summary.parent.relative_to(tmp_path / "outputs")))


def test_the_run_name_leaves_out_what_does_not_change_the_training() -> None:
    from trainflow.util.rundir import run_name

    base = run_name(["model=gpt_small", "optim.lr=0.01"])
    assert base == run_name(["optim.lr=0.01", "model=gpt_small"])  # order does not matter
    assert base == run_name(["model=gpt_small", "optim.lr=0.01", "trainer.max_steps=9", "checkpoint=dcp_async",
                             "checkpoint.resume=never", "logger=none", "parallelism=ddp", "compile=off",
                             "trainer.nonfinite=skip_step", "profiler.active=2", "hydra/launcher=process"])
    assert base.startswith("model=gpt_small,optim.lr=0.01-")
    assert run_name(["model=gpt_small", "optim.lr=0.02"]) != base
    assert run_name(["model=gpt_small", "optim.lr=0.01", "checkpoint.dir=/x"]) != base  # another history


@pytest.mark.parametrize("pinned", [False, True], ids=["named-dir", "pinned-dir"])
def test_a_run_name_that_is_not_a_folder_name_is_one_line(tmp_path: Path, pinned: bool) -> None:
    command = [sys.executable, str(ROOT / "train.py"), *SHORT, "trainer.run_name=a/b"]
    run = run_process([*command, *([f"hydra.run.dir={tmp_path / 'run'}"] if pinned else [])], cwd=tmp_path,
                      env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert errors(run.stderr) == ["Error: trainer.run_name: 'a/b' is not a folder name; give a name without '/', "
                                  "e.g. trainer.run_name=gpt-small-try2"]
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------------------------
# one run per run directory


def test_a_second_run_in_a_live_runs_directory_is_refused_before_it_writes_anything(run_dir: Path) -> None:
    live = start_process([sys.executable, str(ROOT / "train.py"), *SHORT, "trainer.max_steps=100000",
                          f"hydra.run.dir={run_dir}"], ROOT, clean_env(), run_dir.parent / "live.out")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0,
                   live, "the live run's first metrics")
        saved = {p: p.read_bytes() for p in [run_dir / "config.yaml", *sorted((run_dir / ".hydra").iterdir())]}
        second = train(run_dir, *SHORT, "trainer.max_steps=3", "trainer.seed=7")  # another config: would show
        assert second.returncode == 2, second.stderr[-3000:]
        expected = re.compile(re.escape(f"Error: hydra.run.dir: {run_dir} is in use by another run (pid {live.pid} "
                                        f"on {os.uname().nodename}, since ") + r"[^)]+" + re.escape(
            "); wait for it to end, or give this run its own directory (another trainer.run_name, or "
            "hydra.run.dir=<folder>)"))
        (line,) = errors(second.stderr)
        assert expected.fullmatch(line), line
        assert "Traceback" not in second.stderr
        assert {p: p.read_bytes() for p in saved} == saved
        assert live.poll() is None
    finally:
        live.terminate()
        live.wait(timeout=60)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no second run's lines among them
    assert "trainer.seed=7" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


def test_a_checkpoint_dir_inside_the_locked_run_dir_itself_is_allowed(run_dir: Path) -> None:
    """checkpoint.dir may be the run directory itself: one process, one lock file, no refusal of itself."""
    run = train(run_dir, *SHORT, "trainer.max_steps=2", "checkpoint=dcp", "checkpoint.every_steps=2",
                f"checkpoint.dir={run_dir}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert committed(run_dir) == ["step_00000002"]


def test_a_run_directory_holding_another_run_is_refused_and_the_same_run_continues(run_dir: Path) -> None:
    """hydra.run.dir of an earlier run: another model there would overwrite its config.yaml and summary.json;
    the same run (more steps) resumes in it, and so does another config under that run's trainer.run_name."""
    from trainflow.util.rundir import run_identity

    args = [*SHORT, "checkpoint=dcp", "checkpoint.every_steps=2"]
    first = train(run_dir, *args, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    kept = tree_hash(run_dir)
    theirs = run_identity([*args, "trainer.max_steps=2"])

    other = train(run_dir, *args, "trainer.max_steps=2", "model.n_embd=32")
    assert other.returncode == 2, other.stderr[-3000:]
    assert errors(other.stderr) == [
        f"Error: hydra.run.dir: {run_dir} holds the config.yaml and summary.json of another run ({theirs}; this one "
        f"is {run_identity([*args, 'model.n_embd=32'])}); nothing was changed: give this run its own directory "
        f"(hydra.run.dir=<new folder>), or continue that run with trainer.run_name='{theirs}'"]
    assert "Traceback" not in other.stderr
    assert {k: v for k, v in tree_hash(run_dir).items() if k != ".lock"} == \
        {k: v for k, v in kept.items() if k != ".lock"}  # the lock file names its latest holder

    more = train(run_dir, *args, "trainer.max_steps=4")  # the same run, continued
    assert more.returncode == 0, more.stderr[-3000:]
    assert more.summary["resumed_from_step"] == 2 and more.summary["steps"] == 4

    changed = train(run_dir, *args, "trainer.max_steps=6", "optim.lr=3e-4", f"trainer.run_name='{theirs}'")
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert changed.summary["resumed_from_step"] == 4
    assert changed.summary["checkpoint"]["resume_changes"][0]["key"] == "optim.lr"
