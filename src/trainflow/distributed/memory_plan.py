"""parallelism=auto: the per-rank memory of each layout (trainflow.distributed.memory_estimate), the decision, and
after training the estimate checked against what the run measured.

The budget is the device's free memory (CUDA: free + what this process holds; CPU: available RAM shared by this
node's ranks) times parallelism.memory_headroom, or parallelism.memory_budget_gb; the smallest budget of all
ranks counts, so that every rank decides alike. Order of preference: DDP (one process: as is), HSDP (several
nodes), FSDP, then the same with activation checkpointing; then tensor parallel, tp = 2, 4, ... up to the
ranks of a node (dividing the model's heads and hidden sizes), each as DDP, HSDP, FSDP (or TP alone) x tp, then
with activation checkpointing; then pipeline parallel, pp = 2, 3, ... (dividing the world and the model's blocks
into parallelism.pp_schedule's stages), FSDP x pp (or PP alone), at each TP degree. Each sharded layout comes
with selective activation checkpointing (the matmul and attention outputs kept) before full. A layout whose
data-parallel ranks do not divide the global batch (parallelism.global_batch, else trainer.batch_size x world
size: auto keeps it), or whose micro-batch its pipeline micro-batches do not divide, is not offered. None
fitting is a one-line refusal with the numbers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.config.choices import Strategy
from trainflow.config.schema import ModelSection, ParallelismConfig, RunConfig
from trainflow.distributed.memory_estimate import GB, ITEMS, Layout, ModelFacts, estimate, local_bytes, model_facts
from trainflow.distributed.parallelism import fsdp_dtypes
from trainflow.distributed.pipeline import stages_per_rank
from trainflow.distributed.process_group import node_count
from trainflow.errors import ConfigError
from trainflow.metrics.batch_fit import available_bytes
from trainflow.models import model_blocks
from trainflow.util.device import autocast_for

log = logging.getLogger(__name__)


@dataclass
class Plan:
    layouts: list[Layout]
    table: dict[str, dict[str, int]]  # layout name -> item -> bytes per rank (+ "total")
    budget_bytes: int
    budget_source: str
    choice: Layout | None = None
    check: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why tensor parallel, when chosen
    excluded: list[str] = field(default_factory=list)  # layouts whose data-parallel ranks do not divide the batch

    def summary(self) -> dict[str, Any]:
        return {"choice": self.choice.name if self.choice else None, "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "table": self.table, "check": self.check or None,
                "reason": self.reason, "excluded": self.excluded}


def candidates(world_size: int, ranks_per_node: int, can_checkpoint: bool, tp_degrees: tuple[int, ...] = (),
               global_batch: int | None = None, grad_accum: int = 1, checkpoint_under_tp: bool = True,
               pp_degrees: tuple[int, ...] = (), microbatches: Callable[[int], int] = lambda pp: pp,
               ) -> tuple[list[Layout], list[str]]:
    """The layouts in order of preference for this launch (cheapest communication first), each with its per-rank
    micro-batch of `global_batch`; and the names of those left out because their data-parallel ranks do not
    divide it (or their pipeline micro-batches, `microbatches(pp)` of them, the micro-batch). Tensor parallel
    comes after data parallel (it communicates every layer), pipeline parallel last (its bubble idles ranks)."""
    order: list[Layout] = []
    for pp in (1, *pp_degrees):
        for tp in (1, *(t for t in tp_degrees if pp == 1)):  # TP x PP fails in torch 2.13 (parallelism.py)
            dp, per_node = world_size // tp // pp, max(ranks_per_node // tp, 1)
            if world_size == 1:
                level = [Layout(Strategy.single, 1)]
            elif dp == 1:  # one copy of the model spans the world
                level = [Layout(Strategy.fsdp, 1, tp=tp, pp=pp, microbatches=microbatches(pp))]
            elif pp > 1:
                level = [Layout(Strategy.fsdp, dp, tp=tp, pp=pp, microbatches=microbatches(pp))]
            else:
                hsdp = [Layout(Strategy.hsdp, per_node, tp=tp)] if world_size > ranks_per_node and per_node > 1 else []
                level = [Layout(Strategy.ddp, 1, tp=tp), *hsdp, Layout(Strategy.fsdp, dp, tp=tp)]
            if can_checkpoint and (tp == 1 or checkpoint_under_tp):
                level += [replace(c, checkpointing=True, selective=selective) for selective in (True, False)
                          for c in level if c.strategy != Strategy.ddp]
            order += level
    if global_batch is None:
        return order, []
    fits = []
    for c in order:
        ranks = world_size // c.tp // c.pp * grad_accum
        if global_batch % ranks == 0 and (global_batch // ranks) % c.microbatches == 0:
            c.batch = global_batch // ranks
            fits.append(c)
    return fits, [c.name for c in order if c not in fits]


def pp_degrees(blocks: int, world_size: int, schedule: str) -> tuple[int, ...]:
    """The pipeline degrees auto may use: dividing the world, and the model's blocks into the schedule's stages."""
    return tuple(p for p in range(2, world_size + 1)
                 if world_size % p == 0 and blocks and blocks % (p * stages_per_rank(schedule)) == 0)


def tp_degrees(facts: ModelFacts, model_cfg: ModelSection, world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """The TP degrees auto may use: within a node, dividing the world and, for a model with heads, its heads
    and hidden size (each TP rank takes whole heads and an equal share of the hidden units)."""
    if facts.tp_dims is None:
        return ()
    sizes = [model_cfg.n_head, model_cfg.n_embd]
    return tuple(t for t in range(2, min(ranks_per_node, world_size) + 1)
                 if world_size % t == 0 and ranks_per_node % t == 0 and all(n is None or n % t == 0 for n in sizes))


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
    state = sum(estimate(facts, Layout(Strategy.fsdp, 1))[k] for k in ("params", "grads", "optimizer"))
    if plan.budget_bytes > fixed and leanest.strategy != "single":
        fixes.append(f"{math.ceil(state / (plan.budget_bytes - fixed))} ranks")
    elif leanest.strategy == Strategy.single and plan.budget_bytes > row["activations"]:
        fixes.append("2 or more ranks (parallelism.nproc_per_node) to shard it")
    other = row["total"] - row["activations"]
    if plan.budget_bytes > other and row["activations"]:
        smaller = int(batch_size * (plan.budget_bytes - other) / row["activations"])  # activations: linear in it
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
    trainflow.loop.meter.PeakMemory), else the allocator's. CPU: the peak resident set since the plan."""
    if device.type == "cuda":
        return training_peak if training_peak is not None else int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


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
    parallelism: ParallelismConfig  # the section as decided: strategy, tp, activation checkpointing, HSDP mesh
    batch_size: int  # the per-rank micro-batch of the chosen layout (trainer.batch_size)


