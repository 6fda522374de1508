"""parallelism=auto: the per-rank memory of each strategy, estimated before training, and the decision.

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

The budget is the device's free memory (CUDA: free + what this process holds; CPU: available RAM shared by this
node's ranks) times parallelism.memory_headroom, or parallelism.memory_budget_gb; the smallest budget of all
ranks counts, so that every rank decides alike. Order of preference: DDP (one process: as is), HSDP (several
nodes), FSDP, then the same with activation checkpointing; none fitting is a one-line refusal with the numbers.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from trainflow.activations import saved_for_backward
from trainflow.distributed.mesh import SHARDED
from trainflow.distributed.parallelism import fsdp_dtypes, shard_units
from trainflow.distributed.process_group import node_count
from trainflow.errors import ConfigError
from trainflow.limits import available_bytes
from trainflow.models import model_blocks
from trainflow.precision import autocast_for

log = logging.getLogger(__name__)
GB = 1024**3
ITEMS = ("params", "grads", "optimizer", "buckets", "all_gather", "activations")


@dataclass
class Layout:
    """One candidate: a strategy, how many ranks shard one copy of the model, activation checkpointing."""

    strategy: str  # one of trainflow.distributed.mesh.STRATEGIES
    shard_size: int
    checkpointing: bool = False

    @property
    def name(self) -> str:
        return self.strategy + (" + activation checkpointing" if self.checkpointing else "")


@dataclass
class ModelFacts:
    """What the estimate needs from the model: per-parameter sizes, shard units, measured activations."""

    params: list[tuple[torch.Size, int, int]]  # (shape, element size, optimizer state bytes when unsharded)
    optimizer_scalar_bytes: int  # per-parameter scalars (AdamW's step): never sharded
    unit_bytes: list[int]  # each shard unit's full parameter bytes
    root_bytes: int  # parameters outside every unit (kept gathered by the root)
    activation_bytes: int  # one micro-batch, no checkpointing
    checkpointed_activation_bytes: int  # the same with each block recomputed in backward
    wrap_note: str | None = None  # said once when size-based wrapping stands in for blocks


@dataclass
class Plan:
    layouts: list[Layout]
    table: dict[str, dict[str, int]]  # layout name -> item -> bytes per rank (+ "total")
    budget_bytes: int
    budget_source: str
    choice: Layout | None = None
    check: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"choice": self.choice.name if self.choice else None, "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "table": self.table, "check": self.check or None}


def shard_rows(dim0: int, shard_size: int) -> int:
    """Rows of rank 0's FSDP2 chunk of a tensor with `dim0` rows (torch.chunk: ceil-sized chunks)."""
    return math.ceil(dim0 / shard_size)


def sharded_bytes(shape: torch.Size, element_size: int, shard_size: int) -> int:
    if len(shape) == 0:
        return element_size
    rest = math.prod(shape[1:])
    return shard_rows(shape[0], shard_size) * rest * element_size


def optimizer_state(model: nn.Module, optim_cfg: DictConfig) -> tuple[list[int], int]:
    """Bytes of the optimizer state of each of `model.parameters()` that scale with it, and the scalar bytes,
    exactly: one step of the configured optimizer on a meta-device copy."""
    from trainflow.optim import build_optimizer

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
                        blocks: list[nn.Module], autocast: Any) -> tuple[int, int]:
    """(bytes saved for backward in one forward, the same with each block checkpointed), deduplicated by storage."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()

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

    saved = saved_for_backward(forward, blocks, size_of)
    return saved.total, saved.checkpointed


def model_facts(model: nn.Module, optim_cfg: DictConfig, fsdp_cfg: DictConfig, example: tuple | None = None,
                task: Callable | None = None, autocast: Any = None) -> ModelFacts:
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
    in_units = {id(p) for unit in units for p in unit.parameters()}
    scaled, scalars = optimizer_state(model, optim_cfg)
    full = checkpointed = 0
    if example is not None:
        full, checkpointed = measure_activations(model, example, task, list(blocks) if blocks is not None else [],
                                                 autocast)
    return ModelFacts(
        params=[(p.shape, p.element_size(), s) for p, s in zip(model.parameters(), scaled, strict=True)],
        optimizer_scalar_bytes=scalars,
        unit_bytes=[sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units],
        root_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_units),
        activation_bytes=full,
        checkpointed_activation_bytes=checkpointed if blocks is not None else full,
        wrap_note=note,
    )


def estimate(facts: ModelFacts, layout: Layout, gather_factor: float = 1.0, bucket_copy: bool = True) -> dict:
    """Bytes per rank of each item under `layout`; gather_factor: gathered parameter bytes over stored ones
    (0.5 when FSDP gathers bf16 copies of fp32 parameters)."""
    s = layout.shard_size
    sharded = layout.strategy in SHARDED
    row = {
        "params": sum(sharded_bytes(shape, size, s) for shape, size, _ in facts.params),
        "grads": sum(sharded_bytes(shape, size, s) for shape, size, _ in facts.params),
        "optimizer": facts.optimizer_scalar_bytes + sum(
            sharded_bytes(shape, state // max(1, math.prod(shape)), s) if state else 0
            for shape, _, state in facts.params),
        "buckets": 0,
        "all_gather": 0,
        "activations": facts.checkpointed_activation_bytes if layout.checkpointing else facts.activation_bytes,
    }
    if layout.strategy == "ddp" and bucket_copy:
        row["buckets"] = row["grads"]
    if sharded:
        largest = max(facts.unit_bytes, default=0)
        row["all_gather"] = int(facts.root_bytes * gather_factor + 2 * largest * gather_factor + largest)
    row["total"] = sum(row[item] for item in ITEMS)
    return row


def candidates(world_size: int, ranks_per_node: int, can_checkpoint: bool) -> list[Layout]:
    """The layouts in order of preference for this launch (cheapest communication first)."""
    if world_size == 1:
        order = [Layout("single", 1)]
    else:
        nodes = world_size // ranks_per_node
        hsdp = [Layout("hsdp", ranks_per_node)] if nodes > 1 and ranks_per_node > 1 else []
        order = [Layout("ddp", 1), *hsdp, Layout("fsdp", world_size)]
    if can_checkpoint:
        order += [Layout(c.strategy, c.shard_size, True) for c in order if c.strategy != "ddp"]
    return order


def device_budget(device: torch.device, local_ranks: int, headroom: float) -> tuple[int, str]:
    """What one rank may use: the free memory now (CUDA: free + held by this process) times the headroom."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        return int((free + held) * headroom), f"free CUDA memory x memory_headroom {headroom}"
    available = available_bytes(device)  # the system's available memory, within the cgroup's limit
    if available is None:
        raise RuntimeError("/proc/meminfo has no MemAvailable: the memory plan cannot size a rank's budget")
    return int(available / local_ranks * headroom), \
        f"available RAM / {local_ranks} local rank{'s' * (local_ranks > 1)} x memory_headroom {headroom}"


