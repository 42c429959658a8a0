"""The closed-form local box of a DTensor against torch's own computation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.checkpoint.entries.dtensor import local_shape_and_offset


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], list[object]]:
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim))
    mesh_ndim = draw(st.integers(1, 3))
    mesh = draw(st.lists(st.integers(1, 5), min_size=mesh_ndim, max_size=mesh_ndim))
    coordinate = [draw(st.integers(0, k - 1)) for k in mesh]
    placements = [
        draw(st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))) for _ in mesh
    ]
    return shape, mesh, coordinate, placements


@settings(max_examples=400)
@given(_cases())
def test_equals_torch(case: tuple[list[int], list[int], list[int], list[object]]) -> None:
    shape, mesh, coordinate, placements = case
    expected = _compute_local_shape_and_global_offset(shape, mesh, coordinate, placements)  # type: ignore[arg-type]
    assert local_shape_and_offset(shape, mesh, coordinate, placements) == expected


def test_fsdp_rows_past_the_end() -> None:
    # 5 rows over 4 ranks: 2, 2, 1, 0 rows; the empty shard starts at the global size.
    boxes = [local_shape_and_offset([5, 3], [4], [rank], [Shard(0)]) for rank in range(4)]
    assert boxes == [((2, 3), (0, 0)), ((2, 3), (2, 0)), ((1, 3), (4, 0)), ((0, 3), (5, 0))]


@pytest.mark.parametrize("placement", [_StridedShard(0, split_factor=2), Partial(), Shard(-1)])
def test_other_placements_are_left_to_torch(placement: object) -> None:
    assert local_shape_and_offset([8, 4], [2, 2], [1, 0], [Shard(1), placement]) is None


class _Mesh:
    """What ``_mesh_facts`` reads of a DeviceMesh, counting the calls."""

    def __init__(self, coordinate: list[int] | None, shape: tuple[int, ...]) -> None:
        self._coordinate, self._shape, self.calls = coordinate, shape, 0

    def get_coordinate(self) -> list[int] | None:
        self.calls += 1
        return self._coordinate

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape


def test_mesh_facts_are_computed_once_per_mesh_object() -> None:
    from shardwise.checkpoint.entries import items as _items

    first, second = _Mesh([1, 0], (2, 2)), _Mesh(None, (4,))
    for _ in range(3):
        assert _items._mesh_facts(first) == ([1, 0], (2, 2))
        assert _items._mesh_facts(second) == (None, (4,))
    assert (first.calls, second.calls) == (1, 1)
    # Never more than 64 meshes are remembered, and a forgotten one is asked again.
    others = [_Mesh([n], (65,)) for n in range(64)]
    for number, mesh in enumerate(others):
        assert _items._mesh_facts(mesh) == ([number], (65,))
    assert len(_items._MESHES) <= 64
    assert _items._mesh_facts(first) == ([1, 0], (2, 2))
    assert first.calls == 2
