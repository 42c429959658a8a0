"""``scatter_or_raise`` and ``broadcast_or_raise``: one rank decides for all (the save's
coordinator plans and commits), every rank gets its value or the decider's error with the
same type and message, in real gloo groups."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardwise.collectives import Comm
from shardwise.errors import CheckpointDataError
from tests.harness import distributed


@distributed(world_size=3, timeout=60)
@pytest.mark.parametrize("src", [0, 2])
def test_each_rank_gets_its_value_and_only_the_source_computes(src: int) -> None:
    comm = Comm(None, operation="save")
    rank = dist.get_rank()
    calls = []

    def plan() -> list[object]:
        calls.append(1)
        return [{"rank": r, "items": list(range(r * 50))} for r in range(3)]

    assert comm.scatter_or_raise(plan, src=src) == {"rank": rank, "items": list(range(rank * 50))}
    assert comm.broadcast_or_raise(lambda: {"from": dist.get_rank()}, src=src) == {"from": src}
    assert calls == ([1] if rank == src else [])


@distributed(world_size=3, timeout=60)
def test_the_deciders_error_is_raised_on_every_rank() -> None:
    comm = Comm(None, operation="save")
    rank = dist.get_rank()

    def refuse() -> list[object]:
        raise ValueError("cannot save 'v': its chunks do not tile it")

    with pytest.raises(ValueError, match=r"^cannot save 'v': its chunks do not tile it$"):
        comm.scatter_or_raise(refuse, src=1)

    def invisible() -> object:
        raise CheckpointDataError("the coordinator does not see the data files", file="data")

    with pytest.raises(CheckpointDataError) as caught:
        comm.broadcast_or_raise(invisible, src=1)
    assert caught.value.bare_message == "the coordinator does not see the data files"
    assert caught.value.file == "data"
    # The others learn which rank decided; the decider raises its own error.
    assert caught.value.rank == (None if rank == 1 else 1)
    # The group is still in step.
    assert comm.broadcast_or_raise(lambda: 7, src=0) == 7


def test_a_single_process_decides_alone() -> None:
    comm = Comm(None)
    assert comm.scatter_or_raise(lambda: [[1, 2]]) == [1, 2]
    assert comm.broadcast_or_raise(lambda: {"a": (1,)}) == {"a": [1]}
