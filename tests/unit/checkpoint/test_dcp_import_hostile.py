"""``DCPReader`` and ``shardwise convert-dcp`` on hostile and malformed DCP checkpoints.

Each test saves a real checkpoint with ``torch.distributed.checkpoint.save`` in this process
(no process group), then attacks it: ``.metadata`` is unpickled with torch's own classes (the
test wrote it), mutated and pickled back, or files are replaced by symbolic links, FIFOs,
truncated copies and compressed archives. Every attack must end in a ``DCPImportError`` that
names the file (and the key concerned); numbers from the files must be checked before
anything is allocated from them (measured in a child process under a memory limit); nothing
outside the checkpoint directory may be opened. A seeded fuzz of byte flips and truncations
checks the same for inputs nobody thought of.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import shardwise
from shardwise import cli
from shardwise.checkpoint.dcp_import import DCPImportError, DCPReader
from shardwise.local_shards import LocalShardsWrapper

DATA_FILE = "__0_0.distcp"
KEYS = {"w", "lsw", "step", "blob"}


# -- helpers ---------------------------------------------------------------------------------


def _dcp_save(state_dict: dict[str, Any], path: Path) -> Path:
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, checkpoint_id=str(path), no_dist=True)
    return path


def _expected() -> dict[str, Any]:
    """The values of the checkpoint the tests attack, as DCPReader should read them."""
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "lsw": torch.tensor([[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]]),
        "step": 7,
        "blob": b"raw bytes",
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A DCP checkpoint of a plain tensor, a tensor in two column chunks and two objects."""
    expected = _expected()
    state_dict = {
        "w": expected["w"].clone(),
        "lsw": LocalShardsWrapper([torch.ones(2, 2), torch.full((2, 2), 2.0)], [(0, 0), (0, 2)]),
        "step": expected["step"],
        "blob": expected["blob"],
    }
    return _dcp_save(state_dict, tmp_path / "dcp")


def _read_all(directory: Path) -> dict[str, Any]:
    reader = DCPReader(str(directory))
    return {key: reader.read(key) for key in reader.keys}


def _assert_reads_expected(directory: Path) -> None:
    values = _read_all(directory)
    expected = _expected()
    assert set(values) == KEYS
    assert torch.equal(values["w"], expected["w"])
    assert torch.equal(values["lsw"], expected["lsw"])
    assert (values["step"], values["blob"]) == (expected["step"], expected["blob"])


def _refusal(directory: Path) -> DCPImportError:
    """The DCPImportError that reading every key of ``directory`` raises."""
    with pytest.raises(DCPImportError) as caught:
        _read_all(directory)
    return caught.value


def _edit_metadata(directory: Path, edit: Callable[[Metadata], object]) -> None:
    path = directory / ".metadata"
    with path.open("rb") as file:
        metadata = pickle.load(file)  # written by this test with dcp.save
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _index(metadata: Metadata, fqn: str, offsets: tuple[int, ...] | None = None) -> MetadataIndex:
    return next(
        index
        for index in metadata.storage_data
        if index.fqn == fqn and (offsets is None or tuple(index.offset) == offsets)
    )


def _info(metadata: Metadata, fqn: str, offsets: tuple[int, ...] | None = None) -> Any:
    return metadata.storage_data[_index(metadata, fqn, offsets)]


