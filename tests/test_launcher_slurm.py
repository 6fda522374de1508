"""hydra/launcher=slurm against a real SLURM cluster (`launch/slurm/up.sh` starts a local one; CI does).

Without SLURM's commands (a developer machine) the cluster tests skip; the sbatch script test runs everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.checkpoints import read_tensors
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, one_line_error, wait_for_log
from helpers.slurm import SLURM, multirun, sweep_env
from hydra.test_utils.launcher_common_tests import LauncherTestSuite

from trainflow.checkpoint import check_intact, list_committed

# one job = 2 ranks on gloo, as SLURM tasks; timeout_min > 10 so that submitit takes USR2 for a preemption
TWO_RANKS = ["parallelism=ddp", "parallelism.nproc_per_node=2", "hydra.launcher.cpus_per_task=1",
             "hydra.launcher.timeout_min=15", "data=synthetic"]
RESUMABLE = ["checkpoint=dcp", "checkpoint.every_steps=50", "checkpoint.verify=false"]


@pytest.fixture(scope="module")
def cluster() -> None:
    """Skip without SLURM's commands; fail when they exist but no cluster answers (CI starts one)."""
    if shutil.which("sinfo") is None:
        pytest.skip("SLURM is not installed here (no sinfo); CI starts a local cluster with launch/slurm/up.sh")
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not re.search(r"idle|mix|alloc", out.stdout):
        pytest.fail(f"sinfo is installed but no SLURM node takes jobs ({(out.stderr or out.stdout).strip()[:200]}); "
                    "start the local cluster: sudo bash launch/slurm/up.sh")


needs_cluster = pytest.mark.usefixtures("cluster")





def slurm_ids(sweep_dir: Path) -> list[str]:
    """The jobs' SLURM ids (array elements "<array>_<n>", or one plain id), from submitit's log folders."""
    folder = sweep_dir / ".submitit"
    names = [p.name for p in folder.iterdir()] if folder.exists() else []
    return sorted(n for n in names if re.fullmatch(r"\d+_\d+", n)) or sorted(n for n in names if n.isdigit())


def _submitit_entries(sweep_dir: Path) -> set[str]:
    """The SLURM ids submitit keeps a log folder for, array elements and single jobs alike."""
    return {p.name for p in (sweep_dir / ".submitit").iterdir() if re.fullmatch(r"\d+(_\d+)?", p.name)}


def sacct(job_id: str) -> tuple[str, int]:
    """(final state, restarts) of a job as SLURM has it; waits while the accounting still says RUNNING."""
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=30).stdout.split()
        state = out[-1] if out else "?"
        if state not in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED", "?") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    restarts = re.search(r"Restarts=(\d+)", show)
    return state, int(restarts.group(1)) if restarts else -1


# Hydra's own launcher suite on the cluster: Hydra's test apps (no trainflow config) run with the launcher's own
# settings, one task a job; a sweep's jobs run at once, as one array.
@needs_cluster
@pytest.mark.parametrize(("launcher_name", "overrides"), [("slurm", ["hydra.launcher.poll_interval_s=0.5"])])
@pytest.mark.usefixtures("hydra_version_unset")
class TestHydraLauncherSuite(LauncherTestSuite):
    pass


