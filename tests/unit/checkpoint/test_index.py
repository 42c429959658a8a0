"""The index format: tensors as layouts (``grid``, ``whole``, ``chunks``) and block checksums
per file. Grid arithmetic against brute force, encode -> decode round trips (files of ranks
that wrote nothing included), the lazy ``Metadata`` view, and a strict decoder that refuses
malformed rows with a ``CheckpointFormatError`` saying what is wrong."""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise._boxes import intersect
from shardwise.checkpoint.index import (
    FORMAT_VERSION,
    FileFacts,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    block_checksums,
    data_file_name,
    decode_index,
    encode_index,
    seal,
)
from shardwise.checkpoint.index.layouts import FileOrder, Grid, LayoutChunks, ceil_grid_steps
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.metadata import MetadataIndex
from shardwise.checkpoint.planning.planner import plan_reads
from shardwise.errors import CheckpointFormatError
from shardwise.metadata import TensorProperties

FACTS = SaveFacts("shardwise test", "2.13.0", 4, "0123456789abcdef", None)
FLOAT = TensorProperties(dtype=torch.float32)
START = 64
BLOCK = 4096

Layout = Grid | list[tuple[tuple[int, ...], tuple[int, ...], int]]


def _cells(grid: Grid) -> list[tuple[int, ...]]:
    """Every cell in row-major order, by brute force."""
    return list(itertools.product(*(range(count) for count in grid.counts)))


def _file(grid: Grid, cell: tuple[int, ...]) -> int:
    return grid.first + sum(k * s for k, s in zip(cell, grid.strides, strict=True))


class _State:
    """A checkpoint as a writer lays it out, written out independently of the code under
    test: per file, the grid cells in index then row-major order from ``START``, then the
    ``whole``/``chunks`` entries, then the blobs; a file that holds nothing is ``null``."""

    def __init__(
        self,
        tensors: list[tuple[str, tuple[int, ...], Layout]],
        num_files: int,
        blobs: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    ) -> None:
        names = [data_file_name(rank, FACTS.save_id) for rank in range(num_files)]
        position = [START] * num_files
        self.chunks: dict[str, list[SavedChunk]] = {}

        def place(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], file: int) -> None:
            nbytes = math.prod(sizes) * 4
            begin = position[file]
            position[file] += nbytes
            self.chunks[key].append(SavedChunk(offsets, sizes, names[file], begin, begin + nbytes))

        for file in range(num_files):
            for key, _, layout in tensors:
                self.chunks.setdefault(key, [])
                if isinstance(layout, Grid):
                    for cell in _cells(layout):
                        if _file(layout, cell) == file:
                            place(key, *layout.box(cell), file)
        for key, _, layout in tensors:
            if not isinstance(layout, Grid):
                for offsets, sizes, file in layout:
                    place(key, offsets, sizes, file)
        self.objects = []
        for key, file, nbytes in blobs:
            begin = position[file]
            position[file] += nbytes
            blob = SavedChunk((), (), names[file], begin, begin + nbytes)
            self.objects.append(ObjectRecord(key, "bytes", blob=blob))
        self.objects.append(ObjectRecord("step", "json", text="7"))
        for key, _, layout in tensors:  # grid chunks in row-major order
            if isinstance(layout, Grid):
                order = {cell: n for n, cell in enumerate(_cells(layout))}
                by_box = {c.offsets: c for c in self.chunks[key]}
                self.chunks[key] = [by_box[layout.box(cell)[0]] for cell in sorted(order)]
        self.names = names
        self.files = {
            name: FileFacts(size, START, block_checksums(bytes(size - START), BLOCK))
            for name, size in zip(names, position, strict=True)
            if size > START or any(c.file == name for cs in self.chunks.values() for c in cs)
        }
        self.records = [
            LayoutRecord(key, FLOAT, size, layout if isinstance(layout, Grid) else self.chunks[key])
            for key, size, layout in tensors
        ]

    def encoded(self, aliases: dict[str, str] | None = None) -> bytes:
        files = [(name, self.files[name]) if name in self.files else None for name in self.names]
        return encode_index(FACTS, files, self.records, self.objects, BLOCK, aliases)


