"""Reading the index's layouts (tensors as ``grid``/``whole``/``chunks``, block checksums per
data file): full and resharded loads, ``load_tensor``, ``read_metadata`` and the CLI, on
checkpoints whose data files are written here with the safetensors layout of ``format.py``
and whose index is the real encoder's; and every malformed one refused with a
``CheckpointError``.

``save``'s own checkpoints are tested in ``test_save_index.py``; these tests build checkpoints
by hand, so :func:`_write_v4` lays out the files as the format says:
per file, the grid cells of every grid tensor in index order, each tensor's cells in row-major
order, from the data section's start; then the ``whole``/``chunks`` entries and the blobs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import (
    INDEX_NAME,
    FileFacts,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    block_checksums,
    data_file_name,
    encode_index,
)
from shardwise.checkpoint.index.data_file import FileEntry, bytes_key, chunk_key, layout_file
from shardwise.checkpoint.index.layouts import Grid, ceil_grid_steps, file_cells
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.cli import main
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    ChecksumError,
)
from shardwise.local_shards import LocalShardsWrapper
from shardwise.metadata import TensorProperties

SAVE_ID = "00c0ffee00c0ffee"
FACTS = SaveFacts("shardwise test", torch.__version__, 4, SAVE_ID, None)
BLOCK = 4096
NUM_FILES = 4
BLOB = b"\x00\x01 raw bytes of a blob " * 50


def _values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return {
        "rows": torch.randn(301, 24, generator=generator),  # 4 row bands, the last shorter
        "cols": torch.randn(8, 300, generator=generator).double(),  # 3 column bands
        "tp": torch.randint(-1000, 1000, (60, 50), generator=generator, dtype=torch.int32),
        "whole": torch.randn(5, generator=generator),
        "pieces": torch.randn(6, 4, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }


# key -> (parts per dim, first file, file strides) of a grid tensor.
_GRIDS: dict[str, tuple[tuple[int, ...], int, tuple[int, ...]]] = {
    "rows": ((4, 1), 0, (1, 0)),
    "cols": ((1, 3), 1, (0, 1)),
    "tp": ((2, 2), 0, (2, 1)),
}
# key -> [(offsets, sizes, file)] of a tensor stored with explicit chunks.
_CHUNKS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {
    "whole": [((0,), (5,), 1)],
    "pieces": [((0, 0), (4, 4), 2), ((4, 0), (2, 4), 3)],
    "scalar": [((), (), 0)],
}


def _piece(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bytes:
    part = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
    return part.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_v4(path: Path, pad: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """A version-4 checkpoint of :func:`_values` at ``path`` (``pad``: file -> bytes inserted
    after its grid cells, which a well-formed checkpoint never has); returns the values."""
    values = _values()
    names = [data_file_name(rank, SAVE_ID) for rank in range(NUM_FILES)]
    grids = {
        key: Grid(
            tuple(values[key].shape),
            ceil_grid_steps(tuple(values[key].shape), parts),
            first,
            strides,
        )
        for key, (parts, first, strides) in _GRIDS.items()
    }
    order = [(key, grid, values[key].dtype.itemsize) for key, grid in grids.items()]
    (path / "data").mkdir(parents=True)
    files: dict[str, FileFacts] = {}
    begins: dict[tuple[str, tuple[int, ...]], int] = {}
    blob_begin = 0
    for file, name in enumerate(names):
        entries: list[tuple[FileEntry, bytes]] = []
        for key, _, box, nbytes in file_cells(order, file):
            tensor = values[key]
            entry = FileEntry(chunk_key(key, box[0]), tensor.dtype, box[1], nbytes)
            entries.append((entry, _piece(tensor, *box)))
        if pad and file in pad:
            entries.append(
                (FileEntry("pad@bytes", None, (pad[file],), pad[file]), b"p" * pad[file])
            )
        for key, chunks in _CHUNKS.items():
            for offsets, sizes, where in chunks:
                if where == file:
                    tensor = values[key]
                    nbytes = math.prod(sizes) * tensor.element_size()
                    entry = FileEntry(chunk_key(key, offsets), tensor.dtype, sizes, nbytes)
                    entries.append((entry, _piece(tensor, offsets, sizes)))
        if file == NUM_FILES - 1:
            entries.append((FileEntry(bytes_key("blob"), None, (len(BLOB),), len(BLOB)), BLOB))
        layout = layout_file([entry for entry, _ in entries], {"format": "shardwise"})
        data = b"".join(piece for _, piece in entries)
        for (entry, _), (begin, _end) in zip(entries, layout.ranges, strict=True):
            begins[entry.key.split("@")[0], _offsets_of(entry.key)] = begin
            if entry.key == bytes_key("blob"):
                blob_begin = begin
        (path / name).write_bytes(layout.header + data)
        files[name] = FileFacts(layout.size, len(layout.header), block_checksums(data, BLOCK))
    records = []
    for key, tensor in values.items():
        props = TensorProperties(dtype=tensor.dtype)
        layout: Grid | list[SavedChunk]
        if key in grids:
            layout = grids[key]
        else:
            layout = []
            for offsets, sizes, where in _CHUNKS[key]:
                begin = begins[key, offsets]
                end = begin + math.prod(sizes) * tensor.element_size()
                layout.append(SavedChunk(offsets, sizes, names[where], begin, end))
        records.append(LayoutRecord(key, props, tuple(tensor.shape), layout))
    blob = SavedChunk((), (), names[-1], blob_begin, blob_begin + len(BLOB))
    objects = [ObjectRecord("blob", "bytes", blob=blob), ObjectRecord("step", "json", text="7")]
    index = encode_index(FACTS, list(files.items()), records, objects, BLOCK)
    (path / INDEX_NAME).write_bytes(index)
    return values


def _offsets_of(key: str) -> tuple[int, ...]:
    text = key.split("@")[1]
    return () if text in ("", "bytes") else tuple(int(part) for part in text.split(","))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "ckpt"
    return path, _write_v4(path)


def _blank(values: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {key: torch.full_like(value, 3) for key, value in values.items()}
    state.update(blob=None, step=0)
    return state


def _unchanged(state: dict[str, Any], values: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(state[key], torch.full_like(v, 3)) for key, v in values.items()) and (
        state["blob"] is None and state["step"] == 0
    )


def _file(path: Path, number: int) -> Path:
    return path / data_file_name(number, SAVE_ID)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_a_v4_checkpoint_loads_exactly(
    saved: tuple[Path, dict[str, torch.Tensor]], verify: bool
) -> None:
    path, values = saved
    state = _blank(values)
    ckpt.load(state, path, verify=verify)
    for key, value in values.items():
        assert _equal(state[key], value), key
    assert state["blob"] == BLOB and state["step"] == 7


def test_load_tensor_reads_whole_tensors_and_boxes_across_cells(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, values = saved
    for key, value in values.items():
        assert _equal(ckpt.load_tensor(path, key), value), key
    # A column band of row bands (strided reads), a box across the four cells of "tp".
    assert _equal(
        ckpt.load_tensor(path, "rows", offsets=[0, 5], sizes=[301, 7]), values["rows"][:, 5:12]
    )
    assert _equal(
        ckpt.load_tensor(path, "tp", offsets=[20, 10], sizes=[25, 30]), values["tp"][20:45, 10:40]
    )


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_rows_load_as_columns_on_other_numbers_of_ranks(
    saved: tuple[Path, dict[str, torch.Tensor]], ranks: int
) -> None:
    """Each simulated rank loads its column shards (LocalShardsWrapper) of the row-wise
    ``rows`` and its row band of the 2 x 2 ``tp``; together they are the tensors."""
    path, values = saved
    rows, tp = values["rows"], values["tp"]
    columns = -(-rows.shape[1] // ranks)
    bands = -(-tp.shape[0] // ranks)
    got_rows, got_tp = torch.zeros_like(rows), torch.zeros_like(tp)
    for rank in range(ranks):
        first = rank * columns
        width = max(0, min(columns, rows.shape[1] - first))
        top = rank * bands
        height = max(0, min(bands, tp.shape[0] - top))
        state: dict[str, Any] = {
            "rows": LocalShardsWrapper([torch.zeros(rows.shape[0], width)], [(0, first)]),
            "tp": LocalShardsWrapper(
                [torch.zeros(height, tp.shape[1], dtype=tp.dtype)], [(top, 0)]
            ),
        }
        with pytest.warns(UserWarning, match="not loaded"):
            ckpt.load(state, path, strict=False)
        got_rows[:, first : first + width] = state["rows"].local_shards()[0]
        got_tp[top : top + height] = state["tp"].local_shards()[0]
    assert torch.equal(got_rows, rows) and torch.equal(got_tp, tp)


def test_read_metadata_describes_the_cells_and_their_file_blocks(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = saved
    metadata = ckpt.read_metadata(path)
    chunks = metadata.state_dict_metadata["rows"].chunks  # type: ignore[union-attr]
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (76, 0), (152, 0), (228, 0)]
    assert [tuple(c.sizes) for c in chunks] == [(76, 24), (76, 24), (76, 24), (73, 24)]
    assert metadata.version == "4"
    with CheckpointReader.open(path) as reader:
        index = reader.index
        assert set(index.data_starts) == set(index.file_checksums) == set(index.files)


def test_a_flipped_bit_raises_checksum_error_and_replaces_no_python_value(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, values = saved
    with CheckpointReader.open(path) as reader:
        cell = reader.index.tensors["rows"].chunks[1]  # in file 1
    target = _file(path, 1)
    data = bytearray(target.read_bytes())
    data[cell.begin + 100] ^= 0x10
    target.write_bytes(bytes(data))
    state = _blank(values)
    with pytest.raises(ChecksumError, match="block 0 of the file") as caught:
        ckpt.load(state, path)
    assert caught.value.key == "rows"
    assert "undefined (partly filled)" in str(caught.value)
    assert state["blob"] is None and state["step"] == 0
    with pytest.raises(ChecksumError):
        ckpt.load_tensor(path, "rows", offsets=[80, 0], sizes=[1, 1])
    # Other cells of the tensor, in files not touched, still read.
    assert _equal(
        ckpt.load_tensor(path, "rows", offsets=[0, 0], sizes=[76, 24]), values["rows"][:76]
    )


def test_a_truncated_file_is_refused_before_anything_changes(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, values = saved
    target = _file(path, 3)
    target.write_bytes(target.read_bytes()[:-10])
    state = _blank(values)
    with pytest.raises(CheckpointDataError, match="truncated"):
        ckpt.load(state, path)
    assert _unchanged(state, values)


def test_grid_cells_that_disagree_with_the_file_size_are_refused(tmp_path: Path) -> None:
    """File 1 holds 64 bytes after its grid cells that no cell accounts for: the cells'
    begins are not where the file says, so the grid tensors with cells there are refused
    (a format error naming the file) while a tensor stored apart still loads."""
    path = tmp_path / "ckpt"
    values = _write_v4(path, pad={1: 64})
    state = _blank(values)
    with pytest.raises(CheckpointFormatError, match="not packed as its size says") as caught:
        ckpt.load(state, path)
    assert caught.value.key in _GRIDS
    assert _unchanged(state, values)
    with pytest.raises(CheckpointError):
        ckpt.load_tensor(path, "rows")
    assert _equal(ckpt.load_tensor(path, "whole"), values["whole"])


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = main([str(arg) for arg in argv])
    return code, capsys.readouterr().out


def test_cli_verify_and_inspect_read_v4(
    saved: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = saved
    code, out = _run(capsys, "verify", path)
    assert code == 0 and "OK" in out, out
    code, out = _run(capsys, "inspect", path)
    assert code == 0 and "rows" in out, out
    target = _file(path, 2)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01  # the last byte of "pieces", in file 2's last block
    target.write_bytes(bytes(data))
    code, out = _run(capsys, "verify", path)
    assert code == 1, out
    assert "CHECKSUM" in out and data_file_name(2, SAVE_ID) in out, out


def test_cli_verify_finds_a_truncated_v4_file(
    saved: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = saved
    target = _file(path, 0)
    target.write_bytes(target.read_bytes()[:-3])
    code, out = _run(capsys, "verify", path)
    assert code == 1 and "TRUNCATED" in out, out
