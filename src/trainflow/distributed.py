"""The process group, the parallel wrapping of the model, and the local launch.

Who starts the ranks:
- `parallelism=single`: one process, no process group.
- `python train.py parallelism=ddp|fsdp|hsdp|auto parallelism.nproc_per_node=N`: `launch` starts N local workers
  through torch's elastic agent (`elastic_launch`, c10d rendezvous on a free localhost port). The workers get
  the composed, resolved config and the run directory the launching process chose, so Hydra runs once and
  there is one run directory. Rank 0's summary is returned to the launching process; a failure on any rank
  comes back as one `TrainflowError` naming the rank, with that rank's traceback. On CPU the workers are
  forked (torch is already imported: each start costs milliseconds, not seconds of imports); with CUDA they
  are spawned, because a forked child cannot use CUDA that its parent touched.
- `torchrun ... train.py ...` (one or many nodes) or any launcher that exports RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT: every rank runs `train.py`; `trainflow.rundir` agrees one run directory.

The process group is initialised on `PrefixStore("trainflow/attempt_<TORCHELASTIC_RESTART_COUNT>", store)`:
torchrun keeps one store across restarts, and without the prefix a restarted group can read the addresses
the failed attempt published and fail to connect.

Order of model assembly (run.py): activation checkpointing -> DDP, or FSDP2 `fully_shard` on each block of
`model.blocks` then on the root (one device mesh: 1-D for FSDP, replicate x shard for HSDP, see trainflow.hsdp)
-> compile -> optimizer. `parallelism=auto` picks one of these before (trainflow.memory_plan). The optimizer
must see the final (sharded) parameters.

Per-block compile and FSDP2: compile each block *in place* (`block.compile()`) after `fully_shard`, i.e. in
run.py's order (parallelize, then compile). Measured with torch 2.13 on CPU (2 gloo ranks, GPT blocks,
backends aot_eager and inductor): in-place compile after `fully_shard` and before it both train like eager
FSDP (largest per-tensor relative difference from one eager process after 3 AdamW steps: 1.0e-4 for eager
FSDP and aot_eager, 2.6e-4 for inductor; 0 graph breaks; one graph shared by all blocks). Replacing a
block by the `torch.compile(block)` wrapper trains as well but renames every parameter
(`blocks.0._orig_mod.`), which checkpoints see: do not. Whole-model compile on top of FSDP2 cannot trace
into the sharded blocks (the compile stage warns and compiles the blocks instead).

Gradient accumulation: `no_grad_sync(model, sync=False)` skips the all-reduce (DDP `no_sync`) or the
reduce-scatter (FSDP2 `set_requires_gradient_sync(False)`) on all but the last micro-step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainflow.errors import ConfigError, TrainflowError
from trainflow.hsdp import MESH_DIMS, build_mesh, hsdp_shape
from trainflow.metrics import RunLogHandler, matmul_math

log = logging.getLogger(__name__)

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The parity check's default tolerance by the matmuls' arithmetic (trainflow.metrics.matmul_math): fp32 all-reduce
# reorderings stay ~1e-5; bf16 (and TF32) gradients of 2-sample shards round differently from the one-process
# batch (~4e-3 measured for bf16).
PARITY_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 2e-2}
_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default, for workers without it
SHARDED = ("fsdp", "hsdp")  # the strategies that shard with FSDP2 (over one mesh dimension, or two)
_self_launched = False  # set in workers started by `launch`: the launching process already spoke for them


class WorkerError(TrainflowError):
    """A rank of a launched run failed; the message names the rank and carries its traceback."""

    exit_code = 1  # a crash, not a usage error


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# ---------------------------------------------------------------------------------------------------------------
# Checks that need the world size or the hardware (the rest is config.validate_parallelism)


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


def resolve_backend(cfg: DictConfig, device: torch.device) -> str:
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


def resolve_nproc(cfg: DictConfig, device: torch.device) -> int:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    nproc = max(gpus, 1) if cfg.nproc_per_node == "auto" else int(cfg.nproc_per_node)
    check_nproc(nproc, device.type, gpus)
    return nproc


def check_world_size(cfg: DictConfig, world_size: int, started_by: str) -> None:
    """ddp/fsdp need two or more ranks, single exactly one: anything else is refused with the fix."""
    if cfg.strategy == "single" and world_size > 1:
        raise ConfigError(f"parallelism.strategy: single trains in one process, but {started_by} started "
                          f"{world_size}; use parallelism=ddp or parallelism=fsdp")
    if cfg.strategy not in ("single", "auto") and world_size < 2:
        if started_by != "trainflow":
            why = f"{started_by} started one"
        elif cfg.nproc_per_node == "auto":
            why = "auto is one process per GPU, and at most one GPU is visible"
        else:
            why = "one was asked for"
        raise ConfigError(f"parallelism.nproc_per_node: {cfg.strategy} needs 2 or more processes, got 1 ({why}); "
                          f"set parallelism.nproc_per_node=2 or more, or use parallelism=single")


def per_rank_batch(cfg: DictConfig, world_size: int) -> int:
    """trainer.batch_size, or the share of parallelism.global_batch each rank takes per micro-step."""
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


def cpu_flags() -> frozenset[str] | None:
    """The CPU feature flags Linux reports, or None where /proc/cpuinfo is not available."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_slowdown(size: int = 384, repeats: int = 5) -> float:
    """Time of a bf16 matmul over an fp32 one of the same size (best of a few): > 1 means bf16 is slower."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.bfloat16] / best[torch.float32]


def bf16_warning(cfg: DictConfig, device: torch.device, flags: frozenset[str] | None = None) -> str | None:
    """A warning when bf16 is asked for on a CPU without native bf16 (emulated bf16 is slower than fp32)."""
    keys = ["trainer.precision"] if cfg.trainer.precision == "bf16" else []
    if cfg.parallelism.strategy in SHARDED:
        keys += [f"parallelism.fsdp.{k}" for k in ("param_dtype", "reduce_dtype") if cfg.parallelism.fsdp[k] == "bf16"]
    if not keys or device.type != "cpu":
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is not None and flags & {"avx512_bf16", "amx_bf16"}:
        return None
    ratio = bf16_slowdown()
    return (f"{', '.join(keys)}=bf16: this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag), so bf16 is "
            f"emulated: a bf16 matmul measured {ratio:.2g}x the time of fp32 here; use fp32 on this machine")


def _preflight(cfg: DictConfig, device: torch.device, world_size: int, local_world_size: int, started_by: str) -> str:
    """Every check that needs the world size or the hardware; returns the backend. Warnings once per run."""
    p = cfg.parallelism
    check_world_size(p, world_size, started_by)
    backend = resolve_backend(p, device)
    if p.strategy in SHARDED and p.fsdp.cpu_offload and device.type == "cpu":
        raise ConfigError("parallelism.fsdp.cpu_offload: the run is on CPU already, so there is nothing to offload "
                          "to; set it to false")
    per_rank_batch(cfg, world_size)
    if p.strategy == "hsdp":
        hsdp_shape(p, world_size)  # raises: a shape that does not fit this world
    if device.type == "cuda" and not gpus_bound_per_task():
        check_nproc(local_world_size, "cuda", torch.cuda.device_count())
    if int(os.environ.get("RANK", "0")) == 0 and not _self_launched:
        for warning in (bf16_warning(cfg, device), _oversubscription_warning(device, local_world_size)):
            if warning:
                log.warning(warning)
        if p.check and cfg.model.get("dropout"):
            log.warning("parallelism.check: model.dropout=%s draws different masks on each rank than in one "
                        "process, so the check cannot match; set model.dropout=0 for the check", cfg.model.dropout)
    return backend


def _oversubscription_warning(device: torch.device, local_world_size: int) -> str | None:
    cores = os.cpu_count() or 1
    if device.type == "cpu" and local_world_size > cores:
        return (f"parallelism.nproc_per_node: {local_world_size} processes share {cores} CPU cores; "
                "they will run, but slower than with one process per core")
    return None


# ---------------------------------------------------------------------------------------------------------------
# The process group


def launched() -> bool:
    """True when a launcher (torchrun, `launch`, a cluster script) started this process as one rank of many."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def should_launch(cfg: DictConfig) -> bool:
    """ddp/fsdp/hsdp typed without a launcher (auto: for more than one process): this process starts them."""
    p = cfg.parallelism
    if p.strategy == "auto" and resolve_nproc(p, resolve_device(cfg.trainer.device, 0)) == 1:
        return False
    return p.strategy != "single" and not launched()


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


