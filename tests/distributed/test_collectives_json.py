"""The coordinator-shaped JSON collectives (``gather_json``, ``scatter_json``,
``broadcast_json``) and ``gather_or_raise``, in real gloo groups of 1 to 4 ranks: values
arrive where they should and nowhere else, on the default group and on a sub-group whose
group ranks are not its global ranks, and every rank reaches the same verdict — a failing
rank's error raised on every rank with the same type and message — including when a rank
never comes."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.collectives import Comm
from shardwise.errors import CheckpointFormatError, CheckpointTimeoutError
from tests.harness import distributed

SHORT = timedelta(seconds=3)
PROMPTLY = 20.0


def _value(rank: int, length: int = 3) -> dict[str, object]:
    """A rank's JSON value, of a length that depends on the rank (padding must not show)."""
    return {"rank": rank, "items": list(range(rank * length)), "text": "é" * rank}


def _groups() -> list[tuple[ProcessGroup, list[int]]]:
    """The default group, and (on 3+ ranks) a sub-group of the odd ranks, whose group rank
    0 is global rank 1; with this process's membership."""
    world = dist.get_world_size()
    assert dist.group.WORLD is not None
    groups = [(dist.group.WORLD, list(range(world)))]
    if world >= 3:
        odd = list(range(1, world, 2))
        sub = dist.new_group(odd)
        assert sub is not None
        groups.append((sub, odd))
    return groups


@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_json_lands_on_dst_only(world: int) -> None:
    members = list(range(world))
    group = dist.new_group(members)
    rank = dist.get_rank()
    if rank in members:
        assert group is not None
        for dst in {0, world - 1}:
            got = collectives.gather_json(_value(rank), group, dst, operation="save")
            if rank == dst:
                assert got == [_value(r) for r in members]
            else:
                assert got is None


@distributed(world_size=4, timeout=60)
def test_gather_and_broadcast_on_a_subgroup_use_group_ranks() -> None:
    rank = dist.get_rank()
    for group, members in _groups():
        if rank not in members:
            continue
        me = members.index(rank)
        dst = len(members) - 1
        got = collectives.gather_json(_value(rank), group, dst)
        assert got == ([_value(r) for r in members] if me == dst else None)
        value = {"from": members[dst]} if me == dst else None
        assert collectives.broadcast_json(value, group, dst) == {"from": members[dst]}


@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("skew", [False, True], ids=["padded", "point-to-point"])
def test_scatter_json_gives_each_rank_its_value(skew: bool) -> None:
    rank = dist.get_rank()
    for group, members in _groups():
        if rank not in members:
            continue
        me = members.index(rank)
        for src in {0, len(members) - 1}:
            # Skewed: one long value and short ones (padding would send ~R x the long one).
            values = [
                {"to": r, "plan": list(range(5000 if skew and r == 0 else 3))}
                for r in range(len(members))
            ]
            got = collectives.scatter_json(values if me == src else None, group, src)
            assert got == values[me]


@distributed(world_size=2, timeout=40)
def test_comm_methods_match_the_module_functions() -> None:
    rank = dist.get_rank()
    comm = Comm(None, operation="save")
    assert comm.gather_json(_value(rank), dst=1) == ([_value(0), _value(1)] if rank else None)
    assert comm.scatter_json(["a", "b"] if rank == 0 else None) == "ab"[rank]
    local, gathered = comm.gather_or_raise(lambda: rank * 10, lambda value: {"v": value})
    assert local == rank * 10
    assert gathered == ([{"v": 0}, {"v": 10}] if rank == 0 else None)


@distributed(world_size=4, timeout=60)
@pytest.mark.parametrize("failing", [[1], [2, 3], [0, 3]])
def test_gather_or_raise_raises_the_lowest_failure_on_every_rank(failing: list[int]) -> None:
    rank = dist.get_rank()

    def compute() -> int:
        if rank in failing:
            raise ValueError(f"bad value on rank {rank}")
        return rank

    with pytest.raises(ValueError) as caught:
        collectives.gather_or_raise(dist.group.WORLD, compute, dst=3, operation="save")  # type: ignore[arg-type]
    # The failing ranks raise their own error; the others the lowest failing rank's.
    expected = rank if rank in failing else failing[0]
    assert str(caught.value) == f"bad value on rank {expected}"
    # The group is still usable, in step: a successful round follows.
    local, gathered = collectives.gather_or_raise(dist.group.WORLD, lambda: rank, dst=3)  # type: ignore[arg-type]
    assert local == rank
    assert gathered == ([0, 1, 2, 3] if rank == 3 else None)


@distributed(world_size=3, timeout=40)
def test_gather_or_raise_keeps_checkpoint_errors_and_other_types() -> None:
    rank = dist.get_rank()

    def compute() -> None:
        if rank == 1:
            raise CheckpointFormatError("bad index", key="w", file="shardwise.json")
        if rank == 2:
            raise OSError("disk on fire")

    if rank == 2:  # a failing rank raises its own error
        with pytest.raises(OSError, match="disk on fire"):
            Comm(None, operation="load").gather_or_raise(compute, dst=2)
    else:
        with pytest.raises(CheckpointFormatError) as caught:
            Comm(None, operation="load").gather_or_raise(compute, dst=2)
        error = caught.value
        assert (error.bare_message, error.key, error.file) == ("bad index", "w", "shardwise.json")
        assert error.rank == (None if rank == 1 else 1)

    def other() -> None:
        if rank == 0:
            raise OSError("disk on fire")

    expected = OSError if rank == 0 else collectives.RemoteError
    with pytest.raises(expected, match="disk on fire"):
        Comm(None).gather_or_raise(other)


def _short_group() -> ProcessGroup:
    group = dist.new_group(list(range(dist.get_world_size())), timeout=SHORT, backend="gloo")
    assert group is not None
    return group


@distributed(world_size=2, timeout=40)
@pytest.mark.parametrize("caller", [0, 1], ids=["dst", "other"])
def test_a_rank_that_never_comes_fails_gather_or_raise_promptly(caller: int) -> None:
    short = _short_group()
    if dist.get_rank() == caller:
        started = time.monotonic()
        with pytest.raises(CheckpointTimeoutError) as caught:
            Comm(short, operation="save").gather_or_raise(lambda: 1)
        assert time.monotonic() - started < PROMPTLY
        message = str(caught.value)
        assert "shardwise.checkpoint.save is collective" in message, message
        assert f"rank {1 - caller} did not arrive" in message, message
        # A local error comes first; the failed exchange is its note.
        with pytest.raises(ValueError, match="mine") as own:
            Comm(short, operation="save").gather_or_raise(_raise_mine)
        (note,) = own.value.__notes__
        assert note.startswith("It was not shared with the other ranks: ")
    dist.barrier()


def _raise_mine() -> int:
    raise ValueError("mine")
