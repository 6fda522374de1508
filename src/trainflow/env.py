"""What the launcher told this process through its environment (torchrun, SLURM tasks and trainflow's own
launch all export RANK)."""

import os


def env_rank() -> int:
    """This process's global rank; 0 when no launcher started it (one process, or the process that launches)."""
    return int(os.environ.get("RANK", "0"))
