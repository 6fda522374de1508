"""Plans at cluster scale, by simulation: trainflow's own sharding over a fake process group of 8 and 64 ranks
(benchmarks/scale_plan.py) holds 1/shard size of the model per rank, and the memory plan's estimate (what
parallelism=auto decides with) agrees with it to the byte."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_plan import simulate  # noqa: E402

STATE = ("params", "grads", "optimizer")


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], dict]:
    return {(strategy, world): simulate("gpt_small", world, strategy) for world in (8, 64)
            for strategy in ("fsdp", "hsdp")}


def test_per_rank_bytes_fall_as_one_over_the_shard_size(rows: dict) -> None:
    fsdp8, fsdp64 = rows[("fsdp", 8)]["measured"], rows[("fsdp", 64)]["measured"]
    full = rows[("fsdp", 8)]["parameters"] * 4  # fp32
    for item in ("params", "grads"):
        assert fsdp8[item] * 8 == pytest.approx(full, rel=1e-3)
        assert fsdp64[item] * 64 == pytest.approx(full, rel=1e-3)
    # AdamW: two fp32 moments per parameter, sharded, plus one unsharded step counter per parameter tensor
    assert fsdp8["optimizer"] - 2 * fsdp8["params"] == fsdp64["optimizer"] - 2 * fsdp64["params"] > 0
    # HSDP shards within a node of 8: at 64 ranks it holds what FSDP holds at 8, eight times FSDP at 64
    hsdp64 = rows[("hsdp", 64)]
    assert hsdp64["shard_size"] == 8
    assert {k: hsdp64["measured"][k] for k in STATE} == {k: fsdp8[k] for k in STATE}
    assert hsdp64["measured"]["params"] == pytest.approx(8 * fsdp64["params"], rel=1e-3)
    # the largest unit gathered (one block) does not shrink with more ranks
    assert fsdp64["largest_unit"] == fsdp8["largest_unit"] < full / 10


def test_the_memory_plan_estimate_equals_the_simulation(rows: dict) -> None:
    for row in rows.values():
        assert {k: row["estimate"][k] for k in STATE} == {k: row["measured"][k] for k in STATE}, row
