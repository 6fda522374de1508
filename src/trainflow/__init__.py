"""trainflow: Hydra-configured PyTorch training, each stage measured.

Importing trainflow does nothing else: the entry points register the config schemas and resolvers Hydra needs
(`trainflow.cli.register_with_hydra`), and the heavy parts (torch, the training loop) load only when a run starts.
"""

from importlib.metadata import version

__version__ = version("trainflow")
