"""Starting the ranks of a run on this machine, when no launcher did.

Who starts the ranks:
- `parallelism=single`: one process, no process group.
- `python train.py parallelism=ddp|fsdp|hsdp|auto parallelism.nproc_per_node=N`: `launch` starts N local workers
  through torch's elastic agent (`elastic_launch`, c10d rendezvous on a free localhost port). The workers get
  the typed config and the run directory the launching process chose, so Hydra runs once (and validation) and
  there is one run directory. Rank 0's summary is returned to the launching process; a failure on any rank
  comes back as one `TrainflowError` naming the rank, with that rank's traceback. On CPU the workers are
  forked (torch is already imported: each start costs milliseconds, not seconds of imports); with CUDA they
  are spawned, because a forked child cannot use CUDA that its parent touched.
- `torchrun ... train.py ...` (one or many nodes) or any launcher that exports RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT: every rank runs `train.py`; `trainflow.util.rundir` agrees one run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainflow.checkpoint.stopping import EXIT_STOPPED, catch_stop_signals
from trainflow.config.schema import RunConfig
from trainflow.distributed.process_group import (
    _preflight,
    cpu_group_note,
    mark_self_launched,
    resolve_backend,
    resolve_device,
    resolve_nproc,
)
from trainflow.errors import TrainflowError
from trainflow.guards.watchdog import hang_report
from trainflow.run.training import train
from trainflow.util.console import FileOnly, RunLogHandler
from trainflow.util.failures import WorkerError, explain_worker_failure, record_failure
from trainflow.util.rank import env_rank
from trainflow.util.rundir import results_begin
from trainflow.util.targets import user_folder_importable

log = logging.getLogger(__name__)

_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default, for workers without it


def launched() -> bool:
    """True when a launcher (torchrun, `launch`, a cluster script) started this process as one rank of many."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def should_launch(cfg: RunConfig) -> bool:
    """ddp/fsdp/hsdp typed without a launcher (auto: for more than one process): this process starts them."""
    p = cfg.parallelism
    if resolve_nproc(p, resolve_device(cfg.trainer.device, 0)) == 1:  # one rank (a group of one): trains here
        return False
    return p.strategy != "single" and not launched()


# signals the agent passes on to the workers: every stop signal (checkpoint.stop_signals), Ctrl-C and SIGQUIT
_PASSED_ON = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_STOPPED_EVERY_S = 0.5  # how often the launching process looks for a stopped worker the agent asked to end
_AGENT_STOPPING = "agent-stopping"  # left next to the workers' pids when the agent got a signal it passes on
_AGENT_STOPPING_EVERY_S = 0.1  # how often a finished worker looks for that mark


def launch(cfg: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """Start parallelism.nproc_per_node workers running `train(cfg, run_dir)`; return rank 0's summary."""
    p = cfg.parallelism
    device = resolve_device(cfg.trainer.device, 0)
    nproc = resolve_nproc(p, device)
    _preflight(cfg, device, nproc, nproc, "trainflow")
    results_begin()  # what the workers do is theirs to say: a failure from here on keeps the run directory
    if note := cpu_group_note(p, device):
        log.info(note)
    log.info("starting %d %s workers on %s (%s)", nproc, p.strategy, device.type, resolve_backend(p, device))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the failure explained below says it all
    with tempfile.TemporaryDirectory(prefix="trainflow-elastic-") as logs, _workers_watched(Path(logs)) as pids:
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
            with _repeated_stops_quiet(SignalException):
                elastic_launch(config, _worker)(cfg, str(run_dir), str(pids))
        except ChildFailedError as exc:
            raise explain_worker_failure(exc, Path(logs), hang_report(run_dir, started)) from None
        except SignalException as exc:
            stop = exc.sigval
        finally:
            # The agent's handlers stay installed and raise in this process: a Ctrl-C pressed again while it
            # exits would print their traceback. After a stop the workers are gone: ignore a repeated signal.
            for name, handler in handlers.items():
                signal.signal(getattr(signal, name), signal.SIG_IGN if stop else handler)
    resumable = stop is not None and cfg.checkpoint.enabled and stop.name in cfg.checkpoint.stop_signals
    return _rank0_summary(run_dir / "summary.json", started, stop, resumable)


@contextlib.contextmanager
def _repeated_stops_quiet(signal_exception: type[BaseException]) -> Iterator[None]:
    """The agent's signal handlers raise in this process; a stop signal repeated while the agent shuts down can
    land in a finalizer (its rendezvous keep-alive timer's), which cannot raise: Python prints "Exception ignored
    in" and a traceback. The stop is under way and said in one line: say nothing of the repeat."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, signal_exception):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def _workers_watched(logs: Path) -> Iterator[Path]:
    """While the agent runs, watch over its workers from a thread; yields the folder where each worker leaves its
    pid. The thread does two things the agent does not:

    - It SIGKILLs a worker that is stopped (SIGSTOP: a frozen rank) once a SIGTERM waits for it. A stopped process
      acts on no signal but SIGKILL: the agent's SIGTERM that ends the run stays pending, and after a failure the
      agent waits a fixed 30 s for it (LaunchConfig.shutdown_timeout is not used there) before its own SIGKILL. The
      run's outcome is already decided by then: the agent read its workers' exits before it asked the others to end.
    - When a signal the agent passes on reaches this process, it leaves a mark the workers read (_AGENT_STOPPING):
      the agent is stopping and will not read their return values, so a worker that finished may leave at once.
    """
    pids, done = logs / "workers", threading.Event()
    pids.mkdir()
    read_signals, write_signals = os.pipe()
    os.set_blocking(write_signals, False)
    try:  # the signals this process gets are written here too, whoever handles them (only the main thread may ask)
        previous = signal.set_wakeup_fd(write_signals, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    thread = threading.Thread(target=_watch, args=(pids, read_signals, done), name="trainflow-workers-watch",
                              daemon=True)
    thread.start()
    try:
        yield pids
    finally:
        done.set()
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes it too
            os.write(write_signals, b"\0")  # wakes the thread at once (0 is no signal)
        thread.join()
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_signals)
        os.close(write_signals)


def _watch(pids: Path, signals: int, done: threading.Event) -> None:
    passed_on = {int(getattr(signal, name)) for name in _PASSED_ON}
    while not done.is_set():
        if select.select([signals], [], [], _STOPPED_EVERY_S)[0] and passed_on & set(os.read(signals, 64)):
            (pids.parent / _AGENT_STOPPING).touch()
        for worker in pids.iterdir():
            if _stopped_with_sigterm_pending(int(worker.name)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(worker.name), signal.SIGKILL)


def _stopped_with_sigterm_pending(pid: int) -> bool:
    """From Linux's /proc: `pid` is still a child of this process (not another process that took an ended worker's
    pid), it is stopped (not traced) and a SIGTERM waits for it. Never without /proc."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):  # gone already, or no /proc
        return False
    pending = int(status.get("ShdPnd", "0"), 16) | int(status.get("SigPnd", "0"), 16)
    return (int(status.get("PPid", "0")) == os.getpid() and status.get("State", "").strip().startswith("T")
            and bool(pending & 1 << (signal.SIGTERM - 1)))


