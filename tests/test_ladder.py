"""The workflow ladder end to end: every rung as a real process, the gates from real files, a broken rung.

One smoke ladder (benchmarks/gpu_ladder.sh --smoke: the tiny GPT, 12 steps, all seven rungs on CPU, ddp and
fsdp on 2 processes) is shared by the tests that read its report. Gate logic is also exercised by altering a
copy of that sweep's files and running `trainflow report` on it. A rung broken for real (a compile backend
with wrong numerics, defined here) must fail its gate and the sweep's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.processes import run_process
from helpers.runs import ROOT

from trainflow.report.ladder import Rung

HERE = Path(__file__).resolve().parent
GATES = ["baseline.learns", "compile.numerics", "compile.loss_parity", "compile.graph_breaks", "compile.recompiles",
         "profile.next_step", "scale.ddp", "scale.fsdp", "checkpoint.restore", "checkpoint.resume_losses"]
RUNGS = ["baseline", "compile", "profile", "ddp", "fsdp", "checkpoint", "resume"]
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32", "trainer.batch_size=8",
        "trainer.max_steps=8", "trainer.excluded_steps=2", "trainer.eval_steps=2", "logger=none"]


def skewed_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
    """A deliberately broken compiler: every floating-point output of a compiled graph comes out 1% too large."""

    def run(*args: torch.Tensor) -> tuple:
        return tuple(o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args))

    return run


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def gates_of(report: dict) -> dict[str, dict]:
    return {g["name"]: g for g in report["gates"]}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`bash benchmarks/gpu_ladder.sh --smoke` on CPU, as CI and a user would run it; the report copied to $OUT."""
    base = tmp_path_factory.mktemp("ladder")
    out, sweep = base / "out", base / "sweep"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_ladder.sh"), "--smoke"], cwd=ROOT,
                          env=clean_env(OUT=str(out), SWEEP_DIR=str(sweep), PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=900)
    return proc, out, sweep


def test_smoke_ladder_runs_every_rung_and_passes_every_gate(smoke) -> None:
    proc, out, sweep = smoke
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["console.log", "report.json", "report.md", "report.png"]
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    assert [r["rung"] for r in report["runs"]] == RUNGS and report["baseline"] == "0"
    assert all(r["status"] == "finished" for r in report["runs"])
    # every rung is the baseline's work at another speed: each has its speedup, none is listed apart
    assert all(r["not_compared"] is None and r["speedup"] is not None for r in report["runs"]), report["runs"]
    gates = gates_of(report)
    assert list(gates) == GATES
    for name, gate in gates.items():
        assert gate["status"] == "PASS" or (name == "compile.graph_breaks" and gate["status"] == "WARN"), gate
        assert gate["numbers"] and any(ch.isdigit() for ch in gate["detail"]), gate
    assert gates["compile.numerics"]["numbers"]["loss_rel_error"] <= gates["compile.numerics"]["numbers"]["tolerance"]
    for name in ("compile.loss_parity", "scale.ddp", "scale.fsdp"):
        numbers = gates[name]["numbers"]
        assert numbers["steps_compared"] == 12 and numbers["max_rel_diff"] <= numbers["tolerance"] == 1e-3
    assert gates["scale.ddp"]["numbers"]["world_size"] == gates["scale.fsdp"]["numbers"]["world_size"] == 2
    assert gates["profile.next_step"]["numbers"]["action"] in gates["profile.next_step"]["detail"]
    restore = gates["checkpoint.restore"]["numbers"]
    assert restore == {"verified": True, "resumed_from_step": 6, "expected_step": 6, "first_step_equal": True,
                       "first_step_abs_diff": 0.0}
    assert gates["checkpoint.resume_losses"]["numbers"] == {"steps_compared": 6, "max_abs_diff": 0.0,
                                                           "tolerance": 0.0, "missing_steps": 0}
    assert report == json.loads((sweep / "report.json").read_text())


