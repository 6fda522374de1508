"""Training through a lost replica group (parallelism.fault_tolerance=torchft).

Replica groups are separate jobs (each its own trainflow run, of one rank, of DDP ranks or of FSDP ranks) that
average their gradients through torchft's Manager, coordinated by torchft's lighthouse; inside a group its ranks
average first. FSDP groups are HSDP whose replicate dimension is the groups: after each shard unit's reduce-scatter
(FSDP2's all-reduce hook) rank r averages its gradient shards with rank r of the other groups, which hold the same
shards (the Manager joins rank r of every group; groups must be of one size); a healing group's rank r takes rank
r's local shards of the peer.
Each step begins with a quorum: the groups alive now. A group that dies makes the others' all-reduce of that step
fail; their update is dropped (the step counts, as a skipped step does) and from the next quorum on they train
without it: the global batch shrinks to the groups present, said in the log and counted in summary.json. A group
started again joins the next quorum and, being behind, fetches the live state (model, optimizer, schedule, step,
position in the sample stream) from a peer over HTTP, not from disk; from then on every group applies the same
averaged gradient to the same weights. An iterable dataset's position is its own share's, not the peer's: the
healed group's stream reads and drops the micro-batches of the steps it took from the peer, so that its share
continues where it would be had the group trained them.

The lighthouse (lighthouse=auto) runs in a process of its own on the groups' host, started by whichever group's rank
0 finds none answering; it outlives the group that started it (its own session) and ends once no group has talked
to it for ft.lighthouse_idle_s, so that losing any one group never loses the lighthouse. Losing the lighthouse itself
(or fewer than ft.min_replicas groups reaching it) leaves a quorum unanswered: after ft.timeout_s each group says so in
one line and, as ft.no_quorum says, stops with its checkpoint committed (the same command resumes, with a new
lighthouse) or trains on alone, without the Manager. It is not restarted under the running groups: a new lighthouse
numbers its quorums from 1 again, and a Manager that held a quorum of that number keeps its process group as it was
(measured, docs/scale.md: a group that reached the new lighthouse first got a quorum of itself alone, then waited
ft.timeout_s in a collective with the other group, which got no quorum at all).

Each group reads its own share of the data stream: group g of G, rank r of its n data-parallel ranks, reads as
rank g * n + r of G * n. Why the quorum is taken between steps (in `after_step`) and not in the optimizer's
zero_grad as torchft's wrapper does: trainflow zeroes gradients before it counts the step, and a state fetched
there would be counted twice.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainflow.config.schema import FaultToleranceConfig, ParallelismConfig
from trainflow.distributed import DistEnv
from trainflow.errors import ConfigError, TrainflowError
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState

log = logging.getLogger("trainflow")

TORCHFT = "torchft"
LIGHTHOUSE_START_S = 60.0  # the longest a started lighthouse may take to answer (an interpreter importing torch)


def replica_groups(parallelism: Any) -> int:
    """Replica groups whose ranks share the data stream and the gradients (1 without fault tolerance)."""
    return int(parallelism.ft.replica_groups) if parallelism.fault_tolerance == TORCHFT else 1


def data_share(parallelism: Any, env: DistEnv) -> tuple[int, int]:
    """(this rank's place, the places) in the sample stream across every replica group."""
    groups = replica_groups(parallelism)
    replica = int(parallelism.ft.replica_id) if groups > 1 else 0
    return replica * env.dp_size + env.dp_rank, groups * env.dp_size


class NoQuorumError(TrainflowError):
    """No quorum came and nothing can be saved (before the first step, or with checkpoints off): the group stops."""

    exit_code = 1


def lighthouse_address(ft: FaultToleranceConfig) -> str:
    return f"http://localhost:{ft.lighthouse_port}" if ft.lighthouse == "auto" else ft.lighthouse


def lighthouse_ages(address: str) -> list[float] | None:
    """Seconds since the lighthouse at `address` last heard from each group it knows (its status page: torchft
    gives no other view of them); None when no lighthouse answers there."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a cluster's http_proxy is not for us
    try:
        with direct.open(f"{address}/status", timeout=2) as response:
            page = response.read().decode()
    except OSError:
        return None
    return [float(age) for age in re.findall(r"seen ([0-9.]+)s ago", page)]


def serve_lighthouse(port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float,
                     idle_s: float | None) -> None:
    """torchft's lighthouse in this process until no group has talked to it for `idle_s` (None: until stopped):
    the process a lighthouse=auto group starts, and `trainflow lighthouse`."""
    from torchft.coordination import LighthouseServer  # lazy: torchft is the ft extra

    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas,
                                  join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=10,
                                  heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    except RuntimeError as exc:
        raise ConfigError(f"--port: the lighthouse cannot listen on port {port} ({exc}); another lighthouse or "
                          "program holds it: give another port") from None
    print(f"trainflow lighthouse: listening on port {port} (pid {os.getpid()})", flush=True)
    started = time.monotonic()
    try:
        while True:
            time.sleep(1)
            if idle_s is None:
                continue
            ages = lighthouse_ages(f"http://localhost:{port}")
            quiet = min(ages) if ages else time.monotonic() - started
            if quiet > idle_s:
                print(f"trainflow lighthouse: no replica group talked to it for {quiet:.1f} s (--idle-s {idle_s:g}): "
                      "stopped", flush=True)
                return
    finally:
        server.shutdown()


def ensure_lighthouse(ft: FaultToleranceConfig, log_file: Path) -> None:
    """lighthouse=auto: wait until a lighthouse answers on this host, starting one unless another group's does.
    Two groups starting at once both start one: the second cannot listen on the port and ends."""
    address = lighthouse_address(ft)
    if lighthouse_ages(address) is not None:
        return
    with open(log_file, "a") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", "from trainflow.cli import main; main()", "lighthouse",
             f"--port={ft.lighthouse_port}", f"--min-replicas={ft.min_replicas}",
             f"--join-timeout-s={ft.join_timeout_s}", f"--heartbeat-timeout-s={ft.heartbeat_timeout_s}",
             f"--idle-s={ft.lighthouse_idle_s}"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + max(ft.timeout_s, LIGHTHOUSE_START_S)
    while lighthouse_ages(address) is None:
        if child.poll() not in (None, 0):  # the port is taken: by another group's lighthouse, which answers soon
            deadline = min(deadline, time.monotonic() + 2)
        if time.monotonic() > deadline:
            raise ConfigError(f"parallelism.ft.lighthouse: no lighthouse answers at {address} (the one started here "
                              f"logged to {log_file}); free port {ft.lighthouse_port} or set "
                              "parallelism.ft.lighthouse_port")
        time.sleep(0.05)


class FaultTolerance(Stage):
    """The torchft Manager of this replica group: the model's gradients go through it, each step's update is
    committed only if every collective of the step succeeded, and the quorum before each step heals a late group."""

    phase = Phase.NEXT
    summary_key = "fault_tolerance"

    def __init__(self, parallelism: ParallelismConfig, env: DistEnv, global_batch: int, run_dir: Path,
                 grad_accum: int, checkpoints: bool = False) -> None:
        self.enabled = parallelism.fault_tolerance == TORCHFT
        self.checkpoints = checkpoints  # checkpoint.enabled: a group that stops for want of a quorum saves first
        self.ft = parallelism.ft  # None in a run without fault tolerance
        self.env = env
        self.run_dir = run_dir
        self.grad_accum = grad_accum
        self._behind = 0  # micro-batches of steps taken from a peer that an iterable stream has yet to skip
        self.group_batch = global_batch // replica_groups(parallelism)  # one group's share of a step
        self.manager: Any = None
        self._state: LoopState | None = None
        self._present = replica_groups(parallelism)  # groups in the current quorum
        self.shrunk_steps = 0  # steps trained with fewer groups than replica_groups
        self.missed_samples = 0  # the absent groups' shares of those steps
        self.uncommitted: list[int] = []  # steps whose update was dropped (a group lost inside the step)
        self.events: list[dict[str, Any]] = []  # each change of the quorum: step, groups, time
        self.healed: dict[str, Any] | None = None  # this group's fetch of the live state from a peer
        self.no_quorum: dict[str, Any] | None = None  # the quorum that never came: step, cause, what the group did
        self.alone = False  # ft.no_quorum=alone after a quorum that never came: a plain run, the Manager unused
        self.alone_steps = 0

    @classmethod
    def build(cls, ctx: StageContext) -> FaultTolerance:
        t, parallelism = ctx.cfg.trainer, ctx.cfg.parallelism
        stage = cls(parallelism, ctx.env, t.batch_size * ctx.env.dp_size * replica_groups(parallelism)
                    * t.grad_accum, ctx.run_dir, t.grad_accum, bool(ctx.cfg.checkpoint.enabled))
        if stage.enabled:
            stage._create_manager()
        return stage

    def _create_manager(self) -> None:
        # trainflow says each quorum change and each dropped update in one line; torchft logs them again, with a
        # traceback for a lost peer's collective (a user debugging torchft lowers these levels, and sets RUST_LOG)
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        from torchft import Manager, ProcessGroupGloo  # lazy: torchft is the ft extra

        ft, env = self.ft, self.env
        if env.rank == 0:  # the rank whose Manager talks to the lighthouse
            if ft.lighthouse == "auto":
                ensure_lighthouse(ft, self.run_dir / "lighthouse.log")
            elif lighthouse_ages(ft.lighthouse) is None:
                raise ConfigError(f"parallelism.ft.lighthouse: no lighthouse answers at {ft.lighthouse}; start one "
                                  "there (trainflow lighthouse --port PORT) or give its address, or set it to auto")
        timeout = timedelta(seconds=ft.timeout_s)
        if env.distributed:  # the group's ranks find each other's Manager in the store of their own process group
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one rank: a store of its own, in this process
            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self._store.port
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load, state_dict=self._live_state,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=env.rank, world_size=env.world_size, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=lighthouse_address(ft), replica_id=f"trainflow_{ft.replica_id}")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """FSDP groups: each shard unit's reduce-scattered gradient is averaged through the Manager with rank r of
        the groups present. Otherwise torchft's DDP in place of the group's own: each gradient bucket is averaged
        over the group's ranks, then through the Manager (its buckets never rebuilt: a restarted group's match)."""
        if not self.enabled:
            return model
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if units:
            for unit in units:
                unit.set_all_reduce_hook(self.average_across_groups)
            return model
        from torchft.ddp import DistributedDataParallel  # lazy: torchft is the ft extra

        class Averaged(DistributedDataParallel):
            _comm_hook = staticmethod(_average)

        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        return Averaged(self, inner)  # the hook's state: this stage, which knows whether the group trains alone

    def average_across_groups(self, tensor: torch.Tensor) -> None:
        """`tensor` (a gradient bucket, or FSDP2's gradient shard, averaged over the group's ranks) averaged in place
        over the groups present; a failed collective leaves it as it is, and the step will not commit. A group
        training alone keeps its own."""
        if not self.alone:
            self.manager.allreduce(tensor).wait()

    def start(self, state: LoopState) -> None:
        """The first quorum: a group behind the others (restarted) takes their state here, before its data
        position is read."""
        if self.enabled:
            self._state = state
            self._quorum(state)

    def __enter__(self) -> FaultTolerance:
        """A heal at the first quorum came before the data loader was built: its stream catches up now."""
        if self._state is not None:
            self._fast_forward(self._state)
        return self

    def _fast_forward(self, state: LoopState) -> None:
        """An iterable stream (the map-style stream's position came with the state) skips the micro-batches of the
        steps taken from the peer: read, not trained."""
        if self._behind and state.data_loader is not None:
            state.data_loader.skip(self._behind)
            log.info("fault tolerance: the iterable stream of replica group %d skips its %d micro-batches of the "
                     "steps taken from the peer", self.ft.replica_id, self._behind)
            assert self.healed is not None, "a heal set the micro-batches to skip"
            self.healed["skipped_micro_batches"] = self._behind
            self._behind = 0

    def keeps_update(self, step: int, grad_norm: torch.Tensor | None) -> bool:
        """Whether this step's update may be applied (False: a group was lost inside the step); asked every step,
        as the Manager counts its commits."""
        if self.alone:
            return True
        committed = bool(self.manager.should_commit())
        if not committed:
            self.uncommitted.append(step)
            log.warning("fault tolerance: step %d's gradients were not averaged across the replica groups (one was "
                        "lost inside the step): its update is dropped", step)
        return committed

    def after_step(self, state: LoopState) -> bool:
        if self.alone:
            self.alone_steps += 1
            return False
        if self._present < self.ft.replica_groups:
            self.shrunk_steps += 1
            self.missed_samples += (self.ft.replica_groups - self._present) * self.group_batch
        if not state.done:
            self._quorum(state)
        return state.stop_reason is not None

    def _quorum(self, state: LoopState) -> None:
        step, start = state.step, time.monotonic()
        try:  # waits for the quorum; a group behind applies a peer's state before returning
            self.manager.start_quorum()
        except (TimeoutError, RuntimeError) as exc:  # torchft's: no answer within ft.timeout_s, or a failed call
            self._without_quorum(state, exc)
            return
        present = self.manager.num_participants()
        if state.step != step:
            self.healed = {"from_step": step, "to_step": state.step, "seconds": round(time.monotonic() - start, 3)}
            log.info("fault tolerance: replica group %d took the live state of step %d from a peer in %.2f s",
                     self.ft.replica_id, state.step, self.healed["seconds"])
            self._behind += (state.step - step) * self.grad_accum
            self._fast_forward(state)
        if present != self._present:
            self.events.append({"step": state.step, "groups": present, "time": time.time()})
            if present < self.ft.replica_groups:
                log.warning("fault tolerance: %d of %d replica groups train from step %d: the global batch is %d of "
                            "%d until the others return", present, self.ft.replica_groups, state.step + 1,
                            present * self.group_batch, self.ft.replica_groups * self.group_batch)
            else:
                log.info("fault tolerance: all %d replica groups train again from step %d", present, state.step + 1)
            self._present = present

    def _without_quorum(self, state: LoopState, exc: Exception) -> None:
        """No quorum for the next step: every rank of the group is here (their quorum is one call of rank 0's
        Manager, which got no answer). As ft.no_quorum says: stop after this step, the checkpointer saving it (the
        loop state's stop_reason), or train on alone. Nothing to save (before the first step, or checkpoints off):
        stop in one line."""
        ft, address = self.ft, lighthouse_address(self.ft)
        answers = lighthouse_ages(address) is not None if self.env.rank == 0 else None
        if answers is None:  # rank 0 alone talks to the lighthouse (and speaks)
            cause = f"rank 0's Manager got none from the lighthouse at {address} ({exc})"
        elif answers:
            cause = (f"the lighthouse at {address} answers but gave this group none (fewer than parallelism.ft."
                     f"min_replicas={ft.min_replicas} replica groups reach it, or it was restarted under the running "
                     "groups)")
        else:
            cause = f"the lighthouse at {address} does not answer"
        said = (f"no quorum for step {state.step + 1} within parallelism.ft.timeout_s ({ft.timeout_s:g} s): {cause}; "
                f"replica group {ft.replica_id}")
        self.no_quorum = {"step": state.step, "lighthouse_answers": answers, "then": ft.no_quorum, "time": time.time()}
        if ft.no_quorum == "alone":
            self.alone = True
            if self.env.is_main:
                log.warning("fault tolerance: %s trains on alone from step %d (parallelism.ft.no_quorum=alone): a "
                            "plain run on its own share of the data (a global batch of %d, not %d), its weights no "
                            "longer synchronised with the other groups'", said, state.step + 1, self.group_batch,
                            ft.replica_groups * self.group_batch)
            return
        if state.steps_this_run == 0 or not self.checkpoints:
            nothing = ("before its first step: nothing new to save" if self.checkpoints else
                       "with nothing saved (checkpoints are off: checkpoint=dcp stops with one committed)")
            raise NoQuorumError(f"parallelism.ft.no_quorum=stop: {said} stops {nothing}; run the same command again "
                                "once the lighthouse answers them, or set parallelism.ft.no_quorum=alone to train on "
                                "alone")
        state.stop_reason = "fault tolerance (no quorum)"
        if self.env.is_main:
            log.warning("fault tolerance: %s stops at step %d with its checkpoint committed "
                        "(parallelism.ft.no_quorum=stop): run the same command to resume%s", said, state.step,
                        ", with a new lighthouse" if ft.lighthouse == "auto" else " once the lighthouse answers")

    def _live_state(self) -> dict[str, Any]:
        """What a late group needs to continue as this one does: sent to it over HTTP by the Manager. Sharded
        tensors go as this rank's local shards, which the late group's rank of the same place holds."""
        state = self._state
        assert state is not None, "the quorum runs after start()"
        return {"model": _local(state.model.state_dict()), "optimizer": _local(state.optimizer.state_dict()),
                "scheduler": state.scheduler.state_dict(), "step": state.step, "samples_seen": state.samples_seen}

    def _load(self, live: dict[str, Any]) -> None:
        state = self._state
        assert state is not None, "the quorum runs after start()"
        with torch.no_grad():  # into the tensors themselves (a sharded one's local shard): the optimizer holds them
            for name, tensor in state.model.state_dict().items():
                _local(tensor).copy_(live["model"][name])
        state.optimizer.load_state_dict(_sharded_like(live["optimizer"], state.optimizer))
        state.scheduler.load_state_dict(live["scheduler"])
        state.step, state.samples_seen = live["step"], live["samples_seen"]

    def close(self, state: Any) -> None:
        if self.enabled:
            self.manager.shutdown(wait=False)

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"replica_groups": self.ft.replica_groups, "replica_id": self.ft.replica_id,
                "shrunk_steps": self.shrunk_steps, "missed_samples": self.missed_samples,
                "uncommitted_steps": self.uncommitted, "quorum_changes": self.events, "healed": self.healed,
                "no_quorum": self.no_quorum, "alone_steps": self.alone_steps}


def _average(stage: FaultTolerance, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the bucket averaged over the group's ranks and the groups present. A collective
    that fails (a group lost inside it) leaves the bucket as it is: the Manager noted the error, and the step will
    not commit.
    (torchft 0.2's own hook asserts there instead: its work's future is never set when the wait fails.)"""
    buffer = bucket.buffer()
    if dist.is_initialized() and dist.get_world_size() > 1:  # a group of several ranks: its own average first
        dist.all_reduce(buffer)
        buffer /= dist.get_world_size()
    stage.average_across_groups(buffer)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# DDP compares the hook's annotations with the objects themselves; this module's are strings (postponed)
_average.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _local(obj: Any) -> Any:
    """`obj` with every DTensor in it replaced by this rank's local shard (plain tensors go over HTTP)."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {key: _local(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_local(value) for value in obj]
    return obj


def _sharded_like(optimizer_state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A peer's optimizer state (local shards) as DTensors sharded as their parameters are: a late group's
    optimizer may hold no state yet to copy into. A state tensor shaped as its parameter's shard is that shard."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in optimizer_state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            values = {key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                              shape=param.shape, stride=param.stride())
                      if torch.is_tensor(value) and value.shape == param.to_local().shape and value.dim() else value
                      for key, value in values.items()}
        state[index] = values
    return {**optimizer_state, "state": state}
