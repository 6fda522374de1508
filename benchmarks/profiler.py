"""What `profiler=schedule` costs on the steps it does not record, against `profiler=off`.

Both runs go through trainflow's `run()` in this one process, alternating off / schedule each round, on the
same model, data and threads, logging every step. The steps compared are those outside the profiler's
warm-up and active window (and past the run's own warm-up): the profiler's idle `step()` calls and its
record_function step markers are all that differs there. Per round, the median step time of those steps
under schedule is divided by the same steps' median under off; the median over rounds is reported as the
throughput loss (goal: <= 2%).

    python benchmarks/profiler.py [--rounds 5] [--steps 60] [--cases tiny,gpt_tiny]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

import trainflow  # noqa: F401  (registers the schemas)
from trainflow.config import profiler_skip_and_end
from trainflow.run import run

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # milliseconds per step: the case where a fixed per-step cost shows most
    "tiny": ["model=gpt_tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32",
             "trainer.batch_size=8"],
    "gpt_tiny": ["model=gpt_tiny", "trainer.batch_size=16"],  # the default model: ~0.4 s per step on 2 cores
}
COMMON = ["data=synthetic", "compile=off", "logger=none", "trainer.eval_every=0", "trainer.eval_steps=1",
          "trainer.log_every=1", "trainer.warmup_steps=5", "trainer.progress=log"]


def step_times(overrides: list[str]) -> tuple[dict[int, float], object]:
    """Per-step wall times of one run (log_every=1), keyed by step; and its config."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with tempfile.TemporaryDirectory() as tmp:
        run(cfg, Path(tmp))
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["perf/step_time_s"] for r in records if "perf/step_time_s" in r}, cfg


def compare(case: str, rounds: int, steps: int) -> list[float]:
    """Per round: median time of the unrecorded steps under schedule / under off."""
    base = [*CASES[case], *COMMON, f"trainer.max_steps={steps}"]
    ratios = []
    for i in range(rounds):
        off, _ = step_times([*base, "profiler=off"])
        on, cfg = step_times([*base, "profiler=schedule"])
        p = cfg.profiler
        skip, end = profiler_skip_and_end(p, cfg.trainer.warmup_steps)
        traced = range(skip + p.wait + 1, end + 2)  # warm-up and active steps, and the one after (trace export)
        outside = [s for s in on if s > cfg.trainer.warmup_steps and s not in traced]
        ratio = statistics.median(on[s] for s in outside) / statistics.median(off[s] for s in outside)
        ratios.append(ratio)
        print(f"{case} round {i + 1}: {len(outside)} unrecorded steps, median step "
              f"{statistics.median(off[s] for s in outside) * 1e3:.2f} ms off, "
              f"{statistics.median(on[s] for s in outside) * 1e3:.2f} ms schedule: ratio {ratio:.4f}", flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cases", default="tiny,gpt_tiny")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for case in args.cases.split(","):
        ratios = compare(case, args.rounds, args.steps)
        median = statistics.median(ratios)
        print(f"{case}: schedule/off step time, median of {args.rounds} rounds = {median:.4f} "
              f"(throughput loss {(1 - 1 / median) * 100:+.2f}%; rounds {min(ratios):.4f}..{max(ratios):.4f})")


if __name__ == "__main__":
    main()