def test_each_rung_ran_in_its_own_process_with_its_own_settings(smoke) -> None:
    _, _, sweep = smoke
    summaries = {json.loads((d / "summary.json").read_text())["config"]["ladder"]["rung"]: json.loads(
        (d / "summary.json").read_text()) for d in sweep.iterdir() if (d / "summary.json").exists()}
    assert sorted(summaries) == sorted(RUNGS)
    for stage in RUNGS:
        assert (sweep / str(RUNGS.index(stage)) / ".process" / "console.log").exists()
    assert {s["global_batch"] for s in summaries.values()} == {8}  # the same global batch on every rung
    assert summaries["ddp"]["parallelism"]["per_rank_batch"] == 4 and summaries["ddp"]["world_size"] == 2
    assert summaries["compile"]["compile"]["enabled"] and not summaries["baseline"]["compile"]["enabled"]
    assert summaries["profile"]["profiler"]["verdict"]["bound"]
    assert summaries["checkpoint"]["checkpoint"]["steps_saved"] == [6, 12]
    assert summaries["resume"]["resumed_from_step"] == 6 and summaries["resume"]["steps_this_run"] == 6
    # the gated rungs log every step; the profile rung only at its end: no log sync inside its profiled window
    logged = {stage: [json.loads(line)["step"] for line in (sweep / str(RUNGS.index(stage)) / "metrics.jsonl")
                      .read_text().splitlines() if "train/loss" in json.loads(line)] for stage in RUNGS}
    assert logged["baseline"] == logged["compile"] == list(range(1, 13)) and logged["profile"] == [12]


def test_report_png_shows_every_rung(smoke) -> None:
    _, out, _ = smoke
    assert png_size(out / "report.png") == (1300, 500)
    assert (out / "report.png").stat().st_size > 30_000
    md = (out / "report.md").read_text()
    for gate in GATES:
        assert f"| {gate} | **" in md
    assert "Result: all gates passed." in md and "## What the profiler recommends" in md


def _bump_resumed_loss(sweep: Path) -> None:
    path = sweep / "6" / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for m in lines:
        if m.get("step") == 12 and "train/loss" in m:
            m["train/loss"] += 1e-6
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))


def _scale_loss(job: str, step: int, factor: float) -> Callable[[Path], None]:
    """One rung's logged loss at one step off by `factor`: what a numerics bug in that rung would look like."""

    def apply(sweep: Path) -> None:
        path = sweep / job / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        hit = [m for m in lines if m.get("step") == step and "train/loss" in m]
        assert len(hit) == 1, hit
        hit[0]["train/loss"] *= factor
        path.write_text("".join(json.dumps(m) + "\n" for m in lines))

    return apply


