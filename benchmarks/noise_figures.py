"""How much another process's load moves each candidate per-step figure of trainflow's own runs.

Each round runs the same `trainflow train` command twice: once as the machine is, once with two processes spinning
(`while True: pass`) beside it, which this script starts before the run and stops after it. From each run's
summary.json it reads the candidates: the mean step time of the steady state (wall time over its steps, the
headline figure), the process's CPU time per step (all its threads), the 10th percentile of single-step times, and
the median of the log intervals' mean step times. It prints, per candidate, the busy/idle ratio of every round and
their min / median / max, and for every run the machine's load: /proc/loadavg before it and the cores other
processes kept busy while its steps were timed (the run's fingerprint measures them: the spinners count there too).
A candidate that the load barely moves has ratios near 1.

    .venv/bin/python benchmarks/noise_figures.py [--rounds 5] [--spinners 2] [-- OVERRIDES...]

Run it on a quiet machine for the idle column to be idle: the "idle" runs' load is printed beside them.
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
# The seed MLP for 600 steps: 550 steady steps, 22 log intervals (a busy run of it takes about a minute here)
DEFAULT = ["experiment=seed_mlp", "logger=none", "trainer.max_steps=600", "trainer.log_every=25",
           "trainer.excluded_steps=50"]
CANDIDATES = {"mean step (wall / steps)": "step_time_s", "device time per step (process CPU)": "step_time_device_s",
              "p10 of single steps": "step_time_p10_s", "median of interval means": "interval_median_s"}


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def run_once(folder: Path, overrides: list[str], spinners: int) -> dict[str, float | str | None]:
    """One run of the command, with `spinners` spinning processes beside it; its candidates and its load."""
    before = load_average()
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        for p in spin:
            p.kill()
            p.wait()
    if proc.returncode != 0:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    steady = summary["steady_state"]
    figures: dict[str, float | str | None] = {key: steady.get(key) for key in CANDIDATES.values()}
    figures["interval_median_s"] = (summary["fingerprint"].get("step_time") or {}).get("median")
    figures["loadavg_before"] = before
    figures["other_cores"] = summary["fingerprint"]["load"].get("other_cores")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="the trainflow train overrides (default: %(default)s)",
                        default=DEFAULT)
    args = parser.parse_args()
    print(f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')} python train.py "
          f"{' '.join(args.overrides)}; {args.rounds} rounds, {args.spinners} spinners, {os.cpu_count()} cores",
          flush=True)
    ratios: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            idle = run_once(Path(tmp) / f"idle{i}", args.overrides, 0)
            busy = run_once(Path(tmp) / f"busy{i}", args.overrides, args.spinners)
            print(f"round {i + 1}: idle loadavg {idle['loadavg_before']}, other cores {idle['other_cores']}; "
                  f"busy loadavg {busy['loadavg_before']}, other cores {busy['other_cores']}", flush=True)
            for name, key in CANDIDATES.items():
                a, b = idle[key], busy[key]
                if isinstance(a, float) and isinstance(b, float) and a > 0:
                    ratios[name].append(b / a)
                    print(f"  {name:28} idle {a * 1e3:8.3f} ms  busy {b * 1e3:8.3f} ms  ratio {b / a:5.2f}",
                          flush=True)
    print("\n| candidate | busy/idle min | median | max |\n|---|---|---|---|")
    for name, values in ratios.items():
        if values:
            print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
