"""Checkpoint metadata: the classes of ``torch.distributed.checkpoint.metadata``, mirrored, and
their versioned JSON forms, the largest of which (:class:`Metadata`) is the checkpoint index.

The classes have DCP's fields, defaults, equality and repr. :class:`TensorProperties` is the
one class of :mod:`shardwise.metadata`, shared with the sharded-tensor metadata. Each class
converts to and from DCP's own class (``to_dcp`` / ``from_dcp``) for code that hands metadata
to ``torch.distributed.checkpoint``.

JSON: every class has ``to_dict``/``from_dict`` (the plain JSON-able body) and
``to_json``/``from_json`` (a versioned document). :meth:`Metadata.to_json` writes the
checkpoint index, whose schema is written down in ``docs/format.md``. Readers reject unknown
keys, names and versions with :class:`~shardwise.errors.CheckpointFormatError`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch

from shardwise.errors import CheckpointFormatError, MetadataFormatError
from shardwise.metadata import TensorProperties, _check_keys, _int_list, _unwrap, _wrap

if TYPE_CHECKING:
    import torch.distributed.checkpoint.metadata as dcp

__all__ = [
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "STORAGE_TYPES",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "properties_from_dcp",
    "properties_to_dcp",
]

#: Value of the ``format`` field of a checkpoint index.
INDEX_FORMAT = "shardwise-checkpoint"
#: Version of the checkpoint index written by :meth:`Metadata.to_json`; readers reject others.
INDEX_VERSION = 1

_T = TypeVar("_T")


@contextlib.contextmanager
def _format_errors() -> Iterator[None]:
    """Report the shared JSON helpers' MetadataFormatError as a CheckpointFormatError."""
    try:
        yield
    except CheckpointFormatError:
        raise
    except MetadataFormatError as err:
        raise CheckpointFormatError(str(err)) from err


def _size(values: list[int], what: str) -> torch.Size:
    if any(v < 0 for v in values):
        raise CheckpointFormatError(f"{what} must not be negative, got {values}")
    return torch.Size(values)


def _plain_ints(values: torch.Size, what: str) -> list[int]:
    """``values`` as a list of non-negative ints: what the JSON readers accept."""
    result = [int(v) for v in values]
    if any(v < 0 for v in result):
        raise CheckpointFormatError(f"{what} must not be negative, got {result}")
    return result


def _check_json_value(value: object, where: str) -> None:
    """Refuse values that JSON would not give back unchanged (tuples, NaN, non-str keys...)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{where}: {value!r} has no JSON form")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: JSON object keys must be strings, got {key!r}")
            _check_json_value(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where}: {type(value).__name__} is not JSON-able (use None, bool, int, float, str, "
        f"list or dict with str keys)"
    )


def _reject_constant(name: str) -> Any:
    raise CheckpointFormatError(f"the checkpoint index contains {name}, which is not JSON")


def _load_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{what} is not valid JSON: {err}") from err


def _from_document(text: str | bytes, kind: str, parse: Callable[[object], _T]) -> _T:
    with _format_errors():
        return parse(_unwrap(text, kind))


# -------------------------------------------------------------------------------------------
# DCP interop for the shared TensorProperties (a different class in DCP).
# -------------------------------------------------------------------------------------------


def properties_to_dcp(properties: TensorProperties) -> dcp.TensorProperties:
    """``properties`` as DCP's ``TensorProperties`` (a class of its own in DCP)."""
    from torch.distributed.checkpoint.metadata import TensorProperties as DCPTensorProperties

    return DCPTensorProperties(
        dtype=properties.dtype,
        layout=properties.layout,
        requires_grad=properties.requires_grad,
        memory_format=properties.memory_format,
        pin_memory=properties.pin_memory,
    )


def properties_from_dcp(properties: dcp.TensorProperties) -> TensorProperties:
    """DCP's ``TensorProperties`` as shardwise's (shared with the sharded-tensor metadata)."""
    return TensorProperties(
        dtype=properties.dtype,
        layout=properties.layout,
        requires_grad=properties.requires_grad,
        memory_format=properties.memory_format,
        pin_memory=properties.pin_memory,
    )


