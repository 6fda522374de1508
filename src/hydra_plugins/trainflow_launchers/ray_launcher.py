"""`hydra/launcher=ray`: each job of a sweep runs as one gang of ranks on a Ray cluster.

A job's nodes x ranks-per-node ranks are placed together by one placement
group (one bundle per rank, with its CPUs and GPUs; spread over nodes when the
job asks for several, packed on one otherwise), so a gang starts whole or not
at all. Each rank is a Ray actor in its bundle that starts trainflow's own
worker (`python -m hydra_plugins.trainflow_launchers._worker JOB.pkl`) on its
node, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT
(rank 0's node and a port free there): the ranks rendezvous as under torchrun.
The launcher ships the pickled job to every actor, collects every rank's
output (echoed here, kept in `<job>/ray/attempt_<n>/`), and takes rank 0's
JobReturn back: only the job's directory needs to be on storage every node
sees (checkpoints and metrics are written there), as on SLURM.

A rank that fails or is lost (killed, its actor or node gone) ends the
attempt: the other ranks are stopped, and the gang starts again in its
placement group (Ray moves bundles off a dead node) up to the job's restarts;
a trainflow job then resumes from its last committed checkpoint. Jobs run
side by side up to `max_concurrent`, each waiting for room on the cluster.
Ctrl-C or SIGTERM stops every gang (the ranks get SIGTERM: trainflow saves at
its next step boundary), kills the actors and removes the placement groups;
if this process dies outright, Ray kills the actors it owns and each actor's
worker is killed with it (a rank whose actor died is as lost as its node: it
must not train on beside the next attempt). The same sweep command resumes.
"""


import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.trainflow_launchers.common import (
    PR_SET_PDEATHSIG,
    RESULT_NAME,
    JobShape,
    SweepJob,
    SweepLauncher,
    failure_reason,
    finished_already,
    job_shape,
    log_outcome,
    one_line,
    read_text,
    user_error,
)
from hydra_plugins.trainflow_launchers.config import RayLauncherConf
from trainflow.util.failures import lost_rank_error, what_it_said
from trainflow.util.rundir import RUN_DIR_ENV

log = logging.getLogger(__name__)

# How long the other ranks get to end by themselves after one failed (they lose their connection to it within a
# second or two and record the step they noticed it in), before they are stopped.
_PEERS_END_S = 10.0
_WAIT_LOG_S = 30.0  # a gang still waiting for room on the cluster this long is said once


def _ray() -> Any:
    """The ray module: an extra (trainflow[ray]), imported only when this launcher runs, since Hydra imports every
    launcher module at start; a missing one is one line naming its install."""
    try:
        import ray  # lazy: an optional extra, see above
    except ImportError:
        user_error("hydra/launcher=ray: Ray is not installed; pip install 'trainflow[ray]'")
    return ray


