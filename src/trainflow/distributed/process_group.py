"""This process as one rank: the checks that need the world size or the hardware, joining the process group,
and the collectives the stages share.

The process group is initialised on `PrefixStore("trainflow/attempt_<TORCHELASTIC_RESTART_COUNT>", store)`:
torchrun keeps one store across restarts, and without the prefix a restarted group can read the addresses
the failed attempt published and fail to connect.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainflow.config.choices import Strategy
from trainflow.config.schema import ParallelismConfig, RunConfig, WatchdogConfig, plain
from trainflow.distributed.health import check_ranks_agree
from trainflow.distributed.mesh import (
    CPU_GROUP_RANKS,
    GROUP_STRATEGIES,
    SHARDED,
    layout,
    local_ranks,
    ranks_per_node,
)
from trainflow.errors import ConfigError, TrainflowError
from trainflow.util.device import emulated_bf16_warning
from trainflow.util.failures import linger_if_peer_lost, record_failure
from trainflow.util.float8 import check_fp8
from trainflow.util.rank import env_rank

log = logging.getLogger(__name__)

_self_launched = False  # set in workers started by `launch`: the launching process already spoke for them

# The collectives torch's flight recorder keeps per process for the watchdog's hang report (the newest, ~0.5 kB each
# in its dump): the last steps of every group, even FSDP's two per block and step. torch 2.13 records 2000 by
# default: each rank's dump would be ~1 MB, written to the run directory by every rank of a hung run at once.
FLIGHT_RECORDER_ENTRIES = 200


def mark_self_launched() -> None:
    """In a worker that trainflow's own launch started: its checks and warnings were the launching process's."""
    global _self_launched
    _self_launched = True


def self_launched() -> bool:
    """Whether trainflow's own launch started this process, which then speaks for it (one line for the run)."""
    return _self_launched


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: str = "single"
    tp: int = 1  # ranks of one tensor-parallel group: consecutive ranks, the mesh's last dimension
    grouped: bool = False  # a process group exists (ddp/fsdp/hsdp: of one rank too, the code path of many)
    pp: int = 1  # pipeline stages: the mesh's first dimension (each stage holds world / pp ranks)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own batches (the ranks of a TP group, and the stages of a pipeline,
        read the same)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp_size

    @property
    def distributed(self) -> bool:
        """Collectives run: 2+ ranks, or one rank of ddp/fsdp/hsdp (a group of one: the same code as many)."""
        return self.world_size > 1 or self.grouped


def resolve_device(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but no GPU is visible; use trainer.device=cpu or auto")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", cuda_index(local_rank, local_world_size, torch.cuda.device_count(),
                                           gpus_bound_per_task()))


def gpus_bound_per_task() -> bool:
    """Whether a scheduler bound this task to its own GPUs (SLURM --gpus-per-task / --gpu-bind).

    Then CUDA_VISIBLE_DEVICES lists this task's GPUs only, and each task sees fewer GPUs than there are ranks on
    its node: its own device is the first one it sees, whatever its local rank.
    """
    return "SLURM_LOCALID" in os.environ and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def cuda_index(local_rank: int, local_world_size: int, visible: int, bound_per_task: bool) -> int:
    """The CUDA device of this rank among the `visible` ones.

    Every rank of a node sees all of its GPUs (torchrun, srun without binding): device LOCAL_RANK. The scheduler
    bound GPUs to each task: the task's first visible device. Anything else would put two ranks on one GPU.
    """
    if visible >= local_world_size:
        return local_rank
    if bound_per_task:
        return 0
    check_nproc(local_world_size, "cuda", visible)  # raises: more ranks on this node than GPUs they can share
    return local_rank


def resolve_backend(cfg: ParallelismConfig, device: torch.device) -> str:
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"parallelism.backend: nccl needs CUDA GPUs, but this run is on {device.type}; "
                          "use parallelism.backend=gloo (or auto)")
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return cfg.backend


def check_nproc(nproc: int, device_type: str, gpus: int) -> None:
    """One GPU per process: more processes than GPUs cannot each get their own."""
    if device_type == "cuda" and nproc > gpus:
        raise ConfigError(f"parallelism.nproc_per_node: {nproc} processes need {nproc} GPUs, but {gpus} "
                          f"{'is' if gpus == 1 else 'are'} visible; set parallelism.nproc_per_node={gpus} (or auto)")


