"""Optimizer and learning-rate schedule (linear warm-up, then cosine or constant)."""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from trainflow.config.schema import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig | DictConfig, max_steps: int, device: torch.device):
    """Build on the final (wrapped, sharded) parameters; no weight decay on biases and norms (one parameter group
    when optim.weight_decay is 0: a second group costs ~8 us a step on a small model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.weight_decay:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": 0.0}]
    if cfg.name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=device.type == "cuda")
    else:
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)

    # plain values: the schedule runs every step, and each DictConfig read costs ~20 us
    warmup, constant, floor = int(cfg.warmup_steps), cfg.schedule == "constant", float(cfg.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if constant:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


def schedule_changes_lr(cfg: OptimConfig | DictConfig) -> bool:
    """Whether the schedule ever changes the LR: a constant one without warm-up need not be stepped. The resume
    puts the schedule at the checkpoint's step whatever its saved position (checkpoint.state.restore_schedule)."""
    return cfg.schedule != "constant" or cfg.warmup_steps > 0


def gradient_norm(parameters: list[torch.Tensor], clip: float) -> torch.Tensor:
    """The gradients' total norm, and the gradients clipped to `clip` when it is set (0: no clipping pass, which
    would scale every gradient by 1)."""
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