def _move_chunk(metadata: Metadata, fqn: str, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    """Move a chunk to offsets ``new``, with its storage (so that only the layout is wrong)."""
    chunk = next(c for c in metadata.state_dict_metadata[fqn].chunks if tuple(c.offsets) == old)
    chunk.offsets = torch.Size(new)
    index = _index(metadata, fqn, old)
    info = metadata.storage_data.pop(index)
    metadata.storage_data[MetadataIndex(fqn, torch.Size(new), index.index)] = info


def _replace_payload(directory: Path, fqn: str, payload: bytes) -> None:
    """Append ``payload`` to the data file and point the (first) storage of ``fqn`` at it."""
    data = directory / DATA_FILE
    offset = data.stat().st_size
    with data.open("ab") as file:
        file.write(payload)

    def edit(metadata: Metadata) -> None:
        info = _info(metadata, fqn)
        info.offset, info.length = offset, len(payload)

    _edit_metadata(directory, edit)


def _torch_save(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- valid input keeps working ---------------------------------------------------------------


def test_a_valid_checkpoint_reads_back_through_a_symlinked_directory(
    checkpoint: Path, tmp_path: Path
) -> None:
    _assert_reads_expected(checkpoint)
    link = tmp_path / "link"
    link.symlink_to(checkpoint, target_is_directory=True)
    _assert_reads_expected(link)  # the directory the user names may be a link


def test_a_data_file_in_a_real_subdirectory_is_read(checkpoint: Path) -> None:
    (checkpoint / "sub").mkdir()
    (checkpoint / DATA_FILE).rename(checkpoint / "sub" / DATA_FILE)

    def edit(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = f"sub/{DATA_FILE}"

    _edit_metadata(checkpoint, edit)
    _assert_reads_expected(checkpoint)


def test_an_empty_chunk_outside_the_tensor_is_accepted(checkpoint: Path) -> None:
    # Chunking 5 rows over 4 ranks leaves an empty chunk past the end; it holds nothing.
    _edit_metadata(
        checkpoint,
        lambda m: m.state_dict_metadata["lsw"].chunks.append(
            ChunkStorageMetadata(torch.Size([0, 9]), torch.Size([2, 0]))
        ),
    )
    _assert_reads_expected(checkpoint)


# -- numbers: bounded before anything is allocated -------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("offset", -1), ("length", -5), ("offset", 2**62), ("length", True), ("length", 1.5)],
)
def test_storage_offsets_and_lengths_must_be_bounded_ints(
    checkpoint: Path, field: str, value: object
) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), field, value))
    err = _refusal(checkpoint)
    assert str(err).startswith(
        f"'w': malformed DCP metadata: its storage is at relative_path '{DATA_FILE}', "
    )
    assert f"{field} {value!r}" in str(err)
    assert "integers in [0, 2**62)" in str(err)
    assert err.file == str(checkpoint / ".metadata")


@pytest.mark.parametrize(("field", "value"), [("length", 2**40), ("offset", 2**40)])
def test_storage_ranges_must_lie_inside_their_file(
    checkpoint: Path, field: str, value: int
) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), field, value))
    err = _refusal(checkpoint)
    assert str(err).startswith("'w': its DCP storage range (")
    assert "reaches past the end of its data file" in str(err)
    assert err.file == str(checkpoint / DATA_FILE)


def test_storage_ranges_must_not_share_bytes(checkpoint: Path) -> None:
    """Two chunks of 16 bytes read from the same bytes would be a copy the files do not hold
    (repeat that a million times and a small file fills terabytes). Hard links are one file."""
    os.link(checkpoint / DATA_FILE, checkpoint / "alias.distcp")

    def edit(metadata: Metadata) -> None:
        first, second = _info(metadata, "lsw", (0, 0)), _info(metadata, "lsw", (0, 2))
        second.relative_path, second.offset = "alias.distcp", first.offset

    _edit_metadata(checkpoint, edit)
    err = _refusal(checkpoint)
    assert str(err).startswith("'lsw': its DCP storage range (")
    assert "overlaps that of 'lsw'" in str(err)
    assert "in the same data file" in str(err)


def test_a_huge_tensor_size_is_refused_before_anything_is_allocated(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def edit(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([2**40])
        entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2**40]))]
        index = _index(metadata, "w")
        info = metadata.storage_data.pop(index)
        metadata.storage_data[MetadataIndex("w", torch.Size([0]), 0)] = info

    _edit_metadata(checkpoint, edit)
    allocations: list[object] = []
    real_empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        allocations.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(DCPImportError) as caught:
        DCPReader(str(checkpoint))  # refused when the reader is created, before any read
    assert str(caught.value).startswith(
        f"'w': the chunk at offsets [0] holds {4 * 2**40} bytes of torch.float32, more than its "
    )
    assert allocations == []


