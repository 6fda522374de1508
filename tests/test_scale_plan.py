"""Plans at cluster scale, by simulation: trainflow's own sharding and tensor parallel over a fake process group of
8 and 64 ranks (benchmarks/scale_plan.py) holds 1/(shard size x tp) of the model per rank, and the memory plan's
estimate (what parallelism=auto decides with) agrees with it to the byte."""

from __future__ import annotations

import sys

import pytest
from helpers.runs import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_plan import simulate  # noqa: E402

STATE = ("params", "grads", "optimizer")


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], dict]:
    plain = {(strategy, world): simulate("gpt_small", world, strategy) for world in (8, 64)
             for strategy in ("fsdp", "hsdp")}
    with_tp = {(strategy, world, tp): simulate("gpt_small", world, strategy, tp)
               for strategy, world, tp in (("fsdp", 8, 2), ("hsdp", 64, 2), ("fsdp", 64, 8))}
    return {**plain, **with_tp}


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


def test_tensor_parallel_divides_the_state_and_the_gathered_block(rows: dict) -> None:
    fsdp8, fsdp64 = rows[("fsdp", 8)]["measured"], rows[("fsdp", 64)]["measured"]
    tp2, tp8 = rows[("fsdp", 8, 2)], rows[("fsdp", 64, 8)]
    assert (tp2["layout"], tp2["shard_size"], tp8["layout"], tp8["shard_size"]) == ("fsdp x tp 2", 4, "fsdp x tp 8", 8)
    # FSDP 4 x TP 2 holds what FSDP 8 holds, FSDP 8 x TP 8 what FSDP 64 holds (a little more: TP replicates
    # the layer norms and the row-wise layers' biases)
    for item in STATE:
        assert fsdp8[item] <= tp2["measured"][item] == pytest.approx(fsdp8[item], rel=1e-3)
        assert fsdp64[item] <= tp8["measured"][item] == pytest.approx(fsdp64[item], rel=5e-3)
    # the block FSDP gathers is split by TP: half at tp 2, an eighth at tp 8
    assert tp2["measured"]["largest_unit"] == pytest.approx(fsdp8["largest_unit"] / 2, rel=1e-3)
    assert tp8["measured"]["largest_unit"] == pytest.approx(fsdp8["largest_unit"] / 8, rel=5e-3)
    # HSDP x TP 2 at 64 ranks: 4 shards x tp 2 per node of 8, so one copy per node, as FSDP 4 x TP 2 at 8 ranks
    hsdp = rows[("hsdp", 64, 2)]
    assert hsdp["shard_size"] == 4 and {k: hsdp["measured"][k] for k in STATE} == {k: tp2["measured"][k] for k in STATE}


def test_pipeline_stages_divide_the_state_and_the_estimate_agrees() -> None:
    """FSDP 32 x PP 2 at 64 ranks: the larger stage (the first: its 6 blocks and the embeddings) holds about what
    FSDP 64 holds, each stage half the blocks on twice the shard size; the estimate equals the simulation."""
    from scale_plan import simulate_pp

    row = simulate_pp("gpt_small", 64, 2)
    assert row["layout"] == "fsdp x pp 2" and row["shard_size"] == 32
    assert {k: row["estimate"][k] for k in STATE} == row["measured"]
    fsdp64 = simulate("gpt_small", 64, "fsdp")["measured"]
    assert row["measured"]["params"] == pytest.approx(fsdp64["params"], rel=0.05)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (8, 32)])
def test_the_simulated_bubble_is_the_schedules_own(pp: int, microbatches: int) -> None:
    """The simulation of each schedule's order of work gives the known bubbles: 1F1B (pp - 1) / (m + pp - 1),
    interleaved 1F1B with 2 stages a rank (pp - 1) / (2 m + pp - 1), and zero bubble below both."""
    from trainflow.distributed.pipeline import simulated_bubble

    one_f_one_b = simulated_bubble("1f1b", pp, microbatches)
    assert one_f_one_b == pytest.approx((pp - 1) / (microbatches + pp - 1))
    assert simulated_bubble("gpipe", pp, microbatches) == pytest.approx(one_f_one_b)
    interleaved = simulated_bubble("interleaved_1f1b", pp, microbatches)
    assert interleaved == pytest.approx((pp - 1) / (2 * microbatches + pp - 1))
    assert simulated_bubble("zbv", pp, microbatches) < interleaved < one_f_one_b