def resolve_nproc(cfg: ParallelismConfig, device: torch.device) -> int:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    nproc = local_ranks(cfg.strategy, cfg.nproc_per_node, gpus)
    check_nproc(nproc, device.type, gpus)
    return nproc


def cpu_group_note(cfg: ParallelismConfig, device: torch.device) -> str | None:
    """Why an auto-sized group runs on CPU processes, said once by the process that starts them."""
    if cfg.nproc_per_node != "auto" or device.type != "cpu" or cfg.strategy not in GROUP_STRATEGIES:
        return None
    return (f"parallelism.nproc_per_node=auto: no GPU {'is used' if torch.cuda.is_available() else 'is visible'}, "
            f"so {cfg.strategy} runs on {CPU_GROUP_RANKS} CPU processes over gloo (auto is one process per GPU); "
            "set parallelism.nproc_per_node=N for another number")


def check_world_size(cfg: ParallelismConfig, world_size: int, started_by: str) -> None:
    """single trains in exactly one process; ddp/fsdp/hsdp on one rank train in a group of one, and say so."""
    if cfg.strategy == Strategy.single and world_size > 1:
        raise ConfigError(f"parallelism.strategy: single trains in one process, but {started_by} started "
                          f"{world_size}; use parallelism=ddp or parallelism=fsdp")
    if cfg.strategy in GROUP_STRATEGIES and world_size == 1 and env_rank() == 0:
        why = "one GPU is visible" if cfg.nproc_per_node == "auto" else "one was asked for"
        log.info("parallelism=%s on one process (%s): a process group of one rank, the code path of many (%s); "
                 "parallelism.nproc_per_node=N trains on N devices", cfg.strategy, why,
                 "nothing to shard across" if cfg.strategy in SHARDED else "nothing to average with")


def per_rank_batch(cfg: RunConfig, world_size: int) -> int:
    """trainer.batch_size, or the share of parallelism.global_batch each rank takes per micro-step; `world_size`:
    the data-parallel ranks (a TP group shares one batch)."""
    global_batch = cfg.parallelism.global_batch
    if global_batch is None:
        return int(cfg.trainer.batch_size)
    parts = world_size * cfg.trainer.grad_accum
    if global_batch % parts:
        lower = max(parts, global_batch // parts * parts)
        raise ConfigError(
            f"parallelism.global_batch: {global_batch} does not divide into {world_size} ranks x "
            f"{cfg.trainer.grad_accum} accumulation steps; use a multiple of {parts}, e.g. {lower} or {lower + parts}")
    return global_batch // parts


def bf16_warning(cfg: RunConfig, device: torch.device, flags: frozenset[str] | None = None) -> str | None:
    """A warning when bf16 is asked for (the step's autocast, FSDP2's dtypes) on a CPU without native bf16."""
    keys = ["trainer.precision"] if cfg.trainer.precision == "bf16" else []
    if cfg.parallelism.strategy in SHARDED:
        keys += [f"parallelism.fsdp.{k}" for k in ("param_dtype", "reduce_dtype")
                 if getattr(cfg.parallelism.fsdp, k) == "bf16"]
    return emulated_bf16_warning(keys, device, flags)


def _preflight(cfg: RunConfig, device: torch.device, world_size: int, local_world_size: int, started_by: str) -> str:
    """Every check that needs the world size or the hardware; returns the backend. Warnings once per run."""
    p = cfg.parallelism
    if cfg.trainer.precision == "fp8":
        check_fp8(device)
    check_world_size(p, world_size, started_by)
    backend = resolve_backend(p, device)
    if p.strategy in SHARDED and p.fsdp.cpu_offload and device.type == "cpu":
        raise ConfigError("parallelism.fsdp.cpu_offload: the run is on CPU already, so there is nothing to offload "
                          "to; set it to false")
    found = layout(p, world_size, local_world_size)  # raises: degrees that do not fit this world
    if p.strategy != "auto":  # auto picks its data-parallel ranks (fewer under TP) for the batch: memory_plan
        per_rank_batch(cfg, found.dp_size)
    if device.type == "cuda" and not gpus_bound_per_task():
        check_nproc(local_world_size, "cuda", torch.cuda.device_count())
    if env_rank() == 0 and not _self_launched:
        for warning in (bf16_warning(cfg, device), oversubscription_warning(device, local_world_size, usable_cores())):
            if warning:
                log.warning(warning)
        if p.check and cfg.model.dropout:
            log.warning("parallelism.check: model.dropout=%s draws different masks on each rank than in one "
                        "process, so the check cannot match; set model.dropout=0 for the check", cfg.model.dropout)
    return backend


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: taskset, a SLURM allocation), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscription_warning(device: torch.device, local_world_size: int, cores: int) -> str | None:
    """More CPU ranks on this node than cores they may use: said once, before start, with what it costs."""
    if device.type != "cpu" or local_world_size <= cores:
        return None
    return (f"parallelism.nproc_per_node: {local_world_size} ranks share {cores} CPU core{'s' if cores > 1 else ''}, "
            f"so each runs {cores / local_world_size:.2g} of a core: a step takes at least "
            f"{local_world_size / cores:.2g}x as long as with one rank per core, for no more samples per second "
            f"(fewer: the ranks also wait for each other to get a core); use parallelism.nproc_per_node={cores} "
            "or fewer")