def setup(cfg: DictConfig) -> DistEnv:
    """Join the process group the launcher prepared (or stay a single process); fix this rank's batch size."""
    p = cfg.parallelism
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.trainer.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    started_by = "trainflow" if _self_launched else "the launcher"
    backend = _preflight(cfg, device, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), started_by)
    cfg.trainer.batch_size = per_rank_batch(cfg, world_size)
    if rank != 0:
        logging.getLogger("trainflow").setLevel(logging.WARNING)  # rank 0 speaks; the others only warn
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=p.timeout_s)
        dist.init_process_group(backend, store=_store(rank, world_size, timeout), rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world_size, local_rank, device, p.strategy)


def teardown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def record_failure(exc: BaseException) -> None:
    """Write the exception where the elastic agent looks (TORCHELASTIC_ERROR_FILE), so the launcher can name it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or getattr(exc, "_trainflow_recorded", False):  # keep the first record: its time counts
        return
    with contextlib.suppress(AttributeError, TypeError):
        exc._trainflow_recorded = True
    data: dict[str, Any] = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        },
        "trainflow_time": time.time(),  # finer than the agent's seconds: which rank failed first
    }
    if isinstance(exc, TrainflowError):
        data["trainflow_user_error"] = str(exc)
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)


@contextlib.contextmanager
def process_group(cfg: DictConfig) -> Iterator[DistEnv]:
    """This process as one rank: set up, record any failure for the launcher, always tear down."""
    env = None
    try:
        env = setup(cfg)
        yield env
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            record_failure(exc)
        raise
    finally:
        if env is not None:
            teardown(env)


# ---------------------------------------------------------------------------------------------------------------
# Starting local workers


_PASSED_ON = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2")  # signals the agent passes on to the workers


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Start parallelism.nproc_per_node workers running `run(cfg, run_dir)`; return rank 0's summary."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    p = cfg.parallelism
    device = resolve_device(cfg.trainer.device, 0)
    nproc = resolve_nproc(p, device)
    _preflight(cfg, device, nproc, nproc, "trainflow")
    log.info("starting %d %s workers on %s (%s)", nproc, p.strategy, device.type, resolve_backend(p, device))
    container = OmegaConf.to_container(cfg, resolve=True)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the failure explained below says it all
    with tempfile.TemporaryDirectory(prefix="trainflow-elastic-") as logs:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"trainflow-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=p.max_restarts, monitor_interval=0.1,
            start_method="spawn" if device.type == "cuda" else "fork", logs_specs=DefaultLogsSpecs(log_dir=logs),
            signals_to_handle=",".join(_PASSED_ON),  # passed on to the workers
        )
        started = time.time() - 1.0  # (file times may be coarser than the clock)
        handlers = {name: signal.getsignal(getattr(signal, name)) for name in _PASSED_ON}
        stop = None
        try:
            elastic_launch(config, _worker)(container, str(run_dir))
        except ChildFailedError as exc:
            raise explain_failure(exc, Path(logs)) from None
        except SignalException as exc:
            stop = exc.sigval
        finally:
            # The agent's handlers stay installed and raise in this process: a Ctrl-C pressed again while it
            # exits would print their traceback. After a stop the workers are gone: ignore a repeated signal.
            for name, handler in handlers.items():
                signal.signal(getattr(signal, name), signal.SIG_IGN if stop else handler)
    return _rank0_summary(run_dir / "summary.json", started, stop)


class StoppedBySignal(TrainflowError):
    """The launcher was signalled and the workers stopped before rank 0 wrote its summary."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process a signal ended


