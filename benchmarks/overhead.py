"""What trainflow's loop costs over a loop without trainflow, and what its start-up costs over a bare script.

The seed MLP is `experiment=seed_mlp`: an MLP on synthetic features, batch 64, SGD at a constant LR, eager, one
process. The hand-written loop is the loop a user writes by hand for it: each step a fresh random batch,
zero_grad, forward, loss, backward, step; no data path, no schedule, no log. The plain loop does the same work
as the trainflow run it is compared with (model, optimizer, schedule, batches, threads) without trainflow.

Throughput: trainflow's `train()` and the plain loop train the same model on the same batches with the same
threads, alternating in one process; each round's steady state (after warm-up) is compared, and the median
ratio trainflow / plain loop is reported.

The seed MLP against the hand-written loop: the ratio of the median rates, alternating rounds in one process;
the same ratio from blocks of 100 steps of each loop alternating inside one run (`LiteralBlocks`, the figure
least moved by a noisy machine: neighbouring blocks share its regime); and where trainflow's extra
microseconds per step go (cProfile of one run: the time of each call the loop makes, per step; cProfile's own
cost inflates every figure alike, so read them as shares); with --cpu-time also part by part: the hand-written
loop with trainflow's parts added one at a time, then trainflow's own step and loop.

Start-up: `python train.py trainer.max_steps=1 trainer.eval_steps=1` against a bare script that imports torch,
builds the same model, takes one step and evaluates one batch, alternating as separate processes.

    python benchmarks/overhead.py [--rounds 5] [--steps 60] [--only-literal] [--cpu-time] [--watchdog]
                                  [--logger '[tensorboard,mlflow]']
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from torch import nn

from trainflow.cli import register_with_hydra
from trainflow.conf import CONFIG_DIR
from trainflow.config.checks import check_config
from trainflow.data import StreamSampler, build_datasets, make_loader
from trainflow.distributed.process_group import process_group
from trainflow.loop.stages import Stage
from trainflow.loop.step import train_step
from trainflow.models import build_model
from trainflow.optim import build_optimizer, schedule_changes_lr
from trainflow.run.assembly import assemble
from trainflow.run.training import train, train_loop
from trainflow.tasks import build_task, cross_entropy

ROOT = Path(__file__).resolve().parents[1]
register_with_hydra()  # before composing configs, as train.py does

# name -> (overrides, steps multiplier): the MLP's ~1 ms steps need many more of them to time.
CASES = {
    "gpt_tiny": (["model=gpt_tiny", "data=text", "trainer.batch_size=16", "optim=adamw"], 1),
    "seed_mlp": (["experiment=seed_mlp"], 50),
}
COMMON = ["compile=off", "logger=none", "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.grad_clip=0"]


def trainflow_rate(cfg) -> float:
    """Steady-state samples/s of trainflow's own loop, as its summary reports it."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp))
    return summary["steady_state"]["samples_per_sec"]


def handwritten_rate(cfg, steps: int, warmup: int) -> float:
    """The plain loop: the same model, optimizer, schedule, batches and threads as trainflow's run."""
    torch.manual_seed(cfg.trainer.seed)
    data = build_datasets(cfg.data, cfg.model.vocab_size is not None)
    model = build_model(cfg.model._target_, cfg.model.kwargs)
    optimizer, scheduler = build_optimizer(model, cfg.optim, steps, torch.device("cpu"))
    b, n = cfg.trainer.batch_size, len(data.train)
    per_epoch = n // b
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        if step % per_epoch == 0:  # a fresh shuffle each epoch, as DataLoader(shuffle=True) does
            order = torch.randperm(n)
        first = step % per_epoch * b
        inputs, targets = data.train[order[first:first + b]]
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return (steps - warmup) * b / (time.perf_counter() - start)


class LiteralLoop:
    """The hand-written loop: a fresh random batch each step, zero_grad, forward, loss, backward, step."""

    def __init__(self, cfg, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = build_model(cfg.model._target_, cfg.model.kwargs)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.optim.lr,
                                         momentum=cfg.optim.kwargs["momentum"])
        self.criterion = nn.CrossEntropyLoss()
        self.shape = (cfg.trainer.batch_size, cfg.model.kwargs["in_features"], cfg.model.kwargs["out_features"])

    def steps(self, count: int) -> None:
        batch, features, classes = self.shape
        for _ in range(count):
            inputs, targets = torch.randn(batch, features), torch.randint(classes, (batch,))
            self.optimizer.zero_grad()
            loss = self.criterion(self.model(inputs), targets)
            loss.backward()
            self.optimizer.step()


