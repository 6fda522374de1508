"""The device mesh of a run: integer degrees (pp x replicate x shard x tp) on one named mesh, and what it does.

Every layout trainflow trains is four degrees whose product is the world size:
- pp: pipeline stages, the mesh's first (outermost) dimension: a stage sends one micro-batch's activations to the
  next, the least traffic of any dimension, so its groups may span nodes (trainflow.distributed.pipeline);
- replicate: copies of the model that all-reduce gradients (DDP; HSDP across nodes);
- shard: ranks one copy is sharded over by FSDP2 (FSDP; HSDP within a node);
- tp: ranks one layer is split over by tensor parallelism, the mesh's last dimension, so that a TP group is
  consecutive ranks (one node: TP's collectives run per layer, on the fast links).
`parallelism.strategy` names the data-parallel kind (the presets single / ddp / fsdp / hsdp: the names the
summary and the reports show), `parallelism.dp_replicate` / `dp_shard` / `tp` / `pp` set degrees (-1: the rest of the
world; null: the strategy's rule). `layout()` answers "what does this mesh do" for validation, the process
group, the memory plan, the parity check and the summary: this module is the one that knows the names.

HSDP (as torchtitan and other large-scale trainers do) shards within a node, where the links are fast, and
keeps one copy of the sharded model per node: only the gradient all-reduce between the copies crosses nodes,
once per step. Defaults: shard = the data-parallel ranks of one node, replicate = the rest (the nodes).
A new dimension (context parallel) is one entry in DIMS, one degree in `layout()` and its apply function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import init_device_mesh

from trainflow.config.choices import Strategy
from trainflow.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "replicate", "shard", "tp")  # the named mesh, outermost first
STRATEGIES = tuple(s for s in Strategy if s is not Strategy.auto)  # the presets; `auto` chooses one of them
SHARDED = (Strategy.fsdp, Strategy.hsdp)  # the strategies that shard with FSDP2 (over one mesh dimension, or two)
GROUP_STRATEGIES = (Strategy.ddp, *SHARDED)  # the strategies that need a process group of 2 or more ranks
MESH_DIMS = ("replicate", "shard")  # the data-parallel dimensions FSDP2 shards over


CPU_GROUP_RANKS = 2  # nproc_per_node=auto without GPUs: the smallest group that really runs data parallel


def local_ranks(strategy: str, nproc_per_node: Any, gpus: int) -> int:
    """The processes per node that parallelism.nproc_per_node asks for, with `gpus` GPUs on the node.


    auto is one process per GPU. Without GPUs, the strategies that need a group get 2 CPU ranks on gloo, so that
    a command such as `python train.py parallelism=fsdp` works unchanged on any machine; single and auto get one.
    Every launcher (trainflow's own, torchrun's, SLURM's) follows this one rule.
    """
    if nproc_per_node != "auto":
        return int(nproc_per_node)
    if gpus > 0:
        return gpus
    return CPU_GROUP_RANKS if strategy in GROUP_STRATEGIES else 1


@dataclass(frozen=True)
class MeshLayout:
    """What a run's mesh does: its strategy (the preset's name) and the size of each dimension."""

    strategy: str
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def sharded(self) -> bool:
        """FSDP2 shards parameters, gradients and optimizer state (fsdp, hsdp)."""
        return self.strategy in SHARDED

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches (a TP group reads one batch together)."""
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp * self.pp

    @property
    def name(self) -> str:
        """fsdp, fsdp x tp 2, fsdp x pp 2, fsdp x tp 2 x pp 2; a model parallel degree alone (tp 2, pp 2, tp 2 x pp 2)
        when one copy of the model spans the world."""
        split = [f"{dim} {size}" for dim, size in (("tp", self.tp), ("pp", self.pp)) if size > 1]
        if split and self.dp_size == 1:
            return " x ".join(split)
        return " x ".join([self.strategy, *split])

    def summary(self) -> dict[str, int] | None:
        """The mesh for summary.json: the data-parallel dimensions of a sharded run, and tp and pp when they split
        the model."""
        out = dict(zip(MESH_DIMS, (self.replicate, self.shard), strict=True)) if self.sharded else {}
        for dim, size in (("tp", self.tp), ("pp", self.pp)):
            if size > 1:
                out = {**(out or {"replicate": self.replicate}), dim: size}
        return out or None


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def mesh_shape(world_size: int, ranks_per_node: int, shard_size: int | None,
               replicate_size: int | None) -> tuple[int, int]:
    """(replicate, shard) of an HSDP run, from what was set and the launcher's ranks per node; one line if wrong."""
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


