"""Evaluation's default cadence: trainer.eval_every=auto keeps validation within a share of the run's time."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.runs import TINY_GPT, ok, train


def test_auto_evaluation_leaves_out_points_a_dear_evaluation_cannot_afford(run_dir: Path) -> None:
    """50 validation batches an evaluation (some 15 training steps' work each) in a 100-step run: evaluated at the
    first candidate step (its cost measured there) and at the end, and at most two more points, not all ten; the
    run says how many it left out and how to have them all."""
    run = ok(train(run_dir, *TINY_GPT, "trainer.max_steps=100", "trainer.log_every=25", "trainer.eval_steps=50"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if "val/loss" in r]
    assert evaluated[0] == 10 and evaluated[-1] == 100 and len(evaluated) <= 4, evaluated
    assert all(step % 10 == 0 for step in evaluated)
    left_out = 10 - len(evaluated)
    assert (f"evaluation: {left_out} of the validation points of trainer.eval_every=auto left out, to keep evaluation "
            "within 10% of the run's time; trainer.eval_every=10 evaluates at every one") in run.stdout
