"""The two read passes of a local load (``reader``, ``_verify``, ``_fill``, ``_kept``): what
they read, what they keep, the memory they hold, and that nothing unverified is copied.

A load first verifies every block it needs, then copies. Locally, a load whose blocks fit
``TUNING.keep_in_memory_bytes`` keeps them in pass 1 and copies them in pass 2 (each byte read
once); a larger one reads its blocks in pass 1 into a small buffer per thread, keeps nothing,
and reads the needed bytes again in pass 2 straight into the tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import math
import os
import shutil
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import _data_files, _fill, _kept, _verify
from shardwise.checkpoint._items import LocalBox
from shardwise.checkpoint.reader import CheckpointReader, read_index_bytes
from shardwise.checkpoint.storage import LocalStorage
from shardwise.checkpoint.tuning import TUNING
from shardwise.errors import CheckpointDataError, ChecksumError
from shardwise.local_shards import LocalShardsWrapper

_MIB = 1 << 20
# 24 MiB in 7 tensors of 1.5 to 6 MiB (several blocks each, one not a whole number of blocks).
_SIZES_MIB = (1.5, 2, 3, 3.5, 4, 4, 6)


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"t{number}": torch.randn(int(mib * _MIB) // 4, generator=generator)
        for number, mib in enumerate(_SIZES_MIB)
    }


_TOTAL = sum(int(mib * _MIB) for mib in _SIZES_MIB)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("passes") / "ckpt"
    ckpt.save(_state(), path)
    return path


def _tune(monkeypatch: pytest.MonkeyPatch, **changes: int) -> None:
    """Use ``changes`` to the tunables in every module of the read passes."""
    tuned = dataclasses.replace(TUNING, **changes)
    for module in (_kept, _verify, _fill):
        monkeypatch.setattr(module, "TUNING", tuned)


@contextlib.contextmanager
def _bytes_read() -> Iterator[list[int]]:
    """The bytes read from data files by the readers closed meanwhile."""
    total = [0]
    close = _data_files.DataFiles.close

    def counting(files: _data_files.DataFiles) -> None:
        total[0] += files.bytes_read
        close(files)

    _data_files.DataFiles.close = counting  # type: ignore[method-assign]
    try:
        yield total
    finally:
        _data_files.DataFiles.close = close  # type: ignore[method-assign]


def _blank() -> dict[str, torch.Tensor]:
    return {key: torch.full_like(value, 7.0) for key, value in _state().items()}


def _copy(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved checkpoint, to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    return path


def _data_file(path: Path) -> Path:
    (name,) = os.listdir(path / "data")
    return path / "data" / name


def _assert_loaded(state: dict[str, torch.Tensor]) -> None:
    for key, value in _state().items():
        assert torch.equal(state[key], value), key


def test_a_load_that_fits_the_memory_bound_reads_each_byte_once(saved: Path) -> None:
    state = _blank()
    with _bytes_read() as total:
        ckpt.load(state, saved)
    _assert_loaded(state)
    assert total[0] == _TOTAL  # verified and kept in pass 1, copied from memory in pass 2


def test_a_larger_load_keeps_nothing_and_reads_twice(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tune(monkeypatch, keep_in_memory_bytes=4 * _MIB)
    state = _blank()
    with _bytes_read() as total:
        ckpt.load(state, saved)
    _assert_loaded(state)
    assert total[0] == 2 * _TOTAL
    with _bytes_read() as total:
        ckpt.load(state, saved, verify=False)
    assert total[0] == _TOTAL


def _peak_of_load(path: Path, state: dict[str, Any]) -> int:
    """The peak of Python allocations during a load (tensors excluded: made beforehand)."""
    tracemalloc.start()
    try:
        ckpt.load(state, path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_memory_of_the_passes_is_bounded(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _blank()
    # Kept: the whole 24 MiB, as the bound allows.
    assert _TOTAL <= _peak_of_load(saved, state) <= TUNING.keep_in_memory_bytes + 4 * _MIB
    _assert_loaded(state)
    # Beyond the bound, nothing is kept: a 1 MiB buffer per I/O thread, and no buffer per
    # run (the batch of runs in flight alone would be 24 MiB).
    _tune(monkeypatch, keep_in_memory_bytes=4 * _MIB)
    state = _blank()
    threads = TUNING.io_threads + 1  # the I/O threads and the calling thread
    assert _peak_of_load(saved, state) <= threads * _MIB + 2 * _MIB
    _assert_loaded(state)


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "not-kept"])
def test_a_corrupt_block_raises_before_any_byte_is_copied(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: bool
) -> None:
    if not kept:
        _tune(monkeypatch, keep_in_memory_bytes=4 * _MIB)
    path = _copy(saved, tmp_path)
    data = bytearray(_data_file(path).read_bytes())
    data[-3 * _MIB - 12345] ^= 0x10  # inside the last tensor, not its first block
    _data_file(path).write_bytes(bytes(data))
    state = _blank()
    with pytest.raises(ChecksumError, match="checksum mismatch") as raised:
        ckpt.load(state, path)
    assert raised.value.key == "t6"
    for value in state.values():
        assert bool((value == 7.0).all())


def _reader_plan(path: Path, state: dict[str, torch.Tensor]) -> tuple[CheckpointReader, Any]:
    reader = CheckpointReader.open(path)
    targets = [LocalBox((0,), tuple(value.shape), value) for value in state.values()]
    jobs = [
        job
        for number, key in enumerate(state)
        for job in reader.plan(key, targets[number].box, number)
    ]
    return reader, (jobs, targets)


def test_what_pass_two_copies_is_what_pass_one_verified(saved: Path, tmp_path: Path) -> None:
    # The data file is overwritten with garbage between the passes: the kept bytes, which
    # were verified, are what reaches the tensors.
    path = _copy(saved, tmp_path)
    state = _blank()
    reader, (jobs, targets) = _reader_plan(path, state)
    with reader:
        reader.verify(reader.job_blocks(jobs))
        victim = _data_file(path)
        size = victim.stat().st_size
        with open(victim, "r+b") as file:
            file.write(b"\xff" * size)
        reader.fill(jobs, targets)
    _assert_loaded(state)


def test_a_file_truncated_between_the_passes_raises_a_checkpoint_error(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tune(monkeypatch, keep_in_memory_bytes=4 * _MIB)  # nothing kept: pass 2 reads the file
    path = _copy(saved, tmp_path)
    state = _blank()
    reader, (jobs, targets) = _reader_plan(path, state)
    with reader:
        reader.verify(reader.job_blocks(jobs))
        os.truncate(_data_file(path), _MIB)
        with pytest.raises(CheckpointDataError, match="truncated"):
            reader.fill(jobs, targets)


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every ``DataFiles.read_into`` from now on, in order (reads still happen)."""
    lengths: list[int] = []
    read_into = _data_files.DataFiles.read_into

    def recording(files: Any, file: str, offset: int, buffer: memoryview, key: Any) -> None:
        lengths.append(len(buffer))
        read_into(files, file, offset, buffer, key)

    monkeypatch.setattr(_data_files.DataFiles, "read_into", recording)
    return lengths


