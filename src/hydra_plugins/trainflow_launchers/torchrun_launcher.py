"""`hydra/launcher=torchrun`: every job of a sweep runs under torch's elastic agent, one job after the other.

Each job is one `python -m torch.distributed.run ...` subprocess (the torchrun
CLI), not `elastic_launch()` inside this process: the agent then owns its own
signal handlers and its process tree, a job that crashes or hangs cannot take
the sweep down with it, this process imports torch only to count GPUs for
`parallelism.nproc_per_node=auto`, and the command in the log is the one a user
can rerun by hand. A trainflow job runs its own `parallelism.nproc_per_node` ranks
per node and `parallelism.max_restarts` restarts; any other Hydra app runs the
launcher's `nproc_per_node` and `max_restarts`. All ranks of a job run the job
in the job's directory; rank 0 hands the JobReturn back through a pickle.

Multi-node: run the same sweep command on every node, with the same
`nnodes`, `rdzv_endpoint` (a host:port on the first node), `rdzv_id` and
`hydra.sweep.dir` (a shared file system path); job k of every node meets
under "<rdzv_id>-<k>".
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.trainflow_launchers.common import (
    JobShape,
    SweepJob,
    SweepLauncher,
    die_with_parent,
    failure_reason,
    job_shape,
    one_line,
    read_text,
    user_error,
)
from hydra_plugins.trainflow_launchers.config import TorchrunLauncherConf
from trainflow.util.failures import (
    WorkerError,
    lost_rank_error,
    ranks_records,
    says_peer_lost,
    what_it_said,
)
from trainflow.util.rundir import RUN_DIR_ENV

log = logging.getLogger(__name__)

_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2")


class TorchrunLauncher(SweepLauncher):
    def __init__(self, **params: Any) -> None:
        super().__init__(TorchrunLauncherConf(**params))
        self.shapes: dict[int, JobShape] = {}  # each job's ranks per node and restarts, by job number

    def check(self) -> None:
        check_conf(self.conf)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = self.compose(job_overrides, initial_job_idx)
        own = {"nproc_per_node": self.conf.nproc_per_node, "max_restarts": self.conf.max_restarts}
        self.shapes = {job.num: job_shape(job, "nproc_per_node", own, _gpu_count) for job in jobs}
        log.info("Launching %d jobs with torchrun, each %s x %s processes (nnodes x nproc_per_node)", len(jobs),
                 self.conf.nnodes, "/".join(sorted({str(shape.ranks_per_node) for shape in self.shapes.values()})))
        return self.run_in_turn(jobs, self._run)

    def command(self, job: SweepJob, spec: Path) -> list[str]:
        """The torchrun command line of one job."""
        c, shape = self.conf, self.shapes[job.num]
        endpoint = c.rdzv_endpoint or "localhost:0"  # one node: the agent takes a free local port
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={c.nnodes}", f"--nproc-per-node={shape.ranks_per_node}",
            f"--rdzv-backend={c.rdzv_backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={c.rdzv_id}-{job.num}",
            f"--max-restarts={shape.max_restarts}", f"--monitor-interval={c.monitor_interval}",
            f"--shutdown-timeout={c.shutdown_timeout_s}", f"--signals-to-handle={c.signals_to_handle}",
            f"--log-dir={spec.parent / 'ranks'}", "--tee=3",
            "-m", "hydra_plugins.trainflow_launchers._worker", str(spec),
        ]

    def _run(self, job: SweepJob, state: Any) -> JobReturn:
        started = time.time()
        if self.conf.rdzv_endpoint:
            wait_for_endpoint(self.conf.rdzv_endpoint, self.conf.rdzv_wait_s)
        job_log_dir = job.dir / self.conf.log_dir
        if _max_nodes(self.conf.nnodes) > 1:  # every node's launcher keeps its own files in the shared job dir
            job_log_dir = job_log_dir / f"{socket.gethostname()}-{os.getpid()}"
        job_log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, RUN_DIR_ENV: str(job.dir)}  # the job's directory, for every rank
        agent_log = job_log_dir / "agent.log"
        # the agent's own traceback when it gives up restates a failure the job's one line names: agent.log keeps it
        rc, ret = self.run_child(job, state, lambda spec: self.command(job, spec), agent_log,
                                 quiet_from="Traceback (most recent call last):", env=env,
                                 preexec_fn=die_with_parent())  # the agent then stops its ranks gracefully
        restarts = _restarts(job_log_dir / "ranks")
        if restarts:
            log.info("\t#%d: the agent restarted the ranks %d time(s)", job.num, restarts)
        if rc == 0 and ret is not None:
            return ret
        error = ret._return_value if ret is not None and ret.status == JobStatus.FAILED else None
        # a rank lost to a signal (an OOM kill) leaves the others only a lost connection to say: name it instead,
        # from the report of whichever node's agent saw it die (another node's, in its folder of the job dir)
        wait_s = _SIBLING_REPORT_WAIT_S if _max_nodes(self.conf.nnodes) > 1 else 0.0
        lost = lost_rank(job.dir / self.conf.log_dir, started, wait_s) \
            if error is None or says_peer_lost(str(error)) else None
        if lost is not None:
            reason = str(lost)
        else:
            reason = one_line(error) if error is not None else \
                failure_reason(read_text(agent_log)) or "see the logs"
        return self.failed(job, ret, f"job #{job.num} failed under torchrun (exit code {rc}, {restarts} "
                                     f"restart(s)): {reason} [logs: {job_log_dir}]")


# torch's agent reports each failed rank when it gives up: "rank : 1 (local_rank: 1)", "exitcode : -9 (pid: 4242)
# (SIGKILL)", "error_file: <path of the rank's record, or <N/A>>"
_REPORTED_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+) \(pid: (\d+)\).*\n"
                            r"\s*error_file\s*: (.*)$", re.MULTILINE)
# How long a node waits for the lost rank's report and a witness (a rank that noticed: its own record, written at
# once, or its agent's report, 5 s later on two busy cores since the rank lingers 2 s and then tears down). The
# wait ends as soon as both are there; only a node lost whole (no report, no record) waits it out.
_SIBLING_REPORT_WAIT_S = 30.0


def reported_ranks(agent_log: str) -> dict[int, tuple[int, int, str]]:
    """Each rank torch's agent reported failed in `agent_log`: rank -> (exit code, pid, error file)."""
    return {int(m[1]): (int(m[2]), int(m[3]), m[4].strip()) for m in _REPORTED_RANK.finditer(agent_log)}


