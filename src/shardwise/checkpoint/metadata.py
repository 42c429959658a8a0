"""Checkpoint metadata: the classes of ``torch.distributed.checkpoint.metadata``, mirrored
(DCP's fields, defaults, equality and repr; :class:`TensorProperties` is shared with the
sharded-tensor metadata); ``to_dcp`` and :func:`properties_to_dcp` give DCP's own classes
(:func:`properties_from_dcp` ours from DCP's).

Every class has a JSON-able body (``to_dict``/``from_dict``, the rules in :mod:`.metadata_json`);
:class:`Metadata`'s is a whole document, also as text, which no checkpoint reader accepts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from shardwise._codec import check_keys, int_list
from shardwise.checkpoint.metadata_json import (
    INDEX_FORMAT,
    INDEX_VERSION,
    check_chunk_bounds,
    check_json_value,
    check_same_ndim,
    format_errors,
    in_entry,
    index_body,
    load_json,
    optional_str,
    plain_ints,
    size_of,
    storage_info_to_json,
)
from shardwise.errors import CheckpointFormatError
from shardwise.metadata import TensorProperties

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


def properties_from_dcp(properties: Any, dtype: torch.dtype) -> TensorProperties:
    """Ours from DCP's ``TensorProperties``, with ``dtype`` (the tensor's own: DCP's planners
    may leave a stale one in the properties of a write item)."""
    return TensorProperties(
        dtype=dtype,
        layout=properties.layout,
        requires_grad=properties.requires_grad,
        memory_format=properties.memory_format,
        pin_memory=properties.pin_memory,
    )


@dataclass(slots=True)
class ChunkStorageMetadata:
    """One saved chunk of a tensor: its offsets and sizes (``torch.Size``; converted)."""

    offsets: torch.Size
    sizes: torch.Size

    def __post_init__(self) -> None:
        self.offsets = torch.Size(self.offsets)
        self.sizes = torch.Size(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        """This chunk as a plain JSON-able dict: ``{"offsets": [...], "sizes": [...]}``."""
        offsets = plain_ints(self.offsets, "ChunkStorageMetadata offsets")
        sizes = plain_ints(self.sizes, "ChunkStorageMetadata sizes")
        check_same_ndim(offsets, sizes)
        return {"offsets": offsets, "sizes": sizes}

    @classmethod
    def from_dict(cls, data: object) -> ChunkStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with format_errors():
            body = check_keys(data, ("offsets", "sizes"), "ChunkStorageMetadata")
            offsets = int_list(body["offsets"], "ChunkStorageMetadata offsets")
            sizes = int_list(body["sizes"], "ChunkStorageMetadata sizes")
        check_same_ndim(offsets, sizes)
        return cls(
            offsets=size_of(offsets, "ChunkStorageMetadata offsets"),
            sizes=size_of(sizes, "ChunkStorageMetadata sizes"),
        )

    def to_dcp(self) -> dcp.ChunkStorageMetadata:
        """The same chunk as ``torch.distributed.checkpoint.metadata.ChunkStorageMetadata``."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as DCPChunk

        return DCPChunk(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))


