"""A stop signal before the first step: nothing to save yet, and no step boundary may ever come (a resume waiting
on a stuck disk, a dataset being built from a dead mount), so the run ends at once in one line instead of swallowing
the signal: exit 75 when it checkpoints (the same command resumes), else 128 + the signal's number."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import committed, tree_hash
from helpers.processes import left_behind
from helpers.runs import ROOT, TINY_GPT, train, wait_for

ARGS = [*TINY_GPT, "trainer.eval_every=0", "trainer.eval_steps=2", "checkpoint=dcp",
        "checkpoint.every_steps=2"]

# A disk that stops answering while the resume checks the checkpoint's files (STUCK_AT=resume) or while the run's
# datasets are built (STUCK_AT=data, before the checkpointer exists): the call leaves a mark that it began, then
# opens a FIFO no one writes to, a call that never returns (as a read on a hung network mount).
STUCK_DISK = """
import os
from pathlib import Path

import trainflow.checkpoint.store as store
import trainflow.run.assembly as run


def stuck(*args):
    Path(os.environ["STUCK_MARK"], str(os.getpid())).touch()
    with open(os.environ["STUCK_FIFO"], "rb") as f:
        f.read()


build_datasets = run.build_datasets


def datasets(*args):
    if os.environ["STUCK_AT"] == "data":
        stuck()
    return build_datasets(*args)


if os.environ["STUCK_AT"] == "resume":
    store.check_files = stuck
run.build_datasets = datasets

if os.environ.get("PREVIOUS_HANDLER"):  # a handler that was there before trainflow's, as submitit's in a SLURM job
    import signal

    def requeue(signum, frame):
        Path(os.environ["PREVIOUS_HANDLER"]).touch()
        os._exit(99)

    signal.signal(signal.SIGUSR2, requeue)
"""


def stuck_run(tmp_path: Path, at: str, *args: str, env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, Path]:
    """`train.py` with a disk that stops answering at `at`; returns once every process of it is stuck there."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STUCK_DISK)
    os.mkfifo(tmp_path / "disk")
    (tmp_path / "stuck").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path / "site"), "STUCK_AT": at,
           "STUCK_MARK": str(tmp_path / "stuck"), "STUCK_FIFO": str(tmp_path / "disk"), **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = 2 if "parallelism=ddp" in args else 1
    wait_for(lambda: len(list((tmp_path / "stuck").iterdir())) == ranks, proc, f"the run got stuck at {at}")
    return proc, tmp_path / "run"


def stop(proc: subprocess.Popen, signum: int) -> tuple[str, str]:
    """Send `signum`; the run's stdout and stderr (a swallowed signal: it never ends, and this times out)."""
    proc.send_signal(signum)
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2],
                         ids=["SIGTERM", "SIGUSR1", "SIGUSR2"])
def test_a_stop_signal_while_the_resume_hangs_ends_the_run_at_once(tmp_path: Path, signum: int) -> None:
    run_dir = tmp_path / "run"
    first = train(run_dir, *ARGS, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts, metrics = run_dir / "checkpoints", (run_dir / "metrics.jsonl").read_text()
    before = tree_hash(ckpts)
    proc, _ = stuck_run(tmp_path, "resume", *ARGS, "trainer.max_steps=8")
    out, err = stop(proc, signum)
    assert proc.returncode == 75, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith(("Stopped", "Error"))] == [
        f"Stopped by {signal.Signals(signum).name} before the first step: nothing to save yet, committed "
        "checkpoints are untouched; run the same command to resume (exit code 75)"]
    assert "Traceback" not in out + err
    assert tree_hash(ckpts) == before and committed(ckpts) == ["step_00000002", "step_00000004"]
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no step ran


def test_a_handler_there_before_trainflows_acts_on_a_stop_signal_before_the_first_step(tmp_path: Path) -> None:
    """Under SLURM, submitit's handler requeues the job on SIGUSR2: before the first step, with nothing to save, a
    stop signal goes to it (before, trainflow ended the process itself, exit 75, and the preempted job was never
    requeued)."""
    run_dir = tmp_path / "run"
    assert train(run_dir, *ARGS, "trainer.max_steps=4").returncode == 0
    proc, _ = stuck_run(tmp_path, "resume", *ARGS, "trainer.max_steps=8",
                        env={"PREVIOUS_HANDLER": str(tmp_path / "requeued")})
    out, err = stop(proc, signal.SIGUSR2)
    assert proc.returncode == 99 and (tmp_path / "requeued").exists(), err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith(("Stopped", "Error"))]


@pytest.mark.parametrize("checkpoint", ["dcp", "off"])
def test_a_stop_signal_while_the_run_is_assembled_ends_it_at_once_in_one_line(tmp_path: Path,
                                                                             checkpoint: str) -> None:
    """While the datasets are built, before the checkpointer exists: the run's entry point caught the signals
    already (before, SIGTERM ended it without a word, exit -15). Without checkpoints nothing can resume: the exit
    code is the one a shell gives a process SIGTERM ended, 143."""
    args = ARGS if checkpoint == "dcp" else [a for a in ARGS if not a.startswith("checkpoint")]  # no stray keys
    proc, run_dir = stuck_run(tmp_path, "data", *args, f"checkpoint={checkpoint}", "trainer.max_steps=8")
    out, err = stop(proc, signal.SIGTERM)
    said = [line for line in err.splitlines() if line.startswith(("Stopped", "Error"))]
    if checkpoint == "dcp":
        assert proc.returncode == 75, err[-3000:]
        assert said == ["Stopped by SIGTERM before the first step: nothing to save yet, committed checkpoints are "
                        "untouched; run the same command to resume (exit code 75)"]
    else:
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert said == ["Stopped by SIGTERM: nothing was saved (checkpointing is off; with checkpoint=dcp a stop "
                        "signal saves at the next step boundary first); the same command starts again from step 0 "
                        "(exit code 143)"]
    assert "Traceback" not in out + err and not (run_dir / "metrics.jsonl").exists()


def test_a_stop_signal_before_the_workers_first_step_ends_a_self_launched_run_with_exit_75(tmp_path: Path) -> None:
    """SIGTERM to `python train.py` while its two workers build their datasets: the agent passes it on, the workers
    end at once, and the launching process says so in one line with the exit code one process gives (before,
    143: the launcher's own code for a signal, not the run's)."""
    with left_behind() as leftovers:
        proc, run_dir = stuck_run(tmp_path, "data", *ARGS, "parallelism=ddp", "parallelism.nproc_per_node=2",
                                  "trainer.max_steps=8")
        out, err = stop(proc, signal.SIGTERM)
        left = leftovers(10.0)
    assert proc.returncode == 75, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith(("Stopped", "Error"))] == [
        "Error: stopped by SIGTERM before the workers saved (before their first step, or on a second signal): nothing "
        "new was saved, committed checkpoints are untouched; run the same command to resume (exit code 75)"]
    assert "Traceback" not in out + err and not (run_dir / "metrics.jsonl").exists()
    assert left == {}
