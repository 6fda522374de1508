"""Activation checkpointing modes side by side on one model: peak memory of a training step and its time.

    .venv/bin/python benchmarks/activation_checkpointing.py [--layers 4] [--width 256] [--seq 256] [--batch 8]
        [--steps 6] [--rounds 3] [--modes off full selective every_2 compiled_off budget_0.5 budget_0.1]

Each mode wraps a fresh copy of the same GPT (same weights, same batch) the way trainflow does
(trainflow.distributed.parallelism.checkpoint_activations; `every_2`: full checkpointing of every second block;
`compiled_*` and `budget_*`: inductor-compiled model, the budget set as parallelism.activation_budget sets it).
Each mode is measured in two processes of its own. Peak memory: after two steps (compilation, the optimizer's
state), how far the resident set rose during a third above its level before it (the model, the optimizer state
and the previous gradients are there already, so the figure is the step's own: activations and their
recomputation, gradients, temporaries), with glibc's mmap threshold fixed so that the resident set follows the
live tensors; for a compiled model also the bytes its graph saves for backward. Step time: the median of
`--steps` steps after those two, the fastest of `--rounds` processes (the modes take their turns round after
round, so that a busy spell of a shared machine falls on one round rather than on one mode). The losses of every
mode are compared with the first mode's: checkpointing recomputes, it must not change the numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainflow.config.choices import ActivationCheckpointing
from trainflow.config.schema import ParallelismConfig
from trainflow.distributed.memory_plan import resident_bytes
from trainflow.distributed.parallelism import checkpoint_activations
from trainflow.models.gpt import GPT

MMAP_THRESHOLD = 65536


def step_peak_bytes(step: Callable[[], None]) -> int:
    """How far the resident set rose above its level before `step` during it (Linux: VmHWM reset, then read).
    With glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, main() sets it) every block of 64 kB or more is
    mapped and unmapped on its own, so the resident set follows the live tensors, not malloc's retained heap."""
    Path("/proc/self/clear_refs").write_text("5")
    before = resident_bytes()
    step()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 - before
    raise RuntimeError("/proc/self/status has no VmHWM")


def saved_bytes(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    """Bytes a compiled model's forward saves for backward (its graph's saved tensors pass autograd's hooks; an
    eager checkpointed block's do not, its checkpoint keeps them itself)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # the weights are kept anyway
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs)
    return sum(sizes.values())


def prepared(mode: str, base: GPT) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A copy of `base` checkpointed (and compiled) as `mode` says, and its optimizer."""
    model = copy.deepcopy(base)
    kind, _, number = mode.partition("_")
    cfg = ParallelismConfig(activation_checkpointing=ActivationCheckpointing(kind if kind in ("full", "selective",
                                                                                          "budget") else "off"),
                            activation_budget=1.0)
    if kind == "every":
        cfg.activation_checkpointing, cfg.activation_checkpointing_every = ActivationCheckpointing.full, int(number)
    if kind == "budget":
        cfg.activation_budget = float(number)
    checkpoint_activations(model, cfg)  # budget: sets torch._functorch.config.activation_memory_budget
    if kind == "compiled":
        from torch._functorch import config as functorch_config

        functorch_config.activation_memory_budget = 1.0
    if kind in ("compiled", "budget"):
        model = torch.compile(model)  # compiled now, under this mode's budget
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def measure(modes: list[str], base: GPT, batch: tuple[torch.Tensor, torch.Tensor], steps: int,
            what: str) -> dict[str, dict[str, Any]]:
    """Per mode: its losses and the median step time (`time`), or the peak of one step and what a compiled
    graph saves (`memory`)."""
    inputs, targets = batch
    runs, out, models = {}, {}, {}
    compiled = [mode for mode in modes if mode.startswith(("compiled", "budget"))]
    for mode in modes:  # compiled (in its mode's budget) and warmed up one mode at a time
        model, optimizer = prepared(mode, base)
        models[mode] = model

        def step(model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> float:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        out[mode] = {"losses": [step(), step()]}  # compilation and the optimizer's state
        runs[mode] = step
    if what == "memory":
        for mode, step in runs.items():
            out[mode]["peak_mib"] = step_peak_bytes(step) / 2**20
            out[mode]["saved_mib"] = saved_bytes(models[mode], inputs) / 2**20 if mode in compiled else None
        return out
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode, step in runs.items():
            begin = time.perf_counter()
            out[mode]["losses"].append(step())
            times[mode].append(time.perf_counter() - begin)
    for mode in modes:
        out[mode]["step_s"] = statistics.median(times[mode])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds; each mode's fastest median counts")
    parser.add_argument("--modes", nargs="+", default=["off", "full", "selective", "every_2", "compiled_off",
                                                       "budget_0.5", "budget_0.1"])
    parser.add_argument("--measure", choices=("memory", "time"), help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    torch.manual_seed(0)
    base = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1))
    if args.measure:
        print(json.dumps(measure(args.modes, base, (tokens[:, :-1], tokens[:, 1:]), args.steps, args.measure)))
        return
    # memory in a process of its own with glibc's mmap threshold fixed (read at its start); time in one without
    # it, where mapping every large block would slow the steps down
    # and each mode in processes of its own: dynamo reuses a compiled graph for another instance of the same
    # model, so a second budget in one process would run the first one's graph
    results: dict[str, dict[str, Any]] = {}
    sizes = [f"--{key}={getattr(args, key)}" for key in ("layers", "width", "seq", "batch", "steps")]

    def child(mode: str, what: str, env: dict[str, str]) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, __file__, *sizes, "--modes", mode, "--measure", what],
                              env={**os.environ, **env}, capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])[mode]

    for mode in args.modes:
        results[mode] = child(mode, "memory", {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    for _ in range(args.rounds):  # the modes in turn, round after round: a busy spell falls on one round, not a mode
        for mode in args.modes:
            step_s = child(mode, "time", {})["step_s"]
            results[mode]["step_s"] = min(step_s, results[mode].get("step_s", step_s))
    reference = results[args.modes[0]]
    print(f"GPT {args.layers} x {args.width}, batch {args.batch} x {args.seq} tokens, AdamW, fp32, "
          f"{torch.get_num_threads()} threads; step time: the fastest of {args.rounds} medians of {args.steps} steps")
    print(f"| mode | peak MiB of a step | vs {args.modes[0]} | step time s | vs {args.modes[0]} | "
          f"compiled graph saves MiB | max loss diff vs {args.modes[0]} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"], strict=True))
        saved = f"{r['saved_mib']:.1f}" if r["saved_mib"] is not None else "-"
        print(f"| {mode} | {r['peak_mib']:.1f} | {r['peak_mib'] / reference['peak_mib']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / reference['step_s']:.2f} | {saved} | {diff:.1e} |")


if __name__ == "__main__":
    main()
