"""trainflow's config groups, shipped inside the package so that any folder can train: Hydra finds them at
CONFIG_PATH; a project adds its own groups and experiments with `--config-dir` or `hydra.searchpath`."""

from pathlib import Path

CONFIG_PATH = "pkg://trainflow.conf"  # for @hydra.main and Hydra's search path
CONFIG_DIR = Path(__file__).parent  # the same folder on disk, for Hydra's compose API and tools that read an option
