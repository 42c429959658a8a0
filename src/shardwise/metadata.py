"""Shard and tensor metadata: :class:`ShardMetadata`, :class:`TensorProperties`,
:class:`ShardedTensorMetadata`, their pickling and their versioned JSON form.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.errors import MetadataFormatError
from shardwise.placement import RemoteDevice

__all__ = [
    "JSON_VERSION",
    "MEM_FORMAT_ENCODING",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "dtype_from_name",
    "dtype_name",
]

#: Version of the JSON form written by ``to_json``; readers reject any other.
JSON_VERSION = 1


class MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - upstream spelling, part of the pickle form
    """Picklable stand-in for ``torch.memory_format``, which does not pickle."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_FORMAT_TO_ENCODING = {
    torch.contiguous_format: MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
    torch.channels_last: MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
    torch.preserve_format: MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT,
}
_ENCODING_TO_FORMAT = {enc: fmt for fmt, enc in _FORMAT_TO_ENCODING.items()}

# Name tables for the JSON form. Every dtype torch exposes is listed under its canonical
# name (``str(dtype)`` without ``torch.``), so aliases such as ``torch.float`` map to one name.
_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}
_LAYOUTS: dict[str, torch.layout] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.layout)
}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, torch.memory_format) and name != "legacy_contiguous_format"
}
_MEMORY_FORMAT_NAMES = {value: name for name, value in _MEMORY_FORMATS.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical JSON name of ``dtype`` (``torch.float`` → ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    """The dtype called ``name`` in the JSON form; :class:`MetadataFormatError` if unknown."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise MetadataFormatError(f"unknown dtype name {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _lookup(table: Mapping[str, Any], name: object, what: str) -> Any:
    if not isinstance(name, str) or name not in table:
        raise MetadataFormatError(f"unknown {what} {name!r}; expected one of {sorted(table)}")
    return table[name]


def _check_keys(data: object, required: Sequence[str], what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise MetadataFormatError(f"{what} must be a JSON object, got {type(data).__name__}")
    keys = set(data)
    unknown = keys - set(required)
    if unknown:
        raise MetadataFormatError(f"unknown keys {sorted(unknown)} in {what}")
    missing = [key for key in required if key not in keys]
    if missing:
        raise MetadataFormatError(f"missing keys {missing} in {what}")
    return data


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MetadataFormatError(f"{what} must be a list of integers, got {value!r}")
    return list(value)


def _check_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise MetadataFormatError(f"{what} must be true or false, got {value!r}")
    return value


def _wrap(kind: str, body: dict[str, Any]) -> str:
    return json.dumps({"kind": kind, "version": JSON_VERSION, "value": body}, sort_keys=True)


def _unwrap(text: str | bytes, kind: str) -> Any:
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        # Bytes that are not UTF-8 fail before the JSON parser sees them.
        raise MetadataFormatError(f"{kind} JSON is not valid JSON: {err}") from err
    document = _check_keys(document, ("kind", "version", "value"), f"{kind} JSON document")
    if document["kind"] != kind:
        raise MetadataFormatError(f"expected a {kind} JSON document, got kind {document['kind']!r}")
    version = document["version"]
    # ``true == 1`` and ``1.0 == 1`` in Python: only the integer itself is version 1.
    if type(version) is not int or version != JSON_VERSION:
        raise MetadataFormatError(
            f"unsupported {kind} JSON version {version!r}; "
            f"this shardwise reads version {JSON_VERSION}"
        )
    return document["value"]


@dataclass(slots=True)
class ShardMetadata:
    """Offsets, sizes and placement of one shard of a sharded tensor.

    Args:
        shard_offsets: Offset of the shard in the global tensor, one entry per dim.
        shard_sizes: Size of the shard, one entry per dim; zeros are allowed.
        placement: Where the shard lives; a string is parsed by :class:`RemoteDevice`.

    Raises:
        ValueError: The lengths differ, or an offset or a size is negative.
    """

    shard_offsets: list[int]
    shard_sizes: list[int]
    placement: RemoteDevice | None = None

    def __post_init__(self) -> None:
        if self.placement is not None and not isinstance(self.placement, RemoteDevice):
            # A string, or torch's own ``_remote_device`` (code migrating from upstream).
            self.placement = RemoteDevice(self.placement)
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(
                "shard_offsets and shard_sizes should have the same number of elements, found "
                f"{len(self.shard_offsets)} and {self.shard_sizes} respectively"
            )
        # Dim by dim, offset before size: the first bad dim decides which error is raised.
        for offset, size in zip(self.shard_offsets, self.shard_sizes, strict=False):
            if offset < 0:
                raise ValueError("shard_offsets should be >=0")
            if size < 0:
                raise ValueError("shard_sizes should be >= 0")

    def __hash__(self) -> int:
        return hash((tuple(self.shard_offsets), tuple(self.shard_sizes), self.placement))

    def to_dict(self) -> dict[str, Any]:
        """This shard as a plain JSON-able dict (the body of the JSON form)."""
        return {
            "offsets": [int(v) for v in self.shard_offsets],
            "sizes": [int(v) for v in self.shard_sizes],
            "placement": None if self.placement is None else str(self.placement),
        }

    @classmethod
    def from_dict(cls, data: object) -> ShardMetadata:
        """Inverse of :meth:`to_dict`; :class:`MetadataFormatError` on a malformed dict."""
        body = _check_keys(data, ("offsets", "sizes", "placement"), "ShardMetadata")
        placement = body["placement"]
        if placement is not None and not isinstance(placement, str):
            raise MetadataFormatError(
                f"ShardMetadata placement must be a string, got {placement!r}"
            )
        offsets = _int_list(body["offsets"], "ShardMetadata offsets")
        sizes = _int_list(body["sizes"], "ShardMetadata sizes")
        try:
            # RemoteDevice lets torch.device's RuntimeError through for a bad device part.
            return cls(offsets, sizes, None if placement is None else RemoteDevice(placement))
        except (ValueError, RuntimeError) as err:
            raise MetadataFormatError(f"invalid ShardMetadata {dict(body)!r}: {err}") from err

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("ShardMetadata", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardMetadata:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return cls.from_dict(_unwrap(text, "ShardMetadata"))


@dataclass
class TensorProperties:
    """Properties of a whole tensor that its shards share.

    ``dtype`` defaults to the default dtype at construction time (not at import time).
    """

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(
        self,
    ) -> tuple[torch.dtype, torch.layout, bool, MEM_FORMAT_ENCODING, bool]:
        encoding = None
        # The isinstance guard keeps an unhashable value from failing with a TypeError.
        if isinstance(self.memory_format, torch.memory_format):
            encoding = _FORMAT_TO_ENCODING.get(self.memory_format)
        if encoding is None:
            raise RuntimeError(f"Invalid torch.memory_format: {self.memory_format}")
        return (self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory)

    def __setstate__(
        self, state: tuple[torch.dtype, torch.layout, bool, MEM_FORMAT_ENCODING, bool]
    ) -> None:
        dtype, layout, requires_grad, encoding, pin_memory = state
        memory_format = None
        if isinstance(encoding, MEM_FORMAT_ENCODING):
            memory_format = _ENCODING_TO_FORMAT.get(encoding)
        if memory_format is None:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding}")
        self.dtype = dtype
        self.layout = layout
        self.requires_grad = requires_grad
        self.memory_format = memory_format
        self.pin_memory = pin_memory

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        """Properties of ``tensor`` (memory format recorded as contiguous)."""
        return TensorProperties(
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
            memory_format=torch.contiguous_format,
            pin_memory=tensor.is_pinned(),
        )

    def to_dict(self) -> dict[str, Any]:
        """These properties as a plain JSON-able dict."""
        memory_format = None
        if isinstance(self.memory_format, torch.memory_format):
            memory_format = _MEMORY_FORMAT_NAMES.get(self.memory_format)
        if memory_format is None:
            raise RuntimeError(f"Invalid torch.memory_format: {self.memory_format}")
        # Refuse to write what from_dict would refuse to read.
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorProperties.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.layout, torch.layout):
            raise TypeError(f"TensorProperties.layout must be a torch.layout, got {self.layout!r}")
        return {
            "dtype": dtype_name(self.dtype),
            "layout": str(self.layout).removeprefix("torch."),
            "requires_grad": bool(self.requires_grad),
            "memory_format": memory_format,
            "pin_memory": bool(self.pin_memory),
        }

    @classmethod
    def from_dict(cls, data: object) -> TensorProperties:
        """Inverse of :meth:`to_dict`; :class:`MetadataFormatError` on a malformed dict."""
        body = _check_keys(
            data,
            ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
            "TensorProperties",
        )
        return cls(
            dtype=dtype_from_name(body["dtype"]),
            layout=_lookup(_LAYOUTS, body["layout"], "layout"),
            requires_grad=_check_bool(body["requires_grad"], "TensorProperties requires_grad"),
            memory_format=_lookup(_MEMORY_FORMATS, body["memory_format"], "memory format"),
            pin_memory=_check_bool(body["pin_memory"], "TensorProperties pin_memory"),
        )

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("TensorProperties", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> TensorProperties:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return cls.from_dict(_unwrap(text, "TensorProperties"))


@dataclass
class ShardedTensorMetadata:
    """The global view of a sharded tensor: every shard, the global size and its properties."""

    shards_metadata: list[ShardMetadata] = field(default_factory=list)
    size: torch.Size = field(default_factory=torch.Size)
    tensor_properties: TensorProperties = field(default_factory=TensorProperties)

    def to_dict(self) -> dict[str, Any]:
        """This metadata as a plain JSON-able dict."""
        return {
            "shards": [shard.to_dict() for shard in self.shards_metadata],
            "size": [int(v) for v in self.size],
            "tensor_properties": self.tensor_properties.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: object) -> ShardedTensorMetadata:
        """Inverse of :meth:`to_dict`; :class:`MetadataFormatError` on a malformed dict."""
        body = _check_keys(data, ("shards", "size", "tensor_properties"), "ShardedTensorMetadata")
        shards = body["shards"]
        if not isinstance(shards, list):
            raise MetadataFormatError(
                f"ShardedTensorMetadata shards must be a list, got {shards!r}"
            )
        return cls(
            shards_metadata=[ShardMetadata.from_dict(shard) for shard in shards],
            size=torch.Size(_int_list(body["size"], "ShardedTensorMetadata size")),
            tensor_properties=TensorProperties.from_dict(body["tensor_properties"]),
        )

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("ShardedTensorMetadata", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardedTensorMetadata:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return cls.from_dict(_unwrap(text, "ShardedTensorMetadata"))