class StoppedBySignal(TrainflowError):
    """The launcher was signalled and the workers stopped before rank 0 wrote its summary."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _rank0_summary(path: Path, started: float, stop: signal.Signals | None = None,
                   resumable: bool = False) -> dict[str, Any]:
    """Rank 0's summary, read from the file it wrote (also after a stop signal the agent passed on: the
    checkpoint stage then saves at the next step boundary and ends the run normally, and says so in it).

    Without one, a stop signal ended the workers at once (before their first step, or a second signal): with
    checkpointing on the committed checkpoints resume the run (exit 75, as one process says), else the exit code
    is the one a shell reports for a process the signal ended."""
    if path.exists() and path.stat().st_mtime >= started:
        if stop:
            log.warning("%s: the workers stopped; rank 0 finished its summary", stop.name)
        return json.loads(path.read_text())
    if stop and resumable:
        raise StoppedBySignal(f"stopped by {stop.name} before the workers saved (before their first step, or on a "
                              "second signal): nothing new was saved, committed checkpoints are untouched; run the "
                              f"same command to resume (exit code {EXIT_STOPPED})", EXIT_STOPPED)
    if stop:
        raise StoppedBySignal(f"stopped by {stop.name} before the workers finished (no summary.json was written)",
                              128 + int(stop))
    raise WorkerError(f"the workers finished, but rank 0 wrote no {path}")


def _interrupt_once(_signum: int, _frame: Any) -> None:
    """Stop this worker at the first SIGINT and ignore the next ones: the terminal's Ctrl-C reaches it, and the
    agent then passes the same signal on. A second KeyboardInterrupt could land after the first was handled,
    where nothing catches it, and print a traceback of the multiprocessing child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker(cfg: RunConfig, run_dir: str, pids: str) -> None:
    """One self-launched rank: the parent's typed config and run directory, no Hydra."""
    Path(pids, str(os.getpid())).touch()  # for _workers_watched
    user_folder_importable()  # a spawned worker (CUDA) imports your code from the launching command's folder too
    signal.set_wakeup_fd(-1)  # a forked worker's own signals are not the agent's (see _workers_watched)
    mark_self_launched()
    # A forked worker inherits the agent's handlers (they raise in Python, which a rank blocked in a collective
    # never reaches): a signal must act on it as on any process, and a stop signal as on any rank.
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt_once)
    catch_stop_signals(cfg.checkpoint.stop_signals, cfg.checkpoint.enabled, speak=False)  # the launcher speaks
    try:
        rank = env_rank()
        _configure_worker_logging(Path(run_dir), rank)
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores, as torchrun does
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        train(cfg, Path(run_dir))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        # Exit rather than raise: the agent's own wrapper would overwrite the record with one that lacks
        # whether this was a user error and when exactly it happened (which rank failed first).
        record_failure(exc)
        raise SystemExit(1) from None
    _leave_once_the_agent_stops(Path(pids).parent / _AGENT_STOPPING)
    return None


def _leave_once_the_agent_stops(mark: Path) -> None:
    """Exit this finished worker when the agent will not read its return value: it is stopping on a signal (it
    then waits for the workers to exit, 30 s by default), or it is gone. Otherwise the worker waits for the
    agent's word in torch's wrapper, as it must: one that leaves while it waits hangs the agent forever (the
    multiprocessing event it sets waits for every waiter to wake), however late the agent reads the run."""
    agent = os.getppid()

    def watch() -> None:
        while not mark.exists() and os.getppid() == agent:
            time.sleep(_AGENT_STOPPING_EVERY_S)
        os._exit(0)

    threading.Thread(target=watch, name="trainflow-leave-on-stop", daemon=True).start()


def _configure_worker_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs like a Hydra job of train.yaml (console + train.log, what is for train.log only kept off the
    console: trainer.print_config); the others print warnings and errors only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.addFilter(FileOnly())
        handlers: list[logging.Handler] = [console, RunLogHandler(run_dir / "train.log")]
        fmt, level = _LOG_FORMAT, logging.INFO
    else:
        handlers, fmt, level = [logging.StreamHandler(sys.stderr)], f"[rank {rank}]{_LOG_FORMAT}", logging.WARNING
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
    root.setLevel(level)