def _killed_with_actor() -> None:
    """In a rank's worker before it runs: SIGKILL it when its actor dies (PR_SET_PDEATHSIG), as the loss of its node
    would. A worker left to save on a SIGTERM would outlive the attempt, holding the job's folder, while the next
    attempt starts; the launcher's own stops (Ctrl-C, a failed peer) go through the live actor, with SIGTERM."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RankActor:
    """One rank of a gang, as a Ray actor in its bundle: starts trainflow's worker on its node, hands its output
    lines, exit code, error record and (rank 0) JobReturn back. Its worker is killed when the actor dies."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="trainflow-rank-"))
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque()
        self.reader: threading.Thread | None = None

    def where(self) -> dict[str, Any]:
        """This rank's node: its Ray id, its address, the GPUs Ray gave this actor, and a port free there."""
        ray = _ray()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "port": port}

    def start(self, spec: bytes, env: dict[str, str], cwd: str) -> int:
        """Run the worker on the pickled job `spec` with `env` added; its pid."""
        path = self.folder / "job.pkl"
        path.write_bytes(spec)
        (self.folder / RESULT_NAME).unlink(missing_ok=True)
        error_file = self.folder / "error.json"
        error_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "hydra_plugins.trainflow_launchers._worker", str(path)],
            env={**os.environ, **env, "TORCHELASTIC_ERROR_FILE": str(error_file)},
            cwd=cwd if Path(cwd).is_dir() else None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, preexec_fn=_killed_with_actor)
        self.reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self.reader.start()
        return self.proc.pid

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def poll(self) -> tuple[list[str], int | None]:
        """The output lines since the last poll, and the exit code once the worker ended (all its output read)."""
        assert self.proc is not None and self.reader is not None
        rc = self.proc.poll()
        if rc is not None:
            self.reader.join(timeout=5)
        lines = []
        while self.lines:
            lines.append(self.lines.popleft())
        return lines, rc

    def outcome(self) -> tuple[bytes | None, dict[str, Any] | None]:
        """The JobReturn the worker left (its node's local rank 0 leaves one) and its error record, if any."""
        result = self.folder / RESULT_NAME
        error = self.folder / "error.json"
        data = result.read_bytes() if result.is_file() else None
        try:
            record = json.loads(error.read_text()) if error.is_file() else None
        except ValueError:
            record = None
        return data, record

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the worker (trainflow saves at its next step boundary), SIGKILL it after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.poll() if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        """Remove this actor's files (the job pickle, the result, the record)."""
        for path in self.folder.iterdir():
            path.unlink(missing_ok=True)
        self.folder.rmdir()


@dataclass
class Rank:
    """A rank of the current attempt: its actor, where it runs, its pid and log, and how it ended."""

    rank: int
    actor: Any
    node: dict[str, Any]
    local_rank: int = 0
    local_world_size: int = 1
    pid: int | None = None
    log: Any = None
    exit_code: int | None = None
    lost: str | None = None  # why Ray lost it (its actor or node died), if it did
    stopped: bool = False  # the launcher stopped it (another rank had failed, or the sweep was stopped)


@dataclass
class Gang:
    """One job of the sweep on the cluster: its placement group, its attempts, its ranks."""

    job: SweepJob
    shape: JobShape
    world_size: int
    placement: Any
    ready: Any  # the placement group's ready() reference of the attempt waiting for it
    waiting_since: float = field(default_factory=time.monotonic)
    attempt: int = 0
    ranks: list[Rank] = field(default_factory=list)
    failed_at: float | None = None  # when the first rank of this attempt failed
    said_waiting: bool = False


