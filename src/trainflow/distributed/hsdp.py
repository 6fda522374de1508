"""The device mesh of a sharded run: FSDP shards over every rank, HSDP over a 2-D (replicate x shard) mesh.

Past a few nodes one flat shard group over every rank makes each all-gather and reduce-scatter cross the slow
links between nodes for every layer. HSDP (as torchtitan and other large-scale trainers do) shards within a
node, where the links are fast, and keeps one copy of the sharded model per node: only the gradient all-reduce
between the copies crosses nodes, once per step. `fully_shard` over a 2-D mesh does exactly that.

Defaults: `shard_size` = the ranks of one node (LOCAL_WORLD_SIZE), `replicate_size` = world size / shard_size
(the nodes). Either may be set; their product must be the world size.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainflow.config import ParallelismConfig
from trainflow.errors import ConfigError

MESH_DIMS = ("replicate", "shard")


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def mesh_shape(world_size: int, ranks_per_node: int, shard_size: int | None,
               replicate_size: int | None) -> tuple[int, int]:
    """(replicate, shard) of an HSDP run, from what was set and the launcher's ranks per node; one line if wrong
    (one rank is refused before, with ddp and fsdp: process_group.check_world_size)."""
    if shard_size is None:
        shard_size = world_size // replicate_size if replicate_size else min(ranks_per_node, world_size)
    if world_size % shard_size:
        raise ConfigError(f"parallelism.hsdp.shard_size: {shard_size} does not divide the world size {world_size}; "
                          f"use one of {_divisors(world_size)}")
    if replicate_size is None:
        replicate_size = world_size // shard_size
    if replicate_size * shard_size != world_size:
        raise ConfigError(f"parallelism.hsdp.replicate_size: {replicate_size} x shard_size {shard_size} = "
                          f"{replicate_size * shard_size} ranks, but the world has {world_size}; set "
                          f"parallelism.hsdp.replicate_size={world_size // shard_size} (or null)")
    return replicate_size, shard_size


def ranks_per_node(world_size: int) -> int:
    """Ranks of this node, as the launcher says (torchrun, SLURM tasks and trainflow's own launch set it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)


def hsdp_shape(cfg: ParallelismConfig | DictConfig, world_size: int) -> tuple[int, int]:
    """The (replicate, shard) shape `parallelism` asks for on this world size."""
    return mesh_shape(world_size, ranks_per_node(world_size), cfg.hsdp.shard_size, cfg.hsdp.replicate_size)


def build_mesh(device_type: str, world_size: int, shape: tuple[int, int] | None = None) -> DeviceMesh:
    """FSDP (no shape): one dimension over every rank. HSDP: the (replicate, shard) `shape`."""
    if shape is None:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
