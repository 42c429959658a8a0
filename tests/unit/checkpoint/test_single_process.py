"""``shardwise.checkpoint`` in a single process with no process group: every value kind round
trips, the index and the safetensors data files hold what they should, ``load_tensor`` reads
boxes and verifies checksums, pickle needs an explicit opt-in on both sides, a crashed save
leaves the previous checkpoint intact, ``async_save`` snapshots, and random tilings reshard
exactly with lean reads."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.storage._local import _LocalReader
from shardwise.local_shards import LocalShardsWrapper

# The module that writes a rank's data file.
data_writer = importlib.import_module("shardwise.checkpoint.saving.writer")

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,  # safetensors has no code for it: stored as U8 bytes
]


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    # These tests are about the no-process-group path of the pytest process itself.
    assert not dist.is_initialized()


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Small exact values of ``dtype`` (integers in [-50, 50], exact in bfloat16)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-50, 51, shape, generator=g)
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.uint8:
        return (values + 50).to(dtype)
    if dtype.is_complex:
        return torch.complex(values.double(), -values.double() / 4).to(dtype)
    return values.to(dtype)


def _state(seed: int) -> dict[str, Any]:
    return {
        "model": {
            **{f"w_{str(dt)[6:]}": _sample(dt, (5, 7), seed + i) for i, dt in enumerate(DTYPES)},
            "scalar": torch.tensor(2.5 + seed),
            "empty": torch.empty(0, 3),
            "param": torch.nn.Parameter(_sample(torch.float32, (3,), seed)),
        },
        "lsw": LocalShardsWrapper(
            [_sample(torch.float64, (4, 2), seed), _sample(torch.float64, (4, 3), seed + 1)],
            [(0, 0), (0, 2)],
        ),
        "blob": b"\x00\x01raw" + bytes([seed]),
        "stream": io.BytesIO(b"stream" + bytes([seed])),
        "step": 100 + seed,
        "config": {"lr": 0.5, "name": "run", "flags": [True, None, 3], "pair": (1, 2)},
        "limits": [float("inf"), -float("inf")],
        "nothing": None,
        "empty_dict": {},
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    """A target shaped like ``state`` with different contents everywhere."""
    model = {
        key: torch.zeros_like(value) if value.dtype != torch.bool else torch.ones_like(value)
        for key, value in state["model"].items()
        if key != "param"
    }
    model["param"] = torch.nn.Parameter(torch.full((3,), 99.0))
    return {
        "model": model,
        "lsw": LocalShardsWrapper(
            [torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)],
            [(0, 0), (2, 0)],
        ),
        "blob": None,
        "stream": None,
        "step": 0,
        "config": {"lr": 0.0, "name": "", "flags": [], "pair": ()},
        "limits": [],
        "nothing": "something",
        "empty_dict": "placeholder",
    }


def _lsw_full(wrapper: LocalShardsWrapper, size: tuple[int, ...]) -> torch.Tensor:
    shards = wrapper.local_shards()
    out = torch.zeros(size, dtype=shards[0].dtype)
    for shard, offsets in zip(shards, wrapper.local_offsets(), strict=True):
        region = out
        for dim, (o, n) in enumerate(zip(offsets, shard.shape, strict=True)):
            region = region.narrow(dim, o, n)
        region.copy_(shard)
    return out


def test_round_trip_of_every_value_kind(tmp_path: Path) -> None:
    source = _state(1)
    metadata = ckpt.save(source, tmp_path / "c")
    target = _blank(source)
    model_before = dict(target["model"])
    ckpt.load(target, tmp_path / "c")

    for key, value in source["model"].items():
        loaded = target["model"][key]
        assert loaded is model_before[key], "tensors are filled in place"
        assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
    assert isinstance(target["model"]["param"], torch.nn.Parameter)
    assert target["model"]["param"].requires_grad
    assert torch.equal(_lsw_full(target["lsw"], (4, 5)), _lsw_full(source["lsw"], (4, 5)))
    assert target["blob"] == source["blob"]
    assert isinstance(target["stream"], io.BytesIO)
    assert target["stream"].getvalue() == b"stream\x01"
    assert target["step"] == 101
    # Nested dicts come back nested; a tuple comes back a tuple.
    assert target["config"] == {"lr": 0.5, "name": "run", "flags": [True, None, 3], "pair": (1, 2)}
    assert target["limits"] == [math.inf, -math.inf]
    assert target["nothing"] is None
    assert target["empty_dict"] == {}

    # What save returns is what read_metadata reads back.
    assert ckpt.read_metadata(tmp_path / "c") == metadata
    assert sorted(metadata.state_dict_metadata) == sorted(
        [f"model.{key}" for key in source["model"]]
        + ["lsw", "blob", "stream", "step", "config.lr", "config.name", "config.flags"]
        + ["config.pair", "limits", "nothing", "empty_dict"]
    )


def test_index_records_entries_chunks_and_storage(tmp_path: Path) -> None:
    source = _state(2)
    ckpt.save(source, tmp_path / "c")
    metadata = ckpt.read_metadata(str(tmp_path / "c"))
    assert metadata.version == "4"
    assert metadata.planner_data["world_size"] == 1
    assert metadata.planner_data["checksum_algorithm"] == "xxh3_64"
    assert metadata.storage_meta is not None and metadata.storage_meta.save_id

    entry = metadata.state_dict_metadata["model.w_bfloat16"]
    assert isinstance(entry, ckpt.TensorStorageMetadata)
    assert entry.size == torch.Size([5, 7])
    assert entry.properties.dtype == torch.bfloat16
    assert entry.chunks == [ckpt.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([5, 7]))]
    lsw = metadata.state_dict_metadata["lsw"]
    assert isinstance(lsw, ckpt.TensorStorageMetadata)
    assert lsw.size == torch.Size([4, 5]) and lsw.properties.dtype == torch.float64
    assert [list(c.offsets) for c in lsw.chunks] == [[0, 0], [0, 2]]
    scalar = metadata.state_dict_metadata["model.scalar"]
    assert isinstance(scalar, ckpt.TensorStorageMetadata) and scalar.size == torch.Size([])

    storage = metadata.storage_data
    info = storage[ckpt.MetadataIndex("model.w_float32", torch.Size([0, 0]))]
    assert set(info) == {"file", "begin", "end", "checksums", "block_scope", "blocks_begin"}
    assert info["end"] - info["begin"] == 5 * 7 * 4
    # The checksums of the file's blocks it touches: here the data section is one block.
    assert len(info["checksums"]) == 1 and len(info["checksums"][0]) == 16
    assert info["block_scope"] == "file" and info["blocks_begin"] <= info["begin"]
    assert isinstance(metadata.state_dict_metadata["blob"], ckpt.BytesStorageMetadata)
    assert storage[ckpt.MetadataIndex("step")] == {"encoding": "json", "text": "102"}
    assert storage[ckpt.MetadataIndex("blob")]["encoding"] == "bytes"
    assert storage[ckpt.MetadataIndex("stream")]["encoding"] == "bytesio"
    # The index is plain JSON (no pickle anywhere) and lists exactly the committed files.
    index = json.loads((tmp_path / "c" / "shardwise.json").read_text())
    assert index["format"] == "shardwise-checkpoint" and index["format_version"] == 4
    files = {i["file"] for i in storage.values() if "file" in i}
    assert {f"data/{name}" for name in os.listdir(tmp_path / "c" / "data")} == files


def test_data_files_are_safetensors_files(tmp_path: Path) -> None:
    source = _state(3)
    metadata = ckpt.save(source, tmp_path / "c")
    flat = {f"model.{k}": v.detach() for k, v in source["model"].items()}
    seen = set()
    for name in os.listdir(tmp_path / "c" / "data"):
        path = tmp_path / "c" / "data" / name
        raw = path.read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        assert (8 + header_len) % 64 == 0, "data starts 64-byte aligned"
        with safe_open(str(path), "pt") as handle:
            assert handle.metadata()["format"] == "shardwise"
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                fqn, _, offsets = key.rpartition("@")
                stored = handle.get_tensor(key)
                seen.add(fqn)
                if offsets == "bytes":
                    expected = source[fqn] if fqn == "blob" else source[fqn].getvalue()
                    assert bytes(stored.numpy()) == expected
                    continue
                if fqn == "lsw":
                    sizes = [4, 2] if offsets == "0,0" else [4, 3]
                    index = 0 if offsets == "0,0" else 1
                    expected_t = source["lsw"].local_shards()[index]
                    assert list(stored.shape) == sizes
                else:
                    expected_t = flat[fqn]
                if expected_t.dtype == torch.complex128:
                    # No safetensors code: raw bytes under U8.
                    assert stored.dtype == torch.uint8
                    assert stored.shape == (expected_t.numel() * 16,)
                    assert bytes(stored.numpy()) == expected_t.contiguous().numpy().tobytes()
                else:
                    assert stored.dtype == expected_t.dtype
                    assert torch.equal(stored, expected_t), key
    tensors = {k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert seen == tensors | {"blob", "stream"}


def test_load_tensor_reads_boxes_and_verifies_the_blocks_they_touch(tmp_path: Path) -> None:
    # Rows of 512 KiB: the two chunks of 3 rows span the data section's 1 MiB blocks 0-2.
    full = _sample(torch.float64, (6, 1 << 16), 0)
    lsw = LocalShardsWrapper([full[:3].clone(), full[3:].clone()], [(0, 0), (3, 0)])
    ckpt.save({"w": lsw, "s": torch.tensor(7, dtype=torch.int64), "o": b"x"}, tmp_path / "c")
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w"), full)
    box = ckpt.load_tensor(tmp_path / "c", "w", offsets=[2, 1], sizes=[3, 3])
    assert torch.equal(box, full[2:5, 1:4])
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w", offsets=(4, 0)), full[4:])
    scalar = ckpt.load_tensor(tmp_path / "c", "s")
    assert scalar.shape == () and scalar.dtype == torch.int64 and scalar.item() == 7

    with pytest.raises(
        ckpt.CheckpointKeyError, match=re.escape("not a tensor of the checkpoint (key 'o')")
    ):
        ckpt.load_tensor(tmp_path / "c", "o")
    with pytest.raises(
        ckpt.CheckpointKeyError, match=re.escape("not a tensor of the checkpoint (key 'nope')")
    ):
        ckpt.load_tensor(tmp_path / "c", "nope")
    with pytest.raises(
        ValueError,
        match=re.escape("box offsets=[5, 0] sizes=[2, 5] does not fit 'w' of size [6, 65536]"),
    ):
        ckpt.load_tensor(tmp_path / "c", "w", offsets=[5, 0], sizes=[2, 5])

    # Corrupt the first byte of the second chunk (row 3, in block 1): reading it whole fails,
    # reading rows in other blocks doesn't.
    metadata = ckpt.read_metadata(tmp_path / "c")
    info = metadata.storage_data[ckpt.MetadataIndex("w", torch.Size([3, 0]))]
    path = tmp_path / "c" / info["file"]
    raw = bytearray(path.read_bytes())
    raw[info["begin"] + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.ChecksumError) as caught:
        ckpt.load_tensor(tmp_path / "c", "w")
    assert caught.value.key == "w" and caught.value.rank == 0
    assert caught.value.file == str(path)
    assert str(caught.value).startswith(
        "checksum mismatch for a chunk of this tensor in block 1 of the file (bytes "
    )
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w", sizes=[1, 1 << 16]), full[:1])
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w", offsets=[4, 0]), full[4:])
    # A box of other bytes of the damaged block is verified too: its block is read and checked.
    with pytest.raises(ckpt.ChecksumError, match="in block 1 of the file"):
        ckpt.load_tensor(tmp_path / "c", "w", offsets=[3, 2], sizes=[1, 1])


def test_pickle_needs_an_explicit_opt_in_on_save_and_on_load(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "cannot save state_dict['opt.sched'] of type set: shardwise stores tensors, bytes, "
            "io.BytesIO, Stateful objects and Python values"
        ),
    ):
        ckpt.save({"w": torch.ones(2), "opt": {"sched": {1, 2}}}, tmp_path / "refused")
    assert not (tmp_path / "refused" / "shardwise.json").exists()

    ckpt.save({"w": torch.ones(2), "opt": {"sched": {1, 2}}}, tmp_path / "c", allow_pickle=True)
    target = {"w": torch.zeros(2), "opt": {"sched": None}}
    with pytest.raises(
        ckpt.PickleNotAllowedError,
        match=re.escape(
            "this entry was pickled; pass allow_pickle=True to load it (only for checkpoints "
            "you trust: unpickling runs code) (key 'opt.sched')"
        ),
    ):
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.zeros(2)), "refused before any data was copied"
    assert target["opt"]["sched"] is None
    ckpt.load(target, tmp_path / "c", allow_pickle=True)
    assert target["opt"]["sched"] == {1, 2}
    assert torch.equal(target["w"], torch.ones(2))
    # A state dict without the pickled key needs no opt-in.
    plain = {"w": torch.zeros(2)}
    ckpt.load(plain, tmp_path / "c")
    assert torch.equal(plain["w"], torch.ones(2))


def test_a_crashed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.full((4,), 1.0), "o": b"A"}, path)
    index_a = (path / "shardwise.json").read_bytes()
    files_a = sorted(os.listdir(path / "data"))

    real_write = data_writer.write_data_file

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(data_writer, "write_data_file", crash)
    with pytest.raises(OSError, match=re.escape("disk full (simulated)")):
        ckpt.save({"w": torch.full((4,), 2.0), "o": b"B"}, path)
    assert (path / "shardwise.json").read_bytes() == index_a
    target = {"w": torch.zeros(4), "o": None}
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.full((4,), 1.0)) and target["o"] == b"A"

    monkeypatch.setattr(data_writer, "write_data_file", real_write)
    ckpt.save({"w": torch.full((4,), 3.0), "o": b"C"}, path)
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.full((4,), 3.0)) and target["o"] == b"C"
    files_c = sorted(os.listdir(path / "data"))
    assert len(files_c) == 1 and not set(files_c) & set(files_a), "old data files are gone"


def test_async_save_snapshots_and_reports_errors_through_the_future(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0), "step": 1}
    future = ckpt.async_save(state, tmp_path / "a")
    state["w"].add_(100)  # the snapshot was taken before async_save returned
    state["step"] = 2
    second = ckpt.async_save({"w": torch.ones(3)}, tmp_path / "b")
    assert future.done(), "a second async_save waits for the one in flight"
    metadata = future.result(timeout=60)
    assert isinstance(metadata, ckpt.Metadata)
    assert second.result(timeout=60) == ckpt.read_metadata(tmp_path / "b")
    target = {"w": torch.zeros(6), "step": 0}
    ckpt.load(target, tmp_path / "a")
    assert torch.equal(target["w"], torch.arange(6.0)) and target["step"] == 1

    bad = ckpt.async_save({"w": torch.ones(1), "x": object()}, tmp_path / "bad")
    with pytest.raises(TypeError, match=re.escape("cannot save state_dict['x'] of type object")):
        bad.result(timeout=60)
    assert not (tmp_path / "bad" / "shardwise.json").exists()


def test_progress_bars_on_save_and_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt.save({"w": torch.ones(1000)}, tmp_path / "c", progress=True)
    saved = capsys.readouterr().err
    assert f"saving {tmp_path / 'c'}" in saved and "100%" in saved
    ckpt.load({"w": torch.zeros(1000)}, tmp_path / "c", progress=True)
    loaded = capsys.readouterr().err
    assert f"loading {tmp_path / 'c'}" in loaded and "100%" in loaded
    ckpt.load({"w": torch.zeros(1000)}, tmp_path / "c")
    assert capsys.readouterr().err == ""


@contextlib.contextmanager
def _count_reads() -> Iterator[list[int]]:
    """Count the bytes and the calls of reads from data files (not the index): reads into one
    buffer and scatter reads into several."""
    counter = [0, 0]
    original = _LocalReader.read_into
    original_vector = _LocalReader.read_vector

    def counting(self: _LocalReader, offset: int, buffer: memoryview) -> int:
        count = original(self, offset, buffer)
        if not self.path.endswith("shardwise.json"):
            counter[0] += count
            counter[1] += 1
        return count

    def counting_vector(self: _LocalReader, offset: int, buffers: Sequence[memoryview]) -> int:
        count = original_vector(self, offset, buffers)
        counter[0] += count
        counter[1] += 1
        return count

    _LocalReader.read_into = counting  # type: ignore[method-assign]
    _LocalReader.read_vector = counting_vector  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        _LocalReader.read_into = original  # type: ignore[method-assign]
        _LocalReader.read_vector = original_vector  # type: ignore[method-assign]


def _row_blocks(full: torch.Tensor, parts: int) -> LocalShardsWrapper:
    step = full.shape[0] // parts
    blocks = [full[step * i : step * (i + 1)].clone() for i in range(parts)]
    return LocalShardsWrapper(blocks, [(step * i, 0) for i in range(parts)])


def test_resharded_load_reads_only_what_it_needs(tmp_path: Path) -> None:
    # Saved as 4 row blocks of a 16x32768 float32 tensor (128 KiB rows); loaded as a column
    # block and an interior box: the bytes read stay within 5% of the need plus one row per
    # chunk touched (the gaps between the needed pieces of rows are skipped).
    full = _sample(torch.float32, (16, 32768), 5)
    ckpt.save({"w": _row_blocks(full, 4)}, tmp_path / "c")
    column = torch.zeros(14, 8192)
    interior = torch.zeros(6, 10000)
    target = {"w": LocalShardsWrapper([column, interior], [(1, 16384), (5, 3000)])}
    with _count_reads() as counter:
        ckpt.load(target, tmp_path / "c", verify=False)
    assert torch.equal(column, full[1:15, 16384:24576])
    assert torch.equal(interior, full[5:11, 3000:13000])
    needed = (14 * 8192 + 6 * 10000) * 4
    row = 32768 * 4
    assert needed <= counter[0] <= 1.05 * needed + (4 + 2) * row, counter
    # Verified, the load reads every checksummed block it touches once (its 1 MiB blocks
    # hold two 512 KiB chunks each; the boxes touch all four chunks), checks it and uses it.
    column.zero_()
    interior.zero_()
    with _count_reads() as counter:
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(column, full[1:15, 16384:24576])
    assert torch.equal(interior, full[5:11, 3000:13000])
    blocks = 4 * 4 * row
    assert counter[0] == blocks, counter

    # Narrow rows: a column block is at most one read per chunk (gaps are read, not 64 tiny
    # reads; adjacent chunks of one file may be read together); never more than the chunks
    # themselves.
    narrow = _sample(torch.float32, (64, 48), 6)
    ckpt.save({"w": _row_blocks(narrow, 4)}, tmp_path / "n")
    block = torch.zeros(64, 12)
    with _count_reads() as counter:
        ckpt.load({"w": LocalShardsWrapper([block], [(0, 12)])}, tmp_path / "n", verify=False)
    assert torch.equal(block, narrow[:, 12:24])
    # The four chunks lie one after another in the one data file, with gaps smaller than a
    # read's cost between the column's pieces: one read through them, never more bytes than
    # the chunks hold.
    assert counter[1] == 1 and counter[0] <= 64 * 48 * 4, counter
    # Verified: the four adjacent one-block chunks are checked (and kept) in one read, and
    # the column block is copied from what was kept.
    block.zero_()
    with _count_reads() as counter:
        ckpt.load({"w": LocalShardsWrapper([block], [(0, 12)])}, tmp_path / "n")
    assert torch.equal(block, narrow[:, 12:24])
    assert counter[1] == 1 and counter[0] == 64 * 48 * 4, counter


@st.composite
def _tilings(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """A random guillotine tiling of ``shape``: boxes ``(offsets, sizes)``."""
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 5))):
        index = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[index]
        dims = [d for d, n in enumerate(sizes) if n > 1]
        if not dims:
            continue
        dim = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, sizes[dim] - 1))
        low = (offsets, tuple(cut if d == dim else n for d, n in enumerate(sizes)))
        high = (
            tuple(o + cut if d == dim else o for d, o in enumerate(offsets)),
            tuple(n - cut if d == dim else n for d, n in enumerate(sizes)),
        )
        boxes[index : index + 1] = [low, high]
    return boxes


def _wrapper(full: torch.Tensor, boxes: list[tuple[tuple[int, ...], ...]]) -> LocalShardsWrapper:
    shards = []
    for offsets, sizes in boxes:
        region = full
        for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            region = region.narrow(dim, o, n)
        shards.append(region.clone())
    return LocalShardsWrapper(shards, [list(o) for o, _ in boxes])


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Any, Any, torch.dtype]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.bool, torch.complex64]))
    return shape, draw(_tilings(shape)), draw(_tilings(shape)), dtype


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_random_tilings_round_trip_through_files(case: Any) -> None:
    shape, saved, wanted, dtype = case
    full = _sample(dtype, shape, len(saved))
    blank = torch.zeros(shape, dtype=dtype) if dtype != torch.bool else ~full
    with tempfile.TemporaryDirectory() as root:
        ckpt.save({"t": _wrapper(full, saved)}, root, sync_files=False)
        target = _wrapper(blank, wanted)
        ckpt.load({"t": target}, root)
        assert torch.equal(_lsw_full(target, shape), full)
        for offsets, sizes in wanted:
            box = ckpt.load_tensor(root, "t", offsets=offsets, sizes=sizes)
            assert torch.equal(box, _wrapper(full, [(offsets, sizes)]).local_shards()[0])


def test_signatures_are_the_specified_ones() -> None:
    def shape(fn: Any) -> list[tuple[str, str, Any]]:
        return [
            (p.name, p.kind.name, p.default if p.default is not p.empty else "required")
            for p in inspect.signature(fn).parameters.values()
        ]

    save_options = [
        ("process_group", "KEYWORD_ONLY", None),
        ("coordinator_rank", "KEYWORD_ONLY", 0),
        ("sync_files", "KEYWORD_ONLY", True),
        ("allow_pickle", "KEYWORD_ONLY", False),
        ("storage_options", "KEYWORD_ONLY", None),
        ("progress", "KEYWORD_ONLY", False),
        # Incremental saves (issue 28): SPEC.md's keywords, then these two.
        ("incremental", "KEYWORD_ONLY", False),
        ("base", "KEYWORD_ONLY", None),
    ]
    positional = "POSITIONAL_OR_KEYWORD"
    head = [("state_dict", positional, "required"), ("path", positional, "required")]
    assert shape(ckpt.save) == [*head, *save_options]
    assert shape(ckpt.async_save) == [*head, *save_options]
    assert shape(ckpt.load) == [
        *head,
        ("process_group", "KEYWORD_ONLY", None),
        ("strict", "KEYWORD_ONLY", True),
        ("verify", "KEYWORD_ONLY", True),
        ("allow_pickle", "KEYWORD_ONLY", False),
        ("allow_dtype_cast", "KEYWORD_ONLY", False),
        ("storage_options", "KEYWORD_ONLY", None),
        ("progress", "KEYWORD_ONLY", False),
    ]
    assert shape(ckpt.read_metadata) == [
        ("path", positional, "required"),
        ("storage_options", "KEYWORD_ONLY", None),
    ]
    assert shape(ckpt.load_tensor) == [
        ("path", positional, "required"),
        ("fqn", positional, "required"),
        ("offsets", "KEYWORD_ONLY", None),
        ("sizes", "KEYWORD_ONLY", None),
        ("storage_options", "KEYWORD_ONLY", None),
    ]


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    ckpt.save({"w": torch.arange(3)}, f"file://{tmp_path}/c")
    assert (tmp_path / "c" / "shardwise.json").is_file()
    target = {"w": torch.zeros(3, dtype=torch.int64)}
    ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.arange(3))
    assert torch.equal(ckpt.load_tensor(f"file://{tmp_path}/c", "w"), torch.arange(3))


def test_local_urls_are_local_paths_that_follow_no_link(tmp_path: Path) -> None:
    from shardwise.checkpoint.storage import LocalStorage, open_storage

    assert isinstance(open_storage(f"local://{tmp_path}/c"), LocalStorage)
    ckpt.save({"w": torch.arange(3)}, f"local://{tmp_path}/c")
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w"), torch.arange(3))
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data").symlink_to(outside)  # fsspec's local backend would write there
    with pytest.raises(ckpt.CheckpointError, match="not a real directory"):
        ckpt.save({"w": torch.arange(3)}, f"local://{tmp_path}/d")
    assert list(outside.iterdir()) == []


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="cannot checkpoint 'q': it is a quantized tensor"):
        ckpt.save({"w": torch.ones(2), "q": quantized}, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()


def test_a_save_whose_index_a_reader_would_refuse_does_not_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_module = importlib.import_module("shardwise.checkpoint.saving.save")
    ckpt.save({"w": torch.ones(2), "note": "old"}, tmp_path / "c")
    # The reader's limit is 1 GiB; a save of JSON values larger than it is refused the same.
    monkeypatch.setattr(save_module, "MAX_INDEX_BYTES", 4096)
    with pytest.raises(ckpt.CheckpointError, match="more than the 4096 a reader reads"):
        ckpt.save({"w": torch.zeros(2), "note": "x" * 5000}, tmp_path / "c")
    target = {"w": torch.full((2,), 7.0), "note": None}
    ckpt.load(target, tmp_path / "c")  # the checkpoint before is intact
    assert torch.equal(target["w"], torch.ones(2)) and target["note"] == "old"


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR and nested are beta/prototype
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: torch.eye(3).to_sparse(), "a sparse_coo tensor, and a checkpoint stores strided"),
        (lambda: torch.eye(3).to_sparse_csr(), "a sparse_csr tensor"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested tensor"),
    ],
    ids=["coo", "csr", "nested"],
)
def test_tensors_without_a_strided_form_are_refused_on_both_sides(
    tmp_path: Path, make: Any, kind: str
) -> None:
    with pytest.raises(TypeError, match=f"cannot checkpoint 's': it is {kind}"):
        ckpt.save({"w": torch.ones(2), "s": make()}, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()
    ckpt.save({"w": torch.ones(2), "s": torch.eye(3)}, tmp_path / "c")
    target = {"w": torch.zeros(2), "s": make()}
    with pytest.raises(
        ckpt.CheckpointMismatchError, match=f"cannot load into {kind.split(',')[0]}"
    ):
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.zeros(2))  # nothing was copied


def test_a_target_whose_elements_share_memory_is_refused_before_anything_is_copied(
    tmp_path: Path,
) -> None:
    ckpt.save({"a": torch.ones(4), "b": torch.arange(12.0).reshape(3, 4)}, tmp_path / "c")
    target = {"a": torch.zeros(4), "b": torch.zeros(1, 4).expand(3, 4)}
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"elements share memory.*key 'b'"):
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["a"], torch.zeros(4))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conjugate_and_negative_views_load_their_values(tmp_path: Path, view: str) -> None:
    values = torch.tensor([1 + 2j, -3 - 4j, 0.5j], dtype=torch.complex64)
    ckpt.save({"c": values}, tmp_path / "c")
    base = torch.zeros(3, dtype=torch.complex64)
    target = base.conj() if view == "conj" else torch._neg_view(base)
    assert target.is_conj() or target.is_neg()
    ckpt.load({"c": target}, tmp_path / "c")
    assert torch.equal(target.resolve_conj().resolve_neg(), values)
    # The view's memory holds what makes the view show the values.
    assert torch.equal(base, values.conj() if view == "conj" else -values)


@pytest.mark.parametrize(
    "state_dict",
    [
        {"w\udcff": torch.ones(2)},  # a tensor's key
        {"opt": {"k\ud800": 1}},  # a nested object's key
    ],
)
def test_keys_that_are_not_text_are_refused_before_anything_is_written(
    tmp_path: Path, state_dict: dict[str, Any]
) -> None:
    # A lone surrogate has no UTF-8 form: the index could not name the key.
    with pytest.raises(TypeError, match="state_dict keys must be valid Unicode text"):
        ckpt.save(state_dict, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_directory_name_that_is_not_utf8_saves_and_loads(tmp_path: Path) -> None:
    # os.fsdecode(b"\xff") is "\udcff": the index records the path escaped, and commits.
    path = tmp_path / os.fsdecode(b"run-\xff")
    ckpt.save({"w": torch.arange(3.0)}, path)
    loaded = {"w": torch.zeros(3)}
    ckpt.load(loaded, path)
    assert torch.equal(loaded["w"], torch.arange(3.0))
    saved = json.loads((path / "shardwise.json").read_bytes())
    assert saved["save"]["checkpoint_id"].endswith("run-\\udcff")


def test_meta_tensors_are_refused_on_save_and_as_load_targets(tmp_path: Path) -> None:
    # A meta tensor holds no data: saving one used to fail in the write step with a pinned
    # memory error; loading into one copied nothing and reported success.
    with pytest.raises(ValueError, match="cannot checkpoint 'm': it is on the meta device"):
        ckpt.save({"w": torch.ones(2), "m": torch.empty(3, device="meta")}, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()
    ckpt.save({"m": torch.ones(3)}, tmp_path / "d")
    with pytest.raises(ckpt.CheckpointMismatchError, match="meta device") as caught:
        ckpt.load({"m": torch.empty(3, device="meta")}, tmp_path / "d")
    assert caught.value.key == "m"


@pytest.mark.parametrize(
    ("state_dict", "hint"),
    [
        (torch.nn.Linear(2, 2), r"got Linear \(wrap it: \{'model': model\}\)$"),
        ([torch.ones(1)], "got list$"),
        (None, "got NoneType$"),
    ],
    ids=["module", "list", "none"],
)
def test_a_state_dict_that_is_not_a_mapping_is_a_type_error_naming_its_type(
    tmp_path: Path, state_dict: Any, hint: str
) -> None:
    ckpt.save({"w": torch.ones(1)}, tmp_path / "c")
    message = "state_dict must be a Mapping of str or int keys, such as .*" + hint
    with pytest.raises(TypeError, match=message):
        ckpt.save(state_dict, tmp_path / "d")
    with pytest.raises(TypeError, match=message):
        ckpt.async_save(state_dict, tmp_path / "d").result()
    with pytest.raises(TypeError, match=message):
        ckpt.load(state_dict, tmp_path / "c")
    assert not (tmp_path / "d" / "shardwise.json").exists()