class RayLauncher(SweepLauncher):
    def __init__(self, **params: Any) -> None:
        super().__init__(RayLauncherConf(**params))
        self.shapes: dict[int, JobShape] = {}

    def check(self) -> None:
        check_conf(self.conf)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = self.compose(job_overrides, initial_job_idx)
        address = cluster_address(self.conf)
        ray = _ray()
        with connected(ray, address):
            own = {"nproc_per_node": self.conf.nproc_per_node, "max_restarts": self.conf.max_restarts}
            self.shapes = {job.num: job_shape(job, "nproc_per_node", own, lambda: _gpus_per_node(ray))
                           for job in jobs}
            check_fits(ray, self.conf, self.shapes.values())
            log.info("Launching %d jobs on the Ray cluster at %s, each a gang of %d node(s) x %s ranks", len(jobs),
                     address, self.conf.nodes,
                     "/".join(sorted({str(shape.ranks_per_node) for shape in self.shapes.values()})))
            done = {job.num: ret for job in jobs if (ret := finished_already(job)) is not None}
            todo = [job for job in jobs if job.num not in done]  # the same sweep again: only unfinished jobs run
            with stop_on_sigterm():
                done.update(self.run_gangs(ray, todo))
        return [done[job.num] for job in jobs]

    def run_gangs(self, ray: Any, jobs: list[SweepJob]) -> dict[int, JobReturn]:
        """Run every job as a gang, up to max_concurrent at once; Ctrl-C or SIGTERM stops them all."""
        state = Singleton.get_state()
        pending, running, results = deque(jobs), [], {}
        try:
            while pending or running:
                while pending and len(running) < self.conf.max_concurrent:
                    running.append(self.place(ray, pending.popleft()))
                for gang in list(running):
                    ret = self.advance(ray, gang, state)
                    if ret is not None:
                        running.remove(gang)
                        self.release(ray, gang)
                        results[gang.job.num] = ret
                        log_outcome(f"#{gang.job.num}", ret, gang.job.dir)
                time.sleep(self.conf.poll_interval_s)
        except KeyboardInterrupt:
            log.error("Stopping %d running job(s): each rank gets SIGTERM (a trainflow job saves at its next step "
                      "boundary); the same command resumes the sweep", len(running))
            stopping = [(gang, self.signal_stop(gang)) for gang in running]  # every gang saves at once
            for gang, refs in stopping:
                self.await_stop(ray, gang, refs)
                self.release(ray, gang)
            raise
        return results

    def place(self, ray: Any, job: SweepJob) -> Gang:
        """Ask the cluster for the job's placement group; the gang starts once Ray has reserved it."""
        from ray.util.placement_group import placement_group  # lazy: the ray extra

        shape = self.shapes[job.num]
        world_size = self.conf.nodes * int(shape.ranks_per_node)
        bundle = {"CPU": self.conf.cpus_per_rank, **({"GPU": self.conf.gpus_per_rank} if self.conf.gpus_per_rank
                                                       else {})}
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy(self.conf.nodes,
                                int(shape.ranks_per_node)), name=f"trainflow-{job.dir}")
        log.info("\t%s (%d ranks)", job.describe(), world_size)
        return Gang(job, shape, world_size, group, group.ready())

    def advance(self, ray: Any, gang: Gang, state: Any) -> JobReturn | None:
        """One look at a gang: start it once placed, echo and keep its output, end or restart its attempt; its
        JobReturn once it is over."""
        if not gang.ranks:
            ready, _ = ray.wait([gang.ready], timeout=0)
            if ready:
                self.start_attempt(ray, gang, state)
            elif not gang.said_waiting and time.monotonic() - gang.waiting_since > _WAIT_LOG_S:
                gang.said_waiting = True
                log.info("\t#%d waits for room on the cluster: %d bundle(s) of %s", gang.job.num, gang.world_size,
                         {"CPU": self.conf.cpus_per_rank, "GPU": self.conf.gpus_per_rank})
            return None
        self.collect(ray, gang)
        ended = [r for r in gang.ranks if r.exit_code is not None or r.lost is not None]
        failed = [r for r in ended if r.lost is not None or r.exit_code != 0]
        if len(ended) == len(gang.ranks) and not failed:
            return self.finish(gang)
        if not failed:
            return None
        if gang.failed_at is None:
            gang.failed_at = time.monotonic()
        if len(ended) < len(gang.ranks) and time.monotonic() - gang.failed_at < _PEERS_END_S:
            return None  # the others notice within seconds and say in which step
        self.stop_ranks(ray, gang)
        return self.end_attempt(ray, gang, state)

    def start_attempt(self, ray: Any, gang: Gang, state: Any) -> None:
        """Start one rank actor per bundle, number the ranks node by node (rank 0 in bundle 0), and start every
        rank's worker with the rendezvous at rank 0's node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: the ray extra

        actor_class = ray.remote(RankActor)
        actors = [actor_class.options(
            num_cpus=self.conf.cpus_per_rank, num_gpus=self.conf.gpus_per_rank, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(gang.placement, placement_group_bundle_index=i),
        ).remote() for i in range(gang.world_size)]
        try:
            nodes = ray.get([actor.where.remote() for actor in actors])
        except ray.exceptions.RayError as exc:
            for actor in actors:
                ray.kill(actor)
            gang.ready = gang.placement.ready()  # a node went away while the actors started: wait for room again
            gang.waiting_since = time.monotonic()
            log.warning("\t#%d: a rank could not start (%s); waiting for the placement again", gang.job.num,
                        one_line(exc))
            return
        order = list(dict.fromkeys(node["node_id"] for node in nodes))  # rank 0's node first
        bundles = sorted(range(len(actors)), key=lambda i: (order.index(nodes[i]["node_id"]), i))
        gang.ranks = [Rank(rank, actors[i], nodes[i]) for rank, i in enumerate(bundles)]
        per_node: dict[str, list[Rank]] = {}
        for r in gang.ranks:
            per_node.setdefault(r.node["node_id"], []).append(r)
        for members in per_node.values():
            for local, r in enumerate(members):
                r.local_rank, r.local_world_size = local, len(members)
        folder = self.attempt_dir(gang)
        folder.mkdir(parents=True, exist_ok=True)
        master = gang.ranks[0].node
        (folder / "placement.json").write_text(json.dumps(
            [{"rank": r.rank, "local_rank": r.local_rank, "node_id": r.node["node_id"], "ip": r.node["ip"]}
             for r in gang.ranks], indent=1) + "\n")
        spec = cloudpickle.dumps((self.hydra_context, self.task_function, gang.job, state))
        cwd = os.getcwd()
        starts = []
        for r in gang.ranks:
            env = {
                "RANK": str(r.rank), "WORLD_SIZE": str(gang.world_size), "LOCAL_RANK": str(r.local_rank),
                "LOCAL_WORLD_SIZE": str(r.local_world_size), "GROUP_RANK": str(order.index(r.node["node_id"])),
                "MASTER_ADDR": master["ip"], "MASTER_PORT": str(master["port"]),
                "TORCHELASTIC_RESTART_COUNT": str(gang.attempt), "TORCHELASTIC_MAX_RESTARTS":
                    str(gang.shape.max_restarts), RUN_DIR_ENV: str(gang.job.dir),
                "OMP_NUM_THREADS": str(max(1, int(self.conf.cpus_per_rank))), "PYTHONUNBUFFERED": "1",
            }
            if self.conf.gpus_per_rank:  # the node's GPUs of this gang, in local-rank order: cuda:LOCAL_RANK is its own
                env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    g for m in per_node[r.node["node_id"]] for g in m.node["gpus"])
            r.log = (folder / f"rank_{r.rank}.log").open("w")
            starts.append(r.actor.start.remote(spec, env, cwd))
        for r, pid in zip(gang.ranks, ray.get(starts), strict=True):
            r.pid = pid
        gang.failed_at = None

    def attempt_dir(self, gang: Gang) -> Path:
        return gang.job.dir / self.conf.log_dir / f"attempt_{gang.attempt}"

    def collect(self, ray: Any, gang: Gang) -> None:
        """Every running rank's new output, echoed as `[#job rankN]:line` and kept in its log; its end, if it ended."""
        live = [r for r in gang.ranks if r.exit_code is None and r.lost is None]
        refs = [r.actor.poll.remote() for r in live]
        for r, ref in zip(live, refs, strict=True):
            try:
                lines, rc = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor or its node died
                r.lost = f"its Ray actor on node {r.node['ip']} died ({_first_line(exc)})"
                continue
            for line in lines:
                sys.stdout.write(f"[#{gang.job.num} rank{r.rank}]:{line}")
                r.log.write(line)
            r.log.flush()
            r.exit_code = rc

    def stop_ranks(self, ray: Any, gang: Gang) -> None:
        """SIGTERM every rank still running (SIGKILL after shutdown_timeout_s) and keep their last output."""
        self.await_stop(ray, gang, self.signal_stop(gang))

    def signal_stop(self, gang: Gang) -> list[tuple[Rank, Any]]:
        """Ask every rank still running to stop (SIGTERM, SIGKILL after shutdown_timeout_s), without waiting: the
        ranks of several gangs save side by side."""
        running = [r for r in gang.ranks if r.exit_code is None and r.lost is None]
        for r in running:
            r.stopped = True
        return [(r, r.actor.stop.remote(self.conf.shutdown_timeout_s)) for r in running]

    def await_stop(self, ray: Any, gang: Gang, stopping: list[tuple[Rank, Any]]) -> None:
        """Wait for the ranks `signal_stop` asked to stop, and keep their last output."""
        for _, ref in stopping:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # gone already: killed below anyway
                ray.get(ref, timeout=self.conf.shutdown_timeout_s + 30)
        self.collect(ray, gang)

    def end_attempt(self, ray: Any, gang: Gang, state: Any) -> JobReturn | None:
        """A failed attempt: name its cause in one line, then start the next attempt or fail the job."""
        ret, records = self.outcomes(ray, gang)
        reason = self.cause(gang, ret, records)
        self.kill_actors(ray, gang)
        if gang.attempt < gang.shape.max_restarts:
            gang.attempt += 1
            log.warning("\t#%d: %s; restarting the gang (restart %d of %d)", gang.job.num, reason, gang.attempt,
                        gang.shape.max_restarts)
            gang.ranks, gang.ready, gang.waiting_since = [], gang.placement.ready(), time.monotonic()
            return None
        codes = ", ".join(f"{r.rank}: {'lost' if r.lost else r.exit_code}" for r in gang.ranks)
        return self.failed(gang.job, ret, f"job #{gang.job.num} failed on Ray (exit codes {codes}; {gang.attempt} "
                                          f"restart(s)): {reason} [logs: {self.attempt_dir(gang)}]")

    def outcomes(self, ray: Any, gang: Gang) -> tuple[JobReturn | None, dict[int, dict[str, Any]]]:
        """Rank 0's JobReturn (None: it left none) and every rank's error record, kept beside its log."""
        ret, records = None, {}
        for r in gang.ranks:
            if r.log is not None:
                r.log.close()
            if r.lost is not None:
                continue
            try:
                data, record = ray.get(r.actor.outcome.remote())
            except ray.exceptions.RayError:
                continue
            if record is not None:
                records[r.rank] = record
                (self.attempt_dir(gang) / f"rank_{r.rank}.error.json").write_text(json.dumps(record))
            if r.rank == 0 and data is not None:
                with contextlib.suppress(Exception):  # a torn result: the job counts as failed, with its output
                    ret = cloudpickle.loads(data)
        return ret, records

    def cause(self, gang: Gang, ret: JobReturn | None, records: dict[int, dict[str, Any]]) -> str:
        """Why the attempt failed: a rank lost to a signal or with its node (the others only lost their connection
        to it), else rank 0's error, else the first error a rank recorded, else the last error in its output."""
        others = {rank: what_it_said(data) for rank, data in records.items()}
        gone = [r for r in gang.ranks if r.lost is not None]
        if gone:
            return f"rank {gone[0].rank} (pid {gone[0].pid}) was lost: {gone[0].lost}"
        killed = [r for r in gang.ranks if r.exit_code is not None and r.exit_code < 0 and not r.stopped
                  and r.rank not in records]
        if killed:
            first = killed[0]
            return str(lost_rank_error(first.rank, signal.Signals(-first.exit_code).name, others, pid=first.pid))
        if ret is not None and ret.status == JobStatus.FAILED:
            return one_line(ret._return_value)
        for rank in sorted(records):
            said, _ = others[rank]
            if said:
                return said.splitlines()[0]
        logs = [self.attempt_dir(gang) / f"rank_{r.rank}.log" for r in gang.ranks]
        return failure_reason(*(read_text(path) for path in logs)) or "see the rank logs"

    def finish(self, gang: Gang) -> JobReturn:
        """Every rank ended well: rank 0's JobReturn."""
        ret, _ = self.outcomes(_ray(), gang)
        self.kill_actors(_ray(), gang)
        if ret is None:
            return self.failed(gang.job, None, f"job #{gang.job.num} failed on Ray: its ranks ended, and rank 0 "
                                               f"left no result [logs: {self.attempt_dir(gang)}]")
        return ret

    def kill_actors(self, ray: Any, gang: Gang) -> None:
        for r in gang.ranks:
            if r.log is not None:
                r.log.close()
            with contextlib.suppress(Exception):  # its files are in the node's temp folder: best effort
                ray.get(r.actor.close.remote(), timeout=10)
            ray.kill(r.actor, no_restart=True)

    def release(self, ray: Any, gang: Gang) -> None:
        """Kill the gang's actors and give its placement group back."""
        from ray.util.placement_group import remove_placement_group  # lazy: the ray extra

        self.kill_actors(ray, gang)
        gang.ranks = []
        remove_placement_group(gang.placement)


