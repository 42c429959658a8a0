"""Hostile input to the Hugging Face code, one attack per test (issue 27's review): an index
that repeats a key or is not a regular file; headers that the safetensors library refuses
(lone surrogates, ``-0``, empty shapes with overflowing dims); names ``safetensors`` reserves
or cannot hold; arguments at their edges (``max_shard_size``, ``prefix``, ``key_map``); float8
casts the docs rule out; tied keys both in the files; and saves (``save_safetensors`` and
``shardwise consolidate``) stopped or blocked midway. Every failure is a ``CheckpointError``
subclass (bad files) or a ``TypeError``/``ValueError`` (bad arguments), leaves the target as
it was, and no load or save of old and new files as one model is possible.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.huggingface import files as files_module
from shardwise.checkpoint.huggingface import load as hf_load
from shardwise.checkpoint.huggingface.files import (
    OutTensor,
    check_unique_names,
    normalized_prefix,
    parse_index_json,
)
from shardwise.checkpoint.huggingface.keys import Names
from shardwise.checkpoint.storage import LocalStorage
from shardwise.cli import main as cli_main


def test_an_index_naming_a_key_twice_is_refused(tmp_path: Path) -> None:
    # JSON parsers keep either of two values of one key: which file holds "w" is ambiguous.
    data = b'{"weight_map": {"w": "b.safetensors", "w": "a.safetensors"}}'
    with pytest.raises(ckpt.CheckpointFormatError, match="repeats the key 'w'"):
        parse_index_json(data, "index.json")
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.full((2,), 2.0)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_bytes(data)
    target = {"w": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointFormatError, match="repeats the key"):
        ckpt.load_safetensors(target, tmp_path)
    assert not target["w"].any()
    nested = b'{"metadata": {"total_size": 1, "total_size": 2}, "weight_map": {}}'
    with pytest.raises(ckpt.CheckpointFormatError, match="repeats the key 'total_size'"):
        parse_index_json(nested, "index.json")
    assert parse_index_json(json.dumps({"weight_map": {"w": "a.safetensors"}}).encode(), "i") == {
        "w": "a.safetensors"
    }


@pytest.mark.parametrize("how", ["key", "key_map"])
def test_a_tensor_named_like_the_header_metadata_is_refused(tmp_path: Path, how: str) -> None:
    # "__metadata__" is the header's metadata: a tensor of that name makes a file no reader
    # (safetensors included) accepts.
    if how == "key":
        state, key_map = {"__metadata__": torch.ones(2), "w": torch.ones(1)}, None
    else:
        state, key_map = {"w": torch.ones(1)}, lambda key: "__metadata__"
    with pytest.raises(ckpt.CheckpointKeyError, match=r"'__metadata__'.*reserves"):
        ckpt.save_safetensors(state, tmp_path / "out", key_map=key_map)
    assert not (tmp_path / "out").exists()


def test_consolidate_refuses_a_tensor_named_like_the_header_metadata() -> None:
    tensors = [OutTensor("__metadata__", "m.__metadata__", torch.float32, (2,), 8)]
    with pytest.raises(ckpt.CheckpointKeyError, match="reserves"):
        check_unique_names(tensors, "the checkpoint")


@pytest.mark.parametrize(
    ("size", "error"),
    [(0, ValueError), (-1, ValueError), ("5XB", ValueError), ("0GB", ValueError),
     ("-1GB", ValueError), (1.5, TypeError), (True, TypeError), (b"5GB", TypeError)],
)  # fmt: skip
def test_a_max_shard_size_that_is_not_a_positive_byte_count_is_refused(
    tmp_path: Path, size: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="max_shard_size"):
        ckpt.save_safetensors({"w": torch.ones(2)}, tmp_path / "out", max_shard_size=size)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
    # One byte is a valid limit: every tensor in a file of its own.
    written = ckpt.save_safetensors(
        {"a": torch.ones(2), "b": torch.ones(1)}, tmp_path / "one", max_shard_size=1
    )
    assert written[:2] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    ("size", "files"), [("5GB", 1), ("8B", 2), ("1KB", 1), ("1 KiB", 1), ("0.008kb", 2), (8, 2)]
)
def test_a_max_shard_size_may_be_a_size_with_a_unit_as_transformers_takes_it(
    tmp_path: Path, size: int | str, files: int
) -> None:
    # As save_pretrained(max_shard_size="5GB"): decimal units are powers of 1000.
    state = {"a": torch.ones(2), "b": torch.ones(2)}  # 8 bytes each
    written = ckpt.save_safetensors(state, tmp_path / "out", max_shard_size=size)
    assert len([name for name in written if name.endswith(".safetensors")]) == files


def test_an_empty_prefix_selects_every_key_as_it_is(tmp_path: Path) -> None:
    # Was: "" became ".", under which no key is, so a load filled nothing without a word.
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    target = {"w": torch.zeros(2)}
    assert ckpt.load_safetensors(target, tmp_path, prefix="") == ([], [])
    assert target["w"].tolist() == [1.0, 1.0]
    assert normalized_prefix("") == "" and normalized_prefix("model") == "model."
    ckpt.save_safetensors({"a.b": torch.ones(1)}, tmp_path / "out", prefix="")
    assert list(load_file(str(tmp_path / "out" / "model.safetensors"))) == ["a.b"]


def test_a_weight_file_at_the_root_of_the_file_system_is_not_looked_for_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: "/model.safetensors" read ./model.safetensors, another file of the same name.
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    assert hf_load._split("/model.safetensors") == ("/", "model.safetensors")
    assert hf_load._split("model.safetensors") == (".", "model.safetensors")
    assert hf_load._split("/a/b/m.safetensors") == ("/a/b", "m.safetensors")
    if not Path("/model.safetensors").exists():
        target = {"w": torch.zeros(2)}
        with pytest.raises(ckpt.CheckpointNotFoundError, match=r"'/model\.safetensors'"):
            ckpt.load_safetensors(target, "/model.safetensors")
        assert not target["w"].any()


@pytest.mark.parametrize(
    ("stored", "target"),
    [(torch.float8_e4m3fn, torch.float32), (torch.float8_e5m2, torch.bfloat16),
     (torch.float32, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2)],
)  # fmt: skip
def test_float8_data_is_never_cast_on_load(
    tmp_path: Path, stored: torch.dtype, target: torch.dtype
) -> None:
    # docs/huggingface.md, Dtypes: float8 is never converted (its scales live elsewhere).
    save_file({"w": torch.ones(2, 3).to(stored)}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(2, 3, dtype=target)}
    with pytest.raises(ckpt.CheckpointMismatchError, match="float8") as caught:
        ckpt.load_safetensors(state, tmp_path, allow_dtype_cast=True)
    assert caught.value.key == "w" and not state["w"].float().any()
    same = {"w": torch.zeros(2, 3, dtype=stored)}
    assert ckpt.load_safetensors(same, tmp_path) == ([], [])
    assert same["w"].float().eq(1).all()


def _failing_rename(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Renames in local storage fail after the first ``after`` (a save killed midway)."""
    calls: list[str] = []
    rename = LocalStorage.rename

    def failing(self: LocalStorage, source: str, target: str) -> None:
        calls.append(target)
        if len(calls) > after:
            raise OSError(errno.EIO, "killed", target)
        rename(self, source, target)

    monkeypatch.setattr(LocalStorage, "rename", failing)


