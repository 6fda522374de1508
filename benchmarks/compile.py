"""Does trainflow keep torch.compile's gain? And what does the persistent compile cache save?

Steady state: four variants train the same model on batches of the same shape with the same threads,
alternating in one process (the order rotates every round): trainflow eager (`compile=off`), trainflow
compiled (`compile=default`), and the plain loop (the same model, loss, clipping and AdamW without trainflow),
eager and `torch.compile`d. Each variant's steady step time excludes its warm-up and compile steps. The gain is
eager / compiled step time; trainflow's gain over the plain loop's gain (median of the rounds) is what trainflow
keeps of torch.compile's own gain (goal >= 0.98).

Cold vs warm: `python train.py compile=default` twice as separate processes on a fresh cache directory: the
first compiles from scratch (cold), the second finds inductor's and AOTAutograd's artifacts (warm).

    python benchmarks/compile.py [--rounds 3] [--steps 20] [--skip-cold] [--gpu]

`--gpu`: gpt_small in bf16 on CUDA, both loops with fused AdamW and bf16 autocast, timed between device syncs;
trainflow eager against the plain loop eager is then the loop's cost on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
from trainflow.conf import CONFIG_DIR
from trainflow.config.checks import check_config
from trainflow.run.training import train
from trainflow.tasks import cross_entropy

ROOT = Path(__file__).resolve().parents[1]
register_with_hydra()  # before composing configs, as train.py does
MODEL = ["model=gpt_tiny", "data=text", "trainer.batch_size=16", "optim=adamw"]
GPU_MODEL = ["model=gpt_small", "data=text", "trainer.batch_size=16", "optim=adamw", "trainer.device=cuda",
             "trainer.precision=bf16"]
COMMON = ["logger=none", "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.progress=log"]
WARMUP = 3  # steps left out before timing, in both loops (plus trainflow's own compile steps)


def trainflow_step_time(model: list[str], overrides: list[str], steps: int, cache_dir: str) -> float:
    """trainflow's steady-state step time, as its summary reports it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = check_config(compose("train", overrides=[
            *model, *COMMON, *overrides, f"compile.cache_dir={cache_dir}", f"trainer.excluded_steps={WARMUP}",
            f"trainer.max_steps={steps + WARMUP + 1}", f"trainer.log_every={steps + WARMUP + 1}"]))
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp))
    compile_report = summary["compile"]
    assert not compile_report.get("recompile_limit_hit"), compile_report  # would time eager code as compiled
    return summary["steady_state"]["step_time_s"]


def handwritten_step_time(model_overrides: list[str], compiled: bool, steps: int) -> float:
    """The plain loop: the same model, loss, clipping and AdamW; `torch.compile(model)` when compiled. On CUDA:
    bf16 autocast and fused AdamW, as a user who reads the docs writes them (trainflow uses both there)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*model_overrides, *COMMON])
    device = torch.device(cfg.trainer.device if cfg.trainer.device != "auto" else "cpu")
    on_gpu = device.type == "cuda"
    torch.manual_seed(cfg.trainer.seed)
    model = instantiate(cfg.model).to(device)
    if compiled:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay, fused=on_gpu)
    b, t = cfg.trainer.batch_size, cfg.data.seq_len
    tokens = torch.randint(cfg.model.vocab_size, (steps + WARMUP + 1, b, t + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16")
    for step in range(steps + WARMUP + 1):
        if step == WARMUP + 1:  # the first step compiles; WARMUP more settle
            if on_gpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        with autocast:
            loss = cross_entropy(model(tokens[step, :, :-1]), tokens[step, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if on_gpu:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def fresh_dynamo() -> None:
    """Each variant compiles for itself, as a new process would (inductor's disk cache stays warm)."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()


def steady_state(model: list[str], rounds: int, steps: int, cache_dir: str) -> dict[str, object]:
    variants = {
        "trainflow_eager": lambda: trainflow_step_time(model, ["compile=off"], steps, cache_dir),
        "trainflow_compiled": lambda: trainflow_step_time(model, ["compile=default"], steps, cache_dir),
        "hand_eager": lambda: handwritten_step_time(model, False, steps),
        "hand_compiled": lambda: handwritten_step_time(model, True, steps),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % 4:] + names[:r % 4]:
            fresh_dynamo()
            times[name].append(variants[name]())
            print(f"round {r + 1}: {name} {times[name][-1] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    tf_gain = [e / c for e, c in zip(times["trainflow_eager"], times["trainflow_compiled"], strict=True)]
    hand_gain = [e / c for e, c in zip(times["hand_eager"], times["hand_compiled"], strict=True)]
    return {
        "step_time_ms": {k: [round(v * 1e3, 1) for v in vs] for k, vs in times.items()},
        "gain_trainflow": statistics.median(tf_gain),
        "gain_handwritten": statistics.median(hand_gain),
        "kept_of_torch_compile_gain": statistics.median([a / b for a, b in zip(tf_gain, hand_gain, strict=True)]),
        # > 1: trainflow's loop is faster than the plain loop; its cost over it is 1 - this
        "eager_speed_vs_handwritten": statistics.median(
            [h / t for h, t in zip(times["hand_eager"], times["trainflow_eager"], strict=True)]),
        "compiled_speed_vs_handwritten": statistics.median(
            [h / t for h, t in zip(times["hand_compiled"], times["trainflow_compiled"], strict=True)]),
    }


def cold_vs_warm(model: list[str], cache_dir: str) -> dict[str, object]:
    """First-step and compile time of two `python train.py compile=default` processes on one fresh cache."""
    result = {}
    for name in ("cold", "warm"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(ROOT / "train.py"), *model, *COMMON, "compile=default",
                   f"compile.cache_dir={cache_dir}", "trainer.max_steps=3", "trainer.excluded_steps=0",
                   f"hydra.run.dir={tmp}"]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr)
            c = json.loads((Path(tmp) / "summary.json").read_text())["compile"]
        result[name] = {"cache": c["cache"]["state"], "first_step_s": round(c["first_step_s"], 2),
                        "compile_time_s": round(c["compile_time_s"], 2)}
        print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
    result["first_step_speedup"] = round(result["cold"]["first_step_s"] / result["warm"]["first_step_s"], 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    parser.add_argument("--skip-cold", action="store_true", help="only the steady-state comparison")
    parser.add_argument("--gpu", action="store_true", help="gpt_small in bf16 on CUDA (see above)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = GPU_MODEL if args.gpu else MODEL
    results: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "model": model}
    if args.gpu:
        results["device"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the plain loop's inductor uses it too
        if not args.skip_cold:
            results["cold_vs_warm"] = cold_vs_warm(model, cache)
        results["steady_state"] = steady_state(model, args.rounds, args.steps, cache)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