def lost_rank(log_root: Path, since: float, wait_s: float) -> WorkerError | None:
    """The rank an agent of this job (any node's agent.log under `log_root` written since `since`) reported
    killed by a signal, when every rank that failed by itself only lost its connection: named as every launcher
    names it, with the step the others noticed it in. Waits up to `wait_s` for a witness: another node's report
    of a rank that noticed, or that rank's own record (its agent may fail before it reports: the rendezvous
    store it talks to can live in the lost rank's node)."""
    deadline = time.monotonic() + wait_s
    while True:
        reports: dict[int, tuple[int, int, str]] = {}
        for agent_log in sorted(log_root.glob("**/agent.log")):
            if agent_log.stat().st_mtime >= since:  # not a former launch of the same sweep
                reports.update(reported_ranks(read_text(agent_log)))
        records = ranks_records(log_root, since)
        killed = sorted(rank for rank, (code, _, _) in reports.items() if code < 0)
        if killed and (set(reports) | set(records)) - set(killed) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not killed:
        return None
    others = {rank: what_it_said(data) for rank, data in records.items() if rank not in killed}
    others.update({rank: _record(error_file) for rank, (code, _, error_file) in reports.items()  # not read yet
                   if code >= 0 and rank not in others})
    if any(not says_peer_lost(said) for said, _ in others.values()):
        return None  # a rank failed by itself: its own error says why
    code, pid, _ = reports[killed[0]]
    return lost_rank_error(killed[0], signal.Signals(-code).name, others, pid=pid)


def _record(error_file: str) -> tuple[str, int | None]:
    """A rank's error record as (its message, the step it failed in); empty when it left none."""
    try:
        data = json.loads(Path(error_file).read_text())
    except (OSError, ValueError):
        return "", None
    return what_it_said(data)


