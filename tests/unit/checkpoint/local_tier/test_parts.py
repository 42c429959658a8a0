"""A part's files: written by ``save_parts`` in one process, read back, packed and unpacked
(hostile messages refused), verified against their index (a flipped byte, a missing or extra
file, another save's index), linked into a restore directory; and the directory's restore
directories (a link in their place refused, nothing outside touched)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from shardwise import collectives
from shardwise.checkpoint import load
from shardwise.checkpoint.index import INDEX_NAME, data_file_name
from shardwise.checkpoint.local_tier import TierDirectory
from shardwise.checkpoint.local_tier import parts as part_files
from shardwise.checkpoint.local_tier.parts import (
    check_stored_part,
    link_part,
    pack_part,
    read_packed_part,
    read_part,
    unpack_part,
    verify_part,
    write_part,
)
from shardwise.checkpoint.saving.save import save_parts
from shardwise.checkpoint.saving.snapshot import describe_or_error
from shardwise.errors import CheckpointError, CheckpointStorageError


def _saved(path: pathlib.Path) -> tuple[str, dict[str, bytes]]:
    path.mkdir()
    state = {"w": torch.arange(40, dtype=torch.float32).reshape(8, 5), "step": 3}
    snapshot, error = describe_or_error(state, False)
    assert error is None
    save_id = save_parts(snapshot, str(path), collectives.Comm(None), sync_files=False)
    return save_id, read_part(str(path), 0, save_id)


def test_a_part_is_a_checkpoint_and_verifies(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    assert sorted(files) == [data_file_name(0, save_id), INDEX_NAME]
    assert verify_part(files, 0, save_id, 1) is None
    state = {"w": torch.zeros(8, 5), "step": 0}
    load(state, tmp_path / "part")
    assert torch.equal(state["w"], torch.arange(40, dtype=torch.float32).reshape(8, 5))
    assert state["step"] == 3


def test_verify_names_what_is_wrong(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    name = data_file_name(0, save_id)
    flipped = bytearray(files[name])
    flipped[-1] ^= 1
    assert "checksums" in str(verify_part({**files, name: bytes(flipped)}, 0, save_id, 1))
    assert "bytes, not" in str(verify_part({**files, name: files[name][:-1]}, 0, save_id, 1))
    assert "missing" in str(verify_part({INDEX_NAME: files[INDEX_NAME]}, 0, save_id, 1))
    other = "0123456789abcdef"
    index_only = {INDEX_NAME: files[INDEX_NAME]}
    assert f"not {other}" in str(verify_part(index_only, 0, other, 1))
    assert "holds" in str(verify_part(files, 0, other, 1))  # another save's data file
    assert "by 1 ranks, not" in str(verify_part(files, 0, save_id, 2))
    assert "does not decode" in str(verify_part({**files, INDEX_NAME: b"{"}, 0, save_id, 1))
    assert "holds" in str(verify_part({**files, "data/x": b""}, 0, save_id, 1))


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
        assert verify_part(read_part(str(path), 0, save_id), 0, save_id, 1) is not None
    data_file.write_bytes(good[:-1])
    assert "bytes, not" in str(check_stored_part(str(path), 0, save_id, 1))
    data_file.unlink()
    assert "missing" in str(check_stored_part(str(path), 0, save_id, 1))
    os.symlink(tmp_path / "elsewhere", data_file)
    (tmp_path / "elsewhere").write_bytes(good)
    with pytest.raises(OSError):
        check_stored_part(str(path), 0, save_id, 1)  # a link is never followed
    data_file.unlink()
    data_file.write_bytes(good)
    assert check_stored_part(str(path), 0, save_id, 1) is None


def test_pack_round_trips_and_refuses_hostile_messages(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    packed = pack_part(files)
    assert read_packed_part(str(tmp_path / "part"), 0, save_id) == packed  # read in one go
    assert unpack_part(packed) == files
    assert unpack_part(bytearray(packed)) == files
    assert unpack_part(pack_part({INDEX_NAME: b"{}"})) == {INDEX_NAME: b"{}"}
    for hostile in (
        b"",
        packed[:-1],
        packed + b"x",
        (1 << 40).to_bytes(8, "little") + packed[8:],
        pack_part({INDEX_NAME: b"", "../../etc/passwd": b"x"}),
        pack_part({data_file_name(0, save_id): b"x"}),
        (7).to_bytes(8, "little") + b"[[1, 2]]",
    ):
        with pytest.raises(CheckpointError):
            unpack_part(hostile)


def test_write_and_link_into_a_restore_directory(tmp_path: pathlib.Path) -> None:
    save_id, files = _saved(tmp_path / "part")
    copy = tmp_path / "copy"
    copy.mkdir()
    write_part(str(copy), files)
    assert read_part(str(copy), 0, save_id) == files
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
