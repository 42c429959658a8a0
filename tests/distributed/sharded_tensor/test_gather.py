"""``ShardedTensor.gather`` in real gloo groups (reference §11; SPEC deviation 2).

The sharded tensors are built from a seeded full tensor that every rank knows, with
``_init_from_local_shards_and_global_metadata`` (no communication), so these tests depend on
gather alone and can compare the gathered tensor bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardwise import (
    ChunkShardingSpec,
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from tests.harness import distributed


def _box(offsets: list[int], sizes: list[int], rank: int) -> ShardMetadata:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")


def _chunk_boxes(size: tuple[int, ...], dim: int, ranks: list[int]) -> list[ShardMetadata]:
    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])
    return spec.build_metadata(torch.Size(size), TensorProperties()).shards_metadata


def _source(size: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """The same tensor on every rank, with values that tell every element apart."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(size, generator=gen) > 0.5
    if dtype == torch.int64:
        # Beyond 2**53: a detour through float64 (let alone float32) would change them.
        return torch.randint(-(2**62), 2**62, size, generator=gen, dtype=torch.int64)
    return torch.randn(size, generator=gen, dtype=dtype)


def _region(full: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    index = tuple(
        slice(offset, offset + size)
        for offset, size in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
    )
    return full[index]


def _sharded(
    full: torch.Tensor, boxes: list[ShardMetadata], group: ProcessGroup | None = None
) -> ShardedTensor:
    """``full`` cut into ``boxes``; this rank keeps the boxes placed on it (as leaves that
    require grad iff ``full`` does)."""
    me = dist.get_rank()
    local = [
        Shard(
            _region(full, box)
            .detach()
            .clone(memory_format=torch.contiguous_format)
            .requires_grad_(full.requires_grad),
            box,
        )
        for box in boxes
        if box.placement is not None and box.placement.rank() == me
    ]
    metadata = ShardedTensorMetadata(
        list(boxes), full.size(), TensorProperties.create_from_tensor(full)
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh row-major copy: strides of size-1 dims may be anything in a view.
    return tensor.detach().clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)


def _gather(st: ShardedTensor, dst: int, group_rank: int, **kwargs: Any) -> torch.Tensor | None:
    """Gather to ``dst``; returns the output on ``dst`` and checks it stays None elsewhere."""
    dtype = kwargs.pop("out_dtype", st.dtype)
    out = torch.empty(st.size(), dtype=dtype) if group_rank == dst else None
    st.gather(dst, out, **kwargs)
    return out


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------

LAYOUTS = {
    "rows": lambda: ((12, 5), _chunk_boxes((12, 5), 0, [0, 1, 2, 3])),
    "columns": lambda: ((6, 10), _chunk_boxes((6, 10), 1, [0, 1, 2, 3])),
    # Upstream's test_gather_uneven: 5 chunks of 2 rows on r0, r0, r1, r1, r2; rank 3 owns none.
    "several-per-rank": lambda: ((10, 20), _chunk_boxes((10, 20), 0, [0, 0, 1, 1, 2])),
    "empty-trailing-5-over-4": lambda: ((5, 4), _chunk_boxes((5, 4), 0, [0, 1, 2, 3])),
    "reversed-3d": lambda: ((3, 7, 2), _chunk_boxes((3, 7, 2), 1, [3, 2, 1, 0])),
    "grid": lambda: (
        (10, 10),
        [
            _box([0, 0], [5, 5], 0),
            _box([0, 5], [5, 5], 1),
            _box([5, 0], [5, 5], 2),
            _box([5, 5], [5, 5], 3),
        ],
    ),
    # Upstream's grid test_gather_uneven: rank 0 two boxes, rank 2 none.
    "grid-uneven": lambda: (
        (10, 10),
        [
            _box([0, 0], [5, 5], 0),
            _box([0, 5], [5, 5], 1),
            _box([5, 0], [5, 5], 0),
            _box([5, 5], [5, 5], 3),
        ],
    ),
    "irregular": lambda: (
        (6, 9),
        [
            _box([0, 4], [3, 5], 2),
            _box([0, 0], [3, 4], 3),
            _box([3, 2], [3, 7], 2),
            _box([6, 0], [0, 9], 1),
            _box([3, 0], [3, 2], 0),
        ],
    ),
}


@distributed(world_size=4)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_gather_any_layout_to_every_dst(layout: str) -> None:
    size, boxes = LAYOUTS[layout]()
    full = _source(size, seed=len(layout))
    st = _sharded(full, boxes)
    for dst in range(4):
        out = _gather(st, dst, dist.get_rank())
        if dist.get_rank() == dst:
            assert out is not None
            assert torch.equal(_bits(out), _bits(full))
        else:
            assert out is None


@distributed(world_size=2)
def test_gather_two_ranks_default_dst() -> None:
    full = _source((7, 3), dtype=torch.float64, seed=1)
    st = _sharded(full, _chunk_boxes((7, 3), 0, [1, 0, 1]))
    out = torch.zeros(7, 3, dtype=torch.float64) if dist.get_rank() == 0 else None
    assert st.gather(out=out) is None  # dst defaults to 0
    if out is not None:
        assert torch.equal(_bits(out), _bits(full))


@distributed(world_size=4)
def test_gather_partial_world() -> None:
    full = _source((9, 4), seed=2)
    st = _sharded(full, _chunk_boxes((9, 4), 0, [1, 3]))  # ranks 0 and 2 own nothing
    assert len(st.local_shards()) == (1 if dist.get_rank() in (1, 3) else 0)
    for dst in (0, 2, 3):
        out = _gather(st, dst, dist.get_rank())
        if out is not None:
            assert torch.equal(out, full)


# ---------------------------------------------------------------------------------------------
# Sub-groups: dst is a group rank (broken upstream, reference §11)
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_gather_on_a_sub_group() -> None:
    group = dist.new_group([1, 2, 3])
    full = _source((8, 6), seed=3)
    # Several boxes per rank, placements name global ranks 1-3, out of order.
    boxes = _chunk_boxes((8, 6), 1, [3, 1, 3, 2, 1, 3])
    st = _sharded(full, boxes, group)
    group_rank = dist.get_rank(group)  # -1 on rank 0
    for dst in range(3):
        out = _gather(st, dst, group_rank)
        if group_rank == dst:
            assert out is not None
            assert torch.equal(out, full)
        else:
            assert out is None


@distributed(world_size=4)
def test_gather_on_upstreams_failing_sub_group() -> None:
    # The case reference §11 verified broken upstream: new_group([2, 3]) with placements on
    # ranks 2 and 3. Group rank 0 is global rank 2, group rank 1 is global rank 3.
    group = dist.new_group([2, 3])
    full = _source((10, 20), dtype=torch.float64, seed=4)
    st = _sharded(full, _chunk_boxes((10, 20), 0, [2, 3]), group)
    if dist.get_rank() < 2:
        assert st.local_shards() == []
    group_rank = dist.get_rank(group)
    for dst in (0, 1):
        out = _gather(st, dst, group_rank)
        if group_rank == dst:
            assert out is not None
            assert torch.equal(_bits(out), _bits(full))


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


@distributed(world_size=4)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_keeps_the_dtype_bit_exact(dtype: torch.dtype) -> None:
    # SPEC 2: dtype=None gathers in the tensor's own dtype (upstream rounds through float32).
    full = _source((6, 5), dtype=dtype, seed=5)
    if dtype == torch.float64:
        # Values float32 cannot hold.
        full = full + 1e-12
        assert not torch.equal(full.float().double(), full)
    st = _sharded(full, _chunk_boxes((6, 5), 1, [2, 0, 3, 1]))
    out = _gather(st, 1, dist.get_rank())
    if out is not None:
        assert out.dtype == dtype
        assert torch.equal(_bits(out), _bits(full))


@distributed(world_size=4)
def test_gather_large_int64_exactly() -> None:
    full = torch.arange(16, dtype=torch.int64).view(4, 4) + (2**62 + 1)
    st = _sharded(full, _chunk_boxes((4, 4), 0, [3, 2, 1, 0]))
    out = _gather(st, 2, dist.get_rank())
    if out is not None:
        assert torch.equal(out, full)
        assert int(out[3, 3]) == 2**62 + 16


@distributed(world_size=4)
def test_gather_dtype_override_rounds_every_region() -> None:
    full = _source((8, 3), dtype=torch.float64, seed=6) + 1e-12
    rounded = full.float().double()
    assert not torch.equal(rounded, full)
    st = _sharded(full, _chunk_boxes((8, 3), 0, [0, 1, 2, 3]))
    # dst 0 owns a shard too: its own region goes through float32 like the received ones.
    out = _gather(st, 0, dist.get_rank(), dtype=torch.float32)
    if out is not None:
        assert out.dtype == torch.float64
        assert torch.equal(out, rounded)


@distributed(world_size=4)
@pytest.mark.parametrize("out_dtype", [torch.float64, torch.bfloat16, torch.float32], ids=str)
def test_gather_enforce_dtype_uses_out_dtype(out_dtype: torch.dtype) -> None:
    full = _source((7, 4), seed=7)  # float32
    st = _sharded(full, _chunk_boxes((7, 4), 0, [1, 2, 3, 1]))
    # Only dst knows out.dtype; every rank must still move the bytes in that dtype. A dtype=
    # argument is overridden by enforce_dtype, as upstream.
    out = _gather(st, 3, dist.get_rank(), out_dtype=out_dtype, enforce_dtype=True, dtype=None)
    if out is not None:
        assert out.dtype == out_dtype
        assert torch.equal(out, full.to(out_dtype))


# ---------------------------------------------------------------------------------------------
# Output validation: every rank raises, nobody hangs
# ---------------------------------------------------------------------------------------------


def _small() -> ShardedTensor:
    full = torch.arange(40.0).view(10, 4)
    return _sharded(full, _chunk_boxes((10, 4), 0, [0, 1, 2, 3]))


@distributed(world_size=4, timeout=20)
def test_gather_out_validation_raises_on_every_rank() -> None:
    me = dist.get_rank()
    st = _small()

    missing = "Argument ``dst_tensor`` must be specified on destination rank 1"
    with pytest.raises(ValueError, match=f"^{re.escape(missing)}$"):
        st.gather(1, None)

    wrong = "Argument ``dst_tensor`` have size (3, 4),but should be (10, 4)"
    with pytest.raises(ValueError, match=f"^{re.escape(wrong)}$"):
        st.gather(2, torch.zeros(3, 4) if me == 2 else None)

    wrong_3d = "Argument ``dst_tensor`` have size (10, 4, 1),but should be (10, 4)"
    with pytest.raises(ValueError, match=f"^{re.escape(wrong_3d)}$"):
        st.gather(0, torch.zeros(10, 4, 1) if me == 0 else None)

    extra = "Argument ``dst_tensor`` must NOT be specified on non-destination ranks."
    with pytest.raises(ValueError, match=f"^{re.escape(extra)}$"):
        st.gather(0, torch.zeros(10, 4))  # given on every rank

    # The group is still in step afterwards.
    out = _gather(st, 3, me)
    if out is not None:
        assert torch.equal(out, torch.arange(40.0).view(10, 4))


@distributed(world_size=4, timeout=20)
def test_gather_wrong_out_on_one_rank_raises_on_every_rank() -> None:
    me = dist.get_rank()
    st = _small()
    extra = "Argument ``dst_tensor`` must NOT be specified on non-destination ranks."
    # Only rank 3 passes an out (dst is 0, which passes a correct one).
    out = torch.zeros(10, 4) if me in (0, 3) else None
    with pytest.raises(ValueError, match=f"^{re.escape(extra)}$"):
        st.gather(0, out)

    # Only dst (rank 3) is wrong.
    out = torch.zeros(4, 10) if me == 3 else None
    wrong = "Argument ``dst_tensor`` have size (4, 10),but should be (10, 4)"
    with pytest.raises(ValueError, match=f"^{re.escape(wrong)}$"):
        st.gather(3, out)


@distributed(world_size=4, timeout=20)
def test_gather_dst_disagreement_and_range_raise_on_every_rank() -> None:
    me = dist.get_rank()
    st = _small()
    with pytest.raises(ValueError, match=re.escape("gather: dst=4 is not a rank")):
        st.gather(4, None)
    # Ranks 0 and 1 each believe they are dst, with a correct out: nobody may wait forever.
    disagree = "gather: ranks disagree on dst: [0, 1, 0, 0]"
    with pytest.raises(ValueError, match=f"^{re.escape(disagree)}$"):
        st.gather(me if me < 2 else 0, torch.zeros(10, 4) if me < 2 else None)


# ---------------------------------------------------------------------------------------------
# Memory: the destination receives sender by sender into one reusable buffer
# ---------------------------------------------------------------------------------------------


class _NewStorageBytes(TorchFunctionMode):
    """Sums the bytes of every plain tensor storage that a torch call creates (views and
    in-place results reuse an input's storage and are not counted).

    A torch-function mode sees the torch calls made from Python, which is where shardwise
    allocates; it is cheap to enter, unlike a dispatch mode, whose first use imports much of
    torch's compiler stack.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        inputs = {_storage(a) for a in tree_leaves((args, kwargs))}
        for tensor in tree_leaves(result):
            key = _storage(tensor)
            if key is not None and key not in inputs and key[1]:
                self.bytes += key[1]
                self.largest = max(self.largest, key[1])
        return result


def _storage(value: object) -> tuple[int, int] | None:
    # Plain tensors only: a ShardedTensor wrapper has no storage of its own.
    if type(value) is not torch.Tensor:
        return None
    storage = value.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@distributed(world_size=4)
def test_gather_memory_is_bounded_by_the_largest_sender() -> None:
    me = dist.get_rank()
    cols = 512
    # 32 one-row chunks: rank 1 holds 20 of them, ranks 2 and 3 six each, dst 0 none.
    ranks = [1] * 20 + [2] * 6 + [3] * 6
    full = _source((32, cols), seed=8)
    st = _sharded(full, _chunk_boxes((32, cols), 0, ranks))
    row_bytes = cols * 4
    out = torch.empty(32, cols) if me == 0 else None
    counter = _NewStorageBytes()
    with counter:
        st.gather(0, out)
    if me == 0:
        assert out is not None
        assert torch.equal(out, full)
        # One buffer of the largest sender's 20 rows, plus a few small metadata tensors. An
        # all-ranks gather list (upstream) would need 4 x 20 rows, a buffer per shard 32 rows.
        assert 20 * row_bytes <= counter.bytes <= 20 * row_bytes + 4096
        assert counter.largest == 20 * row_bytes
    else:
        # Senders send straight from their shards' memory: no copy of the data.
        assert counter.bytes <= 4096
