"""Stragglers (per-rank step times gathered at log steps, a slow rank named), the start-up word on more ranks than
cores, and the one way every account of ranks names them."""

from __future__ import annotations

from trainflow.distributed.failures import rank_list


def test_every_account_names_ranks_alike() -> None:
    """The health check, the hang report, the lost-rank line and the straggler line share one wording."""
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 2]) == "ranks 0, 2"
    assert rank_list(list(range(8))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7"
    assert rank_list(list(range(64))) == "ranks 0, 1, 2, 3, 4, 5, 6, 7, ..."
    assert rank_list(list(range(5)), limit=2) == "ranks 0, 1, ..."
