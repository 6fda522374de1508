"""What trainflow's loop costs over a hand-written one, and what its start-up costs over a bare script.

Throughput: trainflow's `run()` and the seed article's plain loop train the same model on the same batches
with the same threads, alternating in one process; each round's steady state (after warm-up) is compared,
and the median ratio trainflow / hand-written is reported.

Start-up: `python train.py trainer.max_steps=1 trainer.eval_steps=1` against a bare script that imports torch,
builds the same model, takes one step and evaluates one batch, alternating as separate processes.

    python benchmarks/overhead.py [--rounds 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from trainflow.cli import register_with_hydra
from trainflow.data import build_datasets
from trainflow.optim import build_optimizer
from trainflow.run import run
from trainflow.tasks import cross_entropy

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
        summary = run(cfg, Path(tmp))
    return summary["steady_state"]["samples_per_sec"]


def handwritten_rate(cfg, steps: int, warmup: int) -> float:
    """The seed article's loop on the same model, optimizer, batches and threads."""
    torch.manual_seed(cfg.trainer.seed)
    data = build_datasets(cfg.data, cfg.model)
    model = instantiate(cfg.model)
    optimizer, scheduler = build_optimizer(model, cfg.optim, steps, torch.device("cpu"))
    b, n = cfg.trainer.batch_size, len(data.train)
    per_epoch = n // b
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        if step % per_epoch == 0:  # a fresh shuffle each epoch, as the article's DataLoader(shuffle=True) does
            order = torch.randperm(n)
        first = step % per_epoch * b
        inputs, targets = data.train[order[first:first + b]]
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return (steps - warmup) * b / (time.perf_counter() - start)


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
    args = parser.parse_args()
    logging.disable(logging.INFO)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    for name, (overrides, multiplier) in CASES.items():
        steps, warmup = args.steps * multiplier, args.warmup * multiplier
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, *COMMON, f"trainer.max_steps={steps}",
                                              f"trainer.warmup_steps={warmup}", f"trainer.log_every={steps}"])
        ratios = []
        for _ in range(args.rounds):
            ours = trainflow_rate(cfg)
            theirs = handwritten_rate(cfg, steps, warmup)
            ratios.append(ours / theirs)
        print(f"{name:9s} throughput trainflow / hand-written: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); last hand-written {theirs:.0f} samples/s")
    ours, theirs = startup_times(args.rounds)
    print(f"time to first step: train.py {ours:.2f} s, bare script {theirs:.2f} s, difference {ours - theirs:.2f} s")


if __name__ == "__main__":
    main()