def apply_auto(cfg: RunConfig, env: Any, model: nn.Module, example: Any, task: Callable) -> tuple[Any, AutoPlan]:
    """parallelism=auto: measure and decide. The plan's `parallelism` is the section as decided (strategy, activation
    checkpointing, the HSDP mesh) for the run to record in its config, so that everything after it sees a plain
    ddp/fsdp/hsdp run. Returns the env with the strategy."""
    p, t = cfg.parallelism, cfg.trainer
    autocast = autocast_for(env.device, t.precision)
    facts = model_facts(model, cfg.optim, p.fsdp, example, task, autocast, p.tp_plan)
    ranks_per_node = env.world_size // node_count(env.world_size)
    global_batch = global_batch_of(cfg, env.world_size)
    blocks = model_blocks(model)
    # a pipeline needs the task's loss apart from the model (task=lm or classify) and one batch shape
    pipelines = blocks is not None and not cfg.task._target_ and not cfg.task.loss_from_model \
        and cfg.data.seq_lens is None
    layouts, excluded = candidates(
        env.world_size, ranks_per_node, facts.activations(1, True) < facts.activations(1, False),
        tp_degrees(facts, cfg.model, env.world_size, ranks_per_node), global_batch, t.grad_accum,
        checkpoint_under_tp=not cfg.compile.enabled,  # compiled checkpointed blocks under TP fail in torch
        pp_degrees=tuple(d for d in pp_degrees(len(blocks), env.world_size, p.pp_schedule)
                         if (p.microbatches or d) >= d * stages_per_rank(p.pp_schedule)) if pipelines else (),
        microbatches=lambda pp: p.microbatches or pp * stages_per_rank(p.pp_schedule))
    if not layouts:
        raise ConfigError(f"parallelism.global_batch: {global_batch} does not split over the data-parallel ranks of "
                          f"any layout of {env.world_size} ranks x trainer.grad_accum={t.grad_accum} (left out: "
                          f"{', '.join(excluded)}); use a multiple of {t.grad_accum * env.world_size}")
    if p.activation_checkpointing in ("full", "selective"):  # asked for: the layouts with that mode
        wanted = p.activation_checkpointing == "selective"
        layouts = [c for c in layouts if c.checkpointing and c.selective == wanted] or layouts
    if p.memory_budget_gb is not None:
        budget, source = int(p.memory_budget_gb * GB), f"parallelism.memory_budget_gb={p.memory_budget_gb}"
    else:
        budget, source = device_budget(env.device, ranks_per_node, p.memory_headroom)
    budget = smallest_over_ranks(budget, env.device)
    gather = 0.5 if fsdp_dtypes(p.fsdp.param_dtype, p.fsdp.reduce_dtype, t.precision)[0] == "bf16" else 1.0
    plan = decide(facts, layouts, budget, source, t.batch_size, t.precision, gather,
                  not p.ddp.gradient_as_bucket_view)
    choice = plan.choice
    plan.excluded = excluded
    plan.reason = why_pipeline(plan) or why_tensor_parallel(plan, excluded, global_batch, t.grad_accum)
    mode = ("selective" if choice.selective else "full") if choice.checkpointing else "off"
    decision = replace(p, strategy=choice.strategy, tp=choice.tp, pp=choice.pp, activation_checkpointing=mode)
    if choice.strategy == Strategy.hsdp:
        decision.hsdp = replace(p.hsdp, shard_size=choice.shard_size,
                                replicate_size=env.world_size // choice.tp // choice.shard_size)
    if env.is_main:
        if facts.wrap_note:
            log.warning(facts.wrap_note)
        log.info("parallelism=auto chose %s on %d rank%s: %.3g GB per rank under a budget of %.3g GB (%s)%s; MB "
                 "per rank:\n%s", choice.name, env.world_size, "s" * (env.world_size > 1),
                 plan.table[choice.name]["total"] / GB, budget / GB, source, f" ({plan.reason})" * bool(plan.reason),
                 format_table(plan))
    resident = sum(x.numel() * x.element_size() for x in model.parameters())
    return (replace(env, strategy=choice.strategy, tp=choice.tp, pp=choice.pp),
            AutoPlan(plan, reset_peak(env.device), resident, decision, choice.batch or t.batch_size))


def global_batch_of(cfg: RunConfig, world_size: int) -> int:
    """The samples of one optimizer step auto keeps whatever it chooses: parallelism.global_batch, else what
    trainer.batch_size gives on every rank of the world (a TP group then reads tp of them per micro-step)."""
    p, t = cfg.parallelism, cfg.trainer
    return p.global_batch if p.global_batch is not None else t.batch_size * world_size * t.grad_accum


def probe_ranks(cfg: RunConfig, world_size: int) -> int:
    """The data-parallel ranks the activations are measured for, before the decision: the most (the fewest TP
    ranks within a node) that divide the global batch; the world when none does (per_rank_batch then says so)."""
    per_node = world_size // node_count(world_size)
    batch = global_batch_of(cfg, world_size)
    for tp in range(1, per_node + 1):
        if world_size % tp == 0 and batch % (world_size // tp * cfg.trainer.grad_accum) == 0:
            return world_size // tp
    return world_size


def why_pipeline(plan: Plan) -> str | None:
    """The decision line's reason for PP: what the leanest layout without it needs, and what PP divides."""
    if plan.choice.pp == 1:
        return None
    flat = [c for c in plan.layouts if c.pp == 1]
    if not flat:
        return "pipeline parallel: no layout without it splits the global batch"
    leanest = min(flat, key=lambda c: plan.table[c.name]["total"])
    row = plan.table[leanest.name]
    state = row["params"] + row["grads"] + row["optimizer"]
    return (f"pipeline parallel: no layout without it fits: the leanest, {leanest.name}, needs {row['total'] / GB:.3g} "
            f"GB per rank, of which state {state / GB:.3g} GB, the gathered blocks {row['all_gather'] / GB:.3g} GB and "
            f"activations {row['activations'] / GB:.3g} GB; {plan.choice.pp} stages hold each a share of the blocks")


def why_tensor_parallel(plan: Plan, excluded: list[str], global_batch: int, grad_accum: int) -> str | None:
    """The decision line's reason for TP: what no data-parallel layout could fit, or the batch they cannot split."""
    if plan.choice.tp == 1:
        return None
    reasons = []
    data_parallel = [c for c in plan.layouts if c.tp == 1]  # before the choice: none of them fit
    if data_parallel:
        leanest = min(data_parallel, key=lambda c: plan.table[c.name]["total"])
        row = plan.table[leanest.name]
        reasons.append(f"no data-parallel layout fits: the leanest, {leanest.name}, needs {row['total'] / GB:.3g} GB "
                       f"per rank, of which the gathered blocks {row['all_gather'] / GB:.3g} GB and activations "
                       f"{row['activations'] / GB:.3g} GB, which only tensor parallel divides")
    if any(" x tp " not in name and not name.startswith("tp ") for name in excluded):
        reasons.append(f"the global batch {global_batch} x {grad_accum} accumulation step{'s' * (grad_accum > 1)} "
                       f"does not split over every rank ({', '.join(excluded)} left out)")
    return "tensor parallel: " + "; ".join(reasons)


def finish(auto: AutoPlan, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer,
           training_peak: int | None = None) -> dict:
    """The plan for summary.json, with its estimate checked against this run's measured peak."""
    auto.plan.check = check_estimate(auto.plan, device, auto.baseline, auto.resident_model, model, optimizer,
                                     training_peak)
    return auto.plan.summary()