def literal_rate(cfg, steps: int, warmup: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Samples per second of the hand-written loop after `warmup` of its `steps`."""
    loop = LiteralLoop(cfg, cfg.trainer.seed)
    loop.steps(warmup)
    start = clock()
    loop.steps(steps - warmup)
    return (steps - warmup) * cfg.trainer.batch_size / (clock() - start)


def trainflow_cpu_rate(cfg_of: Callable[[int], Any], steps: int, warmup: int) -> float:
    """Samples per second of this thread's CPU time in trainflow's steady state: `train()` for `steps` and for
    `warmup` steps, the difference divided by the steps between (what both share, the set-up, cancels)."""
    cpu_s = []
    for length in (steps, warmup):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.thread_time()
            train(cfg_of(length), Path(tmp))
            cpu_s.append(time.thread_time() - start)
    return (steps - warmup) * cfg_of(steps).trainer.batch_size / (cpu_s[0] - cpu_s[1])


# trainflow's functions that make up its loop: the calls they make are the causes of its per-step time
LOOP_FUNCTIONS = {"train_step", "train_loop"}


def step_breakdown(cfg, steps: int, clock: Callable[[], float], top: int = 14) -> list[tuple[str, float]]:
    """(cause, microseconds per step) of trainflow's loop under cProfile: each call the loop functions make, with
    everything beneath it, and the loop functions' own lines ("(own lines)")."""
    profiler = cProfile.Profile(clock)
    with tempfile.TemporaryDirectory() as tmp:
        profiler.runcall(train, cfg, Path(tmp))
    stats = pstats.Stats(profiler).stats
    by_cause: dict[str, float] = {}
    for (filename, line, name), (_, _, own, _, callers) in stats.items():
        for (_, _, caller), (_, _, _, cumulative) in callers.items():
            if caller in LOOP_FUNCTIONS and name not in LOOP_FUNCTIONS:
                cause = f"{name} ({Path(filename).name}:{line})" if filename != "~" else name
                by_cause[cause] = by_cause.get(cause, 0.0) + cumulative
        if name in LOOP_FUNCTIONS:
            by_cause["(own lines)"] = by_cause.get("(own lines)", 0.0) + own
    ranked = sorted(by_cause.items(), key=lambda kv: kv[1], reverse=True)
    return [(cause, seconds / steps * 1e6) for cause, seconds in ranked[:top]]


def literal_comparison(rounds: int, steps: int, warmup: int, cpu_time: bool) -> None:
    """Seed MLP: trainflow against the hand-written loop, and trainflow's step by cause.

    `cpu_time`: CPU time of the one thread both run on instead of wall time, for a machine other work shares
    (its load slows both sides unevenly, in bursts); the same work is measured, less the waits for a core."""

    def cfg_of(length: int):
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            overrides = ["experiment=seed_mlp", *COMMON, f"trainer.max_steps={length}",
                         f"trainer.excluded_steps={warmup}", "trainer.log_every=50"]
            return check_config(compose("train", overrides=overrides))

    cfg, clock = cfg_of(steps), time.thread_time if cpu_time else time.perf_counter
    trainflow_cpu_rate(cfg_of, warmup + 1, warmup) if cpu_time else trainflow_rate(cfg)  # imports, caches: not a round
    literal_rate(cfg, warmup + 1, warmup, clock)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(trainflow_cpu_rate(cfg_of, steps, warmup) if cpu_time else trainflow_rate(cfg))
        theirs.append(literal_rate(cfg, steps, warmup, clock))
    step_us = [1e6 * cfg.trainer.batch_size / rate for rate in ours]
    literal_us = [1e6 * cfg.trainer.batch_size / rate for rate in theirs]
    print(f"seed_mlp  {'CPU time' if cpu_time else 'wall time'}, {torch.get_num_threads()} thread(s)")
    print(f"seed_mlp  throughput trainflow / hand-written: {statistics.median(ours) / statistics.median(theirs):.3f} "
          f"(ratio of medians; per round {', '.join(f'{a / b:.3f}' for a, b in zip(ours, theirs, strict=True))}); "
          f"step: trainflow {statistics.median(step_us):.0f} us ({min(step_us):.0f}-{max(step_us):.0f}), "
          f"hand-written {statistics.median(literal_us):.0f} us ({min(literal_us):.0f}-{max(literal_us):.0f})")
    interleaved(cfg_of, pairs=10 * rounds, block=100, warmup=warmup, cpu_time=cpu_time)
    print("seed_mlp  trainflow's step under cProfile, microseconds per step by cause:")
    for cause, micros in step_breakdown(cfg, steps, clock):
        print(f"  {micros:8.1f}  {cause}")
    if cpu_time:
        rounds_of_parts = [part_by_part(cfg_of, steps, warmup) for _ in range(rounds)]
        print(f"seed_mlp  CPU microseconds per step, part by part (median of {rounds} rounds, spread):")
        for name in rounds_of_parts[0]:
            values = [r[name] for r in rounds_of_parts]
            print(f"  {statistics.median(values):7.1f}  ({min(values):.0f}-{max(values):.0f})  {name}")


class LiteralBlocks(Stage):
    """A stage that, after every `block` steps of trainflow's loop, runs `block` steps of the hand-written loop
    (its own model, optimizer and fresh random batches) and times both blocks by `clock`. The two loops then meet
    the machine in the same seconds, so a change of regime (another process's load, the cores' clocks, how torch's
    threads land) hits both alike, and each pair of neighbouring blocks gives one ratio."""

    def __init__(self, cfg, block: int, warmup: int, clock: Callable[[], float]) -> None:
        self.literal = LiteralLoop(cfg, cfg.trainer.seed + 1)
        self.block, self.warmup, self.clock = block, warmup, clock
        self.trainflow_s: list[float] = []  # per step, of each trainflow block (stages, log steps and all)
        self.literal_s: list[float] = []  # per step, of the hand-written block that follows it
        self._mark: float | None = None
        self.literal.steps(warmup)

    def after_step(self, state) -> bool:
        if state.steps_this_run < self.warmup or state.steps_this_run % self.block:
            return False
        if self._mark is not None:
            self.trainflow_s.append((self.clock() - self._mark) / self.block)
        start = self.clock()
        self.literal.steps(self.block)
        self._mark = self.clock()
        self.literal_s.append((self._mark - start) / self.block)  # pairs with the trainflow block after it
        return False


def interleaved(cfg_of: Callable[[int], Any], pairs: int, block: int, warmup: int, cpu_time: bool) -> None:
    """Seed MLP: trainflow's loop and the hand-written loop in alternating blocks of one run (`LiteralBlocks`); the
    median over the pairs of blocks of hand-written step time / trainflow step time (trainflow's relative
    throughput)."""
    cfg = cfg_of(warmup + block * (pairs + 1))
    clock = time.thread_time if cpu_time else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp, process_group(cfg) as env:
        assembled = assemble(cfg, Path(tmp), env)
        blocks = LiteralBlocks(cfg, block, warmup, clock)
        assembled.stages.append(blocks)
        train_loop(assembled)
        assembled.ctx.writer.close()
    # the hand-written blocks are one more than trainflow's (the last has no trainflow block after it)
    ratios = [literal / ours for literal, ours in zip(blocks.literal_s, blocks.trainflow_s, strict=False)]
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"seed_mlp  interleaved, {'CPU time' if cpu_time else 'wall time'}, {torch.get_num_threads()} thread(s), "
          f"{len(ratios)} pairs of {block}-step blocks: trainflow / hand-written {statistics.median(ratios):.3f} "
          f"(median of the pairs; quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}); step: trainflow "
          f"{1e6 * statistics.median(blocks.trainflow_s):.0f} us, "
          f"hand-written {1e6 * statistics.median(blocks.literal_s):.0f} us")


