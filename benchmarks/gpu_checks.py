"""What only a GPU can confirm (docs/gpu.md), measured side by side in one script: gpu_ladder.sh runs it after the
ladder and puts its report next to the ladder's.

    python benchmarks/gpu_checks.py --out DIR            # on a CUDA machine
    python benchmarks/gpu_checks.py --out DIR --smoke    # anywhere: tiny model, CPU, checks the script itself

Each check is a pair (or one) of short `train.py` runs in fresh processes; the figures come from their summary.json.
Writes DIR/gpu_checks.json and DIR/gpu_checks.md; exit code 1 when a check FAILED (a run failed or a figure is
outside what the check expects), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU = ["model=gpt_small", "trainer.device=cuda", "trainer.batch_size=16", "trainer.max_steps=60",
       "trainer.excluded_steps=10", "trainer.eval_every=0", "trainer.eval_steps=5", "trainer.log_every=20",
       "logger=none", "compile=off"]
SMOKE = ["model=gpt_tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32",
         "trainer.batch_size=8", "trainer.max_steps=8", "trainer.excluded_steps=2", "trainer.eval_every=0",
         "trainer.eval_steps=2", "trainer.log_every=4", "logger=none", "compile=off"]


def train(out: Path, name: str, base: list[str], *overrides: str) -> dict[str, Any]:
    """One run in a fresh process; its summary, or {"error": ...} with the last stderr line."""
    run_dir = out / "runs" / name
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *base, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}", "wall_s": wall}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**summary, "wall_s": wall}


def steady(summary: dict[str, Any], key: str) -> float | None:
    return (summary.get("steady_state") or {}).get(key)


def check_pinning(out: Path, base: list[str]) -> dict[str, Any]:
    """Pinned batches copy asynchronously: the step should not be slower, and data wait should stay small."""
    pinned = train(out, "pinned", base, "data.pin_memory=true")
    pageable = train(out, "pageable", base, "data.pin_memory=false")
    figures = {f"{name}_{key}": steady(run, key) if "error" not in run else run["error"]
               for name, run in (("pinned", pinned), ("pageable", pageable))
               for key in ("step_time_s", "data_wait_fraction")}
    ok = "error" not in pinned and "error" not in pageable and (
        base is SMOKE or steady(pinned, "step_time_s") <= 1.05 * steady(pageable, "step_time_s"))
    return {"ok": ok, "expect": "pinned step time <= 1.05 x pageable; data wait small", **figures}


def check_tf32(out: Path, base: list[str]) -> dict[str, Any]:
    """fp32 runs on TF32 tensor cores: faster than full fp32, and MFU divides by the TF32 peak."""
    tf32 = train(out, "tf32", base, "trainer.tf32=true")
    ieee = train(out, "fp32", base, "trainer.tf32=false")
    if "error" in tf32 or "error" in ieee:
        return {"ok": False, "tf32": tf32.get("error"), "fp32": ieee.get("error")}
    return {"ok": steady(tf32, "step_time_s") < steady(ieee, "step_time_s") or base is SMOKE,
            "expect": "TF32 steps faster than full fp32 (on CPU both are fp32)",
            "tf32_step_time_s": steady(tf32, "step_time_s"), "fp32_step_time_s": steady(ieee, "step_time_s"),
            "tf32_math": tf32.get("matmul_math"), "fp32_math": ieee.get("matmul_math"),
            "tf32_peak_flops": tf32.get("peak_flops"), "fp32_peak_flops": ieee.get("peak_flops"),
            "tf32_mfu": tf32.get("mfu"), "fp32_mfu": ieee.get("mfu"), "device": tf32.get("device")}


def check_cuda_graphs_with_eval(out: Path, base: list[str]) -> dict[str, Any]:
    """compile=reduce_overhead (CUDA graphs) on one GPU with evaluation between steps: trains and evaluates."""
    if base is GPU:
        overrides = ["compile=reduce_overhead", "trainer.eval_every=20"]
    else:  # CUDA graphs need a GPU: the same run shape through aot_eager
        overrides = ["compile=default", "compile.backend=aot_eager", "trainer.eval_every=4"]
    run = train(out, "cuda_graphs", base, *overrides)
    if "error" in run:
        return {"ok": False, "error": run["error"]}
    compiled = run.get("compile") or {}
    val = (run.get("validation") or {}).get("loss")
    return {"ok": val is not None and val == val, "expect": "trains, evaluates, val loss finite",
            "val_loss": val, "step_time_s": steady(run, "step_time_s"), "graphs": compiled.get("graphs"),
            "recompiles": len(compiled.get("recompiles") or [])}


def check_async_checkpoint(out: Path, base: list[str]) -> dict[str, Any]:
    """Async saves block the loop for staging only; the same command resumes from the last one."""
    args = ["checkpoint=dcp_async", "checkpoint.every_steps=20", "checkpoint.keep_last=2"]
    first = train(out, "async", base, *args)
    if "error" in first:
        return {"ok": False, "error": first["error"]}
    ck = first["checkpoint"]
    resumed = train(out, "async", base, *args, "trainer.max_steps=80" if base is GPU else "trainer.max_steps=12")
    ok = "error" not in resumed and resumed.get("resumed_from_step") == first["steps"]
    return {"ok": ok, "expect": "blocked << write; resume from the last step",
            "saves": ck["saves"], "blocked_s_per_save": ck["blocked_s"]["per_save"],
            "write_s_per_save": ck["write_s"]["per_save"], "bytes": ck["bytes"],
            "resumed_from_step": resumed.get("resumed_from_step", resumed.get("error"))}


def check_memory_snapshot(out: Path, base: list[str]) -> dict[str, Any]:
    """The CUDA allocator snapshot (Python stacks) is written after the loop in seconds, not minutes."""
    window = ["profiler.wait=2", "profiler.warmup=1", "profiler.active=2"]
    run = train(out, "memory", base, "profiler=memory", *window)
    if "error" in run:
        return {"ok": False, "error": run["error"]}
    prof = run.get("profiler") or {}
    seconds = prof.get("memory_snapshot_write_s")
    snapshots = prof.get("memory_snapshots") or []
    ok = bool(snapshots) and seconds is not None and seconds < 30 if base is GPU else seconds is not None
    return {"ok": ok, "expect": "a snapshot written in < 30 s", "write_s": seconds, "snapshots": snapshots}


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    """Step time, MFU, peak memory and the last loss of a run (or its error)."""
    if "error" in run:
        return {"error": run["error"]}
    return {"step_time_s": steady(run, "step_time_s"), "mfu": run.get("mfu"),
            "peak_memory_gib": round((run.get("peak_memory_bytes") or 0) / 2**30, 3),
            "last_loss": (run.get("train_loss") or {}).get("last")}


def _compiled(base: list[str]) -> list[str]:
    """Compiled bf16 on a GPU (how these modes are used); aot_eager in fp32 on CPU (the smoke run)."""
    return ["compile=default", "trainer.precision=bf16"] if base is GPU else ["compile=default",
                                                                             "compile.backend=aot_eager"]


def check_activation_checkpointing(out: Path, base: list[str]) -> dict[str, Any]:
    """Each parallelism.activation_checkpointing mode on the same model: step time, MFU, peak memory. Expected:
    full holds the least and is the slowest, selective between off and full in both, budget (0.5) below off."""
    runs = {mode: _figures(train(out, f"ac_{mode}", base, *_compiled(base),
                                 f"parallelism.activation_checkpointing={mode}"))
            for mode in ("off", "full", "selective", "budget")}
    if any("error" in r for r in runs.values()):
        return {"ok": False, **{f"{m}_error": r["error"] for m, r in runs.items() if "error" in r}}
    peak = {m: r["peak_memory_gib"] for m, r in runs.items()}
    ok = base is SMOKE or peak["full"] <= peak["selective"] <= peak["off"] and peak["budget"] <= peak["off"]
    return {"ok": ok, "expect": "peak memory full <= selective <= off, budget <= off",
            **{f"{m}_{k}": v for m, r in runs.items() for k, v in r.items()}}


def check_fp8(out: Path, base: list[str]) -> dict[str, Any]:
    """trainer.precision=fp8 (torchao, tensorwise and rowwise) against bf16, compiled, with and without full
    activation checkpointing: step time, MFU, peak memory, last loss. Expected: fp8 faster than bf16 at the
    same checkpointing, its last loss within 10% (the ladder's fp8 gates judge the whole curve)."""
    if base is SMOKE:  # float8 needs a GPU of compute capability 8.9+: the smoke run checks the refusal
        run = train(out, "fp8", base, "trainer.precision=fp8")
        return {"ok": "error" in run and "compute capability" in run["error"], "refusal": run.get("error")}
    runs = {}
    for precision, recipe in (("bf16", None), ("fp8", "tensorwise"), ("fp8", "rowwise")):
        for ac in ("off", "full"):
            if recipe == "rowwise" and ac == "full":
                continue
            name = f"{recipe or precision}_ac_{ac}"
            extra = [f"trainer.fp8_recipe={recipe}"] if recipe else []
            runs[name] = _figures(train(out, name, base, "compile=default", f"trainer.precision={precision}",
                                        f"parallelism.activation_checkpointing={ac}", *extra))
    if any("error" in r for r in runs.values()):
        return {"ok": False, **{f"{n}_error": r["error"] for n, r in runs.items() if "error" in r}}
    faster = all(runs[f"tensorwise_ac_{ac}"]["step_time_s"] < runs[f"bf16_ac_{ac}"]["step_time_s"]
                 for ac in ("off", "full"))
    close = abs(runs["tensorwise_ac_off"]["last_loss"] / runs["bf16_ac_off"]["last_loss"] - 1) < 0.1
    return {"ok": faster and close, "expect": "fp8 tensorwise faster than bf16 with and without AC; loss within 10%",
            **{f"{n}_{k}": v for n, r in runs.items() for k, v in r.items()}}


def check_energy(out: Path, base: list[str]) -> dict[str, Any]:
    """The board's energy counter (NVML, or nvidia-smi) read over the steady state: joules per sample and token,
    and the cost of a million tokens at a price per GPU-hour; on CPU (--smoke) energy is absent with the reason."""
    run = train(out, "energy", base, "trainer.cost_per_hour=2.0")
    if "error" in run:
        return {"ok": False, "error": run["error"]}
    energy, money = run["cost"]["energy"], run["cost"]["money"]
    measured = (energy.get("joules_per_sample") or 0) > 0 and (energy.get("watts") or 0) > 0
    ok = (measured if base is GPU else "absent" in energy) and (money.get("per_million_tokens") or 0) > 0
    return {"ok": ok, "expect": "watts > 0, joules per sample > 0 (GPU); cost per M tokens > 0",
            "source": energy.get("source"), "watts": energy.get("watts"),
            "joules_per_sample": energy.get("joules_per_sample"), "joules_per_token": energy.get("joules_per_token"),
            "energy_absent": energy.get("absent"), "cost_per_million_tokens": money.get("per_million_tokens")}


CHECKS: dict[str, Callable[[Path, list[str]], dict[str, Any]]] = {
    "pinning": check_pinning, "tf32": check_tf32, "cuda_graphs_with_eval": check_cuda_graphs_with_eval,
    "async_checkpoint": check_async_checkpoint, "memory_snapshot": check_memory_snapshot, "energy": check_energy,
    "activation_checkpointing": check_activation_checkpointing, "fp8": check_fp8,
}


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = ["# GPU checks (benchmarks/gpu_checks.py)", "", "| check | result | figures |", "|---|---|---|"]
    for name, result in results.items():
        figures = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("ok",))
        lines.append(f"| {name} | {'PASS' if result['ok'] else 'FAIL'} | {figures} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining checks past this time")
    args = parser.parse_args()
    unknown = [name for name in args.only.split(",") if name not in CHECKS]
    if unknown:  # CHECKS_ONLY of gpu_ladder.sh arrives here
        parser.error(f"--only: no check named {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    base = SMOKE if args.smoke else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in args.only.split(","):
        if time.perf_counter() - start > args.budget_s:
            results[name] = {"ok": False, "skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        results[name] = {**CHECKS[name](args.out, base), "check_s": round(time.perf_counter() - start, 1)}
        print(f"gpu_checks: {name}: {'PASS' if results[name]['ok'] else 'FAIL'} {json.dumps(results[name])}",
              flush=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=1))
    (args.out / "gpu_checks.md").write_text(render(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