def test_sbatch_script_for_four_nodes_of_eight_gpus(tmp_path: Path) -> None:
    """Inspected, not submitted: runs without a cluster."""
    proc = multirun(tmp_path, *SLURM, "hydra.launcher.nodes=4", "hydra.launcher.gpus_per_node=8",
                    "hydra.launcher.cpus_per_task=10", "hydra.launcher.mem_gb=480", "hydra.launcher.timeout_min=240",
                    "hydra.launcher.partition=gpu", "hydra.launcher.constraint=h100",
                    "+hydra.launcher.additional_parameters.exclusive=true", "hydra.launcher.setup=[module load nccl]",
                    "hydra.launcher.dry_run=true", "trainer.seed=1,2", "parallelism=ddp", timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "dry_run.sbatch").read_text()
    sbatch = {line for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {"#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8",  # one task per GPU
            "#SBATCH --cpus-per-task=10", "#SBATCH --mem=480GB", "#SBATCH --time=240", "#SBATCH --partition=gpu",
            "#SBATCH --constraint=h100", "#SBATCH --exclusive", "#SBATCH --requeue", "#SBATCH --signal=USR2@120",
            "#SBATCH --array=0-1%2", "#SBATCH --job-name=train"} <= sbatch
    lines = script.splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert lines.index("module load nccl") < lines.index(srun)
    assert "--unbuffered" in srun and "%A_%a_%t_log.out" in srun  # one log per task (rank)
    assert srun.endswith(f"-u -m submitit.core._submit {tmp_path}/.submitit/%j")
    assert not (tmp_path / ".submitit").exists()  # nothing submitted
    assert "Warning" not in proc.stderr and "no runs found" not in proc.stderr  # no report of a sweep that never ran


@pytest.mark.parametrize(("signals", "warned"), [("[SIGTERM,SIGUSR1]", True), ("[SIGTERM,SIGUSR2]", False)])
def test_stop_signals_without_slurms_notice_are_said(tmp_path: Path, signals: str, warned: bool) -> None:
    """Inspected, not submitted: SLURM's notice before a time limit or a preemption is USR2 (#SBATCH --signal);
    checkpoint.stop_signals without it saves nothing on the notice, and the launcher says so once."""
    proc = multirun(tmp_path, *SLURM, "hydra.launcher.dry_run=true", "checkpoint=dcp",
                    f"checkpoint.stop_signals={signals}", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("checkpoint.stop_signals leaves out SIGUSR2, SLURM's notice before a time limit or a preemption: a "
            "requeued job starts again from its last periodic checkpoint" in proc.stdout + proc.stderr) is warned
    assert "#SBATCH --signal=USR2@120" in (tmp_path / "dry_run.sbatch").read_text()


@pytest.mark.parametrize(("overrides", "tasks"), [
    (["parallelism=ddp", "parallelism.nproc_per_node=3"], 3),  # the one knob, followed
    (["parallelism=fsdp", "hydra.launcher.gpus_per_node=4"], 4),  # auto: one rank per GPU asked for
    (["parallelism=fsdp"], 2),  # auto without GPUs: 2 CPU ranks
    (["parallelism=single", "hydra.launcher.gpus_per_node=4"], 1),  # one process, whatever the node has
])
def test_tasks_per_node_follow_parallelism(tmp_path: Path, overrides: list[str], tasks: int) -> None:
    """Inspected, not submitted: the ranks per node of the sbatch script come from parallelism.nproc_per_node."""
    proc = multirun(tmp_path, *SLURM, "hydra.launcher.dry_run=true", *overrides, timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "dry_run.sbatch").read_text()
    assert [line for line in script.splitlines() if "--ntasks-per-node" in line] == \
        [f"#SBATCH --ntasks-per-node={tasks}"]


@needs_cluster
def test_parallelism_nproc_per_node_alone_starts_that_many_ranks(tmp_path: Path) -> None:
    """No hydra.launcher.tasks_per_node: the job runs as parallelism.nproc_per_node=2 SLURM tasks (before, one
    task, and the run failed asking for the very setting the user had given)."""
    proc = multirun(tmp_path, *TINY_GPT, *SLURM, "parallelism=ddp", "parallelism.nproc_per_node=2", "data=synthetic",
                    "hydra.launcher.timeout_min=15", "trainer.max_steps=3", "trainer.eval_steps=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    job_id = slurm_ids(tmp_path)[0]
    for rank in (0, 1):  # each rank its own SLURM task
        assert f"global_rank={rank}(2)" in (tmp_path / ".submitit" / job_id / f"{job_id}_{rank}_log.out").read_text()


@pytest.mark.parametrize(("overrides", "expected"), [
    (["parallelism=ddp", "hydra.launcher.tasks_per_node=4"],
     "Error: hydra.launcher.tasks_per_node: is for Hydra apps other than trainflow, and job #0 is a trainflow run, "
     "which sets its own: drop hydra.launcher.tasks_per_node and set parallelism.nproc_per_node"),
    (["parallelism=ddp", "parallelism.nproc_per_node=2,3"],
     "Error: parallelism.nproc_per_node: the jobs of this sweep ask for different ranks per node (#0: 2, #1: 3), "
     "and one SLURM job array has one shape; sweep jobs of each size separately"),
])
def test_ranks_per_node_that_disagree_fail_in_one_line(tmp_path: Path, overrides: list[str], expected: str) -> None:
    proc = multirun(tmp_path, *SLURM, *overrides, timeout=60)
    assert one_line_error(proc) == expected
    assert not (tmp_path / ".submitit").exists()  # nothing submitted
    assert "Warning" not in proc.stderr and "no runs found" not in proc.stderr  # no report of a sweep that never ran


@dataclass
class Sweep:
    dir: Path
    returncode: int
    output: str  # the launcher's stdout and stderr
    preempted: str  # the SLURM id of the job that got the preemption notice
    command: list[str]


@pytest.fixture(scope="module")
def sweep(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """A 2-job array of identical jobs, 2 ranks (SLURM tasks) each; job 0 gets `scancel --signal=USR2` at step 3
    of 120, as a preempting scheduler sends it. Job 1 runs through: the reference."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *SLURM, *TWO_RANKS, *RESUMABLE,
           "trainer.max_steps=120", "trainer.seed=5,5", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=sweep_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_step(proc, sweep_dir / "0", 3, timeout=240)
        job_id = slurm_ids(sweep_dir)[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    return Sweep(sweep_dir, proc.returncode, out, job_id, cmd)


def test_sweep_of_two_jobs_each_on_two_ranks(sweep: Sweep) -> None:
    assert sweep.returncode == 0, sweep.output[-5000:]
    ids = slurm_ids(sweep.dir)
    assert len(ids) == 2 and ids[0].split("_")[0] == ids[1].split("_")[0]  # one array
    for num, job_id in enumerate(ids):
        job = sweep.dir / str(num)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 120
        assert sacct(job_id)[0] == "COMPLETED"
        assert f"id: {job_id}" in (job / ".hydra" / "hydra.yaml").read_text().replace("'", "")  # SLURM's id
        for rank in (0, 1):  # each rank was its own SLURM task, with the rank submitit derived from SLURM's
            log = (sweep.dir / ".submitit" / job_id / f"{job_id}_{rank}_log.out").read_text()
            assert f"global_rank={rank}(2)" in log
    assert re.findall(r"#(\d) \(\d+_\d\) COMPLETED", sweep.output) == ["0", "1"]  # the launcher's report
    submitted = next((sweep.dir / ".submitit").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in submitted and "#SBATCH --requeue" in submitted


def test_the_ranks_of_a_slurm_job_print_like_a_single_run(sweep: Sweep) -> None:
    """Job 1's two ranks (SLURM tasks; each its own console, submitit's log files): the short header once, from
    rank 0, at most 15 lines before its first step, and the config in train.log only (trainer.print_config=false
    reaches every rank)."""
    job_id = slurm_ids(sweep.dir)[1]
    consoles = [[line for name in ("out", "err")
                 for line in (sweep.dir / ".submitit" / job_id / f"{job_id}_{rank}_log.{name}").read_text().splitlines()
                 if not line.startswith("submitit ")]  # submitit's own lines about the task
                for rank in (0, 1)]
    assert sum(" trains model " in line for console in consoles for line in console) == 1
    assert any(" trains model " in line for line in consoles[0])
    first_step = next(i for i, line in enumerate(consoles[0]) if re.search(r"step \d+/120", line))
    assert first_step <= 15, "\n".join(consoles[0][:first_step])
    assert not any("max_steps: 120" in line for console in consoles for line in console)
    assert "max_steps: 120" in (sweep.dir / "1" / "train.log").read_text()


def _wait_for_step(proc: subprocess.Popen, job_dir: Path, step: int, timeout: float) -> None:
    """Block until the job in job_dir has logged `step` (training runs, the stop-signal handlers are in place)."""
    deadline = time.monotonic() + timeout
    while not (job_dir / "metrics.jsonl").exists() or max(losses_by_step(job_dir), default=0) < step:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"{job_dir} did not reach step {step} in {timeout} s"
        time.sleep(0.2)


def test_preemption_signal_checkpoints_requeues_and_resumes_to_the_same_losses(sweep: Sweep) -> None:
    """Every rank of job 0 saved at the step boundary after USR2; submitit requeued the job (a preemption, not a
    timeout); it resumed from that checkpoint and ended with job 1's (uninterrupted) losses, bit for bit."""
    assert sweep.returncode == 0, sweep.output[-5000:]
    state, restarts = sacct(sweep.preempted)
    assert state == "COMPLETED" and restarts == 1
    preempted, reference = sweep.dir / "0", sweep.dir / "1"
    summary = json.loads((preempted / "summary.json").read_text())
    assert summary["steps"] == 120 and 3 <= summary["resumed_from_step"] < 50  # the step after the signal, not 0
    assert summary["steps_this_run"] == 120 - summary["resumed_from_step"]
    assert losses_by_step(preempted) == losses_by_step(reference)
    assert summary["validation"]["loss"] == json.loads((reference / "summary.json").read_text())["validation"]["loss"]
    rank_logs = "".join(p.read_text() for p in (sweep.dir / ".submitit" / sweep.preempted).glob("*_log.*"))
    assert "this job is preempted" in rank_logs and "Requeued job" in rank_logs  # submitit's path, not a timeout


def test_the_same_sweep_again_submits_nothing_when_every_job_finished(sweep: Sweep) -> None:
    """Both jobs (one of them preempted and resumed) finished with this config: each is skipped in one line, their
    results are kept, and nothing goes to SLURM."""
    assert sweep.returncode == 0, sweep.output[-5000:]
    before = {n: (sweep.dir / n / "metrics.jsonl").read_bytes() for n in ("0", "1")}
    entries = _submitit_entries(sweep.dir)
    again = run_process(sweep.command, ROOT, sweep_env(), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"sweep: job #(\d) finished already", again.stdout + again.stderr) == ["0", "1"]
    assert "Submitted" not in again.stdout + again.stderr and _submitit_entries(sweep.dir) == entries
    assert {n: (sweep.dir / n / "metrics.jsonl").read_bytes() for n in ("0", "1")} == before


@needs_cluster
def test_time_limit_checkpoints_requeues_and_resumes_to_the_same_losses(tmp_path: Path) -> None:
    """timeout_min=1, signal_delay_s=5: SLURM's own notice before the time limit (USR2; SLURM looks at time limits
    every 30 s and sends it at the first look that finds less than signal_delay_s + 30 s left: 25 to 55 s after the
    start) reaches every rank in training; they save at the step boundary, submitit counts a timeout and requeues the
    job, which resumes and ends with the losses of an uninterrupted run. The first attempt reads each item 0.06 s
    slower (8 a step: ~70 s of steps), so that it is still training when the notice comes; the second reads at full
    speed and is done before its own (25 s after its start at the earliest)."""
    data = ["data=synthetic", "data._target_=helpers.slurm.first_attempt_slow", "data.num_samples=4096"]
    steps = [*TINY_GPT, *data, "trainer.max_steps=150", "trainer.eval_every=0", "parallelism=ddp"]
    tests = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)}
    reference = tmp_path / "reference"  # trained beside the job's first attempt, which mostly sleeps
    local = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *steps, "parallelism.nproc_per_node=2",
                              f"hydra.run.dir={reference}"], cwd=ROOT, env={**sweep_env(), **tests},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sweep = tmp_path / "sweep"
    proc = multirun(sweep, *steps, *SLURM, *TWO_RANKS[:2], "hydra.launcher.timeout_min=1",
                    "hydra.launcher.signal_delay_s=5", *RESUMABLE, timeout=400,
                    env={**sweep_env(), **tests, "TEST_FIRST_ATTEMPT_ITEM_S": "0.06"})
    assert local.wait(timeout=300) == 0, local.stderr.read()[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = slurm_ids(sweep)
    state, restarts = sacct(job_id)
    rank_logs = "".join(p.read_text() for p in (sweep / ".submitit" / job_id).glob("*_log.*"))
    attempts = [line for line in rank_logs.splitlines() if re.search(r"Caught signal|stopped at step|resumed", line)]
    assert state == "COMPLETED" and restarts == 1, "\n".join(attempts)  # one notice: in the first attempt
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    resumed = summary["resumed_from_step"]
    assert summary["steps"] == 150 and resumed is not None and 0 < resumed < 150
    assert losses_by_step(sweep / "0") == losses_by_step(reference)
    assert "this job is timed-out" in rank_logs  # submitit's own account of the notice: a time limit
    assert f"SIGUSR2: stopped at step {resumed} with checkpoint " in rank_logs  # saved on the notice, resumed there


@needs_cluster
def test_failed_job_comes_back_with_its_reason_and_alone_is_submitted_again(tmp_path: Path) -> None:
    """Job 0 fails, job 1 still runs; the report names job 0's failure. The same sweep again submits job 0 only:
    job 1 finished (same config), is skipped in one line and keeps its results."""
    overrides = [*TINY_GPT, *SLURM, "trainer.max_steps=2", "trainer.eval_steps=0,1"]
    proc = multirun(tmp_path, *overrides)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert json.loads((tmp_path / "1" / "summary.json").read_text())["steps"] == 2  # job 1 ran despite job 0
    failure = (r"job #0 failed on SLURM \(job \d+_0, state FAILED, exit code 2\): "
               r"trainer\.eval_steps: must be a positive integer; got 0")
    assert re.search(failure, proc.stderr), proc.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert [r["status"] for r in rows] == ["failed", "finished"] and re.match(failure, rows[0]["error"])
    metrics, first_ids = (tmp_path / "1" / "metrics.jsonl").read_bytes(), _submitit_entries(tmp_path)

    again = multirun(tmp_path, *overrides)
    assert again.returncode == 1, again.stderr[-3000:]
    assert re.findall(r"sweep: job #(\d) finished already", again.stdout + again.stderr) == ["1"]
    assert "Submitted 1 jobs to SLURM" in again.stdout + again.stderr
    new_ids = sorted(_submitit_entries(tmp_path) - first_ids)
    assert len(new_ids) == 1 and new_ids[0].isdigit()  # one job, not an array: job 0 alone went to SLURM again
    assert sacct(new_ids[0])[0] == "FAILED"
    assert (tmp_path / "1" / "metrics.jsonl").read_bytes() == metrics


def test_srun_task_ends_are_read_as_signals_the_last_attempt_of_each_task_counting() -> None:
    """srun's account of tasks that ended by a signal, as it writes it into the batch log: a task list, a signal's
    description, and "Out Of Memory" for a task the job's memory limit killed (here no cgroup enforces one, so the
    line is srun's own wording); a requeued job's later attempt overrides the earlier one of the same task."""
    from hydra_plugins.trainflow_launchers.slurm_launcher import srun_signal_ends

    log = "\n".join(["step 3 loss 2.1", "srun: error: node1: task 1: Killed", "requeued",
                     "srun: error: node1: tasks 0,2-3: Terminated", "srun: error: node1: task 1: Out Of Memory",
                     "srun: error: node1: task 4: Exited with exit code 2"])
    assert srun_signal_ends(log) == {0: (3, "SIGTERM"), 2: (3, "SIGTERM"), 3: (3, "SIGTERM"),
                                     1: (4, "SIGKILL (out of memory: the job's memory limit)")}


@needs_cluster
def test_a_rank_killed_by_a_signal_fails_its_job_in_one_line_and_the_same_sweep_resumes_it(tmp_path: Path) -> None:
    """SIGKILL of rank 1 of job 0 (as an OOM kill does) once step 4 is committed: rank 0 ends within seconds (its
    collective loses the connection), the sweep names rank 1, SIGKILL and the step rank 0 noticed it in, in one line
    (not rank 0's connection error, no traceback), committed checkpoints are whole; the same sweep again resumes
    job 0 from its last commit to the losses of job 1, which ran through."""
    # 16 steps: half a second of training after the kill even on an idle machine, so that the kill lands mid-run
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *TINY_GPT, *SLURM, *TWO_RANKS, "checkpoint=dcp",
           "checkpoint.every_steps=2", "checkpoint.verify=false", "trainer.max_steps=16", "trainer.eval_every=0",
           "trainer.eval_steps=2", "trainer.seed=5,5", f"hydra.sweep.dir={tmp_path}"]
    job, reference = tmp_path / "0", tmp_path / "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=sweep_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_log(job, "checkpoint step 2 committed", proc, timeout=240)
        array_id = slurm_ids(tmp_path)[0].split("_")[0]
        ranks = _rank_pids(array_id, 0)
        assert sorted(ranks) == [0, 1], ranks
        wait_for_log(job, "checkpoint step 4 committed", proc, timeout=60)
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        while Path(f"/proc/{ranks[0]}").exists():  # rank 0, the healthy one, ends by itself
            assert time.monotonic() - killed_at < 60, "rank 0 still runs 60 s after rank 1 was killed"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err and "gloo" not in err, err[-3000:]  # not rank 0's connection error
    failure = (rf"job #0 failed on SLURM \(job {array_id}_0, state FAILED, exit code \d+\): rank 1 was lost: killed by "
               r"signal SIGKILL \(rank 0 lost its connection to it in step (\d+)\); the other ranks were stopped; "
               r"committed checkpoints are intact: the same command resumes from the newest \[log: \S+\]")
    said = [match for line in err.splitlines() if (match := re.fullmatch(failure, line))]  # Hydra's frame around it
    assert len(said) == 1, err[-3000:]
    noticed = int(said[0].group(1))
    assert re.fullmatch(failure, (job / "failure.txt").read_text().strip())  # the sweep's report blames rank 1 too
    listed = list_committed(job / "checkpoints")
    assert listed and all(c.step % 2 == 0 for c in listed) and 4 <= listed[-1].step < noticed
    for c in listed:  # whole: every file as its manifest says, every tensor readable
        check_intact(c, listed)
        assert read_tensors(c.path)
    assert json.loads((reference / "summary.json").read_text())["steps"] == 16  # job 1 ran despite job 0

    again = run_process(cmd, ROOT, sweep_env(), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"sweep: job #(\d) finished already", again.stdout + again.stderr) == ["1"]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["resumed_from_step"] == listed[-1].step
    assert losses_by_step(job) == losses_by_step(reference)
    assert summary["validation"]["loss"] == json.loads((reference / "summary.json").read_text())["validation"]["loss"]