def part_by_part(cfg_of: Callable[[int], Any], steps: int, warmup: int) -> dict[str, float]:
    """Microseconds of this thread's CPU time per step: the hand-written loop with trainflow's parts added one at a
    time (the data path; the optimizer and schedule as trainflow builds them; the loss; the task's metrics computed
    every step, which trainflow does only at log steps unless task.train_metrics=every_step), then
    trainflow's `train_step` alone, its `train_loop` with the stage list emptied, and the whole loop."""
    cfg = cfg_of(steps)
    data = build_datasets(cfg.data, cfg.model.vocab_size is not None)
    timed = {}

    task = build_task(cfg.task, data.is_lm)  # classify: the loss, accuracy and top-5 accuracy of every step

    def literal_with(data_path: bool, optimizer_and_schedule: bool, trainflow_loss: bool,
                     metrics: bool = False) -> float:
        torch.manual_seed(cfg.trainer.seed)
        model = build_model(cfg.model._target_, cfg.model.kwargs)
        if optimizer_and_schedule:
            optimizer, scheduler = build_optimizer(model, cfg.optim, steps, torch.device("cpu"))
            scheduler = scheduler if schedule_changes_lr(cfg.optim) else None  # as train_step does
        else:
            optimizer, scheduler = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr,
                                                   momentum=cfg.optim.kwargs["momentum"]), None
        sampler = StreamSampler(len(data.train), cfg.trainer.batch_size, 0, 1, cfg.trainer.seed)
        batches = iter(make_loader(data.train, sampler, cfg.data, False))
        criterion = nn.CrossEntropyLoss()
        mlp = cfg.model.kwargs
        batch, features, classes = cfg.trainer.batch_size, mlp["in_features"], mlp["out_features"]
        for step in range(steps):
            if step == warmup:
                start = time.thread_time()
            if data_path:
                inputs, targets = next(batches)
            else:
                inputs, targets = torch.randn(batch, features), torch.randint(classes, (batch,))
            optimizer.zero_grad()
            if metrics:
                loss = task(model, (inputs, targets))[0]
            else:
                loss = cross_entropy(model(inputs), targets) if trainflow_loss else criterion(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        return (time.thread_time() - start) / (steps - warmup)

    def trainflow_with(part: str) -> float:
        cpu_s = []
        for length in (steps, warmup):
            cfg_run = cfg_of(length)
            with tempfile.TemporaryDirectory() as tmp, process_group(cfg_run) as env:
                assembled = assemble(cfg_run, Path(tmp), env)
                start = time.thread_time()
                if part == "train_step":
                    inputs = assembled.step_inputs
                    inputs.state.model.train()
                    while inputs.state.step < length:
                        train_step(inputs)
                else:
                    assembled.stages = assembled.stages if part == "train_loop" else []
                    train_loop(assembled)
                cpu_s.append(time.thread_time() - start)
                assembled.ctx.writer.close()
        return (cpu_s[0] - cpu_s[1]) / (steps - warmup)

    timed["hand-written loop"] = literal_with(False, False, False)
    timed["+ trainflow's data path"] = literal_with(True, False, False)
    timed["+ trainflow's optimizer and LR schedule (build_optimizer)"] = literal_with(True, True, False)
    timed["+ its cross_entropy"] = literal_with(True, True, True)
    timed["+ the task's metrics every step (task.train_metrics=every_step)"] = literal_with(True, True, True,
                                                                                           metrics=True)
    timed["trainflow train_step alone"] = trainflow_with("train_step")
    timed["trainflow train_loop, no stages"] = trainflow_with("no stages")
    timed["trainflow train_loop"] = trainflow_with("train_loop")
    return {name: seconds * 1e6 for name, seconds in timed.items()}


def startup_times(rounds: int) -> tuple[float, float]:
    """Median wall time of a process that takes one training step and one validation batch: `python train.py`
    vs a bare script doing the same on the same model."""
    bare = (
        "import torch, torch.nn.functional as F\n"
        "from trainflow.models.gpt import GPT\n"
        "torch.manual_seed(0); m = GPT(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)\n"
        "x = torch.randint(256, (16, 129))\n"
        "F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward(); opt.step()\n"
        "with torch.no_grad(): F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item()\n"
    )
    ours, theirs = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "train.py", "trainer.max_steps=1", "trainer.eval_steps=1", "compile=off",
                            "logger=none", f"hydra.run.dir={tmp}"], cwd=ROOT, check=True, capture_output=True)
            ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", bare], cwd=ROOT, check=True, capture_output=True)
        theirs.append(time.perf_counter() - t0)
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only-literal", action="store_true", help="only the seed MLP against the hand-written loop")
    parser.add_argument("--cpu-time", action="store_true",
                        help="the hand-written-loop comparison in one thread's CPU time (for a machine under load)")
    parser.add_argument("--watchdog", action="store_true",
                        help="trainflow with its hang watchdog on (by default on only for runs of 2+ ranks)")
    parser.add_argument("--logger", default="none",
                        help="trainflow's loggers, e.g. [tensorboard,mlflow] (MLflow: a SQLite store in a temporary "
                             "folder); default none")
    args = parser.parse_args()
    if args.watchdog:
        COMMON.append("parallelism.watchdog.enabled=true")
    COMMON[COMMON.index("logger=none")] = f"logger={args.logger}"
    if "mlflow" in args.logger:
        store = Path(tempfile.mkdtemp()) / "mlflow.db"
        COMMON.append(f"logger.mlflow.tracking_uri=sqlite:///{store}")
    logging.disable(logging.INFO)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    multiplier = CASES["seed_mlp"][1]
    if args.cpu_time:
        torch.set_num_threads(1)
    literal_comparison(args.rounds, args.steps * multiplier, args.warmup * multiplier, args.cpu_time)
    if args.only_literal:
        return
    for name, (overrides, multiplier) in CASES.items():
        steps, warmup = args.steps * multiplier, args.warmup * multiplier
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = check_config(compose("train", overrides=[*overrides, *COMMON, f"trainer.max_steps={steps}",
                                                       f"trainer.excluded_steps={warmup}",
                                                       f"trainer.log_every={steps}"]))
        ratios = []
        for _ in range(args.rounds):
            ours = trainflow_rate(cfg)
            theirs = handwritten_rate(cfg, steps, warmup)
            ratios.append(ours / theirs)
        print(f"{name:9s} throughput trainflow / plain loop: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); last plain loop {theirs:.0f} samples/s")
    ours, theirs = startup_times(args.rounds)
    print(f"time to first step: train.py {ours:.2f} s, bare script {theirs:.2f} s, difference {ours - theirs:.2f} s")


if __name__ == "__main__":
    main()