def test_a_huge_size_with_small_chunks_is_a_gap(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(m.state_dict_metadata["w"], "size", [2**40, 3]))
    err = _refusal(checkpoint)
    assert str(err).startswith(f"'w': its DCP chunks do not tile its size [{2**40}, 3]: ")
    assert "does not match tensor volume" in str(err)
    assert err.file == str(checkpoint / ".metadata")


def test_an_empty_size_whose_strides_overflow_is_refused(checkpoint: Path) -> None:
    # No element, so no chunk to tile it: was torch's RuntimeError when the tensor was made.
    def edit(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([0, 2**61, 2**61])
        entry.chunks = []

    _edit_metadata(checkpoint, edit)
    err = _refusal(checkpoint)
    assert str(err).startswith(
        f"'w': malformed DCP metadata: its size [0, {2**61}, {2**61}] is too large: no tensor"
    )


@pytest.mark.parametrize(
    "size",
    [[-4, 3], [4, True], [4, 3.0], [4, 2**62], [1] * 2000, "43", None],
    ids=["negative", "bool", "float", "huge", "too-many-dims", "str", "none"],
)
def test_tensor_sizes_must_be_bounded_ints(checkpoint: Path, size: object) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(m.state_dict_metadata["w"], "size", size))
    err = _refusal(checkpoint)
    assert str(err).startswith("'w': malformed DCP metadata: its size is ")
    assert "(expected at most 1024 integers in [0, 2**62))" in str(err)
    assert len(str(err)) < 400  # a huge value is shown abbreviated


# -- chunks must tile their tensor -----------------------------------------------------------


def test_overlapping_chunks_are_refused(checkpoint: Path) -> None:
    # Chunks [0:2, 0:2] and [0:2, 1:3] hold 8 elements, as many as the tensor: counting
    # elements accepts this and leaves column 3 uninitialized.
    _edit_metadata(checkpoint, lambda m: _move_chunk(m, "lsw", (0, 2), (0, 1)))
    err = _refusal(checkpoint)
    assert str(err).startswith("'lsw': its DCP chunks do not tile its size [2, 4]: Shards ")
    assert "overlap" in str(err)
    assert err.file == str(checkpoint / ".metadata")


def test_a_duplicated_chunk_is_refused(checkpoint: Path) -> None:
    def edit(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.chunks = [entry.chunks[0], entry.chunks[0]]

    _edit_metadata(checkpoint, edit)
    err = _refusal(checkpoint)
    assert str(err).startswith("'w': its DCP chunks do not tile its size [4, 3]: Shards ")
    assert "overlap" in str(err)


def test_a_gap_between_chunks_is_refused(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: m.state_dict_metadata["lsw"].chunks.pop())
    err = _refusal(checkpoint)
    assert str(err).startswith("'lsw': its DCP chunks do not tile its size [2, 4]: ")
    assert "Total volume of shards: 4 does not match tensor volume: 8" in str(err)


def test_a_chunk_past_the_end_of_its_tensor_is_refused(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(m.state_dict_metadata["lsw"], "size", [2, 3]))
    err = _refusal(checkpoint)
    assert str(err).startswith("'lsw': its DCP chunks do not tile its size [2, 3]: ")
    assert "exceeds tensor dim: 3" in str(err)


def test_a_chunk_with_the_wrong_number_of_dims_is_refused(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: _move_chunk(m, "w", (0, 0), (0,)))
    err = _refusal(checkpoint)
    assert str(err).startswith("'w': malformed DCP metadata: a chunk has offsets (0,) and sizes")
    assert "(expected 2 integers in [0, 2**62) each)" in str(err)


def test_a_chunk_larger_than_its_storage_range_is_refused(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), "length", 47))
    err = _refusal(checkpoint)
    assert str(err) == (
        "'w': the chunk at offsets [0, 0] holds 48 bytes of torch.float32, more than its "
        f"47-byte storage range (file '{checkpoint / '.metadata'}')"
    )