def strategy(nodes: int, ranks_per_node: int) -> str:
    """The placement group's strategy: one rank per node on as many nodes (STRICT_SPREAD), several ranks per node
    spread over the nodes (SPREAD), or all on one node (PACK)."""
    if nodes == 1:
        return "PACK"
    return "STRICT_SPREAD" if ranks_per_node == 1 else "SPREAD"


def cluster_address(c: RayLauncherConf) -> str:
    """The cluster to run on: hydra.launcher.address, else RAY_ADDRESS; never a local cluster started silently."""
    address = c.address or os.environ.get("RAY_ADDRESS")
    if not address:
        user_error("hydra.launcher.address: no Ray cluster given; set hydra.launcher.address=<head host>:6379 (or "
                   "RAY_ADDRESS), or start one here with `ray start --head` and set hydra.launcher.address=auto")
    return address


@contextlib.contextmanager
def connected(ray: Any, address: str) -> Iterator[None]:
    """This process as the cluster's driver while the sweep runs; a cluster that does not answer is one line."""
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        user_error(f"hydra.launcher.address: no Ray cluster answers at {address} ({_first_line(exc)}); start one "
                   "with `ray start --head` or fix the address")
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM to the sweep stops it as Ctrl-C does: every gang is stopped and given back."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _gpus_per_node(ray: Any) -> int:
    """The most GPUs a node of the cluster has (parallelism.nproc_per_node=auto: one rank per GPU)."""
    return int(max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=0))


