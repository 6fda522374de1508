"""`hydra/launcher=slurm`: a sweep becomes one SLURM job array through submitit; each element is one job.

Process model: one SLURM task per rank (per GPU on a GPU cluster), not one
elastic agent per node. SLURM then starts, signals and kills every rank itself:
its preemption notice (USR2, `--signal=USR2@signal_delay_s`) reaches every
rank directly, where torchrun would not forward it and would SIGKILL 30 s
after a SIGTERM; and submitit's checkpoint/requeue machinery, which lives in
the task processes, sees the real ranks. Each task exports RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (the job's first node) and
MASTER_PORT (derived from the job id) from SLURM's variables, so a multi-node
job rendezvouses on its first node. What an elastic agent would add, restarts
inside an allocation, is left to requeueing.

Preemption and time limits: on USR2 trainflow's checkpoint stage saves at the
next step boundary on every rank and the job exits with EXIT_STOPPED; rank 0
then hands the signal to submitit, which calls `checkpoint()` (a requeue of
the same job) and requeues it. The requeued job runs in the same directory and
resumes from that checkpoint. A SIGTERM stop (scancel) is not requeued.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import OmegaConf, open_dict

from hydra_plugins.trainflow_launchers.common import (
    JobFailed,
    SweepJob,
    SweepLauncher,
    failure_reason,
    finished_already,
    job_shape,
    log_outcome,
    one_line,
    run_job_here,
    trainflow_job,
    user_error,
)
from hydra_plugins.trainflow_launchers.config import SlurmLauncherConf
from trainflow.util.failures import WorkerError, lost_rank_error, noted_step, says_peer_lost

log = logging.getLogger(__name__)

# Pending reasons after which SLURM never starts the job, whatever else runs: the key to change and why.
_NEVER_REASONS = {
    "PartitionNodeLimit": ("nodes", "more nodes than the partition allows"),
    "PartitionTimeLimit": ("timeout_min", "a longer time limit than the partition allows"),
    "PartitionConfig": ("nodes", "more nodes, CPUs, memory or GPUs than the partition's nodes have"),
    "BadConstraints": ("constraint", "a feature no node of the partition has"),
    "InvalidAccount": ("account", "an account SLURM does not know"),
    "InvalidQOS": ("qos", "a QOS SLURM does not know or this account may not use"),
    "DependencyNeverSatisfied": ("additional_parameters", "a dependency that can never be satisfied"),
}
_HELD = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
         "SUSPENDED", "STOPPED"}  # squeue states of a job that is not over yet
_PER_JOB_LIMIT = re.compile(r"(?:QOS|Assoc)Max\w*PerJob\w*")  # a per-job limit of the QOS or account: never either

# sbatch's refusals: (pattern in its message, the key to change, what to do).
_SBATCH_ERRORS = (
    (r"invalid partition", "partition", "pick one of the cluster's partitions (sinfo -s)"),
    (r"Invalid feature", "constraint", "use a feature the nodes have (sinfo -o '%P %f')"),
    (r"Invalid qos", "qos", "use a QOS of your account (sacctmgr show assoc user=$USER)"),
    (r"Invalid account", "account", "use one of your accounts (sacctmgr show assoc user=$USER)"),
    (r"gres|node configuration is not available|Memory specification|Node count specification|"
     r"More processors requested|CPU count per node", "nodes",
     "no node of the partition has what each job asks for; lower nodes, tasks_per_node, cpus_per_task, "
     "gpus_per_node or mem_gb"),
    (r"time limit", "timeout_min", "ask for less time than the partition's limit"),
)


class SlurmLauncher(SweepLauncher):
    def __init__(self, **params: Any) -> None:
        super().__init__(SlurmLauncherConf(**params))

    def check(self) -> None:
        check_conf(self.conf)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        jobs = self.compose(job_overrides, initial_job_idx)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        params = sbatch_parameters(self.conf, tasks_per_node(self.conf, jobs))
        # the setting that makes a job's ranks per node, as a line that asks to change it names it
        ranks_key = "parallelism.nproc_per_node" if trainflow_job(jobs[0]) else "hydra.launcher.tasks_per_node"
        warn_unsaved_notice(jobs[0].config)
        if self.conf.dry_run:
            path = sweep_dir / "dry_run.sbatch"
            path.write_text(render_sbatch(self.conf, params, len(jobs)))
            log.info("dry run: the sbatch script for %d jobs is %s; nothing was submitted", len(jobs), path)
            return []
        preflight(self.conf)
        done = {job.num: ret for job in jobs if (ret := finished_already(job)) is not None}
        todo = [job for job in jobs if job.num not in done]  # the same sweep again: only unfinished jobs go
        if todo:
            runner = SlurmJobRunner(self.hydra_context, self.task_function, Singleton.get_state())
            submitted = submit(self.conf, params, runner, todo, ranks_key)
            log.info("Submitted %d jobs to SLURM as array %s (logs: %s)", len(todo),
                     submitted[0].job_id.split("_")[0], submitted[0].paths.folder.parent)
            for job, sj in zip(todo, submitted, strict=True):
                log.info("\t%s -> %s in %s", job.describe(), sj.job_id, job.dir)
            wait(self.conf, params, submitted, ranks_key)
            for job, sj in zip(todo, submitted, strict=True):
                done[job.num] = collect(self.hydra_context, job, sj)
                log_outcome(f"#{job.num} ({sj.job_id})", done[job.num], job.dir)
        return [done[job.num] for job in jobs]


class SlurmJobRunner:
    """What every SLURM task (one rank) runs: its sweep job, then, after a preemption notice, the requeue."""

    def __init__(self, hydra_context: HydraContext, task_function: TaskFunction, singleton_state: Any) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.singleton_state = singleton_state

    def __call__(self, job: SweepJob) -> JobReturn:
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        env = submitit.JobEnvironment()
        # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=<first node>, MASTER_PORT from SLURM's variables. Every task
        # keeps all the node's GPUs visible: trainflow picks cuda:LOCAL_RANK.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        # Like torchrun: one thread per rank unless SLURM gave the task more CPUs (else ranks fight for cores).
        os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
        setup_globals()
        Singleton.set_state(self.singleton_state)
        # Hydra marks the config it runs read-only: run a copy, so that checkpoint() requeues the job as submitted.
        run = SweepJob(job.num, job.overrides, copy.deepcopy(job.config), job.dir)
        with open_dict(run.config):
            run.config.hydra.job.id = env.job_id
        try:
            return run_job_here(self.hydra_context, self.task_function, run)
        except SystemExit as exc:
            # Not imported here: a notice during start-up interrupts `import torch`, and importing again would
            # fail on the half-imported module. A run trainflow stopped has loaded it.
            stopped = getattr(sys.modules.get("trainflow.checkpoint"), "EXIT_STOPPED", None)
            if stopped is not None and exc.code == stopped and env.global_rank == 0 \
                    and _stop_signal(job.dir) == "SIGUSR2":
                # Saved and stopped on the preemption notice: submitit's own USR2 handler (back in place now)
                # calls checkpoint(), requeues this job and exits.
                handler = signal.getsignal(signal.SIGUSR2)
                if callable(handler):
                    handler(signal.SIGUSR2, None)
            raise

    def checkpoint(self, job: SweepJob) -> Any:
        """submitit calls this on a preemption notice or time limit: run the same job again (it resumes)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, job)


