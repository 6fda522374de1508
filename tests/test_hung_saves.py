"""A save that stops answering ends the run: a rank frozen in a save (SIGSTOP), a disk that stops answering under
one rank's async upload, a disk that stops answering under a one-process run. Each ends within a bound derived from
parallelism.timeout_s, in one line with the watchdog's account, exit 124, its stacks in <run dir>/hang/, the
committed checkpoints byte-identical, the unfinished save uncommitted, and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.checkpoints import committed, tree_hash
from helpers.processes import left_behind
from helpers.runs import ROOT, TINY_GPT, train, wait_for_log

# A real fault, injected where a save does its work: the rank stops (SIGSTOP, as a frozen node) as its save of step
# TEST_HANG_STEP begins, or its disk stops answering as the save opens a shard (an open of a FIFO no one writes to:
# a call that never returns, as on a hung network mount). Only the ranks in TEST_HANG_RANKS.
FAULT = """
import os
import signal
from pathlib import Path

import trainflow.checkpoint.checkpointer as checkpointer
import trainflow.checkpoint.safe_io as safe_io


def _here(step):
    return os.environ.get("RANK", "0") in os.environ["TEST_HANG_RANKS"].split(",") and \\
        step == int(os.environ["TEST_HANG_STEP"])


if os.environ.get("TEST_HANG") == "stop":
    save = checkpointer.Checkpointer._save

    def stopped(self, state, blocking):
        if _here(state.step):
            os.kill(os.getpid(), signal.SIGSTOP)
        return save(self, state, blocking)

    checkpointer.Checkpointer._save = stopped
elif os.environ.get("TEST_HANG") == "disk":
    opened = safe_io._ChecksummedFile.__init__

    def stuck(self, path):
        if _here(int(Path(path).parent.name.removeprefix(".tmp-step_"))):
            with open(os.environ["TEST_FIFO"], "rb") as fifo:  # STUCK HERE
                fifo.read()
        opened(self, path)

    safe_io._ChecksummedFile.__init__ = stuck
