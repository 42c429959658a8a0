"""The fast paths of the tiling check and of the decoder's ``whole`` rows, each against the
general path it shortcuts: ``_tiling.split_tiles`` (a split along one dim, in arithmetic)
must only ever accept what the general sweep accepts, and both must agree with a brute-force
count of the elements each box covers; ``decode._whole`` (a whole row's checks written out)
must only ever return what the field-by-field path returns; ``plan_reads`` of a box that
is a saved chunk reads that chunk whole, and ``whole_reads`` plans the whole tensor as
intersecting would."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.index import decode
from shardwise.checkpoint.index import tiling as _tiling
from shardwise.checkpoint.index.checks import Ranges, row_of
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.planning.planner import Box, ChunkRead
from shardwise.errors import CheckpointFormatError
from tests.unit.checkpoint.test_planner import _chunks_of, _tiling_and_targets, reads_at_cost

# File numbers 0 to 2 of an index; number 1 is null (a rank that wrote nothing).
_FILES: list[str | None] = [
    "data/rank-00000.0123456789abcdef.safetensors",
    None,
    "data/rank-00002.0123456789abcdef.safetensors",
]
_NAMES = [name for name in _FILES if name is not None]


def _tiles(size: tuple[int, ...], boxes: list[Box]) -> bool:
    """The truth, by counting: every element of the tensor is in exactly one box with
    elements, and no box with elements reaches outside it."""
    counts = dict.fromkeys(itertools.product(*(range(n) for n in size)), 0)
    for offsets, sizes in boxes:
        if not math.prod(sizes):
            continue
        for element in itertools.product(
            *(range(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        ):
            if element not in counts:
                return False
            counts[element] += 1
    return all(count == 1 for count in counts.values())


def _general_accepts(size: tuple[int, ...], boxes: list[Box]) -> bool:
    try:
        _tiling.check_tiling_generally(size, boxes)
    except ValueError:
        return False
    return True


@st.composite
def _splits(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], bool]:
    """A tensor and its split along one dim (shuffled, with empty boxes anywhere), then
    perhaps spoiled: a box moved, resized, dropped, repeated, or made partial in another
    dim. Also whether it was left alone (so the fast path must take it)."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    dim = draw(st.integers(0, ndim - 1))
    cuts = sorted(draw(st.sets(st.integers(1, size[dim] - 1), max_size=4))) if size[dim] > 1 else []
    edges = [0, *cuts, size[dim]]
    boxes: list[Box] = []
    for start, stop in itertools.pairwise(edges):
        offsets = tuple(start if d == dim else 0 for d in range(ndim))
        sizes = tuple(stop - start if d == dim else size[d] for d in range(ndim))
        boxes.append((offsets, sizes))
    for _ in range(draw(st.integers(0, 2))):  # empty boxes, even past the end
        offsets = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
        sizes = list(draw(st.integers(0, 3)) for _ in range(ndim))
        sizes[draw(st.integers(0, ndim - 1))] = 0
        boxes.append((offsets, tuple(sizes)))
    spoil = draw(st.sampled_from(["none", "move", "resize", "drop", "repeat", "partial"]))
    at = draw(st.integers(0, len(boxes) - 1))
    offsets, sizes = boxes[at]
    d = draw(st.integers(0, ndim - 1))
    change = draw(st.sampled_from([-1, 1]))
    if spoil == "move":
        boxes[at] = (_bump(offsets, d, change), sizes)
    elif spoil == "resize":
        boxes[at] = (offsets, _bump(sizes, d, change))
    elif spoil == "drop" and len(boxes) > 1:
        del boxes[at]
    elif spoil == "repeat":
        boxes.append(boxes[at])
    elif spoil == "partial":  # a box cut short in a dim that is not split
        boxes[at] = (offsets, _bump(sizes, (dim + 1) % ndim, -1))
    order = draw(st.permutations(range(len(boxes))))
    return size, [boxes[i] for i in order], spoil == "none"


def _bump(values: tuple[int, ...], dim: int, change: int) -> tuple[int, ...]:
    return tuple(max(0, v + change) if d == dim else v for d, v in enumerate(values))


