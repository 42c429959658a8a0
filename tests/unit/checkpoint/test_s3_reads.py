"""Reads from an object store (moto's S3 server, in the pytest process): ranged, concurrent
requests; each block a load touches requested once, checked, and used (one pass); no local
temporary file, and memory beyond the destinations bounded by one batch of requests.

A spy on the s3fs file system counts the bytes of every ``get_object`` body; a load's need is
the checksummed 1 MiB blocks of the data files it touches (computed here from the index
document, independently of the reader) plus the index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.entries.items import LocalBox
from shardwise.checkpoint.loading.reader import CheckpointReader
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


def _index(s3: S3Bucket) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        s3.filesystem().cat_file(f"{s3.name}/ckpt/shardwise.json")
    )
    return document


def _touched(s3: S3Bucket, ranges: list[tuple[int, int, int]]) -> int:
    """Bytes of the blocks of the data files that the byte ranges ``(file number, begin,
    end)`` touch (blocks counted from each file's data section, the last one ending at the
    file's end)."""
    files = _index(s3)["files"]
    touched: set[tuple[int, int]] = set()
    for number, begin, end in ranges:
        start = files[number][2]
        touched.update(
            (number, block)
            for block in range((begin - start) // BLOCK, (end - 1 - start) // BLOCK + 1)
        )
    total = 0
    for number, block in touched:
        size, start = files[number][1], files[number][2]
        total += min(BLOCK, size - start - block * BLOCK)
    return total


def _needed_w(s3: S3Bucket, boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    """Bytes of the blocks that the boxes ``((row, col), (rows, cols))`` of ``w`` touch: row
    by row, each row's byte range in its saved chunk."""
    (layout,) = [entry[3] for entry in _index(s3)["tensors"] if entry[0] == "w"]
    assert layout[0] == "chunks"
    begins = {chunk[0][0]: (chunk[2], chunk[3]) for chunk in layout[1]}  # first row -> place
    step = ROWS // ROW_BLOCKS
    ranges = []
    for (row, col), (rows, cols) in boxes:
        for r in range(row, row + rows):
            file, begin = begins[r - r % step]
            local = r % step
            ranges.append(
                (file, begin + (local * COLS + col) * 4, begin + (local * COLS + col + cols) * 4)
            )
    return _touched(s3, ranges)


def _all_data(s3: S3Bucket) -> int:
    """Bytes of every data file's data section."""
    return sum(entry[1] - entry[2] for entry in _index(s3)["files"] if entry is not None)


def _index_bytes(s3: S3Bucket) -> int:
    return s3.keys("ckpt/shardwise.json")["ckpt/shardwise.json"]


def _check(calls: S3Calls, needed: int) -> None:
    """At least what is needed was requested, at most 10% more, and no byte twice."""
    requested = calls.bytes_read()
    assert needed <= requested <= 1.1 * needed, (requested, needed)
    assert calls.requested_twice() == 0


def test_a_full_load_requests_each_needed_byte_once(s3: S3Bucket) -> None:
    url = _save(s3)
    state: dict[str, Any] = {"w": torch.zeros(ROWS, COLS), "bias": torch.zeros(100), "blob": None}
    state["step"] = 0
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["w"], _full()) and state["blob"] == BLOB and state["step"] == 7
    _check(calls, _all_data(s3) + _index_bytes(s3))
    # Ranged requests, several at a time, of at most 8 MiB.
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
    needed = _needed_w(s3, boxes) + _index_bytes(s3)
    assert needed < ROWS * COLS * 4 * 0.7  # whole blocks are skipped
    _check(calls, needed)


def test_load_tensor_of_one_box_requests_its_blocks_once(s3: S3Bucket) -> None:
    url = _save(s3)
    with record_s3_calls(s3.filesystem()) as calls:
        box = ckpt.load_tensor(
            url, "w", offsets=[2, 500000], sizes=[3, 20000], storage_options=s3.options
        )
    assert torch.equal(box, _full()[2:5, 500000:520000])
    _check(calls, _needed_w(s3, [((2, 500000), (3, 20000))]) + _index_bytes(s3))


def _load_measured(endpoint: str, bucket: str) -> None:
    """Load the checkpoint of :func:`_save` from bucket ``bucket`` and print the peak of the
    Python memory allocated meanwhile (run in a process of its own, without the server)."""

    def no_file(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a load made a temporary file")

    for name in ("TemporaryFile", "NamedTemporaryFile", "mkstemp", "SpooledTemporaryFile"):
        setattr(tempfile, name, no_file)
    s3 = S3Bucket(endpoint, bucket)
    state: dict[str, Any] = {"w": torch.zeros(ROWS, COLS), "blob": None}
    # The storage library's own start (botocore's service models: about 10 MiB) first.
    ckpt.read_metadata(s3.url("ckpt"), storage_options=s3.options)
    tracemalloc.start()
    ckpt.load(state, s3.url("ckpt"), storage_options=s3.options)
    peak = tracemalloc.get_traced_memory()[1]
    assert torch.equal(state["w"], _full()) and state["blob"] == BLOB
    print(peak)


def test_no_temporary_file_and_memory_bounded_by_a_batch(s3: S3Bucket) -> None:
    # 19 MiB loaded in batches of 2 MiB of requests, in a process of its own (the server,
    # which copies what it sends, stays in this one): no local file is made, and the Python
    # memory allocated at any time (buffers, response bodies) stays a few batches, not the
    # size of what is loaded (19 MiB). With the defaults (batches of 32 MiB of spans of at
    # most 8 MiB), that is the 64 MiB bound of docs/format.md.
    _save(s3)
    batch = 2 << 20
    env = {
        **os.environ,
        "SHARDWISE_READ_BATCH_BYTES": str(batch),
        "SHARDWISE_STORAGE_BATCH_BYTES": str(batch),
        "SHARDWISE_REQUEST_BYTES": str(batch),
        "SHARDWISE_READ_RUN_BYTES": str(batch),
    }
    code = (
        "from tests.unit.checkpoint.test_s3_reads import _load_measured; "
        f"_load_measured({s3.endpoint!r}, {s3.name!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    # The blob's bytes are a destination (its value); the rest is the batch in flight, and
    # the request bodies of s3fs.
    assert peak < len(BLOB) + 3 * batch, peak


def test_unverified_loads_read_each_byte_once_too(s3: S3Bucket) -> None:
    url = _save(s3)
    state = {"w": torch.zeros(ROWS, COLS)}
    with record_s3_calls(s3.filesystem()) as calls:
        ckpt.load(state, url, storage_options=s3.options, verify=False)
    assert torch.equal(state["w"], _full())
    _check(calls, ROWS * COLS * 4 + _index_bytes(s3))


def test_a_corrupt_object_raises_and_replaces_no_python_value(s3: S3Bucket) -> None:
    url = _save(s3)
    fs = s3.filesystem()
    (name,) = [key for key in s3.keys("ckpt/data")]
    data = bytearray(fs.cat_file(f"{s3.name}/{name}"))
    data[-5] ^= 0xFF  # in the last block: of the blob
    fs.pipe_file(f"{s3.name}/{name}", bytes(data))
    state: dict[str, Any] = {"w": torch.full((ROWS, COLS), 7.0), "blob": None, "step": None}
    with pytest.raises(ckpt.ChecksumError, match="checksum mismatch") as raised:
        ckpt.load(state, url, storage_options=s3.options)
    assert raised.value.key == "blob"
    assert "undefined (partly filled)" in str(raised.value)
    assert state["blob"] is None and state["step"] is None


def test_an_object_shortened_during_a_read_names_its_file(s3: S3Bucket) -> None:
    url = _save(s3)
    fs = s3.filesystem()
    (name,) = list(s3.keys("ckpt/data"))
    with CheckpointReader.open(url, storage_options=s3.options) as reader:
        target = torch.zeros(ROWS, COLS)
        jobs = reader.plan("w", ((0, 0), (ROWS, COLS)), 0)
        reader.check_files((job.key, job.chunk) for job in jobs)  # opened at the right size
        data = fs.cat_file(f"{s3.name}/{name}")
        fs.pipe_file(f"{s3.name}/{name}", data[: len(data) // 2])
        # A range past the new end: the store refuses it, and the error names the object.
        with pytest.raises(ckpt.CheckpointError) as raised:
            reader.fill(jobs, [LocalBox((0, 0), (ROWS, COLS), target)])
    assert s3.url(name) in str(raised.value)