@pytest.mark.parametrize("before", ["split", "single"])
def test_a_save_stopped_midway_never_leaves_old_and_new_files_that_load_as_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str
) -> None:
    out = tmp_path / "out"
    old = {"a": torch.ones(4), "b": torch.ones(4)}
    ckpt.save_safetensors(old, out, max_shard_size=16 if before == "split" else 100)
    new = {"a": torch.full((4,), 2.0), "b": torch.full((4,), 2.0)}
    _failing_rename(monkeypatch, after=1)  # the first new file in place, then stopped
    with pytest.raises(ckpt.CheckpointStorageError, match="killed"):
        ckpt.save_safetensors(new, out, max_shard_size=16)
    monkeypatch.undo()
    # Was: the old index (or the old model.safetensors) with a new file: a model of old and
    # new tensors, loaded without a word.
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_safetensors(target, out)
    assert not any(name.endswith(".tmp") for name in os.listdir(out))
    # The next save puts it right.
    ckpt.save_safetensors(new, out, max_shard_size=16)
    assert ckpt.load_safetensors(target, out) == ([], [])
    assert target["a"].eq(2).all() and target["b"].eq(2).all()


def test_a_save_removes_what_a_killed_save_left_under_temporary_names(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    left = [".model.safetensors.0123456789abcdef.tmp", ".model-00001-of-00002.safetensors.1234.tmp"]
    for name in left:
        (out / name).write_bytes(b"partial")
    (out / "notes.tmp").write_text("not ours")
    (out / ".model.safetensors.fedcba9876543210.tmp").mkdir()  # not a file: left, no failure
    ckpt.save_safetensors({"w": torch.ones(2)}, out)
    assert sorted(os.listdir(out)) == [
        ".model.safetensors.fedcba9876543210.tmp",
        "model.safetensors",
        "notes.tmp",
    ]


def test_an_output_name_taken_by_a_directory_fails_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    ckpt.save_safetensors({"w": torch.ones(2)}, out)
    before = (out / "model.safetensors").read_bytes()
    (out / "model-00003-of-00003.safetensors").mkdir()  # an earlier save's name: removed
    with pytest.raises(ckpt.CheckpointStorageError, match="is a directory"):
        ckpt.save_safetensors({"w": torch.full((2,), 2.0)}, out)
    assert sorted(os.listdir(out)) == ["model-00003-of-00003.safetensors", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == before


def test_consolidate_stopped_midway_never_leaves_old_and_new_files_that_load_as_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same commit as save_safetensors (see above), by shardwise consolidate.
    source = tmp_path / "ckpt"
    ckpt.save({"a": torch.full((4,), 2.0), "b": torch.full((4,), 2.0)}, source)
    out = tmp_path / "hf"
    ckpt.save_safetensors({"a": torch.ones(4), "b": torch.ones(4)}, out, max_shard_size=16)
    (out / ".model.safetensors.99999999.tmp").write_bytes(b"left by a killed run")
    argv = ["consolidate", str(source), str(out), "--max-shard-size", "16"]
    _failing_rename(monkeypatch, after=1)
    assert cli_main(argv) != 0
    monkeypatch.undo()
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_safetensors(target, out)
    (out / "model-00009-of-00009.safetensors").mkdir()  # refused before a file is written
    assert cli_main(argv) != 0
    assert "is a directory" in capsys.readouterr().err
    (out / "model-00009-of-00009.safetensors").rmdir()
    assert cli_main(argv) == 0
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert ckpt.load_safetensors(target, out) == ([], [])
    assert target["a"].eq(2).all() and target["b"].eq(2).all()


def test_a_key_map_returning_a_name_that_is_not_unicode_text_is_a_key_error(
    tmp_path: Path,
) -> None:
    # A lone surrogate: no file can hold the name (it has no UTF-8). Was: a bare TypeError
    # from the JSON encoder in the save plan.
    def key_map(key: str) -> str:
        return "\udcff"

    with pytest.raises(ckpt.CheckpointKeyError, match="not Unicode text") as caught:
        ckpt.save_safetensors({"a": torch.ones(2)}, tmp_path / "out", key_map=key_map)
    assert caught.value.key == "a" and not (tmp_path / "out").exists()
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ckpt.CheckpointKeyError, match="not Unicode text"):
        ckpt.load_safetensors({"a": torch.zeros(2)}, tmp_path, key_map=key_map)


def _raw_header(text: bytes, data: int = 0) -> bytes:
    return struct.pack("<Q", len(text)) + text + bytes(data)


_F32 = b'"dtype": "F32", "shape": '
_REFUSED_BY_SAFETENSORS = {
    # Shapes of no elements whose other dims overflow: no tensor (torch's or safetensors')
    # has them.
    "shape_overflow_first": (
        b'{"w": {' + _F32 + b'[0, 2305843009213693952, 4], "data_offsets": [0, 0]}}',
        0,
    ),
    "shape_overflow_last": (
        b'{"w": {' + _F32 + b'[2305843009213693952, 8, 0], "data_offsets": [0, 0]}}',
        0,
    ),
    # -0 is a float to other JSON readers.
    "negative_zero_dim": (b'{"w": {' + _F32 + b'[-0, 2], "data_offsets": [0, 0]}}', 0),
    "negative_zero_offset": (b'{"w": {' + _F32 + b'[2], "data_offsets": [-0, 8]}}', 8),
    # A lone surrogate: a name, or metadata, that is not Unicode text.
    "surrogate_name": (b'{"w\\ud800": {' + _F32 + b'[2], "data_offsets": [0, 8]}}', 8),
    "surrogate_metadata": (
        b'{"__metadata__": {"k": "\\udc00"}, "w": {' + _F32 + b'[2], "data_offsets": [0, 8]}}',
        8,
    ),
}


@pytest.mark.parametrize("case", sorted(_REFUSED_BY_SAFETENSORS))
def test_a_header_the_safetensors_library_refuses_is_refused(tmp_path: Path, case: str) -> None:
    text, data = _REFUSED_BY_SAFETENSORS[case]
    raw = _raw_header(text, data)
    with pytest.raises(Exception):  # noqa: B017 (the reference: any refusal)
        safetensors.torch.load(raw)
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(ckpt.CheckpointFormatError, match="not a valid safetensors file"):
        ckpt.load_safetensors({}, tmp_path, strict=False)
    # Their well-formed twins load (a -0 elsewhere, in a string, is text).
    fine = text.replace(b"2305843009213693952", b"3").replace(b"-0", b"0")
    fine = fine.replace(b"w\\ud800", b"w").replace(b"\\u", b"u")
    fine = fine.replace(b'"k": "u', b'"k": "-0 u')
    (tmp_path / "model.safetensors").write_bytes(_raw_header(fine, data))
    safetensors.torch.load(_raw_header(fine, data))
    with pytest.warns(UserWarning, match="not loaded"):
        assert ckpt.load_safetensors({}, tmp_path, strict=False).unexpected_keys == ["w"]


@pytest.mark.parametrize("kind", ["link", "directory", "fifo"])
def test_an_index_that_is_not_a_regular_file_is_a_data_error_and_is_not_followed(
    tmp_path: Path, kind: str
) -> None:
    # As a weight file that is not a regular file (docs: CheckpointDataError); was a
    # CheckpointFormatError, as if its (unread) text were malformed.
    outside = tmp_path / "outside.json"
    outside.write_text('{"weight_map": {"w": "a.safetensors"}}')
    path = tmp_path / "hf"
    path.mkdir()
    save_file({"w": torch.ones(2)}, str(path / "a.safetensors"))
    index = path / "model.safetensors.index.json"
    if kind == "link":
        index.symlink_to(outside)
    elif kind == "directory":
        index.mkdir()
    else:
        os.mkfifo(index)
    target = {"w": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointDataError, match="not a regular file"):
        ckpt.load_safetensors(target, path)
    assert not target["w"].any()


@pytest.mark.parametrize(
    ("options", "says"),
    [({"prefix": 3}, "prefix must be a str"), ({"prefix": b"model"}, "prefix must be a str"),
     ({"key_map": {"w": "v"}}, r"key_map must be a function.*\.get")],
)  # fmt: skip
def test_a_prefix_or_key_map_of_the_wrong_type_is_a_type_error(
    tmp_path: Path, options: dict[str, object], says: str
) -> None:
    # Was: an AttributeError from deep in the key names, or a dict "raising" for every key.
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    target = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match=says):
        ckpt.load_safetensors(target, tmp_path, **options)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=says):
        ckpt.save_safetensors(target, tmp_path / "out", **options)  # type: ignore[arg-type]
    assert not target["w"].any() and not (tmp_path / "out").exists()


