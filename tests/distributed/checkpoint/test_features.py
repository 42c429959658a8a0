"""Checkpoint features on real ranks: ``async_save`` (snapshot, errors through the future, one
save at a time, its own process group), dedup and balance of replicated data, valid
safetensors data files, atomic commit over an existing checkpoint, lean reads when resharding,
progress bars on rank 0, and fsspec ``memory://`` URLs (in the pytest process: the memory
file system lives in one process)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import io
import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint.storage._local import _LocalReader
from tests.harness import distributed

# The module, not the function the package exports under the same name.
background = importlib.import_module("shardwise.checkpoint.saving.background")
data_writer = importlib.import_module("shardwise.checkpoint.saving.writer")

WORLD = 4
ROWS = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(WORLD)])
COLS = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(WORLD)])


def _gather(st: sw.ShardedTensor, size: tuple[int, ...]) -> torch.Tensor:
    """The full tensor on every rank (all-gather of the local shards, by metadata)."""
    out = torch.zeros(size, dtype=st.dtype)
    pieces: list[Any] = [None] * dist.get_world_size()
    mine = [(list(s.metadata.shard_offsets), s.tensor) for s in st.local_shards()]
    dist.all_gather_object(pieces, mine)
    for rank_pieces in pieces:
        for offsets, tensor in rank_pieces:
            region = out
            for dim, (o, n) in enumerate(zip(offsets, tensor.shape, strict=True)):
                region = region.narrow(dim, o, n)
            region.copy_(tensor)
    return out


# -- async_save ------------------------------------------------------------------------------


@distributed(world_size=WORLD, timeout=60)
def test_async_save_snapshots_the_state_and_runs_one_at_a_time(tmp_path: Path) -> None:
    rank = dist.get_rank()
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    state = {"w": sw.shard_tensor(full, ROWS), "b": torch.ones(5), "step": 10, "o": b"x"}
    future = ckpt.async_save(state, tmp_path / "a")
    assert isinstance(future, concurrent.futures.Future)
    # The caller may change everything as soon as async_save returns.
    state["w"].local_shards()[0].tensor.add_(1000)
    state["b"].zero_()
    state["step"] = 11
    # Training collectives on the default group go on while the save writes.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == 6.0

    second = ckpt.async_save({"v": torch.full((2,), float(rank == 0))}, tmp_path / "b")
    assert future.done(), "a second async_save first waits for the one in flight"
    metadata = future.result(timeout=60)
    assert metadata == ckpt.read_metadata(tmp_path / "a")
    assert metadata.planner_data["world_size"] == WORLD
    second.result(timeout=60)

    target = {"w": sw.zeros(COLS, 8, 3), "b": torch.zeros(5), "step": 0, "o": None}
    ckpt.load(target, tmp_path / "a")
    assert torch.equal(_gather(target["w"], (8, 3)), full)
    assert torch.equal(target["b"], torch.ones(5))
    assert target["step"] == 10 and target["o"] == b"x"

    # Errors travel through the future, on every rank (a bad value on rank 1 only).
    bad = ckpt.async_save({"x": object() if rank == 1 else 1}, tmp_path / "c")
    with pytest.raises(TypeError, match=re.escape("cannot save state_dict['x'] of type object")):
        bad.result(timeout=60)
    assert not (tmp_path / "c" / "shardwise.json").exists()
    # The writes ran in a writer process of this rank's own, which lives on for the next save.
    writers = list(background._writers.values())
    assert writers and all(w.process.pid != os.getpid() for w in writers)
    assert all(w.process.poll() is None and not w.dead for w in writers)


# -- dedup, balance, safetensors -------------------------------------------------------------


@distributed(world_size=WORLD, timeout=60)
def test_replicated_data_is_written_once_and_balanced(tmp_path: Path) -> None:
    sizes = [50 + (37 * i) % 211 for i in range(40)]
    state = {f"t{i:02d}": torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(sizes)}
    mesh = init_device_mesh("cpu", (2, 2))
    state["dt"] = distribute_tensor(torch.arange(30.0).reshape(6, 5), mesh, [Replicate(), Shard(0)])
    metadata = ckpt.save(state, tmp_path / "c")

    per_file: dict[str, int] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.startswith("t"):
            assert len(entry.chunks) == 1, f"{fqn} is stored once"
        else:
            # Each half of the DTensor is held by two ranks, stored once.
            assert [list(c.offsets) for c in entry.chunks] == [[0, 0], [3, 0]]
        for chunk in entry.chunks:
            info = metadata.storage_data[ckpt.MetadataIndex(fqn, chunk.offsets)]
            per_file[info["file"]] = per_file.get(info["file"], 0) + info["end"] - info["begin"]
    # Every rank wrote a file; each within one tensor of the even share.
    assert len(per_file) == WORLD
    total = sum(per_file.values())
    assert total == 4 * sum(sizes) + 30 * 4
    largest = 4 * max(sizes)
    assert all(abs(nbytes - total / WORLD) <= largest for nbytes in per_file.values()), per_file
    # File sizes: a header, then exactly the entries' bytes (nothing written twice).
    for name, nbytes in per_file.items():
        raw = (tmp_path / "c" / name).read_bytes()
        (header,) = struct.unpack("<Q", raw[:8])
        assert len(raw) == 8 + header + nbytes
    if dist.get_rank() == 0:
        assert sorted(os.listdir(tmp_path / "c" / "data")) == sorted(
            name.split("/")[1] for name in per_file
        )


@distributed(world_size=WORLD, timeout=60)
def test_data_files_are_safetensors_files(tmp_path: Path) -> None:
    full = torch.arange(7 * 6, dtype=torch.float64).reshape(7, 6)
    bf16 = (torch.arange(5 * 4) - 10).reshape(5, 4).to(torch.bfloat16)
    c128 = torch.complex(torch.arange(6.0), -torch.arange(6.0)).to(torch.complex128)
    mesh = init_device_mesh("cpu", (2, 2))
    sources = {"rows": full, "cols": full, "dt": bf16, "c128": c128, "flag": torch.tensor(True)}
    state = {
        "rows": sw.shard_tensor(full, ROWS),
        "cols": sw.shard_tensor(full, COLS),
        "dt": distribute_tensor(bf16, mesh, [Shard(0), Shard(1)]),
        "c128": c128,
        "flag": torch.tensor(True),
        "o": b"bytes!",
    }
    # Rank 3 coordinates: it writes the index and the objects.
    metadata = ckpt.save(state, tmp_path / "c", coordinator_rank=3)
    checked = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn == "o":
            info = metadata.storage_data[ckpt.MetadataIndex("o")]
            assert info["file"].startswith("data/rank-00003.")
            with safe_open(str(tmp_path / "c" / info["file"]), "pt") as handle:
                assert bytes(handle.get_tensor("o@bytes").numpy()) == b"bytes!"
            continue
        for chunk in entry.chunks:
            info = metadata.storage_data[ckpt.MetadataIndex(fqn, chunk.offsets)]
            key = f"{fqn}@{','.join(str(o) for o in chunk.offsets)}"
            with safe_open(str(tmp_path / "c" / info["file"]), "pt") as handle:
                stored = handle.get_tensor(key)
            expected = sources[fqn]
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                expected = expected.narrow(dim, o, n)
            if expected.dtype == torch.complex128:  # no safetensors code: U8 bytes
                assert stored.dtype == torch.uint8
                assert bytes(stored.numpy()) == expected.contiguous().numpy().tobytes()
            else:
                assert stored.dtype == expected.dtype and torch.equal(stored, expected), key
            checked += 1
    # cols: 6 columns over 4 ranks are 2, 2, 2 and an empty shard past the end (no chunk).
    assert checked == 4 + 3 + 4 + 1 + 1


# -- atomic commit ---------------------------------------------------------------------------


@distributed(world_size=WORLD, timeout=60)
def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    rank = dist.get_rank()
    path = tmp_path / "c"
    full_a = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    ckpt.save({"w": sw.shard_tensor(full_a, ROWS), "o": b"A"}, path)
    files_a = set(os.listdir(path / "data"))
    dist.barrier()

    # Save B over it; rank 2 crashes while writing, after the others have written theirs.
    real = data_writer.write_data_file

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise OSError("simulated crash while writing")

    if rank == 2:
        data_writer.write_data_file = crash
    try:
        with pytest.raises(
            ckpt.CheckpointDataError, match="simulated crash while writing"
        ) as caught:
            ckpt.save({"w": sw.shard_tensor(full_a + 100, ROWS), "o": b"B"}, path)
        assert caught.value.rank == 2  # every rank names the rank that failed
    finally:
        data_writer.write_data_file = real
    dist.barrier()
    target = {"w": sw.zeros(COLS, 8, 4), "o": None}
    ckpt.load(target, path)
    assert torch.equal(_gather(target["w"], (8, 4)), full_a) and target["o"] == b"A"
    assert set(os.listdir(path / "data")) >= files_a

    # A completed save replaces A entirely: B loads, and no file of A (or of the crashed
    # attempt) is left.
    metadata = ckpt.save({"w": sw.shard_tensor(full_a + 200, ROWS), "o": b"C"}, path)
    ckpt.load(target, path)
    assert torch.equal(_gather(target["w"], (8, 4)), full_a + 200) and target["o"] == b"C"
    dist.barrier()
    left = set(os.listdir(path / "data"))
    assert not left & files_a
    save_id = metadata.storage_meta.save_id
    assert left and all(f".{save_id}." in name for name in left), left
    assert sorted(os.listdir(path)) == ["data", "shardwise.json"]


# -- lean reads ------------------------------------------------------------------------------


@contextlib.contextmanager
def _count_reads() -> Iterator[list[int]]:
    """Count the bytes this process reads from data files (positioned and scatter reads)."""
    counter = [0]
    originals = (_LocalReader.read_into, _LocalReader.read_vector)

    def counted(method: Any) -> Any:
        def counting(self: _LocalReader, offset: int, buffers: Any) -> int:
            count: int = method(self, offset, buffers)
            if not self.path.endswith("shardwise.json"):
                counter[0] += count
            return count

        return counting

    _LocalReader.read_into = counted(originals[0])  # type: ignore[method-assign]
    _LocalReader.read_vector = counted(originals[1])  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        _LocalReader.read_into, _LocalReader.read_vector = originals  # type: ignore[method-assign]


@distributed(world_size=WORLD, timeout=60)
def test_resharded_load_reads_what_the_rank_needs(tmp_path: Path) -> None:
    # Saved as row blocks of 256 KiB rows (each 1 MiB chunk is one checksummed block, in a
    # file of its own); loaded as column blocks and as 2x2 DTensor blocks. Unverified, each
    # rank's bytes read stay within 5% of what it needs, plus one saved row per chunk it
    # touches. Verified, each rank reads every block it touches once, whole (it checks it
    # and takes its part), and nothing else.
    full = torch.randn(16, 65536, generator=torch.Generator().manual_seed(0))
    ckpt.save({"w": sw.shard_tensor(full, ROWS)}, tmp_path / "c")
    rank = dist.get_rank()
    row_bytes = 65536 * 4
    block = 4 * row_bytes

    def load(target: dict[str, Any], verify: bool) -> int:
        with _count_reads() as counter:
            ckpt.load(target, tmp_path / "c", verify=verify)
        return counter[0]

    def load_verified(target: dict[str, Any], needed: dict[int, int]) -> None:
        """A verified load of ``target``, which needs ``needed[f]`` bytes of block ``f``."""
        read = load(target, verify=True)
        assert read == len(needed) * block, (read, needed)

    cols = {"w": sw.zeros(COLS, 16, 65536)}
    unverified = load(cols, verify=False)
    (shard,) = cols["w"].local_shards()
    assert torch.equal(shard.tensor, full[:, 16384 * rank : 16384 * (rank + 1)])
    needed = 16 * 16384 * 4
    assert needed <= unverified <= 1.05 * needed + 4 * row_bytes, unverified
    shard.tensor.zero_()
    load_verified(cols, {number: block // 4 for number in range(4)})
    assert torch.equal(shard.tensor, full[:, 16384 * rank : 16384 * (rank + 1)])

    mesh = init_device_mesh("cpu", (2, 2))
    blocks = {"w": distribute_tensor(torch.zeros(16, 65536), mesh, [Shard(0), Shard(1)])}
    unverified = load(blocks, verify=False)
    i, j = divmod(rank, 2)
    expected = full[8 * i : 8 * i + 8, 32768 * j : 32768 * (j + 1)]
    assert torch.equal(blocks["w"].to_local(), expected)
    needed = 8 * 32768 * 4
    assert needed <= unverified <= 1.05 * needed + 2 * row_bytes, unverified
    blocks["w"].to_local().zero_()
    load_verified(blocks, {2 * i: block // 2, 2 * i + 1: block // 2})
    assert torch.equal(blocks["w"].to_local(), expected)

    # Row blocks at other boundaries (3 ranks' worth of rows on 4): contiguous, exact.
    uneven = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in (0, 1, 2)])
    rows = {"w": sw.zeros(uneven, 16, 65536)}
    unverified = load(rows, verify=False)
    mine = rows["w"].local_shards()
    assert unverified == sum(s.tensor.numel() * 4 for s in mine)
    for s in mine:
        offset = s.metadata.shard_offsets[0]
        assert torch.equal(s.tensor, full[offset : offset + s.tensor.shape[0]])
    touched: dict[int, int] = {}
    for s in mine:
        first = s.metadata.shard_offsets[0]
        for row in range(first, first + s.tensor.shape[0]):
            touched[row // 4] = touched.get(row // 4, 0) + row_bytes
    load_verified(rows, touched)


# -- progress --------------------------------------------------------------------------------


@distributed(world_size=WORLD, timeout=60)
def test_progress_bar_on_rank_zero_only(tmp_path: Path) -> None:
    state = {"w": sw.shard_tensor(torch.ones(40, 10), ROWS), "b": torch.ones(100)}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ckpt.save(state, tmp_path / "c", progress=True)
    saved = err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ckpt.load(state, tmp_path / "c", progress=True)
    loaded = err.getvalue()
    if dist.get_rank() == 0:
        assert f"saving {tmp_path / 'c'}" in saved and "100%" in saved, saved
        assert f"loading {tmp_path / 'c'}" in loaded and "100%" in loaded, loaded
    else:
        assert saved == "" and loaded == ""


# -- fsspec ----------------------------------------------------------------------------------


def test_memory_urls_in_a_single_process() -> None:
    # The memory file system is per process, so this runs in the pytest process (no group).
    assert not dist.is_initialized()
    fs = fsspec.filesystem("memory")
    url = "memory://shardwise-test/ckpt"
    with contextlib.suppress(FileNotFoundError):
        fs.rm("/shardwise-test", recursive=True)
    full = torch.arange(20, dtype=torch.int64).reshape(4, 5)
    ckpt.save({"w": full, "o": io.BytesIO(b"mem"), "cfg": {"n": 3}}, url)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find("/shardwise-test")) == [
        fs.find("/shardwise-test/ckpt/data")[0].rsplit("/", 1)[-1],
        "shardwise.json",
    ]
    state: dict[str, Any] = {"w": torch.zeros(4, 5, dtype=torch.int64), "o": None, "cfg": {"n": 0}}
    ckpt.load(state, url)
    assert torch.equal(state["w"], full)
    assert state["o"].getvalue() == b"mem" and state["cfg"] == {"n": 3}
    assert torch.equal(ckpt.load_tensor(url, "w", offsets=[1, 2], sizes=[2, 3]), full[1:3, 2:5])
    assert ckpt.read_metadata(url).planner_data["world_size"] == 1
    index = json.loads(fs.cat_file("/shardwise-test/ckpt/shardwise.json"))
    assert index["format"] == "shardwise-checkpoint"

    # Saving again replaces the data file; corrupting it is caught; no index, no checkpoint.
    old = set(fs.find("/shardwise-test/ckpt/data"))
    ckpt.save({"w": full * 2}, url)
    new = set(fs.find("/shardwise-test/ckpt/data"))
    assert len(new) == 1 and not new & old
    (data_file,) = new
    raw = bytearray(fs.cat_file(data_file))
    raw[-1] ^= 0xFF
    fs.pipe_file(data_file, bytes(raw))
    with pytest.raises(
        ckpt.ChecksumError, match=r"checksum mismatch for .* in block 0 of the file"
    ):
        ckpt.load({"w": torch.zeros(4, 5, dtype=torch.int64)}, url)
    fs.rm("/shardwise-test/ckpt/shardwise.json")
    with pytest.raises(
        ckpt.CheckpointNotFoundError,
        match=re.escape(f"{url} is not a complete shardwise checkpoint"),
    ):
        ckpt.load({"w": torch.zeros(4, 5, dtype=torch.int64)}, url)
    fs.rm("/shardwise-test", recursive=True)