# -- containment: paths, symbolic links, special files ---------------------------------------


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("../x.distcp", "it has an empty, '.' or '..' component"),
        ("/etc/passwd", "it is absolute"),
        (f"sub/../{DATA_FILE}", "it has an empty, '.' or '..' component"),
        (f"./{DATA_FILE}", "it has an empty, '.' or '..' component"),
        (f"sub//{DATA_FILE}", "it has an empty, '.' or '..' component"),
        ("sub/", "it has an empty, '.' or '..' component"),
        ("", "it is empty"),
        ("__0_0\0.distcp", "it contains a NUL character"),
    ],
)
def test_storage_paths_must_be_plain_relative_paths(
    checkpoint: Path, path: str, problem: str
) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), "relative_path", path))
    err = _refusal(checkpoint)
    assert str(err) == (
        f"'w': its storage path {path!r} is not a plain path inside the checkpoint directory: "
        f"{problem} (file '{checkpoint / '.metadata'}')"
    )


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_a_symlinked_data_file_is_not_followed(
    checkpoint: Path, tmp_path: Path, target: str
) -> None:
    real = (tmp_path / "outside" if target == "outside" else checkpoint) / "real.distcp"
    real.parent.mkdir(exist_ok=True)
    (checkpoint / DATA_FILE).rename(real)
    (checkpoint / DATA_FILE).symlink_to(real)
    err = _refusal(checkpoint)
    key, _, message = str(err).partition(": ")
    assert key in {repr(k) for k in KEYS}
    assert message.startswith(
        f"refusing to read its DCP data file: '{DATA_FILE}' is a symbolic link, which "
        "convert-dcp does not follow"
    )
    assert err.file == str(checkpoint / DATA_FILE)


def test_a_symlinked_subdirectory_is_not_followed(checkpoint: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (checkpoint / DATA_FILE).rename(outside / DATA_FILE)
    (checkpoint / "sub").symlink_to(outside, target_is_directory=True)

    def edit(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = f"sub/{DATA_FILE}"

    _edit_metadata(checkpoint, edit)
    err = _refusal(checkpoint)
    assert "refusing to read its DCP data file: 'sub' is a symbolic link" in str(err)
    assert err.file == str(checkpoint / "sub" / DATA_FILE)


def test_a_file_used_as_a_directory_is_refused(checkpoint: Path) -> None:
    _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), "relative_path", f"{DATA_FILE}/x"))
    err = _refusal(checkpoint)
    assert f"'{DATA_FILE}' is a regular file, not a directory" in str(err)


@pytest.mark.timeout(20)
def test_a_fifo_data_file_is_refused_without_blocking(checkpoint: Path) -> None:
    (checkpoint / DATA_FILE).unlink()
    os.mkfifo(checkpoint / DATA_FILE)
    err = _refusal(checkpoint)
    assert f"refusing to read its DCP data file: '{DATA_FILE}' is a FIFO, not a regular file" in (
        str(err)
    )
    assert err.file == str(checkpoint / DATA_FILE)


