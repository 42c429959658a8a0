"""A part's files: written by ``save_parts`` in one process, checked where they lie and
verified as received bytes against their index (a flipped byte, a wrong size, a missing or
extra file, another save's index), mapped for sending and made and mapped for receiving
(names that are no data file refused, a link never followed), linked into a restore
directory; and the directory's restore directories (a link in their place refused, nothing
outside touched)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from shardwise import collectives
from shardwise.checkpoint import load
from shardwise.checkpoint.index import INDEX_NAME, Index, data_file_name, decode_index
from shardwise.checkpoint.local_tier import TierDirectory
from shardwise.checkpoint.local_tier import parts as part_files
from shardwise.checkpoint.local_tier.parts import (
    IncomingDataFile,
    check_stored_part,
    link_part,
    map_data_file,
    read_index,
    verify_pieces,
    write_part,
)
from shardwise.checkpoint.saving.save import save_parts
from shardwise.checkpoint.saving.snapshot import describe_or_error
from shardwise.errors import CheckpointDataError, CheckpointStorageError


def _saved(path: pathlib.Path) -> tuple[str, dict[str, bytes]]:
    path.mkdir()
    state = {"w": torch.arange(40, dtype=torch.float32).reshape(8, 5), "step": 3}
    snapshot, error = describe_or_error(state, False)
    assert error is None
    save_id = save_parts(snapshot, str(path), collectives.Comm(None), sync_files=False)
    return save_id, _files(path, save_id)


def _files(path: pathlib.Path, save_id: str) -> dict[str, bytes]:
    """The part's files in ``path``, by name."""
    names = [INDEX_NAME, data_file_name(0, save_id)]
    return {name: (path / name).read_bytes() for name in names if (path / name).exists()}