def test_a_linked_weight_file_is_refused_with_a_way_out(tmp_path: Path) -> None:
    # A Hugging Face cache snapshot links every file to a blob outside its directory: refused
    # (no link is followed), saying how to get the files themselves.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file({"w": torch.ones(2)}, str(blobs / "0123abcd"))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "0123abcd")
    target = {"w": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointDataError, match=r"symbolic link.*local_dir") as caught:
        ckpt.load_safetensors(target, snapshot)
    assert caught.value.file == str(snapshot / "model.safetensors") and not target["w"].any()


def test_a_prefix_that_selects_nothing_does_not_replace_an_earlier_save(tmp_path: Path) -> None:
    # Was: an empty model.safetensors written, and the earlier save's files removed.
    out = tmp_path / "out"
    state = {"model": {"w": torch.ones(2)}, "step": 3}
    ckpt.save_safetensors(state, out, prefix="model")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ckpt.CheckpointKeyError, match="no tensor of the state dict is under"):
        ckpt.save_safetensors(state, out, prefix="modle")
    assert os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("strict", [True, False])
def test_a_load_prefix_that_selects_nothing_is_a_key_error(tmp_path: Path, strict: bool) -> None:
    # Was: nothing loaded and nothing missing, so even strict=True passed a typo.
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    weight = torch.zeros(2)
    state = {"model": {"w": weight}, "step": 3}
    with pytest.raises(ckpt.CheckpointKeyError, match="no tensor of the state dict is under"):
        ckpt.load_safetensors(state, tmp_path, prefix="modle", strict=strict)
    assert not weight.any()
    assert ckpt.load_safetensors(state, tmp_path, prefix="model", strict=strict) == ([], [])
    assert weight.eq(1).all()


