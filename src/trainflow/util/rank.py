"""This process's rank, as the launcher that started it exported it: read by the run directory, the launch and the
commands before any process group exists."""

import os


def env_rank() -> int:
    """This process's global rank, as its launcher exported it (torchrun, SLURM tasks and trainflow's own launch all
    set RANK); 0 when no launcher started it (one process, or the process that launches)."""
    return int(os.environ.get("RANK", "0"))