def warn_unsaved_notice(cfg: Any) -> None:
    """Say when SLURM's notice before a time limit or a preemption (USR2, signal_delay_s before the end) would not
    save a checkpoint first: the requeued job then starts again from its last periodic save, or from step 0."""
    if not OmegaConf.select(cfg, "checkpoint.enabled", default=True):
        log.warning("checkpoint=off: a preempted or timed-out job starts again from step 0; "
                    "use checkpoint=dcp to resume where it stopped")
    elif "SIGUSR2" not in OmegaConf.select(cfg, "checkpoint.stop_signals", default=["SIGUSR2"]):
        log.warning("checkpoint.stop_signals leaves out SIGUSR2, SLURM's notice before a time limit or a preemption: "
                    "a requeued job starts again from its last periodic checkpoint; add SIGUSR2 to save on the notice")


def _stop_signal(job_dir: Path) -> str | None:
    """The signal trainflow's checkpoint stage stopped on, as rank 0 just wrote it into summary.json."""
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return (summary.get("checkpoint") or {}).get("stopped_by")


def check_conf(c: SlurmLauncherConf) -> None:
    """Values SLURM would refuse or misread, named by their key."""
    checks = (
        ("nodes", c.nodes, 1), ("gpus_per_node", c.gpus_per_node, 0), ("tasks_per_node", c.tasks_per_node, 1),
        ("cpus_per_task", c.cpus_per_task, 1), ("mem_gb", c.mem_gb, 1), ("timeout_min", c.timeout_min, 1),
        ("signal_delay_s", c.signal_delay_s, 0), ("max_num_timeout", c.max_num_timeout, 0),
        ("array_parallelism", c.array_parallelism, 1),
    )
    for key, value, least in checks:
        if value is not None and value < least:
            user_error(f"hydra.launcher.{key}: must be >= {least}; got {value}")
    if c.signal_delay_s >= c.timeout_min * 60:
        user_error(f"hydra.launcher.signal_delay_s: the preemption notice ({c.signal_delay_s} s before the end) "
                   f"must come after the start: use less than timeout_min x 60 = {c.timeout_min * 60}")
    if c.poll_interval_s <= 0:
        user_error(f"hydra.launcher.poll_interval_s: must be > 0 seconds; got {c.poll_interval_s}")
    if c.timeout_min <= 10:
        log.warning("hydra.launcher.timeout_min=%d: with 10 minutes or less, submitit counts every preemption "
                    "notice as a time limit (max_num_timeout=%d requeues in all)", c.timeout_min, c.max_num_timeout)