def test_tied_keys_both_in_the_files_are_filled_once_from_the_first(tmp_path: Path) -> None:
    # One memory under two keys whose tensors the files both hold (an untied save of a tied
    # model): filled from the first key, as from_pretrained's tie_weights makes the head the
    # embedding; was: read twice into that memory, at once on the I/O threads (a mix could
    # remain), and the last read won.
    save_file(
        {"embed": torch.ones(64, 64), "head": torch.full((64, 64), 2.0)},
        str(tmp_path / "model.safetensors"),
    )
    tied = torch.zeros(64, 64)
    assert ckpt.load_safetensors({"embed": tied, "head": tied}, tmp_path) == ([], [])
    assert tied.eq(1).all()
    storage = hf_load.open_shared_storage(str(tmp_path), None, 1)
    tensors = hf_load._decode_survey(storage, hf_load._survey(storage, str(tmp_path), None))
    plan = hf_load._plan({"embed": tied, "head": tied}, tensors, Names(), False)
    assert {job.key for job in plan.jobs} == {"embed"}
    # Memory of its own per key: each filled from its own tensor.
    apart = {"embed": torch.zeros(64, 64), "head": torch.zeros(64, 64)}
    ckpt.load_safetensors(apart, tmp_path)
    assert apart["embed"].eq(1).all() and apart["head"].eq(2).all()


