"""The pure checkpoint planner (``shardwise.checkpoint.planning.planner``): planning the reads of a
resharded load — including a property test that any saved tiling, its writers chosen by the
save's planner (dedup), read back into any other tiling through an in-memory fake storage
reassembles the tensor exactly, with lean reads."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise._boxes import intersect
from shardwise.checkpoint import tuning
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.index.tiling import check_tiling
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.planning.planner import Box, ChunkRead
from shardwise.checkpoint.planning.save_plan import TableRow, plan_save
from shardwise.checkpoint.tuning import TUNING

# -- helpers -------------------------------------------------------------------------------


def _region(tensor: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    view = tensor
    for dim, (start, offset, size) in enumerate(zip(origin, box[0], box[1], strict=True)):
        view = view.narrow(dim, offset - start, size)
    return view


def reads_at_cost(
    target: Box, chunks: list[SavedChunk], itemsize: int, cost: int
) -> list[ChunkRead]:
    """``plan_reads`` with ``TUNING.read_cost_bytes`` patched to ``cost`` (usable under
    hypothesis, where the function-scoped ``monkeypatch`` fixture is not)."""
    patched = dataclasses.replace(tuning.TUNING)
    # Tuning refuses 0, the cost at which reads must be exactly the needed bytes.
    object.__setattr__(patched, "read_cost_bytes", cost)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tuning, "TUNING", patched)
        return planner.plan_reads(target, chunks, itemsize)


class FakeStorage:
    """Chunks laid out back to back in per-rank in-memory "files", like data files."""

    def __init__(self) -> None:
        self.files: dict[str, bytearray] = {}
        self.bytes_read = 0

    def write(self, name: str, data: torch.Tensor) -> tuple[int, int]:
        file = self.files.setdefault(name, bytearray(b"HEADER--"))
        begin = len(file)
        file += data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return begin, len(file)

    def read(self, name: str, offset: int, nbytes: int) -> bytes:
        self.bytes_read += nbytes
        data = bytes(self.files[name][offset : offset + nbytes])
        assert len(data) == nbytes, "read past the end of a fake file"
        return data


def _apply(
    read: ChunkRead, chunk: SavedChunk, storage: FakeStorage, out: torch.Tensor, dtype: torch.dtype
) -> None:
    """Execute one planned read into ``out`` (the full target tensor), independently of load.py."""
    raw = storage.read(chunk.file, read.file_offset, read.nbytes)
    values = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    sizes = read.overlap[1]
    if read.strides is None:
        assert values.numel() == math.prod(sizes)
        piece = values.reshape(sizes)
    else:
        piece = values.as_strided(sizes, read.strides)
    _region(out, (0,) * out.dim(), read.overlap).copy_(piece)


# -- plan_reads ------------------------------------------------------------------------------


def _chunk(
    offsets: tuple[int, ...], sizes: tuple[int, ...], begin: int, itemsize: int = 4
) -> SavedChunk:
    nbytes = math.prod(sizes) * itemsize
    return SavedChunk(offsets, sizes, "f", begin, begin + nbytes)


def test_reads_of_whole_and_contiguous_overlaps_are_exact() -> None:
    # Saved: rows [0, 4) and [4, 8) of an 8x6 float32 tensor.
    chunks = [_chunk((0, 0), (4, 6), 100), _chunk((4, 0), (4, 6), 196)]
    whole = planner.plan_reads(((4, 0), (4, 6)), chunks, 4)
    assert whole == [ChunkRead(1, 196, 96, ((4, 0), (4, 6)), True, None)]
    rows = planner.plan_reads(((2, 0), (4, 6)), chunks, 4)
    assert rows == [
        ChunkRead(0, 100 + 2 * 24, 48, ((2, 0), (2, 6)), False, None),
        ChunkRead(1, 196, 48, ((4, 0), (2, 6)), False, None),
    ]
    # One row's middle is contiguous too.
    assert planner.plan_reads(((5, 1), (1, 3)), chunks, 4) == [
        ChunkRead(1, 196 + 24 + 4, 12, ((5, 1), (1, 3)), False, None)
    ]


def test_column_overlap_reads_needed_bytes_or_one_read_by_cost() -> None:
    # A column block of a row chunk. At read cost 0: one read per row, exactly the needed
    # bytes (no whole rows).
    chunks = [_chunk((0, 0), (4, 100), 0)]
    exact = reads_at_cost(((0, 10), (4, 20)), chunks, 4, 0)
    assert [(r.file_offset, r.nbytes, r.overlap, r.strides) for r in exact] == [
        (row * 400 + 40, 80, ((row, 10), (1, 20)), None) for row in range(4)
    ]
    assert sum(read.nbytes for read in exact) == 4 * 20 * 4
    # Narrow rows with the default cost: one strided read from the first needed element to
    # the last beats four reads.
    (one,) = planner.plan_reads(((0, 10), (4, 20)), chunks, 4)
    assert one == ChunkRead(0, 40, (3 * 100 + 20) * 4, ((0, 10), (4, 20)), False, (100, 1))
    # Wide rows: the gaps (3 x 96 KiB) cost more than three more reads.
    wide = [_chunk((0, 0), (4, 32768), 0)]
    reads = planner.plan_reads(((0, 8192), (4, 8192)), wide, 4)
    assert [(r.file_offset, r.nbytes) for r in reads] == [
        (row * 131072 + 32768, 32768) for row in range(4)
    ]
    # A 3-D overlap split along its first dim only: each piece is contiguous.
    cube = [_chunk((0, 0, 0), (3, 4, 5), 0, itemsize=8)]
    pieces = reads_at_cost(((0, 1, 0), (3, 2, 5)), cube, 8, 0)
    assert [(r.file_offset, r.nbytes, r.strides) for r in pieces] == [
        ((i * 20 + 5) * 8, 80, None) for i in range(3)
    ]


def test_reads_choose_the_cheapest_split() -> None:
    # 2 x 10 x 4 chunk of bytes, overlap [0:2, 0:2, 1:3]. Exact: 4 reads of 2 bytes; split
    # along dim 0 only: 2 strided reads of 6; no split: one read of 46 (1 + 40 + 4 + 1).
    chunks = [_chunk((0, 0, 0), (2, 10, 4), 0, itemsize=1)]
    target = ((0, 0, 1), (2, 2, 2))
    shapes = {
        cost: [(r.file_offset, r.nbytes, r.strides) for r in reads_at_cost(target, chunks, 1, cost)]
        for cost in (0, 5, 100)
    }
    assert shapes[0] == [(1, 2, None), (5, 2, None), (41, 2, None), (45, 2, None)]
    assert shapes[5] == [(1, 6, (40, 4, 1)), (41, 6, (40, 4, 1))]  # 2*(5+6) < 4*(5+2), 5+46
    assert shapes[100] == [(1, 46, (40, 4, 1))]


def test_reads_of_a_zero_d_tensor_and_of_an_empty_box() -> None:
    chunks = [SavedChunk((), (), "f", 64, 72)]
    assert planner.plan_reads(((), ()), chunks, 8) == [ChunkRead(0, 64, 8, ((), ()), True, None)]
    assert planner.plan_reads(((6, 0), (0, 7)), [_chunk((0, 0), (5, 7), 0)], 4) == []


def test_reads_refuse_chunks_that_do_not_cover_the_target() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "saved chunks cover 24 of the 48 elements of the box at offsets [0, 0] with sizes "
            "[8, 6]"
        ),
    ):
        planner.plan_reads(((0, 0), (8, 6)), [_chunk((0, 0), (4, 6), 0)], 4)


# -- property: any tiling to any tiling ------------------------------------------------------


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, ...], max_boxes: int = 8) -> list[Box]:
    """A random guillotine tiling of ``shape`` (boxes cover it exactly, no overlap)."""
    boxes: list[Box] = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, max_boxes - 1))):
        index = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[index]
        splittable = [d for d, n in enumerate(sizes) if n > 1]
        if not splittable:
            continue
        dim = draw(st.sampled_from(splittable))
        cut = draw(st.integers(1, sizes[dim] - 1))
        low = (offsets, tuple(cut if d == dim else n for d, n in enumerate(sizes)))
        high_offsets = tuple(o + cut if d == dim else o for d, o in enumerate(offsets))
        high_sizes = tuple(n - cut if d == dim else n for d, n in enumerate(sizes))
        boxes[index : index + 1] = [low, (high_offsets, high_sizes)]
    return boxes


@st.composite
def reshard_cases(draw: st.DrawFn) -> dict[str, Any]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    world = draw(st.integers(1, 4))
    saved = draw(tilings(shape))
    holders = [
        sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))) for _ in saved
    ]
    if draw(st.booleans()):
        # An empty trailing shard (ceil rule), offsets past the end: exempt from checks.
        saved.append(((shape[0] + 1, *([0] * (len(shape) - 1))), (0, *shape[1:])))
        holders.append([world - 1])
    return {
        "shape": shape,
        "world": world,
        "saved": saved,
        "holders": holders,
        "target": draw(tilings(shape)),
        "dtype": draw(st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64])),
        "read_cost": draw(st.sampled_from([1, 16, TUNING.read_cost_bytes])),
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_any_tiling_reads_back_into_any_tiling_exactly(case: dict[str, Any]) -> None:
    shape, world, dtype = case["shape"], case["world"], case["dtype"]
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape).to(dtype)
    itemsize = full.element_size()
    local = {
        rank: {"t": [b for b, r in zip(case["saved"], case["holders"], strict=True) if rank in r]}
        for rank in range(world)
    }
    row = TableRow("t", "x", itemsize, shape, {}, ("local",))
    plan = plan_save([[row]], [range(world)], [], local, world)

    # Every distinct box written exactly once, by one of its holders.
    written = [(offsets, sizes, rank) for (offsets, sizes), rank in plan.chunks["t"]]
    assert sorted((o, s) for o, s, _ in written) == sorted(set(case["saved"]))
    for offsets, sizes, rank in written:
        assert (offsets, sizes) in local[rank]["t"]

    # "Write" the files, then plan and execute the reads of every target box.
    storage = FakeStorage()
    chunks = []
    for offsets, sizes, rank in sorted(written):
        data = (
            _region(full, (0,) * len(shape), (offsets, sizes))
            if math.prod(sizes)
            else torch.empty(sizes, dtype=dtype)  # an empty shard may lie past the end
        )
        begin, end = storage.write(f"rank{rank}", data)
        chunks.append(SavedChunk(offsets, sizes, f"rank{rank}", begin, end))
    for read_cost in (0, case["read_cost"]):
        out = torch.full(shape, -1, dtype=torch.int64).to(dtype)
        for box in case["target"]:
            storage.bytes_read = 0
            reads = reads_at_cost(box, chunks, itemsize, read_cost)
            assert reads == sorted(reads, key=lambda r: (chunks[r.chunk].file, r.file_offset))
            for read in reads:
                chunk = chunks[read.chunk]
                assert read.whole_chunk == (read.overlap == (chunk.offsets, chunk.sizes))
                _apply(read, chunk, storage, out, dtype)
            needed = math.prod(box[1]) * itemsize
            exact = reads_at_cost(box, chunks, itemsize, 0)
            if read_cost == 0:
                # Only the needed bytes.
                assert storage.bytes_read == needed
            else:
                # Never costlier than reading exactly the needed bytes row by row, and never
                # more than the chunks it touches.
                cost = storage.bytes_read + read_cost * len(reads)
                assert cost <= needed + read_cost * len(exact)
                touched = {read.chunk for read in reads}
                assert storage.bytes_read <= sum(chunks[i].end - chunks[i].begin for i in touched)
        assert torch.equal(out, full)


# -- ChunkLookup: the sweep that replaces comparing every box with every chunk ------------------


@st.composite
def _tiling_and_targets(draw: Any) -> tuple[tuple[int, ...], list[Box], list[Box]]:
    """A tensor size, a random guillotine tiling of it (plus empty chunks) and boxes in it."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    boxes: list[Box] = [((0,) * ndim, size)]
    for _ in range(draw(st.integers(0, 12))):
        index = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[index]
        dim = draw(st.integers(0, ndim - 1))
        if sizes[dim] < 2:
            continue
        cut = draw(st.integers(1, sizes[dim] - 1))
        first = (offsets, (*sizes[:dim], cut, *sizes[dim + 1 :]))
        second_offsets = (*offsets[:dim], offsets[dim] + cut, *offsets[dim + 1 :])
        second = (second_offsets, (*sizes[:dim], sizes[dim] - cut, *sizes[dim + 1 :]))
        boxes[index : index + 1] = [first, second]
    empties = draw(st.integers(0, 2))
    boxes += [(tuple(size), (0,) * ndim)] * empties  # ceil-rule chunks past the end
    order = draw(st.permutations(range(len(boxes))))
    boxes = [boxes[i] for i in order]
    targets = []
    for _ in range(draw(st.integers(1, 6))):
        offsets = tuple(draw(st.integers(0, n - 1)) for n in size)
        sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(size, offsets, strict=True))
        targets.append((offsets, sizes))
    return size, boxes, targets


