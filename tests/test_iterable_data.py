"""An IterableDataset by data._target_ (tests/streams.py): each rank reads its share through torchdata's
StatefulDataLoader, and a resume continues the stream exactly, with and without workers, with and without the
dataset's own state_dict; what cannot continue exactly (another world size) is said in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.runs import ROOT, losses_by_step, train
from streams import StatefulVectorStream, VectorStream

from trainflow.config.schema import DataSection
from trainflow.data import IterableBatches, IterableSource
from trainflow.errors import ConfigError, DataError

# 20 items a pass in micro-batches of 4: the 8 steps cross passes (5 batches a pass; 4 with 2 workers of 10 each)
STREAM = [f"hydra.searchpath=[file://{ROOT}/tests/conf]", "model=mlp", "data=vector_stream", "trainer.batch_size=4",
          "trainer.max_steps=8", "trainer.log_every=1", "trainer.excluded_steps=2", "trainer.eval_every=0",
          "trainer.eval_steps=2", "logger=none", "compile=off", "checkpoint=dcp", "checkpoint.every_steps=3"]
ENV = {"PYTHONPATH": str(ROOT / "tests")}


@pytest.mark.parametrize(("stateful", "workers", "mode"), [(True, 0, "sync"), (True, 2, "async"), (False, 2, "sync")])
def test_a_resume_continues_the_stream_exactly(tmp_path: Path, stateful: bool, workers: int, mode: str) -> None:
    """Resumed from the step-3 checkpoint of an uninterrupted run (as if killed after that commit), steps 4-8 take
    the same batches: equal losses."""
    args = [*STREAM, f"data.stateful={stateful}", f"data.num_workers={workers}", f"checkpoint.mode={mode}"]
    whole = train(tmp_path / "whole", *args, f"checkpoint.dir={tmp_path / 'ck'}", env=ENV)
    assert whole.returncode == 0, whole.stderr[-3000:]
    step3 = tmp_path / "ck" / "step_00000003"
    resumed = train(tmp_path / "resumed", *args, f"checkpoint.resume={step3}",
                    f"checkpoint.dir={tmp_path / 'ck_resumed'}", env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = losses_by_step(whole.run_dir)
    assert sorted(expected) == list(range(1, 9))
    assert len(set(expected.values())) == 8  # every step a different batch: a repeated or skipped one shows
    assert losses_by_step(resumed.run_dir) == {step: expected[step] for step in range(4, 9)}
    # the iterable validation set, read once, evaluated alike
    assert resumed.summary["validation"] == whole.summary["validation"]
    assert 0 <= whole.summary["validation"]["accuracy"] <= 1
    position = json.loads((step3 / "data_rank00000.json").read_text())
    assert (position["world_size"], position["num_workers"], position["batch_size"]) == (1, workers, 4)
    if stateful and workers == 0:  # the dataset's own position, and trainflow's count of the items it read
        assert position["loader"]["dataset_state"] == {"dataset": {"position": 12}, "read": 12}
    said = "has no state_dict()/load_state_dict(): each rank reads its stream again and skips the batches"
    assert (said in resumed.stdout + resumed.stderr) == (not stateful)


def test_two_ranks_read_disjoint_shares_and_another_world_size_restarts_the_stream(tmp_path: Path) -> None:
    """2 ranks take every other item: their micro-batches make the one-process global batch (the parity check
    passes, losses compared); one rank resuming their checkpoint cannot continue their two streams, and says so."""
    two = train(tmp_path / "two", *STREAM, "data.stateful=true", "parallelism=ddp", "parallelism.nproc_per_node=2",
                "parallelism.check=true", "parallelism.check_steps=3", "trainer.batch_size=2",
                f"checkpoint.dir={tmp_path / 'ck'}", env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    check = two.summary["parallelism"]["check"]
    assert check["passed"] is True and check["steps"] == 3 and check["loss_rel_diff"] <= 1e-4, check
    for rank in range(2):  # each rank's own position: 3 steps x 2 items of its share, read from 6 (or 5) items
        position = json.loads((tmp_path / "ck" / "step_00000003" / f"data_rank{rank:05d}.json").read_text())
        assert position["world_size"] == 2
        assert position["loader"]["dataset_state"] == {"dataset": {"position": 11 + rank}, "read": 11 + rank}
    one = train(tmp_path / "one", *STREAM, "data.stateful=true", "trainer.max_steps=5",
                f"checkpoint.resume={tmp_path / 'ck' / 'step_00000003'}", f"checkpoint.dir={tmp_path / 'ck1'}",
                env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "the iterable stream of streams.vector_stream was checkpointed with other settings (world_size 2 -> 1, " \
           "batch_size 2 -> 4): its position does not carry over; the stream restarts from its beginning" \
           in one.stdout + one.stderr
    assert sorted(losses_by_step(one.run_dir)) == [4, 5]


class TensorStateStream(StatefulVectorStream):
    """A position JSON cannot hold."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"position": torch.tensor(self.position)}


LOADER = DataSection(num_workers=0, persistent_workers=False, prefetch_factor=None)


def test_a_state_json_cannot_hold_or_seq_lens_are_refused_and_ranks_share_the_stream() -> None:
    bad = IterableSource(TensorStateStream(20, 8, 3, 0), torch.utils.data.default_collate, "streams.tensor_state")
    with pytest.raises(DataError, match=r"^data._target_: the state_dict\(\) of the train dataset of "
                                        r"streams.tensor_state cannot be saved as JSON \(Object of type Tensor"):
        IterableBatches(bad, 0, 1, 4, LOADER, False).check(None, 1)
    source = IterableSource(VectorStream(10, 8, 3, 0), torch.utils.data.default_collate, "streams.vector_stream")
    with pytest.raises(ConfigError, match=r"^data.seq_lens: cuts the micro-batches .* streams.vector_stream is an "):
        IterableBatches(source, 0, 1, 4, replace(LOADER, seq_lens=[2]), False)
    firsts = [next(iter(IterableBatches(source, rank, 2, 2, LOADER, False)))[0] for rank in range(2)]
    whole = source[torch.arange(4)][0]  # the first 4 items of the stream: rank 0 takes 0 and 2, rank 1 takes 1, 3
    assert torch.equal(firsts[0], whole[0::2]) and torch.equal(firsts[1], whole[1::2])
