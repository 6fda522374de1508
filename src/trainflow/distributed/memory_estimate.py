"""The per-rank memory of one layout (strategy, shard size, TP degree, activation checkpointing), in bytes,
before training: what parallelism=auto decides with (trainflow.distributed.memory_plan) and what
benchmarks/scale_plan.py checks against a simulation.

Items, per rank, in bytes:
Items, per rank, in bytes:
- params, grads, optimizer: exact. The optimizer takes one step on a meta-device copy of the model (no memory,
  no arithmetic) to show its state; FSDP2 shards every tensor along dim 0 in chunks of ceil(dim0 / shard size),
  and the largest chunk (rank 0's) is what a rank must hold.
- buckets (DDP): the gradient buckets are a second copy of the gradients (unless gradient_as_bucket_view).
- all_gather (FSDP/HSDP): the root's parameters (kept gathered from forward into backward), the largest shard
  unit gathered twice (the one running and the one prefetched) and its unsharded gradient before the
  reduce-scatter.
- activations: measured, not modelled: the bytes autograd saves for backward in one forward of one micro-batch
  (saved-tensor hooks; parameters excluded), attributed to the blocks they were saved in. With activation
  checkpointing a block keeps only its input, and one block's activations live again during its backward.
- selective activation checkpointing: each block keeps its input and the outputs of the ops selective
  checkpointing saves (matmuls, attention: measured in the same forward), and one block's other activations live
  again during its backward.
- pipeline parallel (pp > 1): the larger of the first and the last stage's parameters (their blocks, and the
  first stage the parameters of the children before `blocks`, the last those after it: a tied embedding on both),
  sharded over the data-parallel ranks; its blocks' activations (and everything outside the blocks) for
  min(micro-batches, pp) pipeline micro-batches in flight (1F1B's warm-up on the first stage), each of
  1 / micro-batches of the rank's micro-batch.
- tensor parallel (tp > 1, by the model's TP plan; trainflow.distributed.tensor): each parameter's split
  dimension is divided by tp (rows of rank 0's chunk: ceil), then FSDP2 shards that local tensor along dim 0 over
  the data-parallel shard ranks. Activations are modelled from the measured ones: under sequence parallel a
  block keeps 1/tp of what it saved, except the inputs of its column-wise layers (all-gathered whole on every
  TP rank; measured); outside the blocks nothing is divided (an over-estimate where the model's logits stay
  split by vocabulary for the loss, as trainflow's GPT's do: loss parallel).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainflow.config.choices import Strategy
from trainflow.config.schema import FSDPConfig, OptimSection
from trainflow.distributed.mesh import SHARDED
from trainflow.distributed.parallelism import saved_ops, shard_units
from trainflow.distributed.tensor import gathered_inputs, shard_dims, tp_plan
from trainflow.errors import ConfigError
from trainflow.metrics.activations import Saved, saved_for_backward
from trainflow.models import model_blocks
from trainflow.optim import build_optimizer

GB = 1024**3
ITEMS = ("params", "grads", "optimizer", "buckets", "all_gather", "activations")


@dataclass
class Layout:
    """One candidate: a strategy, how many ranks shard one copy of the model, activation checkpointing."""

    strategy: Strategy  # one of trainflow.distributed.mesh.STRATEGIES
    shard_size: int
    checkpointing: bool = False
    tp: int = 1  # ranks each layer is split over
    batch: int | None = None  # per-rank micro-batch; None: the one the activations were measured with
    selective: bool = False  # with checkpointing: selective (the matmul and attention outputs kept), not full
    pp: int = 1  # pipeline stages
    microbatches: int = 1  # pipeline micro-batches per micro-batch (pp > 1)

    @property
    def tp_alone(self) -> bool:
        """One copy of the model spans the world (FSDP over one rank): TP and PP without any data-parallel
        wrapper."""
        return (self.tp > 1 or self.pp > 1) and (self.strategy, self.shard_size) == (Strategy.fsdp, 1)

    @property
    def name(self) -> str:
        split = [f"{dim} {size}" for dim, size in (("tp", self.tp), ("pp", self.pp)) if size > 1]
        base = " x ".join(split if self.tp_alone else [self.strategy, *split])  # as MeshLayout names it
        if not self.checkpointing:
            return base
        return base + (" + selective activation checkpointing" if self.selective else " + activation checkpointing")


@dataclass
class ModelFacts:
    """What the estimate needs from the model: per-parameter sizes, shard units, measured activations."""

    params: list[tuple[torch.Size, int, int]]  # (shape, element size, optimizer state bytes when unsharded)
    optimizer_scalar_bytes: int  # per-parameter scalars (AdamW's step): never sharded
    units: list[list[int]]  # each shard unit's parameters (indices into params)
    root: list[int]  # parameters outside every unit (kept gathered by the root)
    saved: Saved  # one micro-batch's activations: outside the blocks, per block, the blocks' inputs
    example_batch: int = 1  # the micro-batch they were measured on
    gathered: list[int] = field(default_factory=list)  # per block: its column-wise layers' inputs (TP gathers)
    tp_dims: list[int | None] | None = None  # each parameter's TP split dimension; None: the model has no plan
    wrap_note: str | None = None  # said once when size-based wrapping stands in for blocks
    kept: list[int] = field(default_factory=list)  # per block: the outputs selective checkpointing keeps
    ends: tuple[list[int], list[int]] = ([], [])  # parameters before the blocks (first stage), after (last stage)

    def activations(self, tp: int, checkpointing: bool, selective: bool = False, stage: int = 1) -> float:
        """Bytes saved for backward per rank for one measured micro-batch (see the module's docstring); `stage`:
        the blocks of one of that many pipeline stages."""
        gathered = self.gathered or [0] * len(self.saved.per_block)
        count = len(self.saved.per_block) // stage
        blocks = [(b - g) / tp + g for b, g in zip(self.saved.per_block, gathered, strict=True)][:count]
        inputs = self.saved.block_inputs * count / max(len(self.saved.per_block), 1) / tp
        if checkpointing and selective and blocks:
            kept = [min(k / tp, b) for k, b in zip(self.kept or [0] * len(blocks), blocks, strict=False)]
            return self.saved.outside + inputs + sum(kept) + max(b - k for b, k in zip(blocks, kept, strict=False))
        if checkpointing and blocks:
            return self.saved.outside + inputs + max(blocks)
        return self.saved.outside + sum(blocks)



def shard_rows(dim0: int, shard_size: int) -> int:
    """Rows of rank 0's FSDP2 chunk of a tensor with `dim0` rows (torch.chunk: ceil-sized chunks)."""
    return math.ceil(dim0 / shard_size)


def tp_shape(shape: torch.Size, dim: int | None, tp: int) -> torch.Size:
    """Rank 0's local shape of a parameter split along `dim` over `tp` ranks (DTensor's Shard: ceil chunks)."""
    if tp == 1 or dim is None:
        return shape
    return torch.Size([math.ceil(n / tp) if i == dim else n for i, n in enumerate(shape)])


def sharded_bytes(shape: torch.Size, element_size: int, shard_size: int) -> int:
    if len(shape) == 0:
        return element_size
    rest = math.prod(shape[1:])
    return shard_rows(shape[0], shard_size) * rest * element_size


def optimizer_state(model: nn.Module, optim_cfg: OptimSection) -> tuple[list[int], int]:
    """Bytes of the optimizer state of each of `model.parameters()` that scale with it, and the scalar bytes,
    exactly: one step of the configured optimizer on a meta-device copy."""
    meta = copy.deepcopy(model).to("meta")
    for param in meta.parameters():
        param.grad = torch.zeros_like(param)
    optimizer, _ = build_optimizer(meta, optim_cfg, 1, torch.device("meta"))
    optimizer.step()
    scaled, scalars = [], 0
    named = dict(meta.named_parameters(remove_duplicate=False))  # a copy to meta may untie shared weights
    for name, _ in model.named_parameters():
        param = named[name]
        state = optimizer.state.get(param, {})
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
        scaled.append(sum(t.numel() * t.element_size() for t in tensors if t.shape == param.shape))
        scalars += sum(t.numel() * t.element_size() for t in tensors if t.shape != param.shape)
    return scaled, scalars


def measure_activations(model: nn.Module, example: Any, task: Callable[[nn.Module, Any], tuple],
                        blocks: list[nn.Module], autocast: Any,
                        gathered: list[nn.Module] = ()) -> tuple[Saved, list[int]]:
    """The bytes saved for backward in one forward (deduplicated by storage), and per block the input bytes of
    its `gathered` modules (the column-wise layers of a TP plan)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    block_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    inputs = [0] * len(blocks)

    def count_input(module: nn.Module, args: tuple) -> None:
        inputs[block_of[id(module)]] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def size_of(t: torch.Tensor) -> int:  # each storage once (views share one); parameters are not activations
        storage = t.untyped_storage()
        if storage.data_ptr() in params or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    def forward() -> None:
        with autocast:
            loss, _ = task(model, example)
        del loss

    handles = [m.register_forward_pre_hook(count_input) for m in gathered if id(m) in block_of]
    try:
        saved = saved_for_backward(forward, blocks, size_of)
    finally:
        for handle in handles:
            handle.remove()
    return saved, inputs


def kept_outputs(model: nn.Module, example: Any, task: Callable[[nn.Module, Any], tuple], blocks: list[nn.Module],
                 autocast: Any) -> list[int]:
    """Per block, the bytes of the outputs selective checkpointing keeps (trainflow.distributed.parallelism
    saved_ops: matmuls, attention), in one forward without grad."""
    keep, kept, current = saved_ops(), [0] * len(blocks), []

    class Tally(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if current and func in keep:
                first = out[0] if isinstance(out, (tuple, list)) else out
                kept[current[-1]] += first.numel() * first.element_size()
            return out

    def leave(*_: Any) -> None:  # a forward hook's return value would replace the block's output
        current.pop()

    handles = [b.register_forward_pre_hook(lambda _m, _a, i=i: current.append(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        with torch.no_grad(), autocast, Tally():
            task(model, example)
    finally:
        for handle in handles:
            handle.remove()
    return kept


def model_facts(model: nn.Module, optim_cfg: OptimSection, fsdp_cfg: FSDPConfig, example: tuple | None = None,
                task: Callable | None = None, autocast: Any = None, tp_target: Any = None) -> ModelFacts:
    """Everything the table needs from this model (the same on every rank); without an example (a model on the
    meta device) the activations are left at 0."""
    blocks = model_blocks(model)
    wrap = fsdp_cfg.wrap
    note = None
    if blocks is None and wrap != "size":
        note = (f"parallelism.strategy: auto: {type(model).__name__} has no `blocks` list, so FSDP would shard "
                f"modules by size (parallelism.fsdp.min_params={fsdp_cfg.min_params}) and activation "
                "checkpointing is not available")
        wrap = "size"
    units = shard_units(model, wrap, fsdp_cfg.min_params)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    members = [[index[id(p)] for p in unit.parameters()] for unit in units]
    in_units = {i for unit in members for i in unit}
    scaled, scalars = optimizer_state(model, optim_cfg)
    plan = _tp_plan_or_none(model, tp_target)
    ends: tuple[list[int], list[int]] = ([], [])
    if blocks is not None:  # the children registered before `blocks` go to the first pipeline stage, after to the last
        names = list(model._modules)
        at = names.index("blocks") if "blocks" in names else len(names)
        ends = tuple([index[id(p)] for n in part if model._modules[n] is not None
                      for p in model._modules[n].parameters()] for part in (names[:at], names[at + 1:]))
    saved, gathered, batch, kept = Saved(0, [], 0), [], 1, []
    if example is not None:
        block_list = list(blocks) if blocks is not None else []
        colwise = gathered_inputs(model, plan) if plan else []
        saved, gathered = measure_activations(model, example, task, block_list, autocast, colwise)
        kept = kept_outputs(model, example, task, block_list, autocast) if block_list else []
        batch = len(example[0]) if isinstance(example, (tuple, list)) else len(example)
    return ModelFacts(
        params=[(p.shape, p.element_size(), s) for p, s in zip(model.parameters(), scaled, strict=True)],
        optimizer_scalar_bytes=scalars, units=members, root=[i for i in index.values() if i not in in_units],
        saved=saved, example_batch=batch, gathered=gathered,
        tp_dims=shard_dims(model, plan) if plan else None, wrap_note=note, kept=kept, ends=ends)


def _tp_plan_or_none(model: nn.Module, target: Any) -> dict[str, Any] | None:
    """The model's TP plan, or None when it has none (then auto offers no TP layout)."""
    try:
        return tp_plan(model, target, 2)
    except ConfigError:
        return None


def estimate(facts: ModelFacts, layout: Layout, gather_factor: float = 1.0, bucket_copy: bool = True) -> dict:
    """Bytes per rank of each item under `layout`; gather_factor: gathered parameter bytes over stored ones
    (0.5 when FSDP gathers bf16 copies of fp32 parameters)."""
    s, tp, pp = layout.shard_size, layout.tp, layout.pp
    # DDP under TP: FSDP2 over shard groups of one rank; TP (or PP) alone: no FSDP2
    sharded = (layout.strategy in SHARDED or tp > 1 or pp > 1) and not layout.tp_alone
    dims = facts.tp_dims or [None] * len(facts.params)
    local = [(tp_shape(shape, dim, tp), size, state // max(1, math.prod(shape)))
             for (shape, size, state), dim in zip(facts.params, dims, strict=True)]
    units, scalars = facts.units, facts.optimizer_scalar_bytes
    if pp > 1:  # the first or the last stage, whichever holds more (see the module's docstring)
        per = len(facts.units) // pp
        stages = [(facts.units[:per], facts.ends[0]), (facts.units[len(facts.units) - per:], facts.ends[1])]
        helds = [{*(i for unit in u for i in unit), *extra} for u, extra in stages]
        sizes = [sum(sharded_bytes(*local[i][:2], s) for i in held) for held in helds]
        units, held = stages[sizes.index(max(sizes))][0], helds[sizes.index(max(sizes))]
        local = [entry if i in held else (torch.Size([0]), entry[1], 0) for i, entry in enumerate(local)]
        scalars = facts.optimizer_scalar_bytes * len(held) // len(facts.params)  # per parameter (AdamW's step)
    batch = (layout.batch or facts.example_batch) / facts.example_batch
    if pp > 1:  # min(m, pp) pipeline micro-batches of 1/m of the micro-batch in flight
        batch *= min(layout.microbatches, pp) / layout.microbatches
    row = {
        "params": sum(sharded_bytes(shape, size, s) for shape, size, _ in local),
        "grads": sum(sharded_bytes(shape, size, s) for shape, size, _ in local),
        "optimizer": scalars + sum(
            sharded_bytes(shape, per_element, s) if per_element else 0 for shape, _, per_element in local),
        "buckets": 0,
        "all_gather": 0,
        "activations": int(facts.activations(tp, layout.checkpointing, layout.selective, pp) * batch),
    }
    if layout.strategy == Strategy.ddp and tp == 1 and bucket_copy:
        row["buckets"] = row["grads"]
    if sharded:
        def gathered(members: list[int]) -> int:  # the unit's parameters gathered over the data-parallel ranks
            return sum(math.prod(local[i][0]) * local[i][1] for i in members)

        largest = max(map(gathered, units), default=0)
        row["all_gather"] = int(gathered(facts.root) * gather_factor + 2 * largest * gather_factor + largest)
    row["total"] = sum(row[item] for item in ITEMS)
    return row


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of the tensors (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total
