"""`trainflow compare` is honest: the same command run twice compares as the same within its band; compile=off against
the default, and a model twice as wide, compare as different with the right sign; a CPU hog beside one run is named
as the likely cause. Timing verdicts: these tests run alone (serial), on runs they make themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import TINY_GPT, Run, ok, train, trainflow

pytestmark = pytest.mark.serial

# 60 steps, a log every 5 (11 steady intervals of ~20 ms here), one evaluation at the end
BASE = [*TINY_GPT, "trainer.max_steps=60", "trainer.log_every=5", "trainer.eval_every=0", "trainer.eval_steps=2"]
SPEED = ("step_time", "samples_per_sec", "tokens_per_sec", "mfu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The base command twice, the default compile (TINY_GPT turns it off), and the model twice as wide."""
    folder = tmp_path_factory.mktemp("honest")
    return {"base": ok(train(folder / "base", *BASE)), "again": ok(train(folder / "again", *BASE)),
            "compiled": ok(train(folder / "compiled", *BASE, "compile=default")),
            "wide": ok(train(folder / "wide", *BASE, "model.n_embd=128"))}


def compare(a: Path, b: Path, out: Path, *gates: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = trainflow("compare", a, b, "--out", out, *(x for g in gates for x in ("--fail-on", g)))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    report = json.loads((out / "compare.json").read_text())
    return proc, {row["figure"]: row for row in report["pairs"][0]["figures"]} | {"_report": report}


def test_the_same_command_twice_is_the_same(runs: dict[str, Run], tmp_path: Path) -> None:
    proc, rows = compare(runs["base"].run_dir, runs["again"].run_dir, tmp_path, "step_time=+5%")
    assert proc.returncode == 0, proc.stdout
    for name in SPEED:
        assert rows[name]["verdict"] == "same", rows[name]
        assert abs(rows[name]["change"]) <= rows[name]["band"]
    assert rows["loss"]["diff"] == 0 and rows["val_loss"]["diff"] == 0  # CPU training is deterministic
    pair = rows["_report"]["pairs"][0]
    # nothing in the fingerprints tells them apart but, on a shared machine, the load of other jobs
    assert [n for n in pair["notes"] if n["kind"] != "machine load"] == []
    assert all(c["max_abs_diff"] == 0 and c["verdict"] == "same" for c in pair["curves"])
    assert rows["_report"]["gates"][0]["status"] == "PASS"


def test_compile_against_eager_differs_with_the_right_sign(runs: dict[str, Run], tmp_path: Path) -> None:
    """On CPU the steady step of the tiny GPT is what eager's is (docs/compile.md); compiling costs its compile time,
    which the default pays and compile=off does not."""
    proc, rows = compare(runs["base"].run_dir, runs["compiled"].run_dir, tmp_path, "compile_time=+1")
    compile_s = runs["compiled"].summary["compile"]["compile_time_s"]
    assert rows["compile_time"]["a"] == 0 and rows["compile_time"]["b"] == compile_s > 0
    assert rows["compile_time"]["verdict"] == "slower" and rows["compile_time"]["better"] is False
    assert rows["compile_time"]["likely_cause"].startswith("another config: compile.enabled: False -> True")
    assert proc.returncode == 1 and "GATE FAIL compile_time=+1" in proc.stdout
    _, reverse = compare(runs["compiled"].run_dir, runs["base"].run_dir, tmp_path / "reverse")
    assert reverse["compile_time"]["verdict"] == "faster" and reverse["compile_time"]["better"] is True


def test_a_model_twice_as_wide_is_slower(runs: dict[str, Run], tmp_path: Path) -> None:
    proc, rows = compare(runs["base"].run_dir, runs["wide"].run_dir, tmp_path, "step_time=+5%")
    assert rows["step_time"]["verdict"] == "slower" and rows["step_time"]["change"] > rows["step_time"]["band"]
    assert rows["step_time"]["confidence"] >= 0.9 and rows["samples_per_sec"]["verdict"] == "slower"
    assert rows["step_time"]["likely_cause"] == "another config: model.n_embd: 64 -> 128"
    assert proc.returncode == 1 and "GATE FAIL step_time=+5%" in proc.stdout
    kinds = [n["kind"] for n in rows["_report"]["pairs"][0]["notes"]]
    assert kinds[:2] == ["config", "model"]
    _, reverse = compare(runs["wide"].run_dir, runs["base"].run_dir, tmp_path / "reverse")
    assert reverse["step_time"]["verdict"] == "faster" and reverse["samples_per_sec"]["verdict"] == "faster"


def test_a_cpu_hog_beside_one_run_is_named_as_the_likely_cause(runs: dict[str, Run], tmp_path: Path) -> None:
    """Two busy loops per core run beside the second run of the base command: its steps are slower, its fingerprint
    counts the cores the hogs kept busy, and compare names the busier machine as the likely cause; a gate on the
    step time warns (rerun on an idle machine) instead of failing."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        busy = ok(train(tmp_path / "busy", *BASE))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    base_load, busy_load = runs["base"].summary["fingerprint"]["load"], busy.summary["fingerprint"]["load"]
    assert busy_load["busy"] is True and busy_load["other_cores"] > base_load["other_cores"] + 0.5
    proc, rows = compare(runs["base"].run_dir, busy.run_dir, tmp_path / "out", "step_time=+5%")
    assert rows["step_time"]["verdict"] == "slower", rows["step_time"]
    assert rows["step_time"]["likely_cause"].startswith("B ran on a busier machine: other processes kept")
    assert rows["loss"]["diff"] == 0  # its numbers are the base run's: only its speed changed
    assert proc.returncode == 0 and "GATE WARN step_time=+5%" in proc.stdout
