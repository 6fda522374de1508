"""Every run's fingerprint: what decides its speed and its numbers, so that two runs compare with the reasons they
differ (summary.json["fingerprint"], and each ledger line).

It holds the versions (trainflow, torch, CUDA, the driver, Python), the device's name and count, the host, the
project's git commit (and whether the checkout was dirty) when the run starts inside one, a hash of the resolved
config (less the keys that only say where outputs go) and of the model's tensor shapes (the checkpoints' model
fingerprint), the machine's load during the steady state, the steady log intervals' step-time band
(trainflow.metrics.noise), and what a replay needs: the interpreter, the trainflow command of this job with its
overrides, the working directory and the environment variables that change the code or the arithmetic (information:
bisect takes only the thread counts from it).

The machine's load is measured, not guessed: the CPU time the whole machine spent busy during the steady state
(/proc/stat, steal included: a noisy neighbour counts), less this run's own (this process's, times the ranks of this
node, which do the same work), over the wall time: the cores that other processes kept busy while the run was timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

import trainflow
from trainflow.checkpoint.state import fingerprint as model_fingerprint
from trainflow.checkpoint.state import model_shapes
from trainflow.config.schema import RunConfig, plain
from trainflow.distributed.mesh import ranks_per_node
from trainflow.distributed.process_group import DistEnv, node_count
from trainflow.loop.stages import Phase, Stage, StageContext
from trainflow.loop.state import LoopState
from trainflow.metrics.noise import Band, read_metrics, steady_intervals
from trainflow.util.device import cpu_name

# Keys that say where outputs go or how they are shown (and priced): runs that differ only in them ran the same config.
NOT_IN_CONFIG_HASH = ("logger", "trainer.run_name", "trainer.sweep_name", "trainer.progress", "trainer.print_config",
                      "checkpoint.dir", "checkpoint.resume", "metrics.ledger", "trainer.cost_per_hour")
# The environment recorded as the run had it: where the code came from and how the arithmetic was threaded.
REPLAY_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG")
BUSY_SHARE = 0.25  # other processes kept at least this share of the cores busy: the run was timed on a busy machine
MIN_LOAD_S = 1.0  # a steady state shorter than this is too short to measure the load over: the whole loop is used
GIT_TIMEOUT_S = 10.0
CpuSample = tuple[float, float | None, float]  # (a monotonic clock, the machine's busy CPU s, this process's CPU s)


class Fingerprint(Stage):
    """Records the fingerprint: the code and environment when the run starts (rank 0), the machine's load from the
    start of the steady state to the end of the loop, the model's shape hash, and the step-time band at the end."""

    phase = Phase.OBSERVE  # it only reads: the step as it was
    # entered after the profiler and left before it: the machine's load is the loop's, not the profiler's start-up
    # and trace export
    after = ("profiler",)
    summary_key = "fingerprint"

    def __init__(self, cfg: RunConfig, env: DistEnv, run_dir: Path) -> None:
        self.cfg, self.env, self.run_dir = cfg, env, run_dir
        self.code = code_state(Path.cwd()) if env.is_main else None  # when the code was imported, not at the end
        self.replay = replay_command(run_dir) if env.is_main else None
        self.start_step = 0
        self._excluded_steps = 0  # the run's, as the meter leaves them out (read at start)
        self.model_hash: str | None = None
        self._begin: CpuSample | None = None
        self._steady: CpuSample | None = None
        self._end: CpuSample | None = None

    @classmethod
    def build(cls, ctx: StageContext) -> Fingerprint:
        return cls(ctx.cfg, ctx.env, ctx.run_dir)

    def start(self, state: LoopState) -> None:
        self.start_step = state.step
        self._excluded_steps = state.meter.excluded_steps
        self.model_hash = model_fingerprint(model_shapes(state.model))  # as a checkpoint's manifest names it

    def __enter__(self) -> Fingerprint:
        self._begin = self._steady = cpu_sample()  # the steady one is replaced after excluded steps
        return self

    def after_step(self, state: LoopState) -> bool:
        if state.steps_this_run == self._excluded_steps:  # the meter's steady state begins after this step
            self._steady = cpu_sample()
        return False

    def __exit__(self, *exc: object) -> None:
        self._end = cpu_sample()

    def _measured_from(self) -> CpuSample | None:
        """The steady state's first sample, or the loop's when the steady state is too short to measure."""
        if self._steady is not None and self._end is not None and self._end[0] - self._steady[0] >= MIN_LOAD_S:
            return self._steady
        return self._begin

    def summary(self, steady: dict[str, Any] | None) -> dict[str, Any] | None:
        if not self.env.is_main:
            return None
        excluded = steady["excluded_steps"] if steady else self._excluded_steps
        intervals = steady_intervals(read_metrics(self.run_dir / "metrics.jsonl"), self.start_step, excluded)
        times = intervals["step_time_s"]
        return {
            **environment(self.env.device, self.env.world_size),
            "code": self.code,
            "config_hash": config_hash(plain(self.cfg)),
            "model_hash": self.model_hash,
            "load": machine_load(self._measured_from(), self._end, ranks_per_node(self.env.world_size)),
            "step_time": Band.of(times).as_dict() if times else None,
            "replay": self.replay,
        }


