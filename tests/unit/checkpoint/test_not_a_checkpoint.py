"""A path with no shardwise index is refused with :class:`CheckpointNotFoundError` whose message
says what the path is instead: nothing, a file, an empty directory, an interrupted shardwise
save, a torch DCP checkpoint, a Hugging Face model directory, or other files. Every reader
(``load``, ``read_metadata``, ``load_tensor``, ``shardwise inspect``) gives the same message,
found from names alone: no file is read, no link below the path is followed, and each
directory is listed at most once. Local directories and fsspec ``memory://`` URLs alike."""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec  # type: ignore[import-untyped]
import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint import state_dict_saver as dcp

import shardwise.checkpoint as ckpt
from shardwise import cli
from shardwise.checkpoint.storage import LocalStorage, open_storage
from shardwise.checkpoint.storage._local import _LocalReader

INDEX = "shardwise.json"
INTERRUPTED = (
    "{} is not a complete shardwise checkpoint: its index shardwise.json is missing, so the "
    "save that wrote it did not commit (it may have been interrupted). Save again or load an "
    "earlier checkpoint"
)


# -- helpers ---------------------------------------------------------------------------------


def _refusal(path: str | Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The message with which every reader refuses ``path``: each raises
    ``CheckpointNotFoundError`` naming the index file, the same message, and ``shardwise
    inspect`` prints it on one line of stderr and exits with 2."""
    text = os.fspath(path)
    storage = open_storage(text)
    index = storage.url(storage.join(INDEX))
    readers: list[Callable[[], object]] = [
        lambda: ckpt.load({"w": torch.zeros(2)}, text),
        lambda: ckpt.read_metadata(text),
        lambda: ckpt.load_tensor(text, "w"),
    ]
    errors = []
    for read in readers:
        with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
            read()
        assert isinstance(caught.value, FileNotFoundError)
        assert caught.value.file == index
        assert str(caught.value) == f"{caught.value.bare_message} (file {index!r})"
        errors.append(str(caught.value))
    assert errors == [errors[0]] * len(readers)
    code = cli.main(["inspect", text])
    captured = capsys.readouterr()
    assert (code, captured.out) == (3, "")
    assert captured.err == f"shardwise inspect: error: {errors[0]}\n"
    return errors[0].removesuffix(f" (file {index!r})")


def _save(path: Path | str) -> None:
    ckpt.save({"w": torch.arange(6.0), "step": 3}, path)


def _interrupted_save(path: Path) -> Path:
    """A shardwise save that wrote its data but never committed its index."""
    _save(path)
    (path / INDEX).unlink()
    return path


def _dcp_save(path: Path) -> Path:
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"w": torch.arange(6.0), "b": torch.ones(2)}, checkpoint_id=str(path), no_dist=True
        )
    return path


def _hugging_face(path: Path) -> Path:
    """A model directory as ``save_pretrained`` writes one: a config and safetensors weights."""
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1}')
    safetensors.torch.save_file({"wte.weight": torch.ones(4, 2)}, str(path / "model.safetensors"))
    return path


def _junk(path: Path, names: list[str]) -> Path:
    path.mkdir()
    for name in names:
        (path / name).write_text("not a checkpoint")
    return path


@pytest.fixture
def memory() -> Iterator[tuple[Any, str]]:
    """The fsspec memory file system and a fresh URL prefix in it (removed afterwards)."""
    fs = fsspec.filesystem("memory")
    with contextlib.suppress(FileNotFoundError):
        fs.rm("/not-a-checkpoint", recursive=True)
    yield fs, "memory://not-a-checkpoint"
    with contextlib.suppress(FileNotFoundError):
        fs.rm("/not-a-checkpoint", recursive=True)


# -- nothing, empty, a file --------------------------------------------------------------------


def test_a_missing_path_is_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refusal(tmp_path / "nowhere", capsys) == f"no checkpoint at {tmp_path / 'nowhere'}"


def test_an_empty_directory_says_it_is_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert _refusal(tmp_path / "empty", capsys) == (
        f"no checkpoint at {tmp_path / 'empty'}: it is an empty directory"
    )
    # What is left after deleting a checkpoint's index and data/.
    path = _interrupted_save(tmp_path / "c")
    shutil.rmtree(path / "data")
    assert _refusal(path, capsys) == f"no checkpoint at {path}: it is an empty directory"


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors", "notes"])
def test_a_file_is_not_a_checkpoint_directory(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save({"w": torch.ones(2)}, path)
    elif name.endswith(".safetensors"):
        safetensors.torch.save_file({"w": torch.ones(2)}, str(path))
    else:
        path.write_text("hello")
    assert _refusal(path, capsys) == (
        f"no checkpoint at {path}: it is a file, and a shardwise checkpoint is a directory "
        "holding shardwise.json and data/"
    )


def test_the_index_file_itself_points_to_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path / "c")
    message = _refusal(tmp_path / "c" / INDEX, capsys)
    assert message.endswith(
        f"it is a file, and a shardwise checkpoint is a directory holding shardwise.json and "
        f"data/; to read the checkpoint of this index, give its directory {tmp_path / 'c'}"
    )
    assert ckpt.load_tensor(tmp_path / "c", "w").tolist() == [0, 1, 2, 3, 4, 5]


def test_a_link_to_a_file_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # As in the Hugging Face cache, where snapshots/<rev>/model.safetensors links to a blob.
    blob = tmp_path / "blob"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(blob))
    (tmp_path / "model.safetensors").symlink_to(blob)
    assert "it is a file, and a shardwise checkpoint is a directory" in _refusal(
        tmp_path / "model.safetensors", capsys
    )


def test_a_fifo_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "fifo")
    assert _refusal(tmp_path / "fifo", capsys).startswith(
        f"no checkpoint at {tmp_path / 'fifo'}: it has no shardwise.json and cannot be listed"
    )


# -- a shardwise save that did not commit ------------------------------------------------------


def test_an_interrupted_save_keeps_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _interrupted_save(tmp_path / "c")
    assert _refusal(path, capsys) == INTERRUPTED.format(path)


def test_temporary_data_files_alone_are_an_interrupted_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _interrupted_save(tmp_path / "c")
    for data in (path / "data").iterdir():
        data.rename(data.with_name(data.name + ".tmp"))  # the writer crashed before its rename
    assert _refusal(path, capsys) == INTERRUPTED.format(path)


def test_a_data_directory_without_shardwise_files_is_not_an_interrupted_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _junk(tmp_path / "c", ["README"])
    (path / "data").mkdir()
    (path / "data" / "train.csv").write_text("a,b\n")
    (path / "data" / "rank-0.safetensors").write_text("")  # not the writer's name pattern
    assert _refusal(path, capsys) == (
        f"{path} is not a shardwise checkpoint: it has no shardwise.json; it holds 'README', 'data'"
    )


def test_a_linked_data_directory_is_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _interrupted_save(tmp_path / "c")
    shutil.move(path / "data", tmp_path / "elsewhere")  # shardwise data files, outside
    (path / "data").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert _refusal(path, capsys) == (
        f"{path} is not a shardwise checkpoint: it has no shardwise.json; it holds 'data'"
    )


def test_the_checkpoint_path_may_be_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The user chose the path: a link there is followed, as for a committed checkpoint.
    _interrupted_save(tmp_path / "step-100")
    (tmp_path / "latest").symlink_to(tmp_path / "step-100", target_is_directory=True)
    assert _refusal(tmp_path / "latest", capsys) == INTERRUPTED.format(tmp_path / "latest")
    _dcp_save(tmp_path / "dcp")
    (tmp_path / "dcp-link").symlink_to(tmp_path / "dcp", target_is_directory=True)
    assert "is a torch.distributed.checkpoint (DCP) checkpoint" in _refusal(
        tmp_path / "dcp-link", capsys
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "gone", target_is_directory=True)
    assert _refusal(tmp_path / "dangling", capsys) == f"no checkpoint at {tmp_path / 'dangling'}"


# -- other formats -----------------------------------------------------------------------------


def test_a_dcp_checkpoint_names_the_conversion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _dcp_save(tmp_path / "dcp")
    assert _refusal(path, capsys) == (
        f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not a shardwise one (it "
        "has '.metadata' and 1 *.distcp file and no shardwise.json): convert it with "
        f"`shardwise convert-dcp {path} <out>`, or load it with torch.distributed.checkpoint.load"
    )
    # The fix the message names works.
    assert cli.main(["convert-dcp", str(path), str(tmp_path / "out")]) == 0
    assert ckpt.load_tensor(tmp_path / "out", "w").tolist() == [0, 1, 2, 3, 4, 5]


def test_dcp_files_alone_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _dcp_save(tmp_path / "dcp")
    (path / ".metadata").unlink()  # a DCP save that did not finish
    (path / "__1_0.distcp").write_bytes(b"")
    message = _refusal(path, capsys)
    assert "is a torch.distributed.checkpoint (DCP) checkpoint" in message
    assert "(it has 2 *.distcp files and no shardwise.json)" in message
    # A path with a space is quoted in the command.
    spaced = _dcp_save(tmp_path / "my dcp")
    assert f"`shardwise convert-dcp '{spaced}' <out>`" in _refusal(spaced, capsys)


def test_a_hugging_face_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _hugging_face(tmp_path / "gpt2")
    assert _refusal(path, capsys) == (
        f"{path} is a Hugging Face model directory (it has 'config.json', 'model.safetensors'), "
        "not a shardwise checkpoint (a directory with shardwise.json and data/): load its "
        "weights into any state dict, sharded or not, with "
        "shardwise.checkpoint.load_safetensors (or the model with transformers' from_pretrained)"
    )
    loaded = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert loaded["wte.weight"].tolist() == [[1.0, 1.0]] * 4
    # What the message points to loads it.
    target = {"wte.weight": torch.zeros(4, 2)}
    ckpt.load_safetensors(target, path)
    assert target["wte.weight"].tolist() == [[1.0, 1.0]] * 4


def test_a_sharded_hugging_face_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _junk(
        tmp_path / "llama",
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "special_tokens_map.json",
        ],
    )
    assert (
        f"{path} is a Hugging Face model directory (it has 'model-00001-of-00002.safetensors', "
        "'model-00002-of-00002.safetensors', 'model.safetensors.index.json'), not a shardwise "
        "checkpoint"
    ) in _refusal(path, capsys)
    (path / "pytorch_model.bin").write_bytes(b"")
    assert "'pytorch_model.bin'" in _refusal(path, capsys)


def test_other_content_is_listed_up_to_five_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _junk(tmp_path / "junk", ["a.txt", "b.txt"])
    assert _refusal(path, capsys) == (
        f"{path} is not a shardwise checkpoint: it has no shardwise.json; it holds 'a.txt', 'b.txt'"
    )
    for name in ["c", "d", "e", "f", "g\nh"]:
        (path / name).write_text("")
    # A name is quoted, so the CLI's line stays one line whatever the name holds.
    assert _refusal(path, capsys) == (
        f"{path} is not a shardwise checkpoint: it has no shardwise.json; it holds 'a.txt', "
        "'b.txt', 'c', 'd', 'e' and 2 more"
    )


# -- cheap and safe ----------------------------------------------------------------------------


def test_no_file_is_read_and_each_directory_is_listed_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [
        tmp_path / "nowhere",
        _interrupted_save(tmp_path / "interrupted"),
        _dcp_save(tmp_path / "dcp"),
        _hugging_face(tmp_path / "hf"),
        _junk(tmp_path / "junk", ["x"]),
        _junk(tmp_path / "empty", []),
        _junk(tmp_path / "files", ["model.pt"]) / "model.pt",
    ]
    # A FIFO where a file would be recognized by its name: opening it to read would block.
    os.mkfifo(tmp_path / "hf" / "tokenizer.json")
    os.mkfifo(tmp_path / "dcp" / "__9_0.distcp")

    def no_reads(*args: object) -> int:
        raise AssertionError("a file was read")

    listed: list[str] = []
    listdir = LocalStorage.listdir

    def counted(self: LocalStorage, path: str) -> list[str]:
        listed.append(path)
        return listdir(self, path)

    monkeypatch.setattr(_LocalReader, "read_into", no_reads)
    monkeypatch.setattr(LocalStorage, "listdir", counted)
    for path in paths:
        listed.clear()
        with pytest.raises(ckpt.CheckpointNotFoundError):
            ckpt.read_metadata(path)
        assert len(listed) == len(set(listed))
        assert set(listed) <= {str(path), str(path / "data")}


# -- fsspec ------------------------------------------------------------------------------------


def test_memory_urls_are_described_too(
    memory: tuple[Any, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fs, url = memory
    assert _refusal(f"{url}/nowhere", capsys) == f"no checkpoint at {url}/nowhere"

    _save(f"{url}/c")
    fs.rm("/not-a-checkpoint/c/shardwise.json")
    assert _refusal(f"{url}/c", capsys) == INTERRUPTED.format(f"{url}/c")

    fs.makedirs("/not-a-checkpoint/empty", exist_ok=True)
    assert _refusal(f"{url}/empty", capsys) == (
        f"no checkpoint at {url}/empty: it is an empty directory"
    )

    fs.pipe_file("/not-a-checkpoint/dcp/.metadata", b"")
    fs.pipe_file("/not-a-checkpoint/dcp/__0_0.distcp", b"")
    assert "is a torch.distributed.checkpoint (DCP) checkpoint" in _refusal(f"{url}/dcp", capsys)

    fs.pipe_file("/not-a-checkpoint/hf/config.json", b"{}")
    fs.pipe_file("/not-a-checkpoint/hf/model.safetensors", b"")
    assert "is a Hugging Face model directory" in _refusal(f"{url}/hf", capsys)

    fs.pipe_file("/not-a-checkpoint/junk/notes.txt", b"")
    assert _refusal(f"{url}/junk", capsys) == (
        f"{url}/junk is not a shardwise checkpoint: it has no shardwise.json; it holds 'notes.txt'"
    )

    fs.pipe_file("/not-a-checkpoint/weights.pt", b"")
    assert _refusal(f"{url}/weights.pt", capsys) == (
        f"no checkpoint at {url}/weights.pt: it is a file, and a shardwise checkpoint is a "
        "directory holding shardwise.json and data/"
    )
    _save(f"{url}/d")
    assert _refusal(f"{url}/d/shardwise.json", capsys).endswith(f"give its directory {url}/d")