@dataclass(slots=True)
class TensorStorageMetadata:
    """A saved tensor: properties, global size (``torch.Size``) and chunks (planners append)."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]

    def __post_init__(self) -> None:
        self.size = torch.Size(self.size)

    def to_dict(self) -> dict[str, Any]:
        """This tensor entry as a plain JSON-able dict (properties, size, chunks)."""
        size = plain_ints(self.size, "TensorStorageMetadata size")
        if not isinstance(self.properties, TensorProperties):
            raise TypeError(
                "TensorStorageMetadata.properties must be a shardwise TensorProperties, got "
                f"{type(self.properties).__name__}"
            )
        chunks = [chunk.to_dict() for chunk in self.chunks]
        check_chunk_bounds(self.size, ((c.offsets, c.sizes) for c in self.chunks))
        return {"properties": self.properties.to_dict(), "size": size, "chunks": chunks}

    @classmethod
    def from_dict(cls, data: object) -> TensorStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with format_errors():
            body = check_keys(data, ("properties", "size", "chunks"), "TensorStorageMetadata")
            properties = TensorProperties.from_dict(body["properties"])
            size = int_list(body["size"], "TensorStorageMetadata size")
        chunks = body["chunks"]
        if not isinstance(chunks, list):
            raise CheckpointFormatError(
                f"TensorStorageMetadata chunks must be a list, got {chunks!r}"
            )
        result = cls(
            properties=properties,
            size=size_of(size, "TensorStorageMetadata size"),
            chunks=[ChunkStorageMetadata.from_dict(chunk) for chunk in chunks],
        )
        check_chunk_bounds(result.size, ((c.offsets, c.sizes) for c in result.chunks))
        return result


@dataclass(slots=True)
class BytesStorageMetadata:
    """A saved non-tensor entry (bytes, or a serialized object)."""

    def to_dict(self) -> dict[str, Any]:
        """The (empty) plain JSON-able dict."""
        return {}

    @classmethod
    def from_dict(cls, data: object) -> BytesStorageMetadata:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with format_errors():
            check_keys(data, (), "BytesStorageMetadata")
        return cls()


#: What :attr:`Metadata.state_dict_metadata` maps a key to.
STORAGE_TYPES: TypeAlias = TensorStorageMetadata | BytesStorageMetadata


@dataclass(slots=True)
class StorageMeta:
    """Facts about one save or load (``checkpoint_id`` is written through ``os.fspath``)."""

    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """These facts as a plain JSON-able dict."""
        checkpoint_id = None if self.checkpoint_id is None else os.fspath(self.checkpoint_id)
        ids = {"checkpoint_id": checkpoint_id, "save_id": self.save_id, "load_id": self.load_id}
        for name, value in ids.items():
            if value is not None and not isinstance(value, str):
                raise TypeError(f"StorageMeta.{name} must be a string or None, got {value!r}")
        if not isinstance(self.modules, list) or not all(isinstance(m, str) for m in self.modules):
            raise TypeError(f"StorageMeta.modules must be a list of strings, got {self.modules!r}")
        return {**ids, "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, data: object) -> StorageMeta:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with format_errors():
            body = check_keys(
                data, ("checkpoint_id", "save_id", "load_id", "modules"), "StorageMeta"
            )
        modules = body["modules"]
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise CheckpointFormatError(
                f"StorageMeta modules must be a list of strings, got {modules!r}"
            )
        names = ("checkpoint_id", "save_id", "load_id")
        ids = (optional_str(body[name], f"StorageMeta {name}") for name in names)
        checkpoint_id, save_id, load_id = ids
        return cls(checkpoint_id, save_id, load_id, list(modules))


@dataclass(frozen=True, slots=True)
class MetadataIndex:
    """Names one entry (by ``fqn``) of a state dict or of a checkpoint.

    Args:
        offset: Offsets of a tensor chunk (converted to ``torch.Size``); None for a whole entry.
        index: Hint: the chunk's position in its entry's chunk list, probed before a search;
            ignored by equality and hashing.
    """

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.offset is not None:
            object.__setattr__(self, "offset", torch.Size(self.offset))  # frozen

    def to_dict(self) -> dict[str, Any]:
        """This index as a plain JSON-able dict (the hint included)."""
        if not isinstance(self.fqn, str):
            raise TypeError(f"MetadataIndex.fqn must be a string, got {self.fqn!r}")
        if self.index is not None and (type(self.index) is not int or self.index < 0):
            raise TypeError(f"MetadataIndex.index must be an int >= 0 or None, got {self.index!r}")
        offset = None if self.offset is None else plain_ints(self.offset, "MetadataIndex offset")
        return {"fqn": self.fqn, "offset": offset, "index": self.index}

    @classmethod
    def from_dict(cls, data: object) -> MetadataIndex:
        """Inverse of :meth:`to_dict`; :class:`CheckpointFormatError` on a malformed dict."""
        with format_errors():
            body = check_keys(data, ("fqn", "offset", "index"), "MetadataIndex")
            offset = body["offset"]
            if offset is not None:
                offset = size_of(int_list(offset, "MetadataIndex offset"), "MetadataIndex offset")
        fqn = body["fqn"]
        if not isinstance(fqn, str):
            raise CheckpointFormatError(f"MetadataIndex fqn must be a string, got {fqn!r}")
        index = body["index"]
        if index is not None and (type(index) is not int or index < 0):
            raise CheckpointFormatError(
                f"MetadataIndex index must be an integer >= 0 or null, got {index!r}"
            )
        return cls(fqn, offset, index)


def _entry_to_dict(
    fqn: str, entry: object, storage: dict[MetadataIndex, Any], inlined: set[MetadataIndex]
) -> dict[str, Any]:
    """One ``state_dict_metadata`` entry, with the storage info of its chunks inlined."""

    def attach(target: dict[str, Any], key: MetadataIndex) -> None:
        if key in storage and key not in inlined:
            target["storage"] = storage_info_to_json(storage[key], f"storage_data[{key}]")
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
        with in_entry(fqn):
            entry = TensorStorageMetadata.from_dict(body)
        for position, info in infos:
            collect(MetadataIndex(fqn, entry.chunks[position].offsets, position), info)
        return entry
    if kind == "bytes":
        info = body.pop("storage", None)
        with in_entry(fqn):
            bytes_entry = BytesStorageMetadata.from_dict(body)
        if info is not None:
            collect(MetadataIndex(fqn), info)
        return bytes_entry
    raise CheckpointFormatError(f"{where} has unknown type {kind!r}; expected 'tensor' or 'bytes'")


@dataclass(slots=True)
class Metadata:
    """Everything a checkpoint holds, without the data: one entry per state-dict key.

    Args:
        state_dict_metadata: Per key, a :class:`TensorStorageMetadata` or ``BytesStorageMetadata``.
        planner_data: Data of the planner that wrote the checkpoint (JSON in the JSON form).
        storage_data: Data of the storage layer; for the JSON form None, or storage info (a JSON
            dict, or an object with ``to_dict()``) by :class:`MetadataIndex`, written in its entry.
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
        check_json_value(self.planner_data, "Metadata.planner_data")
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
            with in_entry(fqn):
                entries[fqn] = _entry_to_dict(fqn, entry, storage, inlined)
        detached = [
            {"index": key.to_dict(), "info": storage_info_to_json(info, f"storage_data[{key}]")}
            for key, info in storage.items()
            if key not in inlined
        ]
        return {
            "format": INDEX_FORMAT,
            "format_version": INDEX_VERSION,
            "version": self.version,
            "storage_meta": None if self.storage_meta is None else self.storage_meta.to_dict(),
            "planner_data": self.planner_data,
            "storage_data": None if self.storage_data is None else detached,
            "state_dict_metadata": entries,
        }

    @classmethod
    def from_dict(
        cls, data: object, *, storage_info: Callable[[dict[str, Any]], Any] | None = None
    ) -> Metadata:
        """Inverse of :meth:`to_dict`.

        Args:
            storage_info: Converts each storage info dict (e.g. a dataclass's ``from_dict``);
                by default the dicts are kept as they are.

        Raises:
            CheckpointFormatError: Not a shardwise checkpoint index, an unsupported format
                version, or a malformed, unknown or missing field.
        """
        body = index_body(data)
        convert: Callable[[dict[str, Any]], Any] = storage_info or (lambda info: info)
        meta_version = optional_str(body["version"], "checkpoint index version")
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
                with format_errors():
                    item_body = check_keys(item, ("index", "info"), "storage_data item")
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
        """Read a document written by :meth:`to_json` (``storage_info`` as in :meth:`from_dict`)."""
        return cls.from_dict(load_json(text, "the checkpoint index"), storage_info=storage_info)