def _rank0_summary(path: Path, started: float, stop: signal.Signals | None = None) -> dict[str, Any]:
    """Rank 0's summary, read from the file it wrote (also after a stop signal the agent passed on: the
    checkpoint stage then saves at the next step boundary and ends the run normally, and says so in it)."""
    if path.exists() and path.stat().st_mtime >= started:
        if stop:
            log.warning("%s: the workers stopped; rank 0 finished its summary", stop.name)
        return json.loads(path.read_text())
    if stop:
        raise StoppedBySignal(f"stopped by {stop.name} before the workers finished (no summary.json was written)",
                              int(stop))
    raise WorkerError(f"the workers finished, but rank 0 wrote no {path}")


def _interrupt_once(_signum: int, _frame: Any) -> None:
    """Stop this worker at the first SIGINT and ignore the next ones: the terminal's Ctrl-C reaches it, and the
    agent then passes the same signal on. A second KeyboardInterrupt could land after the first was handled,
    where nothing catches it, and print a traceback of the multiprocessing child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker(container: dict, run_dir: str) -> None:
    """One self-launched rank: the parent's config and run directory, no Hydra."""
    global _self_launched
    _self_launched = True
    # A forked worker inherits the agent's handlers (they raise in Python, which a rank blocked in a collective
    # never reaches): a signal must act on it as on any process.
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        rank = int(os.environ["RANK"])
        _configure_worker_logging(Path(run_dir), rank)
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        from trainflow.run import run

        cfg = OmegaConf.create(container)
        OmegaConf.set_struct(cfg, True)
        run(cfg, run_dir)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        # Exit rather than raise: the agent's own wrapper would overwrite the record with one that lacks
        # whether this was a user error and when exactly it happened (which rank failed first).
        record_failure(exc)
        raise SystemExit(1) from None
    # A worker may exit only once the agent has read its return value. An agent shutting down on a stop signal
    # reads none and would wait its whole shutdown timeout (30 s), so leave by ourselves a little later. The
    # summary travels as the file rank 0 wrote: the small return value never fills the pipe.
    timer = threading.Timer(5.0, os._exit, args=(0,))
    timer.daemon = True
    timer.start()
    return None


