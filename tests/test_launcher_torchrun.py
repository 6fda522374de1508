"""hydra/launcher=torchrun: sweeps whose jobs run under torch's elastic agent (real torchrun, real gloo groups)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY_GPT

TORCHRUN = ["hydra/launcher=torchrun", "hydra.launcher.monitor_interval=0.2"]
DDP2 = ["parallelism=ddp", "hydra.launcher.nproc_per_node=2", "data=synthetic"]
STEPS = 100
RESUMABLE = [f"trainer.max_steps={STEPS}", "checkpoint=dcp", "checkpoint.every_steps=10", "checkpoint.verify=false"]


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py -m ...` as users type it, into sweep_dir."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=timeout)


def losses_by_step(job_dir: Path) -> dict[int, float]:
    """train/loss per step; a step logged twice (before a crash and after the resume) keeps its last value."""
    out = {}
    for line in (job_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return out


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """A 2-job sweep, 2 ranks per job, with checkpoints: checked below, and the reference of the restart test."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    return multirun(sweep_dir, *TINY_GPT, *TORCHRUN, *DDP2, *RESUMABLE, "trainer.seed=1,2"), sweep_dir


def test_sweep_runs_each_job_on_two_ranks_in_one_directory(sweep: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, sweep_dir = sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]  # one directory per job
    losses = []
    for num in (0, 1):
        job = sweep_dir / str(num)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == STEPS
        assert summary["config"]["trainer"]["seed"] == num + 1
        # both ranks ran under this job's agent, wrote into this one directory, and only rank 0 wrote Hydra's files
        ranks = {p.parent.name for p in (job / "torchrun" / "ranks").rglob("attempt_0/*/stdout.log")}
        assert ranks == {"0", "1"}
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "train.log").is_file()
        assert "--nproc-per-node=2" in (job / "torchrun" / "agent.log").read_text().splitlines()[0]
        losses.append(losses_by_step(job))
    assert len(losses[0]) == len(losses[1]) == STEPS and losses[0] != losses[1]  # the seeds reached the jobs
    assert re.findall(r"#(\d) COMPLETED", proc.stdout) == ["0", "1"]  # the launcher's report of each job


