"""Shard and tensor metadata: :class:`ShardMetadata`, :class:`TensorProperties`,
:class:`ShardedTensorMetadata`, their pickling and their versioned JSON form.

The JSON spelling of torch's enums and the strict readers live in :mod:`shardwise._codec`,
shared with the checkpoint index.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardwise._codec import (
    JSON_VERSION,
    LAYOUTS,
    MEMORY_FORMAT_NAMES,
    MEMORY_FORMATS,
    check_bool,
    check_keys,
    dtype_from_name,
    dtype_name,
    int_list,
    lookup,
    unwrap,
    wrap,
)
from shardwise.errors import MetadataFormatError
from shardwise.placement import RemoteDevice

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = [
    "JSON_VERSION",
    "MEM_FORMAT_ENCODING",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "dtype_from_name",
    "dtype_name",
    "keeps_requires_grad",
]


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


def keeps_requires_grad(requires_grad: bool, dtype: torch.dtype, *, new_leaf: bool = False) -> bool:
    """Whether a tensor made in ``dtype`` from one with ``requires_grad`` requires grad too.

    Only floating and complex tensors can require grad. A copy (``clone``, ``to``,
    ``type_as``) is recorded by autograd only in grad mode; a new leaf (``new_leaf=True``:
    ``zeros_like(..., requires_grad=True)``, a stand-in the op under test then runs on) keeps
    the flag in any mode. The answer depends only on values every rank knows, so every rank
    agrees on it, shards or not.
    """
    differentiable = dtype.is_floating_point or dtype.is_complex
    return requires_grad and differentiable and (new_leaf or torch.is_grad_enabled())


class _VersionedJson:
    """``to_json``/``from_json`` over a class's ``to_dict``/``from_dict``: the versioned
    document of :func:`shardwise._codec.wrap`, whose kind is the class's name."""

    __slots__ = ()
    _JSON_KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: object) -> Self:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def to_json(self) -> str:
        """The versioned JSON form."""
        return wrap(self._JSON_KIND, self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return cls.from_dict(unwrap(text, cls._JSON_KIND))


@dataclass(slots=True)
class ShardMetadata(_VersionedJson):
    """Offsets, sizes and placement of one shard of a sharded tensor.

    Args:
        shard_offsets: Offset of the shard in the global tensor, one entry per dim.
        shard_sizes: Size of the shard, one entry per dim; zeros are allowed.
        placement: Where the shard lives; a string is parsed by :class:`RemoteDevice`.

    Raises:
        ValueError: The lengths differ, or an offset or a size is negative.
    """

    _JSON_KIND: ClassVar[str] = "ShardMetadata"

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
        body = check_keys(data, ("offsets", "sizes", "placement"), "ShardMetadata")
        placement = body["placement"]
        if placement is not None and not isinstance(placement, str):
            raise MetadataFormatError(
                f"ShardMetadata placement must be a string, got {placement!r}"
            )
        offsets = int_list(body["offsets"], "ShardMetadata offsets")
        sizes = int_list(body["sizes"], "ShardMetadata sizes")
        try:
            # RemoteDevice lets torch.device's RuntimeError through for a bad device part.
            return cls(offsets, sizes, None if placement is None else RemoteDevice(placement))
        except (ValueError, RuntimeError) as err:
            raise MetadataFormatError(f"invalid ShardMetadata {dict(body)!r}: {err}") from err


@dataclass
class TensorProperties(_VersionedJson):
    """Properties of a whole tensor that its shards share.

    ``dtype`` defaults to the default dtype at construction time (not at import time).
    """

    _JSON_KIND: ClassVar[str] = "TensorProperties"

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
            memory_format = MEMORY_FORMAT_NAMES.get(self.memory_format)
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
        body = check_keys(
            data,
            ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
            "TensorProperties",
        )
        return cls(
            dtype=dtype_from_name(body["dtype"]),
            layout=lookup(LAYOUTS, body["layout"], "layout"),
            requires_grad=check_bool(body["requires_grad"], "TensorProperties requires_grad"),
            memory_format=lookup(MEMORY_FORMATS, body["memory_format"], "memory format"),
            pin_memory=check_bool(body["pin_memory"], "TensorProperties pin_memory"),
        )


@dataclass
class ShardedTensorMetadata(_VersionedJson):
    """The global view of a sharded tensor: every shard, the global size and its properties."""

    _JSON_KIND: ClassVar[str] = "ShardedTensorMetadata"

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
        body = check_keys(data, ("shards", "size", "tensor_properties"), "ShardedTensorMetadata")
        shards = body["shards"]
        if not isinstance(shards, list):
            raise MetadataFormatError(
                f"ShardedTensorMetadata shards must be a list, got {shards!r}"
            )
        return cls(
            shards_metadata=[ShardMetadata.from_dict(shard) for shard in shards],
            size=torch.Size(int_list(body["size"], "ShardedTensorMetadata size")),
            tensor_properties=TensorProperties.from_dict(body["tensor_properties"]),
        )