def _configure_worker_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs like a Hydra job (console + train.log); the others print warnings and errors only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if rank == 0:
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout),
                                           RunLogHandler(run_dir / "train.log")]
        fmt, level = _LOG_FORMAT, logging.INFO
    else:
        handlers, fmt, level = [logging.StreamHandler(sys.stderr)], f"[rank {rank}]{_LOG_FORMAT}", logging.WARNING
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
    root.setLevel(level)


def _records(logs: Path) -> dict[int, dict[str, Any]]:
    """Every rank's error record of the last attempt: the agent itself reports only the first exit it saw,
    which may be a rank that merely lost its connection to the one that failed."""
    def attempt(path: Path) -> int:
        return int(path.parent.parent.name.removeprefix("attempt_"))

    files = list(logs.glob("*/attempt_*/*/error.json"))
    last = max(map(attempt, files), default=-1)
    records = {}
    for path in files:
        if attempt(path) == last:
            with contextlib.suppress(OSError, ValueError):
                records[int(path.parent.name)] = json.loads(path.read_text())
    return records


def explain_failure(exc: Any, logs: Path | None = None) -> TrainflowError:
    """The root cause as one error: a user error (the lowest rank that hit it: usually all do), else the rank
    that failed first (the others were stopped after it), with its traceback."""
    records = _records(logs) if logs else {}
    for rank, failure in exc.failures.items():
        records.setdefault(rank, failure.error_file_data)

    def order(rank: int) -> tuple[int, float, int]:
        data = records[rank]
        if "trainflow_user_error" in data:
            return (0, 0.0, rank)
        return (1, data["trainflow_time"], rank) if "trainflow_time" in data else (2, 0.0, rank)

    rank = min(records, key=order)
    data, failure = records[rank], exc.failures.get(rank)
    if "trainflow_user_error" in data:
        return TrainflowError(f"{data['trainflow_user_error']} (rank {rank})")
    message = data.get("message")
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "").rstrip()
        return WorkerError(f"rank {rank} failed: {message.get('message')}; the other ranks were stopped\n"
                           f"--- traceback of rank {rank} ---\n{stack}")
    if failure is not None and failure.exitcode < 0:
        return WorkerError(f"rank {rank} (pid {failure.pid}) was killed by signal {failure.signal_name()}; "
                           "the other ranks were stopped")
    code = failure.exitcode if failure is not None else "?"
    return WorkerError(f"rank {rank} exited with code {code}; the other ranks were stopped; its output above says why")