def _fsdp_state(rows: int = 10, ranks: int = 4) -> _State:
    """FSDP-like: a weight and its moment row-sharded over every rank (the ceil rule, an
    empty last shard at 10 rows / 4 ranks), a replicated step, and an irregular tensor."""
    grid = Grid((rows, 3), ceil_grid_steps((rows, 3), (ranks, 1)), 0, (1, 0))
    return _State(
        [
            ("w", (rows, 3), grid),
            ("w.exp_avg", (rows, 3), grid),
            ("w.step", (), [((), (), 2)]),
            ("odd", (4, 2), [((0, 0), (1, 2), 1), ((1, 0), (3, 2), 3)]),
        ],
        ranks,
        blobs=[("rng", 0, 10)],
    )


# -- grid arithmetic ----------------------------------------------------------------------


@st.composite
def _grids(draw: st.DrawFn) -> Grid:
    ndim = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim)))
    parts = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    strides = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    return Grid(size, ceil_grid_steps(size, parts), draw(st.integers(0, 3)), strides)


@settings(max_examples=300, deadline=None)
@given(grid=_grids(), data=st.data())
def test_grid_cells_of_a_box_are_the_brute_force_overlaps(grid: Grid, data: st.DataObject) -> None:
    offsets = tuple(data.draw(st.integers(0, max(n - 1, 0))) for n in grid.size)
    sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(grid.size, offsets, strict=True))
    expected = [
        cell
        for cell in _cells(grid)
        if math.prod(sizes)
        and math.prod(grid.box(cell)[1])
        and intersect(*grid.box(cell), offsets, sizes) is not None
    ]
    if not grid.size:  # a 0-d tensor is one cell, which every (empty) box of it reads
        expected = [()]
    assert list(grid.cells(offsets, sizes)) == expected


@settings(max_examples=300, deadline=None)
@given(grid=_grids(), parts=st.lists(st.integers(1, 6), min_size=3, max_size=3))
def test_grid_cells_are_the_ceil_rule_chunks(grid: Grid, parts: list[int]) -> None:
    # torch.chunk's rule (what FSDP, TP and ChunkShardingSpec use): ceil-sized pieces, none
    # past the end.
    size = grid.size
    steps = ceil_grid_steps(size, parts[: len(size)])
    grid = Grid(size, steps, 0, (0,) * len(size))
    boxes = [grid.box(cell) for cell in _cells(grid)]
    if math.prod(size):
        pieces = torch.arange(math.prod(size)).reshape(size)
        for dim, part in enumerate(parts[: len(size)]):
            assert grid.counts[dim] == len(torch.arange(size[dim]).chunk(part))
        # The cells tile the tensor: every element once.
        seen = torch.zeros(size, dtype=torch.int64)
        for offsets, sizes in boxes:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            seen[index] += 1
        assert bool((seen == 1).all()) and pieces.numel() == seen.sum()
    for cell in _cells(grid):
        assert grid.cell_at(grid.number_of(cell)) == cell


@settings(max_examples=300, deadline=None)
@given(grid=_grids())
def test_cells_in_file_are_the_cells_whose_rule_names_the_file(grid: Grid) -> None:
    for file in range(grid.last_file + 2):
        expected = [cell for cell in _cells(grid) if _file(grid, cell) == file]
        assert list(grid.cells_in_file(file)) == expected
        assert all(grid.file_of(cell) == file for cell in expected)


def test_file_order_checks_that_the_cells_fill_the_file() -> None:
    grid = Grid((10, 3), (3, 3), 0, (1, 0))  # 4 cells of 3, 3, 3, 1 rows in files 0..3
    grids = [("a", grid, 4), ("b", grid, 4)]
    order = FileOrder(grids, 1, 64, 64 + 2 * 36)
    assert (order.begin("a", 1), order.begin("b", 1)) == (64, 100)
    with pytest.raises(ValueError, match="end at byte 136, not at 140"):
        FileOrder(grids, 1, 64, 140)
    with pytest.raises(ValueError, match="run past byte 90"):
        FileOrder(grids, 1, 64, 90)


# -- round trips --------------------------------------------------------------------------


def test_round_trip_gives_the_laid_out_chunks() -> None:
    state = _fsdp_state()
    index = decode_index(state.encoded(aliases={"tied": "w"}))
    assert index.format_version == FORMAT_VERSION == 4
    assert index.aliases == {"tied": "w"}
    assert index.data_starts == dict.fromkeys(state.files, START)
    assert index.file_checksums == {name: f.checksums for name, f in state.files.items()}
    for key, chunks in state.chunks.items():
        assert list(index.tensors[key].chunks) == chunks, key
    assert list(index.tensors["tied"].chunks) == state.chunks["w"]
    assert isinstance(index.tensors["w"].chunks, LayoutChunks)
    assert index.objects["step"].text == "7" and index.objects["rng"].blob == state.objects[0].blob