def tasks_per_node(c: SlurmLauncherConf, jobs: list[SweepJob]) -> int:
    """SLURM tasks (ranks) per node: a trainflow job's parallelism.nproc_per_node (auto: one per GPU of
    gpus_per_node, 2 CPU ranks for ddp/fsdp/hsdp without GPUs), another app's tasks_per_node; one array has one
    shape for all."""
    own = {"tasks_per_node": c.tasks_per_node}
    per_job = {job.num: int(job_shape(job, "tasks_per_node", own, lambda: c.gpus_per_node).ranks_per_node)
               for job in jobs}
    if len(set(per_job.values())) > 1:
        shapes = ", ".join(f"#{num}: {n}" for num, n in per_job.items())
        user_error(f"parallelism.nproc_per_node: the jobs of this sweep ask for different ranks per node ({shapes}), "
                   "and one SLURM job array has one shape; sweep jobs of each size separately")
    return next(iter(per_job.values()))


def sbatch_parameters(c: SlurmLauncherConf, ranks_per_node: int) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters (sbatch's own names) for the launcher config."""
    params: dict[str, Any] = {
        "job_name": c.name,
        "nodes": c.nodes,
        "ntasks_per_node": ranks_per_node,
        "time": c.timeout_min,
        "signal_delay_s": c.signal_delay_s,
        "array_parallelism": c.array_parallelism,
        # requeue-able even where the cluster's JobRequeue default says no
        "additional_parameters": {"requeue": True, **OmegaConf.to_container(OmegaConf.create(c.additional_parameters))},
    }
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    optional = {"cpus_per_task": c.cpus_per_task, "mem": f"{c.mem_gb}GB" if c.mem_gb else None,
                "partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
                "setup": list(c.setup) or None, "srun_args": list(c.srun_args) or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def _python_command(folder: str) -> str:
    """The command submitit puts in the script: this interpreter running submitit's job entry point."""
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(folder)])


def render_sbatch(c: SlurmLauncherConf, params: dict[str, Any], num_jobs: int) -> str:
    """The script `submit` hands to sbatch for `num_jobs` jobs, rendered by submitit's own template."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = str(Path(c.submitit_folder).expanduser().absolute())  # as submitit's executor has it
    map_count = num_jobs if num_jobs > 1 else None
    return _make_sbatch_string(command=_python_command(folder), folder=folder, map_count=map_count, **params)


def preflight(c: SlurmLauncherConf) -> None:
    """Cheap checks with a precise message, before anything is submitted."""
    if shutil.which("sbatch") is None:
        user_error("hydra/launcher=slurm: sbatch is not on PATH; run the sweep where SLURM's commands are "
                   "(a login node), or start a local cluster with `sudo bash launch/slurm/up.sh`")
    if c.partition is not None:
        out = _slurm_command(["sinfo", "-h", "-o", "%R"])
        known = sorted(set(out.split())) if out is not None else None
        if known is not None and c.partition not in known:
            user_error(f"hydra.launcher.partition: SLURM has no partition {c.partition!r}; "
                       f"pick one of: {', '.join(known) or '(none)'}")


def _slurm_command(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def submit(c: SlurmLauncherConf, params: dict[str, Any], runner: SlurmJobRunner, jobs: list[SweepJob],
           ranks_key: str) -> list:
    """Submit the jobs as one array; sbatch's refusal becomes one line naming the key to change."""
    import submitit

    executor = submitit.SlurmExecutor(folder=c.submitit_folder, max_num_timeout=c.max_num_timeout)
    executor.update_parameters(**params)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr; we say it once
            return executor.map_array(runner, jobs)
    except Exception as exc:  # submitit's FailedJobError carries sbatch's stderr
        message = "; ".join(line.removeprefix("sbatch: error: ") for line in str(exc).splitlines() if line.strip())
        too_big = oversized_request(c, params, ranks_key)
        if too_big is not None:
            user_error(f"{too_big[0]}: {too_big[1]}, so sbatch refused the jobs ({message})")
        for pattern, key, fix in _SBATCH_ERRORS:
            if re.search(pattern, message, re.IGNORECASE):
                user_error(f"hydra.launcher.{key}: sbatch refused the jobs ({message}); {fix}")
        user_error(f"hydra/launcher=slurm: sbatch refused the jobs: {message}")