def check_fits(ray: Any, c: RayLauncherConf, shapes: Any) -> None:
    """Refuse, in one line naming the key, a gang the cluster could never place (it would wait forever)."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    most = max((int(shape.ranks_per_node) for shape in shapes), default=1)
    if c.nodes > len(nodes):
        user_error(f"hydra.launcher.nodes: {c.nodes} nodes asked for, the Ray cluster has {len(nodes)}; lower it or "
                   "add nodes")
    for key, resource, per_rank in (("cpus_per_rank", "CPU", c.cpus_per_rank), ("gpus_per_rank", "GPU",
                                                                                c.gpus_per_rank)):
        if not per_rank:
            continue
        room = sorted((int(node.get(resource, 0) // per_rank) for node in nodes), reverse=True)
        # the busiest shape's ranks must fit on the nodes: ranks per node on each of `c.nodes` nodes
        placeable = sum(room[:c.nodes]) if c.nodes > 1 else room[0]
        if placeable < c.nodes * most or (c.nodes > 1 and most == 1 and room[c.nodes - 1] < 1):
            user_error(f"hydra.launcher.{key}: a job's {c.nodes * most} ranks x {per_rank:g} {resource} do not fit "
                       f"on the cluster's nodes ({', '.join(f'{node.get(resource, 0):g}' for node in nodes)} "
                       f"{resource}); lower {key}, nodes or the ranks per node")


def check_conf(c: RayLauncherConf) -> None:
    """Values the cluster would refuse or misread, named by their key."""
    for key, value, least in (("nodes", c.nodes, 1), ("nproc_per_node", c.nproc_per_node, 1),
                              ("max_restarts", c.max_restarts, 0), ("max_concurrent", c.max_concurrent, 1),
                              ("cpus_per_rank", c.cpus_per_rank, 0), ("gpus_per_rank", c.gpus_per_rank, 0),
                              ("shutdown_timeout_s", c.shutdown_timeout_s, 0)):
        if value is not None and value < least:
            user_error(f"hydra.launcher.{key}: must be >= {least}; got {value}")
    if c.cpus_per_rank == 0 and c.gpus_per_rank == 0:
        user_error("hydra.launcher.cpus_per_rank: a rank needs some CPUs or GPUs to be placed; set it > 0")
    if c.poll_interval_s <= 0:
        user_error(f"hydra.launcher.poll_interval_s: must be > 0 seconds; got {c.poll_interval_s}")
    if not c.log_dir or Path(c.log_dir).is_absolute() or ".." in Path(c.log_dir).parts:
        user_error(f"hydra.launcher.log_dir: must be a relative path inside the job directory; got {c.log_dir!r}")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

