"""experiment=hf_gpt2 end to end: a transformers GPT-2 on local text read by datasets, a BPE trained here, the
model's own loss, through every stage (compile, DDP and FSDP on 2 ranks, the profiler, DCP and an exact resume).

The tokenizer and the windows themselves are tested in test_tokenizers.py and test_hf_data.py, and a GPT-2
learning from the windows step by step in test_hf_data.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers.runs import losses_by_step, ok, train

QUICK = ["logger=none", "trainer.log_every=1", "trainer.excluded_steps=1", "trainer.eval_steps=2"]
SMALL = ["model.n_embd=32", "model.n_layer=2", "model.n_head=2", "model.n_positions=32", "tokenizer.vocab_size=512",
         "trainer.batch_size=8"]
TWO_RANKS = ["parallelism.nproc_per_node=2", "parallelism.global_batch=16"]
PROFILED = ["profiler=schedule", "profiler.wait=0", "profiler.warmup=1", "profiler.active=2"]
SAVED = ["checkpoint=dcp", "checkpoint.every_steps=4", "trainer.max_steps=8", "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """One tokenizer and token cache for the module's runs: the BPE is trained by the first run only."""
    folder = tmp_path_factory.mktemp("caches")
    return [f"data.cache_dir={folder}/hf", f"tokenizer.cache_dir={folder}/tokenizers"]




def test_hf_gpt2_learns_on_local_text_with_its_own_loss(tmp_path: Path, caches: list[str]) -> None:
    run = ok(train(tmp_path / "run", "experiment=hf_gpt2", *QUICK, *SMALL, *caches, "trainer.max_steps=40",
                   "trainer.eval_every=20"))
    losses = run.losses()
    assert len(losses) == 40
    assert abs(losses[0] - math.log(512)) < 0.1 * math.log(512), losses[:3]  # random init over the BPE's 512 tokens
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses  # it learns
    vals = [m["val/loss"] for m in run.metrics() if "val/loss" in m]
    assert len(vals) == 2 and vals[1] < vals[0] < losses[0]
    assert run.summary["validation"]["loss"] == vals[-1]


@pytest.mark.slow  # the path of test_tasks' my_project; the model stays in make test (the test above)
def test_hf_gpt2_through_fsdp_profiler_checkpoint_resume_and_compiled_ddp(tmp_path: Path, caches: list[str]) -> None:
    args = ["experiment=hf_gpt2", *QUICK, *SMALL, *caches]
    fsdp = ok(train(tmp_path / "fsdp", *args, "parallelism=fsdp", *TWO_RANKS, *PROFILED, *SAVED))
    assert fsdp.summary["world_size"] == 2 and fsdp.summary["parallelism"]["strategy"] == "fsdp"
    assert list((fsdp.run_dir / "profile").glob("*trace.json*"))
    step4 = fsdp.run_dir / "checkpoints" / "step_00000004"
    resumed = ok(train(tmp_path / "resumed", *args, "parallelism=fsdp", *TWO_RANKS, *SAVED,
                       f"checkpoint.resume={step4}"))
    straight, again = losses_by_step(fsdp.run_dir), losses_by_step(resumed.run_dir)
    assert resumed.summary["resumed_from_step"] == 4
    assert {s: again[s] for s in range(5, 9)} == {s: straight[s] for s in range(5, 9)}  # exactly
    assert len(set(straight.values())) == 8  # the batches differ: equal losses are not a coincidence

    ddp = ok(train(tmp_path / "ddp", *args, "parallelism=ddp", *TWO_RANKS, "compile=default", "trainer.max_steps=6",
                   "trainer.eval_every=0"))
    assert ddp.summary["compile"]["enabled"] and ddp.summary["parallelism"]["strategy"] == "ddp"
    losses = ddp.losses()
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_a_trainflow_gpt_on_data_hf_takes_the_tuple_convention(tmp_path: Path, caches: list[str]) -> None:
    """data=hf's default items, (inputs, targets), go through the lm task's own loss, as byte-level text does."""
    run = ok(train(tmp_path / "run", "data=hf", "data.paths=[examples/data/stdlib_docstrings.jsonl]", "tokenizer=bpe",
                   "tokenizer.vocab_size=512", *caches, "model=gpt_tiny", "model.n_layer=2", "model.n_embd=64",
                   "model.n_head=2", "model.block_size=32", "compile=off", "trainer.batch_size=8", *QUICK,
                   "trainer.max_steps=20", "trainer.eval_every=0"))
    losses = run.losses()
    assert abs(losses[0] - math.log(512)) < 0.1 * math.log(512) and losses[-1] < losses[0] - 0.3, losses