def test_a_save_dtype_that_is_not_a_torch_dtype_is_a_type_error(tmp_path: Path) -> None:
    # Was: an AttributeError ('str' object has no attribute 'is_floating_point').
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        ckpt.save_safetensors({"w": torch.ones(2)}, tmp_path / "out", dtype="bfloat16")  # type: ignore[arg-type]
    # A floating-point dtype safetensors has no code for: refused before anything is written,
    # even with no tensor to cast.
    with pytest.raises(ValueError, match="no safetensors code") as refused:
        ckpt.save_safetensors({}, tmp_path / "out", dtype=torch.float8_e4m3fnuz)
    assert not isinstance(refused.value, ckpt.CheckpointError)
    assert not (tmp_path / "out").exists()


def test_a_file_whose_header_no_reader_accepts_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A header over safetensors' 100 MB (here: a limit of 200 bytes) makes a file that every
    # reader, load_safetensors included, refuses. Was: written.
    monkeypatch.setattr(files_module, "MAX_HEADER_BYTES", 200)
    state = {f"layer{i}.weight": torch.ones(1) for i in range(8)}
    with pytest.raises(ckpt.CheckpointMismatchError, match="more than the 200 bytes") as caught:
        ckpt.save_safetensors(state, tmp_path / "out")
    assert caught.value.key == "layer0.weight" and not (tmp_path / "out").exists()
    written = ckpt.save_safetensors(state, tmp_path / "out", max_shard_size=8)
    assert len(written) == 5  # smaller files: smaller headers
    ckpt.save(state, tmp_path / "ckpt")  # consolidate: the same rule
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) != 0
    assert "more than the 200 bytes" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