# -------------------------------------------------------------------------------------------
# The classes.
# -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ChunkStorageMetadata:
    """One saved chunk of a tensor: where it starts and how big it is, one entry per dim.

    Both fields are stored as ``torch.Size`` (a list or tuple is converted).
    """

    offsets: torch.Size
    sizes: torch.Size

    def __post_init__(self) -> None:
        self.offsets = torch.Size(self.offsets)
        self.sizes = torch.Size(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        """This chunk as a plain JSON-able dict: ``{"offsets": [...], "sizes": [...]}``."""
        offsets = _plain_ints(self.offsets, "ChunkStorageMetadata offsets")
        sizes = _plain_ints(self.sizes, "ChunkStorageMetadata sizes")
        _check_same_ndim(offsets, sizes)
        return {"offsets": offsets, "sizes": sizes}

    @classmethod
    def from_dict(cls, data: object) -> ChunkStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with _format_errors():
            body = _check_keys(data, ("offsets", "sizes"), "ChunkStorageMetadata")
            offsets = _int_list(body["offsets"], "ChunkStorageMetadata offsets")
            sizes = _int_list(body["sizes"], "ChunkStorageMetadata sizes")
        _check_same_ndim(offsets, sizes)
        return cls(
            offsets=_size(offsets, "ChunkStorageMetadata offsets"),
            sizes=_size(sizes, "ChunkStorageMetadata sizes"),
        )

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("ChunkStorageMetadata", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ChunkStorageMetadata:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return _from_document(text, "ChunkStorageMetadata", cls.from_dict)

    def to_dcp(self) -> dcp.ChunkStorageMetadata:
        """The same chunk as ``torch.distributed.checkpoint.metadata.ChunkStorageMetadata``."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as DCPChunk

        return DCPChunk(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))

    @classmethod
    def from_dcp(cls, chunk: dcp.ChunkStorageMetadata) -> ChunkStorageMetadata:
        """The chunk ``chunk`` of DCP as a shardwise chunk."""
        return cls(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


def _check_same_ndim(offsets: list[int], sizes: list[int]) -> None:
    if len(offsets) != len(sizes):
        raise CheckpointFormatError(
            f"ChunkStorageMetadata offsets {offsets} and sizes {sizes} have different lengths"
        )


@dataclass(slots=True)
class TensorStorageMetadata:
    """A saved tensor: its properties, its global size and the chunks it was saved in.

    ``size`` is stored as ``torch.Size``; ``chunks`` stays the list given (planners append to
    it).
    """

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]

    def __post_init__(self) -> None:
        self.size = torch.Size(self.size)

    def _check_chunks(self) -> None:
        """Every chunk has the tensor's number of dims and, unless empty, lies inside it."""
        for chunk in self.chunks:
            if len(chunk.offsets) != len(self.size) or len(chunk.sizes) != len(self.size):
                raise CheckpointFormatError(
                    f"chunk at offsets {list(chunk.offsets)} with sizes {list(chunk.sizes)} "
                    f"does not have the {len(self.size)} dims of a tensor of size "
                    f"{list(self.size)}"
                )
            if math.prod(chunk.sizes) == 0:
                continue  # zero-volume chunks are exempt from bounds, as in ShardMetadata
            for dim, (offset, length, extent) in enumerate(
                zip(chunk.offsets, chunk.sizes, self.size, strict=True)
            ):
                if offset + length > extent:
                    raise CheckpointFormatError(
                        f"chunk at offsets {list(chunk.offsets)} with sizes {list(chunk.sizes)} "
                        f"exceeds dim {dim} of a tensor of size {list(self.size)}"
                    )

    def to_dict(self) -> dict[str, Any]:
        """This tensor entry as a plain JSON-able dict (properties, size, chunks)."""
        size = _plain_ints(self.size, "TensorStorageMetadata size")
        if not isinstance(self.properties, TensorProperties):
            raise TypeError(
                "TensorStorageMetadata.properties must be a shardwise TensorProperties, got "
                f"{type(self.properties).__name__} (convert a DCP one with "
                "TensorStorageMetadata.from_dcp)"
            )
        chunks = [chunk.to_dict() for chunk in self.chunks]
        self._check_chunks()
        return {"properties": self.properties.to_dict(), "size": size, "chunks": chunks}

    @classmethod
    def from_dict(cls, data: object) -> TensorStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with _format_errors():
            body = _check_keys(data, ("properties", "size", "chunks"), "TensorStorageMetadata")
            properties = TensorProperties.from_dict(body["properties"])
            size = _int_list(body["size"], "TensorStorageMetadata size")
        chunks = body["chunks"]
        if not isinstance(chunks, list):
            raise CheckpointFormatError(
                f"TensorStorageMetadata chunks must be a list, got {chunks!r}"
            )
        result = cls(
            properties=properties,
            size=_size(size, "TensorStorageMetadata size"),
            chunks=[ChunkStorageMetadata.from_dict(chunk) for chunk in chunks],
        )
        result._check_chunks()
        return result

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("TensorStorageMetadata", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> TensorStorageMetadata:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return _from_document(text, "TensorStorageMetadata", cls.from_dict)

    def to_dcp(self) -> dcp.TensorStorageMetadata:
        """The same entry as DCP's ``TensorStorageMetadata`` (with DCP's TensorProperties)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata as DCPTensor

        return DCPTensor(
            properties=properties_to_dcp(self.properties),
            size=torch.Size(self.size),
            chunks=[chunk.to_dcp() for chunk in self.chunks],
        )

    @classmethod
    def from_dcp(cls, entry: dcp.TensorStorageMetadata) -> TensorStorageMetadata:
        """DCP's entry ``entry`` as a shardwise entry."""
        return cls(
            properties=properties_from_dcp(entry.properties),
            size=torch.Size(entry.size),
            chunks=[ChunkStorageMetadata.from_dcp(chunk) for chunk in entry.chunks],
        )


@dataclass(slots=True)
class BytesStorageMetadata:
    """A saved non-tensor entry (bytes, or a serialized object)."""

    def to_dict(self) -> dict[str, Any]:
        """The (empty) plain JSON-able dict."""
        return {}

    @classmethod
    def from_dict(cls, data: object) -> BytesStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with _format_errors():
            _check_keys(data, (), "BytesStorageMetadata")
        return cls()

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("BytesStorageMetadata", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> BytesStorageMetadata:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return _from_document(text, "BytesStorageMetadata", cls.from_dict)

    def to_dcp(self) -> dcp.BytesStorageMetadata:
        """DCP's ``BytesStorageMetadata``."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata as DCPBytes

        return DCPBytes()

    @classmethod
    def from_dcp(cls, entry: dcp.BytesStorageMetadata) -> BytesStorageMetadata:
        """DCP's entry ``entry`` as a shardwise entry."""
        return cls()


#: What :attr:`Metadata.state_dict_metadata` maps a key to.
STORAGE_TYPES: TypeAlias = TensorStorageMetadata | BytesStorageMetadata


def _optional_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise CheckpointFormatError(f"{what} must be a string or null, got {value!r}")
    return value


@dataclass(slots=True)
class StorageMeta:
    """Facts about one save or load: checkpoint id, save and load ids, and module names.

    The JSON form stores ``checkpoint_id`` as a string (a path-like value is converted with
    ``os.fspath``).
    """

    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """These facts as a plain JSON-able dict."""
        checkpoint_id = None if self.checkpoint_id is None else os.fspath(self.checkpoint_id)
        for name, value in (
            ("checkpoint_id", checkpoint_id),
            ("save_id", self.save_id),
            ("load_id", self.load_id),
        ):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"StorageMeta.{name} must be a string or None, got {value!r}")
        if not isinstance(self.modules, list) or not all(isinstance(m, str) for m in self.modules):
            raise TypeError(f"StorageMeta.modules must be a list of strings, got {self.modules!r}")
        return {
            "checkpoint_id": checkpoint_id,
            "save_id": self.save_id,
            "load_id": self.load_id,
            "modules": list(self.modules),
        }

    @classmethod
    def from_dict(cls, data: object) -> StorageMeta:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with _format_errors():
            body = _check_keys(
                data, ("checkpoint_id", "save_id", "load_id", "modules"), "StorageMeta"
            )
        modules = body["modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise CheckpointFormatError(
                f"StorageMeta modules must be a list of strings, got {modules!r}"
            )
        return cls(
            checkpoint_id=_optional_str(body["checkpoint_id"], "StorageMeta checkpoint_id"),
            save_id=_optional_str(body["save_id"], "StorageMeta save_id"),
            load_id=_optional_str(body["load_id"], "StorageMeta load_id"),
            modules=list(modules),
        )

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("StorageMeta", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> StorageMeta:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return _from_document(text, "StorageMeta", cls.from_dict)

    def to_dcp(self) -> dcp.StorageMeta:
        """The same facts as DCP's ``StorageMeta``."""
        from torch.distributed.checkpoint.metadata import StorageMeta as DCPStorageMeta

        return DCPStorageMeta(
            checkpoint_id=self.checkpoint_id,
            save_id=self.save_id,
            load_id=self.load_id,
            modules=list(self.modules),
        )

    @classmethod
    def from_dcp(cls, meta: dcp.StorageMeta) -> StorageMeta:
        """DCP's ``meta`` as a shardwise StorageMeta."""
        return cls(
            checkpoint_id=meta.checkpoint_id,
            save_id=meta.save_id,
            load_id=meta.load_id,
            modules=list(meta.modules),
        )


@dataclass(frozen=True, slots=True)
class MetadataIndex:
    """Names one entry of a state dict or of a checkpoint: a key, and for a tensor chunk the
    chunk's offsets.

    Args:
        fqn: Fully qualified name of the entry.
        offset: Offsets of the chunk (converted to ``torch.Size``); None for a whole entry.
        index: Hint: the position of the chunk in its entry's chunk list, probed before a
            search. Ignored by equality and hashing.
    """

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.offset is not None:
            # Frozen: the converted value has to bypass the dataclass's __setattr__.
            object.__setattr__(self, "offset", torch.Size(self.offset))

    def to_dict(self) -> dict[str, Any]:
        """This index as a plain JSON-able dict (the hint included)."""
        if not isinstance(self.fqn, str):
            raise TypeError(f"MetadataIndex.fqn must be a string, got {self.fqn!r}")
        if self.index is not None and (type(self.index) is not int or self.index < 0):
            raise TypeError(f"MetadataIndex.index must be an int >= 0 or None, got {self.index!r}")
        return {
            "fqn": self.fqn,
            "offset": None
            if self.offset is None
            else _plain_ints(self.offset, "MetadataIndex offset"),
            "index": self.index,
        }

    @classmethod
    def from_dict(cls, data: object) -> MetadataIndex:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with _format_errors():
            body = _check_keys(data, ("fqn", "offset", "index"), "MetadataIndex")
            offset = body["offset"]
            if offset is not None:
                offset = _size(_int_list(offset, "MetadataIndex offset"), "MetadataIndex offset")
        fqn = body["fqn"]
        if not isinstance(fqn, str):
            raise CheckpointFormatError(f"MetadataIndex fqn must be a string, got {fqn!r}")
        index = body["index"]
        if index is not None and (type(index) is not int or index < 0):
            raise CheckpointFormatError(
                f"MetadataIndex index must be an integer >= 0 or null, got {index!r}"
            )
        return cls(fqn, offset, index)

    def to_json(self) -> str:
        """The versioned JSON form."""
        return _wrap("MetadataIndex", self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> MetadataIndex:
        """Read the versioned JSON form written by :meth:`to_json`."""
        return _from_document(text, "MetadataIndex", cls.from_dict)

    def to_dcp(self) -> dcp.MetadataIndex:
        """The same index as DCP's ``MetadataIndex``."""
        from torch.distributed.checkpoint.metadata import MetadataIndex as DCPMetadataIndex

        return DCPMetadataIndex(self.fqn, self.offset, self.index)

    @classmethod
    def from_dcp(cls, index: dcp.MetadataIndex) -> MetadataIndex:
        """DCP's ``index`` as a shardwise MetadataIndex."""
        return cls(index.fqn, index.offset, index.index)


def _storage_info_to_json(info: object, where: str) -> Any:
    to_dict = getattr(info, "to_dict", None)
    value = to_dict() if callable(to_dict) else info
    if not isinstance(value, dict):
        raise TypeError(
            f"{where}: storage info must be a dict or have a to_dict() method, got "
            f"{type(info).__name__}"
        )
    _check_json_value(value, where)
    return value


def _entry_to_dict(
    fqn: str, entry: object, storage: dict[MetadataIndex, Any], inlined: set[MetadataIndex]
) -> dict[str, Any]:
    """One ``state_dict_metadata`` entry, with the storage info of its chunks inlined."""

    def attach(target: dict[str, Any], key: MetadataIndex) -> None:
        if key in storage and key not in inlined:
            target["storage"] = _storage_info_to_json(storage[key], f"storage_data[{key}]")
            inlined.add(key)

    if isinstance(entry, TensorStorageMetadata):
        body = entry.to_dict()
        for chunk_body, chunk in zip(body["chunks"], entry.chunks, strict=True):
            attach(chunk_body, MetadataIndex(fqn, chunk.offsets))
        return {"type": "tensor", **body}
    if isinstance(entry, BytesStorageMetadata):
        body = {"type": "bytes"}
        attach(body, MetadataIndex(fqn))
        return body
    raise TypeError(
        f"state_dict_metadata[{fqn!r}] must be a TensorStorageMetadata or a "
        f"BytesStorageMetadata, got {type(entry).__name__}"
    )


def _entry_from_dict(
    fqn: str,
    data: object,
    storage: dict[MetadataIndex, Any],
    storage_info: Callable[[dict[str, Any]], Any],
) -> STORAGE_TYPES:
    """Inverse of :func:`_entry_to_dict`; inlined storage info is collected in ``storage``."""
    where = f"checkpoint index entry {fqn!r}"
    if not isinstance(data, Mapping):
        raise CheckpointFormatError(f"{where} must be a JSON object, got {data!r}")
    body = dict(data)
    kind = body.pop("type", None)

    def collect(key: MetadataIndex, info: object) -> None:
        if not isinstance(info, dict):
            raise CheckpointFormatError(f"{where}: storage info must be a JSON object")
        if key in storage:
            raise CheckpointFormatError(f"{where}: two chunks carry storage info for {key}")
        storage[key] = storage_info(info)

    if kind == "tensor":
        chunks = body.get("chunks")
        infos: list[tuple[int, object]] = []
        if isinstance(chunks, list):
            plain_chunks = []
            for position, chunk in enumerate(chunks):
                if isinstance(chunk, Mapping) and "storage" in chunk:
                    chunk = dict(chunk)
                    infos.append((position, chunk.pop("storage")))
                plain_chunks.append(chunk)
            body["chunks"] = plain_chunks
        with _in_entry(fqn):
            entry = TensorStorageMetadata.from_dict(body)
        for position, info in infos:
            collect(MetadataIndex(fqn, entry.chunks[position].offsets, position), info)
        return entry
    if kind == "bytes":
        info = body.pop("storage", None)
        with _in_entry(fqn):
            bytes_entry = BytesStorageMetadata.from_dict(body)
        if info is not None:
            collect(MetadataIndex(fqn), info)
        return bytes_entry
    raise CheckpointFormatError(f"{where} has unknown type {kind!r}; expected 'tensor' or 'bytes'")


@contextlib.contextmanager
def _in_entry(fqn: str) -> Iterator[None]:
    """Name the entry in errors raised while reading it."""
    try:
        yield
    except CheckpointFormatError as err:
        raise CheckpointFormatError(str(err), key=fqn) from err


@dataclass(slots=True)
class Metadata:
    """Everything a checkpoint holds, without the data: one entry per state-dict key.

    Args:
        state_dict_metadata: Per key, a :class:`TensorStorageMetadata` or a
            :class:`BytesStorageMetadata`.
        planner_data: Data of the planner that wrote the checkpoint (a JSON value for the JSON
            form).
        storage_data: Data of the storage layer. For the JSON form: None, or a mapping from
            :class:`MetadataIndex` to storage info (a dict of JSON values, or an object with
            ``to_dict()``); the info of a chunk or bytes entry is written inside that entry.
        storage_meta: Facts about the save (:class:`StorageMeta`).
        version: Version string of the writer's metadata conventions.
    """

    state_dict_metadata: dict[str, STORAGE_TYPES]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint index as a plain JSON-able dict (see ``docs/format.md``).

        Raises:
            TypeError: A value has no exact JSON form (e.g. a tuple in ``planner_data``).
            CheckpointFormatError: A tensor entry is inconsistent (dims, bounds, negatives).
        """
        if self.version is not None and not isinstance(self.version, str):
            raise TypeError(f"Metadata.version must be a string or None, got {self.version!r}")
        if self.storage_meta is not None and not isinstance(self.storage_meta, StorageMeta):
            raise TypeError(
                f"Metadata.storage_meta must be a StorageMeta or None, got {self.storage_meta!r}"
            )
        _check_json_value(self.planner_data, "Metadata.planner_data")
        storage: dict[MetadataIndex, Any] = {}
        if self.storage_data is not None:
            if not isinstance(self.storage_data, Mapping):
                raise TypeError(
                    "Metadata.storage_data must be None or a mapping from MetadataIndex to "
                    f"storage info, got {type(self.storage_data).__name__}"
                )
            for key, info in self.storage_data.items():
                if not isinstance(key, MetadataIndex):
                    raise TypeError(
                        f"Metadata.storage_data keys must be MetadataIndex, got {key!r}"
                    )
                storage[key] = info
        if not isinstance(self.state_dict_metadata, Mapping):
            raise TypeError("Metadata.state_dict_metadata must be a dict")
        inlined: set[MetadataIndex] = set()
        entries = {}
        for fqn, entry in self.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise TypeError(f"Metadata.state_dict_metadata keys must be strings, got {fqn!r}")
            try:
                entries[fqn] = _entry_to_dict(fqn, entry, storage, inlined)
            except CheckpointFormatError as err:
                raise CheckpointFormatError(str(err), key=fqn) from err
        detached = None
        if self.storage_data is not None:
            detached = [
                {
                    "index": key.to_dict(),
                    "info": _storage_info_to_json(info, f"storage_data[{key}]"),
                }
                for key, info in storage.items()
                if key not in inlined
            ]
        return {
            "format": INDEX_FORMAT,
            "format_version": INDEX_VERSION,
            "version": self.version,
            "storage_meta": None if self.storage_meta is None else self.storage_meta.to_dict(),
            "planner_data": self.planner_data,
            "storage_data": detached,
            "state_dict_metadata": entries,
        }

    @classmethod
    def from_dict(
        cls, data: object, *, storage_info: Callable[[dict[str, Any]], Any] | None = None
    ) -> Metadata:
        """Inverse of :meth:`to_dict`.

        Args:
            data: The parsed index.
            storage_info: Converts each storage info dict (e.g. a dataclass's ``from_dict``);
                by default the dicts are kept as they are.

        Raises:
            CheckpointFormatError: Not a shardwise checkpoint index, an unsupported format
                version, or a malformed, unknown or missing field.
        """
        if not isinstance(data, Mapping):
            raise CheckpointFormatError(
                f"a checkpoint index must be a JSON object, got {type(data).__name__}"
            )
        if data.get("format") != INDEX_FORMAT:
            raise CheckpointFormatError(
                f"not a shardwise checkpoint index: format is {data.get('format')!r}, "
                f"expected {INDEX_FORMAT!r}"
            )
        version = data.get("format_version")
        # Checked before the other fields: a later version may have other fields.
        if type(version) is not int or version != INDEX_VERSION:
            raise CheckpointFormatError(
                f"unsupported checkpoint format version {version!r}; this shardwise reads "
                f"version {INDEX_VERSION} (a newer shardwise may read it)"
            )
        with _format_errors():
            body = _check_keys(
                data,
                (
                    "format",
                    "format_version",
                    "version",
                    "storage_meta",
                    "planner_data",
                    "storage_data",
                    "state_dict_metadata",
                ),
                "checkpoint index",
            )
        convert: Callable[[dict[str, Any]], Any] = storage_info or (lambda info: info)
        meta_version = _optional_str(body["version"], "checkpoint index version")
        storage_meta = body["storage_meta"]
        entries = body["state_dict_metadata"]
        if not isinstance(entries, Mapping):
            raise CheckpointFormatError(
                f"checkpoint index state_dict_metadata must be a JSON object, got {entries!r}"
            )
        storage: dict[MetadataIndex, Any] = {}
        state_dict_metadata = {
            fqn: _entry_from_dict(fqn, entry, storage, convert) for fqn, entry in entries.items()
        }
        detached = body["storage_data"]
        if detached is not None:
            if not isinstance(detached, list):
                raise CheckpointFormatError(
                    f"checkpoint index storage_data must be a list or null, got {detached!r}"
                )
            for item in detached:
                with _format_errors():
                    item_body = _check_keys(item, ("index", "info"), "storage_data item")
                key = MetadataIndex.from_dict(item_body["index"])
                if key in storage:
                    raise CheckpointFormatError(f"storage info for {key} is given twice")
                info = item_body["info"]
                if not isinstance(info, dict):
                    raise CheckpointFormatError(f"storage info for {key} must be a JSON object")
                storage[key] = convert(info)
        elif storage:
            raise CheckpointFormatError(
                "checkpoint index entries carry storage info but storage_data is null"
            )
        return cls(
            state_dict_metadata=state_dict_metadata,
            planner_data=body["planner_data"],
            storage_data=None if detached is None else storage,
            storage_meta=None if storage_meta is None else StorageMeta.from_dict(storage_meta),
            version=meta_version,
        )

    def to_json(self, *, indent: int | None = None) -> str:
        """The checkpoint index (JSON text; compact unless ``indent`` is given)."""
        separators = (",", ":") if indent is None else None
        return json.dumps(self.to_dict(), indent=indent, separators=separators, allow_nan=False)

    @classmethod
    def from_json(
        cls, text: str | bytes, *, storage_info: Callable[[dict[str, Any]], Any] | None = None
    ) -> Metadata:
        """Read a checkpoint index written by :meth:`to_json` (``storage_info`` as in
        :meth:`from_dict`)."""
        return cls.from_dict(_load_json(text, "the checkpoint index"), storage_info=storage_info)

    def to_dcp(self) -> dcp.Metadata:
        """The same metadata as DCP's ``Metadata``; ``storage_data`` keys that are
        :class:`MetadataIndex` become DCP's, the values and ``planner_data`` are passed as
        they are."""
        from torch.distributed.checkpoint.metadata import Metadata as DCPMetadata

        storage_data = self.storage_data
        if isinstance(storage_data, Mapping):
            storage_data = {
                key.to_dcp() if isinstance(key, MetadataIndex) else key: value
                for key, value in storage_data.items()
            }
        return DCPMetadata(
            state_dict_metadata={
                fqn: entry.to_dcp() for fqn, entry in self.state_dict_metadata.items()
            },
            planner_data=self.planner_data,
            storage_data=storage_data,
            storage_meta=None if self.storage_meta is None else self.storage_meta.to_dcp(),
            version=self.version,
        )

    @classmethod
    def from_dcp(cls, metadata: dcp.Metadata) -> Metadata:
        """DCP's ``metadata`` as shardwise metadata (inverse of :meth:`to_dcp`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex as DCPMetadataIndex
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata as DCPTensor

        storage_data = metadata.storage_data
        if isinstance(storage_data, Mapping):
            storage_data = {
                MetadataIndex.from_dcp(key) if isinstance(key, DCPMetadataIndex) else key: value
                for key, value in storage_data.items()
            }
        entries: dict[str, STORAGE_TYPES] = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, DCPTensor):
                entries[fqn] = TensorStorageMetadata.from_dcp(entry)
            else:
                entries[fqn] = BytesStorageMetadata.from_dcp(entry)
        return cls(
            state_dict_metadata=entries,
            planner_data=metadata.planner_data,
            storage_data=storage_data,
            storage_meta=None
            if metadata.storage_meta is None
            else StorageMeta.from_dcp(metadata.storage_meta),
            version=metadata.version,
        )