def test_a_rank_that_wrote_nothing_is_a_null_file() -> None:
    # Rows over files 0 and 2 (stride 2), a whole tensor in file 3: file 1 holds nothing.
    grid = Grid((6, 3), (3, 3), 0, (2, 0))
    state = _State([("w", (6, 3), grid), ("s", (), [((), (), 3)])], 4)
    data = state.encoded()
    assert json.loads(data)["files"][1] is None
    index = decode_index(data)
    names = [data_file_name(rank, FACTS.save_id) for rank in (0, 2, 3)]
    assert list(index.files) == list(index.data_starts) == list(index.file_checksums) == names
    assert list(index.tensors["w"].chunks) == state.chunks["w"]
    assert [c.file for c in index.tensors["w"].chunks] == names[:2]
    assert index.tensors["s"].chunks[0].file == names[2]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 13),
    cols=st.integers(1, 5),
    ranks=st.integers(1, 5),
    tp=st.integers(1, 3),
)
def test_round_trips_any_fsdp_by_tp_grid(rows: int, cols: int, ranks: int, tp: int) -> None:
    # Rows over `ranks` and columns over `tp`: file = row cell * tp + column cell.
    size = (rows, cols)
    steps = ceil_grid_steps(size, (ranks, tp))
    grid = Grid(size, steps, 0, (Grid(size, steps, 0, (0, 0)).counts[1], 1))
    state = _State([("a", size, grid), ("b", size, grid)], grid.last_file + 1)
    index = decode_index(state.encoded())
    for key in ("a", "b"):
        chunks = index.tensors[key].chunks
        assert list(chunks) == state.chunks[key]
        # A reader plans any box from the layout alone, the same as from the chunk list.
        box = ((rows // 3, 0), (rows - rows // 3, cols))
        assert plan_reads(box, chunks, 4, lookup=chunks) == plan_reads(box, list(chunks), 4)


def test_metadata_view_names_the_file_blocks_of_a_chunk() -> None:
    grid = Grid((2048, 3), (1024, 3), 0, (1, 0))
    state = _State([("w", (2048, 3), grid), ("b", (5,), [((0,), (5,), 1)])], 2)
    index = decode_index(state.encoded())
    metadata = index.to_metadata()
    name = data_file_name(1, FACTS.save_id)
    sums = index.file_checksums[name]
    # The second cell fills blocks 0 to 2 of file 1's data section; b's 20 bytes follow in
    # block 3.
    info = metadata.storage_data[MetadataIndex("w", (1024, 0))]
    assert (info["file"], info["begin"], info["end"]) == (name, START, START + 12288)
    assert info["block_scope"] == "file" and info["blocks_begin"] == START
    assert info["checksums"] == [sums[16 * b : 16 * b + 16] for b in range(3)]
    info = metadata.storage_data[MetadataIndex("b", (0,))]
    assert info["blocks_begin"] == START + 3 * BLOCK and info["checksums"] == [sums[48:64]]
    assert index.blocks_of(name, START + 4000, START + 4200) == (START, [sums[:16], sums[16:32]])
    assert index.blocks_of(name, START + 10, START + 10) == (START, [])
    assert metadata.version == "4"


# -- hostile rows -------------------------------------------------------------------------


def _document() -> dict[str, Any]:
    data = _fsdp_state().encoded()
    document = json.loads(data)
    del document["index_checksum"]
    return document


def _tensor(document: dict[str, Any], key: str) -> list[Any]:
    return next(row for row in document["tensors"] if row[0] == key)


def _set_layout(key: str, layout: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: _tensor(d, key).__setitem__(3, layout)


def _set_file(column: int, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["files"][0].__setitem__(column, value)


def _same_bytes(rows: list[list[Any]]) -> None:
    """The first chunk's bytes where the second's are."""
    rows[0][2:4] = rows[1][2:4]


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "scope-chunk": (lambda d: d["checksum"].update(scope="chunk"), "checksum scope"),
    "no-scope": (lambda d: d["checksum"].pop("scope"), "must have the keys"),
    "extra-key": (lambda d: d.update(extra=1), "exactly the keys"),
    "file-row-short": (lambda d: d["files"][0].pop(), "a files entry"),
    "data-start-in-header": (_set_file(2, 4), "starts at 4, outside"),
    "data-start-past-end": (_set_file(2, 1 << 40), "outside"),
    "sums-short": (_set_file(3, "0" * 15), "malformed block checksums"),
    "sums-upper-hex": (lambda d: d["files"][0].__setitem__(3, d["files"][0][3].upper()), "hex"),
    "grid-step-0": (_set_layout("w", ["grid", [0, 3], [0, 1, 0]]), "one step >= 1"),
    "grid-steps-short": (_set_layout("w", ["grid", [3], [0, 1, 0]]), "one step >= 1"),
    "grid-files-short": (_set_layout("w", ["grid", [3, 3], [0, 1]]), "first, one stride"),
    "grid-past-last-file": (_set_layout("w", ["grid", [3, 3], [1, 1, 0]]), "reach file 4"),
    "grid-negative-stride": (_set_layout("w", ["grid", [3, 3], [0, -1, 0]]), "must be an integer"),
    "grid-float-step": (_set_layout("w", ["grid", [3.0, 3], [0, 1, 0]]), "grid steps"),
    # The same grid as the row before, but for the type of one number: refused all the same
    # (a row is not answered from an earlier equal-looking one).
    "grid-float-step-repeated": (
        _set_layout("w.exp_avg", ["grid", [3.0, 3], [0, 1, 0]]),
        "grid steps",
    ),
    "grid-bool-stride-repeated": (
        _set_layout("w.exp_avg", ["grid", [3, 3], [0, True, 0]]),
        "must be an integer",
    ),
    "grid-too-big": (
        lambda d: (
            _tensor(d, "w").__setitem__(2, [1 << 40, 3]),
            _tensor(d, "w").__setitem__(3, ["grid", [1 << 40, 3], [0, 0, 0]]),
        ),
        "more than the",
    ),
    "unknown-layout": (_set_layout("w", ["rows", 3]), "starting with 'grid'"),
    "layout-not-list": (_set_layout("w", "grid"), "starting with 'grid'"),
    "whole-bad-file": (_set_layout("w.step", ["whole", 9, 200]), "file index 9"),
    "whole-in-header": (_set_layout("w.step", ["whole", 2, 40]), "inside the file's header"),
    "whole-short": (_set_layout("w.step", ["whole", 2]), "a whole layout"),
    "whole-long": (_set_layout("w.step", ["whole", 2, 200, 0]), "a whole layout"),
    "whole-bool-file": (_set_layout("w.step", ["whole", True, 200]), "file index True"),
    "whole-negative-begin": (_set_layout("w.step", ["whole", 2, -8]), "begin must be"),
    "whole-float-begin": (_set_layout("w.step", ["whole", 2, 200.0]), "begin must be"),
    "whole-past-end": (_set_layout("w.step", ["whole", 2, 1 << 40]), "past the declared size"),
    "whole-past-max": (_set_layout("w.step", ["whole", 2, (1 << 62) - 1]), "malformed chunk"),
    "chunks-gap": (
        _set_layout("odd", ["chunks", [[[0, 0], [1, 2], 1, 100]]]),
        "do not tile",
    ),
    "chunks-with-sums": (
        lambda d: _tensor(d, "odd")[3][1][0].append("0" * 16),
        "a chunk must be a list of 4",
    ),
    "chunks-overlap-bytes": (lambda d: _same_bytes(_tensor(d, "odd")[3][1]), "overlap"),
    "blob-with-sums": (lambda d: d["objects"][0][2].append("0" * 16), "a stored object"),
    "blob-past-end": (lambda d: d["objects"][0][2].__setitem__(2, 1 << 40), "past the declared"),
    # A rank that wrote nothing: no layout, chunk or blob may name its file.
    "null-file-of-a-whole": (lambda d: d["files"].__setitem__(2, None), "w.step"),
    "null-file-of-a-grid's-first-cell": (
        lambda d: d["files"].__setitem__(0, None),
        "a grid cell is in a file of a rank that wrote no data file",
    ),
    "null-file-of-a-grid's-last-cell": (
        lambda d: d["files"].__setitem__(3, None),
        "a grid cell is in a file of a rank that wrote no data file",
    ),
    # (The grids of "w" have cells in file 1 too: checked when read, see below.)
    "null-file-of-chunks": (
        lambda d: d["files"].__setitem__(1, None),
        "file index 1 names a rank that wrote no data file",
    ),
    "null-file-of-a-blob": (
        lambda d: (
            d.update(tensors=[row for row in d["tensors"] if row[0] != "w.step"]),
            d["objects"][0][2].__setitem__(0, 2),
            d["files"].__setitem__(2, None),
        ),
        "file index 2 names a rank that wrote no data file",
    ),
    # No element, but strides no int64 holds: torch cannot create it (was: load_tensor
    # raised torch's RuntimeError "Stride calculation overflowed").
    "size-empty-overflowing-strides": (
        lambda d: _tensor(d, "w.step").__setitem__(2, [0, 1 << 61, 1 << 61]),
        "too large: no tensor of torch.float32 has it",
    ),
    "size-empty-overflowing-last-strides": (
        lambda d: _tensor(d, "w.step").__setitem__(2, [5, 1 << 40, 0, 1 << 40]),
        "too large: no tensor of torch.float32 has it",
    ),
    "file-row-false": (lambda d: d["files"].__setitem__(1, False), "a files entry"),
    "file-row-empty": (lambda d: d["files"].__setitem__(1, []), "a files entry"),
    "empty-grid-many-cells": (
        lambda d: (
            _tensor(d, "w").__setitem__(2, [0, 1 << 30]),
            _tensor(d, "w").__setitem__(3, ["grid", [1, 1], [0, 0, 0]]),
        ),
        "1073741824 cells has more cells than there are files",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_malformed_rows_are_refused(case: str) -> None:
    edit, match = HOSTILE[case]
    document = _document()
    edit(document)
    with pytest.raises(CheckpointFormatError, match=match):
        decode_index(seal(document))


def test_cells_that_do_not_fill_their_file_are_refused_when_read() -> None:
    # A gap of 4 bytes between file 0's cells and its blob: found when file 0 is first read
    # (O(tensors) per file), not while decoding (O(rows)).
    document = _document()
    document["files"][0][1] += 4
    document["objects"][0][2][1] += 4
    index = decode_index(seal(document))
    with pytest.raises(CheckpointFormatError, match="not packed as its size says"):
        list(index.tensors["w"].chunks)
    # Files that are not read are not checked: cells of file 1 still expand.
    assert index.tensors["w"].chunks[1].file.startswith("data/rank-00001")


def test_a_grid_cell_in_a_null_file_is_refused_when_read() -> None:
    # File 1 wrote nothing, yet the grid of "w" puts a cell there (between its first and
    # last cell, which the decoder checks): refused when that cell is first needed, naming
    # the key, like the packing of its file.
    document = _document()
    document["files"][2][1] += document["files"][1][1] - START  # the data stays declared
    document["files"][1] = None
    document["tensors"] = [row for row in document["tensors"] if row[0] != "odd"]
    index = decode_index(seal(document))
    assert index.tensors["w"].chunks[0].file.startswith("data/rank-00000")
    with pytest.raises(CheckpointFormatError, match="wrote no data file") as caught:
        index.tensors["w"].chunks[1]
    assert caught.value.key == "w"


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a parsed document where a value can be replaced."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for position, child in enumerate(value):
            found += _paths(child, (*prefix, position))
    return found


_NASTY = [-1, 0, 1, 7, 1 << 40, 1 << 62, 2.5, True, None, "", "x", [], [0], [[]], {}, ["grid"]]
_PATHS = _paths(_document())


@settings(max_examples=400, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(_PATHS), st.sampled_from(_NASTY)), min_size=1, max_size=3
    )
)
def test_any_edit_of_an_index_is_read_or_refused_as_a_format_error(
    edits: list[tuple[tuple[Any, ...], Any]],
) -> None:
    # Whatever is changed (and re-sealed), reading the index, expanding every chunk and
    # walking its Metadata either works or raises CheckpointFormatError: nothing else.
    document = _document()
    for path, value in edits:
        parent: Any = document
        try:
            for step in path[:-1]:
                parent = parent[step]
            # A copy: the same list placed twice (then edited) would make the document
            # circular, which no JSON text can be.
            parent[path[-1]] = copy.deepcopy(value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed the place
    try:
        index = decode_index(seal(document))
        for record in index.tensors.values():
            list(record.chunks)
        metadata = index.to_metadata()
        dict(metadata.state_dict_metadata)
        dict(metadata.storage_data)
    except CheckpointFormatError:
        pass