@pytest.mark.timeout(20)
def test_a_fifo_metadata_file_is_refused_without_blocking(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()
    os.mkfifo(checkpoint / ".metadata")
    err = _refusal(checkpoint)
    assert str(err) == (
        f"refusing to read {checkpoint / '.metadata'}: '.metadata' is a FIFO, not a regular file"
    )


def test_a_symlinked_metadata_file_is_not_followed(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / ".metadata").rename(tmp_path / "metadata")
    (checkpoint / ".metadata").symlink_to(tmp_path / "metadata")
    err = _refusal(checkpoint)
    assert str(err) == (
        f"refusing to read {checkpoint / '.metadata'}: '.metadata' is a symbolic link, which "
        "convert-dcp does not follow"
    )


def test_a_metadata_directory_is_refused(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()
    (checkpoint / ".metadata").mkdir()
    err = _refusal(checkpoint)
    assert str(err).endswith("'.metadata' is a directory, not a regular file")


def test_an_oversized_metadata_file_is_refused_unread(checkpoint: Path) -> None:
    with (checkpoint / ".metadata").open("r+b") as file:
        file.truncate((1 << 30) + 1)  # sparse: nothing is written, and nothing must be read
    err = _refusal(checkpoint)
    assert str(err) == (
        f"refusing to read {checkpoint / '.metadata'}: it holds {(1 << 30) + 1} bytes, more "
        f"than the {1 << 30} DCP's metadata could need"
    )


def test_a_truncated_data_file_is_refused(checkpoint: Path) -> None:
    data = checkpoint / DATA_FILE
    data.write_bytes(data.read_bytes()[:-100])
    err = _refusal(checkpoint)
    assert "reaches past the end of its data file" in str(err)
    assert "the file is truncated or the metadata is corrupt" in str(err)
    assert err.file == str(data)


def test_a_data_file_truncated_after_the_reader_was_created(checkpoint: Path) -> None:
    reader = DCPReader(str(checkpoint))
    data = checkpoint / DATA_FILE
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(DCPImportError, match=r"its DCP data file is truncated \(read ") as caught:
        for key in reader.keys:
            reader.read(key)
    assert caught.value.file == str(data)


def test_a_missing_data_file_is_refused(checkpoint: Path) -> None:
    (checkpoint / DATA_FILE).unlink()
    err = _refusal(checkpoint)
    assert str(err).endswith(f": its DCP data file is missing (file '{checkpoint / DATA_FILE}')")


# -- payloads --------------------------------------------------------------------------------


def _recompressed(payload: bytes) -> bytes:
    """The same archive with deflated records (torch.load would read it)."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(payload)) as source,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target,
    ):
        for name in source.namelist():
            target.writestr(name, source.read(name))
    return out.getvalue()


def test_a_compressed_payload_is_refused(checkpoint: Path) -> None:
    payload = _recompressed(_torch_save(_expected()["w"]))
    assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), _expected()["w"])
    _replace_payload(checkpoint, "w", payload)
    err = _refusal(checkpoint)
    assert str(err).startswith(
        "'w': its DCP payload is not a torch.save archive (its record 'archive/data.pkl' is "
        "compressed)"
    )
    assert err.file == str(checkpoint / DATA_FILE)


def test_a_payload_not_laid_out_as_torch_save_writes_it_is_refused(checkpoint: Path) -> None:
    payload = _torch_save(_expected()["w"])
    with_comment = payload[:-2] + b"\x04\x00" + b"hint"  # a zip comment after the end record
    _replace_payload(checkpoint, "w", with_comment)
    assert "(it does not end with a zip end record)" in str(_refusal(checkpoint))


_PICKLE_ONLY = "which a shardwise checkpoint stores only with pickle; convert-dcp does not pickle"


def _nested(depth: int) -> bytes:
    """A torch.save archive of ``depth`` nested lists, pickled by hand (torch.save recurses)."""
    pickled = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # EMPTY_LISTs, APPENDs
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_torch_save(0))) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            target.writestr(name, pickled if name.endswith("/data.pkl") else source.read(name))
    return out.getvalue()


def _shared(levels: int) -> list[Any]:
    value: list[Any] = [0]
    for _ in range(levels):
        value = [value, value]  # pickled once per level; 2**levels leaves once expanded
    return value


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (_nested(100_000), "its value nests deeper than 100 levels"),
        (
            _shared(40),
            "its value is more than 16 times larger than its payload (the payload repeats "
            "shared parts)",
        ),
        ({"a": {1: 2}}, f"holds a dict containing a dict with a key of type int, {_PICKLE_ONLY}"),
        ({1, 2}, f"holds a set, {_PICKLE_ONLY}"),
        ([torch.ones(1)], f"holds a list containing a Tensor, {_PICKLE_ONLY}"),
    ],
    ids=["deep", "shared", "int-key", "set", "tensor"],
)
def test_object_values_must_be_bounded_json(checkpoint: Path, value: object, problem: str) -> None:
    _replace_payload(checkpoint, "step", value if isinstance(value, bytes) else _torch_save(value))
    err = _refusal(checkpoint)
    assert str(err) == f"'step': {problem} (file '{checkpoint / DATA_FILE}')"


def test_a_chunk_payload_of_the_wrong_kind_is_refused(checkpoint: Path) -> None:
    _replace_payload(checkpoint, "w", _torch_save(torch.zeros(4, 3).to_sparse()))
    err = _refusal(checkpoint)
    assert "'w': the chunk at offsets [0, 0] holds torch.float32 [4, 3] (torch.sparse_coo" in (
        str(err)
    )


# -- allocations, measured -------------------------------------------------------------------

# Reads each directory given after a valid one (the warm-up) under an address-space limit of
# 1 GiB above what the warm-up left, and prints per directory what was raised and how much the
# peak resident memory grew (KiB).
_MEMORY_PROBE = r"""
import resource, sys
from shardwise.checkpoint.dcp_import import DCPImportError, DCPReader

def read_all(directory):
    reader = DCPReader(directory)
    for key in reader.keys:
        reader.read(key)

read_all(sys.argv[1])
with open("/proc/self/statm") as statm:
    virtual = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (virtual + (1 << 30), resource.RLIM_INFINITY))
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for directory in sys.argv[2:]:
    try:
        read_all(directory)
        outcome = "read"
    except DCPImportError:
        outcome = "DCPImportError"
    except BaseException as err:
        outcome = f"{type(err).__name__}: {str(err)[:200]!r}"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    print(f"{grown} {outcome}", flush=True)
"""


def _deflate_bomb(uncompressed: int) -> bytes:
    """A torch.save archive of a (4, 3) float view of a storage of ``uncompressed`` bytes,
    with the storage deflated: torch.load allocates and fills all of it."""
    source = zipfile.ZipFile(io.BytesIO(_torch_save(torch.zeros(4, 3))))
    pickled = source.read("archive/data.pkl")
    numel = b"cpuq\x04K\x0c"  # ('storage', FloatStorage, '0', 'cpu', 12): its element count
    assert pickled.count(numel) == 1
    pickled = pickled.replace(numel, b"cpuq\x04J" + (uncompressed // 4).to_bytes(4, "little"))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for name in source.namelist():
            if name == "archive/data/0":
                with target.open(name, "w", force_zip64=True) as record:
                    for _ in range(uncompressed >> 20):
                        record.write(bytes(1 << 20))
            else:
                target.writestr(name, pickled if name == "archive/data.pkl" else source.read(name))
    return out.getvalue()


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and RLIMIT_AS")
def test_hostile_numbers_allocate_nothing(checkpoint: Path, tmp_path: Path) -> None:
    def huge_length(directory: Path) -> None:
        _edit_metadata(directory, lambda m: setattr(_info(m, "w"), "length", 2**40))

    def huge_size(directory: Path) -> None:
        def edit(metadata: Metadata) -> None:
            entry = metadata.state_dict_metadata["w"]
            entry.size = torch.Size([2**40])
            entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2**40]))]
            info = metadata.storage_data.pop(_index(metadata, "w"))
            metadata.storage_data[MetadataIndex("w", torch.Size([0]), 0)] = info

        _edit_metadata(directory, edit)

    def memo_bomb(directory: Path) -> None:
        # LONG_BINPUT at index 2**28: C's unpickler grows its memo array to 4 GiB and zeroes it.
        (directory / ".metadata").write_bytes(b"\x80\x02Nr\xff\xff\xff\x0f.")

    def bytes_claim(directory: Path) -> None:
        # BINBYTES8 claiming 1 TiB that the file does not hold.
        (directory / ".metadata").write_bytes(b"\x80\x04\x8e" + (2**40).to_bytes(8, "little"))

    def bytearray_claim(directory: Path) -> None:
        # BYTEARRAY8 claiming 2 GiB: Python's unpickler allocates and zeroes it before reading.
        (directory / ".metadata").write_bytes(b"\x80\x05\x96" + (2**31).to_bytes(8, "little"))

    def deflate_bomb(directory: Path) -> None:
        _replace_payload(directory, "w", _deflate_bomb(512 << 20))

    attacks: dict[str, Callable[[Path], None]] = {
        "huge_length": huge_length,
        "huge_size": huge_size,
        "memo_bomb": memo_bomb,
        "bytes_claim": bytes_claim,
        "bytearray_claim": bytearray_claim,
        "deflate_bomb": deflate_bomb,
    }
    directories = []
    for name, attack in attacks.items():
        directory = tmp_path / name
        shutil.copytree(checkpoint, directory)
        attack(directory)
        directories.append(str(directory))
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(checkpoint), *directories],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line.split(" ", 1) for line in result.stdout.splitlines()]
    assert len(lines) == len(attacks)
    failures = [
        f"{name}: {outcome}, peak memory grew by {grown_kib} KiB"
        for name, (grown_kib, outcome) in zip(attacks, lines, strict=True)
        if outcome != "DCPImportError" or int(grown_kib) >= 128 << 10
    ]
    assert failures == []


# -- the command line ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "attack", ["overlap", "symlink", "fifo", "huge-length"], ids=lambda attack: attack
)
def test_convert_dcp_reports_a_hostile_checkpoint_in_one_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], attack: str
) -> None:
    if attack == "overlap":
        _edit_metadata(checkpoint, lambda m: _move_chunk(m, "lsw", (0, 2), (0, 1)))
    elif attack == "symlink":
        (checkpoint / DATA_FILE).rename(tmp_path / DATA_FILE)
        (checkpoint / DATA_FILE).symlink_to(tmp_path / DATA_FILE)
    elif attack == "fifo":
        (checkpoint / DATA_FILE).unlink()
        os.mkfifo(checkpoint / DATA_FILE)
    else:
        _edit_metadata(checkpoint, lambda m: setattr(_info(m, "w"), "length", 2**40))
    code, out, err = _run(capsys, "convert-dcp", checkpoint, tmp_path / "out")
    assert (code, out) == (3, "")
    assert err.startswith("shardwise convert-dcp: error: '")
    assert err.count("\n") == 1 and err.endswith("')\n")  # one line, ending with the file
    assert not (tmp_path / "out").exists()


def test_convert_dcp_refuses_keys_that_collide_once_flattened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DCP keeps the object "step" and the key "step.a" apart; flattening {"a": 1} joins them.
    directory = _dcp_save({"step": 0, "step.a": 2}, tmp_path / "collide")
    _replace_payload(directory, "step", _torch_save({"a": 1}))
    code, out, err = _run(capsys, "convert-dcp", directory, tmp_path / "out")
    assert (code, out) == (3, "")
    assert err == (
        f"shardwise convert-dcp: error: cannot convert {directory}: state_dict keys "
        "['step.a'] appear twice after flattening\n"
    )


# -- fuzz ------------------------------------------------------------------------------------

_recorded_opens: list[list[object]] = []
_installed_hooks: list[Callable[[str, tuple[Any, ...]], None]] = []


def _record_open(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _recorded_opens:
        _recorded_opens[-1].append(args[0])


@contextlib.contextmanager
def _recording_opens() -> Iterator[list[object]]:
    """The path of every file opened in the block (audit hooks cannot be removed: one is
    installed per process, and records only while a block is active)."""
    if _record_open not in _installed_hooks:
        sys.addaudithook(_record_open)
        _installed_hooks.append(_record_open)
    opened: list[object] = []
    _recorded_opens.append(opened)
    try:
        yield opened
    finally:
        _recorded_opens.pop()


def _opened_outside(opened: list[object], directory: Path) -> list[str]:
    """The opened paths that are neither in ``directory`` nor in Python's, torch's or
    shardwise's installation, /proc, /dev or /sys."""
    roots = [
        directory,
        Path(torch.__file__).parent,
        Path(shardwise.__file__).parent,
        *(Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)),
        *(Path(p) for p in sysconfig.get_paths().values()),
        Path("/proc"),
        Path("/dev"),
        Path("/sys"),
    ]
    roots = [Path(os.path.realpath(root)) for root in roots]
    outside = []
    for path in opened:
        if isinstance(path, int):
            continue  # a descriptor already open (open(fd, "rb"))
        text = os.fsdecode(path)
        if not os.path.isabs(text):
            # Relative names are opened relative to a directory descriptor: one component.
            if "/" in text or text in ("", ".", ".."):
                outside.append(text)
            continue
        real = Path(os.path.realpath(text))
        if not any(real.is_relative_to(root) for root in roots):
            outside.append(text)
    return outside


