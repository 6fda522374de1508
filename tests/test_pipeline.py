"""Pipeline parallel (parallelism.pp) on gloo CPU ranks: PP 2 x FSDP 2 on 4 ranks trains like one process (the parity
check: parameters after 3 SGD steps within 1e-5 relative, fp32, the tied head compared too), the gradient norm is
the whole model's (clipped at 0.5 on every step), evaluation runs through the schedule, and checkpoints reshard
between the layouts (PP 2 x FSDP 2 -> one process -> PP 2) with the losses of the uninterrupted run. The
interleaved and zero-bubble schedules train like one process too, unclipped (a clip below the gradient's norm would
give a gradient 4x too large the same update; zbv holds the first and the last stage, both ends of the tied
embedding, on one rank), a NaN in a stage stops the run in one line, and the summary and the printed verdict report
the bubble, measured and simulated.

Every run keeps the global batch at 8 samples (parallelism.global_batch), so all layouts consume the same global
sample stream: the stages of a pipeline read one batch, the data-parallel ranks split it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.checkpoints import assert_close_losses, assert_parity_checked
from helpers.runs import TINY_GPT, Run, logged_by_step, losses_by_step, ok, one_line_error, train

BASE = [*TINY_GPT, "optim=sgd", "trainer.grad_accum=2", "parallelism.global_batch=8", "trainer.max_steps=4",
        "trainer.eval_every=0", "trainer.eval_steps=1", "trainer.grad_clip=0.5"]
SAVED = ["checkpoint=dcp", "checkpoint.every_steps=2"]
CHECKED = ["parallelism.check=true", "parallelism.check_steps=3", "parallelism.check_tolerance=1e-5"]
PP2_FSDP2 = ["parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=4"]
PP2 = ["parallelism=fsdp", "parallelism.pp=2", "parallelism.nproc_per_node=2"]
GRAD_NORM = "train/grad_norm"


def step_dir(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def pp_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: PP 2 x FSDP 2 on 4 ranks, 4 uninterrupted steps with the parity check, saves at 2 and 4."""
    return ok(train(tmp_path_factory.mktemp("pp_fsdp") / "run", *BASE, *SAVED, *PP2_FSDP2, *CHECKED))