def watchdog_on(watchdog: WatchdogConfig, world_size: int) -> bool:
    """parallelism.watchdog.enabled resolved (auto: runs of 2+ ranks); the group records its collectives for it."""
    return watchdog.enabled is True or (watchdog.enabled == "auto" and world_size > 1)


def _store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, under a prefix per restart attempt (a restarted group must not read stale keys)."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise TrainflowError(f"environment: RANK and WORLD_SIZE are set but {exc.args[0]} is not; a launcher must "
                             "export MASTER_ADDR and MASTER_PORT too (torchrun does)") from None
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent runs it
    is_master = rank == 0 and not agent_hosts_store
    try:
        base = dist.TCPStore(addr, port, world_size if is_master else None, is_master=is_master, timeout=timeout,
                             wait_for_workers=False)
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        raise TrainflowError(f"environment: MASTER_PORT={port} on {addr} is in use by another process; pick a free "
                             "port (or let torchrun choose one)") from exc
    return dist.PrefixStore(f"trainflow/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def setup(cfg: RunConfig) -> DistEnv:
    """Join the process group the launcher prepared (or stay a single process)."""
    p = cfg.parallelism
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.trainer.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    started_by = "trainflow" if _self_launched else "the launcher"
    backend = _preflight(cfg, device, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), started_by)
    composed = plain(cfg) if world_size > 1 else {}  # as this rank composed it (before the run decides anything)
    if rank != 0:
        logging.getLogger("trainflow").setLevel(logging.WARNING)  # rank 0 speaks; the others only warn
    if device.type == "cuda":
        torch.cuda.set_device(device)
    grouped = world_size > 1 or p.strategy in GROUP_STRATEGIES
    if world_size == 1 and grouped and not dist.is_initialized():  # a group of one: its store lives in this process
        dist.init_process_group(resolve_backend(p, device), store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)
    if world_size > 1 and not dist.is_initialized():
        if watchdog_on(p.watchdog, world_size):  # torch's flight recorder (gloo, NCCL) reads it as the group is
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))  # made; a size you set wins
        timeout = timedelta(seconds=p.timeout_s)
        dist.init_process_group(backend, store=_store(rank, world_size, timeout), rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
        check_ranks_agree(composed, device, rank, world_size)
    found = layout(p, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return DistEnv(rank, world_size, local_rank, device, p.strategy, found.tp, grouped, found.pp)


def teardown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(cfg: RunConfig) -> Iterator[DistEnv]:
    """This process as one rank: set up, record any failure for the launcher, always tear down."""
    env = None
    try:
        env = setup(cfg)
        yield env
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            record_failure(exc)
            linger_if_peer_lost(exc)
        raise
    finally:
        if env is not None:
            teardown(env)


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world_size
    return value


def node_count(world_size: int) -> int:
    """Nodes of the run: ranks over ranks per node (GROUP_WORLD_SIZE is torchrun's alone; SLURM does not set it)."""
    return max(1, world_size // max(ranks_per_node(world_size), 1))
