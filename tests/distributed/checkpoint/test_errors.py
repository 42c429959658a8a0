"""Checkpoint failures on 4 real ranks: each is a ``CheckpointError`` subclass (or the SPEC'd
``TypeError``/``ValueError`` on save) naming the key, file and rank where they apply, raised on
EVERY rank (none hangs), and — when found before any data is copied — with the state dict left
untouched on every rank."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import seal
from tests.harness import distributed

WORLD = 4
ROWS = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(WORLD)])
COLS = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(WORLD)])
FULL = torch.arange(48, dtype=torch.float32).reshape(8, 6)


def _save(path: Path) -> ckpt.Metadata:
    """w: 8x6 row-sharded (rank r writes rows 2r, 2r+1), b: replicated, o: bytes, step: JSON."""
    state = {
        "w": sw.shard_tensor(FULL, ROWS),
        "b": torch.tensor([1.0, 2.0, 3.0]),
        "o": b"blob",
        "step": 7,
    }
    return ckpt.save(state, path)


def _target(spec: sw.ChunkShardingSpec = ROWS) -> dict[str, Any]:
    return {
        "w": sw.full(spec, (8, 6), -1.0),
        "b": torch.full((3,), -1.0),
        "o": "untouched",
        "step": -1,
    }


def _assert_untouched(state: dict[str, Any]) -> None:
    for shard in state["w"].local_shards():
        assert torch.all(shard.tensor == -1), "w was modified"
    assert torch.all(state["b"] == -1), "b was modified"
    assert state["o"] == "untouched" and state["step"] == -1


def _file_of(metadata: ckpt.Metadata, fqn: str, offsets: list[int] | None) -> dict[str, Any]:
    index = ckpt.MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))
    return metadata.storage_data[index]


def _on_rank0_then_barrier(action: Any) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


@distributed(world_size=WORLD, timeout=40)
def test_missing_and_incomplete_checkpoints(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    state = _target()
    with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
        ckpt.load(state, nowhere)
    assert str(caught.value) == (
        f"no checkpoint at {nowhere} (file '{nowhere / 'shardwise.json'}'"
        + (")" if dist.get_rank() == 0 else ", rank 0)")
    )
    _assert_untouched(state)

    # A directory without the index: a save that never committed.
    path = tmp_path / "c"
    _save(path)
    _on_rank0_then_barrier(lambda: os.remove(path / "shardwise.json"))
    with pytest.raises(
        ckpt.CheckpointNotFoundError,
        match=re.escape(
            f"{path} is not a complete shardwise checkpoint: its index shardwise.json is "
            "missing, so the save that wrote it did not commit"
        ),
    ):
        ckpt.load(state, path)
    _assert_untouched(state)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="is not a complete shardwise"):
        ckpt.read_metadata(path)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="is not a complete shardwise"):
        ckpt.load_tensor(path, "w")


@distributed(world_size=WORLD, timeout=40)
def test_unknown_format_version(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(path)

    def bump() -> None:
        index = json.loads((path / "shardwise.json").read_text())
        del index["index_checksum"]
        index["format_version"] = 6
        (path / "shardwise.json").write_bytes(seal(index))

    _on_rank0_then_barrier(bump)
    message = (
        "unsupported checkpoint format version 6; this shardwise reads version 4 and version 5 "
        "(incremental checkpoints) (a newer shardwise may read it) "
        f"(file '{path / 'shardwise.json'}')"
    )
    state = _target()
    with pytest.raises(ckpt.CheckpointFormatError, match=re.escape(message)):
        ckpt.load(state, path)
    _assert_untouched(state)
    with pytest.raises(ckpt.CheckpointFormatError, match=re.escape(message)):
        ckpt.read_metadata(path)
    with pytest.raises(ckpt.CheckpointFormatError, match=re.escape(message)):
        ckpt.load_tensor(path, "w")


@distributed(world_size=WORLD, timeout=40)
def test_missing_key_strict_and_lenient(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(path)
    rank = dist.get_rank()
    message = "missing from the checkpoint (pass strict=False to skip missing keys) (key 'extra'"

    # Missing everywhere: each rank finds it.
    state = {**_target(), "extra": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointKeyError, match=re.escape(message + ")")):
        ckpt.load(state, path)
    _assert_untouched(state)

    # Only rank 2 asks for it: every rank still raises the same error, naming rank 2.
    state = _target()
    if rank == 2:
        state["extra"] = torch.zeros(2)
    with pytest.raises(ckpt.CheckpointKeyError) as caught:
        ckpt.load(state, path)
    assert caught.value.key == "extra"
    assert str(caught.value) == message + (")" if rank == 2 else ", rank 2)")
    _assert_untouched(state)

    # strict=False skips it, loads the rest, says so in a warning and in its result.
    state = {**_target(COLS), "extra": torch.zeros(2)}
    with pytest.warns(UserWarning, match=r"1 key missing from the checkpoint \('extra'\)"):
        result = ckpt.load(state, path, strict=False)
    assert result.missing_keys == ["extra"] and result.unexpected_keys == []
    assert torch.equal(state["extra"], torch.zeros(2))
    (shard,) = state["w"].local_shards()
    assert torch.equal(shard.tensor, FULL[:, 2 * rank : 2 * rank + 2])
    assert torch.equal(state["b"], torch.tensor([1.0, 2.0, 3.0]))
    assert state["o"] == b"blob" and state["step"] == 7


@distributed(world_size=WORLD, timeout=40)
def test_size_and_dtype_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(path)
    state = _target()
    state["w"] = sw.full(COLS, (8, 5), -1.0)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape(
            "size mismatch: the checkpoint has size [8, 6], the state dict expects [8, 5] (key 'w')"
        ),
    ):
        ckpt.load(state, path)
    _assert_untouched(state)

    state = _target()
    state["w"] = sw.full(ROWS, (8, 6), -1.0, dtype=torch.float64)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape(
            "dtype mismatch: the checkpoint has torch.float32, the state dict expects "
            "torch.float64; pass allow_dtype_cast=True to cast it on load (key 'w')"
        ),
    ):
        ckpt.load(state, path)
    _assert_untouched(state)
    # The opt-in casts on load, in any layout (here float32 rows into bfloat16 columns).
    state["w"] = sw.full(COLS, (8, 6), -1.0, dtype=torch.bfloat16)
    ckpt.load(state, path, allow_dtype_cast=True)
    (shard,) = state["w"].local_shards()
    rank = dist.get_rank()
    assert shard.tensor.dtype == torch.bfloat16
    assert torch.equal(shard.tensor, FULL[:, 2 * rank : 2 * rank + 2].to(torch.bfloat16))
    # Only floating-point dtypes are cast.
    state = _target()
    state["b"] = torch.full((3,), -1, dtype=torch.int64)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape("(only floating-point dtypes are cast on load) (key 'b'"),
    ):
        ckpt.load(state, path, allow_dtype_cast=True)
    assert torch.all(state["b"] == -1)

    # A mismatch on one rank only (a plain tensor of the wrong size on rank 3).
    state = _target()
    if dist.get_rank() == 3:
        state["b"] = torch.full((4,), -1.0)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape(
            "size mismatch: the checkpoint has size [3], the state dict expects [4] (key 'b'"
        ),
    ) as caught:
        ckpt.load(state, path)
    assert caught.value.rank == (None if dist.get_rank() == 3 else 3)
    _assert_untouched(state)

    # A tensor where the checkpoint has an object, and the other way round.
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape("the state dict holds a tensor, the checkpoint an object (key 'o')"),
    ):
        ckpt.load({"o": torch.zeros(1)}, path)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape("the state dict holds an object, the checkpoint a tensor (key 'b')"),
    ):
        ckpt.load({"b": None}, path)


@distributed(world_size=WORLD, timeout=40)
def test_checksum_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "c"
    metadata = _save(path)
    info = _file_of(metadata, "w", [2, 0])  # rows 2-3: rank 1 reads them in full
    data_file = path / info["file"]

    def corrupt() -> None:
        raw = bytearray(data_file.read_bytes())
        raw[info["begin"] + 4] ^= 0x01  # the low mantissa bit of w[2, 1]
        data_file.write_bytes(bytes(raw))

    _on_rank0_then_barrier(corrupt)
    state = _target()
    with pytest.raises(ckpt.ChecksumError) as caught:
        ckpt.load(state, path)
    error = caught.value
    # Rank 1's file is one 1 MiB block holding its rows of w, then b (which every rank
    # reads): every rank finds the damaged block, each naming the first entry it read there.
    rank = dist.get_rank()
    key = "w" if rank == 1 else "b"
    assert (error.key, error.file, error.rank) == (key, str(data_file), rank)
    size = data_file.stat().st_size
    assert str(error).startswith(
        f"checksum mismatch for a chunk of this tensor in block 0 of the file (bytes "
        f"{info['blocks_begin']}-{size}), which also holds bytes of other entries (the changed "
        f"bytes may be theirs): expected {info['checksums'][0]}, got "
    )
    assert str(error).endswith(
        "the tensors this load was filling are undefined (partly filled) and no Python value "
        f"of the state dict was replaced: load another checkpoint (key '{key}', file "
        f"'{data_file}', rank {rank})"
    )
    assert isinstance(error, ckpt.CheckpointDataError)
    # Tensors are undefined after a mismatch; no Python value was replaced on any rank.
    assert state["o"] == "untouched" and state["step"] == -1

    # verify=False skips the check: the flipped bit comes through.
    state = _target()
    ckpt.load(state, path, verify=False)
    (shard,) = state["w"].local_shards()
    expected = FULL[2 * dist.get_rank() : 2 * dist.get_rank() + 2].clone()
    if dist.get_rank() == 1:
        expected.view(torch.int32)[0, 1] ^= 1
        assert not torch.equal(shard.tensor, FULL[2:4])
    assert torch.equal(shard.tensor, expected)
    # load_tensor verifies too.
    with pytest.raises(ckpt.ChecksumError, match=re.escape("checksum mismatch for a chunk")):
        ckpt.load_tensor(path, "w", offsets=[2, 0], sizes=[2, 6])


@distributed(world_size=WORLD, timeout=40)
def test_truncated_and_missing_data_files(tmp_path: Path) -> None:
    path = tmp_path / "c"
    metadata = _save(path)
    info = _file_of(metadata, "w", [6, 0])  # rank 3's rows
    data_file = path / info["file"]
    size = data_file.stat().st_size
    dist.barrier()  # everyone has its size before rank 0 cuts it
    _on_rank0_then_barrier(lambda: os.truncate(data_file, size - 3))
    state = _target(COLS)  # every rank needs a piece of rows 6-7
    with pytest.raises(
        ckpt.CheckpointDataError,
        match=re.escape(
            f"data file is truncated: it has {size - 3} bytes, the index says {size} "
            f"(key 'w', file '{data_file}', rank "
        ),
    ):
        ckpt.load(state, path)
    _assert_untouched(state)

    _on_rank0_then_barrier(lambda: os.remove(data_file))
    with pytest.raises(
        ckpt.CheckpointDataError,
        match=re.escape(f"data file is missing (key 'w', file '{data_file}', rank "),
    ) as caught:
        ckpt.load(state, path)
    assert not isinstance(caught.value, ckpt.ChecksumError)
    _assert_untouched(state)

    # The objects' file too: the coordinator (rank 0) wrote the blob.
    blob_file = path / _file_of(metadata, "o", None)["file"]
    assert blob_file != data_file
    _on_rank0_then_barrier(lambda: os.remove(blob_file))
    state = {"o": "untouched", "step": -1}
    with pytest.raises(
        ckpt.CheckpointDataError,
        match=re.escape(f"data file is missing (key 'o', file '{blob_file}', rank "),
    ):
        ckpt.load(state, path)
    assert state == {"o": "untouched", "step": -1}


@distributed(world_size=WORLD, timeout=40)
def test_pickled_entries_need_allow_pickle(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with pytest.raises(
        TypeError,
        match=re.escape(
            "cannot save state_dict['opt.state'] of type frozenset: shardwise stores tensors"
        ),
    ):
        ckpt.save({"w": torch.ones(2), "opt": {"state": frozenset({1})}}, path)
    assert not (path / "shardwise.json").exists()

    ckpt.save({"w": torch.ones(2), "opt": {"state": frozenset({1})}}, path, allow_pickle=True)
    state = {"w": torch.zeros(2), "opt": {"state": None}}
    with pytest.raises(
        ckpt.PickleNotAllowedError,
        match=re.escape("this entry was pickled; pass allow_pickle=True to load it"),
    ):
        ckpt.load(state, path)
    assert torch.equal(state["w"], torch.zeros(2)) and state["opt"]["state"] is None
    ckpt.load(state, path, allow_pickle=True)
    assert state["opt"]["state"] == frozenset({1}) and torch.equal(state["w"], torch.ones(2))


@distributed(world_size=WORLD, timeout=40)
def test_save_refuses_bad_values_on_every_rank(tmp_path: Path) -> None:
    rank = dist.get_rank()
    # An unstorable value on rank 2 only: every rank raises the same TypeError.
    state: dict[str, Any] = {"w": torch.ones(2), "x": object() if rank == 2 else 1}
    with pytest.raises(
        TypeError, match=re.escape("cannot save state_dict['x'] of type object: shardwise")
    ):
        ckpt.save(state, tmp_path / "a")

    mesh = init_device_mesh("cpu", (WORLD,))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    with pytest.raises(
        ValueError,
        match=re.escape("cannot checkpoint 'p': its DTensor has a Partial placement; reduce it"),
    ):
        ckpt.save({"p": partial}, tmp_path / "b")
    # Nor is one loaded into: every rank refuses it before anything is copied.
    ckpt.save({"p": torch.ones(3), "w": torch.ones(2)}, tmp_path / "saved")
    target = {"p": partial, "w": torch.zeros(2)}
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=re.escape("cannot load into it: its DTensor has a Partial placement; reduce it"),
    ):
        ckpt.load(target, tmp_path / "saved")
    assert torch.equal(target["w"], torch.zeros(2))

    # Ranks disagreeing about a tensor's size.
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannot save 'v': rank 0 has dtype float32 and size [2], rank 1 has dtype float32 "
            "and size [3]"
        ),
    ):
        ckpt.save({"v": torch.ones(2 if rank == 0 else 3)}, tmp_path / "c")

    with pytest.raises(
        ValueError,
        match=re.escape("coordinator_rank=4 is not a rank of the process group (world size 4)"),
    ):
        ckpt.save({"w": torch.ones(1)}, tmp_path / "d", coordinator_rank=4)
    assert not any((tmp_path / name / "shardwise.json").exists() for name in "abcd")
