"""Per-rank memory of FSDP and HSDP at cluster sizes we cannot run, by simulation.

Each row shards a GPT on the meta device (no memory, no arithmetic) with trainflow's own `shard()` over a real
device mesh of a fake process group (`torch.testing._internal.distributed.fake_pg`: collectives return at once,
so one process plays rank 0 of any world size), builds the optimizer on the sharded parameters and takes one
step, then counts what rank 0 holds: parameters, gradients, optimizer state (the local shards of the DTensors),
and the largest all-gather (the biggest shard unit's full parameters). Next to it, the estimate of
trainflow.distributed.memory_plan (what parallelism=auto decides with): the two must agree to the byte.

HSDP shards within a node of 8 ranks and replicates across nodes; FSDP shards over every rank.

    .venv/bin/python benchmarks/scale_plan.py [--worlds 8 64 512 1024] [--models gpt_small gpt_medium gpt_6b]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainflow.config import FSDPConfig, OptimConfig
from trainflow.distributed import DistEnv
from trainflow.distributed.memory_plan import Layout, estimate, local_bytes, model_facts
from trainflow.distributed.mesh import build_mesh
from trainflow.distributed.parallelism import shard, shard_units
from trainflow.models.gpt import GPT
from trainflow.optim import build_optimizer

MODELS = {  # byte-level vocabulary, as conf/model
    "gpt_small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
    "gpt_medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024},
    "gpt_6b": {"n_layer": 32, "n_head": 32, "n_embd": 4096, "block_size": 2048},
}
RANKS_PER_NODE = 8
MB = 2**20


def meta_gpt(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(**MODELS[name])


def simulate(name: str, world_size: int, strategy: str, ranks_per_node: int = RANKS_PER_NODE) -> dict[str, Any]:
    """Rank 0's bytes under `strategy` (fsdp | hsdp) at `world_size` fake ranks, and the plan's estimate."""
    fsdp_cfg = OmegaConf.structured(FSDPConfig)
    optim_cfg = OmegaConf.structured(OptimConfig)
    shard_size = ranks_per_node if strategy == "hsdp" else world_size
    facts = model_facts(meta_gpt(name), optim_cfg, fsdp_cfg)  # before sharding: the model as the plan sees it
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        shape = (world_size // shard_size, shard_size) if strategy == "hsdp" else None
        mesh = build_mesh("cpu", world_size, shape)
        model = meta_gpt(name)
        units = shard_units(model, fsdp_cfg.wrap, fsdp_cfg.min_params)
        gather = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
        shard(model, fsdp_cfg, DistEnv(0, world_size, 0, torch.device("cpu"), strategy), "fp32", mesh)
        optimizer, _ = build_optimizer(model, optim_cfg, 1, torch.device("meta"))
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        measured = {
            "params": local_bytes(model.parameters()),
            "grads": local_bytes(p.grad for p in model.parameters()),
            "optimizer": local_bytes(state),
            "largest_unit": gather,
        }
    finally:
        dist.destroy_process_group()
    return {"model": name, "parameters": sum(p.numel() for p in meta_gpt(name).parameters()),
            "strategy": strategy, "world_size": world_size, "shard_size": shard_size, "measured": measured,
            "estimate": estimate(facts, Layout(strategy, shard_size))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    print("| model | parameters | strategy | ranks | shard | params MB | grads MB | optimizer MB | "
          "largest all-gather MB | estimate = simulation |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name in args.models:
        for world in args.worlds:
            for strategy in ("fsdp", "hsdp"):
                row = simulate(name, world, strategy)
                m, e = row["measured"], row["estimate"]
                same = all(m[k] == e[k] for k in ("params", "grads", "optimizer"))
                print(f"| {name} | {row['parameters'] / 1e6:.0f}M | {strategy} | {world} | {row['shard_size']} | "
                      f"{m['params'] / MB:.2f} | {m['grads'] / MB:.2f} | {m['optimizer'] / MB:.2f} | "
                      f"{m['largest_unit'] / MB:.1f} | {'yes' if same else 'NO'} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; per rank, rank 0 (the largest shard); fp32 parameters, AdamW")


if __name__ == "__main__":
    main()