def test_failed_job_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    proc = multirun(tmp_path, *TINY_GPT, *TORCHRUN, "trainer.max_steps=2", "trainer.eval_steps=0,1")
    assert proc.returncode == 1
    assert json.loads((tmp_path / "1" / "summary.json").read_text())["steps"] == 2  # job 1 ran despite job 0
    assert not (tmp_path / "0" / "summary.json").exists()
    assert "#1 COMPLETED" in proc.stdout
    last = proc.stderr.strip().splitlines()[-2]  # Hydra ends with "Set HYDRA_FULL_ERROR=1 ..."
    assert last.startswith("job #0 failed under torchrun (exit code 2, 0 restart(s)): "
                           "trainer.eval_steps: must be a positive integer; got 0"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _worker_pid(job_dir: Path, rank: int) -> int | None:
    """The pid of `rank` of the job in job_dir, first attempt (read from the processes' environments)."""
    want = {f"TRAINFLOW_RUN_DIR={job_dir}", f"RANK={rank}", "TORCHELASTIC_RESTART_COUNT=0"}
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and want <= env:
            return int(proc.name)
    return None


def test_restart_after_a_rank_crash_resumes_from_the_last_checkpoint(
        tmp_path: Path, sweep: tuple[subprocess.CompletedProcess, Path]) -> None:
    """Rank 1 is killed at step 15; the agent restarts the group (max_restarts=1), which resumes from the newest
    checkpoint and ends with the losses of the uninterrupted job 0 of the sweep above, bit for bit."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *TORCHRUN, *DDP2, *RESUMABLE,
           "hydra.launcher.max_restarts=1", "hydra.launcher.shutdown_timeout_s=5", "trainer.seed=1",
           f"hydra.sweep.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = tmp_path / "0"
    killed = None
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and (job / "metrics.jsonl").exists() and max(losses_by_step(job), default=0) >= 15:
            killed = _worker_pid(job, rank=1)
            assert killed is not None
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    assert killed and proc.returncode == 0, out[-4000:]
    attempts = {p.name for p in (job / "torchrun" / "ranks").glob("*/attempt_*")}
    assert attempts == {"attempt_0", "attempt_1"}  # the elastic agent restarted the group once
    assert "#0: the agent restarted the ranks 1 time(s)" in out
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from_step"] in range(10, STEPS, 10)  # not from 0
    assert summary["steps_this_run"] == STEPS - summary["resumed_from_step"]
    reference = sweep[1] / "0"
    assert losses_by_step(job) == losses_by_step(reference)
    assert summary["val"]["loss"] == json.loads((reference / "summary.json").read_text())["val"]["loss"]


@pytest.mark.slow
def test_two_nodes_meet_at_the_rendezvous_endpoint(tmp_path: Path) -> None:
    """Two "nodes" (two launchers on this machine) run the same sweep command, one rank each: every job forms
    one group of world size 2 through the shared endpoint and writes into the shared job directory."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *TORCHRUN, "parallelism=ddp", "data=synthetic",
           "hydra.launcher.nnodes=2", f"hydra.launcher.rdzv_endpoint=localhost:{port}", "hydra.launcher.rdzv_id=t2n",
           "trainer.max_steps=3", "trainer.seed=1,2", f"hydra.sweep.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] for out in outs)
    for num in (0, 1):
        summary = json.loads((tmp_path / str(num) / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 3
        assert summary["config"]["trainer"]["seed"] == num + 1


def _job_processes(sweep_dir: Path) -> list[int]:
    """Pids of the agents and ranks working on a job of sweep_dir (their command line names the job's pickle)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(sweep_dir).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_killing_the_launcher_leaves_no_ranks_behind(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *TORCHRUN, *DDP2, "trainer.max_steps=100000",
           "hydra.launcher.shutdown_timeout_s=5", f"hydra.sweep.dir={tmp_path}"]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = tmp_path / "0"
    deadline = time.monotonic() + 120
    while not (job / "metrics.jsonl").exists() or max(losses_by_step(job), default=0) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    workers = [pid for pid in _job_processes(tmp_path) if pid != launcher.pid]
    assert len(workers) == 3  # the agent and two ranks
    launcher.kill()  # SIGKILL: the launcher cannot clean up itself
    launcher.wait()
    deadline = time.monotonic() + 60
    while _job_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(tmp_path) == []  # the agent got SIGTERM when its parent died and stopped its ranks


@pytest.mark.parametrize(("overrides", "expected"), [
    (["hydra.launcher.nproc_per_node=0"], "hydra.launcher.nproc_per_node: must be a positive integer"),
    (["hydra.launcher.nnodes=0"], "hydra.launcher.nnodes: must be N >= 1"),
    (["hydra.launcher.nnodes=2"], "hydra.launcher.rdzv_endpoint: needed when nnodes > 1"),
    (["hydra.launcher.nnodes=2", "hydra.launcher.rdzv_endpoint=no-such-host.invalid:29400"],
     "hydra.launcher.rdzv_endpoint: host 'no-such-host.invalid' does not resolve"),
    (["hydra.launcher.nnodes=2", "hydra.launcher.rdzv_endpoint=192.0.2.1:29400", "hydra.launcher.rdzv_wait_s=1"],
     "hydra.launcher.rdzv_endpoint: nothing answers at 192.0.2.1:29400 after 1 s"),
])
def test_bad_launcher_settings_fail_in_one_line(tmp_path: Path, overrides: list[str], expected: str) -> None:
    proc = multirun(tmp_path, "hydra/launcher=torchrun", *overrides, timeout=60)
    assert one_line_error(proc).startswith(f"Error: {expected}")
    assert not (tmp_path / "0").exists()  # nothing started


def test_torchrun_launcher_without_multirun_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "hydra/launcher=torchrun",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "add -m" in one_line_error(proc)
    assert not (tmp_path / "run").exists()