def _plant_decoys(checkpoint: Path, outside: Path) -> None:
    """Symbolic links to a valid copy of the data file outside the checkpoint, under every name
    one flipped bit of the data file's name gives (and ``__0_0/distcp``, from '.' to '/')."""
    outside.mkdir()
    shutil.copy(checkpoint / DATA_FILE, outside / DATA_FILE)
    shutil.copy(checkpoint / DATA_FILE, outside / "distcp")
    name = DATA_FILE.encode()
    for at in range(len(name)):
        for bit in range(8):
            flipped = bytearray(name)
            flipped[at] ^= 1 << bit
            if b"/" in flipped or 0 in flipped or bytes(flipped) in (b".", b".."):
                continue
            decoy = checkpoint / os.fsdecode(bytes(flipped))
            if not decoy.exists():
                decoy.symlink_to(outside / DATA_FILE)
    (checkpoint / "__0_0").symlink_to(outside, target_is_directory=True)


def _mutate(rng: random.Random, data: bytes, name: bytes) -> bytes:
    mutated = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:  # a few random bytes
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] ^= rng.randrange(1, 256)
    elif kind == 1:  # one random bit
        mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
    elif kind == 2:  # truncation
        del mutated[rng.randrange(len(mutated)) :]
    else:  # one bit of a storage path, where the decoys wait
        starts = [i for i in range(len(data)) if data.startswith(name, i)] or [0]
        mutated[rng.choice(starts) + rng.randrange(len(name))] ^= 1 << rng.randrange(8)
    return bytes(mutated)


