"""Optimizer and learning-rate schedule (linear warm-up, then cosine or constant)."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn


def build_optimizer(model: nn.Module, cfg: DictConfig, max_steps: int, device: torch.device):
    """Build on the final (wrapped, sharded) parameters; no weight decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
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