@pytest.fixture(scope="module")
def single_from_pp(pp_fsdp: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """PP 2 x FSDP 2's step 2 resumed in one process (saved at 3 and 4)."""
    return ok(train(tmp_path_factory.mktemp("single") / "run", *BASE, "checkpoint=dcp", "checkpoint.every_steps=1",
                    f"checkpoint.resume={step_dir(pp_fsdp, 2)}"))


def test_pp2_x_fsdp2_matches_one_process(pp_fsdp: Run) -> None:
    assert_parity_checked(pp_fsdp, "fsdp x pp 2", {"replicate": 1, "shard": 2, "pp": 2})
    assert pp_fsdp.summary["parallelism"]["per_rank_batch"] == 2  # 8 samples over 2 data-parallel ranks x 2 micro
    pipeline = pp_fsdp.summary["parallelism"]["pipeline"]
    assert (pipeline["schedule"], pipeline["stages"], pipeline["microbatches"]) == ("1f1b", 2, 2)
    # the mesh is pp x replicate x shard: ranks 0, 1 hold stage 0 (sharded over them), ranks 2, 3 stage 1
    assert [r["stages"] for r in pipeline["ranks"]] == [[0], [0], [1], [1]]
    assert pipeline["expected_bubble_fraction"] == pytest.approx(1 / 3)  # 1F1B: (pp - 1) / (m + pp - 1)
    assert all(0 < r["bubble"] < 1 and r["compute_s_per_step"] > 0 and r["peak_memory_bytes"] > 0
               for r in pipeline["ranks"])
    assert pp_fsdp.summary["validation"]["loss"] > 0  # evaluation through the schedule: rank 0 has the loss


def test_gradient_norm_is_the_whole_models(pp_fsdp: Run, single_from_pp: Run) -> None:
    """Clipped at 0.5 (every step's norm is above it): a norm over one stage would clip by another factor."""
    staged, whole = logged_by_step(pp_fsdp.run_dir, GRAD_NORM), logged_by_step(single_from_pp.run_dir, GRAD_NORM)
    assert min(staged.values()) > 0.5
    assert [staged[s] for s in (3, 4)] == pytest.approx([whole[s] for s in (3, 4)], rel=1e-5)


def test_checkpoint_reshards_pp_fsdp_to_one_process_to_pp(pp_fsdp: Run, single_from_pp: Run, tmp_path: Path) -> None:
    reference = losses_by_step(pp_fsdp.run_dir)
    assert single_from_pp.summary["resumed_from_step"] == 2
    assert_close_losses(losses_by_step(single_from_pp.run_dir), reference, range(3, 5))
    manifest = json.loads((step_dir(pp_fsdp, 2) / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["samples_seen"] == 2 * 8
    pp = ok(train(tmp_path / "run", *BASE, *SAVED, *PP2, f"checkpoint.resume={step_dir(single_from_pp, 3)}"))
    assert pp.summary["resumed_from_step"] == 3 and pp.summary["parallelism"]["layout"] == "pp 2"
    assert_close_losses(losses_by_step(pp.run_dir), reference, range(4, 5))


# unclipped: a clip below the norm (0.5, every step here) scales any gradient to the same update, a wrong one too
FOUR_BLOCKS = ["model.n_layer=4", "trainer.max_steps=3", "trainer.grad_accum=1", "trainer.grad_clip=0"]


@pytest.mark.parametrize(("schedule", "compiled"), [("interleaved_1f1b", True), ("zbv", False)])
def test_two_stages_a_rank_match_one_process(schedule: str, compiled: bool, tmp_path: Path) -> None:
    """4 blocks in 4 stages on 2 ranks: interleaved (stages r, r + 2; its blocks compiled, aot_eager) and V-shaped
    (zbv: stages r, 3 - r, so rank 0 holds the token embedding and the head it is tied to)."""
    compile_ = ["compile=default", "compile.backend=aot_eager"] if compiled else []
    run = ok(train(tmp_path / "run", *BASE, *PP2, *CHECKED, *FOUR_BLOCKS, f"parallelism.pp_schedule={schedule}",
                   *compile_))
    assert_parity_checked(run, "pp 2", {"replicate": 1, "shard": 1, "pp": 2})
    assert run.summary["compile"].get("scope") == ("blocks" if compiled else None)  # a stage compiles its blocks
    pipeline = run.summary["parallelism"]["pipeline"]
    stages = {"interleaved_1f1b": [[0, 2], [1, 3]], "zbv": [[0, 3], [1, 2]]}[schedule]
    assert [r["stages"] for r in pipeline["ranks"]] == stages and pipeline["stages_per_rank"] == 2
    assert pipeline["microbatches"] == 4  # one per stage
    # interleaving shortens the 1F1B bubble of 2 ranks and 4 micro-batches, (pp - 1) / (m + pp - 1) = 0.2
    assert pipeline["expected_bubble_fraction"] < 0.2


def test_a_nan_in_a_stage_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """The last stage's output turns NaN: the loss every stage reads (sent from the last) stops the run."""
    run = train(tmp_path / "run", *BASE, *PP2, "model._target_=unstable_model.GPTNaNAtStep",
                "+model.nan_at_step=6", env={"PYTHONPATH": str(Path(__file__).parent)})
    # the last stage's 6th forward is in step 2: step 1 made 5 (2 micro-steps x 2 pipeline micro-batches, and the
    # schedule's shape inference)
    one_line_error(run, "trainer.nonfinite: the loss at step 2 is nan", "no checkpoint holds this state")


def test_the_profiler_verdict_names_the_pipeline_bubble(tmp_path: Path) -> None:
    """Rank 0 (stage 0) waits for stage 1 in its receives: that time is the pipeline bubble's share, not
    communication's, and the shares still make up the step."""
    run = ok(train(tmp_path / "run", *TINY_GPT, *PP2, "trainer.max_steps=8", "trainer.eval_every=0",
                   "trainer.eval_steps=1", "profiler=schedule", "profiler.skip_first=2", "profiler.wait=1",
                   "profiler.warmup=1", "profiler.active=3"))
    verdict = run.summary["profiler"]["verdict"]
    assert verdict["shares"]["pipeline_bubble"] > 0.1, verdict
    assert sum(verdict["shares"].values()) == pytest.approx(1.0, abs=0.01)
    # the printed verdict's shares line gives the bubble its measured share (every run's line names it, at 0%)
    (shares,) = [line for line in run.stdout.splitlines() if line.startswith("  shares of step time: ")]
    assert f" | pipeline bubble {verdict['shares']['pipeline_bubble'] * 100:.0f}% | " in shares, shares
    assert int(re.search(r" \| pipeline bubble (\d+)% \| ", shares).group(1)) >= 10, shares
