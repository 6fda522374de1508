"""What parallelism buys on this machine: DDP-2, FSDP-2 and TP-2 against one process, same global batch.

Each variant is a real `python train.py` run (the parallel ones start their 2 workers themselves) on the same
model, data and global batch (one process: 2 x the per-rank batch). Rounds interleave the variants (A B C,
A B C, ...) so that drift on a shared machine hits them alike; the table gives each variant's median
steady-state throughput (warm-up excluded), in total and per rank, and its ratio to one process. One extra
short run per parallel variant under `profiler=schedule` gives the communication share of a step. A
one-process run on one thread (one core, what each rank has) gives the scaling efficiency: throughput over
ranks x that run's. TP-2 splits each layer over the 2 ranks, which read one batch together (the global batch),
and exchanges activations in every layer, over gloo here: what NVLink does for TP on GPUs this says nothing of.

On a CPU, one process already uses every core through intra-op threads; two ranks split the cores (one thread
each, as torchrun does) and add gradient communication, so the honest expectation there is a ratio below 1.
Data parallelism pays when each rank brings its own device. On a machine that other work keeps busy the
comparison tilts the other way: a process whose threads meet at the end of every parallel operator waits for its
slowest, preempted thread, single-threaded ranks do not. The load average is printed with the figures for that reason.

    flock /tmp/trainflow-bench.lock .venv/bin/python benchmarks/scale.py [--rounds 3] [--steps 20] [--batch 8]
        [--no-profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["logger=none", "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.progress=log", "compile=off"]
VARIANTS = {  # name -> (overrides, ranks, data-parallel ranks, environment)
    "single": (["parallelism=single"], 1, 1, {}),
    "single-1-thread": (["parallelism=single"], 1, 1, {"OMP_NUM_THREADS": "1"}),  # what one rank has: one core
    "ddp-2": (["parallelism=ddp", "parallelism.nproc_per_node=2"], 2, 2, {}),
    "fsdp-2": (["parallelism=fsdp", "parallelism.nproc_per_node=2"], 2, 2, {}),
    "tp-2": (["parallelism=ddp", "parallelism.tp=2", "parallelism.nproc_per_node=2"], 2, 1, {}),
}


def train(run_dir: Path, overrides: list[str], env: dict[str, str]) -> dict:
    """One `python train.py` run; its summary.json."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch of the 2-rank variants")
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled runs (communication share)")
    args = parser.parse_args()

    base = [f"model={args.model}", "data=text", f"trainer.max_steps={args.steps}",
            f"trainer.excluded_steps={args.warmup}", f"trainer.log_every={args.steps}", *COMMON]
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    load_before = os.getloadavg()[0]
    comm: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="trainflow-scale-") as tmp:
        for r in range(args.rounds):
            for name, (overrides, _, dp, env) in VARIANTS.items():
                batch = args.batch * 2 // dp  # the same global batch for every variant
                summary = train(Path(tmp) / f"{name}-{r}", [*base, *overrides, f"trainer.batch_size={batch}"], env)
                samples[name].append(summary["steady_state"]["tokens_per_sec"])
                print(f"round {r + 1}/{args.rounds} {name}: {samples[name][-1]:.0f} tokens/s", flush=True)
        for name, (overrides, ranks, dp, env) in VARIANTS.items():
            if ranks == 1 or args.no_profile:
                continue
            profiled = [*base, *overrides, f"trainer.batch_size={args.batch * 2 // dp}", "profiler=schedule",
                        "trainer.max_steps=12", "trainer.excluded_steps=1", "profiler.wait=1"]
            verdict = (train(Path(tmp) / f"{name}-profiled", profiled, env).get("profiler") or {}).get("verdict") or {}
            comm[name] = verdict.get("shares", {}).get("communication")

    load = (load_before, os.getloadavg()[0])
    single = statistics.median(samples["single"])
    one_core = statistics.median(samples["single-1-thread"])
    rows = []
    for name, (_, ranks, _, _) in VARIANTS.items():
        total = statistics.median(samples[name])
        rows.append({"variant": name, "ranks": ranks, "global_batch": args.batch * 2,
                     "tokens_per_sec_total": total, "tokens_per_sec_per_rank": total / ranks,
                     "vs_single": total / single, "scaling_efficiency": total / (ranks * one_core),
                     "communication_share": comm.get(name), "rounds": samples[name], "load_average": load})
    print(f"\n{args.model}, global batch {args.batch * 2}, {args.steps} steps ({args.warmup} warm-up), "
          f"median of {args.rounds} rounds; {os.cpu_count()} cores, load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after\n")
    print("| variant | ranks | tokens/s total | tokens/s per rank | vs single | vs ranks x 1 thread "
          "| communication share |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        share = row["communication_share"]
        print(f"| {row['variant']} | {row['ranks']} | {row['tokens_per_sec_total']:.0f} | "
              f"{row['tokens_per_sec_per_rank']:.0f} | {row['vs_single']:.2f}x | {row['scaling_efficiency']:.2f} | "
              f"{'-' if share is None else f'{share:.0%}'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
