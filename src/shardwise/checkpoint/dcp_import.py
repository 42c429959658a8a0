"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running pickled code.

DCP writes ``.metadata``, a pickle of its ``Metadata``, and ``*.distcp`` data files holding
``torch.save`` payloads at the byte ranges the metadata records (``FileSystemWriter``'s layout).
:class:`DCPReader` unpickles the metadata with an allow-list that resolves every class to an
inert stand-in recording fields, and decodes each payload with ``torch.load(weights_only=True)``,
so nothing from the files executes.

The directory is untrusted input, and nothing in it is believed before it is checked:

* Files are opened below the directory one path component at a time, never through a
  symbolic link, and only regular files are read (a FIFO or a device is refused unread).
* Every offset, length and size is a bounded non-negative ``int``. Each storage range lies
  inside its file and no two ranges of one file overlap; each chunk's bytes fit in its range,
  and the chunks of a tensor tile it exactly (no overlap, no gap). So the tensors hold at most
  the bytes of the data files, and all of this is checked when the reader is created, before
  any tensor is allocated.
* A payload must be laid out as ``torch.save`` writes it (uncompressed records that fit in
  it), so ``torch.load`` cannot allocate more than the payload holds.
* An object value is bounded in depth and may not expand past its payload.

Every failure is a :class:`DCPImportError` naming the file, and the key where one is
concerned. See ``docs/cli.md`` (``convert-dcp``) for what is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import os
import pickle
import reprlib
import stat
import struct
import types
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import torch

from shardwise.errors import DCPImportError
from shardwise.metadata import ShardMetadata
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = ["DCPImportError", "DCPReader"]


_DCP_METADATA = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"
# DCP's metadata for a million chunks pickles to about 200 MB; a larger file is refused unread.
_MAX_METADATA_BYTES = 1 << 30
# Every offset, length and size in the metadata is below this; no file or tensor comes close,
# and sums of a few of them stay far from any C integer limit.
_MAX_INT = 1 << 62
# Tensors with more dims are refused (no real tensor comes close): the work on each chunk grows
# with its dims, and the number of its elements with their product.
_MAX_DIMS = 1024
# Object values nest at most this deep (saving them as JSON recurses once per level).
_MAX_OBJECT_DEPTH = 100
# An object value may expand to at most this many times its payload's size: a pickle can
# reference one part from many places (shared dict keys do it legitimately), and a chain of
# shared lists expands exponentially.
_MAX_OBJECT_EXPANSION = 16

# Components below the DCP directory are opened without following symbolic links; O_NONBLOCK
# keeps the open of a FIFO from waiting for a writer (it is refused right after, unread).
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_COMPONENT_FLAGS = _DIRECTORY_FLAGS | os.O_NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# The records that close a zip archive, as torch.save writes them (always with zip64 ones).
_ZIP_END = struct.Struct("<4s4H2LH")  # signature, disks, entries, directory size and offset,
# comment size
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end, disks
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # ..., directory size and offset last
_ZIP_END_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_END_SIGNATURE = b"PK\x06\x06"

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _shown(value: object) -> str:
    """A repr of a value from the metadata, short even if the value is huge or deeply nested."""
    return _REPR.repr(tuple(value) if isinstance(value, torch.Size) else value)


class _Record:
    """Stand-in for a DCP metadata class: it only keeps the known fields, so no code of the
    real class (``__setstate__``, ``__post_init__``, validators) runs while unpickling."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(self.FIELDS):
            raise pickle.UnpicklingError(f"too many arguments for {type(self).__name__}")
        for name in self.FIELDS:
            setattr(self, name, None)
        for name, value in zip(self.FIELDS, args, strict=False):
            setattr(self, name, value)
        self._update(kwargs)

    def _update(self, state: Mapping[Any, Any]) -> None:
        for name, value in state.items():
            if name in self.FIELDS:  # unknown (newer) fields are ignored, never set
                setattr(self, name, value)

    def __setstate__(self, state: Any) -> None:
        for name in self.FIELDS:
            if not hasattr(self, name):
                setattr(self, name, None)
        # A dataclass pickles its __dict__, or (dict-or-None, slots dict) with __slots__.
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
                self._update(part or {})
        elif isinstance(state, dict):
            self._update(state)
        else:
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")

    def get(self, name: str) -> Any:
        return getattr(self, name, None)


class _DCPMetadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class _DCPTensorEntry(_Record):
    FIELDS = ("properties", "size", "chunks")


class _DCPChunk(_Record):
    FIELDS = ("offsets", "sizes")


class _DCPBytesEntry(_Record):
    FIELDS = ()


class _DCPIndex(_Record):
    FIELDS = ("fqn", "offset", "index")


class _DCPStorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class _DCPStorageInfo(_Record):
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


_MEMORY_FORMATS = {
    "TORCH_CONTIGUOUS_FORMAT": (0, torch.contiguous_format),
    "TORCH_CHANNELS_LAST": (1, torch.channels_last),
    "TORCH_PRESERVE_FORMAT": (2, torch.preserve_format),
}


def _memory_format(code: object) -> torch.memory_format:
    """Stand-in for DCP's memory-format enum, called with a member's value."""
    for value, memory_format in _MEMORY_FORMATS.values():
        if code == value and type(code) is int:
            return memory_format
    raise pickle.UnpicklingError(f"unknown memory format code {code!r}")


class _DCPProperties(_Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        # DCP pickles TensorProperties as (dtype, layout, requires_grad, format code, pin).
        if isinstance(state, tuple) and len(state) == 5:
            self._update(dict(zip(self.FIELDS, state, strict=True)))
        else:
            super().__setstate__(state)


def _layout(name: object) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: ``"torch.strided"`` to the layout."""
    if isinstance(name, str) and name.startswith("torch."):
        value = vars(torch).get(name.removeprefix("torch."))
        if isinstance(value, torch.layout):
            return value
    raise pickle.UnpicklingError(f"unknown layout {name!r}")


def _path_text(*parts: object) -> str:
    """Stand-in for pathlib's path classes (a checkpoint_id given as a Path)."""
    if not all(isinstance(part, str) for part in parts):
        raise pickle.UnpicklingError("a path made of something other than strings")
    return os.path.join(*(str(part) for part in parts)) if parts else ""


def _enum_member(owner: object, name: object) -> Any:
    """The only use of ``builtins.getattr`` allowed: a memory-format enum member by name
    (how some Python versions pickle enum members)."""
    is_enum = isinstance(owner, functools.partial) and owner.func is _memory_format
    if is_enum and isinstance(name, str) and name in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[name][1]
    raise pickle.UnpicklingError("getattr is only allowed for DCP's memory-format enum members")


_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_SHARD_METADATA_MODULE = "torch.distributed._shard.sharded_tensor.metadata"  # torch < 2.2
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MODULE, "Metadata"): _DCPMetadata,
    (_DCP_MODULE, "TensorStorageMetadata"): _DCPTensorEntry,
    (_DCP_MODULE, "ChunkStorageMetadata"): _DCPChunk,
    (_DCP_MODULE, "BytesStorageMetadata"): _DCPBytesEntry,
    (_DCP_MODULE, "MetadataIndex"): _DCPIndex,
    (_DCP_MODULE, "StorageMeta"): _DCPStorageMeta,
    (_DCP_MODULE, "TensorProperties"): _DCPProperties,
    (_DCP_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    (_SHARD_METADATA_MODULE, "TensorProperties"): _DCPProperties,
    (_SHARD_METADATA_MODULE, "MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _DCPStorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "getattr"): _enum_member,
    **{(module, name): _path_text for module in ("pathlib", "pathlib._local") for name in
       _PATH_CLASSES},
}  # fmt: skip


class _ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle references something outside the allow-list."""


def _refuse_bytearray(unpickler: object) -> NoReturn:
    raise pickle.UnpicklingError("bytearrays are not part of DCP's metadata")


class _DCPUnpickler(pickle._Unpickler):
    """Reads DCP's ``.metadata`` into stand-in records. Only the names of
    ``_ALLOWED_GLOBALS`` and torch's dtype, layout and memory-format constants resolve; each
    resolves to a shardwise stand-in or an inert torch value, so nothing from the file runs.

    A pickle can also set attributes on what it loads (BUILD). torch's values are immutable,
    BUILD on a stand-in class fails (they define ``__setstate__``), and functions are handed
    out as a fresh ``functools.partial`` per reference, so no pickle can alter what a later
    one gets.

    It is Python's pure-Python unpickler: the C one allocates what an opcode claims before
    reading it (LONG_BINPUT 0x0fffffff makes it zero 4 GiB for a 10-byte pickle), this one
    keeps its memo in a dict and reads byte strings without allocating their claimed size,
    except BYTEARRAY8, which is refused (DCP's metadata holds no bytearray)."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.BYTEARRAY8[0]: _refuse_bytearray,
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if isinstance(allowed, types.FunctionType):
            return functools.partial(allowed)
        if allowed is not None:
            return allowed
        if module == "torch":
            # vars(), not getattr(): torch's module __getattr__ imports submodules lazily.
            value = vars(torch).get(name)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise _ForbiddenGlobalError(
            f"it references {module}.{name}, which is not part of DCP's metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP's metadata")


# -- opening files below the DCP directory ---------------------------------------------------


class _RefusedFileError(Exception):
    """A path that must not be read: it goes through a symbolic link, or it is not a regular
    file (a directory, FIFO, socket or device)."""


_FILE_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _require(mode: int, shown: str, *, directory: bool) -> None:
    """Refuse a symbolic link, and anything but a directory (or a regular file)."""
    if stat.S_ISLNK(mode):
        raise _RefusedFileError(f"{shown!r} is a symbolic link, which convert-dcp does not follow")
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        kind = next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "a special file")
        expected = "a directory" if directory else "a regular file"
        raise _RefusedFileError(f"{shown!r} is {kind}, not {expected}")


def _open_component(parent: int, name: str, shown: str, *, directory: bool) -> int:
    """Open ``name`` in the directory ``parent`` without following a symbolic link.

    The lstat refuses a link, FIFO or device before anything is opened (opening some devices
    has effects); the fstat of what was opened is the check that counts, since the entry may
    have been replaced in between.
    """
    _require(
        os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode, shown, directory=directory
    )
    fd = os.open(name, _COMPONENT_FLAGS if directory else _FILE_FLAGS, dir_fd=parent)
    try:
        _require(os.fstat(fd).st_mode, shown, directory=directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_regular_file(directory: str, relative: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``relative`` below ``directory``, and its stat.

    ``relative`` is made of checked components (:func:`_relative_path_problem`). ``directory``
    itself was named by the user and may be reached through symbolic links; below it, no
    component is.

    Raises:
        OSError: The file or a directory on the way is missing or cannot be opened.
        _RefusedFileError: A component is a symbolic link, or the file is not a regular file.
    """
    parts = relative.split("/")
    current = os.open(directory, _DIRECTORY_FLAGS)
    try:
        for index, part in enumerate(parts):
            shown = "/".join(parts[: index + 1])
            opened = _open_component(current, part, shown, directory=index < len(parts) - 1)
            current, parent = opened, current
            os.close(parent)
        status = os.fstat(current)
    except BaseException:
        os.close(current)
        raise
    return current, status


def _relative_path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path of normal components, or None."""
    if not path:
        return "it is empty"
    if "\0" in path:
        return "it contains a NUL character"
    if path.startswith("/"):
        return "it is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "it has an empty, '.' or '..' component"
    return None


# -- .metadata -------------------------------------------------------------------------------


def _read_dcp_metadata(directory: str) -> _DCPMetadata:
    path = os.path.join(directory, _DCP_METADATA)
    try:
        fd, status = _open_regular_file(directory, _DCP_METADATA)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise DCPImportError(
            f"{directory} is not a torch.distributed.checkpoint directory: {path} is missing"
        ) from err
    except _RefusedFileError as err:
        raise DCPImportError(f"refusing to read {path}: {err}") from err
    except OSError as err:
        raise DCPImportError(f"cannot open {path}: {err.strerror}") from err
    with open(fd, "rb") as file:
        if status.st_size > _MAX_METADATA_BYTES:
            raise DCPImportError(
                f"refusing to read {path}: it holds {status.st_size} bytes, more than the "
                f"{_MAX_METADATA_BYTES} DCP's metadata could need"
            )
        data = file.read(status.st_size)
    if len(data) != status.st_size:
        raise DCPImportError(f"cannot read {path}: it changed while being read")
    try:
        metadata = _DCPUnpickler(io.BytesIO(data)).load()
    except _ForbiddenGlobalError as err:
        raise DCPImportError(f"refusing to read {path}: {err}") from err
    # Malformed pickles fail in many ways; each is "unreadable input" here.
    except (
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        ValueError,
        LookupError,
        AttributeError,
        RecursionError,
        OverflowError,
        struct.error,
    ) as err:
        raise DCPImportError(f"cannot read {path}: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, _DCPMetadata):
        raise DCPImportError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


def _error(fqn: str, message: str, file: str) -> DCPImportError:
    """The error about the value of ``fqn``, in this module's form: ``'key': message``."""
    return DCPImportError(f"{fqn!r}: {message}", file=file)


def _bounded_ints(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints in ``[0, _MAX_INT)`` (bools are not ints here), or None."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        return None
    if not all(type(v) is int and 0 <= v < _MAX_INT for v in value):
        return None
    return tuple(value)


def _bounded_int(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT


# -- storage ranges --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DCPRange:
    """Where DCP stored one item: ``length`` bytes at ``offset`` of the data file ``file``
    (a checked relative path)."""

    fqn: str
    file: str
    offset: int
    length: int


_StorageKey = tuple[str, tuple[int, ...] | None]


def _dcp_storage(metadata: _DCPMetadata, metadata_path: str) -> dict[_StorageKey, _DCPRange]:
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise DCPImportError(
            "malformed DCP metadata: storage_data is not a dict", file=metadata_path
        )
    ranges = {}
    for key, info in storage.items():
        if not isinstance(key, _DCPIndex) or not isinstance(info, _DCPStorageInfo):
            raise DCPImportError(
                "this DCP checkpoint was not written by FileSystemWriter (unknown storage_data)",
                file=metadata_path,
            )
        fqn, offset = key.get("fqn"), key.get("offset")
        if not isinstance(fqn, str):
            raise DCPImportError(
                f"malformed DCP metadata: a storage key fqn is {_shown(fqn)}", file=metadata_path
            )
        transforms = info.get("transform_descriptors")
        if transforms:
            raise _error(
                fqn,
                f"its storage uses transforms {_shown(transforms)} (e.g. compression), which "
                "convert-dcp does not support",
                metadata_path,
            )
        file, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(file, str) or not _bounded_int(start) or not _bounded_int(length):
            raise _error(
                fqn,
                f"malformed DCP metadata: its storage is at relative_path {_shown(file)}, "
                f"offset {_shown(start)}, length {_shown(length)} (expected a path and "
                f"integers in [0, 2**62))",
                metadata_path,
            )
        problem = _relative_path_problem(file)
        if problem is not None:
            raise _error(
                fqn,
                f"its storage path {file!r} is not a plain path inside the checkpoint "
                f"directory: {problem}",
                metadata_path,
            )
        index = None if offset is None else _bounded_ints(offset)
        if offset is not None and index is None:
            raise _error(
                fqn, f"malformed DCP metadata: a storage offset is {_shown(offset)}", metadata_path
            )
        ranges[(fqn, index)] = _DCPRange(fqn, file, start, length)
    return ranges


def _check_storage_files(directory: str, ranges: Iterable[_DCPRange]) -> None:
    """Check that every range lies inside its data file and that no two ranges of one file
    overlap: then every range's bytes are its own, and all ranges together hold at most the
    bytes of the files.

    Files are told apart by device and inode, so hard links to one file share its bytes.
    """
    by_path: dict[str, list[_DCPRange]] = {}
    for where in ranges:
        by_path.setdefault(where.file, []).append(where)
    by_inode: dict[tuple[int, int], list[_DCPRange]] = {}
    for relative, in_file in by_path.items():
        path = os.path.join(directory, relative)
        fd, status = _open_data_file(directory, relative, in_file[0].fqn)
        os.close(fd)
        for where in in_file:
            if where.offset + where.length > status.st_size:
                raise _error(
                    where.fqn,
                    f"its DCP storage range ({where.length} bytes at offset {where.offset}) "
                    f"reaches past the end of its data file ({status.st_size} bytes): the "
                    "file is truncated or the metadata is corrupt",
                    path,
                )
        by_inode.setdefault((status.st_dev, status.st_ino), []).extend(in_file)
    for in_file in by_inode.values():
        spans = sorted((w for w in in_file if w.length), key=lambda w: (w.offset, w.length))
        # Sorted by offset, a range that overlaps a later one overlaps its successor.
        for before, after in itertools.pairwise(spans):
            if after.offset < before.offset + before.length:
                raise _error(
                    after.fqn,
                    f"its DCP storage range ({after.length} bytes at offset {after.offset}) "
                    f"overlaps that of {before.fqn!r} ({before.length} bytes at offset "
                    f"{before.offset}) in the same data file",
                    os.path.join(directory, after.file),
                )


def _open_data_file(directory: str, relative: str, fqn: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the data file ``relative`` of ``fqn``, and its stat."""
    path = os.path.join(directory, relative)
    try:
        fd, status = _open_regular_file(directory, relative)
    except FileNotFoundError as err:
        raise _error(fqn, "its DCP data file is missing", path) from err
    except _RefusedFileError as err:
        raise _error(fqn, f"refusing to read its DCP data file: {err}", path) from err
    except OSError as err:
        raise _error(fqn, f"cannot open its DCP data file: {err.strerror}", path) from err
    return fd, status


def _read_range(directory: str, where: _DCPRange) -> bytes:
    path = os.path.join(directory, where.file)
    fd, status = _open_data_file(directory, where.file, where.fqn)
    with open(fd, "rb") as file:
        # Checked when the reader was created; the file may have changed since.
        if where.offset + where.length <= status.st_size:
            file.seek(where.offset)
            data = file.read(where.length)
        else:
            data = b""
    if len(data) != where.length:
        raise _error(
            where.fqn,
            f"its DCP data file is truncated (read {len(data)} of {where.length} bytes at "
            f"offset {where.offset})",
            path,
        )
    return data


# -- tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DCPChunkPlan:
    """A non-empty chunk of a tensor and where its payload is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    where: _DCPRange


@dataclass(frozen=True, slots=True)
class _DCPTensorPlan:
    """A tensor entry, checked: its chunks tile it, and each chunk's bytes fit in its range."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[_DCPChunkPlan, ...]
    requires_grad: bool


def _plan_tensor(
    fqn: str,
    entry: _DCPTensorEntry,
    ranges: Mapping[_StorageKey, _DCPRange],
    metadata_path: str,
) -> _DCPTensorPlan:
    def malformed(what: str) -> DCPImportError:
        return _error(fqn, f"malformed DCP metadata: {what}", metadata_path)

    properties = entry.get("properties")
    dtype = properties.get("dtype") if isinstance(properties, _DCPProperties) else None
    if not isinstance(dtype, torch.dtype):
        raise malformed("it has no dtype")
    size = _bounded_ints(entry.get("size"))
    if size is None:
        raise malformed(
            f"its size is {_shown(entry.get('size'))} (expected at most {_MAX_DIMS} integers "
            "in [0, 2**62))"
        )
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, _DCPChunk) for c in chunks):
        raise malformed(f"its chunks are {_shown(chunks)}")
    planned = []
    for chunk in chunks:
        offsets, sizes = _bounded_ints(chunk.get("offsets")), _bounded_ints(chunk.get("sizes"))
        if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(size):
            raise malformed(
                f"a chunk has offsets {_shown(chunk.get('offsets'))} and sizes "
                f"{_shown(chunk.get('sizes'))} (expected {len(size)} integers in [0, 2**62) each)"
            )
        if math.prod(sizes) == 0:
            continue  # holds no elements: nothing to place, nothing to read
        where = ranges.get((fqn, offsets))
        if where is None:
            raise _error(fqn, f"no storage for the chunk at offsets {list(offsets)}", metadata_path)
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes > where.length:
            raise _error(
                fqn,
                f"the chunk at offsets {list(offsets)} holds {nbytes} bytes of {dtype}, more "
                f"than its {where.length}-byte storage range",
                metadata_path,
            )
        planned.append(_DCPChunkPlan(offsets, sizes, where))
    _check_tiling(fqn, size, planned, metadata_path)
    requires_grad = properties.get("requires_grad") is True
    return _DCPTensorPlan(dtype, size, tuple(planned), requires_grad)


def _check_tiling(
    fqn: str, size: tuple[int, ...], chunks: list[_DCPChunkPlan], metadata_path: str
) -> None:
    """Check that the non-empty chunks tile a tensor of ``size``: inside it, no two sharing an
    element, together covering it. Counting covered elements is not enough: overlapping
    chunks would leave a gap of uninitialized memory."""
    if not chunks:
        if math.prod(size) == 0:
            return
        raise _error(
            fqn, f"its DCP chunks hold no elements of its size {list(size)}", metadata_path
        )
    boxes = [ShardMetadata(list(chunk.offsets), list(chunk.sizes)) for chunk in chunks]
    try:
        validate_non_overlapping_shards_metadata(boxes)
        check_tensor(boxes, list(size))
    except ValueError as err:
        raise _error(
            fqn, f"its DCP chunks do not tile its size {list(size)}: {err}", metadata_path
        ) from err


def _dcp_tensor(directory: str, fqn: str, plan: _DCPTensorPlan, metadata_path: str) -> torch.Tensor:
    try:
        result = torch.empty(plan.size, dtype=plan.dtype)
    except RuntimeError as err:
        raise _error(fqn, f"cannot allocate it: {_first_line(err)}", metadata_path) from err
    for chunk in plan.chunks:
        path = os.path.join(directory, chunk.where.file)
        data = _torch_load(_read_range(directory, chunk.where), fqn, path)
        matches = (
            isinstance(data, torch.Tensor)
            and data.layout == torch.strided
            and not data.is_nested
            and data.device.type == "cpu"
            and data.dtype == plan.dtype
            and data.shape == chunk.sizes
        )
        if not matches:
            found = (
                f"{data.dtype} {list(data.shape)} ({data.layout} on {data.device})"
                if isinstance(data, torch.Tensor) and not data.is_nested
                else type(data).__name__
            )
            raise _error(
                fqn,
                f"the chunk at offsets {list(chunk.offsets)} holds {found}, the metadata says "
                f"{plan.dtype} {list(chunk.sizes)}",
                path,
            )
        region = result[
            tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        ]
        try:
            region.copy_(data.detach())
        except RuntimeError as err:
            raise _error(
                fqn, f"the chunk at offsets {list(chunk.offsets)}: {_first_line(err)}", path
            ) from err
    if plan.requires_grad and (plan.dtype.is_floating_point or plan.dtype.is_complex):
        result.requires_grad_(True)
    return result


# -- payloads --------------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _archive_problem(payload: bytes) -> str | None:
    """Why ``torch.load`` could allocate more than ``payload`` holds, or None.

    torch's reader allocates each record's size as the archive's central directory states it,
    before inflating the record, so a small compressed record could claim gigabytes. The
    records are checked here with Python's ``zipfile``, which reads the same central directory
    as torch's reader (miniz) only if the directory sits right before the end records, as
    torch.save writes it; that layout is required first. Then every record must be stored
    uncompressed, and all records together must fit in the payload.
    """
    end = len(payload) - _ZIP_END.size
    if end < 0 or not payload.startswith(_ZIP_END_SIGNATURE, end):
        return "it does not end with a zip end record"
    *_, directory_size, directory_offset, comment_size = _ZIP_END.unpack_from(payload, end)
    if comment_size:
        return "its zip end record has a comment"
    records_start = end
    locator = end - _ZIP64_LOCATOR.size
    if locator >= 0 and payload.startswith(_ZIP64_LOCATOR_SIGNATURE, locator):
        zip64_end = _ZIP64_LOCATOR.unpack_from(payload, locator)[2]
        if zip64_end != locator - _ZIP64_END.size or not payload.startswith(
            _ZIP64_END_SIGNATURE, zip64_end
        ):
            return "its zip64 end record is not right before its locator"
        *_, directory_size, directory_offset = _ZIP64_END.unpack_from(payload, zip64_end)
        records_start = zip64_end
    if directory_offset + directory_size != records_start:
        return "its central directory is not right before its end records"
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            members = archive.infolist()
    except (
        zipfile.BadZipFile,
        NotImplementedError,  # a record needs a newer zip version
        ValueError,
        EOFError,
        OSError,
        struct.error,
    ) as err:
        return f"unreadable zip archive: {_first_line(err)}"
    total = 0
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
            return f"its record {member.filename!r} is compressed"
        total += member.file_size
    if total > len(payload):
        return f"its records claim {total} bytes, more than its {len(payload)}"
    return None


def _torch_load(payload: bytes, fqn: str, path: str, safe: Iterable[type] = ()) -> Any:
    """Decode a ``torch.save`` payload with ``weights_only=True`` (no code runs)."""
    problem = _archive_problem(payload)
    if problem is not None:
        raise _error(fqn, f"its DCP payload is not a torch.save archive ({problem})", path)
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    context = safe_globals(list(safe)) if safe_globals is not None else contextlib.nullcontext()
    try:
        # torch warns about odd payloads (another pickle protocol) and then reads them or
        # fails; either way the warning is noise next to this reader's verdict.
        with context, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    # A malformed payload fails in torch's reader or unpickler in many ways.
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        ValueError,
        TypeError,
        LookupError,
        AttributeError,
        OverflowError,
        struct.error,
    ) as err:
        raise _error(
            fqn,
            f"its DCP payload cannot be read without running pickled code ({_first_line(err)})",
            path,
        ) from err


def _check_json_value(value: object, budget: int, fqn: str, path: str) -> None:
    """Check that ``value`` can be stored as a JSON value of bounded depth and size.

    Walked without recursion, charging each item about the bytes it takes in JSON against
    ``budget``, so the walk stops early on a value that expands past it.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_OBJECT_DEPTH:
            raise _error(fqn, f"its value nests deeper than {_MAX_OBJECT_DEPTH} levels", path)
        budget -= 1
        not_json = None
        if isinstance(item, str):
            budget -= len(item)
        elif isinstance(item, int):
            budget -= item.bit_length() // 8
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    not_json = f"a dict with a key of type {type(key).__name__}"
                    break
                budget -= len(key)
                stack.append((child, depth + 1))
        elif not (item is None or isinstance(item, float)):
            not_json = f"a {type(item).__name__}"
        if not_json is not None:
            what = not_json if item is value else f"a {type(value).__name__} containing {not_json}"
            raise _error(
                fqn,
                f"holds {what}, which a shardwise checkpoint stores only with pickle; "
                "convert-dcp does not pickle",
                path,
            )
        if budget < 0:
            raise _error(
                fqn,
                f"its value is more than {_MAX_OBJECT_EXPANSION} times larger than its payload "
                "(the payload repeats shared parts)",
                path,
            )


def _dcp_object(directory: str, where: _DCPRange) -> Any:
    payload = _read_range(directory, where)
    if not payload.startswith(_ZIP_MAGIC):
        return payload  # raw bytes (a planner that does not torch.save its objects)
    # DCP's default planner stores every non-tensor value as torch.save(value).
    path = os.path.join(directory, where.file)
    value = _torch_load(payload, where.fqn, path, safe=[io.BytesIO])
    if isinstance(value, (bytes, io.BytesIO)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    _check_json_value(value, _MAX_OBJECT_EXPANSION * len(payload), where.fqn, path)
    return value


class DCPReader:
    """A DCP checkpoint directory opened for reading; no pickled code from it ever runs.

    Everything the metadata states is checked here, before any value is read: the storage
    ranges against the data files, and each tensor's chunks against its size.

    Args:
        directory: The DCP checkpoint directory (``.metadata`` plus ``*.distcp`` files).

    Raises:
        DCPImportError: ``.metadata`` is missing, malformed, or references anything outside
            DCP's metadata classes; its storage uses transforms, paths outside ``directory``
            or through symbolic links, files that are not regular files, or byte ranges
            outside their files or overlapping; or a tensor's chunks do not tile it.

    Example::

        reader = DCPReader("/checkpoints/step-100")
        state_dict = {key: reader.read(key) for key in reader.keys}
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        metadata_path = os.path.join(directory, _DCP_METADATA)
        metadata = _read_dcp_metadata(directory)
        entries = metadata.get("state_dict_metadata")
        if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
            raise DCPImportError(
                "malformed DCP metadata: state_dict_metadata is not a dict of keys",
                file=metadata_path,
            )
        ranges = _dcp_storage(metadata, metadata_path)
        _check_storage_files(directory, ranges.values())
        self._metadata_path = metadata_path
        self._entries: dict[str, _DCPTensorPlan | _DCPRange] = {}
        for fqn, entry in entries.items():
            if isinstance(entry, _DCPTensorEntry):
                self._entries[fqn] = _plan_tensor(fqn, entry, ranges, metadata_path)
            elif isinstance(entry, _DCPBytesEntry):
                where = ranges.get((fqn, None))
                if where is None:
                    raise _error(fqn, "no storage for this object", metadata_path)
                self._entries[fqn] = where
            else:
                raise _error(
                    fqn, f"malformed DCP metadata: it is a {type(entry).__name__}", metadata_path
                )

    @property
    def keys(self) -> list[str]:
        """The keys of the saved state dict, in the metadata's order."""
        return list(self._entries)

    def is_tensor(self, fqn: str) -> bool:
        """Whether ``fqn`` was saved as a tensor (else as an object).

        Raises:
            KeyError: ``fqn`` is not one of :attr:`keys`.
        """
        return isinstance(self._entries[fqn], _DCPTensorPlan)

    def read(self, fqn: str) -> Any:
        """The value saved under ``fqn``: a whole CPU tensor assembled from its chunks, or an
        object (``bytes``, ``io.BytesIO`` or a JSON value).

        Raises:
            KeyError: ``fqn`` is not one of :attr:`keys`.
            DCPImportError: A payload is missing, malformed, or needs pickle to be read.
        """
        entry = self._entries[fqn]
        if isinstance(entry, _DCPTensorPlan):
            return _dcp_tensor(self.directory, fqn, entry, self._metadata_path)
        return _dcp_object(self.directory, entry)
