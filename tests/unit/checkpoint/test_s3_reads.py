"""Reads from an object store (moto's S3 server, in the pytest process): ranged, concurrent
requests, and each byte a load needs requested once, although every block is verified before
anything is copied.

A spy on the s3fs file system counts the bytes of every ``get_object`` body; a load's need is
the checksummed 1 MiB blocks it touches (computed here from the layout, independently of the
reader) plus the index.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import _kept as kept_module
from shardwise.checkpoint import _verify as verify_module
from shardwise.checkpoint import reader as reader_module
from shardwise.checkpoint.storage import _local as local_storage_module
from shardwise.checkpoint.tuning import TUNING
from shardwise.local_shards import LocalShardsWrapper
from tests._s3 import S3Bucket, S3Calls, record_s3_calls, s3_bucket, s3_server  # noqa: F401 (fixtures)

BLOCK = 1 << 20
ROWS, COLS = 8, 524288  # float32: 2 MiB rows (2 blocks each), 16 MiB in all
ROW_BLOCKS = 4  # saved as 4 chunks of 2 rows
BLOB = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit: 4 blocks


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def _save(s3: S3Bucket) -> str:
    full = _full()
    step = ROWS // ROW_BLOCKS
    blocks = [full[step * i : step * (i + 1)].clone() for i in range(ROW_BLOCKS)]
    state = {
        "w": LocalShardsWrapper(blocks, [(step * i, 0) for i in range(ROW_BLOCKS)]),
        "bias": torch.arange(100, dtype=torch.float32),
        "blob": BLOB,
        "step": 7,
    }
    url = s3.url("ckpt")
    ckpt.save(state, url, storage_options=s3.options)
    return url


def _blocks(nbytes: int) -> list[int]:
    """The sizes of the checksummed blocks of an entry of ``nbytes``."""
    return [min(BLOCK, nbytes - start) for start in range(0, nbytes, BLOCK)] or [0]


def _needed_w(boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    """Bytes of the blocks of ``w``'s saved chunks that the boxes ``((row, col), (rows,
    cols))`` touch: row by row, each row's byte range in its chunk."""
    step = ROWS // ROW_BLOCKS
    touched: set[tuple[int, int]] = set()
    for (row, col), (rows, cols) in boxes:
        for r in range(row, row + rows):
            chunk, local = divmod(r, step)
            begin = (local * COLS + col) * 4
            end = (local * COLS + col + cols) * 4
            touched.update(
                (chunk, number) for number in range(begin // BLOCK, (end - 1) // BLOCK + 1)
            )
    sizes = _blocks(step * COLS * 4)
    return sum(sizes[number] for _, number in touched)


def _index_bytes(s3: S3Bucket) -> int:
    return s3.keys("ckpt/shardwise.json")["ckpt/shardwise.json"]


def _check(calls: S3Calls, needed: int) -> None:
    """At least what is needed was requested, at most 10% more, and no byte twice."""
    requested = calls.bytes_read()
    assert needed <= requested <= 1.1 * needed, (requested, needed)
    assert calls.requested_twice() == 0


def test_a_full_load_requests_each_needed_byte_once(s3: S3Bucket) -> None:
    url = _save(s3)
    full = _full()
    state: dict[str, Any] = {
        "w": torch.zeros(ROWS, COLS),
        "bias": torch.zeros(100),
        "blob": None,
        "step": 0,
    }
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], full)
    assert torch.equal(state["bias"], torch.arange(100, dtype=torch.float32))
    assert state["blob"] == BLOB and state["step"] == 7
    needed = ROWS * COLS * 4 + 400 + sum(_blocks(len(BLOB))) + _index_bytes(s3)
    _check(calls, needed)
    # Ranged requests, several at a time: 16 MiB of blocks in runs of at most 8 MiB.
    assert calls.most_reads_in_flight > 1
    assert all(size <= 8 << 20 for op, _, size in calls.calls if op == "get_object")