# ---------------------------------------------------------------------------------------------------------------
# Wrapping the model


def parallelize(model: nn.Module, cfg: DictConfig, env: DistEnv, precision: str = "fp32") -> nn.Module:
    """Activation checkpointing, then DDP or FSDP2 for the chosen strategy; one process trains the model as is."""
    if cfg.activation_checkpointing == "full":
        checkpoint_blocks(model)
    if not env.distributed:
        return model
    if cfg.strategy in SHARDED:
        shape = hsdp_shape(cfg, env.world_size) if cfg.strategy == "hsdp" else None
        return shard(model, cfg.fsdp, env, precision, build_mesh(env.device.type, env.world_size, shape))
    from torch.nn.parallel import DistributedDataParallel

    d = cfg.ddp
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None, bucket_cap_mb=d.bucket_cap_mb,
        find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
    )


def _blocks(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0 else None


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (names and state dicts unchanged)."""
    blocks = _blocks(model)
    if blocks is None:
        raise ConfigError(f"parallelism.activation_checkpointing: full recomputes each module of model.blocks, and "
                          f"{type(model).__name__} has no `blocks` list; set it to off")
    for block in blocks:
        block.forward = functools.partial(_checkpointed_forward, block)


def shard_units(model: nn.Module, wrap: str, min_params: int) -> list[nn.Module]:
    """The submodules that get their own `fully_shard`, children before parents (the root comes last, apart)."""
    blocks = _blocks(model)
    if wrap == "blocks" and blocks is None:
        raise ConfigError(f"parallelism.fsdp.wrap: blocks shards each module of model.blocks, and "
                          f"{type(model).__name__} has none; use parallelism.fsdp.wrap=size (or auto)")
    if wrap != "size" and blocks is not None:
        return list(blocks)
    # By size: a module whose parameters (not already in a smaller unit) reach min_params becomes a unit, unless
    # one of its parameters is shared with a module outside it (tied weights stay with the root).
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        pending = sum(visit(child) for child in module.children())
        pending += sum(p.numel() for p in module.parameters(recurse=False))
        inside = {id(m) for m in module.modules()}
        self_contained = all(owners[id(p)] <= inside for p in module.parameters())
        if module is not model and pending >= min_params and self_contained:
            units.append(module)
            return 0
        return pending

    visit(model)
    return units


def fsdp_dtypes(param_dtype: str | None, reduce_dtype: str | None, precision: str) -> tuple[str | None, str | None]:
    """FSDP2's (param, reduce) dtypes: what the user set, else bf16 parameters under bf16 autocast (gathering fp32
    would move twice the bytes for matmuls that run in bf16 anyway) and an fp32 reduce-scatter (summing bf16
    gradients over many ranks loses precision)."""
    param = param_dtype or ("bf16" if precision == "bf16" else None)
    reduce = reduce_dtype or ("fp32" if param not in (None, "fp32") else None)
    return param, reduce


def shard(model: nn.Module, cfg: DictConfig, env: DistEnv, precision: str = "fp32",
          mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2: `fully_shard` each unit (blocks, or modules by size), then the root, over one device mesh (FSDP: one
    dimension; HSDP: replicate x shard)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype = fsdp_dtypes(cfg.param_dtype, cfg.reduce_dtype, precision)
    mesh = mesh or build_mesh(env.device.type, env.world_size)
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    }
    units = shard_units(model, cfg.wrap, cfg.min_params)
    for unit in units:
        fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, **options)
    # The root's reshard_after_forward is left to FSDP (kept gathered: backward needs it first); passing True
    # would cost an all-gather at the start of every backward.
    fully_shard(model, **options)
    if env.is_main:
        log.info("%s: %d shard units + root over %d ranks (mesh %s)", env.strategy, len(units), env.world_size,
                 " x ".join(f"{size} {name}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)))
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under any compile / DDP wrappers (FSDP2 shards in place: nothing to peel)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def no_grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce / reduce-scatter on micro-steps that are not the last of an accumulation."""
    if sync:
        return contextlib.nullcontext()
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):  # under torch.compile's wrapper
        model = model._orig_mod
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world_size
    return value