def test_a_part_is_a_checkpoint_and_verifies(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    assert sorted(files) == [data_file_name(0, save_id), INDEX_NAME]
    name = data_file_name(0, save_id)
    index = decode_index(files[INDEX_NAME])
    start = index.data_starts[name]  # the data section: blocks from there on
    assert verify_pieces([(start, files[name][start:])], name, index) is None
    # The header is no block: a piece from byte 0 is refused, never hashed against a block.
    assert "outside its data section" in str(verify_pieces([(0, files[name])], name, index))
    state = {"w": torch.zeros(8, 5), "step": 0}
    load(state, tmp_path / "part")
    assert torch.equal(state["w"], torch.arange(40, dtype=torch.float32).reshape(8, 5))
    assert state["step"] == 3


def _big(path: pathlib.Path) -> tuple[str, bytes, Index]:
    """A part of 3 MiB and more (several blocks): its save id, data file and index."""
    path.mkdir()
    state = {"w": torch.arange(800_000, dtype=torch.float32), "step": 3}
    snapshot, error = describe_or_error(state, False)
    assert error is None
    save_id = save_parts(snapshot, str(path), collectives.Comm(None), sync_files=False)
    files = _files(path, save_id)
    return save_id, files[data_file_name(0, save_id)], decode_index(files[INDEX_NAME])


def test_verify_pieces_names_what_is_wrong(tmp_path: pathlib.Path) -> None:
    save_id, data, index = _big(tmp_path / "part")
    name = data_file_name(0, save_id)
    start, block = index.data_starts[name], index.block_size
    assert block is not None and len(data) > start + 2 * block
    second = (start + block, data[start + block : start + 2 * block])
    tail = (start + 2 * block, data[start + 2 * block :])  # the last block ends at the end
    assert verify_pieces([second, tail], name, index) is None
    flipped = bytearray(second[1])
    flipped[7] ^= 1
    assert "checksums" in str(verify_pieces([(second[0], flipped)], name, index))
    assert "not whole blocks" in str(verify_pieces([(second[0] + 1, second[1])], name, index))
    assert "not whole blocks" in str(verify_pieces([(second[0], second[1][:-1])], name, index))
    assert "outside" in str(verify_pieces([(tail[0], tail[1] + b"x")], name, index))
    assert "outside" in str(verify_pieces([(-1, b"x")], name, index))
    assert "outside" in str(verify_pieces([(5, b"")], name, index))
    assert "outside" in str(
        verify_pieces([(start - 1, data[start - 1 : start + block])], name, index)
    )
    assert "names no data file" in str(verify_pieces([second], data_file_name(1, save_id), index))


def test_received_pieces_are_read_from_memory_and_nothing_else(tmp_path: pathlib.Path) -> None:
    save_id, data, index = _big(tmp_path / "part")
    name = data_file_name(0, save_id)
    start, block = index.data_starts[name], index.block_size
    assert block is not None
    pieces = [
        (start, memoryview(data[start : start + block])),
        (start + block, memoryview(data[start + block : start + 2 * block])),
    ]
    root = tmp_path / "restore"
    root.mkdir()
    storage = part_files.ReceivedParts(str(root), index, {name: pieces})
    reader = storage.open_reader(storage.join(name))
    assert reader.size == len(data)
    buffer = memoryview(bytearray(block))
    assert reader.read_into(start + block // 2, buffer) == block  # across the two pieces
    assert bytes(buffer) == data[start + block // 2 : start + block // 2 + block]
    for outside in (0, start + 2 * block):
        with pytest.raises(CheckpointDataError, match="not received"):
            reader.read_into(outside, memoryview(bytearray(16)))
    assert reader.read_into(len(data), buffer) == 0  # at the end: nothing to read


def test_a_stored_part_is_checked_as_it_is_read(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A few blocks per read: a data file of 3 MiB and more is read in several pieces.
    monkeypatch.setattr(part_files, "_CHECK_BLOCKS", 1)
    path = tmp_path / "part"
    path.mkdir()
    state = {"w": torch.arange(800_000, dtype=torch.float32), "step": 3}
    snapshot, error = describe_or_error(state, False)
    assert error is None
    save_id = save_parts(snapshot, str(path), collectives.Comm(None), sync_files=False)
    name = data_file_name(0, save_id)
    data_file = path / name
    good = data_file.read_bytes()
    assert len(good) > 3 << 20
    assert check_stored_part(str(path), 0, save_id, 1) is None
    assert "by 1 ranks, not" in str(check_stored_part(str(path), 0, save_id, 2))
    assert "not 0123456789abcdef" in str(check_stored_part(str(path), 0, "0123456789abcdef", 1))
    for where in (len(good) - 1, len(good) // 2, len(good) - (2 << 20)):
        flipped = bytearray(good)
        flipped[where] ^= 1
        data_file.write_bytes(bytes(flipped))
        assert "checksums" in str(check_stored_part(str(path), 0, save_id, 1)), where
        assert check_stored_part(str(path), 0, save_id, 1, blocks=False) is None
    data_file.write_bytes(good[:-1])
    assert "bytes, not" in str(check_stored_part(str(path), 0, save_id, 1))
    assert "bytes, not" in str(check_stored_part(str(path), 0, save_id, 1, blocks=False))
    data_file.unlink()
    assert "missing" in str(check_stored_part(str(path), 0, save_id, 1))
    assert "not 0123456789abcdef" in str(check_stored_part(str(path), 0, "0123456789abcdef", 1))
    assert "does not decode" in str(_with_index(path, b"{", save_id))
    os.symlink(tmp_path / "elsewhere", data_file)
    (tmp_path / "elsewhere").write_bytes(good)
    with pytest.raises(OSError):
        check_stored_part(str(path), 0, save_id, 1)  # a link is never followed
    data_file.unlink()
    data_file.write_bytes(good)
    assert check_stored_part(str(path), 0, save_id, 1) is None


def _with_index(path: pathlib.Path, index: bytes, save_id: str) -> str | None:
    """check_stored_part of ``path`` with its index replaced by ``index`` (then put back)."""
    good = (path / INDEX_NAME).read_bytes()
    (path / INDEX_NAME).write_bytes(index)
    try:
        return check_stored_part(str(path), 0, save_id, 1)
    finally:
        (path / INDEX_NAME).write_bytes(good)


def test_a_data_file_is_mapped_to_be_sent_and_made_to_be_received(
    tmp_path: pathlib.Path,
) -> None:
    save_id, files = _saved(tmp_path / "part")
    name = data_file_name(0, save_id)
    mapped = map_data_file(str(tmp_path / "part"), 0, save_id)
    assert mapped is not None and bytes(mapped) == files[name]
    assert read_index(str(tmp_path / "part")) == files[INDEX_NAME]
    assert map_data_file(str(tmp_path / "part"), 1, save_id) is None  # no such data file
    copy = tmp_path / "copy"
    copy.mkdir()
    incoming = IncomingDataFile(str(copy), name, len(files[name]))
    incoming.buffer[:] = mapped  # what the transport does, from one mapping into the other
    incoming.close()
    incoming.close()  # twice: nothing to do
    mapped.close()
    assert (copy / name).read_bytes() == files[name]
    with pytest.raises(FileExistsError):  # never over a file that is there
        IncomingDataFile(str(copy), name, 10)
    for hostile in ("../x", INDEX_NAME, "data/../../x", f"data/{os.path.basename(name)}/x"):
        with pytest.raises(ValueError, match="not a part's data file"):
            IncomingDataFile(str(copy), hostile, 10)
    with pytest.raises(ValueError, match="not a part's data file"):
        IncomingDataFile(str(tmp_path / "part"), data_file_name(1, save_id), 0)
    # A link where the data file is: never followed, for sending or for receiving.
    linked = tmp_path / "linked"
    (linked / "data").mkdir(parents=True)
    (linked / INDEX_NAME).write_bytes(files[INDEX_NAME])
    (linked / name).symlink_to(copy / name)
    with pytest.raises(OSError):
        map_data_file(str(linked), 0, save_id)
    with pytest.raises(OSError):
        IncomingDataFile(str(linked), name, 10)
    assert (copy / name).read_bytes() == files[name]


def test_write_and_link_into_a_restore_directory(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    copy = tmp_path / "copy"
    copy.mkdir()
    write_part(str(copy), files)
    assert _files(copy, save_id) == files
    with pytest.raises(FileExistsError):
        write_part(str(copy), files)
    with pytest.raises(ValueError, match="not the files of a part"):
        write_part(str(copy), {"../x": b""})
    target = tmp_path / "target"
    target.mkdir()
    assert link_part(str(copy), str(target), 0, save_id) == files[INDEX_NAME]
    linked = target / data_file_name(0, save_id)
    assert linked.read_bytes() == files[data_file_name(0, save_id)]
    assert os.stat(linked).st_nlink == 2  # no copy


def test_restore_directories(tmp_path: pathlib.Path) -> None:
    tier = TierDirectory(str(tmp_path / "tier"), "job")
    assert tier.claim() is None
    path = pathlib.Path(tier.make_restore(3))
    assert path.name == "restore_3" and not any(path.iterdir())
    (path / "left").write_bytes(b"x")
    assert not any(pathlib.Path(tier.make_restore(3)).iterdir())  # an earlier one removed
    tier.remove_restore(3)
    tier.remove_restore(3)  # none: nothing to do
    assert not path.exists()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    path.symlink_to(outside)
    with pytest.raises(CheckpointStorageError, match="link"):
        tier.make_restore(3)
    assert (outside / "keep").exists()


@pytest.mark.parametrize("spare_bytes", [100, 1 << 20])  # shorter and longer than the file
def test_a_data_file_is_received_into_a_spare(tmp_path: pathlib.Path, spare_bytes: int) -> None:
    save_id, files = _saved(tmp_path / "part")
    name = data_file_name(0, save_id)
    tier = TierDirectory(str(tmp_path / "tier"), "job")
    assert tier.claim() is None
    old = pathlib.Path(tier.make_part(1, 0), "data", os.path.basename(name))
    old.parent.mkdir()
    old.write_bytes(b"\xff" * spare_bytes)
    tier.make_part(2, 0)  # the step before the one written: not recycled
    with old.open("rb") as held:  # its inode stays taken: a new file gets another
        inode = os.fstat(held.fileno()).st_ino
        tier.prune(1, writing=3)

        def take(parent: int, base: str, size: int | None) -> int | None:
            return tier.take_spare(parent, base, rank=0, size=size)

        target = pathlib.Path(tier.make_part(3, 0))
        incoming = IncomingDataFile(str(target), name, len(files[name]), take)
        incoming.buffer[:] = files[name]
        incoming.close()
        received = target / name
        assert received.stat().st_ino == inode
    assert received.read_bytes() == files[name]  # exactly its size, not a byte of the old


def test_a_part_is_written_into_a_spare_and_its_index_is_new(tmp_path: pathlib.Path) -> None:
    tier = TierDirectory(str(tmp_path / "tier"), "job")
    assert tier.claim() is None
    state = {"w": torch.arange(40, dtype=torch.float32), "step": 3}
    snapshot, error = describe_or_error(state, False)
    assert error is None
    first = tier.make_part(1, 0)
    save_id = save_parts(snapshot, first, collectives.Comm(None), sync_files=False)
    old = pathlib.Path(first, data_file_name(0, save_id))
    with old.open("ab") as grown:  # a spare longer than the next part
        grown.write(b"\xff" * 5000)
    tier.make_part(2, 0)  # the step before the one written: not recycled
    with old.open("rb") as held:  # its inode stays taken: a new file gets another
        inode = os.fstat(held.fileno()).st_ino
        tier.prune(1, writing=3)
        second = tier.make_part(3, 0)

        def take(parent: int, base: str, size: int | None) -> int | None:
            return tier.take_spare(parent, base, rank=0, size=size)

        storage = part_files.RecyclingStorage(second, take)
        save_id = save_parts(
            snapshot, second, collectives.Comm(None), sync_files=False, storage=storage
        )
        data = pathlib.Path(second, data_file_name(0, save_id))
        assert data.stat().st_ino == inode
    assert check_stored_part(second, 0, save_id, 1) is None  # its size and every block
    state = {"w": torch.zeros(40), "step": 0}
    load(state, second)
    assert torch.equal(state["w"], torch.arange(40, dtype=torch.float32))
    assert state["step"] == 3
