"""The one read pass of a load (``_read``, ``_fill``): each checksummed block a read touches is
read once, checked, and used; what it reads, the memory it holds, and what a mismatch means.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import tuning
from shardwise.checkpoint.loading import fill as _fill
from shardwise.checkpoint.loading import read as _read
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.storage._local import _LocalReader
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


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pass") / "ckpt"
    ckpt.save({**_state(), "note": "kept in the index", "raw": b"x" * 3000}, path)
    return path


def _tune(monkeypatch: pytest.MonkeyPatch, **changes: int) -> None:
    monkeypatch.setattr(tuning, "TUNING", dataclasses.replace(tuning.TUNING, **changes))


@contextlib.contextmanager
def _reads() -> Iterator[list[int]]:
    """The bytes and the number of positioned reads of data files (not the index)."""
    counter = [0, 0]
    read_into, read_vector = _LocalReader.read_into, _LocalReader.read_vector

    def count(reader: _LocalReader, got: int) -> int:
        if not reader.path.endswith("shardwise.json"):
            counter[0] += got
            counter[1] += 1
        return got

    _LocalReader.read_into = lambda self, offset, buffer: count(  # type: ignore[method-assign]
        self, read_into(self, offset, buffer)
    )
    _LocalReader.read_vector = lambda self, offset, buffers: count(  # type: ignore[method-assign]
        self, read_vector(self, offset, buffers)
    )
    try:
        yield counter
    finally:
        _LocalReader.read_into = read_into  # type: ignore[method-assign]
        _LocalReader.read_vector = read_vector  # type: ignore[method-assign]


def _blank() -> dict[str, Any]:
    return {
        **{key: torch.full_like(value, 7.0) for key, value in _state().items()},
        "note": None,
        "raw": None,
    }


def _copy(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    return path


def _data_file(path: Path) -> Path:
    (name,) = os.listdir(path / "data")
    return path / "data" / name


def _index(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((path / "shardwise.json").read_text())
    return document


def _section(path: Path) -> int:
    """The bytes of the data sections of every data file."""
    return sum(entry[1] - entry[2] for entry in _index(path)["files"] if entry is not None)


def test_a_full_load_reads_each_block_once(saved: Path) -> None:
    state = _blank()
    with _reads() as counter:
        ckpt.load(state, saved)
    for key, value in _state().items():
        assert torch.equal(state[key], value), key
    assert state["note"] == "kept in the index" and state["raw"] == b"x" * 3000
    # Every byte of the data section once, in reads of about a 1 MiB block each: no pass
    # reads anything again.
    assert counter[0] == _section(saved)
    assert counter[1] <= _section(saved) // _MIB + 2 * len(_SIZES_MIB) + 2


def test_an_unverified_load_reads_the_same_bytes_in_fewer_reads(saved: Path) -> None:
    state = _blank()
    with _reads() as counter:
        ckpt.load(state, saved, verify=False)
    assert torch.equal(state["t6"], _state()["t6"])
    assert counter[0] == _section(saved)
    assert counter[1] <= _section(saved) // (8 * _MIB) + 2 * len(_SIZES_MIB)


def test_a_corrupt_block_raises_naming_it_and_replaces_no_python_value(
    saved: Path, tmp_path: Path
) -> None:
    path = _copy(saved, tmp_path)
    data = bytearray(_data_file(path).read_bytes())
    data[-3 * _MIB - 12345] ^= 0x10  # inside the last tensor, not its first block
    _data_file(path).write_bytes(bytes(data))
    state = _blank()
    with pytest.raises(
        ChecksumError, match=r"checksum mismatch for a chunk of this tensor in "
    ) as raised:
        ckpt.load(state, path)
    error = raised.value
    assert error.key == "t6" and error.rank == 0
    assert error.file == str(_data_file(path))
    message = str(error)
    assert "the data file is corrupt; the tensors this load was filling are undefined" in message
    assert "(partly filled) and no Python value of the state dict was replaced" in message
    assert "load another checkpoint" in message
    assert state["note"] is None and state["raw"] is None  # no Python value replaced
    # Nothing unverified is returned by a read of the damaged tensor either.
    with pytest.raises(ChecksumError):
        ckpt.load_tensor(path, "t6")
    # Without verification, the damaged bytes load as they are.
    ckpt.load(state, path, verify=False)
    assert not torch.equal(state["t6"], _state()["t6"])


def test_every_mismatch_is_collected_by_an_audit(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    data = bytearray(_data_file(path).read_bytes())
    start = _index(path)["files"][0][2]
    for block in (0, 5, 20):
        data[start + block * _MIB + 100] ^= 0x01
    _data_file(path).write_bytes(bytes(data))
    problems: list[ChecksumError] = []
    with CheckpointReader.open(path) as reader:
        name = next(iter(reader.index.files))
        _read.audit(reader.files, [name], problems)
    assert len(problems) == 3
    assert all(f"block {b} " in str(p) for b, p in zip((0, 5, 20), problems, strict=True))


def test_a_file_truncated_during_a_load_is_a_checkpoint_error(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    state = _state()
    with CheckpointReader.open(path) as reader:
        jobs = reader.plan("t6", ((0,), tuple(state["t6"].shape)), 0)
        reader.check_files((job.key, job.chunk) for job in jobs)  # opened at the right size
        os.truncate(_data_file(path), _data_file(path).stat().st_size - 2 * _MIB)
        target = torch.empty_like(state["t6"])
        with pytest.raises(CheckpointDataError, match="data file is truncated"):
            reader.fill(jobs, [_fill.LocalBox((0,), tuple(target.shape), target)])


def test_casts_are_staged_a_batch_at_a_time(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cast goes through staging buffers: at most a batch of them at a time (a tensor larger
    # than a batch in pieces of rows), not one per read of the whole load at once.
    _tune(monkeypatch, read_batch_bytes=2 * _MIB)
    staged: list[int] = []
    read = _fill.read

    def spy(files: Any, segments: list[_read.Segment], **kwargs: Any) -> None:
        staged.append(sum(len(s.memory) for s in segments if s.key.startswith("t")))
        read(files, segments, **kwargs)

    monkeypatch.setattr(_fill, "read", spy)
    state: dict[str, Any] = {
        key: torch.zeros(value.shape, dtype=torch.float64) for key, value in _state().items()
    }
    ckpt.load(state, saved, allow_dtype_cast=True)
    for key, value in _state().items():
        assert torch.equal(state[key], value.double()), key
    assert len(staged) >= 12 and max(staged) <= 2 * _MIB


def test_destinations_that_share_bytes_are_each_filled(tmp_path: Path) -> None:
    # Tied keys, saved once, loaded into two separate tensors: both read the same bytes
    # (the second in a later round, checked again).
    weight = torch.randn(300, 500)
    ckpt.save({"a": weight, "b": weight}, tmp_path / "c")
    state = {"a": torch.zeros(300, 500), "b": torch.zeros(300, 500)}
    ckpt.load(state, tmp_path / "c")
    assert torch.equal(state["a"], weight) and torch.equal(state["b"], weight)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_keys_sharing_memory_loaded_from_two_saved_tensors_end_as_the_later_key(
    tmp_path: Path, order: str
) -> None:
    # An untied checkpoint loaded into a tied state dict (one tensor under two keys), and a
    # key that is a view of another's first rows. Was: both read at once into the same memory
    # by the I/O threads, and each block hashed from there after the other had overwritten it:
    # a ChecksumError calling the (intact) file corrupt, or a mix of both values.
    columns = _MIB // 16
    saved = {"a": torch.full((64, columns), 1.0), "b": torch.full((64, columns), 2.0)}
    ckpt.save(dict(sorted(saved.items(), reverse=order == "ba")), tmp_path / "c")
    later = order[1]
    for _ in range(3):
        tied = torch.zeros(64, columns)
        ckpt.load({key: tied for key in order}, tmp_path / "c")
        assert torch.equal(tied, saved[later])
    rows = {"a": saved["a"], "b": saved["b"][:16]}
    ckpt.save(dict(sorted(rows.items(), reverse=order == "ba")), tmp_path / "rows")
    whole = torch.zeros(64, columns)
    views = {"a": whole, "b": whole[:16]}
    ckpt.load({key: views[key] for key in order}, tmp_path / "rows")
    expected = saved["a"].clone()
    if order == "ab":
        expected[:16] = 2.0  # "b" (rows 0-15 of "a"'s memory) is loaded after "a"
    assert torch.equal(whole, expected)


def test_destinations_of_different_targets_that_share_memory_go_in_later_layers() -> None:
    memory = torch.zeros(64)
    other = torch.zeros(64)

    def job(target: int, destination: torch.Tensor) -> tuple[int, torch.Tensor, list[Any]]:
        return target, destination, [(target, destination.data_ptr())]

    def layers(*jobs: tuple[int, torch.Tensor, list[Any]]) -> list[list[Any]]:
        return _fill._layers(list(jobs))

    # Disjoint memory, or two bands of one target: one layer, in job order.
    assert layers(job(0, memory), job(1, other)) == [[job(0, memory)[2][0], job(1, other)[2][0]]]
    assert len(layers(job(0, memory[:32]), job(0, memory[32:]))) == 1
    # Another target's memory, whole or in part: a layer later, each time it overlaps again.
    first, second, third = job(0, memory), job(1, memory[10:20]), job(2, memory[15:16])
    assert layers(first, second, third) == [first[2], second[2], third[2]]
    assert layers(first, job(1, other), second) == [first[2] + job(1, other)[2], second[2]]


def test_a_column_band_reads_the_blocks_it_touches_once(tmp_path: Path) -> None:
    # Rows of 2 MiB (two blocks each) saved in 4 row blocks; the left quarter of every row
    # loaded: verified, every block a row's quarter touches is read once (whole blocks: here
    # the first block of each row, half of the data); unverified, only the needed bytes.
    full = torch.randn(8, 524288)
    parts = [full[2 * i : 2 * i + 2].clone() for i in range(4)]
    ckpt.save({"w": LocalShardsWrapper(parts, [(2 * i, 0) for i in range(4)])}, tmp_path / "c")
    needed = 8 * 131072 * 4
    for verify, low, high in ((True, 2 * needed, 2.1 * needed), (False, needed, 1.05 * needed)):
        band = torch.zeros(8, 131072)
        with _reads() as counter:
            ckpt.load({"w": LocalShardsWrapper([band], [(0, 0)])}, tmp_path / "c", verify=verify)
        assert torch.equal(band, full[:, :131072])
        assert low <= counter[0] <= high, (verify, counter)


def test_small_tensors_side_by_side_are_read_a_block_at_a_time(tmp_path: Path) -> None:
    values = {f"s{n}": torch.full((n % 1000 + 1,), float(n)) for n in range(3000)}
    ckpt.save(values, tmp_path / "c")
    state = {key: torch.zeros_like(value) for key, value in values.items()}
    with _reads() as counter:
        ckpt.load(state, tmp_path / "c")
    assert all(torch.equal(state[key], values[key]) for key in values)
    size = _section(tmp_path / "c")
    assert counter[0] == size
    # One scatter read per 1,024 destinations at most, not one read per tensor.
    assert counter[1] <= size // _MIB + 3000 // 1000 + 2


# -- the pure parts ---------------------------------------------------------------------------


def _files(block: int, start: int, size: int, data: bytes = b"") -> Any:
    """A stand-in for :class:`DataFiles` of one file ``f`` (the index fields the pass uses)."""
    sums = "".join(
        xxhash.xxh3_64_hexdigest(data[begin : begin + block])
        for begin in range(0, max(len(data), 1), block)
    )
    index = SimpleNamespace(
        block_size=block,
        data_starts={"f": start},
        files={"f": size},
        file_checksums={"f": sums},
        objects={},
        tensors={},
    )
    return SimpleNamespace(
        index=index, handle=lambda name, key=None: None, shown=lambda name: name, rank=0
    )


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[int, int]]]:
    block = draw(st.sampled_from([4, 16, 64]))
    start = draw(st.integers(8, 100))
    size = start + draw(st.integers(1, 40 * block))
    cuts = sorted(draw(st.lists(st.integers(start, size), min_size=2, max_size=12)))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
    return block, start, size, ranges


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.integers(1, 6))
def test_spans_are_the_touched_blocks_in_runs(
    layout: tuple[int, int, int, list[tuple[int, int]]], run_blocks: int
) -> None:
    block, start, size, ranges = layout
    files = _files(block, start, size)
    segments = [_read.Segment("f", a, memoryview(bytearray(b - a)), "k") for a, b in ranges]
    with pytest.MonkeyPatch.context() as patch:
        _tune(patch, read_run_bytes=run_blocks * block)
        spans = _read._blocks_spans(files, segments)
    touched = {
        (a - start) // block + k
        for a, b in ranges
        for k in range((b - 1 - start) // block - (a - start) // block + 1)
    }
    covered: list[int] = []
    for span in spans:
        assert (span.begin - start) % block == 0  # whole blocks
        assert span.end == size or (span.end - start) % block == 0
        assert span.length <= run_blocks * block
        covered.extend(range((span.begin - start) // block, (span.end - 1 - start) // block + 1))
        # A span lists exactly the segments with bytes in it, in file order.
        inside = [s for s in segments if s.begin < span.end and span.begin < s.end]
        assert span.segments == inside
    assert covered == sorted(touched)  # each touched block once, in order


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 200),
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
    st.integers(0, 10**6),
)
def test_blocks_are_checked_however_their_bytes_are_fed(
    length: int, pieces: list[int], flip: int
) -> None:
    block, start = 16, 8
    data = bytes(range(256)) * 4
    data = data[:length]
    files = _files(block, start, start + length, data)
    span = _read._Span("f", start, start + length)
    damaged = bytearray(data)
    where = flip % length if flip % 3 else None  # a third of the cases intact
    if where is not None:
        damaged[where] ^= 0x40
    checker = _read._Checker(files, span, "")
    offset = 0
    for piece in pieces * (length // sum(pieces) + 1):
        if offset >= length:
            break
        checker.feed(memoryview(damaged)[offset : offset + piece])
        offset += piece
    if where is None:
        assert checker.mismatches == []
    else:
        (mismatch,) = checker.mismatches
        assert f"in block {where // block} of the file" in str(mismatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_unverified_byte_reaches_device_memory(saved: Path, tmp_path: Path) -> None:
    state = {key: torch.full_like(value, 7.0, device="cuda") for key, value in _state().items()}
    ckpt.load(state, saved)
    for key, value in _state().items():
        assert torch.equal(state[key].cpu(), value), key
    path = _copy(saved, tmp_path)
    data = bytearray(_data_file(path).read_bytes())
    data[-3 * _MIB - 12345] ^= 0x10
    _data_file(path).write_bytes(bytes(data))
    target = {"t6": torch.full_like(_state()["t6"], 7.0, device="cuda")}
    with pytest.raises(ChecksumError):
        ckpt.load(target, path)
    # Staged on the host and copied only once verified: the device tensor never changed.
    assert bool((target["t6"] == 7.0).all())


def test_data_files_refuse_a_wrong_size(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    with open(_data_file(path), "ab") as file:
        file.write(b"more")
    state = _blank()
    with pytest.raises(CheckpointDataError, match="data file has the wrong size"):
        ckpt.load(state, path)
    assert bool((state["t0"] == 7.0).all())  # refused before anything is read


def test_staged_jobs_of_every_itemsize_share_one_round_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Non-contiguous destinations are staged; the jobs of a round are cut from one host
    # buffer at 64-byte boundaries, whatever their dtypes' sizes (odd byte counts included).
    generator = torch.Generator().manual_seed(3)
    values = {
        "f64": torch.randn(7, 5, dtype=torch.float64, generator=generator),
        "u8": torch.randint(0, 255, (3, 11), dtype=torch.uint8, generator=generator),
        "c64": torch.randn(5, 3, dtype=torch.complex64, generator=generator),
        "b": torch.rand(9, 4, generator=generator) > 0.5,
        "f8": torch.randn(6, 6, generator=generator).to(torch.float8_e4m3fn),
        "i16": torch.randint(-99, 99, (13, 2), dtype=torch.int16, generator=generator),
    }
    ckpt.save(values, tmp_path / "c")
    state = {key: torch.zeros(v.shape[::-1], dtype=v.dtype).t() for key, v in values.items()}
    assert not any(t.is_contiguous() for t in state.values())
    rounds: list[int] = []
    stage = _fill._stage

    def spy(group: list[Any]) -> list[Any]:
        staged = stage(group)
        rounds.append(len({s.staging.untyped_storage().data_ptr() for s in staged}))
        return staged

    monkeypatch.setattr(_fill, "_stage", spy)
    ckpt.load(state, tmp_path / "c")
    assert rounds == [1]  # one round, one buffer for all six jobs
    for key, value in values.items():
        assert torch.equal(state[key].contiguous().view(torch.uint8), value.view(torch.uint8)), key
