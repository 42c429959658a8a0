"""``agree_or_raise``: a step whose results stay local agrees on its verdict in one small
all-reduce (and sums the counts ranks add), and a failure anywhere is raised on every rank as
``exchange_or_raise`` raises it, in real gloo groups."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardwise.collectives import Comm
from shardwise.errors import CheckpointDataError
from tests.harness import distributed


@distributed(world_size=3, timeout=60)
def test_counts_are_summed_and_results_stay_local() -> None:
    comm = Comm(None, operation="load")
    rank = dist.get_rank()
    result, sums = comm.agree_or_raise(lambda: {"rank": rank}, lambda r: [r["rank"] + 1, 10], 2)
    assert result == {"rank": rank}
    assert sums == [1 + 2 + 3, 30]
    assert comm.agree_or_raise(lambda: "ok") == ("ok", [])


@distributed(world_size=3, timeout=60)
def test_the_lowest_failing_ranks_error_is_raised_on_every_rank() -> None:
    comm = Comm(None, operation="load")
    rank = dist.get_rank()

    def plan() -> int:
        if rank == 2:
            raise ValueError("rank 2's target has the wrong size")
        if rank == 1:
            raise CheckpointDataError("a data file is missing", file="data/x")
        return rank

    expected: type[Exception] = ValueError if rank == 2 else CheckpointDataError
    with pytest.raises(expected) as caught:
        comm.agree_or_raise(plan, lambda value: [value], 1)
    if rank == 2:  # a failing rank raises its own error
        assert str(caught.value) == "rank 2's target has the wrong size"
    else:
        assert isinstance(caught.value, CheckpointDataError)
        assert caught.value.bare_message == "a data file is missing"
        assert caught.value.file == "data/x"
        assert caught.value.rank == (None if rank == 1 else 1)
    # The group is still in step.
    assert comm.agree_or_raise(lambda: rank, lambda value: [value], 1) == (rank, [3])


@distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("counts", [[], [1, 2], [-1], [1 << 48]])
def test_a_count_that_breaks_the_rules_fails_on_every_rank(counts: list[int]) -> None:
    comm = Comm(None, operation="load")
    mine = counts if dist.get_rank() == 1 else [5]
    with pytest.raises(ValueError, match=r"a count must be 1 integers in \[0, 2\*\*48\)"):
        comm.agree_or_raise(lambda: None, lambda _: mine, 1)
    assert comm.agree_or_raise(lambda: None, lambda _: [2], 1) == (None, [4])


def test_a_single_process_agrees_alone() -> None:
    comm = Comm(None)
    assert comm.agree_or_raise(lambda: "x", lambda _: [7], 1) == ("x", [7])
    with pytest.raises(KeyError):
        comm.agree_or_raise(lambda: {}["missing"])
