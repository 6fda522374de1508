"""Resume with dropout on, per strategy: the restored RNG states must give the uninterrupted run's losses bit for bit.

Without dropout a resumed run draws no random numbers, so a checkpoint whose RNG states were never restored
would resume to the same losses and every other resume test would still pass. With model.dropout=0.1 each step's
masks come from the RNG, and a resume that restarts the generators from the initial seed differs by ~5e-3.
"""

from __future__ import annotations

import pytest
from helpers.checkpoints import assert_same_tensors
from helpers.runs import TINY_GPT, Run, losses_by_step, ok, train

# 8 steps, a sync checkpoint every 4; the resumed run starts from the reference's step 4 in a fresh run directory.
DROPOUT = [*TINY_GPT, "data=synthetic", "data.num_samples=4096", "model.dropout=0.1", "trainer.max_steps=8",
           "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp", "checkpoint.every_steps=4"]
STRATEGIES = {"single": [], "ddp": ["parallelism=ddp", "parallelism.nproc_per_node=2"],
              "fsdp": ["parallelism=fsdp", "parallelism.nproc_per_node=2"]}




@pytest.fixture(scope="module", params=list(STRATEGIES))
def straight_and_resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                         ) -> tuple[str, Run, Run]:
    """(strategy, the uninterrupted run, a run resumed from its step-4 checkpoint on the same number of ranks)."""
    strategy = request.param
    base = tmp_path_factory.mktemp(f"dropout-{strategy}")
    straight = ok(train(base / "straight", *DROPOUT, *STRATEGIES[strategy]))
    step4 = straight.run_dir / "checkpoints" / "step_00000004"
    resumed = ok(train(base / "resumed", *DROPOUT, *STRATEGIES[strategy], f"checkpoint.resume={step4}"))
    return strategy, straight, resumed


def test_resume_with_dropout_reproduces_the_uninterrupted_losses(straight_and_resumed: tuple[str, Run, Run]) -> None:
    strategy, straight, resumed = straight_and_resumed
    assert resumed.summary["resumed_from_step"] == 4 and resumed.summary["steps_this_run"] == 4
    assert resumed.summary["config"]["model"]["dropout"] == 0.1
    assert resumed.summary["world_size"] == straight.summary["world_size"] == (1 if strategy == "single" else 2)
    reference = losses_by_step(straight.run_dir)
    assert list(reference) == list(range(1, 9))
    assert losses_by_step(resumed.run_dir) == {s: v for s, v in reference.items() if s > 4}  # exact float equality
    assert_same_tensors(resumed.run_dir / "checkpoints" / "step_00000008",
                        straight.run_dir / "checkpoints" / "step_00000008")
