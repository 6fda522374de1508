"""HSDP: 4 gloo ranks as 2 replicas x 2 shards (2 accumulation micro-steps: the gradient sync skipped on the first)
train like one process, resume exactly, and their checkpoints reshard to FSDP 2, DDP 2 and one process, and back.

Every run keeps the global batch at 8 samples (parallelism.global_batch), so 1, 2 and 4 ranks consume the same
global sample stream: a resharded run must reproduce the reference's per-step losses up to the summation order
of the gradient reduction (tolerance and its reason in test_checkpoint_distributed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.checkpoints import assert_close_losses, assert_same_tensors
from helpers.runs import TINY_GPT, Run, losses_by_step, ok, train

BASE = [*TINY_GPT, "trainer.grad_accum=2", "parallelism.global_batch=8", "trainer.max_steps=8",
        "trainer.eval_every=0", "trainer.eval_steps=1", "checkpoint=dcp"]
HSDP_2X2 = ["parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.hsdp.shard_size=2"]
OTHERS = {
    "fsdp2": ["parallelism=fsdp", "parallelism.nproc_per_node=2"],
    "ddp2": ["parallelism=ddp", "parallelism.nproc_per_node=2"],
    "single": [],
}


@pytest.fixture(scope="module")
def hsdp_straight(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: HSDP 2 x 2, 8 uninterrupted steps with the parity check, saves at 4 and 8."""
    return ok(train(tmp_path_factory.mktemp("hsdp") / "run", *BASE, *HSDP_2X2, "checkpoint.every_steps=4",
                    "parallelism.check=true"))


def checkpoint(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def resharded_from_hsdp(hsdp_straight: Run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """HSDP's step 4 resumed under FSDP 2, DDP 2 and one process, each saving every 2 steps."""
    return {name: ok(train(tmp_path_factory.mktemp(name) / "run", *BASE, *layout, "checkpoint.every_steps=2",
                           f"checkpoint.resume={checkpoint(hsdp_straight, 4)}"))
            for name, layout in OTHERS.items()}


def test_hsdp_2x2_trains_like_one_process(hsdp_straight: Run) -> None:
    parallelism = hsdp_straight.summary["parallelism"]
    assert parallelism["strategy"] == "hsdp" and parallelism["world_size"] == 4
    assert parallelism["mesh"] == {"replicate": 2, "shard": 2}
    check = parallelism["check"]
    assert check["passed"] and check["steps"] == 3, check
    assert check["param_rel_diff"] <= check["tolerance"] and check["loss_rel_diff"] <= check["tolerance"]
    assert "hsdp: 2 shard units + root over 4 ranks (mesh 2 replicate x 2 shard)" in hsdp_straight.stdout


def test_hsdp_resume_is_bit_identical(hsdp_straight: Run, tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", *BASE, *HSDP_2X2, "checkpoint.every_steps=4",
                   f"checkpoint.resume={checkpoint(hsdp_straight, 4)}"))
    assert run.summary["resumed_from_step"] == 4 and run.summary["steps_this_run"] == 4
    resumed, reference = losses_by_step(run.run_dir), losses_by_step(hsdp_straight.run_dir)
    assert {s: resumed[s] for s in range(5, 9)} == {s: reference[s] for s in range(5, 9)}
    assert_same_tensors(checkpoint(run, 8), checkpoint(hsdp_straight, 8))
    manifest = json.loads((checkpoint(run, 8) / "manifest.json").read_text())
    assert manifest["world_size"] == 4


@pytest.mark.parametrize("name", list(OTHERS))
def test_hsdp_checkpoint_reshards_to(name: str, hsdp_straight: Run, resharded_from_hsdp: dict[str, Run]) -> None:
    run = resharded_from_hsdp[name]
    assert run.summary["resumed_from_step"] == 4
    assert run.summary["world_size"] == {"fsdp2": 2, "ddp2": 2, "single": 1}[name]
    assert_close_losses(losses_by_step(run.run_dir), losses_by_step(hsdp_straight.run_dir), range(5, 9))


@pytest.mark.parametrize("name", ["fsdp2", "single"])
def test_checkpoint_reshards_back_to_hsdp(name: str, hsdp_straight: Run, resharded_from_hsdp: dict[str, Run],
                                          tmp_path: Path) -> None:
    run = ok(train(tmp_path / "run", *BASE, *HSDP_2X2, f"checkpoint.resume={checkpoint(resharded_from_hsdp[name], 6)}"))
    assert run.summary["resumed_from_step"] == 6 and run.summary["parallelism"]["mesh"] == {"replicate": 2, "shard": 2}
    assert_close_losses(losses_by_step(run.run_dir), losses_by_step(hsdp_straight.run_dir), range(7, 9))


@pytest.mark.parametrize(("world", "per_node", "shard", "replicate", "expected"), [
    (32, 8, None, None, (4, 8)),  # defaults: shard within a node of 8, replicate across the 4 nodes
    (4, 4, None, None, (1, 4)),  # one node: one copy sharded over all (FSDP's layout)
    (32, 8, None, 2, (2, 16)),  # only the replicas set: the shard size follows
    (4, 4, 2, None, (2, 2)),  # the CPU tests' 2 x 2
])
def test_mesh_shape_defaults_come_from_the_launch(world: int, per_node: int, shard: int | None,
                                                  replicate: int | None, expected: tuple[int, int]) -> None:
    from trainflow.distributed.mesh import mesh_shape

    assert mesh_shape(world, per_node, shard, replicate) == expected


def test_hsdp_with_compiled_blocks_and_activation_checkpointing_matches_one_process(tmp_path: Path) -> None:
    """compile.scope=blocks (aot_eager: the graphs of inductor without its C++ build time) over the 2-D mesh."""
    run = ok(train(tmp_path / "run", *BASE, *HSDP_2X2, "checkpoint=off", "trainer.max_steps=3", "compile=default",
                   "compile.backend=aot_eager", "compile.scope=blocks", "parallelism.check=true",
                   "parallelism.activation_checkpointing=full"))
    check, compiled = run.summary["parallelism"]["check"], run.summary["compile"]
    assert check["passed"] and check["param_rel_diff"] <= check["tolerance"], check
    assert compiled["enabled"] and compiled["scope"] == "blocks" and compiled["graphs"] >= 1
    assert compiled["graph_breaks"]["count"] == 0
