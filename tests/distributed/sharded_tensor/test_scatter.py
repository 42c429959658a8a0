"""Scatter from a source rank in real gloo groups: ``shard_tensor``, ``shard_parameter`` and the
specs' own ``shard`` (reference §5 and §18; SPEC deviations 1, 6 and 13).

Every rank builds the same seeded source tensor, so each test can check on every rank that its
local shards are exactly the right slices of it. Non-source ranks usually pass something else
(other values, sizes or dtypes) to show that only the source's tensor is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import shardwise as sw
from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardingSpec,
    ShardMetadata,
    TensorProperties,
)
from tests.harness import distributed

NOT_CONTIGUOUS = "input tensor is not a contiguous Tensor"


def _chunk(dim: int, ranks: list[int]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _box(offsets: list[int], sizes: list[int], rank: int) -> ShardMetadata:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")


def _source(size: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """The same tensor on every rank, with values that tell every element apart."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(size, generator=gen) > 0.5
    if dtype == torch.int64:
        # Beyond 2**53, so a detour through any floating dtype would show.
        return torch.randint(-(2**62), 2**62, size, generator=gen, dtype=torch.int64)
    return torch.randn(size, generator=gen, dtype=dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh row-major copy: strides of size-1 dims may be anything in a view.
    return tensor.detach().clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)


