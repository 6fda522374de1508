"""The optimizer, by `optim._target_` (a torch.optim class or your own), and trainflow's learning-rate schedule
(linear warm-up, then cosine or constant)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainflow.config.schema import OptimSection
from trainflow.errors import ConfigError
from trainflow.util.targets import OPTIMIZER, call, import_target

FUSED_ON_CUDA = (torch.optim.AdamW, torch.optim.Adam)  # one kernel for the whole update, unless optim.fused says


def optimizer_arguments(optim: OptimSection) -> dict[str, Any]:
    """What the optimizer is called with besides the parameter groups: lr and its own arguments (lists as tuples,
    as torch's signatures have them: `betas`); weight decay is set per group, the schedule is trainflow's."""
    return {"lr": optim.lr, **{k: tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v
                               for k, v in optim.kwargs.items()}}


def build_optimizer(model: nn.Module, optim: OptimSection, max_steps: int, device: torch.device):
    """Build on the final (wrapped, sharded) parameters; no weight decay on biases and norms (one parameter group
    when optim.weight_decay is 0: a second group costs ~8 us a step on a small model)."""
    arguments = optimizer_arguments(optim)
    decay = optim.weight_decay
    params = [p for p in model.parameters() if p.requires_grad]
    if decay:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": 0.0}]
    target = str(optim._target_)
    cls = import_target("optim._target_", target, OPTIMIZER)
    if cls in FUSED_ON_CUDA and device.type == "cuda":
        arguments.setdefault("fused", True)
    optimizer = call("optim", target, functools.partial(cls, groups), arguments)  # the error shows the keys, not groups
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optim._target_: {target} made a {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                          f"give {OPTIMIZER}")

    # plain values: the schedule runs every step, and each config read costs ~20 us
    warmup, constant = int(optim.warmup_steps), optim.schedule == "constant"
    floor = float(optim.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if constant:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


def schedule_changes_lr(optim: OptimSection) -> bool:
    """Whether the schedule ever changes the LR: a constant one without warm-up need not be stepped. The resume
    puts the schedule at the checkpoint's step whatever its saved position (checkpoint.state.restore_schedule)."""
    return optim.schedule != "constant" or optim.warmup_steps > 0


def gradient_norm(parameters: list[torch.Tensor], clip: float, counted: list[torch.Tensor] | None = None,
                  group: Any = None) -> torch.Tensor:
    """The gradients' total norm, and the gradients clipped to `clip` when it is set (0: no clipping pass, which
    would scale every gradient by 1). A pipeline stage holds part of the model: the norm is of its `counted`
    parameters (each shared one once), summed in squares over the stages' `group`, and clips all of them."""
    if group is not None:
        total = gradient_norm(counted if counted is not None else parameters, 0.0)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        squared = total.detach().float().square()
        torch.distributed.all_reduce(squared, group=group)
        total = squared.sqrt()
        if clip:
            by_mesh: dict[Any, list[torch.Tensor]] = {}
            for param in parameters:
                if param.grad is not None:
                    by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
            for params in by_mesh.values():
                nn.utils.clip_grads_with_norm_(params, clip, total)
        return total
    groups: dict[Any, list[torch.Tensor]] = {}  # by device mesh: a TP plan may leave some parameters whole
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    if len(groups) <= 1:
        if clip:
            return nn.utils.clip_grad_norm_(parameters, clip)
        return nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    # each group's norm reduced over its own mesh (DTensor), then the norm of those: the whole model's
    norms = [nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
    if clip:
        for group in groups.values():
            nn.utils.clip_grads_with_norm_(group, clip, total)
    return total
