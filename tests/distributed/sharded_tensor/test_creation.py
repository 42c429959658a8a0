"""Creating ShardedTensors: the constructor, its accessors and tensor-like properties, and the
factories (``empty``, ``zeros``, ``ones``, ``full``, ``rand``, ``randn``) on real gloo groups.

Placements are CPU placements ("rank:N/cpu") naming *global* ranks; every body runs on every
rank of the group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import ChunkShardingSpec, EnumerableShardingSpec, ShardedTensor, ShardMetadata
from tests.harness import distributed

FACTORIES: dict[str, Callable[..., ShardedTensor]] = {
    "empty": sw.empty,
    "zeros": sw.zeros,
    "ones": sw.ones,
    "rand": sw.rand,
    "randn": sw.randn,
}


def _full_of_3(spec: Any, *size: Any, **kwargs: Any) -> ShardedTensor:
    """``full`` with the varargs size form of the other factories (``full`` takes one size)."""
    return sw.full(spec, size[0] if len(size) == 1 else size, 3.0, **kwargs)


ALL_FACTORIES = {**FACTORIES, "full": _full_of_3}


def _chunk(dim: int, ranks: Sequence[int], device: str = "cpu") -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/{device}" for r in ranks])


def _grid(ranks: Sequence[int] = (0, 1, 2, 3)) -> EnumerableShardingSpec:
    """A 10x10 tensor in four 5x5 blocks, block i (row-major) on ``ranks[i]``."""
    return EnumerableShardingSpec(
        [
            ShardMetadata([(i // 2) * 5, (i % 2) * 5], [5, 5], f"rank:{rank}/cpu")
            for i, rank in enumerate(ranks)
        ]
    )


def _offsets_and_sizes(st: ShardedTensor) -> list[tuple[list[int], list[int], str]]:
    return [
        (list(md.shard_offsets), list(md.shard_sizes), str(md.placement))
        for md in st.metadata().shards_metadata
    ]


# -- constructor and accessors ---------------------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("dim", [0, -2])
def test_constructor_row_wise_metadata_and_local_shard(dim: int) -> None:
    rank = dist.get_rank()
    spec = _chunk(dim, range(4))
    st = ShardedTensor(spec, 10, 20)
    assert isinstance(st, torch.Tensor)
    assert st.sharding_spec() is spec
    rows = [3, 3, 3, 1]
    assert _offsets_and_sizes(st) == [
        ([3 * r, 0], [rows[r], 20], f"rank:{r}/cpu") for r in range(4)
    ]
    assert st.metadata().size == torch.Size([10, 20])
    (shard,) = st.local_shards()
    assert shard.tensor.shape == (rows[rank], 20)
    assert shard.tensor.device == torch.device("cpu")
    # The local shard carries the very metadata object listed in the global metadata.
    assert shard.metadata is st.metadata().shards_metadata[rank]
    assert st.local_tensor() is shard.tensor
    # Accessors return live objects, not copies.
    assert st.metadata() is st.metadata()
    assert st.local_shards() is st.local_shards()


@distributed(world_size=4)
@pytest.mark.parametrize("dim", [1, -1])
def test_constructor_column_wise(dim: int) -> None:
    rank = dist.get_rank()
    st = sw.empty(_chunk(dim, range(4)), 10, 32)
    assert _offsets_and_sizes(st) == [([0, 8 * r], [10, 8], f"rank:{r}/cpu") for r in range(4)]
    assert st.local_tensor().shape == (10, 8)
    assert st.local_shards()[0].metadata.shard_offsets == [0, 8 * rank]


@distributed(world_size=4)
def test_tensor_like_properties() -> None:
    st = sw.empty(_chunk(0, range(4)), 10, 20)
    assert st.size() == torch.Size([10, 20])
    assert st.shape == torch.Size([10, 20])
    assert (st.size(0), st.size(1), st.size(-1), st.size(-2)) == (10, 20, 20, 10)
    for bad in (2, -3):
        with pytest.raises(IndexError, match=re.escape("Dimension out of range")):
            st.size(bad)
    assert st.dim() == 2
    assert st.ndim == 2
    assert st.dtype == torch.float32
    assert st.layout == torch.strided
    assert st.requires_grad is False
    assert st.device == torch.device("cpu")
    assert st.is_contiguous() is True
    assert st.contiguous() is st
    assert st.is_meta is False
    assert st.is_floating_point() is True
    assert st.is_pinned() is False
    assert hash(st) == id(st)
    assert st._process_group is dist.group.WORLD

    ints = sw.empty(_chunk(0, range(4)), 10, 20, dtype=torch.int32)
    assert ints.dtype == torch.int32
    assert ints.is_floating_point() is False
    assert ints.local_tensor().dtype == torch.int32


@distributed(world_size=4)
def test_requires_grad_and_dtype_reach_the_shards_and_metadata() -> None:
    st = sw.empty(_chunk(0, range(4)), 10, 20, requires_grad=True, dtype=torch.float64)
    assert st.requires_grad is True
    assert st.dtype == torch.float64
    properties = st.metadata().tensor_properties
    assert (properties.requires_grad, properties.dtype) == (True, torch.float64)
    local = st.local_tensor()
    assert local.requires_grad and local.is_leaf
    assert local.dtype == torch.float64


@distributed(world_size=2)
def test_repr_is_the_metadata_repr() -> None:
    st = sw.empty(_chunk(0, range(2)), 3, 2)
    expected = (
        "ShardedTensor(ShardedTensorMetadata(shards_metadata=["
        "ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 2], placement=rank:0/cpu), "
        "ShardMetadata(shard_offsets=[2, 0], shard_sizes=[1, 2], placement=rank:1/cpu)], "
        "size=torch.Size([3, 2]), tensor_properties=TensorProperties(dtype=torch.float32, "
        "layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, "
        "pin_memory=False)))"
    )
    assert repr(st) == expected


@distributed(world_size=2)
def test_attribute_setter_and_unsupported_torch_functions_are_rejected() -> None:
    st = sw.empty(_chunk(0, range(2)), 4, 2)
    with pytest.raises(RuntimeError, match="torch function '__set__'") as info:
        st.requires_grad = True  # type: ignore[misc]
    assert str(info.value).endswith("not supported for ShardedTensor!")
    assert st.requires_grad is False
    with pytest.raises(
        RuntimeError, match=r"(?s)^torch function 'add', .*not supported for ShardedTensor!$"
    ):
        torch.add(st, torch.ones(4, 2))


@distributed(world_size=4)
def test_aten_op_reaching_the_wrapper() -> None:
    # 4 ranks: the first dispatch to Python imports torch.distributed.tensor (seconds), which
    # the 4-rank pool's DTensor tests pay anyway.
    st = sw.empty(_chunk(0, range(4)), 4, 2)
    # With torch functions disabled, the aten op reaches __torch_dispatch__ on the wrapper.
    expected = (
        "A ShardedTensor object is being used from c++ while calling torch._ops.aten.add.Tensor "
        "but the there is no custom __torch_dispatch__ implementation for it."
    )
    with (
        torch._C.DisableTorchFunctionSubclass(),
        pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"),
    ):
        torch.add(st, st)


@distributed(world_size=1)
def test_world_size_one_owns_everything() -> None:
    st = sw.ones(_chunk(0, [0]), 4, 3)
    assert _offsets_and_sizes(st) == [([0, 0], [4, 3], "rank:0/cpu")]
    assert torch.equal(st.local_tensor(), torch.ones(4, 3))
    assert st.device == torch.device("cpu")
    # Several placements on the only rank: several local shards.
    two = sw.zeros(_chunk(1, [0, 0]), 4, 3)
    assert [tuple(s.tensor.shape) for s in two.local_shards()] == [(4, 2), (4, 1)]
    with pytest.raises(
        NotImplementedError,
        match=f"^{re.escape('Only single local shard is supported. Number of shards: 2')}$",
    ):
        two.local_tensor()


@distributed(world_size=4)
def test_default_keywords_of_the_constructor() -> None:
    # Upstream's __new__ read the keywords from **kwargs and raised KeyError without them;
    # ours has the documented defaults.
    st = ShardedTensor(_chunk(0, range(4)), [8, 2])
    assert st.dtype == torch.get_default_dtype()
    assert not st.requires_grad
    assert st.local_tensor().shape == (2, 2)


# -- devices: meta placements, no local shards -----------------------------------------------


@distributed(world_size=4)
def test_meta_placements() -> None:
    rank = dist.get_rank()
    st = sw.empty(_chunk(0, range(4), device="meta"), 8, 3)
    assert st.is_meta is True
    assert st.device == torch.device("meta")
    assert st.local_tensor().is_meta
    assert str(st.local_shards()[0].metadata.placement) == f"rank:{rank}/meta"

    # is_meta asks the single local shard, so 0 or 2 local shards raise.
    partial = sw.empty(_chunk(0, [0, 0, 1], device="meta"), 9, 3)
    num_local = len(partial.local_shards())
    assert num_local == [2, 1, 0, 0][rank]
    if num_local == 1:
        assert partial.is_meta is True
    else:
        with pytest.raises(
            NotImplementedError,
            match=re.escape(f"Only single local shard is supported. Number of shards: {num_local}"),
        ):
            _ = partial.is_meta


@distributed(world_size=4)
def test_partial_world_ranks_without_shards() -> None:
    rank = dist.get_rank()
    st = sw.ones(_chunk(0, [0, 2]), 10, 20)
    assert _offsets_and_sizes(st) == [
        ([0, 0], [5, 20], "rank:0/cpu"),
        ([5, 0], [5, 20], "rank:2/cpu"),
    ]
    if rank in (0, 2):
        assert torch.equal(st.local_tensor(), torch.ones(5, 20))
        assert st.local_shards()[0].metadata is st.metadata().shards_metadata[rank // 2]
    else:
        assert st.local_shards() == []
        # No local shard on a gloo group: the device is the CPU.
        assert st.device == torch.device("cpu")
        with pytest.raises(
            NotImplementedError,
            match=f"^{re.escape('Only single local shard is supported. Number of shards: 0')}$",
        ):
            st.local_tensor()
    assert st.size() == torch.Size([10, 20])


# -- factories: size forms, dtypes, values ---------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("name", sorted(ALL_FACTORIES))
def test_factory_size_forms(name: str) -> None:
    factory = ALL_FACTORIES[name]
    rank = dist.get_rank()
    spec = _chunk(0, range(4))
    forms: list[tuple[Any, ...]] = [
        ([10, 20],),
        ((10, 20),),
        (torch.Size([10, 20]),),
    ]
    if name != "full":
        forms.append((10, 20))  # varargs (full takes the size as one argument)
    for size in forms:
        st = factory(spec, *size)
        assert st.size() == torch.Size([10, 20]), size
        assert st.local_tensor().shape == ((3, 20) if rank < 3 else (1, 20)), size
    single = factory(spec, 10)
    assert single.size() == torch.Size([10])
    assert single.local_tensor().shape == ((3,) if rank < 3 else (1,))


@distributed(world_size=4)
def test_factory_values_and_default_dtypes() -> None:
    rank = dist.get_rank()
    spec = _chunk(0, range(4))
    shape = (3, 20) if rank < 3 else (1, 20)
    zeros = sw.zeros(spec, 10, 20)
    ones = sw.ones(spec, 10, 20)
    assert zeros.dtype == ones.dtype == torch.float32
    assert torch.equal(zeros.local_tensor(), torch.zeros(shape))
    assert torch.equal(ones.local_tensor(), torch.ones(shape))
    assert ones.local_tensor().dtype == torch.float32

    # full infers its dtype from the fill value like torch.full (SPEC deviation 5).
    for fill in (7, 2.5, True, 1 + 2j):
        st = sw.full(spec, (10, 20), fill)
        reference = torch.full(shape, fill)
        assert st.dtype == reference.dtype, fill
        assert st.metadata().tensor_properties.dtype == reference.dtype
        assert torch.equal(st.local_tensor(), reference), fill
    assert sw.full(spec, [10, 20], 7).dtype == torch.int64

    explicit = sw.full(spec, size=(10, 20), fill_value=1234, dtype=torch.int32)
    assert explicit.dtype == torch.int32
    assert torch.equal(explicit.local_tensor(), torch.full(shape, 1234, dtype=torch.int32))
    assert torch.equal(
        sw.ones(spec, 10, 20, dtype=torch.int8).local_tensor(), torch.ones(shape, dtype=torch.int8)
    )
    with pytest.raises(TypeError):
        sw.full(spec, 10, 20, 3)  # type: ignore[call-arg, misc]


@distributed(world_size=2)
def test_factories_follow_the_default_dtype() -> None:
    # The harness resets the default dtype before every body.
    torch.set_default_dtype(torch.float64)
    spec = _chunk(0, range(2))
    for name, factory in ALL_FACTORIES.items():
        st = factory(spec, 4, 2)
        assert st.dtype == torch.float64, name
        assert st.local_tensor().dtype == torch.float64, name
    assert sw.full(spec, (4, 2), 1.5).dtype == torch.float64
    assert sw.full(spec, (4, 2), 1).dtype == torch.int64


@distributed(world_size=4)
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_seeded_random_factories_draw_each_local_shard(name: str) -> None:
    rank = dist.get_rank()
    factory = FACTORIES[name]
    draw = torch.rand if name == "rand" else torch.randn

    torch.manual_seed(1234)
    st = factory(_chunk(0, range(4)), 8, 2, dtype=torch.float64)
    torch.manual_seed(1234)
    assert torch.equal(st.local_tensor(), draw(2, 2, dtype=torch.float64))

    # Several shards per rank: one draw per local shard, in local-shard order.
    seed = 99 + rank
    torch.manual_seed(seed)
    multi = factory(_chunk(0, [0, 1, 2, 3, 0, 1, 2, 3]), 13, 3)
    torch.manual_seed(seed)
    shapes = [tuple(s.tensor.shape) for s in multi.local_shards()]
    assert shapes == (
        [(2, 3), (1, 3)] if rank == 2 else [(2, 3), (2, 3)] if rank < 2 else [(2, 3), (0, 3)]
    )
    for shard in multi.local_shards():
        assert torch.equal(shard.tensor, draw(*shard.tensor.shape))
    if name == "rand":
        values = torch.cat([s.tensor.flatten() for s in multi.local_shards()])
        assert bool(((values >= 0) & (values < 1)).all())


@distributed(world_size=4)
def test_factory_requires_grad_makes_leaf_shards() -> None:
    for name, factory in ALL_FACTORIES.items():
        st = factory(_chunk(0, range(4)), 8, 2, requires_grad=True)
        local = st.local_tensor()
        assert st.requires_grad, name
        assert local.requires_grad and local.is_leaf and local.grad_fn is None, name
    assert torch.equal(
        sw.ones(_chunk(0, range(4)), 8, 2, requires_grad=True).local_tensor().detach(),
        torch.ones(2, 2),
    )


@distributed(world_size=4)
def test_factory_process_group_argument() -> None:
    world = dist.group.WORLD
    for name, factory in ALL_FACTORIES.items():
        assert factory(_chunk(0, range(4)), 8, process_group=world)._process_group is world, name
        assert factory(_chunk(0, range(4)), 8)._process_group is world, name


# -- factory errors --------------------------------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("name", sorted(ALL_FACTORIES))
def test_factory_argument_errors(name: str) -> None:
    factory = ALL_FACTORIES[name]
    spec = _chunk(0, range(4))

    with pytest.raises(
        ValueError, match=re.escape("Expecting ShardingSpec but got: <class 'str'>")
    ):
        factory("rank:0/cpu", 10, 20)
    if name != "full":
        with pytest.raises(
            TypeError,
            match=f"^{re.escape('size has to be a sequence of ints, found: [10, 2.0]')}$",
        ):
            factory(spec, 10, 2.0)
    with pytest.raises(
        TypeError, match=f"^{re.escape('size has to be a sequence of ints, found: [10.0, 2]')}$"
    ):
        factory(spec, [10.0, 2])

    for dim in (2, 3, -3):
        with pytest.raises(ValueError, match=f"^Invalid sharding dim: {dim}$"):
            factory(_chunk(dim, range(4)), 10, 20)
    # The size is checked before the layout, the sharding dim before the layout too.
    with pytest.raises(TypeError, match="size has to be a sequence of ints"):
        factory(spec, [1.5], layout=torch.sparse_coo)
    with pytest.raises(ValueError, match="Invalid sharding dim: 2"):
        factory(_chunk(2, range(4)), 10, 20, layout=torch.sparse_coo)

    with pytest.raises(
        ValueError, match=f"^{re.escape('Only torch.strided layout is currently supported')}$"
    ):
        factory(spec, 10, 20, layout=torch.sparse_coo)
    with pytest.raises(
        ValueError,
        match=f"^{re.escape('Only torch.contiguous_format memory_format is currently supported')}$",
    ):
        factory(spec, 10, 20, memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=re.escape("Only torch.strided layout")):
        # Layout is checked before the memory format.
        factory(spec, 10, 20, layout=torch.sparse_coo, memory_format=torch.channels_last)

    with pytest.raises(
        ValueError,
        match=f"^{re.escape('Global rank 5 does not exist in input process group: [0, 1, 2, 3]')}$",
    ):
        factory(_chunk(0, [0, 5]), 10, 20)

    # SPEC deviation 11: pinning cannot be honored on a host without an accelerator.
    with pytest.raises(RuntimeError, match="pin_memory=True cannot be honored") as info:
        factory(_chunk(0, range(4)), 10, 20, pin_memory=True)
    assert "accelerator" in str(info.value)

    rpc_message = (
        "RPC Framework needs to be initialized using torch.distributed.rpc.init_rpc if "
        "init_rrefs is set to True"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(rpc_message)}$"):
        factory(spec, 10, 20, init_rrefs=True)


@distributed(world_size=2)
def test_size_errors_with_strings_and_scalars() -> None:
    spec = _chunk(0, range(2))
    # A string is a sequence: its characters are reported.
    foo_message = "size has to be a sequence of ints, found: ['f', 'o', 'o']"
    with pytest.raises(TypeError, match=f"^{re.escape(foo_message)}$"):
        sw.empty(spec, "foo")
    with pytest.raises(TypeError, match=re.escape("found: ['f', 'o', 'o']")):
        sw.full(spec, "foo", 1)
    with pytest.raises(TypeError, match=re.escape("found: [None]")):
        sw.zeros(spec, None)
    # A 0-d tensor cannot be chunked along any dim.
    with pytest.raises(ValueError, match=r"^Invalid sharding dim: 0$"):
        sw.empty(spec)


@distributed(world_size=2)
def test_worker_name_placement_without_rpc() -> None:
    spec = ChunkShardingSpec(dim=0, placements=["worker0/cpu", "worker1/cpu"])
    with pytest.raises(
        RuntimeError,
        match=re.escape("RPC framework needs to be initialized for using worker names: worker0")
        + "$",
    ):
        sw.empty(spec, 4, 2)


# -- layouts: uneven and empty chunks, grids, several shards per rank --------------------------


@distributed(world_size=4)
def test_uneven_chunks() -> None:
    rank = dist.get_rank()
    st = sw.ones(_chunk(0, range(4)), 10, 3)
    assert [md.shard_sizes[0] for md in st.metadata().shards_metadata] == [3, 3, 3, 1]
    assert torch.equal(st.local_tensor(), torch.ones([3, 3, 3, 1][rank], 3))


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("rows", "sizes", "offsets"),
    [(5, [2, 2, 1, 0], [0, 2, 4, 6]), (2, [1, 1, 0, 0], [0, 1, 2, 3])],
)
def test_empty_trailing_chunks_work_everywhere(
    rows: int, sizes: list[int], offsets: list[int]
) -> None:
    """SPEC deviation 1: offsets stay ``split * i`` even past the end, and the tensor can be
    cloned, converted and rebuilt from its shards (upstream raised "exceeds tensor dim")."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    st = sw.rand(_chunk(0, range(4)), rows, 3)
    assert [md.shard_sizes[0] for md in st.metadata().shards_metadata] == sizes
    assert [md.shard_offsets[0] for md in st.metadata().shards_metadata] == offsets
    # Every rank has exactly one local shard, even an empty one.
    local = st.local_tensor()
    assert local.shape == (sizes[rank], 3)

    cloned = st.clone()
    assert cloned is not st
    assert cloned.metadata() == st.metadata()
    assert torch.equal(cloned.local_tensor(), local)
    assert cloned.local_tensor() is not local

    doubled = st.to(torch.float64)
    assert doubled.dtype == torch.float64
    assert doubled.metadata().tensor_properties.dtype == torch.float64
    assert torch.equal(doubled.local_tensor(), local.double())

    rebuilt = sw.init_from_local_shards(st.local_shards(), rows, 3)
    assert rebuilt.metadata() == st.metadata()
    spec = rebuilt.sharding_spec()
    assert isinstance(spec, ChunkShardingSpec)
    assert spec.dim == 0
    assert [p.rank() for p in spec.placements] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert rebuilt.local_tensor() is local


