"""Per-rank memory of FSDP and HSDP, alone and with tensor parallel, at cluster sizes we cannot run, by simulation.

Each row splits a GPT on the meta device (no memory, no arithmetic) with trainflow's own tensor parallel (its
`tp_plan`, over the mesh's tp dimension) and `shard()` over a real device mesh of a fake process group
(`torch.testing._internal.distributed.fake_pg`: collectives return at once, so one process plays rank 0 of any
world size), builds the optimizer on the sharded parameters and takes one step, then counts what rank 0 holds:
parameters, gradients, optimizer state (the local shards of the DTensors), and the largest all-gather (the
biggest shard unit's parameters, TP-local). Next to it, the estimate of trainflow.distributed.memory_estimate
(what parallelism=auto decides with): the two must agree to the byte.

HSDP shards within a node of 8 ranks and replicates across nodes; FSDP shards over every rank; TP splits each
layer over tp consecutive ranks of a node, and the data-parallel degrees take the rest (FSDP x TP: world / tp
shards; HSDP x TP: 8 / tp shards per node).

    .venv/bin/python benchmarks/scale_plan.py [--worlds 8 64 512 1024] [--models gpt_small gpt_medium gpt_6b gpt_70b]
        [--tp 1 2 8] [--pp 2 4 8] [--schedules 1f1b interleaved_1f1b zbv]

Pipeline plans (`--pp`): FSDP x PP at each world size, the first and the last stage of the meta GPT split as
trainflow splits it (trainflow.distributed.pipeline.stage_copy) and sharded over the data-parallel ranks of the
mesh; the rank holding more is counted, next to the estimate. Then the bubble of each schedule, simulated from its
order of work (trainflow.distributed.pipeline.simulated_bubble), by pipeline degree and micro-batches.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainflow.config.schema import FSDPConfig, OptimConfig, OptimSection
from trainflow.distributed import DistEnv
from trainflow.distributed.memory_estimate import Layout, estimate, local_bytes, model_facts
from trainflow.distributed.mesh import MeshLayout, data_parallel_mesh, mesh_for
from trainflow.distributed.parallelism import shard, shard_units
from trainflow.distributed.pipeline import simulated_bubble, stage_copy
from trainflow.distributed.tensor import apply_tensor_parallel
from trainflow.models.gpt import GPT
from trainflow.optim import build_optimizer

MODELS = {  # byte-level vocabulary, as conf/model
    "gpt_small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
    "gpt_medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024},
    "gpt_6b": {"n_layer": 32, "n_head": 32, "n_embd": 4096, "block_size": 2048},
    "gpt_70b": {"n_layer": 80, "n_head": 64, "n_embd": 8192, "block_size": 4096},  # Llama-70B-like widths
}
RANKS_PER_NODE = 8
MB = 2**20


def meta_gpt(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(**MODELS[name])


def simulate(name: str, world_size: int, strategy: str, tp: int = 1,
             ranks_per_node: int = RANKS_PER_NODE) -> dict[str, Any]:
    """Rank 0's bytes under `strategy` (fsdp | hsdp) x `tp` at `world_size` fake ranks, and the plan's estimate."""
    fsdp_cfg = OmegaConf.structured(FSDPConfig)
    optim_cfg = OptimSection(_target_=OptimConfig._target_)
    dp = world_size // tp
    shard_size = ranks_per_node // tp if strategy == "hsdp" else dp
    facts = model_facts(meta_gpt(name), optim_cfg, fsdp_cfg)  # before sharding: the model as the plan sees it
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        found = MeshLayout(strategy, dp // shard_size, shard_size, tp)
        mesh = mesh_for(found, "cpu")
        model = meta_gpt(name)
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        units = shard_units(model, fsdp_cfg.wrap, fsdp_cfg.min_params)
        gather = max(local_bytes(unit.parameters()) for unit in units)  # one unit, gathered over the dp ranks
        if dp > 1:
            shard(model, fsdp_cfg, DistEnv(0, world_size, 0, torch.device("cpu"), strategy, tp), "fp32",
                  data_parallel_mesh(mesh))
        measured = {**stepped_bytes(model, optim_cfg), "largest_unit": gather}
    finally:
        dist.destroy_process_group()
    layout = Layout(strategy, shard_size, tp=tp)
    return {"model": name, "parameters": sum(p.numel() for p in meta_gpt(name).parameters()), "layout": layout.name,
            "strategy": strategy, "world_size": world_size, "shard_size": shard_size, "tp": tp, "measured": measured,
            "estimate": estimate(facts, layout)}


def stepped_bytes(model: torch.nn.Module, optim_cfg: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state once the optimizer has taken a step (its state
    exists only then), all on the meta device."""
    optimizer, _ = build_optimizer(model, optim_cfg, 1, torch.device("meta"))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
            "optimizer": local_bytes(state)}