def oversized_request(c: SlurmLauncherConf, params: dict[str, Any], ranks_key: str) -> tuple[str, str] | None:
    """(key, why) when no node of the partition can hold one job's request, from what sinfo says of the nodes;
    `ranks_key` names the setting of the ranks per node."""
    out = _slurm_command(["sinfo", "-h", "-N", "-o", "%P|%c|%m|%G"]) or ""
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 3]
    wanted = c.partition or next((p.rstrip("*") for p, *_ in rows if p.endswith("*")), None)
    nodes = [(int(cpus), int(mem), _gpus(gres)) for p, cpus, mem, gres in rows
             if p.rstrip("*") == wanted and cpus.isdigit() and mem.isdigit()]
    if not nodes:
        return None
    tasks, cpus_per_task = params["ntasks_per_node"], c.cpus_per_task or 1
    most_cpus, most_mem, most_gpus = (max(n[i] for n in nodes) for i in range(3))
    fits = {
        "hydra.launcher.nodes": (c.nodes <= len(nodes), f"{c.nodes} nodes asked for, partition {wanted} has "
                                 f"{len(nodes)}"),
        "hydra.launcher.gpus_per_node": (c.gpus_per_node <= most_gpus, f"{c.gpus_per_node} GPUs per node asked for, "
                                         f"the nodes of partition {wanted} have at most {most_gpus}"),
        ranks_key: (tasks * cpus_per_task <= most_cpus, f"{tasks} tasks x {cpus_per_task} CPUs = "
                    f"{tasks * cpus_per_task} CPUs per node asked for, the nodes of partition {wanted} have at most "
                    f"{most_cpus}"),
        "hydra.launcher.mem_gb": ((c.mem_gb or 0) * 1024 <= most_mem, f"{c.mem_gb} GB per node asked for, the nodes "
                                  f"of partition {wanted} have at most {most_mem // 1024} GB"),
    }
    return next(((key, why) for key, (ok, why) in fits.items() if not ok), None)