@distributed(world_size=4)
def test_grid_enumerable_spec() -> None:
    rank = dist.get_rank()
    spec = _grid()
    st = sw.ones(spec, 10, 10)
    assert st.size() == torch.Size([10, 10])
    assert st.metadata().shards_metadata == spec.shards
    (shard,) = st.local_shards()
    assert shard.metadata.shard_offsets == [(rank // 2) * 5, (rank % 2) * 5]
    assert shard.metadata.shard_sizes == [5, 5]
    assert str(shard.metadata.placement) == f"rank:{rank}/cpu"
    assert torch.equal(st.local_tensor(), torch.ones(5, 5))
    assert st.sharding_spec() is spec


@distributed(world_size=4)
def test_uneven_enumerable_spec() -> None:
    rank = dist.get_rank()
    boxes = [([0, 0], [2, 4]), ([0, 4], [4, 2]), ([2, 0], [4, 4]), ([4, 4], [2, 2])]
    spec = EnumerableShardingSpec(
        [ShardMetadata(off, size, f"rank:{r}/cpu") for r, (off, size) in enumerate(boxes)]
    )
    st = sw.zeros(spec, 6, 6)
    assert _offsets_and_sizes(st) == [
        (off, size, f"rank:{r}/cpu") for r, (off, size) in enumerate(boxes)
    ]
    assert st.local_tensor().shape == tuple(boxes[rank][1])
    # The enumerable spec validates coverage when it builds the metadata.
    with pytest.raises(ValueError, match=re.escape("does not match tensor volume: 49")):
        sw.empty(spec, 7, 7)


@distributed(world_size=4)
def test_several_shards_per_rank() -> None:
    rank = dist.get_rank()
    st = sw.empty(_chunk(0, [0, 1, 2, 3, 0, 1, 2, 3]), 16, 20)
    assert _offsets_and_sizes(st) == [([2 * i, 0], [2, 20], f"rank:{i % 4}/cpu") for i in range(8)]
    shards = st.local_shards()
    assert len(shards) == 2
    assert [s.metadata for s in shards] == [
        st.metadata().shards_metadata[rank],
        st.metadata().shards_metadata[rank + 4],
    ]
    assert all(s.tensor.shape == (2, 20) for s in shards)
    with pytest.raises(
        NotImplementedError,
        match=re.escape("Only single local shard is supported. Number of shards: 2"),
    ):
        st.local_tensor()
    # The device is the first local shard's.
    assert st.device == torch.device("cpu")

    # Enumerable: ranks 0 and 1 own two blocks each, ranks 2 and 3 none.
    grid = sw.ones(_grid([0, 1, 0, 1]), 10, 10)
    mine = grid.local_shards()
    if rank < 2:
        assert [s.metadata.shard_offsets for s in mine] == [[0, 5 * rank], [5, 5 * rank]]
        assert all(torch.equal(s.tensor, torch.ones(5, 5)) for s in mine)
    else:
        assert mine == []


# -- sub-groups ---------------------------------------------------------------------------------


@distributed(world_size=4)
def test_sub_group_placements_name_global_ranks() -> None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    st = sw.ones(_chunk(0, [2, 3]), 10, 20, process_group=group)
    assert st._process_group is group
    assert _offsets_and_sizes(st) == [
        ([0, 0], [5, 20], "rank:2/cpu"),
        ([5, 0], [5, 20], "rank:3/cpu"),
    ]
    if rank in (2, 3):
        assert torch.equal(st.local_tensor(), torch.ones(5, 20))
        assert st.local_shards()[0].metadata.placement.rank() == rank  # type: ignore[union-attr]
    else:
        # Rank 0 is not a member, rank 1 is a member without a placement: neither owns anything.
        assert st.local_shards() == []
        assert st.device == torch.device("cpu")

    grid = sw.empty(
        EnumerableShardingSpec(
            [
                ShardMetadata([0, 0], [5, 5], "rank:1/cpu"),
                ShardMetadata([5, 0], [5, 5], "rank:3/cpu"),
            ]
        ),
        10,
        5,
        process_group=group,
    )
    assert [len(grid.local_shards())] == [1 if rank in (1, 3) else 0]


@distributed(world_size=4)
def test_sub_group_rejects_a_placement_outside_it() -> None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    spec = _chunk(0, [0, 1])
    if rank == 0:
        # Not a member: the placements are not validated against the group (upstream), and
        # the shard naming this global rank is allocated here.
        st = sw.empty(spec, 4, 2, process_group=group)
        assert [tuple(s.tensor.shape) for s in st.local_shards()] == [(2, 2)]
    else:
        with pytest.raises(
            ValueError,
            match=re.escape("Global rank 0 does not exist in input process group: [1, 2, 3]") + "$",
        ):
            sw.empty(spec, 4, 2, process_group=group)