@pytest.mark.timeout(240)
def test_fuzzed_checkpoints_raise_only_dcp_import_errors_and_stay_inside(
    checkpoint: Path, tmp_path: Path
) -> None:
    _plant_decoys(checkpoint, tmp_path / "outside")
    originals = {name: (checkpoint / name).read_bytes() for name in (".metadata", DATA_FILE)}
    rng = random.Random(20240617)
    outcomes: dict[str, int] = {"read": 0, "refused": 0, "symlink refused": 0}
    escaped: list[str] = []
    with _recording_opens() as opened:
        for iteration in range(300):
            target = ".metadata" if rng.random() < 0.6 else DATA_FILE
            mutated = _mutate(rng, originals[target], DATA_FILE.encode())
            (checkpoint / target).write_bytes(mutated)
            try:
                reader = DCPReader(str(checkpoint))
                for key in reader.keys:
                    reader.is_tensor(key)
                    reader.read(key)
                outcomes["read"] += 1
            except DCPImportError as err:
                symlink = "is a symbolic link" in str(err)
                outcomes["symlink refused" if symlink else "refused"] += 1
            except Exception as err:  # anything else is what the fuzz looks for
                escaped.append(f"iteration {iteration} ({target}): {type(err).__name__}: {err}")
            (checkpoint / target).write_bytes(originals[target])
    assert (escaped, _opened_outside(opened, checkpoint)) == ([], [])
    # The fuzz reached all three outcomes: valid reads (flipped tensor bytes), refusals, and
    # storage paths turned into the names of the planted links.
    assert all(outcomes.values()), outcomes
    assert any(isinstance(path, str) and path == str(checkpoint) for path in opened)