"""

RUN = [*TINY_GPT, "data=synthetic", "trainer.eval_every=0", "trainer.excluded_steps=0", "checkpoint.every_steps=5"]
TIMEOUT_S = 6  # parallelism.timeout_s of the 2-rank runs
DDP = ["parallelism=ddp", "parallelism.nproc_per_node=2", f"parallelism.timeout_s={TIMEOUT_S}",
       "parallelism.watchdog.min_s=2", "parallelism.watchdog.factor=2"]
SLACK_S = 20  # start-up of the stop, the launcher's own end, 2 busy cores


@dataclass
class Hung:
    returncode: int
    error: str  # the one Error: line
    took: float  # from the last step before the hung save (its log line) to the end of the run
    site: Path  # where the fault's code is
    left: dict[int, str]  # processes left behind


def start_faulty(tmp_path: Path, how: str, ranks: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """Start a run with the fault `how` on `ranks` at the save of step 10; return it and its run directory once the
    first commit (step 5) is done."""
    run_dir, site = tmp_path / "run", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULT)
    os.mkfifo(tmp_path / "disk")
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(site), "TEST_HANG": how, "TEST_HANG_RANKS": ranks, "TEST_HANG_STEP": "10",
           "TEST_FIFO": str(tmp_path / "disk")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *RUN, "trainer.max_steps=100000", *overrides,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_log(run_dir, "checkpoint step 5 committed", proc, timeout=120)
    return proc, run_dir


def hang(tmp_path: Path, how: str, ranks: str, bound_s: float, *overrides: str) -> Hung:
    """Run with the fault `how` on `ranks` at the save of step 10 (the first commit, step 5, done before it)."""
    with left_behind() as leftovers:
        proc, run_dir = start_faulty(tmp_path, how, ranks, *overrides)
        first = tree_hash(run_dir / "checkpoints" / "step_00000005")
        wait_for_log(run_dir, "step 10/100000: loss ", proc, timeout=60)
        began = time.monotonic()
        try:
            _, stderr = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and every rank it started
            proc.wait()
            leftovers(0.0)
            pytest.fail(f"the run still hangs {bound_s:.0f} s after its save of step 10 began")
        took = time.monotonic() - began
        left = leftovers(10.0)
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert committed(ckpts) == ["step_00000005"] and tree_hash(ckpts / "step_00000005") == first
    if how == "disk":  # the unfinished save: never committed, removed at the next start
        assert (ckpts / ".tmp-step_00000010").is_dir()
    assert "Thread" in (run_dir / "hang" / "rank_0.stacks.txt").read_text()
    return Hung(proc.returncode, errors[0], took, tmp_path / "site", left)


@pytest.mark.serial
def test_a_rank_frozen_in_a_sync_save_ends_the_run_at_the_collective_timeout(tmp_path: Path) -> None:
    """SIGSTOP of rank 1 as its save begins: rank 0's collective in the save waits parallelism.timeout_s (before,
    the checkpointer's groups waited torch's 30 minutes, and the watchdog took a save for work: the run hung)."""
    hung = hang(tmp_path, "stop", "1", TIMEOUT_S + 2 + SLACK_S, *DDP, "checkpoint=dcp")
    assert hung.returncode == 124, hung.error
    assert hung.took < TIMEOUT_S + 2 + SLACK_S  # the timeout, the linger of a rank that lost a peer, slack
    assert hung.error.startswith("Error: rank 0 waited parallelism.timeout_s in a collective in the save of step 10 "
                                 "and another rank never arrived (RuntimeError: "), hung.error
    assert "; hang: no step for " in hung.error and "rank 1 stopped answering (last beat " in hung.error
    assert "rank 0 waiting in a save at " in hung.error
    assert f"every rank's stacks: {tmp_path / 'run' / 'hang'}" in hung.error
    assert hung.error.endswith("committed checkpoints are intact: the same command resumes from the newest")
    assert hung.left == {}


def _stuck_line() -> int:
    return next(n for n, text in enumerate(FAULT.splitlines(), 1) if "# STUCK HERE" in text)


@pytest.mark.serial
def test_a_disk_that_stops_answering_under_an_async_upload_is_named_and_ended(tmp_path: Path) -> None:
    """Rank 1's upload of step 10 never returns from its disk: rank 0's upload times out, rank 1 waits for its own
    at the next save, and its watchdog ends it once the save has lasted twice parallelism.timeout_s, naming where."""
    hung = hang(tmp_path, "disk", "1", 2 * TIMEOUT_S + SLACK_S, *DDP, "checkpoint=dcp_async")
    assert hung.returncode == 124, hung.error
    assert hung.took < 2 * TIMEOUT_S + SLACK_S
    at = f"at {hung.site / 'sitecustomize.py'}:{_stuck_line()} in stuck"
    assert hung.error.startswith("Error: rank 1 was still in the save after step "), hung.error
    assert f"past its limit of twice parallelism.timeout_s (2 x {TIMEOUT_S} s), {at}: the watchdog ended it; hang: " \
        in hung.error, hung.error
    assert f"rank 1 is stuck in a save {at}; rank 0 waiting in a save at " in hung.error, hung.error
    assert hung.left == {}


def test_a_disk_that_stops_answering_under_one_process_is_ended_by_the_watchdog(tmp_path: Path) -> None:
    """One process, no collective to time out: the watchdog (enabled) ends the run once the save has lasted twice
    parallelism.timeout_s; the same command then resumes from the committed checkpoint."""
    timeout = 4
    hung = hang(tmp_path, "disk", "0", 2 * timeout + SLACK_S, "checkpoint=dcp", "parallelism.watchdog.enabled=true",
                f"parallelism.timeout_s={timeout}", "parallelism.watchdog.min_s=1", "parallelism.watchdog.factor=2")
    assert hung.returncode == 124, hung.error
    assert 2 * timeout - 1 <= hung.took < 2 * timeout + SLACK_S  # not before the limit (less the log's delay)
    at = f"at {hung.site / 'sitecustomize.py'}:{_stuck_line()} in stuck"
    assert hung.error.startswith("Error: rank 0 was still in the save after step 10 "), hung.error
    assert f"past its limit of twice parallelism.timeout_s (2 x {timeout} s), {at}: the watchdog ended it; hang: no " \
        "step for " in hung.error, hung.error
    assert f"rank 0 is stuck in a save {at}; every rank's stacks: " in hung.error
    assert "the other ranks" not in hung.error  # there are none
    assert hung.left == {}

    run_dir = tmp_path / "run"
    resumed = train(run_dir, *RUN, "trainer.max_steps=10", "checkpoint=dcp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == 5
    assert not (run_dir / "checkpoints" / ".tmp-step_00000010").exists()


def test_a_second_stop_signal_ends_a_hung_save_at_once_in_one_line(tmp_path: Path) -> None:
    """One process, no watchdog: the first SIGTERM waits for a step boundary the stuck save never reaches; the
    second ends the run at once in one line, exit 75 (before, it ended it without a word, exit -15)."""
    proc, run_dir = start_faulty(tmp_path, "disk", "0", "checkpoint=dcp")
    ckpts = run_dir / "checkpoints"
    first = tree_hash(ckpts / "step_00000005")
    wait_for_log(run_dir, "step 10/100000: loss ", proc, timeout=60)
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):  # the save of step 10 never ends: no step boundary comes
        proc.wait(timeout=2)
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith(("Stopped", "Error"))] == [
        "Stopped by SIGTERM again: ended at once, without the save at the step boundary (a save in progress stays "
        "uncommitted); committed checkpoints are untouched; run the same command to resume (exit code 75)"]
    assert "Traceback" not in stderr
    assert committed(ckpts) == ["step_00000005"] and tree_hash(ckpts / "step_00000005") == first
    assert (ckpts / ".tmp-step_00000010").is_dir()