def _chunks_of(boxes: list[Box]) -> list[SavedChunk]:
    chunks, position = [], 8
    for offsets, sizes in boxes:
        nbytes = math.prod(sizes) * 4
        chunks.append(SavedChunk(offsets, sizes, "data/f", position, position + nbytes))
        position += nbytes
    return chunks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tiling_and_targets())
def test_chunk_lookup_plans_exactly_what_the_all_pairs_search_plans(case: Any) -> None:
    size, boxes, targets = case
    check_tiling(size, boxes)
    chunks = _chunks_of(boxes)
    lookup = planner.ChunkLookup([(c.offsets, c.sizes) for c in chunks])
    for target in targets:
        overlapping = [
            i
            for i, c in enumerate(chunks)
            if math.prod(c.sizes) and intersect(*target, c.offsets, c.sizes)
        ]
        candidates = lookup.candidates(target)
        assert set(overlapping) <= set(candidates), (target, overlapping, candidates)
        assert planner.plan_reads(target, chunks, 4, lookup=lookup) == planner.plan_reads(
            target, chunks, 4
        )


def test_chunk_lookup_of_many_row_chunks_returns_only_the_neighbours() -> None:
    rows = [((r * 4, 0), (4, 16)) for r in range(1024)]
    lookup = planner.ChunkLookup(rows)
    assert lookup.candidates(((4 * 500 + 1, 0), (4, 16))) == [500, 501]
    columns = [((0, c * 2), (8, 2)) for c in range(512)]
    assert planner.ChunkLookup(columns).candidates(((0, 7), (8, 2))) == [3, 4]
    assert planner.ChunkLookup([((0,), (5,))]).candidates(((2,), (1,))) == [0]
    assert planner.ChunkLookup([((), ())]).candidates(((), ())) == [0]