def layout(cfg: Any, world_size: int, per_node: int | None = None) -> MeshLayout:
    """The degrees `parallelism` asks for on this world size; one line naming the keys if they cannot fit it."""
    per_node = ranks_per_node(world_size) if per_node is None else per_node
    strategy, pp = cfg.strategy, cfg.pp
    if world_size % pp:
        raise ConfigError(f"parallelism.pp: {pp} does not divide the world size {world_size}; use one of "
                          f"{_divisors(world_size)}, or parallelism.nproc_per_node a multiple of {pp}")
    world_size //= pp  # one pipeline stage's ranks: the data-parallel and tensor-parallel degrees split them
    tp = cfg.tp
    if tp == -1:  # the rest of the world after the data-parallel degrees that are set
        tp = world_size // max(1, *(d for d in (cfg.dp_replicate, cfg.dp_shard) if d and d > 0))
    if tp > 1 and tp > per_node:
        raise ConfigError(f"parallelism.tp: {tp} is larger than the {per_node} ranks of one node, and tensor "
                          "parallelism gathers activations every layer over its group; set parallelism.tp to "
                          f"{per_node} or less (parallelism.dp_shard / dp_replicate for the rest)")
    if world_size % tp:
        raise ConfigError(f"parallelism.tp: {tp} does not divide the world size {world_size}; use one of "
                          f"{_divisors(world_size)}")
    dp = world_size // tp
    if strategy == Strategy.hsdp and cfg.dp_replicate is None and cfg.dp_shard is None:
        replicate, shard = mesh_shape(dp, max(per_node // tp, 1), cfg.hsdp.shard_size, cfg.hsdp.replicate_size)
    else:
        default = {"fsdp": (1, -1), "hsdp": (-1, -1)}.get(strategy, (-1, 1))
        replicate = default[0] if cfg.dp_replicate is None else cfg.dp_replicate
        shard = default[1] if cfg.dp_shard is None else cfg.dp_shard
        if replicate == -1 and shard == -1:  # hsdp's rule: shard within a node, replicate across
            shard = min(max(per_node // tp, 1), dp)
        if replicate == -1:
            replicate = dp // shard if shard > 0 and dp % shard == 0 else 0
        if shard == -1:
            shard = dp // replicate if replicate > 0 and dp % replicate == 0 else 0
    result = MeshLayout(strategy, replicate, shard, tp, pp)
    if strategy in STRATEGIES and result.world_size != world_size * pp:
        stages = f" x pp {pp}" if pp > 1 else ""
        raise ConfigError(f"parallelism.dp_replicate x dp_shard x tp: {cfg.dp_replicate} x {cfg.dp_shard} x {tp}"
                          f"{stages} does not make the world size {world_size * pp} (-1: the rest of the world); set "
                          f"degrees whose product is {world_size * pp}")
    return result


def hsdp_shape(cfg: Any, world_size: int) -> tuple[int, int]:
    """The (replicate, shard) shape `parallelism` asks for on this world size."""
    found = layout(cfg, world_size)
    return found.replicate, found.shard


def build_mesh(device_type: str, world_size: int, shape: tuple[int, int] | None = None, tp: int = 1,
               pp: int = 1) -> DeviceMesh:
    """The run's named mesh. Without TP and PP its data-parallel dimensions only: FSDP (no shape) one "shard"
    dimension, HSDP the (replicate, shard) `shape`; with TP or PP all four (pp x replicate x shard x tp)."""
    if tp == 1 and pp == 1:
        if shape is None:
            return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    replicate, shard = shape or (1, world_size // tp // pp)
    if pp == 1:
        return init_device_mesh(device_type, (replicate, shard, tp), mesh_dim_names=DIMS[1:])
    return init_device_mesh(device_type, (pp, replicate, shard, tp), mesh_dim_names=DIMS)


def mesh_for(found: MeshLayout, device_type: str) -> DeviceMesh:
    """The mesh of `found`, as build_mesh makes it."""
    both = found.strategy == Strategy.hsdp or ((found.tp > 1 or found.pp > 1) and found.strategy == Strategy.ddp)
    return build_mesh(device_type, found.world_size, (found.replicate, found.shard) if both else None, found.tp,
                      found.pp)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The part of the run's mesh FSDP2 shards over: all of it without TP and PP, else the mesh less its tp and pp
    dimensions ("shard" alone for FSDP, replicate x shard for HSDP and for DDP under TP or PP)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names and "pp" not in names:
        return mesh
    return mesh["shard"] if mesh.shape[names.index("replicate")] == 1 else mesh[MESH_DIMS]
