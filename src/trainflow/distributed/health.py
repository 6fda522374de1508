"""Start-up health: every rank says what it runs on and with what, once, before any work.

A node with another torch, another trainflow or a config composed differently (an environment variable that
differs between nodes, a stale config folder on one of them) trains a wrong model or hangs in a mismatched
collective long after start. One gather at start compares them and refuses the run in one line naming the ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

import trainflow
from trainflow.errors import ConfigError
from trainflow.metrics.batch_fit import available_bytes
from trainflow.util.failures import rank_list

log = logging.getLogger("trainflow")

# What every rank must share, with the fix for a difference.
_MUST_AGREE = {
    "torch": "install the same torch on every node",
    "trainflow": "install the same trainflow on every node",
}
_SAME_CONFIG = ("every rank must compose the same config: look for an environment variable, a config folder or an "
                "override that differs between nodes or ranks (the run's config.yaml is rank 0's)")


def check_ranks_agree(composed: dict[str, Any], device: torch.device, rank: int, world_size: int) -> None:
    """Gather every rank's host, device, free memory, versions and a hash of its composed config; refuse a
    mismatch in one line (on every rank alike: each sees the whole gather); rank 0 logs who is there."""
    free = available_bytes(device)
    mine = {"host": socket.gethostname(), "device": str(device), "free_gb": free / 1e9 if free else None,
            "torch": torch.__version__, "trainflow": trainflow.__version__,
            "config": hashlib.sha256(json.dumps(composed, sort_keys=True, default=str).encode()).hexdigest()[:12]}
    everyone: list[dict] = [{} for _ in range(world_size)]
    dist.all_gather_object(everyone, mine)
    if len({info["config"] for info in everyone}) > 1:
        _refuse_config_difference(composed, world_size)
    for key, fix in _MUST_AGREE.items():
        holders: dict[str, list[int]] = {}
        for each_rank, info in enumerate(everyone):
            holders.setdefault(info[key], []).append(each_rank)
        if len(holders) > 1:
            ranks = "; ".join(f"{key} {value} on {rank_list(group)}" for value, group in holders.items())
            raise ConfigError(f"parallelism: the ranks disagree on {key} ({ranks}); {fix}")
    if rank == 0:
        hosts = sorted({info["host"] for info in everyone})
        free_gb = [info["free_gb"] for info in everyone if info["free_gb"] is not None]
        log.info("ranks: %d on %d host(s) (%s), %s; torch %s, trainflow %s, config %s%s", world_size, len(hosts),
                 ", ".join(hosts[:4]) + (", ..." if len(hosts) > 4 else ""), mine["device"].split(":")[0],
                 mine["torch"], mine["trainflow"], mine["config"],
                 f"; least free memory {min(free_gb):.1f} GB" if free_gb else "")


def _refuse_config_difference(composed: dict[str, Any], world_size: int) -> None:
    """Name the keys whose values differ between ranks (a second gather, only on this path)."""
    configs: list[dict] = [{} for _ in range(world_size)]
    dist.all_gather_object(configs, _flat(composed))
    keys = sorted({key for config in configs for key in config if any(key not in c or c[key] != config[key]
                                                                       for c in configs)})
    shown = []
    for key in keys[:3]:
        holders: dict[str, list[int]] = {}
        for each_rank, config in enumerate(configs):
            holders.setdefault(repr(config.get(key, "<absent>")), []).append(each_rank)
        shown.append(f"{key}: " + "; ".join(f"{value} on {rank_list(group)}" for value, group in holders.items()))
    more = f" (and {len(keys) - 3} more keys)" if len(keys) > 3 else ""
    raise ConfigError(f"{' | '.join(shown)}{more}: the ranks composed different configs; {_SAME_CONFIG}")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}
