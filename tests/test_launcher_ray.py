"""hydra/launcher=ray on a real Ray cluster of two nodes on this machine (a head and a second node, started by Ray's
own cluster utilities with 2 CPUs and a 100 MB object store each, stopped however the tests end).

Hydra's launcher suite runs on it (Hydra's test apps: one rank a job, the launcher's own settings); trainflow's
sweeps run as gangs of 2 ranks, one on each node, with real gloo groups."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, one_line_error
from hydra.test_utils.launcher_common_tests import LauncherTestSuite

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need the ray extra: pip install 'trainflow[ray]'")

NODE = {"num_cpus": 2, "object_store_memory": 100 * 1024 * 1024}
RAY = ["hydra/launcher=ray", "hydra.launcher.poll_interval_s=0.1"]
# one job = 2 ranks, one on each node of the cluster, on gloo
TWO_NODES = ["parallelism=ddp", "parallelism.nproc_per_node=1", "hydra.launcher.nodes=2", "data=synthetic"]
STEPS = 30
RESUMABLE = [f"trainer.max_steps={STEPS}", "checkpoint=dcp", "checkpoint.every_steps=10", "checkpoint.verify=false"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A head node and a second node, 2 CPUs each; RAY_ADDRESS names it for every sweep of this module."""
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    # Ray kills workers when the machine's memory is 95% used: on a machine shared with other test processes that is
    # their memory, not the job's; a test of the launcher wants the ranks to live (an OOM kill is a lost rank anyway)
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 - Ray reads the name as it is spelt
    nodes = Cluster(initialize_head=True, connect=False, head_node_args=dict(NODE))
    try:
        nodes.add_node(**NODE)
        nodes.wait_for_nodes()
        print(f"Ray cluster of 2 nodes up in {time.monotonic() - started:.1f} s at {nodes.address}")
        before = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = nodes.address
        yield nodes.address
    finally:
        if "before" in locals():
            if before is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = before
        nodes.shutdown()
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py -m ...` as users type it, into sweep_dir."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return run_process([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, timeout=timeout)


# Hydra's own launcher suite on the cluster: Hydra's test apps (no trainflow config) run with the launcher's own
# settings, one rank a job; a sweep's jobs run side by side. Each job costs a Ray actor and a worker process (~10 s on
# two busy cores): the default run keeps the suite's one- and two-job sweeps, its strict config and its overrides
# of Hydra's own keys; the five that sweep other overrides through the same path run with -m slow.
def _slow(name: str) -> object:
    """Hydra's suite test `name`, marked slow here only (marking the inherited function would mark it for the
    process and torchrun launchers' suites too)."""
    @pytest.mark.slow
    def test(self, hydra_sweep_runner: object, launcher_name: str, overrides: list[str], tmpdir: Path) -> None:
        getattr(LauncherTestSuite, name)(self, hydra_sweep_runner, launcher_name, overrides, tmpdir)

    test.__name__ = name
    return test


@pytest.mark.parametrize(("launcher_name", "overrides"), [("ray", ["hydra.launcher.poll_interval_s=0.1"])])
@pytest.mark.usefixtures("hydra_version_unset", "cluster")
class TestHydraLauncherSuite(LauncherTestSuite):
    test_sweep_1_job_strict = _slow("test_sweep_1_job_strict")
    test_sweep_2_optimizers = _slow("test_sweep_2_optimizers")
    test_sweep_over_unspecified_mandatory_default = _slow("test_sweep_over_unspecified_mandatory_default")
    test_sweep_and_override = _slow("test_sweep_and_override")
    test_sweep_with_custom_resolver = _slow("test_sweep_with_custom_resolver")


@dataclass
class Sweep:
    dir: Path
    returncode: int
    output: str  # the launcher's stdout and stderr
    killed: int | None  # the pid of the rank that was killed
    command: list[str]


def _rank_pid(job_dir: Path, rank: int, attempt: int) -> int | None:
    """The pid of trainflow's worker of `rank` of the job in job_dir, in `attempt` (read from its environment)."""
    want = {f"TRAINFLOW_RUN_DIR={job_dir}", f"RANK={rank}", f"TORCHELASTIC_RESTART_COUNT={attempt}"}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and want <= set((proc / "environ").read_bytes().decode(errors="replace")
                                                   .split("\0")):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def sweep(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Two identical jobs side by side, each 2 ranks on the 2 nodes, checkpoints every 10 steps, max_restarts=1.
    Job 0 runs through; rank 1 of job 1 is SIGKILLed at step 15, so its gang restarts."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *RAY, *TWO_NODES, *RESUMABLE,
           "parallelism.max_restarts=1", "hydra.launcher.shutdown_timeout_s=5", "trainer.seed=1,1",
           f"hydra.sweep.dir={sweep_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    console = sweep_dir.with_name(sweep_dir.name + ".out")  # a file, not a pipe: nobody reads a pipe while it runs,
    job = sweep_dir / "1"  # and a full one would stop the launcher at its next line (every step's, echoed)
    killed = None
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 900  # a guard against a hang: beside two spinners the sweep took over 400 s
        while proc.poll() is None and time.monotonic() < deadline:
            if killed is None and (job / "metrics.jsonl").exists() and max(losses_by_step(job), default=0) >= 15:
                killed = _rank_pid(job, rank=1, attempt=0)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Sweep(sweep_dir, proc.returncode, console.read_text(), killed, cmd)


def test_sweep_of_two_jobs_runs_each_as_a_gang_over_both_nodes_side_by_side(sweep: Sweep) -> None:
    assert sweep.returncode == 0, sweep.output[-4000:]
    assert sorted(p.name for p in sweep.dir.iterdir() if p.is_dir()) == ["0", "1"]  # one directory per job
    spans = []
    for num in (0, 1):
        job = sweep.dir / str(num)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == STEPS
        placement = json.loads((job / "ray" / "attempt_0" / "placement.json").read_text())
        assert [r["rank"] for r in placement] == [0, 1]
        assert len({r["node_id"] for r in placement}) == 2  # STRICT_SPREAD: one rank on each node
        assert (job / "ray" / "attempt_0" / "rank_1.log").is_file()  # every rank's output came back into the job
        assert f"step 1/{STEPS}" in (job / "ray" / "attempt_0" / "rank_0.log").read_text()
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "train.log").is_file()
        assert len(losses_by_step(job)) == STEPS
        spans.append(((job / "ray" / "attempt_0" / "placement.json").stat().st_mtime,
                      (job / "summary.json").stat().st_mtime))
    assert spans[1][0] < spans[0][1] and spans[0][0] < spans[1][1]  # the two gangs ran at the same time
    assert re.findall(r"#(\d) COMPLETED", sweep.output) == ["0", "1"]
    assert re.search(rf"^\[#0 rank0\]:.*step {STEPS}/{STEPS}", sweep.output, re.MULTILINE)  # streamed back as it ran


def test_a_lost_rank_restarts_its_gang_from_the_last_checkpoint_with_the_same_losses(sweep: Sweep) -> None:
    """Job 1 lost rank 1 at step 15: named in one line, the gang restarted, resumed from its newest checkpoint and
    ended with the losses of the uninterrupted job 0, bit for bit."""
    assert sweep.killed is not None and sweep.returncode == 0, sweep.output[-4000:]
    reference, job = sweep.dir / "0", sweep.dir / "1"
    assert sorted(p.name for p in (job / "ray").glob("attempt_*")) == ["attempt_0", "attempt_1"]
    assert sorted(p.name for p in (reference / "ray").glob("attempt_*")) == ["attempt_0"]
    lines = [line for line in sweep.output.splitlines() if "restarting the gang" in line]
    assert len(lines) == 1 and re.search(
        rf"#1: rank 1 \(pid {sweep.killed}\) was lost: killed by signal SIGKILL \(rank 0 lost its connection to it "
        r"in step \d+\); .*; restarting the gang \(restart 1 of 1\)$", lines[0]), lines
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from_step"] in range(10, STEPS, 10)  # not from 0
    assert summary["steps_this_run"] == STEPS - summary["resumed_from_step"]
    assert losses_by_step(job) == losses_by_step(reference)
    assert summary["validation"]["loss"] == json.loads((reference / "summary.json").read_text())["validation"]["loss"]


def test_the_same_sweep_again_skips_the_finished_jobs(sweep: Sweep) -> None:
    assert sweep.returncode == 0, sweep.output[-4000:]
    before = {n: (sweep.dir / n / "metrics.jsonl").read_bytes() for n in ("0", "1")}
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    again = run_process(sweep.command, ROOT, env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"sweep: job #(\d) finished already", again.stdout + again.stderr) == ["0", "1"]
    assert {n: (sweep.dir / n / "metrics.jsonl").read_bytes() for n in ("0", "1")} == before
    assert sorted(p.name for p in (sweep.dir / "1" / "ray").glob("attempt_*")) == ["attempt_0", "attempt_1"]


def _job_processes(sweep_dir: Path) -> list[int]:
    """Pids of trainflow workers of a job of sweep_dir (their environment names the job's folder) and of the
    launcher's rank actors (Ray names their processes after the class)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (f"TRAINFLOW_RUN_DIR={sweep_dir}/".encode() in (proc / "environ").read_bytes()
                                        or b"RankActor" in (proc / "cmdline").read_bytes()):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _cluster_state(address: str) -> dict:
    """The cluster's free and total CPUs and its placement groups' states, as a fresh driver sees them."""
    code = ("import json, logging, ray\n"
            f"ray.init(address={address!r}, logging_level=logging.ERROR, log_to_driver=False)\n"
            "print(json.dumps({'free': ray.available_resources().get('CPU', 0), "
            "'total': ray.cluster_resources().get('CPU', 0), "
            "'groups': sorted(g['state'] for g in ray.util.placement_group_table().values())}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# SIGTERM takes the same path once its handler turned it into Ctrl-C's KeyboardInterrupt: with -m slow
@pytest.mark.parametrize("stop", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["ctrl-c", "sigterm"])
def test_stopping_the_sweep_leaves_no_rank_actor_or_placement_behind(cluster: str, tmp_path: Path,
                                                                     stop: signal.Signals) -> None:
    """Two gangs train; Ctrl-C (or SIGTERM) to the launcher stops both: every rank saves and ends, the actors are
    killed, the placement groups removed: the cluster has all its CPUs free again."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *RAY, *TWO_NODES, "trainer.max_steps=100000",
           "trainer.eval_every=0", "checkpoint=dcp", "checkpoint.every_steps=1000", "trainer.seed=1,2",
           f"hydra.sweep.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    console = tmp_path.with_name(tmp_path.name + ".out")  # a file: a pipe nobody reads would stop the launcher
    with open(console, "w") as written:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=written, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600  # a guard against a hang: beside two spinners over 240 s
        while not all((tmp_path / n / "metrics.jsonl").exists() and max(losses_by_step(tmp_path / n), default=0) >= 2
                      for n in ("0", "1")):
            assert launcher.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert len([p for p in _job_processes(tmp_path) if p != launcher.pid]) >= 4  # 2 ranks x 2 jobs, + actors
        launcher.send_signal(stop)
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = console.read_text()
    assert launcher.returncode != 0, out[-3000:]
    assert "Stopping 2 running job(s)" in out
    deadline = time.monotonic() + 30
    while _job_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(tmp_path) == []
    for n in ("0", "1"):  # each rank saved at its step boundary on the SIGTERM it got: the same command resumes
        summary = json.loads((tmp_path / n / "summary.json").read_text())
        assert summary["checkpoint"]["stopped_by"] == "SIGTERM", summary.get("checkpoint")
    state = _cluster_state(cluster)
    assert state["free"] == state["total"] == 4 and set(state["groups"]) <= {"REMOVED"}, state


def test_no_cluster_address_is_one_line_and_starts_no_cluster(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=ray", "trainer.max_steps=1",
                        f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, env=env, timeout=120)
    assert one_line_error(proc) == (
        "Error: hydra.launcher.address: no Ray cluster given; set hydra.launcher.address=<head host>:6379 (or "
        "RAY_ADDRESS), or start one here with `ray start --head` and set hydra.launcher.address=auto")
    assert not (tmp_path / "0").exists()


def test_a_gang_the_cluster_cannot_place_is_refused_in_one_line(cluster: str, tmp_path: Path) -> None:
    """Three nodes asked of a 2-node cluster: refused before anything starts (a placement group would wait
    forever)."""
    proc = multirun(tmp_path, *RAY, "parallelism=ddp", "parallelism.nproc_per_node=1", "hydra.launcher.nodes=3",
                    timeout=120)
    assert one_line_error(proc) == ("Error: hydra.launcher.nodes: 3 nodes asked for, the Ray cluster has 2; lower "
                                    "it or add nodes")
    assert not (tmp_path / "0").exists()


def test_ray_launcher_without_multirun_is_refused(tmp_path: Path) -> None:
    proc = run_process([sys.executable, str(ROOT / "train.py"), "hydra/launcher=ray",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, timeout=60)
    assert "add -m" in one_line_error(proc)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_rank_whose_actor_dies_is_named_and_its_gang_restarts(cluster: str, tmp_path: Path) -> None:
    """The actor of rank 0 is SIGKILLed at step 7 (as when its node goes away): Ray reports the actor dead and its
    worker dies with it; the launcher names the rank and restarts the gang, which resumes from the checkpoint of
    step 5 (or a later one)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *RAY, "parallelism=single", "data=synthetic",
           "trainer.max_steps=20", "checkpoint=dcp", "checkpoint.every_steps=5", "checkpoint.verify=false",
           "parallelism.max_restarts=1", f"hydra.sweep.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = tmp_path / "0"
    actor = None
    try:
        deadline = time.monotonic() + 240
        while actor is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            worker = _rank_pid(job, rank=0, attempt=0)
            if worker is not None and (job / "metrics.jsonl").exists() and max(losses_by_step(job), default=0) >= 7:
                actor = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
                assert b"RankActor" in Path(f"/proc/{actor}/cmdline").read_bytes()
                os.kill(actor, signal.SIGKILL)
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"#0: rank 0 \(pid \d+\) was lost: its Ray actor on node \S+ died \(.*\); restarting the gang "
                     r"\(restart 1 of 1\)$", out, re.MULTILINE), out[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumed_from_step"] in (5, 10, 15)  # its last committed checkpoint
    assert _job_processes(tmp_path) == []
