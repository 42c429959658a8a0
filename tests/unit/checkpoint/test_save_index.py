"""``save`` writing the index in one process (layouts, block checksums per data file): read
back by every reader, refused when a data file is corrupt, no data file where there is nothing
to write. The multi-rank cases (grids over DTensor meshes, file numbers = group ranks, ranks
that write nothing) are in ``tests/distributed/checkpoint``."""

from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.entries.items import describe_tensor
from shardwise.checkpoint.index import INDEX_NAME, block_checksums
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.planning import tables as _save_tables
from shardwise.checkpoint.saving import writer as data_writer
from shardwise.cli import main
from shardwise.errors import CheckpointDataError
from shardwise.local_shards import LocalShardsWrapper
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)


def _values() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 5, generator=generator)
    return {
        "model": {
            "weight": weight,
            "tied": weight,  # the same tensor: an alias
            "bias": torch.randn(5, generator=generator).double(),
            "scale": torch.tensor(1.5),
            "none": torch.zeros(0, 3),
            "codes": torch.randint(0, 255, (40,), generator=generator, dtype=torch.uint8),
        },
        "wrapper": LocalShardsWrapper(
            [torch.ones(2, 3), torch.full((2, 3), 2.0), torch.zeros(0, 3)],
            [(0, 0), (2, 0), (4, 0)],
        ),
        "step": 12,
        "rng": b"\x00\x01 random state " * 300,
        "buffer": io.BytesIO(b"in a BytesIO"),
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {
            "weight": torch.full((6, 5), 7.0),
            "tied": torch.full((6, 5), 7.0),
            "bias": torch.full((5,), 7.0, dtype=torch.float64),
            "scale": torch.tensor(7.0),
            "none": torch.zeros(0, 3),
            "codes": torch.full((40,), 7, dtype=torch.uint8),
        },
        "wrapper": torch.full((4, 3), 7.0),
        "step": 0,
        "rng": b"",
        "buffer": io.BytesIO(),
    }


def _document(path: Path) -> dict[str, Any]:
    return json.loads((path / INDEX_NAME).read_bytes())


def _check_loaded(state: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values["model"].items():
        assert torch.equal(state["model"][key], value), key
    assert torch.equal(state["wrapper"], torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)]))
    assert state["step"] == 12 and state["rng"] == values["rng"]
    assert state["buffer"].getvalue() == b"in a BytesIO"


def test_a_save_writes_layouts_and_reads_back(tmp_path: Path) -> None:
    values = _values()
    returned = ckpt.save(values, tmp_path / "c")
    document = _document(tmp_path / "c")
    assert document["format_version"] == 4
    assert document["checksum"]["scope"] == "file"
    layouts_of = {row[0]: row[3][0] for row in document["tensors"]}
    assert layouts_of == {
        "model.weight": "whole",
        "model.bias": "whole",
        "model.scale": "whole",
        "model.none": "whole",
        "model.codes": "whole",
        "wrapper": "chunks",
    }
    assert document["aliases"] == [["model.tied", "model.weight"]]
    (name, size, data_start, sums) = document["files"][0]
    assert size == (tmp_path / "c" / name).stat().st_size
    data = (tmp_path / "c" / name).read_bytes()
    assert sums == block_checksums(data[data_start:])  # one block here
    assert returned == ckpt.read_metadata(tmp_path / "c")
    assert returned.version == "4"

    state = _blank()
    ckpt.load(state, tmp_path / "c")
    _check_loaded(state, values)
    weight = values["model"]["weight"]
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "model.tied"), weight)
    part = ckpt.load_tensor(tmp_path / "c", "model.weight", offsets=[2, 1], sizes=[3, 2])
    assert torch.equal(part, weight[2:5, 1:3])


def test_a_save_without_tensors_or_blobs_writes_no_data_file(tmp_path: Path) -> None:
    # The one rank has nothing to write: its file is null, and every reader copes.
    values = {"step": 3, "config": {"lr": 0.5}}
    ckpt.save({"w": torch.ones(3)}, tmp_path / "c")  # a file the next save replaces
    returned = ckpt.save(values, tmp_path / "c")
    document = _document(tmp_path / "c")
    assert document["files"] == [None]
    assert list((tmp_path / "c" / "data").iterdir()) == []  # the old file cleaned up
    assert returned == ckpt.read_metadata(tmp_path / "c")
    state: dict[str, Any] = {"step": 0, "config": {"lr": 0.0}}
    ckpt.load(state, tmp_path / "c")
    assert state == values
    assert main(["verify", str(tmp_path / "c")]) == 0
    assert main(["inspect", str(tmp_path / "c")]) == 0


def test_async_save_writes_layouts_too(tmp_path: Path) -> None:
    values = _values()
    returned = ckpt.async_save(values, tmp_path / "c").result(timeout=60)
    assert returned.version == "4" and returned == ckpt.read_metadata(tmp_path / "c")
    state = _blank()
    ckpt.load(state, tmp_path / "c")
    _check_loaded(state, values)


def test_many_small_tensors_and_blocks_across_entries(tmp_path: Path) -> None:
    # 3 MiB and change of entries of every size: the file's blocks cut through entries.
    values = {f"t{i:03d}": torch.arange(i * 97 % 5000, dtype=torch.float64) for i in range(200)}
    values["large"] = torch.arange(300_000, dtype=torch.float32)
    ckpt.save(values, tmp_path / "c")
    name, size, data_start, sums = _document(tmp_path / "c")["files"][0]
    data = (tmp_path / "c" / name).read_bytes()
    assert len(data) == size and len(sums) == 16 * math.ceil((size - data_start) / (1 << 20))
    assert sums == block_checksums(data[data_start:])
    state = {key: torch.zeros_like(value) for key, value in values.items()}
    ckpt.load(state, tmp_path / "c")
    assert all(torch.equal(state[key], value) for key, value in values.items())