def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter; FSDP2 shards are gathered (a collective: call on every rank)."""
    for name, param in unwrap(model).named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, full.detach()


# ---------------------------------------------------------------------------------------------------------------
# Parity check and summary


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


class ParityCheck:
    """With parallelism.check: rank 0 trains a one-process copy on the same global batches, then compares.

    The reference starts from a copy of the model taken before wrapping (the same initial weights every rank
    has), reads the global stream with one rank and micro-batches of batch_size x world_size (the union of the
    ranks' micro-batches: see data.py), and takes the same optimizer steps. Each step's loss (of the last
    micro-step, averaged over ranks) and, after check_steps, the parameters are compared by relative
    difference: the norm of the difference over the norm of the reference, all parameters as one vector.
    The worst single tensor is reported too, not gated: a zero-initialised bias under Adam turns the
    rounding of a differently ordered all-reduce into a visibly different update (~1e-4 of its small norm).
    """

    def __init__(self, cfg: DictConfig, env: DistEnv, model: nn.Module, dataset: Any,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        p = cfg.parallelism
        self.enabled = bool(p.check) and env.distributed
        self.steps = min(p.check_steps, cfg.trainer.max_steps) if self.enabled else 0
        self.tolerance = p.check_tolerance or PARITY_TOLERANCE[matmul_math(env.device, cfg.trainer.precision)]
        self.env = env
        self.result: dict[str, Any] | None = None
        self._losses: list[tuple[float, float]] = []  # (ranks' mean, reference), on rank 0
        self._seen = 0
        if not (self.enabled and env.is_main):
            return
        from trainflow.data import StreamSampler, make_loader
        from trainflow.optim import build_optimizer

        t = cfg.trainer
        self.reference = copy.deepcopy(model)
        self.optimizer, self.scheduler = build_optimizer(self.reference, cfg.optim, t.max_steps, env.device)
        self.loss_fn, self.trainer = loss_fn, t
        sampler = StreamSampler(len(dataset), t.batch_size * env.world_size, 0, 1, t.seed)
        self.batches = iter(make_loader(dataset, sampler, cfg.data, False))

    def _reference_step(self) -> float:
        t = self.trainer
        autocast = torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")
        for _ in range(t.grad_accum):
            inputs, targets = (x.to(self.env.device) for x in next(self.batches))
            with autocast:
                loss = self.loss_fn(self.reference(inputs), targets)
            (loss / t.grad_accum).backward()
        nn.utils.clip_grad_norm_(self.reference.parameters(), t.grad_clip or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> None:
        """Call on every rank after each optimizer step with the last micro-step's loss."""
        if not self.enabled or self.result is not None:
            return
        self._seen += 1
        if step != self._seen:  # resumed: the reference started from the initial weights
            self.result = {"skipped": f"the run resumed at step {step - 1}; the check compares from step 0"}
            self._release()
            return
        mean_loss = all_reduce_mean(loss.detach().float().clone(), self.env).item()
        if self.env.is_main:
            self._losses.append((mean_loss, self._reference_step()))
        if step < self.steps:
            return
        diff_sq, ref_sq, worst, worst_name = 0.0, 0.0, 0.0, ""
        reference = dict(self.reference.named_parameters()) if self.env.is_main else {}
        for name, full in full_parameters(model):  # every rank takes part in the gathers
            if self.env.is_main:
                a, b = full.double(), reference[name].detach().double()
                diff_sq += float((a - b).square().sum())
                ref_sq += float(b.square().sum())
                tensor_diff = _rel(a, b)
                if tensor_diff >= worst:
                    worst, worst_name = tensor_diff, name
        if self.env.is_main:
            loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in self._losses)
            param_diff = math.sqrt(diff_sq / max(ref_sq, 1e-24))
            passed = loss_diff <= self.tolerance and param_diff <= self.tolerance
            self.result = {
                "steps": step, "tolerance": self.tolerance, "passed": passed,
                "losses": [a for a, _ in self._losses], "reference_losses": [b for _, b in self._losses],
                "loss_rel_diff": loss_diff, "param_rel_diff": param_diff,
                "worst_tensor": worst_name, "worst_tensor_rel_diff": worst,
            }
            (log.info if passed else log.error)(
                "parity check %s: %s on %d ranks vs one process after %d steps: loss rel diff %.1e, "
                "parameter rel diff %.1e (worst tensor %s: %.1e), tolerance %.0e", "passed" if passed else "FAILED",
                self.env.strategy, self.env.world_size, step, loss_diff, param_diff, worst_name, worst,
                self.tolerance)
        else:
            self.result = {}
        self._release()

    def _release(self) -> None:
        for name in ("reference", "optimizer", "scheduler", "batches"):
            self.__dict__.pop(name, None)

    def summary(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return self.result or {"skipped": f"the run ended before parallelism.check_steps={self.steps}"}


def node_count(world_size: int) -> int:
    """Nodes of the run: ranks over ranks per node (GROUP_WORLD_SIZE is torchrun's alone; SLURM does not set it)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(per_node, 1))


def summary(cfg: DictConfig, env: DistEnv, steady: dict[str, float] | None, check: ParityCheck) -> dict[str, Any]:
    """The parallel layout, global batch, throughput in total and per rank, and the parity check's verdict."""
    t = cfg.trainer
    out: dict[str, Any] = {
        "strategy": env.strategy,
        "world_size": env.world_size,
        "nodes": node_count(env.world_size),
        "backend": dist.get_backend() if env.distributed and dist.is_initialized() else None,
        "per_rank_batch": t.batch_size,
        "grad_accum": t.grad_accum,
        "global_batch": t.batch_size * env.world_size * t.grad_accum,
        "check": check.summary(),
    }
    if env.strategy in SHARDED:
        shape = hsdp_shape(cfg.parallelism, env.world_size) if env.strategy == "hsdp" else (1, env.world_size)
        out["mesh"] = dict(zip(MESH_DIMS, shape, strict=True))
    if steady:
        for key in ("samples_per_sec", "tokens_per_sec"):
            out[f"{key}_total"] = steady[key]
            out[f"{key}_per_rank"] = steady[key] / env.world_size
    return out
