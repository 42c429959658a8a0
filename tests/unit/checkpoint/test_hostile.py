"""Hand-made attacks on checkpoints from strangers (issue "Checkpoints from strangers").

Each class of attack on ``docs/format.md``'s contract has several variants: index entries that
name files outside the checkpoint, links and special files inside it, a save into a directory
laid out to make it write or delete elsewhere, every bit flip and truncation of an index, byte
ranges and sizes that cannot be right, and damaged data files. For every one, every reader
(``read_metadata``, ``load``, ``load_tensor``, ``shardwise inspect`` and ``verify``) either
returns exactly the saved values or raises a CheckpointError subclass (the CLI: exit 3 for an
unreadable index, 1 for damaged data, one line on stderr, no traceback), leaves the target
state dict unchanged (after a checksum mismatch found while reading: replaces no Python value,
its tensors being undefined), and opens nothing outside the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import BLOCK_SIZE, seal
from shardwise.local_shards import LocalShardsWrapper
from tests import _hostile as h

pytestmark = pytest.mark.timeout(120)

SIZES = {"sharded": (64, 48)}
STATE = h.mixed_state(rows=SIZES["sharded"][0])
ORIGINAL = h.expected_values(STATE, SIZES)

Edit = Callable[[dict[str, Any]], object]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    ckpt.save(STATE, path)
    return path


@pytest.fixture
def victim(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the mixed checkpoint, to attack."""
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    return path


def _data_file(path: Path) -> Path:
    (data,) = h.data_files(path)
    return data


def _loads_exactly(path: Path, verify_code: int = 0) -> None:
    """Every reader gives the saved values (a control for the attacks); ``shardwise verify``
    exits with ``verify_code``."""
    target = h.blank_like(STATE)
    with h.confined_opens(path):
        ckpt.load(target, path)
        weight = ckpt.load_tensor(path, "model.weight", offsets=[3, 4], sizes=[5, 6])
        verify = h.run_cli("verify", str(path))
    h.assert_same_values(h.loaded_values(target, SIZES), ORIGINAL)
    assert h.same_tensor(weight, ORIGINAL["model.weight"][3:8, 4:10])
    assert verify.code == verify_code, verify


def assert_index_refused(
    path: Path, kind: type[ckpt.CheckpointError] = ckpt.CheckpointFormatError, match: str = ""
) -> None:
    """Every reader refuses the index of ``path`` with ``kind``, before any data file is
    opened; the CLI exits 3 with one line."""
    target = h.blank_like(STATE)
    before = h.snapshot(target)
    with h.confined_opens(path) as opened:
        errors = [
            h.expect_error(lambda: ckpt.read_metadata(path), kind),
            h.expect_error(lambda: ckpt.load(target, path), kind),
            h.expect_error(lambda: ckpt.load_tensor(path, "model.weight"), kind),
        ]
        results = [h.run_cli(command, str(path)) for command in ("inspect", "verify")]
    h.assert_unchanged(target, before)
    for err in errors:
        assert re.search(match, str(err)), err
    data = os.path.realpath(path / "data") + os.sep
    assert not [name for name in opened if name.startswith(data)], "data opened"
    for result in results:
        h.check_cli(result)
        assert result.code == 3, result


def assert_data_refused(
    path: Path,
    kind: type[ckpt.CheckpointError] = ckpt.CheckpointDataError,
    match: str = "",
    fqn: str = "sharded",
) -> None:
    """The index of ``path`` is valid, the data behind it is not: ``load`` and
    ``load_tensor(fqn)`` raise ``kind`` and change nothing; ``shardwise verify`` exits 1."""
    target = h.blank_like(STATE)
    before = h.snapshot(target)
    with h.confined_opens(path):
        ckpt.read_metadata(path)  # the index alone is fine
        errors = [
            h.expect_error(lambda: ckpt.load(target, path), kind),
            h.expect_error(lambda: ckpt.load_tensor(path, fqn, offsets=[1, 2], sizes=[3, 4]), kind),
        ]
        inspect = h.run_cli("inspect", str(path))
        verify = h.run_cli("verify", str(path))
    h.assert_unchanged(target, before)
    for err in errors:
        assert re.search(match, str(err)), err
    h.check_cli(inspect)
    h.check_cli(verify)
    assert verify.code == 1, verify


def _tensor_row(document: dict[str, Any], fqn: str) -> list[Any]:
    return next(row for row in document["tensors"] if row[0] == fqn)


def _object_row(document: dict[str, Any], fqn: str) -> list[Any]:
    return next(row for row in document["objects"] if row[0] == fqn)


def _edit(path: Path, edit: Edit) -> None:
    document = h.read_document(path)
    edit(document)
    h.write_resealed(path, document)


def test_the_controls_load_exactly(victim: Path) -> None:
    _loads_exactly(victim)
    assert ckpt.read_metadata(victim).version == "4"
    h.reblock(victim, 4096)
    _loads_exactly(victim)


# -- 1. names of files outside ------------------------------------------------------------


def _outside_names(path: Path, save_id: str) -> dict[str, str]:
    base = f"rank-00000.{save_id}.safetensors"
    return {
        "parent": "../secret.bin",
        "parent-of-data": f"data/../../{base}",
        "absolute": str(path.parent / "elsewhere" / base),
        "dotdot-inside": f"data/../{base}",
        "dotdot-back": f"data/../data/{base}",
        "dot": f"./data/{base}",
        "other-dir": f"other/{base}",
        "nested": f"data/sub/{base}",
        "double-slash": f"data//{base}",
        "backslash": f"data\\{base}",
        "no-dir": base,
        "short-rank": f"data/rank-0000.{save_id}.safetensors",
        "long-rank": f"data/rank-0000000000.{save_id}.safetensors",
        "upper-hex": f"data/rank-00000.{save_id.upper()}.safetensors",
        "short-id": f"data/rank-00000.{save_id[:15]}.safetensors",
        "other-extension": f"data/rank-00000.{save_id}.bin",
        "temporary": f"data/{base}.tmp",
        "trailing-newline": f"data/{base}\n",
        "trailing-nul": f"data/{base}\x00",
        "arabic-digits": f"data/rank-\u0660\u0660\u0660\u0660\u0660.{save_id}.safetensors",
        "empty": "",
    }


NAME_KINDS = list(_outside_names(Path("/ckpt"), "0" * 16))


def _name(path: Path, kind: str) -> str:
    return _outside_names(path, h.read_document(path)["save"]["save_id"])[kind]


def _plant(path: Path, name: str) -> None:
    """A valid copy of the data file where ``name`` points, so that only the reader's
    refusal keeps it from being read."""
    where = Path(name) if os.path.isabs(name) else path / name
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        if not where.exists():
            shutil.copyfile(_data_file(path), where)
    except (OSError, ValueError):  # a name no file can have (NUL, a directory...)
        pass


