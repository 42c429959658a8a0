"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running pickled code.

DCP writes ``.metadata``, a pickle of its ``Metadata``, and ``*.distcp`` data files holding
``torch.save`` payloads at the byte ranges the metadata records (``FileSystemWriter``'s layout).
:class:`DCPReader` unpickles the metadata with an allow-list that resolves every class to an
inert stand-in recording fields, and decodes each payload with ``torch.load(weights_only=True)``,
so nothing from the files executes. See ``docs/cli.md`` (``convert-dcp``) for what is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import pickle
import struct
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from shardwise.errors import DCPImportError

__all__ = ["DCPImportError", "DCPReader"]


_DCP_METADATA = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"


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


class _DCPUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` into stand-in records. Only the names of
    ``_ALLOWED_GLOBALS`` and torch's dtype, layout and memory-format constants resolve; each
    resolves to a shardwise stand-in or an inert torch value, so nothing from the file runs.

    A pickle can also set attributes on what it loads (BUILD). torch's values are immutable,
    BUILD on a stand-in class fails (they define ``__setstate__``), and functions are handed
    out as a fresh ``functools.partial`` per reference, so no pickle can alter what a later
    one gets."""

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


def _read_dcp_metadata(directory: str) -> _DCPMetadata:
    path = os.path.join(directory, _DCP_METADATA)
    if not os.path.isfile(path):
        raise DCPImportError(
            f"{directory} is not a torch.distributed.checkpoint directory: {path} is missing"
        )
    with open(path, "rb") as file:
        data = file.read()
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
        struct.error,
    ) as err:
        raise DCPImportError(f"cannot read {path}: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, _DCPMetadata):
        raise DCPImportError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise DCPImportError(f"malformed DCP metadata: {what} is {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class _DCPRange:
    """Where DCP stored one item."""

    file: str
    offset: int
    length: int


def _dcp_storage(metadata: _DCPMetadata) -> dict[tuple[str, tuple[int, ...] | None], _DCPRange]:
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise DCPImportError("malformed DCP metadata: storage_data is not a dict")
    ranges = {}
    for key, info in storage.items():
        if not isinstance(key, _DCPIndex) or not isinstance(info, _DCPStorageInfo):
            raise DCPImportError(
                "this DCP checkpoint was not written by FileSystemWriter (unknown storage_data)"
            )
        fqn, offset = key.get("fqn"), key.get("offset")
        if not isinstance(fqn, str):
            raise DCPImportError(f"malformed DCP metadata: a storage key fqn is {fqn!r}")
        where = f"the storage of {fqn!r}"
        transforms = info.get("transform_descriptors")
        if transforms:
            raise DCPImportError(
                f"{where} uses transforms {list(transforms)} (e.g. compression), which "
                "convert-dcp does not support"
            )
        file, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(file, str) or type(start) is not int or type(length) is not int:
            raise DCPImportError(f"malformed DCP metadata: {where} is {vars(info)!r}")
        normalized = os.path.normpath(file)
        if os.path.isabs(normalized) or normalized.split(os.sep)[0] == os.pardir:
            raise DCPImportError(f"{where} points outside the checkpoint directory: {file!r}")
        index = None if offset is None else _int_tuple(offset, f"the offset of {where}")
        ranges[(fqn, index)] = _DCPRange(normalized, start, length)
    return ranges


def _read_dcp_range(directory: str, fqn: str, where: _DCPRange) -> bytes:
    path = os.path.join(directory, where.file)
    try:
        with open(path, "rb") as file:
            file.seek(where.offset)
            data = file.read(where.length)
    except FileNotFoundError as err:
        raise DCPImportError(f"{fqn!r}: DCP data file {path} is missing") from err
    if len(data) != where.length:
        raise DCPImportError(
            f"{fqn!r}: DCP data file {path} is truncated (read {len(data)} of {where.length} "
            f"bytes at offset {where.offset})"
        )
    return data


def _torch_load(payload: bytes, fqn: str, safe: Iterable[type] = ()) -> Any:
    """Decode a ``torch.save`` payload with ``weights_only=True`` (no code runs)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    context = safe_globals(list(safe)) if safe_globals is not None else contextlib.nullcontext()
    try:
        with context:
            return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DCPImportError(
            f"{fqn!r}: its DCP payload cannot be read without running pickled code ({first_line})"
        ) from err


def _is_json_value(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


def _dcp_object(directory: str, fqn: str, where: _DCPRange) -> Any:
    payload = _read_dcp_range(directory, fqn, where)
    if not payload.startswith(_ZIP_MAGIC):
        return payload  # raw bytes (a planner that does not torch.save its objects)
    # DCP's default planner stores every non-tensor value as torch.save(value).
    value = _torch_load(payload, fqn, safe=[io.BytesIO])
    if isinstance(value, (bytes, io.BytesIO)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if _is_json_value(value):
        return value
    raise DCPImportError(
        f"{fqn!r} holds a {type(value).__name__}, which a shardwise checkpoint stores only "
        "with pickle; convert-dcp does not pickle"
    )


def _dcp_tensor(
    directory: str,
    fqn: str,
    entry: _DCPTensorEntry,
    ranges: Mapping[tuple[str, tuple[int, ...] | None], _DCPRange],
) -> torch.Tensor:
    properties = entry.get("properties")
    dtype = properties.get("dtype") if isinstance(properties, _DCPProperties) else None
    if not isinstance(dtype, torch.dtype):
        raise DCPImportError(f"malformed DCP metadata: {fqn!r} has no dtype")
    size = _int_tuple(entry.get("size"), f"the size of {fqn!r}")
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, _DCPChunk) for c in chunks):
        raise DCPImportError(f"malformed DCP metadata: the chunks of {fqn!r}")
    result = torch.empty(size, dtype=dtype)
    covered = 0
    for chunk in chunks:
        offsets = _int_tuple(chunk.get("offsets"), f"a chunk offset of {fqn!r}")
        sizes = _int_tuple(chunk.get("sizes"), f"a chunk size of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise DCPImportError(f"malformed DCP metadata: a chunk of {fqn!r} has the wrong dims")
        if math.prod(sizes) == 0:
            continue
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            raise DCPImportError(f"malformed DCP metadata: a chunk of {fqn!r} exceeds its size")
        where = ranges.get((fqn, offsets))
        if where is None:
            raise DCPImportError(f"{fqn!r}: no storage for the chunk at offsets {list(offsets)}")
        data = _torch_load(_read_dcp_range(directory, fqn, where), fqn)
        if not isinstance(data, torch.Tensor) or data.dtype != dtype or data.shape != sizes:
            found = (
                f"{data.dtype} {list(data.shape)}"
                if isinstance(data, torch.Tensor)
                else type(data).__name__
            )
            raise DCPImportError(
                f"{fqn!r}: the chunk at offsets {list(offsets)} holds {found}, the metadata "
                f"says {dtype} {list(sizes)}"
            )
        region = result
        for dim, (offset, length) in enumerate(zip(offsets, sizes, strict=True)):
            region = region.narrow(dim, offset, length)
        region.copy_(data)
        covered += math.prod(sizes)
    if covered != result.numel():
        raise DCPImportError(
            f"{fqn!r}: the DCP chunks cover {covered} of the tensor's {result.numel()} elements"
        )
    if properties.get("requires_grad") is True and (dtype.is_floating_point or dtype.is_complex):
        result.requires_grad_(True)
    return result


class DCPReader:
    """A DCP checkpoint directory opened for reading; no pickled code from it ever runs.

    Args:
        directory: The DCP checkpoint directory (``.metadata`` plus ``*.distcp`` files).

    Raises:
        DCPImportError: ``.metadata`` is missing, malformed, or references anything outside
            DCP's metadata classes; or its storage uses transforms or paths outside
            ``directory``.

    Example::

        reader = DCPReader("/checkpoints/step-100")
        state_dict = {key: reader.read(key) for key in reader.keys}
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        metadata = _read_dcp_metadata(directory)
        entries = metadata.get("state_dict_metadata")
        if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
            raise DCPImportError(
                "malformed DCP metadata: state_dict_metadata is not a dict of keys"
            )
        self._entries: dict[str, Any] = entries
        self._ranges = _dcp_storage(metadata)

    @property
    def keys(self) -> list[str]:
        """The keys of the saved state dict, in the metadata's order."""
        return list(self._entries)

    def is_tensor(self, fqn: str) -> bool:
        """Whether ``fqn`` was saved as a tensor (else as an object)."""
        return isinstance(self._entries[fqn], _DCPTensorEntry)

    def read(self, fqn: str) -> Any:
        """The value saved under ``fqn``: a whole CPU tensor assembled from its chunks, or an
        object (``bytes``, ``io.BytesIO`` or a JSON value).

        Raises:
            DCPImportError: The value is missing, malformed, or needs pickle to be read.
        """
        entry = self._entries[fqn]
        if isinstance(entry, _DCPTensorEntry):
            return _dcp_tensor(self.directory, fqn, entry, self._ranges)
        if isinstance(entry, _DCPBytesEntry):
            where = self._ranges.get((fqn, None))
            if where is None:
                raise DCPImportError(f"{fqn!r}: no storage for this object")
            return _dcp_object(self.directory, fqn, where)
        raise DCPImportError(f"malformed DCP metadata: {fqn!r} is a {type(entry).__name__}")