def simulate_pp(name: str, world_size: int, pp: int) -> dict[str, Any]:
    """Rank 0's bytes under FSDP x `pp` at `world_size` fake ranks (the larger of the first and the last stage),
    and the estimate."""
    fsdp_cfg = OmegaConf.structured(FSDPConfig)
    optim_cfg = OptimSection(_target_=OptimConfig._target_)
    dp = world_size // pp
    facts = model_facts(meta_gpt(name), optim_cfg, fsdp_cfg)
    layers = MODELS[name]["n_layer"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = mesh_for(MeshLayout("fsdp", 1, dp, 1, pp), "cpu")
        stages = []
        for stage in (0, pp - 1):
            part = stage_copy(meta_gpt(name), stage, pp, layers // pp)
            if dp > 1:
                shard(part, fsdp_cfg, DistEnv(0, world_size, 0, torch.device("cpu"), "fsdp", 1, True, pp), "fp32",
                      data_parallel_mesh(mesh))
            stages.append(stepped_bytes(part, optim_cfg))
    finally:
        dist.destroy_process_group()
    measured = max(stages, key=lambda row: row["params"])
    layout = Layout("fsdp", dp, pp=pp, microbatches=pp)
    return {"model": name, "layout": layout.name, "world_size": world_size, "shard_size": dp, "pp": pp,
            "measured": measured, "estimate": estimate(facts, layout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8], help="TP degrees (within a node of 8)")
    parser.add_argument("--pp", type=int, nargs="*", default=[], help="pipeline degrees (FSDP x PP rows)")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b", "zbv"])
    args = parser.parse_args()
    if args.pp:
        pipeline_rows(args)
        return
    print("| model | parameters | layout | ranks | shard | tp | params MB | grads MB | optimizer MB | "
          "largest all-gather MB | estimate = simulation |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name in args.models:
        for world in args.worlds:
            for tp in args.tp:
                for strategy in ("fsdp", "hsdp"):
                    if world % tp or (strategy == "hsdp" and RANKS_PER_NODE // tp < 2):
                        continue  # HSDP x TP needs 2 or more shards per node
                    row = simulate(name, world, strategy, tp)
                    m, e = row["measured"], row["estimate"]
                    same = all(m[k] == e[k] for k in ("params", "grads", "optimizer"))
                    print(f"| {name} | {row['parameters'] / 1e6:.0f}M | {row['layout']} | {world} | "
                          f"{row['shard_size']} | {tp} | {m['params'] / MB:.2f} | {m['grads'] / MB:.2f} | "
                          f"{m['optimizer'] / MB:.2f} | {m['largest_unit'] / MB:.1f} | {'yes' if same else 'NO'} |",
                          flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; per rank, rank 0 (the largest shard); fp32 parameters, AdamW")


def pipeline_rows(args: argparse.Namespace) -> None:
    """The FSDP x PP memory rows, then the bubble by schedule, pipeline degree and micro-batches."""
    print("| model | layout | ranks | shard | pp | params MB | grads MB | optimizer MB | estimate = simulation |")
    print("|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name in args.models:
        for world in args.worlds:
            for pp in args.pp:
                if world % pp or MODELS[name]["n_layer"] % pp:
                    continue
                row = simulate_pp(name, world, pp)
                m, e = row["measured"], row["estimate"]
                same = all(m[k] == e[k] for k in ("params", "grads", "optimizer"))
                print(f"| {name} | {row['layout']} | {world} | {row['shard_size']} | {pp} | {m['params'] / MB:.2f} | "
                      f"{m['grads'] / MB:.2f} | {m['optimizer'] / MB:.2f} | {'yes' if same else 'NO'} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; per rank, the larger of the first and last stage; fp32, AdamW\n")
    counts = sorted({m * pp for pp in args.pp for m in (1, 2, 4)})
    print("| schedule | pp | " + " | ".join(f"m={m}" for m in counts) + " |")
    print("|---|---|" + "---|" * len(counts))
    for schedule in args.schedules:
        for pp in args.pp:
            stages = pp * (1 if schedule in ("1f1b", "gpipe") else 2)
            cells = [f"{simulated_bubble(schedule, pp, m):.3f}" if m >= stages and m % pp == 0 else "-"
                     for m in counts]
            print(f"| {schedule} | {pp} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