def smallest_over_ranks(value: int, device: torch.device) -> int:
    """Every rank must reach the same decision: the smallest budget of all ranks counts."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def decide(facts: ModelFacts, layouts: list[Layout], budget: int, budget_source: str, batch_size: int,
           precision: str, gather_factor: float = 1.0, bucket_copy: bool = True) -> Plan:
    """The first layout whose total fits the budget; none: a ConfigError naming what is needed and what helps."""
    table = {c.name: estimate(facts, c, gather_factor, bucket_copy) for c in layouts}
    plan = Plan(layouts, table, budget, budget_source)
    plan.choice = next((c for c in layouts if table[c.name]["total"] <= budget), None)
    if plan.choice is None:
        raise ConfigError(refusal(facts, plan, batch_size, precision))
    return plan


def refusal(facts: ModelFacts, plan: Plan, batch_size: int, precision: str) -> str:
    """The one line of a plan that fits nowhere: the leanest need, the budget, and what would make it fit."""
    leanest = min(plan.layouts, key=lambda c: plan.table[c.name]["total"])
    row = plan.table[leanest.name]
    key = "parallelism.memory_budget_gb" if plan.budget_source.startswith("parallelism") else "parallelism.strategy"
    fixes = []
    fixed = row["all_gather"] + row["activations"]
    state = sum(estimate(facts, Layout("fsdp", 1))[k] for k in ("params", "grads", "optimizer"))
    if plan.budget_bytes > fixed and leanest.strategy != "single":
        fixes.append(f"{math.ceil(state / (plan.budget_bytes - fixed))} ranks")
    elif leanest.strategy == "single" and plan.budget_bytes > row["activations"]:
        fixes.append("2 or more ranks (parallelism.nproc_per_node) to shard it")
    other = row["total"] - row["activations"]
    if plan.budget_bytes > other and row["activations"]:
        smaller = int(batch_size * (plan.budget_bytes - other) / row["activations"])
        if smaller >= 1:
            fixes.append(f"trainer.batch_size={smaller}")
    if precision == "fp32" and row["total"] - row["activations"] // 2 <= plan.budget_bytes:
        fixes.append("trainer.precision=bf16 (about half the activations)")
    fix = f"it would fit with {' or '.join(fixes)}" if fixes else "only a device with more memory would fit it"
    return (f"{key}: no strategy fits: the leanest, {leanest.name}, needs {row['total'] / GB:.3g} GB per rank "
            f"(parameters, gradients and optimizer state {(row['params'] + row['grads'] + row['optimizer']) / GB:.3g}"
            f" GB, activations {row['activations'] / GB:.3g} GB), and the budget is {plan.budget_bytes / GB:.3g} GB "
            f"({plan.budget_source}); {fix}")


def format_table(plan: Plan) -> str:
    """The decision table in MB per rank, one row per layout, the chosen one marked."""
    head = f"{'layout':<34}" + "".join(f"{item:>12}" for item in (*ITEMS, "total"))
    lines = [head]
    for c in plan.layouts:
        row = plan.table[c.name]
        mark = "* " if c is plan.choice else "  "
        lines.append(f"{mark}{c.name:<32}" + "".join(f"{row[i] / 2**20:>12.2f}" for i in (*ITEMS, "total")))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# After training: the estimate against what was measured


def resident_bytes() -> int:
    """This process's resident set now (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak(device: torch.device) -> int:
    """Start measuring the peak from here; returns the baseline (CUDA: 0, the allocator counts from nothing;
    CPU: the resident set now, which peak RSS later includes)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set
    return resident_bytes()


def measured_peak(device: torch.device, training_peak: int | None = None) -> int:
    """CUDA: the training loop's own peak when given (it resets the allocator's peak per log interval, see
    trainflow.metrics.PeakMemory), else the allocator's. CPU: the peak resident set since the plan."""
    if device.type == "cuda":
        return training_peak if training_peak is not None else int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of the tensors (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def check_estimate(plan: Plan, device: torch.device, baseline: int, resident_model: int, model: nn.Module,
                   optimizer: torch.optim.Optimizer, training_peak: int | None = None) -> dict[str, Any]:
    """The chosen layout's estimate against the measured peak and the live state this rank holds.

    CPU: the peak resident set since the plan, less the baseline, plus the model bytes the baseline already held.
    """
    row = plan.table[plan.choice.name]
    peak = measured_peak(device, training_peak) - baseline + resident_model
    for module in model.modules():  # the last forward (evaluation) left the root gathered: count the shards
        if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
            module.reshard()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "estimated_bytes": row["total"],
        "measured_peak_bytes": peak,
        "measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS since the plan",
        "peak_over_estimate": peak / row["total"],
        "params_bytes": local_bytes(model.parameters()),
        "optimizer_bytes": local_bytes(state),
    }


