"""Temporary files are created fresh (``docs/format.md``, *Directory layout*, *Commit order*):
a hard link or a symbolic link put at a temporary name, to a file outside the directory, is
never written through by the storage layer, ``save``, ``save_safetensors`` or ``shardwise
consolidate``: the write fails cleanly or removes the name first, and the outside file keeps
every byte."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.storage import LocalStorage, UnsafePathError
from shardwise.cli import main as cli_main
from shardwise.errors import CheckpointDataError, CheckpointStorageError

TOKEN = "0123456789abcdef"
SECRET = b"the outside file: not the checkpoint's to write\n" * 4
Plant = Callable[[Path, Path], None]


def _hard_link(outside: Path, at: Path) -> None:
    os.link(outside, at)


def _symlink(outside: Path, at: Path) -> None:
    at.symlink_to(outside)


PLANTS = pytest.mark.parametrize("plant", [_hard_link, _symlink], ids=["hard link", "symlink"])


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "precious.bin"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


def _intact(outside: Path) -> bool:
    return outside.read_bytes() == SECRET


@pytest.fixture
def fixed_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """The random tokens of ``save`` and ``save_safetensors`` made predictable, as someone who
    could read the directory while a save runs would learn them."""
    # save and save_safetensors draw them from the secrets module, patched for the test.
    monkeypatch.setattr(secrets, "token_hex", lambda n=32: TOKEN[: 2 * n])
    return TOKEN


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(8)}


# -- the storage layer ------------------------------------------------------------------------


@PLANTS
def test_open_write_never_opens_an_entry_already_there(
    tmp_path: Path, outside: Path, plant: Plant
) -> None:
    storage = LocalStorage(tmp_path / "dir")
    storage.makedirs(storage.root)
    at = tmp_path / "dir" / "file.tmp"
    plant(outside, at)
    with pytest.raises(FileExistsError):
        storage.open_write(str(at))
    with pytest.raises(FileExistsError):
        storage.open_parts(str(at), 16)
    assert _intact(outside)
    storage.remove(str(at))  # the name goes, never what it points at
    writer = storage.open_write(str(at))
    writer.write(b"fresh")
    writer.close(sync=False)
    assert at.read_bytes() == b"fresh" and _intact(outside)


@PLANTS
def test_a_part_writer_never_reopens_a_link_put_in_place_of_its_file(
    tmp_path: Path, outside: Path, plant: Plant
) -> None:
    storage = LocalStorage(tmp_path)
    at = tmp_path / "weights.tmp"
    storage.open_parts(str(at), 16).close(sync=False)
    control = storage.open_parts(str(at))  # the file it created: reopened and written
    control.write_at(4, [b"ok"])
    control.close(sync=False)
    assert at.read_bytes() == b"\0" * 4 + b"ok" + b"\0" * 10
    at.unlink()
    plant(outside, at)
    with pytest.raises(UnsafePathError):
        storage.open_parts(str(at))
    assert _intact(outside)


@pytest.mark.timeout(20)
def test_a_part_writer_never_waits_on_a_fifo_put_in_place_of_its_file(tmp_path: Path) -> None:
    at = tmp_path / "weights.tmp"
    os.mkfifo(at)
    with pytest.raises(UnsafePathError):
        LocalStorage(tmp_path).open_parts(str(at))


@PLANTS
def test_a_small_file_written_aside_removes_a_link_at_its_temporary_name(
    tmp_path: Path, outside: Path, plant: Plant
) -> None:
    storage = LocalStorage(tmp_path)
    target = tmp_path / "small.json"
    aside = Path(f"{target}.{os.getpid()}.{threading.get_ident()}.tmp")
    plant(outside, aside)
    storage.replace_small(str(target), b"{}")
    assert target.read_bytes() == b"{}" and target.stat().st_nlink == 1
    assert not os.path.lexists(aside) and _intact(outside)


# -- the writers ------------------------------------------------------------------------------


@PLANTS
@pytest.mark.parametrize("name", [f"data/rank-00000.{TOKEN}.safetensors.tmp", "index"])
def test_save_never_writes_through_a_link_at_a_temporary_name(
    tmp_path: Path, outside: Path, plant: Plant, fixed_token: str, name: str
) -> None:
    path = tmp_path / "ckpt"
    (path / "data").mkdir(parents=True)
    at = path / (f"shardwise.json.{fixed_token}.tmp" if name == "index" else name)
    plant(outside, at)
    with pytest.raises(CheckpointDataError, match="refusing to save") as info:
        ckpt.save(_state(), path)
    assert info.value.file == str(at)
    assert _intact(outside)
    assert not (path / "shardwise.json").exists()
    at.unlink()
    ckpt.save(_state(), path)  # the control: the same save, nothing planted
    loaded = {key: torch.zeros_like(value) for key, value in _state().items()}
    ckpt.load(loaded, path)
    assert all(torch.equal(loaded[key], value) for key, value in _state().items())


@PLANTS
def test_save_safetensors_never_writes_through_a_link_at_a_temporary_name(
    tmp_path: Path, outside: Path, plant: Plant, fixed_token: str
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    at = out / f".model.safetensors.{fixed_token}.tmp"
    plant(outside, at)
    with pytest.raises(CheckpointStorageError, match="cannot create the files in"):
        ckpt.save_safetensors(_state(), out)
    assert _intact(outside)
    assert not (out / "model.safetensors").exists()
    ckpt.save_safetensors(_state(), out)  # the control (the failed save removed the name)
    assert torch.equal(load_file(out / "model.safetensors")["w"], _state()["w"])


@PLANTS
def test_save_safetensors_refuses_a_link_swapped_in_after_the_files_are_created(
    tmp_path: Path, outside: Path, plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are created by rank 0, then reopened by every rank that writes a part: a
    link put in place in between is refused, not written through."""
    reopen = LocalStorage.open_parts

    def swapped(self: LocalStorage, path: str, size: int | None = None) -> object:
        if size is None:
            os.unlink(path)
            plant(outside, Path(path))
        return reopen(self, path, size)

    monkeypatch.setattr(LocalStorage, "open_parts", swapped)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointStorageError, match="cannot write") as info:
        ckpt.save_safetensors(_state(), out)
    assert info.value.file is not None and info.value.file.endswith(".tmp")
    assert _intact(outside)
    assert not (out / "model.safetensors").exists()


@PLANTS
def test_consolidate_removes_a_link_at_its_temporary_name_first(
    tmp_path: Path,
    outside: Path,
    plant: Plant,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt.save(_state(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    plant(outside, out / f".model.safetensors.{os.getpid()}.tmp")
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    capsys.readouterr()
    assert _intact(outside)
    assert (out / "model.safetensors").stat().st_nlink == 1
    assert not (out / "model.safetensors").is_symlink()
    assert torch.equal(load_file(out / "model.safetensors")["w"], _state()["w"])