def _region(full: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    index = tuple(
        slice(offset, offset + size)
        for offset, size in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
    )
    return full[index]


def _assert_scattered(st: Any, full: torch.Tensor) -> None:
    """``st`` holds, on this rank, exactly the shards its metadata places here, bit for bit."""
    me = dist.get_rank()
    assert isinstance(st, ShardedTensor)
    assert st.size() == full.size()
    assert st.dtype == full.dtype
    mine = [md for md in st.metadata().shards_metadata if md.placement.rank() == me]
    assert [shard.metadata for shard in st.local_shards()] == mine
    for shard in st.local_shards():
        expected = _region(full, shard.metadata)
        assert shard.tensor.dtype == full.dtype
        assert shard.tensor.device == torch.device("cpu")
        assert shard.tensor.is_contiguous()
        assert shard.tensor.shape == expected.shape
        assert torch.equal(_bits(shard.tensor), _bits(expected))


# ---------------------------------------------------------------------------------------------
# Chunk layouts
# ---------------------------------------------------------------------------------------------

CHUNK_CASES = {
    "rows": ((12, 8), 0, [0, 1, 2, 3], 0),
    "columns": ((8, 12), 1, [0, 1, 2, 3], 0),
    "uneven": ((10, 6), 0, [0, 1, 2, 3], 0),
    "empty-trailing-5-over-4": ((5, 8), 0, [0, 1, 2, 3], 0),
    "reversed-negative-dim-src2": ((6, 10), -1, [3, 2, 1, 0], 2),
    "shuffled-3d-src3": ((7, 3, 5), 1, [2, 0, 3, 1], 3),
    "several-per-rank-src1": ((11, 4), 0, [0, 1, 0, 1, 2, 3, 3], 1),
}


@distributed(world_size=4)
@pytest.mark.parametrize("case", list(CHUNK_CASES), ids=list(CHUNK_CASES))
def test_shard_tensor_chunk_layouts(case: str) -> None:
    size, dim, ranks, src = CHUNK_CASES[case]
    full = _source(size, seed=len(case))
    spec = _chunk(dim, ranks)
    # Only the source's data counts: the others pass other values.
    given = full if dist.get_rank() == src else torch.full(size, -1.0)
    st = sw.shard_tensor(given, spec, src_rank=src)
    _assert_scattered(st, full)
    assert st.sharding_spec() is spec
    assert not st.requires_grad
    expected = spec.build_metadata(full.size(), TensorProperties.create_from_tensor(full))
    assert st.metadata().shards_metadata == expected.shards_metadata
    assert st.metadata().tensor_properties == expected.tensor_properties
    # One local shard per placement naming this rank, in placement order.
    assert len(st.local_shards()) == ranks.count(dist.get_rank())


@distributed(world_size=4)
def test_empty_trailing_chunk_keeps_offset_past_the_end() -> None:
    # SPEC 1: 5 rows over 4 ranks gives offsets 0, 2, 4, 6 and rank 3 an empty [0, 3] shard.
    full = _source((5, 3))
    st = sw.shard_tensor(full, _chunk(0, [0, 1, 2, 3]))
    shards = st.metadata().shards_metadata
    assert [md.shard_offsets for md in shards] == [[0, 0], [2, 0], [4, 0], [6, 0]]
    assert [md.shard_sizes for md in shards] == [[2, 3], [2, 3], [1, 3], [0, 3]]
    local = st.local_tensor()
    assert list(local.shape) == shards[dist.get_rank()].shard_sizes
    assert torch.equal(local, full[2 * dist.get_rank() : 2 * dist.get_rank() + 2])


@distributed(world_size=2)
def test_shard_tensor_two_ranks_from_rank_one() -> None:
    full = _source((9, 5), dtype=torch.float64)
    spec = _chunk(1, [1, 0])
    st = sw.shard_tensor(full if dist.get_rank() == 1 else torch.zeros(9, 5), spec, src_rank=1)
    _assert_scattered(st, full)
    # Columns 0-2 on rank 1, columns 3-4 on rank 0.
    assert st.local_tensor().shape == ((9, 2), (9, 3))[dist.get_rank()]


# ---------------------------------------------------------------------------------------------
# Enumerable layouts and the specs' own shard()
# ---------------------------------------------------------------------------------------------


def _grid_2x2() -> tuple[tuple[int, ...], list[ShardMetadata]]:
    return (10, 10), [
        _box([0, 0], [5, 5], 0),
        _box([0, 5], [5, 5], 1),
        _box([5, 0], [5, 5], 2),
        _box([5, 5], [5, 5], 3),
    ]


def _irregular() -> tuple[tuple[int, ...], list[ShardMetadata]]:
    # Several boxes per rank, listed out of rank order, and rank 1 owning only an empty box.
    return (6, 9), [
        _box([0, 4], [3, 5], 2),
        _box([0, 0], [3, 4], 3),
        _box([3, 2], [3, 7], 2),
        _box([6, 0], [0, 9], 1),
        _box([3, 0], [3, 2], 0),
    ]


ENUM_CASES = {"grid-2x2": _grid_2x2, "irregular": _irregular}


@distributed(world_size=4)
@pytest.mark.parametrize("case", list(ENUM_CASES), ids=list(ENUM_CASES))
@pytest.mark.parametrize("src", [0, 2])
def test_shard_tensor_enumerable_layouts(case: str, src: int) -> None:
    size, boxes = ENUM_CASES[case]()
    full = _source(size, seed=src)
    spec = EnumerableShardingSpec(boxes)
    st = sw.shard_tensor(full if dist.get_rank() == src else torch.zeros(1), spec, src_rank=src)
    _assert_scattered(st, full)
    assert st.sharding_spec() is spec
    assert st.metadata().shards_metadata == boxes
    assert len(st.local_shards()) == [b.placement.rank() for b in boxes].count(dist.get_rank())


@distributed(world_size=4)
def test_spec_shard_methods_scatter_directly() -> None:
    full = _source((8, 6), dtype=torch.float64, seed=3)
    chunk = _chunk(0, [1, 1, 3, 0])
    st = chunk.shard(full if dist.get_rank() == 1 else torch.ones(2, 2), src_rank=1)
    _assert_scattered(st, full)
    assert st.sharding_spec() is chunk
    assert len(st.local_shards()) == {0: 1, 1: 2, 2: 0, 3: 1}[dist.get_rank()]

    size, boxes = _grid_2x2()
    grid_source = _source(size, seed=4)
    enumerable = EnumerableShardingSpec(boxes)
    st = enumerable.shard(grid_source, process_group=dist.group.WORLD)
    _assert_scattered(st, grid_source)
    assert st.sharding_spec() is enumerable
    assert st.local_tensor().shape == (5, 5)


@dataclass
class _WholeOnOneRank(ShardingSpec):
    """A user-defined spec: the whole tensor on one rank; its ``shard`` records each call."""

    rank: int

    def build_metadata(
        self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        box = _box([0] * len(tensor_sizes), list(tensor_sizes), self.rank)
        return ShardedTensorMetadata([box], tensor_sizes, tensor_properties)

    def shard(
        self, tensor: torch.Tensor, src_rank: int = 0, process_group: ProcessGroup | None = None
    ) -> ShardedTensor:
        CUSTOM_CALLS.append((src_rank, process_group))
        if self.rank < 0:
            raise NotImplementedError("_WholeOnOneRank.shard not implemented for rank < 0")
        whole = EnumerableShardingSpec([_box([0] * tensor.dim(), list(tensor.size()), self.rank)])
        return whole.shard(tensor, src_rank=src_rank, process_group=process_group)


CUSTOM_CALLS: list[tuple[int, ProcessGroup | None]] = []


@distributed(world_size=4)
def test_shard_tensor_calls_a_user_spec_shard() -> None:
    CUSTOM_CALLS.clear()
    full = _source((4, 3), seed=5)
    st = sw.shard_tensor(full, _WholeOnOneRank(rank=2), src_rank=3)
    assert CUSTOM_CALLS == [(3, dist.group.WORLD)]
    _assert_scattered(st, full)
    assert len(st.local_shards()) == (1 if dist.get_rank() == 2 else 0)

    # An error raised by the user's own shard() reaches the caller unchanged (upstream's
    # GridShardingSpec test expects exactly that).
    with pytest.raises(NotImplementedError, match=re.escape("not implemented for rank < 0")):
        sw.shard_tensor(full, _WholeOnOneRank(rank=-1))
    assert len(CUSTOM_CALLS) == 2


# ---------------------------------------------------------------------------------------------
# dtypes, requires_grad, what non-source ranks pass
# ---------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


@distributed(world_size=4)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_keeps_dtype_bit_exact(dtype: torch.dtype) -> None:
    full = _source((3, 7), dtype=dtype, seed=6)
    # Columns (non-contiguous slices on the source), an empty chunk and a shuffled order.
    spec = _chunk(1, [2, 0, 3, 1, 2])
    given = full if dist.get_rank() == 3 else torch.zeros(2, dtype=torch.int8)
    st = sw.shard_tensor(given, spec, src_rank=3)
    _assert_scattered(st, full)
    assert st.metadata().tensor_properties.dtype == dtype
    assert [md.shard_sizes[1] for md in st.metadata().shards_metadata] == [2, 2, 2, 1, 0]


@distributed(world_size=4)
def test_requires_grad_is_copied_from_the_source() -> None:
    full = _source((8, 4), seed=7)
    leaf = full.clone().requires_grad_(dist.get_rank() == 0)
    # Only the source's flag counts: ranks 1-3 pass tensors that do not require grad.
    st = sw.shard_tensor(leaf, _chunk(0, [0, 1, 2, 3]))
    assert st.requires_grad
    assert st.metadata().tensor_properties.requires_grad
    shard = st.local_tensor()
    assert shard.requires_grad and shard.is_leaf and shard.grad_fn is None
    assert torch.equal(shard.detach(), full[2 * dist.get_rank() : 2 * dist.get_rank() + 2])

    plain = sw.shard_tensor(full, _chunk(0, [0, 1, 2, 3]))
    assert not plain.requires_grad
    assert not plain.local_tensor().requires_grad


@distributed(world_size=4)
def test_partial_world_source_owns_nothing() -> None:
    full = _source((10, 2), seed=8)
    spec = _chunk(0, [3, 1])
    st = sw.shard_tensor(full, spec)  # src_rank 0 owns no shard
    _assert_scattered(st, full)
    assert len(st.local_shards()) == (1 if dist.get_rank() in (1, 3) else 0)
    assert len(st.metadata().shards_metadata) == 2


# ---------------------------------------------------------------------------------------------
# Sub-groups: src_rank is a group rank, placements name global ranks
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_shard_tensor_on_a_sub_group() -> None:
    group = dist.new_group([1, 2, 3])
    me = dist.get_rank()
    full = _source((9, 4), seed=9)
    # src_rank=1 is group rank 1, i.e. global rank 2. Rank 0 is not in the group: it calls too
    # (SPMD code does), takes part in nothing and keeps no shard.
    given = full if me in (0, 2) else torch.zeros(3)
    spec = _chunk(0, [3, 1, 2])
    st = sw.shard_tensor(given, spec, src_rank=1, process_group=group)
    _assert_scattered(st, full)
    assert st._process_group is group
    assert len(st.local_shards()) == (0 if me == 0 else 1)
    assert st.sharding_spec() is spec

    # Several shards per rank and an enumerable spec, from group rank 2 (global rank 3).
    boxes = [_box([0, 0], [4, 4], 3), _box([4, 0], [2, 4], 1), _box([6, 0], [3, 4], 3)]
    st = EnumerableShardingSpec(boxes).shard(
        full if me in (0, 3) else torch.zeros(1), src_rank=2, process_group=group
    )
    _assert_scattered(st, full)
    assert len(st.local_shards()) == {0: 0, 1: 1, 2: 0, 3: 2}[me]

    # shard_parameter goes the same way.
    fc = _linear()
    weight = fc.weight.detach().clone()
    sw.shard_parameter(fc, "weight", _chunk(1, [1, 2, 3]), src_rank=0, process_group=group)
    assert isinstance(fc.weight, ShardedTensor)
    _assert_scattered(fc.weight.detach(), weight)


@distributed(world_size=4)
def test_shard_tensor_on_a_two_rank_sub_group_with_src_zero() -> None:
    group = dist.new_group([2, 3])
    if dist.get_rank() not in (2, 3):
        return
    full = _source((5, 5), dtype=torch.int64, seed=10)
    given = full if dist.get_rank() == 2 else torch.zeros(5, 5, dtype=torch.int64)
    st = sw.shard_tensor(given, _chunk(1, [3, 2]), process_group=group)
    _assert_scattered(st, full)


# ---------------------------------------------------------------------------------------------
# Errors: every rank raises the same error before any data moves
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4, timeout=20)
def test_non_contiguous_input_shard_tensor_refuses_spec_shard_accepts() -> None:
    spec = _chunk(0, [0, 1, 2, 3])
    transposed = _source((4, 8), seed=12).t()
    assert not transposed.is_contiguous()
    with pytest.raises(ValueError, match=f"^{re.escape(NOT_CONTIGUOUS)}$"):
        sw.shard_tensor(transposed, spec)
    # Upstream's specs copy the slices out of any strided tensor: so do ours.
    _assert_scattered(spec.shard(transposed), transposed)
    boxes = [_box([0, 0], [8, 1], 3), _box([0, 1], [8, 3], 1)]
    _assert_scattered(EnumerableShardingSpec(boxes).shard(transposed, src_rank=2), transposed)


@distributed(world_size=4, timeout=20)
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_non_contiguous_input_on_one_rank_raises_on_every_rank(bad_rank: int) -> None:
    full = _source((8, 4))
    given = full.t().contiguous().t() if dist.get_rank() == bad_rank else full
    assert given.is_contiguous() == (dist.get_rank() != bad_rank)
    with pytest.raises(ValueError, match=f"^{re.escape(NOT_CONTIGUOUS)}$"):
        sw.shard_tensor(given, _chunk(0, [0, 1, 2, 3]))
    # Nobody is left inside a collective: the group still works.
    _assert_scattered(sw.shard_tensor(full, _chunk(0, [3, 2, 1, 0])), full)


@distributed(world_size=4, timeout=20)
def test_src_rank_mismatch_raises_on_every_rank() -> None:
    me = dist.get_rank()
    full = _source((8, 4))
    spec = _chunk(0, [0, 1, 2, 3])
    # Every rank names itself: each one differs from the first other rank it compares with.
    other = 1 if me == 0 else 0
    message = f"src_rank={me} on rank: {me} does not match with src_rank={other} on rank: {other}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sw.shard_tensor(full, spec, src_rank=me)

    # Only rank 2 differs.
    src = 1 if me == 2 else 0
    other = 0 if me == 2 else 2
    message = (
        f"src_rank={src} on rank: {me} does not match with src_rank={1 - src} on rank: {other}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        spec.shard(full, src_rank=src)


@distributed(world_size=4, timeout=20)
def test_spec_mismatch_raises_on_every_rank() -> None:
    me = dist.get_rank()
    full = _source((8, 4))

    def spec_of(rank: int) -> ChunkShardingSpec:
        return _chunk(0, [rank, 1, 2, 3])

    other = 1 if me == 0 else 0
    message = (
        f"sharding_spec={spec_of(me)} on rank: {me} does not match with "
        f"sharding_spec={spec_of(other)} on rank: {other}"
    )
    assert "ChunkShardingSpec(dim=0, placements=[rank:" in message
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sw.shard_tensor(full, spec_of(me))


@distributed(world_size=4, timeout=20)
def test_mismatches_are_reported_rank_by_rank() -> None:
    # Upstream compares (src_rank, spec) one rank at a time: rank 1's different spec is found
    # before rank 2's different src_rank.
    me = dist.get_rank()
    spec = _chunk(0, [0, 1, 2, 3]) if me != 1 else _chunk(1, [0, 1, 2, 3])
    src = 1 if me == 2 else 0
    if me == 0:
        expected = (
            f"sharding_spec={spec} on rank: 0 does not match with "
            f"sharding_spec={_chunk(1, [0, 1, 2, 3])} on rank: 1"
        )
    elif me == 1:
        expected = (
            f"sharding_spec={spec} on rank: 1 does not match with "
            f"sharding_spec={_chunk(0, [0, 1, 2, 3])} on rank: 0"
        )
    elif me == 2:
        expected = "src_rank=1 on rank: 2 does not match with src_rank=0 on rank: 0"
    else:
        expected = (
            f"sharding_spec={spec} on rank: 3 does not match with "
            f"sharding_spec={_chunk(1, [0, 1, 2, 3])} on rank: 1"
        )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        sw.shard_tensor(_source((8, 4)), spec, src_rank=src)


@distributed(world_size=4, timeout=20)
def test_layout_errors_raise_on_every_rank() -> None:
    # The boxes do not cover the tensor, the dim does not exist, src_rank is not in the group.
    short = EnumerableShardingSpec([_box([0, 0], [2, 4], 0), _box([2, 0], [2, 4], 1)])
    with pytest.raises(ValueError, match=re.escape("Total volume of shards: 16 does not match")):
        sw.shard_tensor(_source((6, 4)), short)
    with pytest.raises(ValueError, match=r"^Invalid sharding dim: 2$"):
        sw.shard_tensor(_source((6, 4)), _chunk(2, [0, 1]))
    with pytest.raises(
        ValueError, match=re.escape("src_rank=4 is not a rank of the process group")
    ):
        sw.shard_tensor(_source((6, 4)), _chunk(0, [0, 1]), src_rank=4)


# ---------------------------------------------------------------------------------------------
# shard_parameter
# ---------------------------------------------------------------------------------------------


def _linear() -> nn.Linear:
    torch.manual_seed(11)  # the same weights on every rank
    return nn.Linear(12, 8)


@distributed(world_size=4)
def test_shard_parameter_replaces_the_parameter() -> None:
    me = dist.get_rank()
    fc = _linear()
    weight = fc.weight.detach().clone()
    if me != 1:
        with torch.no_grad():
            fc.weight.fill_(-5.0)  # only src_rank 1's weight counts
    sw.shard_parameter(fc, "weight", _chunk(0, [0, 1, 2, 3]), src_rank=1)
    param = fc.weight
    assert isinstance(param, ShardedTensor)
    assert isinstance(param, nn.Parameter)
    assert dict(fc.named_parameters())["weight"] is param
    assert param.requires_grad
    assert param.size() == (8, 12)
    assert torch.equal(param.local_tensor().detach(), weight[2 * me : 2 * me + 2])

    # SPEC 6: nn.Module.to(dtype) calls t.to(device, dtype, non_blocking) and converts it.
    fc.to(torch.float64)
    converted = fc.weight
    assert isinstance(converted, ShardedTensor)
    assert isinstance(converted, nn.Parameter)
    assert converted.dtype == torch.float64
    assert converted.metadata().tensor_properties.dtype == torch.float64
    assert converted.local_tensor().dtype == torch.float64
    assert converted.requires_grad
    assert torch.equal(converted.local_tensor().detach(), weight[2 * me : 2 * me + 2].double())
    assert fc.bias.dtype == torch.float64


@distributed(world_size=4, timeout=20)
def test_shard_parameter_errors() -> None:
    me = dist.get_rank()
    spec = _chunk(0, [0, 1, 2, 3])
    fc = _linear()
    with pytest.raises(ValueError, match=re.escape("does not match with src_rank")):
        sw.shard_parameter(fc, "weight", spec, src_rank=me)
    assert not isinstance(fc.weight, ShardedTensor)  # nothing replaced on failure

    with pytest.raises(AttributeError, match=f"^{re.escape('Linear has no attribute `foo`')}$"):
        sw.shard_parameter(fc, "foo", spec)

    del fc.bias
    fc.bias = "foo"  # type: ignore[assignment]
    message = "Expected Linear.bias to be a Tensor, but found str"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sw.shard_parameter(fc, "bias", spec)

    fc.bias = torch.rand(10, 10).t()  # type: ignore[assignment]
    message = "param: bias is not a contiguous Tensor"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sw.shard_parameter(fc, "bias", spec)

    with pytest.raises(ValueError, match=re.escape("does not match with sharding_spec")):
        sw.shard_parameter(fc, "weight", _chunk(0, [me, 1, 2, 3]))


@distributed(world_size=4, timeout=20)
def test_shard_parameter_error_on_one_rank_raises_everywhere() -> None:
    fc = _linear()
    if dist.get_rank() == 3:
        del fc.bias
        fc.bias = torch.rand(4, 2).t()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^param: bias is not a contiguous Tensor$"):
        sw.shard_parameter(fc, "bias", _chunk(0, [0, 1]))
