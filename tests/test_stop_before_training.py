"""A stop signal before the first step: nothing to save yet, and no step boundary may ever come (a resume waiting
on a stuck disk), so the run ends at once in one line with exit 75 instead of swallowing the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY_GPT, train, wait_for
from helpers.checkpoints import committed, tree_hash

ARGS = [*TINY_GPT, "trainer.eval_every=0", "trainer.eval_steps=2", "checkpoint=dcp",
        "checkpoint.every_steps=2"]

# A disk that stops answering while the resume checks the checkpoint's files: the check leaves a mark that it
# began, then opens a FIFO no one writes to, a call that never returns (as a read on a hung network mount).
STUCK_DISK = """
import os
from pathlib import Path

import trainflow.checkpoint.store as store


def stuck(folder, checksums):
    Path(os.environ["STUCK_MARK"]).touch()
    with open(os.environ["STUCK_FIFO"], "rb") as f:
        f.read()


store.check_files = stuck
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_a_stop_signal_while_the_resume_hangs_ends_the_run_at_once(tmp_path: Path, signum: int) -> None:
    run_dir = tmp_path / "run"
    first = train(run_dir, *ARGS, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts, metrics = run_dir / "checkpoints", (run_dir / "metrics.jsonl").read_text()
    before = tree_hash(ckpts)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STUCK_DISK)
    os.mkfifo(tmp_path / "disk")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path / "site"),
           "STUCK_MARK": str(tmp_path / "stuck"), "STUCK_FIFO": str(tmp_path / "disk")}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS, "trainer.max_steps=8",
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "stuck").exists(), proc, "the resume began to check the checkpoint")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)  # a swallowed signal: the open never returns, this times out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith(("Stopped", "Error"))] == [
        f"Stopped by {signal.Signals(signum).name} before the first step: nothing to save yet, committed "
        "checkpoints are untouched; run the same command to resume (exit code 75)"]
    assert "Traceback" not in out + err
    assert tree_hash(ckpts) == before and committed(ckpts) == ["step_00000002", "step_00000004"]
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no step ran