@pytest.mark.parametrize("kind", NAME_KINDS)
def test_a_sealed_index_naming_a_file_outside_is_refused(victim: Path, kind: str) -> None:
    name = _name(victim, kind)
    _plant(victim, name)

    def edit(document: dict[str, Any]) -> None:
        document["files"][0][0] = name

    _edit(victim, edit)
    assert_index_refused(victim, match="is not a data file name")


@pytest.mark.parametrize("kind", ["parent", "absolute", "other-dir", "upper-hex"])
def test_an_unsealed_edit_of_a_file_name_is_corruption(victim: Path, kind: str) -> None:
    name = _name(victim, kind)
    _plant(victim, name)
    data = h.index_bytes(victim)
    original = h.read_document(victim)["files"][0][0]
    h.write_index(victim, data.replace(json.dumps(original).encode(), json.dumps(name).encode()))
    assert_index_refused(victim, match="the checkpoint index is corrupt")


def test_an_unused_file_entry_is_validated_too(victim: Path) -> None:
    _plant(victim, "../secret.bin")

    def edit(document: dict[str, Any]) -> None:
        document["files"].append(["../secret.bin", 38759, 960, "0" * 16])

    _edit(victim, edit)
    assert_index_refused(victim, match="is not a data file name")


def test_a_valid_name_of_a_file_that_is_not_there_is_missing_data(victim: Path) -> None:
    _data_file(victim).unlink()
    assert_data_refused(victim, match="data file is missing")


# -- 2. links and special files inside the checkpoint --------------------------------------