@st.composite
def _anything(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """Any few boxes of a small tensor's dims: mostly not a tiling."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
    box = st.tuples(
        st.tuples(*(st.integers(0, 5) for _ in range(ndim))),
        st.tuples(*(st.integers(0, 5) for _ in range(ndim))),
    )
    return size, draw(st.lists(box, min_size=1, max_size=5))


@settings(max_examples=600, deadline=None)
@given(st.one_of(_splits().map(lambda case: case[:2]), _anything()))
def test_split_check_accepts_only_tilings_and_agrees_with_the_general_check(
    case: tuple[tuple[int, ...], list[Box]],
) -> None:
    size, boxes = case
    truth = _tiles(size, boxes)
    assert _general_accepts(size, boxes) == truth
    if _tiling.split_tiles(size, boxes):
        assert truth
    try:
        _tiling.check_tiling(size, boxes)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == truth


@settings(max_examples=300, deadline=None)
@given(_splits())
def test_every_split_along_one_dim_takes_the_fast_path(
    case: tuple[tuple[int, ...], list[Box], bool],
) -> None:
    size, boxes, untouched = case
    if untouched:
        assert _tiling.split_tiles(size, boxes)


def test_split_check_leaves_the_unusual_to_the_general_check() -> None:
    rows = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert _tiling.split_tiles((4, 4), rows)
    assert _tiling.split_tiles((4, 4), [((0, 0), (4, 2)), ((0, 2), (4, 2))])  # columns
    assert _tiling.split_tiles((4, 4), [*rows, ((9, 9), (0, 4))])  # an empty box anywhere
    assert not _tiling.split_tiles((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4))])
    assert not _tiling.split_tiles((4, 0), [((0, 0), (4, 0))])  # no elements: general
    assert not _tiling.split_tiles((4, 4), [((0, 0), (2, 4)), ((2, 0), (3, 4))])  # past the end
    assert not _tiling.split_tiles((4, 4), [[[0, 0], [4, 4]]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="overlap"):
        _tiling.check_tiling((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])


# -- whole layouts ----------------------------------------------------------------------------

_VALUES: list[Any] = [0, 1, 2, 7, -1, 1 << 62, (1 << 62) - 1, True, 1.0, "1", None, [], [1], {}]


@st.composite
def _whole_rows(draw: st.DrawFn) -> tuple[list[Any], tuple[int, ...]]:
    """A ``whole`` layout as a writer writes it, perhaps with a field replaced (or one too
    many), and the tensor's size."""
    size = tuple(draw(st.lists(st.integers(0, 9), max_size=2)))
    row: list[Any] = ["whole", draw(st.integers(0, 2)), draw(st.integers(0, 1 << 20))]
    if draw(st.booleans()):
        field = draw(st.integers(-1, 2))
        if field < 0:
            row.append(0)
        else:
            row[field] = draw(st.sampled_from(_VALUES))
    return row, size


def _outcome(work: Any) -> tuple[Any, ...]:
    """What decoding a layout gives: the chunks and the ranges added, or the error."""
    ranges = Ranges(dict.fromkeys(_NAMES, 1 << 20), dict.fromkeys(_NAMES, 64))
    try:
        chunks = work(ranges)
    except CheckpointFormatError as err:
        return ("error", str(err))
    return ("chunks", chunks, ranges._ranges)


@settings(max_examples=600, deadline=None)
@given(_whole_rows())
def test_whole_rows_decode_as_the_field_by_field_path_decodes_them(case: Any) -> None:
    # File 1 is a rank that wrote nothing (null).
    row, size = case
    fast = _outcome(lambda ranges: decode._whole(row, size, 4, _FILES, ranges, "t"))

    def checked(ranges: Ranges) -> Any:
        _, file, begin = row_of(row, 3, "a whole layout", "t")
        chunk = decode._chunk(tuple(0 for _ in size), size, file, begin, 4, _FILES, "t")
        ranges.add(chunk, "t")
        return chunk

    assert fast == _outcome(checked)


# -- reads of a saved chunk's own box --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(_tiling_and_targets())
def test_a_target_that_is_a_saved_chunk_reads_it_whole(case: Any) -> None:
    _, boxes, targets = case
    chunks = _chunks_of(boxes)
    lookup = planner.ChunkLookup([(c.offsets, c.sizes) for c in chunks])
    for index, chunk in enumerate(chunks):
        box = (chunk.offsets, chunk.sizes)
        if math.prod(chunk.sizes):
            expected = [ChunkRead(index, chunk.begin, chunk.nbytes, box, True, None)]
        else:  # an empty box needs no read, even when it is a chunk's (one of several)
            expected = []
        assert planner.plan_reads(box, chunks, 4) == expected
        assert planner.plan_reads(box, chunks, 4, lookup=lookup) == expected
    for target in targets:  # other boxes: as planned by intersecting (covered, in order)
        reads = reads_at_cost(target, chunks, 4, 0)
        assert sum(math.prod(read.overlap[1]) for read in reads) == math.prod(target[1])


@settings(max_examples=300, deadline=None)
@given(_tiling_and_targets())
def test_the_whole_tensor_reads_every_chunk_as_intersecting_would(case: Any) -> None:
    size, boxes, _ = case
    chunks = _chunks_of(boxes)
    whole = ((0,) * len(size), size)
    assert planner.whole_reads(chunks) == planner.plan_reads(whole, chunks, 4)
