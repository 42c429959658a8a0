"""DCP's ``.metadata`` unpickled into inert stand-ins: an allow-list of records of its fields."""

from __future__ import annotations

import functools
import os
import pickle
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

import torch

__all__ = [
    "DCPBytesEntry",
    "DCPChunk",
    "DCPIndex",
    "DCPMetadata",
    "DCPProperties",
    "DCPStorageInfo",
    "DCPTensorEntry",
    "DCPUnpickler",
    "ForbiddenGlobalError",
    "layout",
]


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


class DCPMetadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class DCPTensorEntry(_Record):
    FIELDS = ("properties", "size", "chunks")


class DCPChunk(_Record):
    FIELDS = ("offsets", "sizes")


class DCPBytesEntry(_Record):
    FIELDS = ()


class DCPIndex(_Record):
    FIELDS = ("fqn", "offset", "index")


class DCPStorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class DCPStorageInfo(_Record):
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


class DCPProperties(_Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        # DCP pickles TensorProperties as (dtype, layout, requires_grad, format code, pin).
        if isinstance(state, tuple) and len(state) == 5:
            self._update(dict(zip(self.FIELDS, state, strict=True)))
        else:
            super().__setstate__(state)


def layout(name: object) -> torch.layout:
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
    (_DCP_MODULE, "Metadata"): DCPMetadata,
    (_DCP_MODULE, "TensorStorageMetadata"): DCPTensorEntry,
    (_DCP_MODULE, "ChunkStorageMetadata"): DCPChunk,
    (_DCP_MODULE, "BytesStorageMetadata"): DCPBytesEntry,
    (_DCP_MODULE, "MetadataIndex"): DCPIndex,
    (_DCP_MODULE, "StorageMeta"): DCPStorageMeta,
    (_DCP_MODULE, "TensorProperties"): DCPProperties,
    (_DCP_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    (_SHARD_METADATA_MODULE, "TensorProperties"): DCPProperties,
    (_SHARD_METADATA_MODULE, "MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DCPStorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): layout,
    ("builtins", "getattr"): _enum_member,
    **{(module, name): _path_text for module in ("pathlib", "pathlib._local") for name in
       _PATH_CLASSES},
}  # fmt: skip


class ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle references something outside the allow-list."""


def _refuse_bytearray(unpickler: object) -> NoReturn:
    raise pickle.UnpicklingError("bytearrays are not part of DCP's metadata")


class DCPUnpickler(pickle._Unpickler):
    """Reads DCP's ``.metadata`` into stand-ins: only ``_ALLOWED_GLOBALS`` and torch's dtype,
    layout and memory-format constants resolve, so nothing from the file runs.

    No BUILD alters what a later pickle gets: torch's values are immutable, BUILD on a stand-in
    class fails (it has ``__setstate__``), a function reference is a fresh ``functools.partial``.

    It is the pure-Python unpickler: the C one allocates what an opcode claims before reading
    it (LONG_BINPUT 0x0fffffff zeroes 4 GiB for a 10-byte pickle); this one keeps its memo in a
    dict and never allocates a byte string's claimed size, except BYTEARRAY8, refused here."""

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
        raise ForbiddenGlobalError(
            f"it references {module}.{name}, which is not part of DCP's metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP's metadata")