def test_data_directory_link_to_valid_files_is_not_followed(victim: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(victim / "data", elsewhere)  # the real, valid data files
    (victim / "data").symlink_to(elsewhere, target_is_directory=True)
    assert_data_refused(victim, match="not a real directory|not a regular file")


def test_relative_data_directory_link_is_not_followed(victim: Path) -> None:
    shutil.move(victim / "data", victim / "real")  # inside the checkpoint, even
    (victim / "data").symlink_to("real", target_is_directory=True)
    assert_data_refused(victim, match="not a real directory|not a regular file")


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_data_file_link_is_not_followed(victim: Path, tmp_path: Path, where: str) -> None:
    data = _data_file(victim)
    target = tmp_path / "secret.bin" if where == "outside" else victim / "data" / "x.bin"
    shutil.move(data, target)
    data.symlink_to(target)
    assert_data_refused(victim, match="not a regular file")


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_index_link_is_not_followed(victim: Path, tmp_path: Path, where: str) -> None:
    index = victim / h.INDEX
    target = tmp_path / "index.json" if where == "outside" else victim / "real.json"
    shutil.move(index, target)
    index.symlink_to(target)
    assert_index_refused(victim, match="not a regular file")


def test_dangling_links_are_refused(victim: Path, tmp_path: Path) -> None:
    index = victim / h.INDEX
    shutil.move(index, tmp_path / "index.json")
    index.symlink_to(tmp_path / "gone.json")
    assert_index_refused(victim, match="not a regular file")


@pytest.mark.timeout(20)
def test_a_fifo_data_file_does_not_block(victim: Path) -> None:
    data = _data_file(victim)
    data.unlink()
    os.mkfifo(data)
    started = time.monotonic()
    assert_data_refused(victim, match="not a regular file")
    assert time.monotonic() - started < 10


@pytest.mark.timeout(20)
def test_a_fifo_index_does_not_block(victim: Path) -> None:
    index = victim / h.INDEX
    index.unlink()
    os.mkfifo(index)
    assert_index_refused(victim, match="not a regular file")


@pytest.mark.timeout(20)
def test_a_socket_data_file_is_refused(victim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data_file(victim)
    data.unlink()
    monkeypatch.chdir(data.parent)  # a socket's path is short: bind a relative one
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(data.name)
        server.listen()
        assert_data_refused(victim, match="not a regular file")


def test_a_directory_in_place_of_a_data_file_is_refused(victim: Path) -> None:
    data = _data_file(victim)
    data.unlink()
    data.mkdir()
    (data / "payload").write_bytes(b"x" * 100)
    assert_data_refused(victim, match="not a regular file")


def test_a_directory_in_place_of_the_index_is_refused(victim: Path) -> None:
    index = victim / h.INDEX
    index.unlink()
    index.mkdir()
    assert_index_refused(victim, match="not a regular file")


def test_a_file_in_place_of_the_data_directory_is_refused(victim: Path) -> None:
    shutil.rmtree(victim / "data")
    (victim / "data").write_bytes(b"not a directory")
    assert_data_refused(victim, match="not a real directory|not a regular file")


def test_a_missing_index_is_no_checkpoint(victim: Path) -> None:
    (victim / h.INDEX).unlink()
    assert_index_refused(victim, ckpt.CheckpointNotFoundError, "not a complete")
    shutil.rmtree(victim / "data")
    assert_index_refused(victim, ckpt.CheckpointNotFoundError, "no checkpoint at")


def test_the_checkpoint_directory_itself_may_be_a_link(victim: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(victim, target_is_directory=True)
    _loads_exactly(link)


# -- 3. save never deletes or writes outside ----------------------------------------------


def _tree(path: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry below ``path``: links as their target, files as their bytes."""
    tree: dict[str, tuple[str, bytes | str]] = {}
    for entry in sorted(path.rglob("*")):
        relative = str(entry.relative_to(path))
        if entry.is_symlink():
            tree[relative] = ("link", os.readlink(entry))
        elif entry.is_dir():
            tree[relative] = ("dir", "")
        else:
            tree[relative] = ("file", entry.read_bytes())
    return tree


def _bystanders(directory: Path, save_id: str) -> None:
    """Files a save must leave alone, with names close to the writer's."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-00003.{save_id}.safetensors").write_bytes(b"matches the pattern")
    (directory / "notes.txt").write_bytes(b"notes")
    (directory / "rank-00000.safetensors.bak").write_bytes(b"backup")
    (directory / "sub").mkdir()
    (directory / "sub" / f"rank-00000.{save_id}.safetensors").write_bytes(b"nested")


@pytest.mark.parametrize("previous", ["checkpoint", "empty"])
def test_save_refuses_a_data_link_and_touches_nothing_behind_it(
    victim: Path, tmp_path: Path, previous: str
) -> None:
    elsewhere = tmp_path / "elsewhere"
    _bystanders(elsewhere, "0123456789abcdef")
    if previous == "empty":
        shutil.rmtree(victim)
        victim.mkdir()
    else:
        shutil.rmtree(victim / "data")
    (victim / "data").symlink_to(elsewhere, target_is_directory=True)
    before, index_before = _tree(elsewhere), _tree(victim)
    with h.confined_opens(victim):
        err = h.expect_error(lambda: ckpt.save(STATE, victim), ckpt.CheckpointDataError)
    assert "not a real directory" in str(err) and str(victim / "data") in str(err)
    assert _tree(elsewhere) == before
    assert _tree(victim) == index_before  # not even a temporary file


def test_save_refuses_a_file_in_place_of_the_data_directory(victim: Path) -> None:
    shutil.rmtree(victim / "data")
    (victim / "data").write_bytes(b"precious")
    before = _tree(victim)
    with h.confined_opens(victim):
        h.expect_error(lambda: ckpt.save(STATE, victim), ckpt.CheckpointDataError)
    assert _tree(victim) == before


def test_save_removes_only_the_writers_files(victim: Path) -> None:
    save_id = h.read_document(victim)["save"]["save_id"]
    old = _data_file(victim)
    # Temporary files of killed saves are removed (the save lock guarantees that no other
    # save is writing them); nothing else that is not the writer's is.
    killed = {
        f"data/{old.name}.tmp": b"temporary data file of a crashed save",
        "data/rank-00000.fedcba9876543210.safetensors.tmp": b"another one",
        f"shardwise.json.{save_id}.tmp": b"temporary index",
    }
    leftovers = {
        "data/notes.txt": b"notes",
        "data/rank-00000.safetensors.bak": b"backup",
        f"data/RANK-00000.{save_id}.safetensors": b"not the pattern",
        f"data/rank-00000.{save_id.upper()}.safetensors": b"not the pattern",
        f"data/sub/rank-00000.{save_id}.safetensors": b"in a subdirectory",
        # A directory with the writer's name: never removed (it is not a data file).
        f"data/rank-00009.{save_id}.safetensors/payload": b"in a directory named like a file",
        "README": b"next to the index",
    }
    for name, contents in {**killed, **leftovers}.items():
        (victim / name).parent.mkdir(parents=True, exist_ok=True)
        (victim / name).write_bytes(contents)
    for _ in range(2):
        with h.confined_opens(victim):
            ckpt.save(STATE, victim)
    for name, contents in leftovers.items():
        assert (victim / name).read_bytes() == contents, name
    assert not any((victim / name).exists() for name in killed)
    assert not old.exists()  # the file the replaced index named is cleaned up
    _loads_exactly(victim)


def test_save_removes_a_stale_link_not_its_target(victim: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    link = victim / "data" / "rank-00007.0123456789abcdef.safetensors"
    link.symlink_to(target)
    with h.confined_opens(victim):
        ckpt.save(STATE, victim)
    assert not link.is_symlink() and target.read_bytes() == b"precious"


def test_save_replaces_an_index_link_without_writing_through_it(
    victim: Path, tmp_path: Path
) -> None:
    target = tmp_path / "precious.json"
    target.write_bytes(b"precious")
    (victim / h.INDEX).unlink()
    (victim / h.INDEX).symlink_to(target)
    with h.confined_opens(victim):
        ckpt.save(STATE, victim)
    assert target.read_bytes() == b"precious"
    assert not (victim / h.INDEX).is_symlink()
    _loads_exactly(victim)


@pytest.mark.parametrize("which", ["data", "index"])
def test_save_never_writes_through_a_planted_temporary_link(
    victim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    save_module = __import__("shardwise.checkpoint.saving.save", fromlist=["secrets"])
    monkeypatch.setattr(save_module.secrets, "token_hex", lambda n: "00000000000000aa")
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    if which == "data":
        planted = victim / "data" / "rank-00000.00000000000000aa.safetensors.tmp"
    else:
        planted = victim / "shardwise.json.00000000000000aa.tmp"
    planted.symlink_to(target)
    before = _tree(victim)
    with h.confined_opens(victim), pytest.raises(OSError):
        ckpt.save(STATE, victim)
    assert target.read_bytes() == b"precious"
    if which == "data":
        assert _tree(victim) == before
    _loads_exactly(victim)  # the previous checkpoint stands


# -- 4. index corruption ------------------------------------------------------------------

SMALL: dict[str, Any] = {
    "w": torch.arange(6, dtype=torch.float32).view(2, 3),
    "s": torch.tensor(1.5),
    "step": 3,
}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small") / "ckpt"
    ckpt.save(SMALL, path)
    return path


def _small_target() -> dict[str, Any]:
    return {"w": torch.zeros(2, 3), "s": torch.tensor(0.0), "step": None}


def _refuses_every(path: Path, indexes: Iterator[bytes]) -> int:
    """Write each index in turn: read_metadata and load must both refuse it as malformed,
    with the target unchanged. Returns how many were tried."""
    count = 0
    target = _small_target()
    before = h.snapshot(target)
    with h.confined_opens(path):
        for data in indexes:
            (path / h.INDEX).write_bytes(data)
            for call in (lambda: ckpt.read_metadata(path), lambda: ckpt.load(target, path)):
                err = h.failure(call)
                assert isinstance(err, ckpt.CheckpointFormatError), (data, err)
            count += 1
    h.assert_unchanged(target, before)
    return count


@pytest.mark.timeout(300)
def test_every_single_bit_flip_of_the_index_is_detected(small: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(small, path)
    original = h.index_bytes(path)

    def flips() -> Iterator[bytes]:
        for position in range(len(original)):
            for bit in range(8):
                damaged = bytearray(original)
                damaged[position] ^= 1 << bit
                yield bytes(damaged)

    assert _refuses_every(path, flips()) == 8 * len(original) > 4000
    h.write_index(path, original)
    target = _small_target()
    ckpt.load(target, path)  # the control
    assert torch.equal(target["w"], SMALL["w"]) and target["step"] == 3


def test_every_truncation_of_the_index_is_detected(small: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(small, path)
    original = h.index_bytes(path)
    assert _refuses_every(path, (original[:length] for length in range(len(original)))) > 400


@pytest.mark.parametrize(
    "data",
    [b"", b"[" * 100000, b"{" * 100000, b"null", b"[]", b"{}", b'"x"', b"\xff" * 64],
    ids=["empty", "100000-brackets", "100000-braces", "null", "list", "object", "str", "ff"],
)
def test_an_index_that_is_not_an_index_is_refused(victim: Path, data: bytes) -> None:
    h.write_index(victim, data)
    assert_index_refused(victim)


def test_an_index_larger_than_1_gib_is_refused_unread(victim: Path) -> None:
    with open(victim / h.INDEX, "r+b") as index:  # sparse: no disk space used
        index.truncate((1 << 30) + 1)
    assert_index_refused(victim, match="more than a reader accepts")


@pytest.mark.parametrize(
    "suffix", [b"\n", b" ", b"\x00", b"}", b',"x":1}', b"\xef\xbb\xbf"], ids=repr
)
def test_anything_after_the_seal_is_detected(victim: Path, suffix: bytes) -> None:
    h.write_index(victim, h.index_bytes(victim) + suffix)
    assert_index_refused(victim)


def test_the_seal_must_be_last_and_complete(victim: Path) -> None:
    document = h.read_document(victim)
    seal = document.pop("index_checksum")
    h.write_index(victim, json.dumps({"index_checksum": seal, **document}).encode())
    assert_index_refused(victim, match="index_checksum")
    h.write_index(victim, json.dumps(document, separators=(",", ":")).encode())
    assert_index_refused(victim, match="checksum .*is missing")
    h.write_index(victim, h.resealed(document).replace(b'"index_checksum"', b'"index_Checksum"'))
    assert_index_refused(victim)


# -- 5. byte ranges, sizes, numbers, names and JSON ---------------------------------------


def _set(path: list[Any], value: Any) -> Edit:
    """An edit setting the item at ``path`` (keys, positions, or ``(fqn,)`` for the row of
    that key in a list of rows) to ``value`` (or to ``value(old)`` if it is callable)."""

    def edit(document: dict[str, Any]) -> None:
        node = _walk(document, path[:-1])
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return edit


def _walk(node: Any, path: list[Any]) -> Any:
    for step in path:
        node = next(r for r in node if r[0] == step[0]) if isinstance(step, tuple) else node[step]
    return node


def _chunk(fqn: str, number: int, field: int) -> list[Any]:
    """Field ``field`` of chunk ``number`` of a ``chunks`` layout."""
    return ["tensors", (fqn,), 3, 1, number, field]


def _property(field: int, value: Any) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        row = _tensor_row(document, "model.weight")
        properties = list(document["properties"][row[1]])
        properties[field] = value
        document["properties"].append(properties)
        row[1] = len(document["properties"]) - 1

    return edit


def _each(*edits: Edit) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        for one in edits:
            one(document)

    return edit


def _append(path: list[Any], value: Callable[[dict[str, Any]], Any]) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        _walk(document, path).append(value(document))

    return edit


# model.weight is ["whole", file, begin]; sharded is ["chunks", [[offsets, sizes, file, begin],
# ...]]; a blob is [file, begin, nbytes]; a file is [name, size, data start, checksums].
_WEIGHT_FILE = ["tensors", ("model.weight",), 3, 1]
_WEIGHT_BEGIN = ["tensors", ("model.weight",), 3, 2]
_WEIGHT_SIZE = ["tensors", ("model.weight",), 2]
_SCALE_LAYOUT = ["tensors", ("model.scale",), 3]
_SHARDED_1 = _chunk("sharded", 1, 0)[:-1]
_FILE_SUMS = ["files", 0, 3]
_BLOB = ["objects", ("blob",), 2]

EDITS: dict[str, tuple[Edit, str]] = {
    # tilings
    "overlapping-chunks": (_set([*_SHARDED_1, 0], [30, 0]), "do not tile"),
    "gap": (_each(_set([*_SHARDED_1, 0], [32, 0]), _set([*_SHARDED_1, 1], [32, 48])), "tile"),
    "chunk-past-the-end": (_set([*_SHARDED_1, 1], [34, 48]), "tile|overlap"),
    "chunk-outside": (_set([*_SHARDED_1, 0], [64, 0]), "do not tile"),
    "chunk-other-dims": (
        _each(_set([*_SHARDED_1, 0], [31, 0, 0]), _set([*_SHARDED_1, 1], [33, 48, 1])),
        "dims",
    ),
    "no-chunks": (_set(["tensors", ("sharded",), 3, 1], []), "no chunks"),
    "0-d-two-chunks": (
        _set(_SCALE_LAYOUT, ["chunks", [[[], [], 0, 1047], [[], [], 0, 1049]]]),
        "one chunk|overlap",
    ),
    "0-d-no-chunks": (_set(_SCALE_LAYOUT, ["chunks", []]), "no chunks"),
    "0-d-with-offsets": (_set(_SCALE_LAYOUT, ["chunks", [[[0], [1], 0, 1047]]]), "dims"),
    # numbers
    "negative-begin": (_set(_WEIGHT_BEGIN, -1), r"integer in \[0, 2\*\*62\)"),
    "huge-begin": (_set(_WEIGHT_BEGIN, 2**62), r"integer in \[0, 2\*\*62\)"),
    "float-begin": (_set(_WEIGHT_BEGIN, 1051.0), "integer"),
    "bool-begin": (_set(_WEIGHT_BEGIN, True), "integer"),
    "string-begin": (_set(_WEIGHT_BEGIN, "1051"), "integer"),
    "null-begin": (_set(_WEIGHT_BEGIN, None), "integer"),
    "negative-size": (_set(_WEIGHT_SIZE, [-1, 50]), "integers in"),
    "bool-size": (_set(_WEIGHT_SIZE, [40, True]), "integers in"),
    "float-size": (_set(_WEIGHT_SIZE, [40.0, 50]), "integers in"),
    "huge-size": (_set(_WEIGHT_SIZE, [2**62, 50]), "integers in"),
    "size-not-a-list": (_set(_WEIGHT_SIZE, 2000), "list"),
    "negative-offset": (_set([*_SHARDED_1, 0], [-1, 0]), "integers in"),
    "65-dims": (_set(_WEIGHT_SIZE, [1] * 63 + [40, 50]), "at most 64"),
    "file-index-missing": (_set(_WEIGHT_FILE, 1), "file index 1 does not"),
    "file-index-negative": (_set(_WEIGHT_FILE, -1), "does not exist"),
    "file-index-bool": (_set(_WEIGHT_FILE, False), "does not exist"),
    # File 1 is a rank that wrote nothing (null): nothing may lie in it.
    "file-index-null": (
        _each(_append(["files"], lambda d: None), _set(_WEIGHT_FILE, 1)),
        "file index 1 names a rank that wrote no data file",
    ),
    "chunk-in-a-null-file": (
        _each(_append(["files"], lambda d: None), _set(_chunk("sharded", 1, 2), 1)),
        "file index 1 names a rank that wrote no data file",
    ),
    "blob-in-a-null-file": (
        _each(_append(["files"], lambda d: None), _set([*_BLOB, 0], 1)),
        "file index 1 names a rank that wrote no data file",
    ),
    "file-row-false": (_append(["files"], lambda d: False), "a files entry"),
    "property-index-missing": (_set(["tensors", ("model.weight",), 1], 99), "property"),
    "property-index-bool": (_set(["tensors", ("model.weight",), 1], True), "property"),
    "world-size-0": (_set(["save", "world_size"], 0), "world_size"),
    "world-size-bool": (_set(["save", "world_size"], True), "world_size"),
    "world-size-string": (_set(["save", "world_size"], "1"), "world_size"),
    "block-size-small": (_set(["checksum", "block_size"], 4095), "block_size"),
    "block-size-huge": (_set(["checksum", "block_size"], 2**30 + 1), "block_size"),
    "block-size-bool": (_set(["checksum", "block_size"], True), "block_size"),
    "file-size-negative": (_set(["files", 0, 1], -1), "integer"),
    "data-start-in-header": (_set(["files", 0, 2], 7), "outside"),
    "data-start-past-the-end": (_set(["files", 0, 2], 38760), "outside"),
    # byte ranges
    "begin-at-0": (_set(_WEIGHT_BEGIN, 0), "inside the file's header"),
    "begin-at-7": (_set(_WEIGHT_BEGIN, 7), "inside the file's header"),
    "past-the-declared-size": (_set(_WEIGHT_BEGIN, 38759 - 100), "past the declared size"),
    "declared-size-short": (_set(["files", 0, 1], 38758), "past the declared size"),
    "sharing-bytes": (_set(_WEIGHT_BEGIN, 9051), "overlap"),
    "sharing-one-byte": (_set(_WEIGHT_BEGIN, 1051 + 1), "overlap"),
    "blob-sharing-bytes": (_set([*_BLOB, 1], 38747 - 5120 + 6), "overlap"),
    "blob-past-the-end": (_set([*_BLOB, 2], 10**6), "past the declared size"),
    "blob-negative-size": (_set([*_BLOB, 2], -1), "integer"),
    "blob-file-missing": (_set([*_BLOB, 0], 3), "file index 3 does not"),
    # checksums
    "checksums-short": (_set(_FILE_SUMS, lambda s: s[:-1]), "checksums"),
    "checksums-upper": (_set(_FILE_SUMS, lambda s: s.upper()), "checksums"),
    "checksums-not-hex": (_set(_FILE_SUMS, "g" * 16), "checksums"),
    "checksums-twice": (_set(_FILE_SUMS, lambda s: s * 2), "checksums"),
    "checksums-number": (_set(_FILE_SUMS, 0), "checksums of .* must be a string"),
    "checksums-for-other-blocks": (_set(["checksum", "block_size"], 4096), "checksums"),
    "checksums-of-chunks": (_set(["checksum", "scope"], "chunk"), "checksum scope"),
    "chunk-with-checksums": (_append(_SHARDED_1, lambda d: "0" * 16), "a chunk must be"),
    "blob-with-checksums": (_append(_BLOB, lambda d: "0" * 16), "a stored object must be"),
    # names
    "unknown-dtype": (_property(0, "float128"), "unknown tensor properties"),
    "torch-prefixed-dtype": (_property(0, "torch.float32"), "unknown tensor properties"),
    "capitalized-dtype": (_property(0, "Float32"), "unknown tensor properties"),
    "empty-dtype": (_property(0, ""), "unknown tensor properties"),
    "dtype-number": (_property(0, 6), "unknown tensor properties"),
    "quantized-dtype": (_property(0, "qint8"), "quantized"),
    "unknown-layout": (_property(1, "strided2"), "unknown tensor properties"),
    "torch-prefixed-layout": (_property(1, "torch.strided"), "unknown tensor properties"),
    "unknown-memory-format": (_property(3, "channels_first"), "unknown tensor properties"),
    "legacy-memory-format": (_property(3, "legacy_contiguous_format"), "unknown tensor"),
    "requires-grad-string": (_property(2, "false"), "unknown tensor properties"),
    "pin-memory-number": (_property(4, 0), "unknown tensor properties"),
    "properties-short": (_set(["properties", 0], ["float32"]), "properties entry"),
    # structure
    "extra-key": (_set(["extra"], 1), "exactly the keys"),
    "missing-key": (
        lambda d: d.pop(
            "objects",
        ),
        "exactly the keys",
    ),
    "keys-out-of-order": (lambda d: d.update(format=d.pop("format")), "exactly the keys"),
    "version-true": (_set(["format_version"], True), "unsupported checkpoint format version"),
    "version-float": (_set(["format_version"], 2.0), "unsupported checkpoint format version"),
    "version-string": (_set(["format_version"], "2"), "unsupported checkpoint format version"),
    "version-6": (_set(["format_version"], 6), "unsupported checkpoint format version"),
    "version-5-no-digests": (_set(["format_version"], 5), "must have exactly the keys"),
    # The development formats of the unreleased 0.1: unknown versions like any other.
    "version-1": (_set(["format_version"], 1), "unsupported checkpoint format version 1"),
    "version-2": (_set(["format_version"], 2), "unsupported checkpoint format version 2"),
    "version-3": (_set(["format_version"], 3), "unsupported checkpoint format version 3"),
    "other-format": (_set(["format"], "shardwise"), "not a shardwise checkpoint index"),
    "other-algorithm": (_set(["checksum", "algorithm"], "crc32c"), "unsupported checksum"),
    "save-id-upper": (_set(["save", "save_id"], lambda s: s.upper()), "save_id"),
    "save-extra-key": (_set(["save", "extra"], 1), "save facts"),
    "writer-number": (_set(["save", "writer"], 1), "writer must be a string"),
    "duplicate-tensor": (
        _append(["tensors"], lambda d: copy.deepcopy(_tensor_row(d, "model.bias"))),
        "appears twice",
    ),
    "tensor-and-object": (_set(["objects", ("step",), 0], "model.weight"), "appears twice"),
    "duplicate-object": (
        _append(["objects"], lambda d: copy.deepcopy(_object_row(d, "step"))),
        "appears twice",
    ),
    "duplicate-file": (_append(["files"], lambda d: list(d["files"][0])), "listed twice"),
    "unknown-encoding": (_set(["objects", ("blob",), 1], "pickle2"), "unknown object"),
    "json-payload-number": (_set(["objects", ("step",), 2], 7), "must be a string"),
    "object-row-short": (lambda d: _object_row(d, "step").pop(), "objects entry"),
    "key-number": (_set(["tensors", ("model.bias",), 0], 5), "key must be a string"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_sealed_index_that_cannot_be_right_is_refused(victim: Path, case: str) -> None:
    edit, match = EDITS[case]
    _edit(victim, edit)
    assert_index_refused(victim, match=match)


def _raw(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        assert data.count(old) == 1, old
        return data.replace(old, new)

    return edit


RAW_EDITS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "5000-digit-integer": (_raw(b'"world_size":1', b'"world_size":' + b"9" * 5000), "JSON"),
    "4000-digit-integer": (_raw(b'"world_size":1', b'"world_size":' + b"9" * 4000), "2..62"),
    "negative-zero": (_raw(b'"world_size":1', b'"world_size":-0'), "world_size"),
    "exponent": (_raw(b'"world_size":1', b'"world_size":1e0'), "world_size"),
    "nan": (_raw(b'"world_size":1', b'"world_size":NaN'), "not JSON"),
    "infinity": (_raw(b'"world_size":1', b'"world_size":-Infinity'), "not JSON"),
    "deep-nesting": (
        _raw(b'"world_size":1', b'"world_size":' + b"[" * 100000 + b"]" * 100000),
        "nested too deeply",
    ),
    "lone-surrogate-in-a-key": (_raw(b'"model.bias"', b'"model.bias\\ud800"'), "surrogate"),
    "low-surrogate-in-a-key": (_raw(b'"model.bias"', b'"\\uDFFFmodel.bias"'), "surrogate"),
    "surrogate-pair-escape": (_raw(b'"model.bias"', b'"\\ud83d\\ude00"'), "surrogate"),
    "encoded-surrogate": (_raw(b'"model.bias"', b'"model.bias\xed\xa0\x80"'), "not valid JSON"),
    "non-utf8": (_raw(b'"model.bias"', b'"model.bias\xff"'), "not valid JSON"),
    "latin-1": (_raw(b'"model.bias"', b'"model.bi\xe4s"'), "not valid JSON"),
    "overlong-utf8": (_raw(b'"model.bias"', b'"model.bias\xc0\xae"'), "not valid JSON"),
    "byte-order-mark": (lambda data: b"\xef\xbb\xbf" + data, "not valid JSON"),
    "duplicate-top-key": (
        _raw(b'{"format":', b'{"format":"shardwise-checkpoint","format":'),
        "the checkpoint index repeats the key 'format' in one JSON object",
    ),
    "duplicate-save-key": (
        _raw(b'"writer":', b'"writer":"x","writer":'),
        "repeats the key 'writer'",
    ),
    "duplicate-checksum-key": (
        _raw(b'"block_size":', b'"block_size":4096,"block_size":'),
        "repeats the key 'block_size'",
    ),
    "trailing-comma": (_raw(b'"world_size":1', b'"world_size":1,'), "not valid JSON"),
    "comment": (_raw(b'"world_size":1', b'"world_size":1/*x*/'), "not valid JSON"),
}


@pytest.mark.parametrize("case", list(RAW_EDITS))
def test_a_sealed_index_that_is_not_strict_json_is_refused(victim: Path, case: str) -> None:
    edit, match = RAW_EDITS[case]
    h.write_index(victim, h.reseal_bytes(edit(h.index_bytes(victim))))
    assert_index_refused(victim, match=match)


def test_an_escaped_backslash_before_u_is_text_not_a_surrogate(victim: Path) -> None:
    edit = _raw(b'"model.bias"', b'"model.bias\\\\ud800"')
    h.write_index(victim, h.reseal_bytes(edit(h.index_bytes(victim))))
    metadata = ckpt.read_metadata(victim)
    assert "model.bias\\ud800" in metadata.state_dict_metadata  # a backslash, then "ud800"
    target = h.blank_like(STATE)
    before = h.snapshot(target)
    h.expect_error(lambda: ckpt.load(target, victim), ckpt.CheckpointKeyError)
    h.assert_unchanged(target, before)
    assert ckpt.load_tensor(victim, "model.bias\\ud800").dtype == torch.bfloat16


def _object_text(fqn: str, text: str) -> Edit:
    return _set(["objects", (fqn,), 2], text)


STORED_JSON = {
    "nested-65": (json.dumps(json.loads("[" * 65 + "]" * 65)), "deeper than 64"),
    "nested-100000": ("[" * 100000 + "]" * 100000, "nested too deeply"),
    "repeated-key": ('{"a": 1, "a": 2}', "the stored JSON value repeats the key 'a'"),
    "5000-digits": ("9" * 5000, "not valid JSON"),
    "truncated": ("[1, 2", "not valid JSON"),
    "empty": ("", "not valid JSON"),
    "two-values": ("1 2", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(STORED_JSON))
def test_a_stored_json_value_is_decoded_strictly(victim: Path, case: str) -> None:
    text, match = STORED_JSON[case]
    _edit(victim, _object_text("config.name", text))
    target = h.blank_like(STATE)
    before = h.snapshot(target)
    with h.confined_opens(victim):
        ckpt.read_metadata(victim)
        err = h.expect_error(lambda: ckpt.load(target, victim), ckpt.CheckpointFormatError)
        verify = h.run_cli("verify", str(victim))
    assert re.search(match, str(err)) and err.key == "config.name", err
    h.assert_unchanged(target, before)
    h.check_cli(verify)
    assert verify.code == 1, verify


def test_a_stored_json_value_may_be_nested_64_deep(victim: Path) -> None:
    deep: Any = 1
    for _ in range(64):
        deep = [deep]
    _edit(victim, _object_text("config.name", json.dumps(deep)))
    target = h.blank_like(STATE)
    ckpt.load(target, victim)
    assert target["config"]["name"] == deep


def _vm_peak() -> int:
    """The peak virtual memory of this process in bytes (an allocation shows in it even
    before its pages are touched)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmPeak:"))
    return int(line.split()[1]) * 1024


def test_a_huge_declared_size_is_refused_before_any_allocation(victim: Path) -> None:
    end = 38759  # the real size: the huge tensor's bytes would start where the file ends

    def edit(document: dict[str, Any]) -> None:
        row = _tensor_row(document, "model.weight")
        row[2] = [2**40]
        row[3] = ["whole", 0, end]
        file = document["files"][0]
        file[1] = end + 2**42
        document["checksum"]["block_size"] = 2**30  # the largest: 4097 checksums
        file[3] = "0" * 16 * -(-(file[1] - file[2]) // 2**30)

    _edit(victim, edit)
    entry = ckpt.read_metadata(victim).state_dict_metadata["model.weight"]
    assert isinstance(entry, ckpt.TensorStorageMetadata) and entry.size == (2**40,)
    peak, started = _vm_peak(), time.monotonic()
    with h.confined_opens(victim):
        err = h.expect_error(
            lambda: ckpt.load_tensor(victim, "model.weight"), ckpt.CheckpointDataError
        )
        h.expect_error(
            lambda: ckpt.load({"model": {"weight": torch.zeros(1)}}, victim, strict=False),
            ckpt.CheckpointMismatchError,
        )
        verify = h.run_cli("verify", str(victim))
        inspect = h.run_cli("inspect", str(victim))
    assert re.search("truncated|wrong size", str(err)), err
    assert time.monotonic() - started < 10 and _vm_peak() - peak < 1 << 30
    h.check_cli(verify)
    h.check_cli(inspect)
    assert verify.code == 1


def test_a_huge_size_without_bytes_behind_it_is_refused(victim: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        _tensor_row(document, "model.weight")[2] = [2**40]

    _edit(victim, edit)
    peak = _vm_peak()
    assert_index_refused(victim, match="past the declared size|overlap")
    assert _vm_peak() - peak < 1 << 30


@pytest.mark.parametrize("delta", [1, -1, 4096])
def test_a_data_file_of_another_size_than_declared_is_refused(victim: Path, delta: int) -> None:
    _edit(victim, _set(["files", 0, 1], lambda size: size + delta) if delta > 0 else lambda d: None)
    if delta < 0:
        os.truncate(_data_file(victim), _data_file(victim).stat().st_size + delta)
    assert_data_refused(victim, match="wrong size|truncated")


@pytest.mark.parametrize("length", [-1, 0], ids=["truncated", "emptied"])
def test_a_shorter_data_file_is_refused(victim: Path, length: int) -> None:
    data = _data_file(victim)
    os.truncate(data, data.stat().st_size - 1 if length < 0 else 0)
    assert_data_refused(victim, match="wrong size|truncated")


def test_a_longer_data_file_is_refused(victim: Path) -> None:
    with open(_data_file(victim), "ab") as data:
        data.write(b"\x00" * 64)
    assert_data_refused(victim, match="wrong size")


@pytest.mark.parametrize("dims", [[64 * 48], [64, 48, 1], [1, 64, 48]], ids=str)
def test_a_resealed_reshape_does_not_fit_a_sharded_target(victim: Path, dims: list[int]) -> None:
    def edit(document: dict[str, Any]) -> None:  # the same bytes, as another shape
        row = _tensor_row(document, "sharded")
        row[2] = dims
        for chunk, first in zip(row[3][1], (0, 31), strict=True):
            rows = chunk[1][0]
            if len(dims) == 1:
                chunk[:2] = [[first * 48], [rows * 48]]
            elif dims[0] == 1:
                chunk[:2] = [[0, first, 0], [1, rows, 48]]
            else:
                chunk[:2] = [[first, 0, 0], [rows, 48, 1]]

    _edit(victim, edit)
    target = h.blank_like(STATE)  # "sharded" is a LocalShardsWrapper of 2-d shards
    before = h.snapshot(target)
    with h.confined_opens(victim):
        err = h.expect_error(lambda: ckpt.load(target, victim), ckpt.CheckpointMismatchError)
        whole = ckpt.load_tensor(victim, "sharded")
    assert err.key == "sharded" and "do not fit" in str(err)
    h.assert_unchanged(target, before)
    assert h.same_tensor(whole, ORIGINAL["sharded"].reshape(dims))


@pytest.mark.parametrize("dtype", ["int6", "uint3", "int1", "bits8", "float8_e5m2", "bool"])
def test_sub_box_reads_of_every_one_byte_dtype_are_exact(tmp_path: Path, dtype: str) -> None:
    values = torch.arange(48, dtype=torch.uint8).view(6, 8)
    ckpt.save({"w": values}, tmp_path / "ckpt")

    def edit(document: dict[str, Any]) -> None:
        document["properties"][0][0] = dtype

    _edit(tmp_path / "ckpt", edit)
    for offsets, sizes in (([0, 0], [6, 8]), ([1, 2], [3, 4]), ([5, 7], [1, 1])):
        got = ckpt.load_tensor(tmp_path / "ckpt", "w", offsets=offsets, sizes=sizes)
        assert got.dtype == getattr(torch, dtype)
        want = values[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        assert torch.equal(h.bits(got), h.bits(want))
        target = {"w": LocalShardsWrapper([torch.empty(sizes, dtype=got.dtype)], [offsets])}
        ckpt.load(target, tmp_path / "ckpt")
        assert torch.equal(h.bits(target["w"].local_shards()[0]), h.bits(want))


# -- 6. damaged data ----------------------------------------------------------------------

BIG = h.big_state()
BIG_SIZES = {"rows": (768, 1024)}
BIG_VALUES = h.expected_values(BIG, BIG_SIZES)


@pytest.fixture(scope="module")
def big_pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "ckpt"
    ckpt.save(BIG, path)
    return path


@pytest.fixture
def big(big_pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "big"
    shutil.copytree(big_pristine, path)
    return path


@contextlib.contextmanager
def _flipped(path: Path, position: int, bit: int = 0) -> Iterator[None]:
    """Bit ``bit`` of byte ``position`` of file ``path`` flipped, for the block."""
    with open(path, "r+b") as file:
        file.seek(position)
        (byte,) = file.read(1)
        file.seek(position)
        file.write(bytes([byte ^ (1 << bit)]))
    try:
        yield
    finally:
        with open(path, "r+b") as file:
            file.seek(position)
            file.write(bytes([byte]))


def _big_chunks(path: Path) -> tuple[int, int, list[tuple[str, int, int, int, int]]]:
    """The big checkpoint's one data file: where its data section starts, its size, and
    every saved chunk: key, first global row, rows, begin, bytes."""
    document = h.read_document(path)
    (_, size, data_start, _) = document["files"][0]
    found = []
    for fqn, number, tensor_size, layout in document["tensors"]:
        itemsize = getattr(torch, document["properties"][number][0]).itemsize
        if layout[0] == "whole":
            rows = [([0] * len(tensor_size), tensor_size, layout[2])]
        else:
            rows = [(offsets, sizes, begin) for offsets, sizes, _, begin in layout[1]]
        for offsets, sizes, begin in rows:
            found.append((fqn, offsets[0], sizes[0], begin, math.prod(sizes) * itemsize))
    return data_start, size, found


def _data_positions(path: Path) -> Iterator[int]:
    """Bytes to damage in the data section: the first and last byte of every block (counted
    from the data section's start) and one in between (seeded)."""
    rng = __import__("random").Random(7)
    data_start, size, _ = _big_chunks(path)
    for start in range(data_start, size, BLOCK_SIZE):
        stop = min(start + BLOCK_SIZE, size)
        yield from sorted({start, stop - 1, rng.randrange(start, stop)})


def _row_band(fqn: str, first: int, count: int) -> LocalShardsWrapper:
    """A target holding rows [first, first + count) of ``fqn`` only (another shape)."""
    full = BIG_VALUES[fqn]
    return LocalShardsWrapper([torch.zeros_like(full[first : first + count])], [(first, 0)])


@pytest.mark.timeout(300)
def test_a_damaged_block_fails_every_read_that_touches_it(big: Path) -> None:
    positions = list(_data_positions(big))
    assert len(positions) >= 15  # three bytes of each of the six blocks
    for number, position in enumerate(positions):
        with _flipped(_data_file(big), position, bit=number % 8):
            _check_damaged_block(big, position)


def _check_damaged_block(path: Path, position: int) -> None:
    """Byte ``position`` of the data file is damaged: every read touching its block fails
    (naming a key whose bytes the block holds, and the block), with no Python value
    replaced; every other read gives the saved values."""
    data_start, size, chunks = _big_chunks(path)
    block = (position - data_start) // BLOCK_SIZE
    low = data_start + block * BLOCK_SIZE
    high = min(low + BLOCK_SIZE, size)
    # The keys whose bytes the damaged block holds, and the damaged byte's chunk.
    touching = {fqn for fqn, _, _, begin, nbytes in chunks if begin < high and low < begin + nbytes}
    fqn, chunk_row, _, begin, nbytes = next(c for c in chunks if c[3] <= position < c[3] + c[4])
    full = BIG_VALUES[fqn]
    row_bytes = full[0].numel() * full.element_size()
    row = chunk_row + (position - begin) // row_bytes  # the damaged row
    # The rows of this chunk in the damaged block.
    first = chunk_row + max(0, low - begin) // row_bytes
    last = chunk_row + -(-(min(high, begin + nbytes) - begin) // row_bytes)

    def clean(r: int) -> bool:
        """Row ``r`` of ``fqn`` lies in no byte of the damaged block."""
        for key, start_row, rows, start, _ in chunks:
            if key == fqn and start_row <= r < start_row + rows:
                row_begin = start + (r - start_row) * row_bytes
                return row_begin + row_bytes <= low or high <= row_begin
        raise AssertionError(r)

    other_row = next((r for r in range(full.shape[0]) if clean(r)), None)
    with h.confined_opens(path):
        target = h.blank_like(BIG, reshard=False)
        err = h.expect_error(lambda: ckpt.load(target, path), ckpt.ChecksumError)
        assert err.key in touching and f"in block {block} of the file" in str(err), err
        assert err.file == str(_data_file(path)), err
        # A load of the other keys does not touch the damage.
        others = {key: value for key, value in h.blank_like(BIG).items() if key not in touching}
        ckpt.load(others, path)
        loaded = h.loaded_values(others, BIG_SIZES)
        h.assert_same_values(loaded, {key: BIG_VALUES[key] for key in loaded})
        # Any box in the damaged block fails, even one without the damaged byte.
        width = min(5, full.shape[1])
        for offsets, sizes in (([row, 0], [1, width]), ([first, 0], [last - first, width])):
            read = functools.partial(ckpt.load_tensor, path, fqn, offsets=offsets, sizes=sizes)
            h.expect_error(read, ckpt.ChecksumError)
        # So does a resharded load (column shards), and one into a band of rows.
        for layout in (h.blank_like({fqn: BIG[fqn]}), {fqn: _row_band(fqn, row, 1)}):
            h.expect_error(functools.partial(ckpt.load, layout, path), ckpt.ChecksumError)
        if other_row is not None:  # a box and a band elsewhere read the saved values
            got = ckpt.load_tensor(path, fqn, offsets=[other_row, 1], sizes=[1, 3])
            assert h.same_tensor(got, full[other_row : other_row + 1, 1:4])
            band = {fqn: _row_band(fqn, other_row, 1)}
            ckpt.load(band, path)
            assert h.same_tensor(band[fqn].local_shards()[0], full[other_row : other_row + 1])
        verify = h.run_cli("verify", str(path))
    h.check_cli(verify)
    assert verify.code == 1 and any(f"'{key}'" in verify.out for key in touching), verify


def _header_positions(path: Path) -> tuple[list[int], list[int]]:
    """Damageable header bytes of the data file: those verify must notice (the length
    prefix, the entries, the padding) and those of ``__metadata__`` (sampled)."""
    data = _data_file(path).read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    start = data.index(b'"__metadata__":')
    stop = data.index(b"}", start) + 1
    rng = __import__("random").Random(3)
    entries = [p for p in range(8, end) if not start <= p < stop]
    noticed = [*range(8), *rng.sample(entries, 24), end - 1]
    return noticed, rng.sample(range(start, stop), 6)


@pytest.mark.timeout(300)
def test_damaged_safetensors_headers_are_harmless_to_loads(big: Path) -> None:
    data = _data_file(big)
    noticed, metadata = _header_positions(big)
    for number, position in enumerate(noticed + metadata):
        with _flipped(data, position, bit=number % 8), h.confined_opens(big):
            target = h.blank_like(BIG)
            ckpt.load(target, big)  # loads read byte ranges from the index, never the header
            box = ckpt.load_tensor(big, "rows", offsets=[380, 7], sizes=[8, 9])
            verify = h.run_cli("verify", str(big))
        h.assert_same_values(h.loaded_values(target, BIG_SIZES), BIG_VALUES)
        assert h.same_tensor(box, BIG_VALUES["rows"][380:388, 7:16])
        h.check_cli(verify)
        # verify checks that the headers agree with the index (docs/format.md).
        assert verify.code in (0, 1), verify
        if position in noticed:
            assert verify.code == 1, (position, verify)


def test_int_positions_of_a_key_must_mark_int_parts(tmp_path: Path) -> None:
    # A version-2 key's NUL suffix names which dotted parts are ints; a sealed index that
    # marks a part that is not an int, or a position past the key, is refused when read.
    path = tmp_path / "c"
    ckpt.save({"o": {"state": {0: torch.ones(2)}}}, path)
    index = json.loads((path / "shardwise.json").read_bytes())
    del index["index_checksum"]
    (key,) = [row[0] for row in index["tensors"]]
    assert key == "o.state.0\x002"
    for bad in ("o.state.0\x001", "o.state.0\x003", "o.state.0\x002,2", "o.state.0\x00x"):
        index["tensors"][0][0] = bad
        (path / "shardwise.json").write_bytes(seal(index))
        with pytest.raises(ckpt.CheckpointFormatError, match="malformed key"):
            ckpt.read_metadata(path)
        target = {"o": {"state": {}}}
        with pytest.raises(ckpt.CheckpointFormatError, match="malformed key"):
            ckpt.load(target, path)
        assert target == {"o": {"state": {}}}