def test_large_reads_are_cut_into_pieces_for_the_threads(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tune(monkeypatch, read_run_bytes=256 << 10)
    sizes = _record_reads(monkeypatch)
    state = _blank()
    ckpt.load(state, saved, verify=False)
    _assert_loaded(state)
    assert max(sizes) == 256 << 10 and sum(sizes) == _TOTAL


def test_an_audit_collects_every_mismatch_without_keeping(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    data = bytearray(_data_file(path).read_bytes())
    for back in (1, 5 * _MIB, 20 * _MIB):
        data[-back] ^= 0x01
    _data_file(path).write_bytes(bytes(data))
    with CheckpointReader.open(path) as reader:
        blocks = [
            block
            for key, record in reader.index.tensors.items()
            for chunk in record.chunks
            for block in reader.blocks(key, chunk, 0, chunk.nbytes)
        ]
        found: list[ChecksumError] = []
        reader.verify(blocks, problems=found)
        assert len(found) == 3
        assert not reader.files.kept.holds(_data_file(path).relative_to(path).as_posix())
        assert reader.bytes_verified == _TOTAL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int8])
@pytest.mark.parametrize("keep", [64 * _MIB, 1], ids=["kept", "not-kept"])
def test_column_boxes_of_row_chunks_are_copied_row_by_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, keep: int
) -> None:
    # Rows of 20 KiB and more per chunk than fit one 1 MiB buffer: the strided reads of the
    # column boxes go in pieces of rows through each thread's buffer, from the kept bytes
    # or from the file.
    _tune(monkeypatch, keep_in_memory_bytes=keep)
    generator = torch.Generator().manual_seed(1)
    full = (torch.randn(96, 8, 5120, generator=generator) * 4).to(dtype)
    saved = LocalShardsWrapper([full[:60].clone(), full[60:].clone()], [(0, 0, 0), (60, 0, 0)])
    ckpt.save({"w": saved}, tmp_path / "c")
    left = torch.zeros(96, 8, 1000, dtype=dtype)
    inner = torch.zeros(50, 3, 2000, dtype=dtype)
    target = {"w": LocalShardsWrapper([left, inner], [(0, 0, 0), (30, 2, 3000)])}
    with _bytes_read() as total:
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(left, full[:, :, :1000])
    assert torch.equal(inner, full[30:80, 2:5, 3000:5000])
    blocks = full.numel() * full.element_size()  # every block holds needed bytes
    if keep > 1:
        assert total[0] == blocks
    else:  # then each box's rows again from the file (the gaps the planner reads through)
        assert blocks < total[0] <= 3 * blocks