def _gpus(gres: str) -> int:
    """GPUs in sinfo's GRES column, e.g. "gpu:8", "gpu:h100:4(S:0-1)", "(null)"."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[\w.-]+)?:(\d+)", gres))


def wait(c: SlurmLauncherConf, params: dict[str, Any], submitted: list, ranks_key: str) -> None:
    """Wait until every job is over; stop at once, naming the key, when SLURM leaves a job pending forever.

    A job is over when submitit has its result and SLURM no longer holds it: a result file alone can be the one
    of an attempt that was requeued since.
    """
    array_id = submitted[0].job_id.split("_")[0]
    while True:
        out = _slurm_command(["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T|%r"])
        queue = {job_id: (state, reason) for job_id, state, reason in
                 ((line.split("|") + ["", ""])[:3] for line in (out or "").splitlines())}
        for job_id, (state, reason) in queue.items():
            never = _NEVER_REASONS.get(reason)
            if never is None and _PER_JOB_LIMIT.fullmatch(reason):
                never = ("timeout_min", "more than a per-job limit of the QOS or account allows")
            if state == "PENDING" and never is not None:
                _slurm_command(["scancel", array_id])
                key, why = oversized_request(c, params, ranks_key) or (f"hydra.launcher.{never[0]}", never[1])
                user_error(f"{key}: {why}, so SLURM would keep job {job_id} pending forever (reason {reason}); "
                           f"cancelled it: change {key} or the partition")
        over = [sj for sj in submitted if out is not None and queue.get(sj.job_id, ("",))[0] not in _HELD]
        if any(not sj.done() for sj in over):
            # a rank killed before it left its result: submitit asks SLURM's accounting about it only every
            # minute or so, but SLURM let the job go already; ask now (one sacct for all jobs)
            over[0].get_info(mode="force")
        if all(sj.done() and queue.get(sj.job_id, ("",))[0] not in _HELD for sj in submitted):
            return
        time.sleep(c.poll_interval_s)


def collect(hydra_context: HydraContext, job: SweepJob, sj: Any) -> JobReturn:
    """Rank 0's JobReturn; a failed job's as one line that says why: a rank SLURM lost to a signal (rank 0's own
    error then only says that it lost a peer), else rank 0's error, else the last error in the job's stderr."""
    rank0 = sj.task(0)
    try:
        ret, error = rank0.result(), None
    except Exception as exc:  # the job died without a result: read why from its log
        ret, error = None, exc
    if ret is not None and ret.status != JobStatus.FAILED:
        return ret
    lost = lost_rank(sj, rank0.stderr() or "")
    if lost is not None:
        reason = str(lost)
    elif ret is not None:
        reason = one_line(ret._return_value)
    else:
        reason = failure_reason(rank0.stderr(), str(error)) or "no error message; see the logs"
    failed = JobReturn(overrides=job.overrides, working_dir=str(job.dir), status=JobStatus.FAILED)
    state = sj.get_info(mode="force").get("State", "UNKNOWN")
    failed.return_value = JobFailed(f"job #{job.num} failed on SLURM (job {sj.job_id}, state {state}, exit code "
                                    f"{_exit_code(sj.job_id)}): {reason} [log: {rank0.paths.stderr}]")
    # the ranks died before Hydra's on_job_end ran there, or ran it with rank 0's view: run the callbacks here
    hydra_context.callbacks.on_job_end(config=job.config, job_return=failed)
    return failed


# srun's line for tasks that ended abnormally: "srun: error: <node>: task 1: Killed", "... tasks 0-1,3: Terminated";
# a task the step's cgroup killed over its memory limit ends "Out Of Memory" (SIGKILL from the kernel's OOM killer)
_SRUN_TASK_END = re.compile(r"^srun: error: \S+: tasks? ([\d,-]+): (.+)$")
_SIGNAL_NAMES = {text: sig.name for sig in signal.Signals if (text := signal.strsignal(sig))} | {
    "Out Of Memory": "SIGKILL (out of memory: the job's memory limit)"}


def srun_signal_ends(batch_stderr: str) -> dict[int, tuple[int, str]]:
    """Each task srun saw end by a signal, as task -> (line number, signal name); a task's last such line counts
    (srun appends a requeued job's attempts to one log)."""
    ends: dict[int, tuple[int, str]] = {}
    for number, line in enumerate(batch_stderr.splitlines()):
        if match := _SRUN_TASK_END.match(line.strip()):
            ends.update({task: (number, match.group(2)) for task in _task_ids(match.group(1))})
    return {task: (number, _SIGNAL_NAMES[how]) for task, (number, how) in ends.items() if how in _SIGNAL_NAMES}


def lost_rank(sj: Any, batch_stderr: str) -> WorkerError | None:
    """The rank srun saw killed by a signal first, when it left no result (it died mid-run, not after its run
    failed) and no rank failed by itself, named with the step the others noticed it in, from their results;
    None otherwise.

    srun writes its lines into the batch log (rank 0's stderr)."""
    ends = srun_signal_ends(batch_stderr)
    lost = sorted((number, task) for task, (number, _) in ends.items()
                  if task < sj.num_tasks and not sj.task(task).paths.result_pickle.exists())
    if not lost:
        return None
    others = {task: (str(ret._return_value), noted_step(ret._return_value)) for task in range(sj.num_tasks)
              if (ret := _result(sj.task(task))) is not None and ret.status == JobStatus.FAILED}
    if any(not says_peer_lost(said) for said, _ in others.values()):
        return None  # a rank failed by itself: its error says why, the rank SLURM stopped after it does not
    rank = lost[0][1]
    return lost_rank_error(rank, ends[rank][1], others)


def _task_ids(spec: str) -> list[int]:
    """srun's task list ("1", "0-1,3") as task ids."""
    ids = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def _result(task: Any) -> JobReturn | None:
    """A task's JobReturn, if it left one."""
    try:
        return task.result() if task.paths.result_pickle.exists() else None
    except Exception:  # a torn or foreign result: the task says nothing
        return None


def _exit_code(job_id: str) -> str:
    """The job's exit code as SLURM's accounting has it ("2" of "2:0"), "?" without accounting."""
    out = _slurm_command(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "ExitCode"]) or ""
    codes = [line.split(":")[0] for line in out.split() if line.split(":")[0].isdigit()]
    return codes[-1] if codes else "?"
