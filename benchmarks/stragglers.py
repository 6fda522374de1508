"""What measuring stragglers costs a multi-rank run: the marks of every step and the log step's all-gather.

Two real gloo ranks train gpt_tiny under DDP. Each round times a stretch of steps without the stragglers stage
(the step as trainflow takes it, the baseline) and the same number of steps with it (the hook on the last
gradient, the two end-of-backward callbacks, a clock read after the step), alternating in the same processes, and
reports the median ratio of the step times. Then it times the log step's collective: the stage's all-gather of
every rank's three means, against the all-reduce the train metrics already make at every log step.

    flock /tmp/trainflow-bench.lock .venv/bin/python benchmarks/stragglers.py [--rounds 7] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trainflow.config.schema import StragglerConfig
from trainflow.distributed import DistEnv
from trainflow.guards.stragglers import Stragglers
from trainflow.loop.meter import PeakMemory, Throughput
from trainflow.loop.state import LoopState
from trainflow.models.gpt import GPT

CPU = torch.device("cpu")


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int,
           stage: Stragglers | None, state: LoopState) -> float:
    """Seconds per step of `steps` training steps (the stage, when given, acts after each as in the loop)."""
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if stage is not None:
            state.steps_this_run += 1
            stage.after_step(state)
    return (time.perf_counter() - start) / steps


def _collective_s(op, repeats: int = 200) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        op()
    return (time.perf_counter() - start) / repeats


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (8, 33))
    env = DistEnv(rank, 2, rank, CPU, "ddp")
    stage = Stragglers(StragglerConfig(factor=1e9), env, Throughput(0, CPU, PeakMemory(CPU)))  # measure, name no one
    state = LoopState(model, optimizer, None)
    stage.wrap_model(model)
    stage.__enter__()
    _steps(model, optimizer, batch, 3, stage, state)  # warm-up; the first step keeps one hook
    ratios = []
    for round_ in range(args.rounds):  # the order alternates, so that drift favours neither
        times = {}
        for marks in (False, True) if round_ % 2 else (True, False):
            stage._previous = time.perf_counter()
            times[marks] = _steps(model, optimizer, batch, args.steps, stage if marks else None, state)
        ratios.append(times[True] / times[False])
    plain = times[False]
    state.log_due = True  # the stage's after_step at a log step: its bookkeeping and the gather
    gather = _collective_s(lambda: stage.after_step(state))
    reduce = _collective_s(lambda: dist.all_reduce(torch.zeros(4)))
    if rank == 0:
        print(f"step with the marks / without, median of {args.rounds} rounds of {args.steps} steps: "
              f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}); a step "
              f"{plain * 1e3:.1f} ms")
        print(f"log step: the stage's all-gather {gather * 1e3:.3f} ms (its table and judgement included), the train "
              f"metrics' all-reduce {reduce * 1e3:.3f} ms; load average {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