def _rank_pids(array_id: str, element: int) -> dict[int, int]:
    """{rank: pid} of the ranks (SLURM tasks) of one job array element, read from the processes' environments."""
    want = {f"SLURM_ARRAY_JOB_ID={array_id}", f"SLURM_ARRAY_TASK_ID={element}"}
    tasks = {}
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            command = (proc / "cmdline").read_bytes().decode(errors="replace")
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, ValueError, IndexError):
            continue
        if proc.name.isdigit() and want <= env and "submitit.core._submit" in command:
            rank = next(int(v.removeprefix("SLURM_PROCID=")) for v in env if v.startswith("SLURM_PROCID="))
            tasks[int(proc.name)] = (rank, int(parent))
    return {rank: pid for pid, (rank, parent) in tasks.items() if parent not in tasks}  # not a rank's own child


@needs_cluster
@pytest.mark.parametrize(("overrides", "expected"), [
    (["hydra.launcher.partition=nope"], r"Error: hydra\.launcher\.partition: SLURM has no partition 'nope'; pick one"),
    (["hydra.launcher.mem_gb=100000"], r"Error: hydra\.launcher\.mem_gb: 100000 GB per node asked for, the nodes "
                                       r"of partition \w+ have at most \d+ GB, so sbatch refused the jobs \(.*Memory"),
    (["hydra.launcher.gpus_per_node=8"], r"Error: hydra\.launcher\.gpus_per_node: 8 GPUs per node asked for, the nodes "
                                         r"of partition \w+ have at most 0, so sbatch refused the jobs"),
    # accepted by sbatch, then pending forever: the launcher reads SLURM's pending reason, cancels, names the key
    (["hydra.launcher.nodes=2"], r"Error: hydra\.launcher\.nodes: 2 nodes asked for, partition \w+ has 1, so SLURM "
                                 r"would keep job \d+ pending forever \(reason Partition\w+\); cancelled it"),
    (["parallelism=ddp", "parallelism.nproc_per_node=64"],
     r"Error: parallelism\.nproc_per_node: 64 tasks x 1 CPUs = 64 CPUs per node asked for, .* pending forever "
     r"\(reason PartitionConfig\)"),
])
def test_requests_the_cluster_cannot_run_fail_in_one_line(tmp_path: Path, overrides: list[str], expected: str
                                                           ) -> None:
    proc = multirun(tmp_path, *SLURM, *overrides, "trainer.max_steps=1", timeout=120)
    assert re.match(expected, one_line_error(proc))
    assert not (tmp_path / "0" / "summary.json").exists()
    ids = slurm_ids(tmp_path)
    if ids:  # a pending job was cancelled, not left in the queue
        queued = subprocess.run(["squeue", "-h", "-j", ids[0].split("_")[0]], capture_output=True, text=True)
        assert queued.stdout.strip() == ""


