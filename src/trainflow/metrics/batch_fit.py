"""Batch sizes that cannot work, refused before anything of their size is allocated.

A micro-batch larger than the training set, or one whose inputs and activations cannot fit in the memory this
process can have, would otherwise end in an index error, or in minutes of swapping and an out-of-memory kill.
The activations are counted on the meta device (shapes only, no memory, no compute): every tensor autograd
keeps for backward during one forward and loss, at the real batch size.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import Dataset

from trainflow.config.schema import RunConfig
from trainflow.data import apply_to_tensors
from trainflow.errors import ConfigError
from trainflow.metrics.activations import saved_for_backward
from trainflow.models import model_blocks
from trainflow.tasks import Task, tensors

log = logging.getLogger(__name__)

def check_batch(cfg: RunConfig, batch_size: int, model: nn.Module, dataset: Dataset, task: Task,
                device: torch.device) -> None:
    """Refuse a micro-batch the training set cannot fill or the memory cannot hold, naming the key to change."""
    key = "trainer.batch_size" if cfg.parallelism.global_batch is None else "parallelism.global_batch"
    n = len(dataset)
    if batch_size > n:
        raise ConfigError(f"{key}: a micro-batch of {batch_size} samples is more than the training set holds ({n} "
                          f"samples); lower {key} so that each rank's micro-batch is <= {n}, or give more data")
    available = available_bytes(device)
    if available is None:
        return
    sample = dataset[torch.arange(1)]
    try:
        needed = micro_batch_bytes(model, sample, batch_size, task,
                                   cfg.parallelism.activation_checkpointing == "full")
    except Exception as exc:  # a model that cannot run on the meta device (it reads values, or an op lacks a kernel)
        log.info("the memory a micro-batch needs could not be estimated on the meta device (%s); not checked", exc)
        return
    if needed > available:
        fits = max(0, math.floor(available / (needed / batch_size)))
        raise ConfigError(f"{key}: a micro-batch of {batch_size} samples needs about {_size(needed)} for its inputs "
                          f"and activations, and {_size(available)} of {device.type} memory is available; lower "
                          f"{key} (about {fits} samples fit), raising trainer.grad_accum to keep the global batch")


def micro_batch_bytes(model: nn.Module, sample: Any, batch_size: int, task: Task,
                      activation_checkpointing: bool = False) -> int:
    """The batch's tensors and the tensors autograd saves for backward of one micro-batch, on the meta device.

    With activation checkpointing, each of `model.blocks` keeps only its input, and one block's activations exist
    at a time (while it is recomputed in backward).
    """
    batch = apply_to_tensors(sample, lambda t: torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta"))
    state = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
             for name, t in [*model.named_parameters(), *model.named_buffers()]}
    weights = {id(t) for t in state.values()}

    def size_of(t: torch.Tensor) -> int:  # a weight (or a view of one) is not an activation
        return 0 if id(t) in weights or id(t._base) in weights else t.numel() * t.element_size()

    blocks = list(model_blocks(model) or [])  # the blocks activation checkpointing would wrap
    saved = saved_for_backward(lambda: task(lambda *args, **kwargs: functional_call(model, state, args, kwargs), batch),
                               blocks, size_of)
    batch_bytes = sum(t.numel() * t.element_size() for t in tensors(batch))
    return batch_bytes + (saved.checkpointed if activation_checkpointing and blocks else saved.total)


def available_bytes(device: torch.device) -> int | None:
    """Memory this process can still take: free device memory on CUDA; on CPU, the smaller of the system's
    available memory and what the cgroup (a container, a SLURM job) still allows. None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