def environment(device: torch.device, world_size: int) -> dict[str, Any]:
    """Versions, device and host."""
    cuda = device.type == "cuda"
    return {
        "trainflow": trainflow.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "driver": driver_version() if cuda else None,
        "python": platform.python_version(),
        "device": {"type": device.type, "name": device_name(device), "count": world_size,
                   "nodes": node_count(world_size)},
        "host": socket.gethostname(),
        "cpu_cores": os.cpu_count(),
    }


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def driver_version() -> str | None:
    """The NVIDIA driver's version: NVML where pynvml is installed, else nvidia-smi; None when neither answers."""
    try:
        import pynvml  # lazy: pynvml is the energy extra

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 (not installed, no driver, an old NVML: the version is unknown, not an error)
        pass
    out = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], Path.cwd())
    return out.splitlines()[0].strip() if out else None


def code_state(folder: Path) -> dict[str, Any]:
    """The git commit of the checkout `folder` lies in, whether it had changes (tracked files only) and a hash of
    them (two runs of the same commit with the same changes ran the same code); None values with the reason when
    it is not a checkout. trainflow's own checkout too, when it is another one (an editable install beside the
    user's project)."""
    project = git_state(folder)
    package = Path(trainflow.__file__).resolve().parent
    own = git_state(package)
    if own.get("root") is not None and own.get("root") != project.get("root"):
        project["trainflow"] = own
    return project


def git_state(folder: Path) -> dict[str, Any]:
    """One checkout's root, commit, whether tracked files changed, and a hash of the changes."""
    root = _output(["git", "rev-parse", "--show-toplevel"], folder)
    if root is None:
        return {"root": None, "commit": None, "dirty": None, "absent": f"{folder} is not inside a git checkout"}
    commit = _output(["git", "rev-parse", "HEAD"], folder)
    status = _output(["git", "status", "--porcelain", "--untracked-files=no"], folder)
    dirty = None if status is None else bool(status.strip())
    diff = _output(["git", "diff", "HEAD"], folder) if dirty else None
    return {"root": root.strip(), "commit": commit.strip() if commit else None, "dirty": dirty,
            "diff": hashlib.sha256(diff.encode()).hexdigest()[:12] if diff else None}


def _output(cmd: list[str], cwd: Path) -> str | None:
    """A command's stdout, or None when it is missing, fails or takes longer than GIT_TIMEOUT_S."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def config_hash(config: dict[str, Any]) -> str:
    """A short hash of the resolved config, less NOT_IN_CONFIG_HASH: equal for the same command run again."""
    return hashlib.sha256(json.dumps(hashed_config(config), sort_keys=True, default=str).encode()).hexdigest()[:12]


def hashed_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config without the keys of NOT_IN_CONFIG_HASH."""
    out = json.loads(json.dumps(config, default=str))
    for key in NOT_IN_CONFIG_HASH:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def replay_command(run_dir: Path) -> dict[str, Any] | None:
    """How to run this job again as it ran: the interpreter, `-m trainflow train` with the job's config folders and
    overrides (as Hydra saved them in <run dir>/.hydra, so a sweep's job replays alone), the working directory and
    the environment of REPLAY_ENV; beside them the command line this process was given (a sweep's, a launcher's).
    The code's commit is the fingerprint's `code`. None when Hydra saved nothing (the run did not start through
    train.py or trainflow train). A record to read, never to execute: a run folder may come from someone else, and
    `compare --bisect` rebuilds its replay from the run's overrides instead (trainflow.report.bisect)."""
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if not hydra_file.is_file():
        return None
    hydra = OmegaConf.load(hydra_file).hydra
    config_dirs = [s.path for s in hydra.runtime.config_sources if s.provider == "command-line"]
    typed = OmegaConf.to_container(hydra.overrides, resolve=False)  # as typed: `${model.vocab_size}` too
    searchpath = [o for o in typed["hydra"] if str(o).startswith("hydra.searchpath=")]
    args = ["-m", "trainflow", "train", *(a for d in config_dirs for a in ("--config-dir", str(d))),
            *map(str, typed["task"]), *map(str, searchpath)]
    return {"python": sys.executable, "args": args, "cwd": os.getcwd(),
            "env": {k: os.environ.get(k) for k in REPLAY_ENV}, "argv": list(sys.orig_argv)}


def cpu_sample() -> CpuSample:
    """(a monotonic clock, the seconds every core of the machine spent busy since boot (None: no /proc/stat), this
    process's CPU seconds and its finished children's)."""
    own = os.times()
    return time.monotonic(), machine_busy_s(), own.user + own.system + own.children_user + own.children_system


def machine_busy_s() -> float | None:
    """The seconds the machine's cores spent busy since boot (steal included: a neighbour's), None without
    /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_load(start: CpuSample | None, end: CpuSample | None, local_ranks: int) -> dict[str, Any]:
    """The cores other processes kept busy between two samples (see the module's docstring), the load average at
    the end, and whether that makes the machine busy (BUSY_SHARE of its cores)."""
    cores = os.cpu_count() or 1
    load = {"load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "cpu_cores": cores,
            "other_cores": None, "busy": None}
    if start is None or end is None or start[1] is None or end[1] is None or end[0] <= start[0]:
        load["absent"] = "no /proc/stat here: the other processes' CPU time is unknown"
        return load
    wall = end[0] - start[0]
    others = max(0.0, (end[1] - start[1]) - (end[2] - start[2]) * local_ranks) / wall
    load.update(other_cores=round(others, 3), busy=others >= BUSY_SHARE * cores, seconds=round(wall, 3))
    return load