def test_a_flipped_bit_is_refused_and_no_python_value_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = _values()
    ckpt.save(values, tmp_path / "c")
    assert main(["verify", str(tmp_path / "c")]) == 0
    assert "OK" in capsys.readouterr().out
    with CheckpointReader.open(tmp_path / "c") as reader:
        chunk = reader.index.tensors["model.bias"].chunks[0]
    target = tmp_path / "c" / chunk.file
    data = bytearray(target.read_bytes())
    data[chunk.begin + 3] ^= 0x04
    target.write_bytes(bytes(data))
    state = _blank()
    with pytest.raises(CheckpointDataError) as caught:
        ckpt.load(state, tmp_path / "c")
    assert isinstance(caught.value, ckpt.ChecksumError) and caught.value.key == "model.bias"
    assert state["step"] == 0 and state["rng"] == b""
    assert main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "CHECKSUM" in out
    # One 1 MiB block holds every entry of this small file: a checksum cannot tell which
    # entry's bytes changed, and the message says so rather than blame the first one.
    assert "which also holds bytes of other entries (the changed bytes may be theirs)" in out
    assert "which also holds bytes of other entries" in str(caught.value)


def test_a_block_inside_one_entry_names_it(tmp_path: Path) -> None:
    # A tensor of several blocks: a flipped byte in a block only it holds names it exactly.
    big = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB
    ckpt.save({"a": torch.ones(3), "big": big, "z": torch.zeros(3)}, tmp_path / "c")
    with CheckpointReader.open(tmp_path / "c") as reader:
        chunk = reader.index.tensors["big"].chunks[0]
    target = tmp_path / "c" / chunk.file
    data = bytearray(target.read_bytes())
    data[chunk.begin + (3 << 19)] ^= 0x10  # the middle: block 1 lies inside "big"
    target.write_bytes(bytes(data))
    state = {"a": torch.zeros(3), "big": torch.zeros(3 << 18), "z": torch.ones(3)}
    with pytest.raises(ckpt.ChecksumError) as caught:
        ckpt.load(state, tmp_path / "c")
    assert caught.value.key == "big"
    assert "in block 1 of the file" in str(caught.value)
    assert "other entries" not in str(caught.value)


def test_file_blocks_hash_a_stream_as_one_buffer() -> None:
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (20_000,), generator=generator, dtype=torch.uint8).numpy()
    data = data.tobytes()
    for cuts in ([], [1, 4096, 4097, 9000], list(range(0, 20_000, 333)), [8192, 12288]):
        blocks = data_writer.FileBlocks(block_size=4096)
        edges = [0, *cuts, len(data)]
        for start, end in itertools.pairwise(edges):
            blocks.update(memoryview(data)[start:end])
        assert blocks.checksums() == block_checksums(data, 4096), cuts
    exact = data_writer.FileBlocks(block_size=4096)
    exact.update(data[:8192])
    assert exact.checksums() == block_checksums(data[:8192], 4096)
    assert data_writer.FileBlocks().checksums() == xxhash.xxh3_64_hexdigest(b"")


def test_own_file_writes_order_the_other_entries_by_key() -> None:
    # Whole tensors only in one process: no grid cells lead the file, the others by key.
    state = {"b": torch.zeros(2), "a": torch.zeros(3)}
    tensors = {key: describe_tensor(key, value) for key, value in state.items()}
    table = _save_tables.rank_table(tensors, 0, lambda r: r if r == 0 else -1)
    assignment: dict[str, Any] = {"whole": ["b", "a"], "chunks": []}
    writes, cells = _save_tables.own_file_writes(table, tensors, assignment, 0)
    assert [w.fqn for w in writes] == ["a", "b"] and cells == 0


def test_a_save_on_an_object_store(s3: S3Bucket) -> None:
    # No rename there: the data objects go under their final names and the index last; a
    # second save replaces the first and removes its objects. A flipped byte is refused.
    values = _values()
    url = s3.url("ckpt")
    for _ in range(2):
        returned = ckpt.save(values, url, storage_options=s3.options)
    assert returned.version == "4"
    assert returned == ckpt.read_metadata(url, storage_options=s3.options)
    state = _blank()
    ckpt.load(state, url, storage_options=s3.options)
    _check_loaded(state, values)
    index = json.loads(s3.filesystem().cat_file(f"{s3.name}/ckpt/{INDEX_NAME}"))
    assert index["format_version"] == 4
    named = {f"ckpt/{row[0]}" for row in index["files"]}
    assert set(s3.keys("ckpt")) == {f"ckpt/{INDEX_NAME}", *named}
    (name,) = named
    fs = s3.filesystem()
    data = bytearray(fs.cat_file(f"{s3.name}/{name}"))
    data[-1] ^= 0x01
    fs.pipe_file(f"{s3.name}/{name}", bytes(data))
    blank = _blank()
    with pytest.raises(CheckpointDataError):
        ckpt.load(blank, url, storage_options=s3.options)
    assert torch.equal(blank["model"]["weight"], _blank()["model"]["weight"])
