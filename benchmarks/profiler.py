"""What `profiler=schedule` costs on the steps it does not record, against `profiler=off`.

One process trains one model with the training loop's shape (the same `record_function` annotations as
`run.py`, one `Profiler.step()` per step) in alternating blocks: a block with the profiler off, then a
block with it on a schedule whose window closes early in the block, and so on. Only the steps the profiler
does not record are timed: its idle wait steps and every step after its window closed (the window itself,
its warm-up and the step that exports the trace are left out). Per pair of blocks, the median step time
with the profiler on is divided by the median with it off; the median over pairs is the cost (goal: a
throughput loss of at most 2%). Alternating blocks in one process keeps a busy machine's slow drift out of
the ratio, not its fast jitter; so the time of the `profiler.step()` calls themselves (the only code that
differs on those steps) is measured too, and given as a share of the median step.

    python benchmarks/profiler.py [--pairs 20] [--steps 30] [--threads 1] [--cases tiny,gpt_tiny]

One intra-op thread by default: on a busy 2-core machine, waits at intra-op barriers make tiny steps jump
between milliseconds and a hundred, which drowns a per-step cost of microseconds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from trainflow.config.schema import ProfilerConfig
from trainflow.distributed import DistEnv
from trainflow.metrics.verdict import DATA, FWD_BWD, OPTIMIZER
from trainflow.models.gpt import GPT
from trainflow.profile.profiler import Profiler
from trainflow.tasks import cross_entropy

CASES = {  # model keyword arguments, batch size
    "tiny": (dict(n_layer=2, n_embd=64, n_head=2, block_size=32), 8),  # milliseconds per step: worst case
    "gpt_tiny": (dict(n_layer=4, n_embd=256, n_head=4, block_size=128), 16),  # the default model
}
WAIT, WARMUP, ACTIVE = 6, 1, 2  # the window closes at step 9; steps 1-6 and 11.. are unrecorded
PHASES = ("first", "wait", "after")  # step 1 (the profiler's first step() call), steps 2-6, steps 11..
ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def block(model: GPT, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int, on: bool,
          run_dir: Path) -> tuple[list[float], dict[str, list[float]]]:
    """Wall times of the unrecorded steps of one block, and of the `profiler.step()` calls in them by phase."""
    cfg = ProfilerConfig(enabled=on, skip_first=0, wait=WAIT, warmup=WARMUP, active=ACTIVE)
    profiler = Profiler(cfg, ENV, run_dir, max_steps=steps)
    times: list[float] = []
    calls: dict[str, list[float]] = {phase: [] for phase in PHASES}
    with profiler:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            with record_function(DATA):
                inputs, targets = batch[:, :-1], batch[:, 1:]
            with record_function(FWD_BWD):
                cross_entropy(model(inputs), targets).backward()
            with record_function(OPTIMIZER):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            before_step = time.perf_counter()
            profiler.step()
            end = time.perf_counter()
            if step <= WAIT or step > WAIT + WARMUP + ACTIVE + 1:
                times.append(end - start)
                calls["first" if step == 1 else "wait" if step <= WAIT else "after"].append(end - before_step)
    return times, calls


def compare(case: str, pairs: int, steps: int) -> list[float]:
    """Print each pair's on/off ratio of median step times and the cost of the profiler.step() calls; return
    the ratios."""
    kwargs, batch_size = CASES[case]
    torch.manual_seed(0)
    model = GPT(**kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(256, (batch_size, kwargs["block_size"] + 1))
    block(model, optimizer, batch, 5, False, Path("."))  # warm up allocator and caches
    ratios, off_steps = [], []
    calls: dict[tuple[bool, str], list[float]] = {(on, p): [] for on in (False, True) for p in PHASES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            medians = []
            for on in (False, True):
                times, phase_calls = block(model, optimizer, batch, steps, on, Path(tmp))
                medians.append(statistics.median(times))
                off_steps += times if not on else []
                for phase, values in phase_calls.items():
                    calls[(on, phase)] += values
            ratios.append(medians[1] / medians[0])
            print(f"{case} pair {i + 1}: median unrecorded step {medians[0] * 1e3:.3f} ms off, "
                  f"{medians[1] * 1e3:.3f} ms schedule: ratio {ratios[-1]:.4f}", flush=True)
    step = statistics.median(off_steps)
    for phase in PHASES:
        on, off = (statistics.median(calls[(flag, phase)]) for flag in (True, False))
        print(f"{case}: profiler.step() on the {phase} steps: {on * 1e6:.1f} us on, {off * 1e6:.1f} us off: "
              f"{(on - off) / step * 100:.3f}% of the median {step * 1e3:.2f} ms step")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cases", default="tiny,gpt_tiny")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for case in args.cases.split(","):
        ratios = compare(case, args.pairs, args.steps)
        median = statistics.median(ratios)
        print(f"{case}: schedule/off unrecorded step time, median of {args.pairs} pairs = {median:.4f} "
              f"(throughput loss {(1 - 1 / median) * 100:+.2f}%; pairs {min(ratios):.4f}..{max(ratios):.4f})")


if __name__ == "__main__":
    main()