def _gpu_count() -> int:
    """GPUs on this node, for parallelism.nproc_per_node=auto (torch only now: importing it takes seconds)."""
    import torch

    return torch.cuda.device_count()


def _restarts(ranks_dir: Path) -> int:
    """Restarts of the newest agent run whose rank logs are in ranks_dir (one attempt_<n> folder per attempt)."""
    runs = sorted(ranks_dir.glob("*/"), key=lambda p: p.stat().st_mtime)
    attempts = [int(p.name.split("_")[1]) for p in runs[-1].glob("attempt_*")] if runs else []
    return max(attempts, default=0)


def check_conf(c: TorchrunLauncherConf) -> None:
    """Reject settings torchrun would fail on later, or (a missing endpoint) hang on."""
    nproc = str(c.nproc_per_node)
    if c.nproc_per_node is not None and not (nproc in _NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1)):
        user_error(f"hydra.launcher.nproc_per_node: must be a positive integer or one of "
                   f"{', '.join(_NPROC_WORDS)}; got {nproc!r}")
    match = re.fullmatch(r"(\d+)(?::(\d+))?", str(c.nnodes))
    low, high = (int(match.group(1)), _max_nodes(c.nnodes)) if match else (0, 0)
    if not match or low < 1 or high < low:
        user_error(f"hydra.launcher.nnodes: must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX; got {c.nnodes!r}")
    if c.rdzv_backend not in _RDZV_BACKENDS:
        user_error(f"hydra.launcher.rdzv_backend: must be one of {', '.join(_RDZV_BACKENDS)}; got {c.rdzv_backend!r}")
    if c.rdzv_endpoint is None and high > 1:
        user_error("hydra.launcher.rdzv_endpoint: needed when nnodes > 1; set it to host:port on the first node, "
                   "the same on every node")
    if c.rdzv_endpoint is not None and not re.fullmatch(r"[^\s:]+:\d+|\[[0-9a-fA-F:]+\]:\d+", c.rdzv_endpoint):
        user_error(f"hydra.launcher.rdzv_endpoint: must be host:port, e.g. node001:29400; got {c.rdzv_endpoint!r}")
    for key, value, least in (("max_restarts", c.max_restarts, 0), ("shutdown_timeout_s", c.shutdown_timeout_s, 0),
                              ("rdzv_wait_s", c.rdzv_wait_s, 0)):
        if value is not None and value < least:
            user_error(f"hydra.launcher.{key}: must be >= {least}; got {value}")
    if c.monitor_interval <= 0:
        user_error(f"hydra.launcher.monitor_interval: must be > 0 seconds; got {c.monitor_interval}")
    if not c.log_dir or Path(c.log_dir).is_absolute() or ".." in Path(c.log_dir).parts:
        user_error(f"hydra.launcher.log_dir: must be a relative path inside the job directory; got {c.log_dir!r}")


def _max_nodes(nnodes: str) -> int:
    return int(str(nnodes).rpartition(":")[2])


def _is_this_machine(host: str) -> bool:
    """Whether torchrun on this machine will host the rendezvous store for `host`."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
        mine = {info[4][0] for name in names for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return any(addr.startswith("127.") or addr == "::1" for addr in wanted) or bool(wanted & mine)


def wait_for_endpoint(endpoint: str, wait_s: float) -> None:
    """Fail in one line, before starting an agent, when another host's rendezvous endpoint never answers.

    (The agent itself would wait for minutes and then fail with a long traceback.)
    """
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port))
    except OSError:
        user_error(f"hydra.launcher.rdzv_endpoint: host {host!r} does not resolve; "
                   "set it to the first node's hostname or IP address")
    if _is_this_machine(host):
        return  # this node's agent hosts the store
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(1.0, min(5.0, wait_s))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                user_error(f"hydra.launcher.rdzv_endpoint: nothing answers at {endpoint} after {wait_s:g} s "
                           f"({exc.strerror or exc}); start the sweep on {host} first (it hosts the rendezvous), "
                           "or fix the address, or raise hydra.launcher.rdzv_wait_s")
            time.sleep(1.0)