def _edit_summary(job: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(sweep: Path) -> None:
        path = sweep / job / "summary.json"
        summary = json.loads(path.read_text())
        edit(summary)
        path.write_text(json.dumps(summary))

    return apply


@pytest.mark.parametrize(("tamper", "gate", "fragment"), [
    (_bump_resumed_loss, "checkpoint.resume_losses", "max |diff| 1e-06"),
    (_edit_summary("1", lambda s: s["compile"]["check"].update(passed=False)), "compile.numerics", "loss rel. error"),
    (_edit_summary("1", lambda s: s["compile"].update(recompile_limit_hit=True)), "compile.recompiles", "HIT"),
    (_edit_summary("3", lambda s: s["parallelism"]["check"].update(passed=False)), "scale.ddp", "parameter rel. diff"),
    (_edit_summary("2", lambda s: s["profiler"].update(verdict=None)), "profile.next_step", "no verdict"),
    (_edit_summary("5", lambda s: s["checkpoint"].update(verified=False)), "checkpoint.restore", "NOT verified"),
    (_scale_loss("1", 7, 1.01), "compile.loss_parity", "max rel. difference 1.0e-02 at step 7; tolerance 1e-03"),
    (_scale_loss("3", 5, 1.002), "scale.ddp", "max rel. difference 2.0e-03 at step 5 (tolerance 1e-03)"),
    (_scale_loss("4", 9, 0.99), "scale.fsdp", "max rel. difference 1.0e-02 at step 9 (tolerance 1e-03)"),
], ids=["resumed-loss", "compile-check", "recompile-limit", "ddp-parity", "no-profile", "unverified-save",
        "compile-loss", "ddp-loss", "fsdp-loss"])
def test_a_bad_number_fails_its_gate_and_the_report_command(smoke, tmp_path: Path, tamper, gate: str,
                                                            fragment: str) -> None:
    _, _, sweep = smoke
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("checkpoints", "profile"))
    tamper(copy)
    proc = subprocess.run([sys.executable, "-c", "from trainflow.cli import main; main()", "report", str(copy)],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL {gate}: " in proc.stdout and fragment in proc.stdout, proc.stdout
    gates = gates_of(json.loads((copy / "report.json").read_text()))
    assert [n for n, g in gates.items() if g["status"] == "FAIL"] == [gate]


def test_a_broken_compile_rung_fails_its_gate_and_the_sweep(tmp_path: Path) -> None:
    """A backend with wrong numerics: compile.check stops the compile rung; the next rung still runs; exit 1."""
    sweep = tmp_path / "sweep"
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "experiment=ladder", "ladder=compile,baseline",
                        *TINY, "compile.backend=test_ladder.skewed_backend", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, env=clean_env(PYTHONPATH=pythonpath), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "job #0 failed (exit code 2): compile.check: compiled and eager results differ" in proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads((sweep / "report.json").read_text())
    assert report["passed"] is False and report["baseline"] == "1"
    assert [(r["rung"], r["status"]) for r in report["runs"]] == [("compile", "failed"), ("baseline", "finished")]
    gates = gates_of(report)
    assert gates["baseline.learns"]["status"] == "PASS"
    for name in ("compile.numerics", "compile.loss_parity", "compile.graph_breaks", "compile.recompiles"):
        assert gates[name]["status"] == "FAIL" and "compile.check: compiled and eager results differ" in \
            gates[name]["detail"], gates[name]
    for name in ("profile.next_step", "scale.ddp", "scale.fsdp", "checkpoint.restore", "checkpoint.resume_losses"):
        assert gates[name]["status"] == "NOT EVALUATED" and "not in this sweep" in gates[name]["detail"]
    assert "| compile.numerics | **FAIL** |" in (sweep / "report.md").read_text()


def test_a_failed_gate_of_finished_rungs_fails_the_sweep_in_one_line(tmp_path: Path) -> None:
    """Every rung finishes but a gate fails (SGD at lr 10 blows the loss up, 5.4 -> 163; clipping keeps it far from
    overflow, so the run is not stopped as non-finite; at lr 100 it overflowed by step 8): the sweep still exits 1."""
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "experiment=ladder", "ladder=baseline",
                        *TINY, "optim=sgd", "optim.lr=10", "optim.warmup_steps=0", "optim.schedule=constant",
                        "trainer.grad_clip=1", f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ladder: 1 gate(s) FAILED: baseline.learns: 8 steps"), \
        proc.stderr
    assert "it did not decrease" in proc.stderr and "Traceback" not in proc.stderr
    gates = gates_of(json.loads((sweep / "report.json").read_text()))
    assert gates["baseline.learns"]["status"] == "FAIL"
    assert not gates["baseline.learns"]["numbers"]["loss_last"] < gates["baseline.learns"]["numbers"]["loss_first"]


def test_bad_ladder_setting_is_one_line(tmp_path: Path) -> None:
    proc = run_process([sys.executable, str(ROOT / "train.py"), "experiment=ladder", "ladder.resume_atol=-1",
                        *TINY, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["Error: ladder.resume_atol: must be >= 0 (0: bit-identical); got -1.0"], proc.stderr


def test_only_a_ladder_job_has_a_ladder_section(tmp_path: Path) -> None:
    """The ladder's settings belong to experiment=ladder: a plain run's config has no such section, and a ladder
    key given to one is Hydra's one line."""
    proc = run_process([sys.executable, str(ROOT / "train.py"), "ladder.resume_atol=0.1", *TINY,
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "Error: ladder.resume_atol: Could not override it: the config has no such key; python train.py --cfg job "
        "lists every key"], proc.stderr


def test_gpu_script_without_a_gpu_says_to_use_smoke(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run the real ladder")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_ladder.sh")], cwd=ROOT,
                          env=clean_env(PYTHON=sys.executable, SWEEP_DIR=str(tmp_path / "sweep")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"gpu_ladder.sh: no CUDA GPU visible to {sys.executable}; run with --smoke for the " \
                                  "CPU check"


def test_an_unknown_gpu_check_is_one_line(tmp_path: Path) -> None:
    """gpu_ladder.sh's CHECKS_ONLY reaches gpu_checks.py --only: a misspelt check ends before any run, naming
    the known ones (it was a KeyError traceback after the ladder's minutes)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_checks.py"), "--out", str(tmp_path / "out"),
                           "--only", "tf32,pining"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "gpu_checks.py: error: --only: no check named pining; the checks are pinning, tf32, cuda_graphs_with_eval, "
        "async_checkpoint, memory_snapshot, energy, activation_checkpointing, fp8")
    assert not (tmp_path / "out").exists()


def test_a_rung_that_cannot_run_stops_the_ladder_before_its_first_rung(tmp_path: Path) -> None:
    """`python train.py -m experiment=ladder trainer.max_steps=8`, as typed: the profile rung's window does not fit
    8 steps, so the sweep fails at once, naming the rung and the key, instead of training two rungs first."""
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "experiment=ladder", "trainer.max_steps=8",
                        f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "Error: ladder=profile (job #2): trainer.max_steps: is 8 but the profiler window ends at step 15 (skip_first "
        "5 + 1 x (wait 5 + warmup 2 + active 3)); raise trainer.max_steps to >= 15 or shorten the window "
        "(profiler.skip_first/wait/warmup/active)"]
    assert not sweep.exists()  # no rung started, and a refused sweep leaves no folder behind


@pytest.mark.parametrize(("steps", "every"), [(12, 1), (40, 4), (60, 6), (200, 20), (7, 1)])
def test_rungs_log_about_ten_times_at_a_divisor_of_the_half_way_step(steps: int, every: int) -> None:
    from trainflow.report.ladder import half, log_interval

    assert log_interval(None, steps) == every and half(steps) % every == 0
    assert log_interval(3, steps) == 3  # ladder.log_every, when set, is taken as given


def test_rungs_that_log_rarely_still_pass_the_resume_gates(tmp_path: Path) -> None:
    """40 steps: every rung logs every 4 steps (10 host syncs, not 40); the resumed run's logged interval means
    equal the uninterrupted run's exactly, from the first log after the half-way step on."""
    sweep = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", "experiment=ladder",
                        "ladder=baseline,checkpoint,resume", *TINY, "trainer.max_steps=40",
                        f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for job in ("0", "1", "2"):
        steps = [json.loads(line)["step"] for line in (sweep / job / "metrics.jsonl").read_text().splitlines()
                 if "train/loss" in line]
        assert steps == (list(range(4, 41, 4)) if job != "2" else list(range(24, 41, 4))), (job, steps)
    gates = gates_of(json.loads((sweep / "report.json").read_text()))
    assert gates["baseline.learns"]["status"] == "PASS"
    assert gates["checkpoint.restore"]["numbers"] == {"verified": True, "resumed_from_step": 20, "expected_step": 20,
                                                      "first_step_equal": True, "first_step_abs_diff": 0.0}
    assert "its first logged loss (step 24) equals" in gates["checkpoint.restore"]["detail"]
    assert gates["checkpoint.resume_losses"]["numbers"] == {"steps_compared": 5, "max_abs_diff": 0.0,
                                                           "tolerance": 0.0, "missing_steps": 0}


def _gpu_like_rungs(compiled_drift: float, first_resumed_drift: float) -> list:
    """Rungs as a bf16 CUDA ladder gives them: the compiled curve drifts from the baseline's, and the resumed run's
    losses from the uninterrupted one's (non-deterministic backward kernels), by the given amounts."""
    from trainflow.report.ladder import Rung

    base = {s: 5.0 - s / 100 for s in range(20, 201, 20)}
    checkpoint = {"steps": 200, "checkpoint": {"verified": True, "saves": 2, "steps_saved": [100, 200]}}
    return [Rung("baseline", "0", {"steps": 200, "train_loss": {"first": 5.55, "last": 2.48}}, base),
            Rung("compile", "1", {"steps": 200, "compile": {
                "graphs": 2, "graph_breaks": {"count": 0, "breaks": []}, "recompiles": {"count": 1},
                "recompile_limit": 8, "recompile_limit_hit": False, "compile_time_s": 27.7}},
                 {s: v * (1 + (compiled_drift if s == 40 else 0)) for s, v in base.items()}),
            Rung("checkpoint", "3", checkpoint, base),
            Rung("resume", "4", {"steps": 200, "resumed_from_step": 100},
                 {s: v + (first_resumed_drift if s == 120 else 0) for s, v in base.items() if s > 100})]


@pytest.mark.parametrize(("drift", "atol", "status", "words"), [
    (2e-4, 0.0, "FAIL", "DIFFERS from"), (2e-4, 0.02, "PASS", "is within 0.02 of"), (0.0, 0.0, "PASS", "equals"),
    (0.05, 0.02, "FAIL", "DIFFERS from")])
def test_the_restore_gate_allows_the_resume_tolerance(drift: float, atol: float, status: str, words: str) -> None:
    """The first GPU ladder resumed exactly (step 101 from the restored weights) but its step-120 loss differed by
    2e-4 after 20 steps of CUDA's atomics-based backward: ladder.resume_atol applies to that first loss too."""
    from trainflow.config.schema import LadderConfig
    from trainflow.report.ladder import evaluate

    gates = {g.name: g for g in evaluate(_gpu_like_rungs(0.0, drift), LadderConfig(resume_atol=atol), "bf16")}
    restore = gates["checkpoint.restore"]
    assert restore.status == status and f"(step 120) {words} the uninterrupted one" in restore.detail, restore
    assert restore.numbers["first_step_abs_diff"] == pytest.approx(drift)


@pytest.mark.parametrize(("drift", "precision", "status"), [
    (0.034, "bf16", "PASS"), (0.08, "bf16", "FAIL"), (0.034, "fp32", "FAIL"), (5e-4, "fp32", "PASS")])
def test_loss_parity_follows_the_arithmetic(drift: float, precision: str, status: str) -> None:
    """bf16 compiled vs eager gpt_small on an H200 drifted 3.4e-2 at step 40: inside bf16's tolerance, not fp32's."""
    from trainflow.config.schema import LadderConfig
    from trainflow.report.ladder import evaluate

    gates = {g.name: g for g in evaluate(_gpu_like_rungs(drift, 0.0), LadderConfig(), precision)}
    parity = gates["compile.loss_parity"]
    assert parity.status == status and parity.numbers["at_step"] == 40, parity
    assert parity.numbers["max_rel_diff"] == pytest.approx(drift)


def _rung(kind: str, math: str, step_time_s: float, losses: dict[int, float]) -> Rung:
    compiled = {"graphs": 1, "graph_breaks": {"count": 0, "breaks": []}, "recompiles": {"count": 0},
                "recompile_limit": 8, "recompile_limit_hit": False, "compile_time_s": 30.0}
    return Rung(kind, kind, {"matmul_math": math, "steady_state": {"step_time_s": step_time_s}, "mfu": 0.4,
                             "compile": compiled}, losses)


@pytest.mark.parametrize(("fp8_step_s", "fp8_scale", "compile_math", "parity", "speed", "fragment"), [
    (0.08, 1.05, "bf16", "PASS", "PASS", "fp8 80.0 ms/step vs bf16 100.0 ms/step: 1.25x"),
    (0.11, 1.05, "bf16", "PASS", "FAIL", "0.91x; stay in bf16 (trainer.precision=bf16)"),
    (0.08, 1.20, "bf16", "FAIL", "PASS", "max rel. difference 2.0e-01 at step 2; tolerance 1e-01"),
    (0.08, 1.05, "fp32", "NOT EVALUATED", "NOT EVALUATED", "compile rung ran in fp32"),
], ids=["faster-and-close", "slower", "loss-drifts", "no-bf16-reference"])
def test_the_fp8_rung_is_judged_against_bf16(fp8_step_s: float, fp8_scale: float, compile_math: str, parity: str,
                                              speed: str, fragment: str) -> None:
    """The fp8 rung's gates (a GPU's: here the numbers of its summaries): the loss within ladder.fp8_rtol (0.1) of
    the compile rung's in bf16 at every step, and faster, or FAIL saying to stay in bf16."""
    from trainflow.config.schema import LadderConfig
    from trainflow.report.ladder import evaluate

    bf16 = {1: 5.0, 2: 4.0, 3: 3.5}
    rungs = [_rung("compile", compile_math, 0.1, bf16),
             _rung("fp8", "fp8", fp8_step_s, {s: v * (fp8_scale if s == 2 else 1.0) for s, v in bf16.items()})]
    gates = {g.name: g for g in evaluate(rungs, LadderConfig(), "bf16")}
    assert (gates["fp8.loss_parity"].status, gates["fp8.speedup"].status) == (parity, speed)
    assert fragment in gates["fp8.loss_parity"].detail + gates["fp8.speedup"].detail
    assert "fp8.speedup" not in {g.name for g in evaluate(rungs[:1], LadderConfig(), "bf16")}  # no fp8 rung: no gate
