"""trainflow: Hydra-configured PyTorch training, each stage measured.

Importing the package registers the config schemas and resolvers Hydra needs;
the heavy parts (torch, the training loop) load only when a run starts.
"""

from trainflow.config import register_configs
from trainflow.ladder import register_resolvers as register_ladder_resolvers
from trainflow.rundir import register_resolvers

__version__ = "0.1.0"

register_configs()
register_resolvers()
register_ladder_resolvers()
