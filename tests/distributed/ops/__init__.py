"""Tests of the ops on ShardedTensors (dispatch, upstream built-ins, element-wise math and
reductions), run on pooled 4-rank gloo groups.

Shared helpers live here. :func:`from_full` builds a ShardedTensor from a full tensor that every
rank holds, without any communication, so a test can compare each local shard with the matching
slice of the unsharded result (:func:`assert_shards_match`): that checks every element of the
result, each on the rank that owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    Shard,
    ShardedTensor,
    ShardingSpec,
    ShardMetadata,
    TensorProperties,
)

WORLD_SIZE = 4


def chunk_spec(dim: int = 0, ranks: Iterable[int] = range(WORLD_SIZE)) -> ChunkShardingSpec:
    """A chunk spec over CPU placements of the given global ranks, in that order."""
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def grid_spec(rows: int, cols: int) -> EnumerableShardingSpec:
    """A 2x2 grid of a ``rows x cols`` tensor; block ``i`` (row-major) lives on rank ``i``."""
    top, left = rows // 2, cols // 2
    boxes = [
        ([0, 0], [top, left]),
        ([0, left], [top, cols - left]),
        ([top, 0], [rows - top, left]),
        ([top, left], [rows - top, cols - left]),
    ]
    return EnumerableShardingSpec(
        [ShardMetadata(offsets, sizes, f"rank:{r}/cpu") for r, (offsets, sizes) in enumerate(boxes)]
    )


#: Layouts the element-wise and reduction tests run on: (spec, global size).
LAYOUTS: dict[str, tuple[ShardingSpec, tuple[int, ...]]] = {
    "rows": (chunk_spec(0), (8, 6)),
    # 5 rows over 4 ranks: chunks of 2, 2, 1 and an empty trailing one.
    "uneven_rows": (chunk_spec(0), (5, 3)),
    "cols_shuffled": (chunk_spec(1, [2, 3, 0, 1]), (4, 10)),
    "grid": (grid_spec(6, 5), (6, 5)),
    "two_per_rank": (chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), (16, 3)),
    # Ranks 0 and 3 own nothing.
    "two_ranks": (chunk_spec(0, [2, 1]), (6, 4)),
    "vector": (chunk_spec(0), (7,)),
}


def narrow(full: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    """The slice of ``full`` that a shard with ``metadata`` covers.

    Slicing, not ``narrow``: an empty trailing chunk's offset may lie past the end (SPEC 1).
    """
    return full[
        tuple(
            slice(offset, offset + size)
            for offset, size in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
        )
    ]


def from_full(
    full: torch.Tensor,
    spec: ShardingSpec,
    *,
    requires_grad: bool = False,
    process_group: ProcessGroup | None = None,
) -> ShardedTensor:
    """Shard ``full`` (identical on every rank) by ``spec`` without communicating.

    Each local shard is a fresh leaf copy of its slice.
    """
    properties = TensorProperties(dtype=full.dtype, requires_grad=requires_grad)
    metadata = spec.build_metadata(full.size(), properties)
    rank = dist.get_rank()
    shards = []
    for md in metadata.shards_metadata:
        assert md.placement is not None
        if md.placement.rank() == rank:
            data = narrow(full, md).clone().requires_grad_(requires_grad)
            shards.append(Shard(data, md))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=process_group, sharding_spec=spec
    )


#: Default (rtol, atol) per dtype, the values torch.testing uses. (torch.testing itself is not
#: used: its first call imports sympy, several seconds in every worker.)
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def assert_close(
    actual: object,
    expected: torch.Tensor,
    *,
    exact: bool = False,
    equal_nan: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``actual`` is a tensor with ``expected``'s shape and dtype and values close to (with
    ``exact``: equal to) ``expected``'s."""
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    actual = actual.detach()
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    if exact or expected.dtype not in _TOLERANCES:
        if equal_nan:
            nan = torch.isnan(expected)
            ok = torch.equal(torch.isnan(actual), nan) and torch.equal(actual[~nan], expected[~nan])
        else:
            ok = torch.equal(actual, expected)
    else:
        default_rtol, default_atol = _TOLERANCES[expected.dtype]
        ok = torch.allclose(
            actual,
            expected,
            rtol=default_rtol if rtol is None else rtol,
            atol=default_atol if atol is None else atol,
            equal_nan=equal_nan,
        )
    assert ok, f"values differ:\n{actual}\nexpected:\n{expected}"


def assert_shards_match(
    st: ShardedTensor, full: torch.Tensor, *, exact: bool = False, equal_nan: bool = False
) -> None:
    """Every local shard of ``st`` equals its slice of ``full`` (same dtype)."""
    assert st.size() == full.size()
    assert st.dtype == full.dtype
    for shard in st.local_shards():
        expected = narrow(full, shard.metadata)
        assert shard.tensor.dtype == full.dtype
        assert_close(shard.tensor, expected, exact=exact, equal_nan=equal_nan)


def gathered(values: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """``values`` (same shape and dtype on every rank) from every member of ``group``."""
    flat = values.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat.contiguous(), group=group)
    return out


def assert_same_on_all_ranks(value: torch.Tensor, group: ProcessGroup | None = None) -> None:
    """``value`` is bit-for-bit the same on every rank (NaN counts as equal to NaN)."""
    everyone = gathered(value, group)
    for theirs in everyone:
        assert_close(theirs, everyone[dist.get_rank(group)], exact=True, equal_nan=True)


def seeded_full(
    size: Sequence[int], dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    """The same pseudo-random tensor on every rank (values in [-2, 2) for float dtypes)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.rand(size, generator=generator, dtype=torch.float64).mul(4).sub(2).to(dtype)
    if dtype.is_complex:
        parts = torch.rand((*size, 2), generator=generator, dtype=torch.float64).mul(4).sub(2)
        return torch.view_as_complex(parts).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(size), generator=generator).bool()
    return torch.randint(-50, 50, tuple(size), generator=generator).to(dtype)