def test_a_resharded_load_requests_only_the_blocks_it_touches_once(s3: S3Bucket) -> None:
    url = _save(s3)
    full = _full()
    # A column band across every saved chunk (in the second block of each row), and an
    # interior box across two of them (in the first).
    column = torch.zeros(ROWS - 2, 8192)
    interior = torch.zeros(4, 10000)
    boxes = [((1, 300000), (ROWS - 2, 8192)), ((2, 100000), (4, 10000))]
    target = {"w": LocalShardsWrapper([column, interior], [box[0] for box in boxes])}
    with record_s3_calls(s3.filesystem()) as calls:
        result = ckpt.load(target, url, storage_options=s3.options)
    assert sorted(result.unexpected_keys) == ["bias", "blob", "step"]
    assert torch.equal(column, full[1 : ROWS - 1, 300000 : 300000 + 8192])
    assert torch.equal(interior, full[2:6, 100000:110000])
    needed = _needed_w(boxes) + _index_bytes(s3)
    assert needed < ROWS * COLS * 4 * 0.7  # whole blocks are skipped
    _check(calls, needed)


def test_load_tensor_of_one_box_requests_its_blocks_once(s3: S3Bucket) -> None:
    url = _save(s3)
    with record_s3_calls(s3.filesystem()) as calls:
        box = ckpt.load_tensor(
            url, "w", offsets=[2, 500000], sizes=[3, 20000], storage_options=s3.options
        )
    assert torch.equal(box, _full()[2:5, 500000:520000])
    _check(calls, _needed_w([((2, 500000), (3, 20000))]) + _index_bytes(s3))


def test_verified_bytes_beyond_the_memory_budget_go_to_a_temporary_file(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 2 MiB kept in memory, most of the 16 MiB go to the temporary file; still one
    # request per needed byte, and the values come back intact.
    url = _save(s3)
    monkeypatch.setattr(
        kept_module, "TUNING", dataclasses.replace(TUNING, keep_in_memory_bytes=2 << 20)
    )
    spilled: list[int] = []
    write_spill = reader_module._KeptBytes._write_spill

    def counting(self: Any, data: memoryview) -> int | None:
        spilled.append(len(data))
        return write_spill(self, data)

    monkeypatch.setattr(reader_module._KeptBytes, "_write_spill", counting)
    state = {"w": torch.zeros(ROWS, COLS)}
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], _full())
    assert sum(spilled) >= (16 - 2) << 20
    _check(calls, ROWS * COLS * 4 + _index_bytes(s3))


def test_a_full_temporary_disk_only_costs_a_second_request(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temporary file cannot be written (a full disk): the bytes it would hold are
    # requested again in the second pass, and the load is still right.
    url = _save(s3)
    monkeypatch.setattr(
        kept_module, "TUNING", dataclasses.replace(TUNING, keep_in_memory_bytes=2 << 20)
    )

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_storage_module.tempfile, "TemporaryFile", full_disk)
    state = {"w": torch.zeros(ROWS, COLS)}
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], _full())
    data = ROWS * COLS * 4
    assert data + (data - (2 << 20)) <= calls.bytes_read() <= 2.1 * data
    assert calls.requested_twice() >= data - (2 << 20)


def test_unverified_loads_read_each_byte_once_too(s3: S3Bucket) -> None:
    url = _save(s3)
    state = {"w": torch.zeros(ROWS, COLS)}
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options, verify=False)
    assert torch.equal(state["w"], _full())
    _check(calls, ROWS * COLS * 4 + _index_bytes(s3))


def test_blocks_larger_than_a_read_are_checked_in_pieces_and_kept(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reads of at most 256 KiB: each 1 MiB block is read in 4 pieces (as a version-1 chunk,
    # one block however large, always is), hashed in order, and kept once it matched.
    url = _save(s3)
    monkeypatch.setattr(
        verify_module, "TUNING", dataclasses.replace(TUNING, read_run_bytes=256 << 10)
    )
    state = {"w": torch.zeros(ROWS, COLS)}
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], _full())
    _check(calls, ROWS * COLS * 4 + _index_bytes(s3))
    data_reads = [size for op, key, size in calls.calls if op == "get_object" and "/data/" in key]
    assert data_reads and max(data_reads) <= 256 << 10


def test_a_corrupt_object_raises_before_anything_is_copied(s3: S3Bucket) -> None:
    url = _save(s3)
    fs = s3.filesystem()
    (name,) = [key for key in s3.keys("ckpt/data")]
    data = bytearray(fs.cat_file(f"{s3.name}/{name}"))
    data[-5] ^= 0xFF  # in the last block of the blob or of a chunk
    fs.pipe_file(f"{s3.name}/{name}", bytes(data))
    state: dict[str, Any] = {"w": torch.full((ROWS, COLS), 7.0), "blob": None}
    with pytest.raises(ckpt.ChecksumError, match="checksum mismatch"):
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], torch.full((ROWS, COLS), 7.0)) and state["blob"] is None