# ---------------------------------------------------------------------------------------------------------------
# The hook of the training loop


@dataclass
class AutoPlan:
    plan: Plan
    baseline: int  # resident bytes (CPU) when the plan was made
    resident_model: int  # the model's bytes the baseline already held
    parallelism: dict[str, Any]  # the decision, as values of the parallelism section


def apply_auto(cfg: DictConfig, env: Any, model: nn.Module, example: Any, task: Callable) -> tuple[Any, AutoPlan]:
    """parallelism=auto: measure and decide. The plan's `parallelism` is the decision (strategy, activation
    checkpointing, the HSDP mesh) for the run to record in its config, so that everything after it sees a plain
    ddp/fsdp/hsdp run. Returns the env with the strategy."""
    from dataclasses import replace

    p, t = cfg.parallelism, cfg.trainer
    autocast = autocast_for(env.device, t.precision)
    facts = model_facts(model, cfg.optim, p.fsdp, example, task, autocast)
    ranks_per_node = env.world_size // node_count(env.world_size)
    layouts = candidates(env.world_size, ranks_per_node, facts.checkpointed_activation_bytes < facts.activation_bytes)
    if p.activation_checkpointing == "full":
        layouts = [c for c in layouts if c.checkpointing] or layouts
    if p.memory_budget_gb is not None:
        budget, source = int(p.memory_budget_gb * GB), f"parallelism.memory_budget_gb={p.memory_budget_gb}"
    else:
        budget, source = device_budget(env.device, ranks_per_node, p.memory_headroom)
    budget = smallest_over_ranks(budget, env.device)
    gather = 0.5 if fsdp_dtypes(p.fsdp.param_dtype, p.fsdp.reduce_dtype, t.precision)[0] == "bf16" else 1.0
    plan = decide(facts, layouts, budget, source, t.batch_size, t.precision, gather,
                  not p.ddp.gradient_as_bucket_view)
    decision: dict[str, Any] = {"strategy": plan.choice.strategy,
                                "activation_checkpointing": "full" if plan.choice.checkpointing else "off"}
    if plan.choice.strategy == "hsdp":
        decision["hsdp"] = {"shard_size": plan.choice.shard_size,
                            "replicate_size": env.world_size // plan.choice.shard_size}
    if env.is_main:
        if facts.wrap_note:
            log.warning(facts.wrap_note)
        log.info("parallelism=auto chose %s on %d rank%s: budget %.3g GB per rank (%s); MB per rank:\n%s",
                 plan.choice.name, env.world_size, "s" * (env.world_size > 1), budget / GB, source, format_table(plan))
    resident = sum(x.numel() * x.element_size() for x in model.parameters())
    return replace(env, strategy=plan.choice.strategy), AutoPlan(plan, reset_peak(env.device), resident, decision)


def finish(auto: AutoPlan, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer,
           training_peak: int | None = None) -> dict:
    """The plan for summary.json, with its estimate checked against this run's measured peak."""
    auto.plan.check = check_estimate(auto.plan, device, auto.baseline, auto.resident_model, model, optimizer,
                                     training_peak)
    return auto.plan.summary()
