"""Pickling / ``torch.save`` of ShardedTensors (reference §17, SPEC deviation 10) and
``load_with_process_group``, on real gloo groups.

Each rank saves its own shards to its own file; loading checks the saved rank and world sizes
against the group it loads into, in upstream's order, without communicating.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import ChunkShardingSpec, EnumerableShardingSpec, ShardedTensor, ShardMetadata
from shardwise.sharded_tensor import serialization
from tests.harness import distributed, run_on_ranks

NEED_DEFAULT_GROUP = (
    'Need to initialize default process group using "init_process_group" before loading '
    "ShardedTensor"
)


def _chunk(dim: int, ranks: list[int]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _file(directory: Path, rank: int | None = None) -> Path:
    return directory / f"rank{dist.get_rank() if rank is None else rank}.pt"


def _assert_same(loaded: object, st: ShardedTensor) -> None:
    assert type(loaded) is ShardedTensor
    assert loaded is not st
    assert loaded.metadata() == st.metadata()
    assert loaded.sharding_spec() == st.sharding_spec()
    assert loaded.size() == st.size()
    assert loaded.dtype == st.dtype
    assert loaded.requires_grad == st.requires_grad
    assert len(loaded.local_shards()) == len(st.local_shards())
    for mine, theirs in zip(loaded.local_shards(), st.local_shards(), strict=True):
        assert mine.metadata == theirs.metadata
        assert mine.tensor.dtype == theirs.tensor.dtype
        assert torch.equal(mine.tensor, theirs.tensor)
    # The default group object itself, so ops mixing it with the original work.
    assert loaded._process_group is dist.group.WORLD
    assert torch.equal(loaded, st)


def _layouts() -> list[ShardedTensor]:
    torch.manual_seed(dist.get_rank())
    grid = EnumerableShardingSpec(
        [
            ShardMetadata([0, 0], [5, 5], "rank:0/cpu"),
            ShardMetadata([0, 5], [5, 5], "rank:1/cpu"),
            ShardMetadata([5, 0], [5, 5], "rank:2/cpu"),
            ShardMetadata([5, 5], [5, 5], "rank:3/cpu"),
        ]
    )
    return [
        sw.rand(_chunk(0, [0, 1, 2, 3]), 10, 20),
        sw.rand(_chunk(1, [3, 1, 0, 2]), 6, 9, dtype=torch.float64, requires_grad=True),
        sw.rand(grid, 10, 10),
        # Several shards per rank, two of them empty (offsets 24 and 27).
        sw.rand(_chunk(0, [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]), 24, 3),
        # Empty trailing chunk: 5 rows over 4 ranks.
        sw.full(_chunk(0, [0, 1, 2, 3]), (5, 2), 7),
        # Owned by two ranks only: the others save no shards.
        sw.ones(_chunk(0, [3, 1]), 4, 4, dtype=torch.int32),
    ]


@distributed(world_size=4)
@pytest.mark.parametrize("weights_only", [False, True])
def test_round_trip_through_a_file(tmp_path: Path, weights_only: bool) -> None:
    originals = _layouts()
    for index, st in enumerate(originals):
        path = tmp_path / f"t{index}-rank{dist.get_rank()}.pt"
        torch.save(st, path)
        _assert_same(torch.load(path, weights_only=weights_only), st)
    # A dict of them (the shape of a state dict) in one file.
    torch.save({"a": originals[0], "nested": {"b": originals[3]}}, _file(tmp_path))
    loaded = torch.load(_file(tmp_path), weights_only=weights_only)
    _assert_same(loaded["a"], originals[0])
    _assert_same(loaded["nested"]["b"], originals[3])


@distributed(world_size=4)
def test_plain_pickle_round_trip() -> None:
    st = sw.rand(_chunk(1, [2, 0, 3, 1]), 8, 8)
    _assert_same(pickle.loads(pickle.dumps(st)), st)
    state = st.__getstate__()
    assert isinstance(state, tuple) and len(state) == 5
    local_shards, metadata, where, spec, init_rrefs = state
    assert local_shards is st.local_shards()
    assert metadata is st.metadata()
    assert spec is st.sharding_spec()
    assert init_rrefs is False
    rank = dist.get_rank()
    assert where == serialization.ProcessGroupState(rank, rank, 4, 4)


@distributed(world_size=4)
def test_rank_checks_upstream_case(tmp_path: Path) -> None:
    # Saved under the 4-rank default group, loaded into the group of ranks [0, 2, 3].
    st = sw.rand(_chunk(0, [0, 1, 2, 3]), 10, 20)
    torch.save(st, _file(tmp_path))
    group = dist.new_group([0, 2, 3])
    expected = {
        0: "Local world size at save time was 4, but at load time was 3",
        # Rank 1 is not a member: its group rank is -1.
        1: "Local rank at save time was 1, but at load time was -1",
        2: "Local rank at save time was 2, but at load time was 1",
        3: "Local rank at save time was 3, but at load time was 2",
    }[dist.get_rank()]
    for weights_only in (False, True):
        with (
            sw.load_with_process_group(group),
            pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"),
        ):
            torch.load(_file(tmp_path), weights_only=weights_only)
    # The context manager was reset by the failures: loading normally works again.
    _assert_same(torch.load(_file(tmp_path), weights_only=True), st)


@distributed(world_size=4)
def test_global_rank_check(tmp_path: Path) -> None:
    # Rank 1 saves a tensor of the group [1, 2, 3] (group rank 0); rank 0 loads that file into
    # the group [0, 2, 3], where it is group rank 0 too: only the global rank differs.
    group = dist.new_group([1, 2, 3])
    other = dist.new_group([0, 2, 3])
    st = sw.rand(_chunk(0, [1, 2, 3]), 6, 2, process_group=group)
    if dist.get_rank() == 1:
        torch.save(st, _file(tmp_path))
    dist.barrier()
    if dist.get_rank() == 0:
        with (
            sw.load_with_process_group(other),
            pytest.raises(
                RuntimeError,
                match=f"^{re.escape('Global rank at save time was 1, but at load time was 0')}$",
            ),
        ):
            torch.load(_file(tmp_path, rank=1), weights_only=True)


def _save_on_a_two_rank_group(directory: str) -> None:
    # Rank 0 saves a tensor of the group [0, 1] of a 4-rank world: (0, 0, 2, 4).
    group = dist.new_group([0, 1])
    st = sw.rand(_chunk(0, [0, 1]), 4, 3, process_group=group)
    if dist.get_rank() == 0:
        torch.save(st, Path(directory) / "rank0.pt")
    dist.barrier()


def _load_in_a_two_rank_world(directory: str) -> str:
    if dist.get_rank() != 0:
        return ""
    with pytest.raises(RuntimeError) as raised:
        torch.load(Path(directory) / "rank0.pt", weights_only=True)
    return str(raised.value)


def test_global_world_size_check(tmp_path: Path) -> None:
    # Same group rank, global rank and group size; only the world is smaller at load time.
    run_on_ranks(_save_on_a_two_rank_group, 4, args=(str(tmp_path),))
    messages = run_on_ranks(_load_in_a_two_rank_world, 2, args=(str(tmp_path),))
    assert messages[0] == "Global world size at save time was 4, but at load time was 2"


@distributed(world_size=4)
def test_load_into_an_equivalent_group(tmp_path: Path) -> None:
    group = dist.new_group([1, 2, 3])
    same_ranks = dist.new_group([1, 2, 3])
    st = sw.rand(_chunk(1, [3, 2, 1]), 5, 7, process_group=group)
    if dist.get_rank() == 0:
        return
    torch.save(st, _file(tmp_path))
    with sw.load_with_process_group(same_ranks) as yielded:
        assert yielded is same_ranks
        loaded = torch.load(_file(tmp_path), weights_only=True)
    assert loaded._process_group is same_ranks
    assert loaded.metadata() == st.metadata()
    assert torch.equal(loaded.local_tensor(), st.local_tensor())


@distributed(world_size=4)
def test_new_group_state_dict_round_trip(tmp_path: Path) -> None:
    # Upstream's test_state_dict_new_group: every rank (members of [2, 3] or not) saves and
    # loads a module state dict holding tensors of that group, then compares on every rank.
    group = dist.new_group([2, 3])
    spec = _chunk(0, [2, 3])
    model = _Holder(sw.rand(spec, 10, 20, process_group=group))
    model._register_state_dict_hook(sw.state_dict_hook)
    torch.save(model.state_dict(), _file(tmp_path))
    fresh = _Holder(None)
    fresh._register_load_state_dict_pre_hook(sw.pre_load_state_dict_hook, True)
    with sw.load_with_process_group(group):
        state = torch.load(_file(tmp_path), weights_only=True)
    fresh.load_state_dict(state, strict=False)
    assert isinstance(fresh.st, ShardedTensor)
    assert fresh.st._process_group is group
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(model.st, fresh.st)


class _Holder(nn.Module):
    def __init__(self, st: ShardedTensor | None) -> None:
        super().__init__()
        self.st = st
        self.weight = nn.Parameter(torch.arange(4.0))


@distributed(world_size=4)
def test_load_with_process_group_is_not_reentrant() -> None:
    group = dist.new_group([0, 1, 2, 3])
    nested = 'ProcessGroup already set by previous "load_with_process_group" context manager'
    with sw.load_with_process_group(group) as yielded:
        assert yielded is group
        assert serialization.get_current_process_group() is group
        with (
            pytest.raises(RuntimeError, match=f"^{re.escape(nested)}$"),
            sw.load_with_process_group(dist.group.WORLD),
        ):
            pass
        # The failed nesting left the outer group in place.
        assert serialization.get_current_process_group() is group
    assert serialization.get_current_process_group() is dist.group.WORLD
    # An exception inside the block resets it too.
    with pytest.raises(KeyError, match="boom"), sw.load_with_process_group(group):
        raise KeyError("boom")
    assert serialization.get_current_process_group() is dist.group.WORLD
    with sw.load_with_process_group(group):
        assert serialization.get_current_process_group() is group


@distributed(world_size=2, fresh=True)
def test_loading_without_a_default_group(tmp_path: Path) -> None:
    st = sw.rand(_chunk(0, [0, 1]), 4, 4)
    path = _file(tmp_path)
    torch.save(st, path)
    data = pickle.dumps(st)
    dist.destroy_process_group()
    for weights_only in (False, True):
        with pytest.raises(RuntimeError, match=f"^{re.escape(NEED_DEFAULT_GROUP)}$"):
            torch.load(path, weights_only=weights_only)
    with pytest.raises(RuntimeError, match=f"^{re.escape(NEED_DEFAULT_GROUP)}$"):
        pickle.loads(data)
