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
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, one_line_error, wait_for_log

from trainflow.checkpoint import check_intact, list_committed

TORCHRUN = ["hydra/launcher=torchrun", "hydra.launcher.monitor_interval=0.2"]
DDP2 = ["parallelism=ddp", "parallelism.nproc_per_node=2", "data=synthetic"]
STEPS = 40
RESUMABLE = [f"trainer.max_steps={STEPS}", "checkpoint=dcp", "checkpoint.every_steps=10", "checkpoint.verify=false"]


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py -m ...` as users type it, into sweep_dir."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return run_process([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=timeout)





@dataclass
class Sweep:
    dir: Path
    returncode: int
    output: str  # the launcher's stdout and stderr
    killed: int | None  # the pid of the rank that was killed


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Two identical jobs of 2 ranks each, with checkpoints every 10 steps and max_restarts=1. Job 0 runs through;
    rank 1 of job 1 is SIGKILLed at step 15 (read from the processes' environments), so the agent restarts it."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *TORCHRUN, *DDP2, *RESUMABLE,
           "parallelism.max_restarts=1", "hydra.launcher.shutdown_timeout_s=5", "trainer.seed=1,1",
           f"hydra.sweep.dir={sweep_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = sweep_dir / "1"
    killed = None
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and (job / "metrics.jsonl").exists() and max(losses_by_step(job), default=0) >= 15:
            killed = _worker_pid(job, rank=1)
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    return Sweep(sweep_dir, proc.returncode, out, killed)


def test_sweep_runs_each_job_on_two_ranks_in_one_directory(sweep: Sweep) -> None:
    assert sweep.returncode == 0, sweep.output[-4000:]
    assert sorted(p.name for p in sweep.dir.iterdir() if p.is_dir()) == ["0", "1"]  # one directory per job
    for num in (0, 1):
        job = sweep.dir / str(num)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == STEPS
        # both ranks ran under this job's agent and wrote into this one directory; rank 0 wrote Hydra's files
        ranks = {p.parent.name for p in (job / "torchrun" / "ranks").rglob("attempt_0/*/stdout.log")}
        assert ranks == {"0", "1"}
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "train.log").is_file()
        assert "--nproc-per-node=2" in (job / "torchrun" / "agent.log").read_text().splitlines()[0]
        assert len(losses_by_step(job)) == STEPS
        # each rank's console prints as a single run does: rank 0 the short header once and no config, rank 1 neither
        consoles = {p.parent.name: p.read_text() for p in (job / "torchrun" / "ranks").rglob("attempt_0/*/stdout.log")}
        assert consoles["0"].count(" trains model ") == 1 and "max_steps: " not in consoles["0"], consoles["0"]
        assert " trains model " not in consoles["1"] and "max_steps: " not in consoles["1"]
    assert re.findall(r"#(\d) COMPLETED", sweep.output) == ["0", "1"]  # the launcher's report of each job


def test_restart_after_a_rank_crash_resumes_from_the_last_checkpoint(sweep: Sweep) -> None:
    """Job 1 lost rank 1 at step 15: the agent restarted the group, which resumed from the newest checkpoint and
    ended with the losses of the uninterrupted job 0, bit for bit."""
    assert sweep.killed is not None and sweep.returncode == 0, sweep.output[-4000:]
    reference, job = sweep.dir / "0", sweep.dir / "1"
    assert {p.name for p in (job / "torchrun" / "ranks").glob("*/attempt_*")} == {"attempt_0", "attempt_1"}
    assert {p.name for p in (reference / "torchrun" / "ranks").glob("*/attempt_*")} == {"attempt_0"}
    assert "#1: the agent restarted the ranks 1 time(s)" in sweep.output
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from_step"] in range(10, STEPS, 10)  # not from 0
    assert summary["steps_this_run"] == STEPS - summary["resumed_from_step"]
    assert losses_by_step(job) == losses_by_step(reference)
    assert summary["validation"]["loss"] == json.loads((reference / "summary.json").read_text())["validation"]["loss"]


def test_failed_job_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    proc = multirun(tmp_path, *TINY_GPT, *TORCHRUN, "trainer.max_steps=2", "trainer.eval_steps=0,1")
    assert proc.returncode == 1
    assert json.loads((tmp_path / "1" / "summary.json").read_text())["steps"] == 2  # job 1 ran despite job 0
    assert not (tmp_path / "0" / "summary.json").exists()
    assert "#1 COMPLETED" in proc.stdout
    assert re.search(r"^job #0 failed under torchrun \(exit code 1, 0 restart\(s\)\): trainer\.eval_steps: must be "
                     r"a positive integer; got 0 \[logs: .*/0/torchrun\]$", proc.stderr, re.MULTILINE), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("ranks", [["parallelism.nproc_per_node=2"], []], ids=["two", "auto-without-gpu"])
def test_ranks_follow_parallelism_nproc_per_node(tmp_path: Path, ranks: list[str]) -> None:
    """No hydra.launcher.nproc_per_node: torchrun starts the ranks parallelism.nproc_per_node asks for (auto on a
    machine without GPUs: 2 CPU ranks)."""
    if not ranks and torch_sees_a_gpu():
        pytest.skip("auto is one rank per GPU here")
    proc = multirun(tmp_path, *TINY_GPT, *TORCHRUN, "parallelism=ddp", *ranks, "data=synthetic",
                    "trainer.max_steps=3", "trainer.eval_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert "--nproc-per-node=2" in (tmp_path / "0" / "torchrun" / "agent.log").read_text().splitlines()[0]
    assert {p.parent.name for p in (tmp_path / "0" / "torchrun" / "ranks").rglob("attempt_0/*/stdout.log")} == \
        {"0", "1"}


@pytest.mark.parametrize(("setting", "knob"), [("nproc_per_node=3", "parallelism.nproc_per_node"),
                                              ("max_restarts=1", "parallelism.max_restarts")])
def test_a_launcher_setting_a_trainflow_job_sets_itself_is_refused_in_one_line(tmp_path: Path, setting: str,
                                                                              knob: str) -> None:
    """One knob each: the launcher's nproc_per_node and max_restarts are for other Hydra apps."""
    key = setting.split("=")[0]
    proc = multirun(tmp_path, *TORCHRUN, "parallelism=ddp", "parallelism.nproc_per_node=2",
                    f"hydra.launcher.{setting}", timeout=60)
    assert one_line_error(proc) == (
        f"Error: hydra.launcher.{key}: is for Hydra apps other than trainflow, and job #0 is a trainflow run, which "
        f"sets its own: drop hydra.launcher.{key} and set {knob}")
    assert not (tmp_path / "0").exists()  # nothing started


def torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


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
        assert len(list((tmp_path / str(num) / "torchrun").glob("*/agent.log"))) == 2  # one folder per node


def _rank_pid(rank: int, marker: str) -> int | None:
    """The pid of the worker of global rank `rank` whose command line holds `marker` (its job's pickle path)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes() \
                    and f"\0RANK={rank}\0".encode() in b"\0" + (proc / "environ").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    return None


def test_a_rank_killed_on_one_node_is_named_by_every_node(tmp_path: Path) -> None:
    """Two "nodes" (two launchers on the loopback, one rank each) train one job; rank 1 is SIGKILLed (as an OOM kill
    does) once step 4 is committed. Both launchers end within seconds and each names rank 1, its signal and the step
    rank 0 noticed it in, in the job's one line: the node that only lost a connection reads the other node's agent
    report in the shared job dir. No traceback on either console (torch's agent report stays in agent.log);
    committed checkpoints are whole."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *TORCHRUN, "parallelism=ddp",
           "parallelism.nproc_per_node=1", "data=synthetic", "hydra.launcher.nnodes=2",
           f"hydra.launcher.rdzv_endpoint=localhost:{port}", "hydra.launcher.rdzv_id=lost", "trainer.max_steps=100000",
           "trainer.eval_every=0", "checkpoint=dcp", "checkpoint.every_steps=2", f"hydra.sweep.dir={sweep}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        wait_for_log(sweep / "0", "checkpoint step 4 committed", nodes[0], timeout=180)
        killed = _rank_pid(1, str(sweep))
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        outs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert time.monotonic() - killed_at < 60  # connections reset, not a collective timeout
    steps = set()
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 1 and "Traceback" not in out, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("job #0 failed under torchrun"))
        said = re.search(rf": rank 1 \(pid {killed}\) was lost: killed by signal SIGKILL \(rank 0 lost its "
                         r"connection to it in step (\d+)\); the other ranks were stopped; committed checkpoints are "
                         r"intact: the same command resumes from the newest \[logs: ", line)
        assert said, line
        steps.add(int(said[1]))
    assert len(steps) == 1  # both nodes tell the same story
    committed = list_committed(sweep / "0" / "checkpoints")
    for checkpoint in committed:
        check_intact(checkpoint, committed)
    assert committed and max(c.step for c in committed) < steps.pop()


def test_a_witness_whose_agent_never_reported_is_read_from_its_own_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What CI once left: the lost rank's node hosted the rendezvous store, so when it ended, the other node's
    agent failed on the store with a traceback and never reported its rank 0. Rank 0's own record (written when
    it noticed) still names the step: both launchers read it, without waiting out the 30 s for a report."""
    from hydra_plugins.trainflow_launchers.torchrun_launcher import lost_rank
    from trainflow.util.failures import note_step, record_failure

    logs = tmp_path / "torchrun"
    (logs / "vm-2").mkdir(parents=True)
    (logs / "vm-2" / "agent.log").write_text(
        "  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 4242)  (SIGKILL)\n  error_file: <N/A>\n")
    (logs / "vm-1").mkdir()
    (logs / "vm-1" / "agent.log").write_text("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: "
                                             "The connection to the C10d store has failed.\n")
    record = logs / "vm-1" / "ranks" / "lost-0_ab" / "attempt_0" / "0" / "error.json"
    record.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(record))
    monkeypatch.setenv("RANK", "0")
    try:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5288: Connection reset by peer")
    except RuntimeError as exc:
        note_step(exc, 5)
        record_failure(exc)
    start = time.monotonic()
    error = lost_rank(logs, since=0.0, wait_s=30.0)
    assert time.monotonic() - start < 5  # a witness is there: no wait for a report that never comes
    assert str(error).startswith("rank 1 (pid 4242) was lost: killed by signal SIGKILL (rank 0 lost its connection "
                                 "to it in step 5); the other ranks were stopped"), error
    assert json.loads(record.read_text())["trainflow_rank"] == 0


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
    proc = run_process([sys.executable, str(ROOT / "train.py"), "hydra/launcher=torchrun",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "add -m" in one_line_error(proc)
    assert not (tmp_path / "run").exists()
