"""trainflow: Hydra-configured PyTorch training, each stage measured.

Importing trainflow does nothing else: the entry points register the config schemas and resolvers Hydra needs
(`trainflow.cli.register_with_hydra`), and the heavy parts (torch, the training loop) load only when a run starts.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainflow")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed: benchmarks/gpu_ladder.sh on a bare GPU host
    __version__ = "0.1.0+checkout"

