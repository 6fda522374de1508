"""The data path's cost on an experiment: data-wait fraction and steady-state throughput, data.num_workers 0 vs 2.

Both settings train the same experiment for the same steps in one process, alternating round by round, so that
the machine's load falls on both alike; each round's steady state (after warm-up) comes from the run's own
summary. Reported: the median samples/s and data-wait fraction of each, and the median of the per-round ratios
(workers 2 / workers 0). With 0 workers, items are gathered and collated in the training process, between steps;
with 2, worker processes prepare the next batches while the step runs.

    python benchmarks/data_path.py [--experiment digits] [--rounds 3] [--steps 150] [--threads N] [override ...]

--threads sets torch's intra-op threads: on a machine whose cores other processes also use, two threads of a
small model's step wait on each other (measured here: 7 ms a step with one thread, 40-80 ms with two), which
would drown the data path's own cost.

A user's project: add its conf folder and its package, e.g.
`PYTHONPATH=examples/my_project python benchmarks/data_path.py --experiment my_project
--config-dir examples/my_project/conf`.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from trainflow.cli import register_with_hydra
from trainflow.run import run
from trainflow.validation import validate

ROOT = Path(__file__).resolve().parents[1]
register_with_hydra()  # before composing configs, as train.py does
COMMON = ["compile=off", "logger=none", "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.warmup_steps=10",
          "trainer.log_every=50"]
WORKERS = {0: ["data.num_workers=0"], 2: ["data.num_workers=2", "data.persistent_workers=true"]}


def steady(cfg_dir: Path, extra_dir: Path | None, overrides: list[str]) -> dict[str, float]:
    """One run's steady-state samples/s and data-wait fraction, from its summary."""
    with initialize_config_dir(str(cfg_dir), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, *([f"hydra.searchpath=[file://{extra_dir}]"] if extra_dir
                                                        else [])])
    cfg = validate(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(cfg, Path(tmp))
    return {"samples_per_sec": summary["steady_state"]["samples_per_sec"],
            "data_wait_fraction": summary["data_wait_fraction"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="digits")
    parser.add_argument("--config-dir", type=Path, default=None, help="a user's conf folder, searched after conf/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default: torch's")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("trainflow").setLevel(logging.WARNING)
    base = [f"experiment={args.experiment}", *COMMON, f"trainer.max_steps={args.steps}", *args.overrides]
    extra = args.config_dir.resolve() if args.config_dir else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; experiment={args.experiment}, "
          f"{args.rounds} rounds x {args.steps} steps (steady state after 10 warm-up steps)")
    results: dict[int, list[dict[str, float]]] = {n: [] for n in WORKERS}
    for _ in range(args.rounds):
        for n, loader in WORKERS.items():
            results[n].append(steady(ROOT / "conf", extra, [*base, *loader]))
    for n, rounds in results.items():
        print(f"num_workers={n}: {statistics.median(r['samples_per_sec'] for r in rounds):8.1f} samples/s, "
              f"data wait {statistics.median(r['data_wait_fraction'] for r in rounds) * 100:5.1f}% of the step "
              f"(median of {len(rounds)})")
    ratios = [b["samples_per_sec"] / a["samples_per_sec"] for a, b in zip(results[0], results[2], strict=True)]
    print(f"throughput num_workers=2 / num_workers=0: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
