"""One run directory for all ranks, however they were started.

Hydra names the run directory in every process it runs in. Under torchrun each
rank is such a process, and `${now:}` differs between them by a few
milliseconds: the well-known "one directory per rank" bug. Here the name is
agreed through torchrun's own key-value store (the first rank to ask sets it,
the others read it), so all ranks, nodes and restarts of a job share one
directory. Only rank 0 writes Hydra's saved config and the log file.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

RUN_DIR_ENV = "TRAINFLOW_RUN_DIR"  # set by our launchers for the processes they start


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _timestamp() -> str:
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def _agreed_under_torchrun() -> str:
    """The name rank 0's clock gives, shared through the elastic agent's store."""
    from torch.distributed import TCPStore

    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    mine = _timestamp()
    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30),
        )
        key = f"trainflow/run_name/{run_id}"
        if env_rank() == 0:
            store.compare_set(key, "", mine)
        agreed = store.get(key).decode()  # blocks until rank 0 has set it
    except Exception:  # no reachable store: fall back to a name every rank can derive
        agreed = datetime.now().strftime("%Y-%m-%d/%H-%M") + f"-torchrun-{run_id}"
    return agreed


def run_dir() -> str:
    """Hydra's run directory: ours when a trainflow launcher chose it, else outputs/<date>/<time>."""
    if os.environ.get(RUN_DIR_ENV):
        return os.environ[RUN_DIR_ENV]
    if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ:
        return f"outputs/{_agreed_under_torchrun()}"
    return f"outputs/{_timestamp()}"


def log_file(output_dir: str) -> str:
    return os.path.join(output_dir, "train.log") if env_rank() == 0 else os.devnull


def hydra_subdir() -> str | None:
    return ".hydra" if env_rank() == 0 else None


def register_resolvers() -> None:
    for name, fn in (
        ("trainflow_run_dir", run_dir),
        ("trainflow_log_file", log_file),
        ("trainflow_hydra_subdir", hydra_subdir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)


class OutputDirCheck(Callback):
    """Makes the run (or sweep) directory before Hydra does, so an unwritable one is one line, not a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable("hydra.run.dir", str(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable("hydra.sweep.dir", str(config.hydra.sweep.dir))


def _check_writable(key: str, folder: str) -> None:
    from trainflow.cli import user_error

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        user_error(f"{key}: cannot create {folder} ({exc.strerror}); point {key} at a writable folder")
