"""``Comm(None)`` without a process group is a world of one: its gathers, scatters and
verdicts are plain calls that give what a group of one would (values through JSON)."""

from __future__ import annotations

import pytest

from shardwise.collectives import Comm, is_initialized


def test_a_world_of_one_gathers_scatters_and_raises_locally() -> None:
    assert not is_initialized()
    comm = Comm(None)
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.gather_json({"a": (1, 2)}) == [{"a": [1, 2]}]
    assert comm.scatter_json([{"b": (3,)}]) == {"b": [3]}
    assert comm.broadcast_json([1], 0) == [1]
    local, gathered = comm.gather_or_raise(lambda: (1, 2), lambda value: {"v": value})
    assert local == (1, 2) and gathered == [{"v": [1, 2]}]

    def fail() -> int:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        comm.gather_or_raise(fail)