def test_staging_buffers_are_made_a_batch_at_a_time(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cast goes through staging buffers: at most a batch of them (or one larger read)
    # exist at a time, not one per read of the whole load at once.
    _tune(monkeypatch, read_batch_bytes=4 * _MIB)
    live = [0, 0]  # staging bytes made and not yet copied out; the most at once
    prepare, read_staged = _fill._Staged.prepare, _fill._read_staged

    def preparing(job: Any, destination: torch.Tensor) -> Any:
        live[0] += job.read.nbytes
        live[1] = max(live)
        return prepare(job, destination)

    def reading(files: Any, group: list[Any]) -> None:
        read_staged(files, group)
        live[0] -= sum(fill.read.length for fill in group)

    monkeypatch.setattr(_fill._Staged, "prepare", preparing)
    monkeypatch.setattr(_fill, "_read_staged", reading)
    state = {key: torch.zeros(value.shape, dtype=torch.float64) for key, value in _state().items()}
    ckpt.load(state, saved, allow_dtype_cast=True)
    for key, value in _state().items():
        assert torch.equal(state[key], value.double()), key
    assert live[0] == 0 and 0 < live[1] <= 6 * _MIB  # the largest tensor, alone in its batch


@pytest.mark.parametrize("keep", [64 * _MIB, 1], ids=["kept", "not-kept"])
def test_small_tensors_side_by_side_are_read_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    # 3,000 tensors of 4 B to 12 KiB, saved side by side: pass 2 reads them a buffer at a
    # time (or copies them from the kept bytes), not with one read each.
    _tune(monkeypatch, keep_in_memory_bytes=keep)
    generator = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
    saved = {
        f"p{n}": (torch.randn(1 + (n * 37) % 3000, generator=generator) * 9).to(dtypes[n % 5])
        for n in range(3000)
    }
    ckpt.save(saved, tmp_path / "c")
    state = {key: torch.zeros_like(value) for key, value in saved.items()}
    reads = _record_reads(monkeypatch)
    for verify in (True, False):
        for value in state.values():
            value.zero_()
        reads.clear()
        ckpt.load(state, tmp_path / "c", verify=verify)
        for key, value in saved.items():
            assert torch.equal(state[key], value), key
        total = sum(value.nbytes for value in saved.values())
        if verify and keep > 1:
            assert reads == []  # pass 1 reads whole runs and keeps them; pass 2 copies
        else:
            assert sum(reads) >= total and len(reads) <= 2 * total // _MIB + 4


class _Replaced:
    """A reader of an index replaced, between the size lookup and the read, by one of another
    size (as on an object store, where the two are separate requests)."""

    def __init__(self, real: Any, size: int) -> None:
        self.path, self.size, self._real = real.path, size, real

    def read_into(self, offset: int, buffer: memoryview) -> int:
        count: int = self._real.read_into(offset, buffer)
        return count

    def close(self) -> None:
        self._real.close()


@pytest.mark.parametrize("change", [-40, 40], ids=["grew", "shrank"])
def test_an_index_replaced_while_it_is_read_is_read_again(
    saved: Path, monkeypatch: pytest.MonkeyPatch, change: int
) -> None:
    opened: list[str] = []
    open_reader = LocalStorage.open_reader

    def replacing(storage: LocalStorage, path: str) -> Any:
        reader = open_reader(storage, path)
        opened.append(path)
        if path.endswith("shardwise.json") and len(opened) == 1:
            return _Replaced(reader, reader.size + change)
        return reader

    monkeypatch.setattr(LocalStorage, "open_reader", replacing)
    storage = LocalStorage(saved)
    data = read_index_bytes(storage, str(saved))
    assert data == (saved / "shardwise.json").read_bytes()
    assert len(opened) == 2


def _save_row_chunks(path: Path, seed: int, shape: tuple[int, ...], split: int) -> torch.Tensor:
    """A random tensor of ``shape`` saved at ``path`` as two chunks of rows (``[0, split)``
    and the rest, as two ranks of a row-wise sharding save it); returned whole."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape, generator=generator)
    second = (split,) + (0,) * (len(shape) - 1)
    chunks = [full[:split].clone(), full[split:].clone()]
    ckpt.save({"w": LocalShardsWrapper(chunks, [(0,) * len(shape), second])}, path)
    return full


@pytest.mark.parametrize("keep", [64 * _MIB, 1], ids=["kept", "not-kept"])
def test_long_strided_runs_are_scattered_straight_into_their_destinations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    # Rows of 32 KiB; column boxes whose rows are runs of 20 and 24 KiB, with gaps of
    # different sizes between them (within a row band, between bands). Read from the file,
    # one scatter read puts the runs into the destinations and the gaps aside; from the
    # kept bytes, they are copied.
    _tune(monkeypatch, keep_in_memory_bytes=keep)
    full = _save_row_chunks(tmp_path / "c", 3, (64, 4, 8192), 40)
    left = torch.zeros(64, 4, 5000)
    inner = torch.zeros(30, 2, 6000)
    target = {"w": LocalShardsWrapper([left, inner], [(0, 0, 0), (20, 1, 1000)])}
    scattered: list[int] = []
    read_vector = _data_files.DataFiles.read_vector

    def recording(files: Any, file: str, offset: int, buffers: list[memoryview], key: Any) -> None:
        scattered.append(len(buffers))
        read_vector(files, file, offset, buffers, key)

    monkeypatch.setattr(_data_files.DataFiles, "read_vector", recording)
    ckpt.load(target, tmp_path / "c")
    assert torch.equal(left, full[:, :, :5000])
    assert torch.equal(inner, full[20:50, 1:3, 1000:7000])
    if keep > 1:
        assert scattered == []
    else:  # a run and a gap per destination row, up to 1,024 buffers per read
        assert (sum(scattered) + len(scattered)) // 2 >= 64 * 4 + 30 * 2
        assert max(scattered) <= 1024


def test_a_scatter_read_past_the_end_of_a_file_is_a_checkpoint_error(saved: Path) -> None:
    with CheckpointReader.open(saved) as reader:
        name = next(iter(reader.index.files))
        size = reader.handle(name).size
        buffers = [memoryview(bytearray(8)), memoryview(bytearray(8))]
        with pytest.raises(CheckpointDataError, match="truncated: read 10 of 16 bytes"):
            reader.files.read_vector(name, size - 10, buffers, "t0")


@pytest.mark.parametrize("verify", [True, False])
def test_runs_far_apart_are_read_alone_and_the_gaps_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    # Rows of 64 KiB: the left half's runs of 32 KiB (and the 4 KiB runs of a narrow box,
    # shorter than a scattered run) lie 32 KiB and more apart, so pass 2 reads each run on
    # its own and reads exactly the bytes it needs.
    _tune(monkeypatch, keep_in_memory_bytes=1)
    full = _save_row_chunks(tmp_path / "c", 4, (48, 2, 16384), 20)
    left = torch.zeros(48, 2, 8192)
    narrow = torch.zeros(10, 2, 1024)
    target = {"w": LocalShardsWrapper([left, narrow], [(0, 0, 0), (15, 0, 9000)])}
    separate: list[int] = []
    read_runs = _data_files.DataFiles.read_runs

    def recording(files: Any, file: str, runs: list[tuple[int, memoryview]], key: Any) -> None:
        separate.extend(len(buffer) for _, buffer in runs)
        read_runs(files, file, runs, key)

    monkeypatch.setattr(_data_files.DataFiles, "read_runs", recording)
    with _bytes_read() as total:
        ckpt.load(target, tmp_path / "c", verify=verify)
    assert torch.equal(left, full[:, :, :8192])
    assert torch.equal(narrow, full[15:25, :, 9000:10024])
    needed = left.nbytes + narrow.nbytes
    assert sorted(set(separate)) == [4096, 32768]
    assert sum(separate) == needed
    blocks = full.nbytes if verify else 0  # pass 1 reads every block the boxes touch
    assert total[0] == blocks + needed


def test_a_run_read_past_the_end_of_a_file_is_a_checkpoint_error(saved: Path) -> None:
    with CheckpointReader.open(saved) as reader:
        name = next(iter(reader.index.files))
        size = reader.handle(name).size
        runs = [(0, memoryview(bytearray(8))), (size - 4, memoryview(bytearray(8)))]
        with pytest.raises(CheckpointDataError, match="truncated: read 4 of 8 bytes"):
            reader.files.read_runs(name, runs, "t0")
        assert reader.files.bytes_read == 8  # the run read whole


@st.composite
def _box_in_chunk(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """A chunk's sizes, and the offsets and sizes of a box inside it."""
    chunk = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    offsets = [draw(st.integers(0, size - 1)) for size in chunk]
    sizes = [
        draw(st.integers(1, size - offset)) for size, offset in zip(chunk, offsets, strict=True)
    ]
    return chunk, offsets, sizes


@settings(max_examples=300, deadline=None)
@given(_box_in_chunk(), st.sampled_from([1, 2, 4, 8]))
def test_the_runs_of_a_strided_read_are_those_of_its_bytes(
    case: tuple[list[int], list[int], list[int]], itemsize: int
) -> None:
    # Against the byte offsets of every element of the box, in row-major order: the length
    # of each contiguous run, and the smallest gap between two.
    chunk, offsets, sizes = case
    strides = [math.prod(chunk[dim + 1 :]) * itemsize for dim in range(len(chunk))]
    starts = sorted(
        sum((o + i) * s for o, i, s in zip(offsets, index, strides, strict=True))
        for index in itertools.product(*(range(size) for size in sizes))
    )
    runs: list[list[int]] = [[starts[0], starts[0] + itemsize]]
    for start in starts[1:]:
        if start == runs[-1][1]:
            runs[-1][1] += itemsize
        else:
            runs.append([start, start + itemsize])
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    run, gap = _fill._runs_of(torch.empty(sizes, dtype=dtype), sizes, strides)
    if len(runs) == 1:
        assert (run, gap) == (None, 0)
        return
    assert {end - start for start, end in runs} == {run}
    assert gap == min(after[0] - before[1] for before, after in itertools.pairwise(runs))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=2, max_size=12),
    boxes=st.lists(st.tuples(st.integers(0, 11), st.floats(0, 1), st.floats(0, 1)), max_size=20),
)
def test_blocks_of_many_reads_are_those_of_each_read_deduplicated(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    boxes: list[tuple[int, float, float]],
) -> None:
    # Version 4 (checksums per file): the blocks the reads of a load touch, found for all
    # reads at once, are what each read's own blocks give once repeats are dropped (the last
    # read touching a block names it, as the verifying pass keeps it).
    path = tmp_path_factory.mktemp("blocks") / "c"
    state = {f"t{n}": torch.arange(size, dtype=torch.float32) for n, size in enumerate(sizes)}
    lowered = dataclasses.replace(TUNING, layout_index_chunks=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module("shardwise.checkpoint.tuning"), "TUNING", lowered)
        ckpt.save(state, path)
    with CheckpointReader.open(path) as reader:
        assert reader.index.block_scope == "file"
        jobs = []
        for number, low, high in boxes:
            size = sizes[number % len(sizes)]
            begin = int(min(low, high) * size)
            end = int(max(low, high) * size)
            jobs += reader.plan(f"t{number % len(sizes)}", ((begin,), (end - begin,)), 0)
        expected = {}
        for job in jobs:
            relative = job.read.file_offset - job.chunk.begin
            for block in reader.blocks(job.key, job.chunk, relative, relative + job.read.nbytes):
                expected[block.file, block.begin] = block
        found = list(reader.job_blocks(jobs))
        assert len(found) == len({(block.file, block.begin) for block in found})
        assert {(block.file, block.begin): block for block in found} == expected
