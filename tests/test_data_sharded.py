"""Sharded streams: whole shards per rank and worker, each item read once a pass, and a resume on another number
of ranks that continues the pass from the global position (in process: the ranks are simulated, each its own
loader with 2 worker processes)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.runs import ROOT, losses_by_step, train
from streams import ShardedNumbers, VectorStream
from torch.utils.data import default_collate

from trainflow.config.schema import DataSection
from trainflow.data.iterable import IterableBatches, IterableSource

LOADER = DataSection(num_workers=2, persistent_workers=False, prefetch_factor=2, seq_lens=None)
BATCH = 4  # 8 shards x 8 items on 2 ranks x 2 workers: 2 shards, 4 micro-batches a worker, 8 a rank, a pass


def loaders(world_size: int) -> list[IterableBatches]:
    source = IterableSource(ShardedNumbers(), default_collate, "tests.streams.ShardedNumbers")
    return [IterableBatches(source, r, world_size, BATCH, LOADER, pin_memory=False) for r in range(world_size)]


def read(loader: IterableBatches, batches: int) -> list[int]:
    stream = iter(loader)
    return [n for _ in range(batches) for n in next(stream).tolist()]


def rest_of_pass(loader: IterableBatches) -> list[int]:
    """What this rank reads until its pass ends (the inner loader's one pass)."""
    out = []
    for _, batch in loader.loader:
        out += batch.tolist()
    return out


EVERY_ITEM = sorted(s * 1000 + j for s in range(8) for j in range(8))


def test_each_reader_gets_whole_shards_and_reads_each_item_once_a_pass() -> None:
    ranks = loaders(2)
    items = [rest_of_pass(rank) for rank in ranks]
    assert sorted(items[0] + items[1]) == EVERY_ITEM  # once each, none missing
    # reader r*2 + w (rank r, worker w) reads shards r*2 + w and r*2 + w + 4: whole shards, none shared
    assert {n // 1000 for n in items[0]} == {0, 1, 4, 5} and {n // 1000 for n in items[1]} == {2, 3, 6, 7}


@pytest.mark.parametrize("new_world", [2, 1, 4])
def test_a_resume_continues_the_pass_on_any_number_of_ranks(new_world: int) -> None:
    """3 micro-batches a rank on 2 ranks, then a checkpoint's positions (JSON) resumed on `new_world` ranks:
    what was read before and after together is every item of the pass exactly once."""
    before = loaders(2)
    first = [n for rank in before for n in read(rank, 3)]
    saved = [rank.state_dict() for rank in before]
    assert all(s["sharded"] and s["pass"] == 0 for s in saved)
    after = loaders(new_world)
    for r, rank in enumerate(after):
        rank.restore(saved[r] if r < len(saved) else None, True, r == 0, saved)
    rest = [n for rank in after for n in rest_of_pass(rank)]
    assert len(first) == 2 * 3 * BATCH and sorted(first + rest) == EVERY_ITEM


def test_a_stream_without_shards_says_its_read_amplification(caplog: pytest.LogCaptureFixture) -> None:
    source = IterableSource(VectorStream(16, 4, 2, 0), default_collate, "tests.streams.VectorStream")
    with caplog.at_level(logging.INFO, logger="trainflow"):
        IterableBatches(source, 0, 2, BATCH, LOADER, pin_memory=False)
    assert ("data: tests.streams.VectorStream exposes no shards (num_shards and shard(index)): each of its 4 readers "
            "(2 rank(s) x 2 worker(s)) reads the whole stream and keeps 1 item in 4: 4x the reading") in caplog.text


def test_train_py_resumes_a_sharded_stream_exactly(tmp_path: Path) -> None:
    """The whole path: 32 items in 8 shards, 2 workers, a save every 3 steps; resumed from step 3, steps 4-8 take
    the same batches (equal losses), and the saved position is the items taken of each shard (JSON)."""
    args = [f"hydra.searchpath=[file://{ROOT}/tests/conf]", "model=mlp", "data=vector_stream", "data.size=32",
            "+data.shards=8", "data.num_workers=2", "trainer.batch_size=4", "trainer.max_steps=8",
            "trainer.log_every=1", "trainer.excluded_steps=2", "trainer.eval_every=0", "trainer.eval_steps=2",
            "logger=none", "compile=off", "checkpoint=dcp", "checkpoint.every_steps=3"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    whole = train(tmp_path / "whole", *args, f"checkpoint.dir={tmp_path / 'ck'}", env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    step3 = tmp_path / "ck" / "step_00000003"
    position = json.loads((step3 / "data_rank00000.json").read_text())
    assert position["sharded"] and position["pass"] == 0 and sum(position["taken"].values()) == 3 * 4
    resumed = train(tmp_path / "resumed", *args, f"checkpoint.resume={step3}",
                    f"checkpoint.dir={tmp_path / 'ck_resumed'}", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = losses_by_step(whole.run_dir)
    assert len(set(expected.values())) == 8
    assert losses_by_step(resumed.run_dir) == {step: expected[step] for step in range(4, 9)}


def numbers(shards: list[int]):
    for s in shards:
        for j in range(8):
            yield {"x": s * 1000 + j}


def test_a_hugging_face_iterable_dataset_is_read_by_its_shards() -> None:
    """`n_shards` / `shard(num_shards=, index=)`: 8 shards (one per gen_kwargs entry) on 2 ranks x 2 workers."""
    import datasets

    hf = datasets.IterableDataset.from_generator(numbers, gen_kwargs={"shards": list(range(8))})
    source = IterableSource(hf, default_collate, "hf")
    ranks = [IterableBatches(source, r, 2, BATCH, LOADER, pin_memory=False) for r in range(2)]
    # read, not copied: deepcopy of a HF dataset failed once the hub's filesystem cache held an entry (a process
    # that had talked to the hub: this test after test_hf_data's, in one process)
    assert all(rank.share.dataset is hf for rank in ranks)
    items = [[n for _, batch in rank.loader for n in batch["x"].tolist()] for rank in ranks]
    assert sorted(items[0] + items[1]) == EVERY_ITEM
    assert {n // 1000 for n in items[0]} == {0, 1, 4, 5} and {n // 1000 for n in items[1]} == {2, 3, 6, 7}