@pytest.mark.parametrize(("overrides", "expected"), [
    (["hydra.launcher.nodes=0"], "Error: hydra.launcher.nodes: must be >= 1; got 0"),
    (["hydra.launcher.tasks_per_node=0"], "Error: hydra.launcher.tasks_per_node: must be >= 1; got 0"),
    (["hydra.launcher.signal_delay_s=600", "hydra.launcher.timeout_min=5"], "Error: hydra.launcher.signal_delay_s:"),
])
def test_bad_slurm_settings_fail_in_one_line(tmp_path: Path, overrides: list[str], expected: str) -> None:
    proc = multirun(tmp_path, *SLURM, *overrides, timeout=60)
    assert one_line_error(proc).startswith(expected)


def test_bad_setting_shows_the_traceback_with_hydra_full_error(tmp_path: Path) -> None:
    proc = multirun(tmp_path, *SLURM, "hydra.launcher.nodes=0", env={**sweep_env(), "HYDRA_FULL_ERROR": "1"},
                    timeout=60)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    assert "trainflow.errors.ConfigError: hydra.launcher.nodes: must be >= 1; got 0" in proc.stderr


def test_no_sbatch_on_path_fails_in_one_line(tmp_path: Path) -> None:
    env = {**sweep_env(), "PATH": str(Path(sys.executable).parent)}  # python, but no SLURM commands
    proc = multirun(tmp_path, *SLURM, "trainer.max_steps=1", env=env, timeout=60)
    assert one_line_error(proc).startswith("Error: hydra/launcher=slurm: sbatch is not on PATH")


def test_slurm_launcher_without_multirun_is_refused(tmp_path: Path) -> None:
    proc = run_process([sys.executable, str(ROOT / "train.py"), "hydra/launcher=slurm",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "add -m" in one_line_error(proc)
    assert not (tmp_path / "run").exists()
