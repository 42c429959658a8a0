"""The shared box helpers against brute force over element indices."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise._boxes import byte_view, intersect, narrow_to, region


def _cells(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes, strict=True))))


_box = st.integers(1, 3).flatmap(
    lambda ndim: st.tuples(
        st.tuples(*[st.integers(0, 6)] * ndim),
        st.tuples(*[st.integers(0, 4)] * ndim),
        st.tuples(*[st.integers(0, 6)] * ndim),
        st.tuples(*[st.integers(0, 4)] * ndim),
    )
)


@given(_box)
def test_intersect_is_the_shared_cells(boxes: tuple[tuple[int, ...], ...]) -> None:
    a_off, a_size, b_off, b_size = boxes
    shared = _cells(a_off, a_size) & _cells(b_off, b_size)
    got = intersect(a_off, a_size, b_off, b_size)
    if not shared:
        assert got is None
    else:
        assert got is not None
        assert _cells(*got) == shared


def test_narrow_to_views_the_global_box() -> None:
    whole = torch.arange(8 * 6).reshape(8, 6)
    local = whole[2:7, 1:5]  # holds the global box ((2, 1), (5, 4))
    view = narrow_to(local, (2, 1), (3, 2), (2, 3))
    assert torch.equal(view, whole[3:5, 2:5])
    view.fill_(-1)
    assert bool((whole[3:5, 2:5] == -1).all())  # a view, not a copy
    assert narrow_to(local, (2, 1), (2, 1), (5, 4)) is local


def test_region_of_an_empty_trailing_shard() -> None:
    whole = torch.arange(13.0)
    assert torch.equal(region(whole, [12], [1]), whole[12:])
    tail = region(whole, [14], [0])
    assert tail.numel() == 0
    assert region(whole, [0], [13]) is whole


def test_byte_view_is_writable_and_shares_memory() -> None:
    tensor = torch.zeros(4, dtype=torch.int32)
    view = byte_view(tensor)
    assert len(view) == 16 and not view.readonly
    view[0] = 7
    assert int(tensor[0]) == 7
    assert len(byte_view(torch.empty(0))) == 0
