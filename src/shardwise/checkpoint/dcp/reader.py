"""``StorageReader``: DCP's load steps reading any shardwise checkpoint (``docs/dcp.md``).

The index is read and validated when the reader is made (and again at each ``reset``), on
every rank, before DCP runs a step: a missing or hostile checkpoint raises the same
``CheckpointError`` as ``load``, from the call that made the reader (or from ``dcp.load``
when it is given ``checkpoint_id``). DCP's planner then matches the state dict against the
metadata this reader gives (the checkpoint's dotted keys, its stored chunks) and asks for
boxes of stored chunks; each box is read by shardwise's verified read pass, straight into
the planner's destination tensor, blocks checked before any byte is used. Objects are decoded
from JSON (or taken as the bytes stored), never unpickled unless ``allow_pickle``, and handed
to DCP's ``load_bytes`` as ``torch.save`` bytes of the decoded value, after every tensor read
succeeded: a checksum mismatch replaces no Python value.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import Metadata as DCPMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from shardwise.checkpoint.dcp.writer import _openable, _path_of
from shardwise.checkpoint.entries.items import LocalBox, decode_object
from shardwise.checkpoint.entries.state_dict import display_key
from shardwise.checkpoint.index import ObjectRecord, decode_text
from shardwise.checkpoint.loading.fill import Job
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.loading.targets import check_memory
from shardwise.checkpoint.metadata import properties_to_dcp
from shardwise.errors import (
    CheckpointDataError,
    CheckpointKeyError,
    CheckpointMismatchError,
    PickleNotAllowedError,
)

__all__ = ["StorageReader"]


class StorageReader(_DCPStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader of shardwise checkpoints.

    Args:
        path: The checkpoint directory, or an fsspec URL; ``~`` is expanded.
            ``dcp.load(..., checkpoint_id=...)`` replaces it.
        verify: Check every byte read against its block checksum (as ``load``).
        allow_pickle: Load objects that were pickled (only from checkpoints you trust).
        allow_dtype_cast: Cast a saved floating-point tensor to a floating-point destination's
            dtype; else another dtype is a ``CheckpointMismatchError`` (as ``load``).
        storage_options: fsspec options for a URL.

    Raises:
        CheckpointError: No committed checkpoint at ``path``, or its index is invalid (read
            and validated here, before DCP runs).

    Example::

        import torch.distributed.checkpoint as dcp
        from shardwise.checkpoint.dcp import StorageReader

        dcp.load(state_dict, storage_reader=StorageReader("/ckpt/step-100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.allow_dtype_cast = allow_dtype_cast
        self.storage_options = storage_options
        self.is_coordinator = False
        self._reader: CheckpointReader | None = None
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins (from ``checkpoint_id``, when given): the index is read again."""
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)
        if self._reader is not None:
            self._reader.close()
        self._reader = CheckpointReader.open(self.path, self.storage_options)
        self._keys, self._metadata = _metadata(self._reader)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint this reader reads (DCP names it in its logs)."""
        return self.path

    def read_metadata(self) -> DCPMetadata:
        """The checkpoint as DCP's metadata: its dotted keys, sizes, dtypes and stored chunks."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: DCPMetadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a shardwise checkpoint (its index is there)."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        text = os.path.expanduser(os.fspath(checkpoint_id))
        if not _openable(text):
            return False
        from shardwise.checkpoint.index import INDEX_NAME
        from shardwise.checkpoint.storage import open_storage

        try:
            storage = open_storage(text)
            return storage.exists(storage.join(INDEX_NAME))
        except (OSError, ValueError):
            return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: tensors in one verified pass into the planner's
        destinations, then the objects."""
        reader = self._reader
        assert reader is not None, "reset() opened the checkpoint"
        jobs: list[Job] = []
        targets: list[LocalBox] = []
        filled: list[tuple[ReadItem, torch.Tensor]] = []
        objects: list[tuple[ReadItem, ObjectRecord]] = []
        for item in plan.items:
            key = self._key(item.storage_index.fqn)
            if item.type == LoadItemType.BYTE_IO:
                record = reader.index.objects.get(key)
                if record is None:
                    raise CheckpointMismatchError(
                        "DCP asks for an object, the checkpoint holds a tensor", key=key
                    )
                if record.encoding == "pickle" and not self.allow_pickle:
                    raise PickleNotAllowedError(
                        "this entry was pickled; pass StorageReader(..., allow_pickle=True) to "
                        "load it (only for checkpoints you trust: unpickling runs code)",
                        key=display_key(key),
                    )
                objects.append((item, record))
                continue
            tensor = self._destination(item, planner, key)
            offsets = tuple(
                int(a) + int(b)
                for a, b in zip(item.storage_index.offset or (), item.storage_offsets, strict=True)
            )
            box = (offsets, tuple(int(n) for n in item.lengths))
            jobs.extend(reader.plan(key, box, len(targets)))
            targets.append(LocalBox(box[0], box[1], tensor))
            filled.append((item, tensor))
        try:
            reader.check_files((job.key, job.chunk) for job in jobs)
            segments, buffers = [], []
            for _, record in objects:
                if record.blob is not None:
                    segment, data = reader.blob_segment(record)
                    segments.append(segment)
                    buffers.append(data)
            reader.fill(jobs, targets, verify=self.verify, also=segments)
        finally:
            # DCP has no close step, and a reader may live on (a reference cycle, a frozen
            # collector): open data files would keep a later save's unlinked files in memory.
            # Measured in bench/dcp_plugins.py: the next save on tmpfs took 2.3 s, not 0.65 s.
            reader.close()
        for item, tensor in filled:
            planner.commit_tensor(item, tensor)
        blobs = iter(buffers)
        for item, record in objects:
            payload = bytes(next(blobs)) if record.blob is not None else None
            planner.load_bytes(item, _torch_saved(self._value(record, payload)))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _key(self, fqn: str) -> str:
        key = self._keys.get(fqn)
        if key is None:
            raise CheckpointKeyError("not in the checkpoint", key=fqn)
        if isinstance(key, list):
            raise CheckpointKeyError(
                f"{len(key)} entries of the checkpoint have this dotted key (their paths differ "
                "in int and str parts, e.g. {0: ...} and {'0': ...}); DCP names them alike",
                key=fqn,
            )
        return key

    def _destination(self, item: ReadItem, planner: LoadPlanner, key: str) -> torch.Tensor:
        """The planner's destination of a tensor item, checked as ``load`` checks a target."""
        reader = self._reader
        assert reader is not None
        record = reader.index.tensors[key]
        fqn = display_key(key)
        tensor = planner.resolve_tensor(item).detach()
        check_memory(fqn, tensor)
        if tuple(tensor.shape) != tuple(item.lengths):
            raise CheckpointMismatchError(
                f"the planner's destination has size {list(tensor.shape)}, the read "
                f"{list(item.lengths)}",
                key=fqn,
            )
        castable = record.dtype.is_floating_point and tensor.dtype.is_floating_point
        if tensor.dtype != record.dtype and not (self.allow_dtype_cast and castable):
            raise CheckpointMismatchError(
                f"dtype mismatch: the checkpoint has {record.dtype}, the state dict expects "
                f"{tensor.dtype}"
                + (" (pass StorageReader(..., allow_dtype_cast=True) to cast)" if castable else ""),
                key=fqn,
            )
        return tensor

    def _value(self, record: ObjectRecord, payload: bytes | None) -> Any:
        if record.text is not None:
            return decode_text(record)
        assert payload is not None
        if record.encoding != "pickle":
            return decode_object(record.encoding, payload, pickle.loads)
        try:
            return pickle.loads(payload)
        except Exception as err:  # a verified payload whose classes fail to load
            raise CheckpointDataError(
                f"the pickled value cannot be loaded: {type(err).__name__}: {err}",
                key=display_key(record.fqn),
            ) from err


def _torch_saved(value: Any) -> io.BytesIO:
    """``value`` as the bytes DCP's ``load_bytes`` reads back (``torch.load``): made here from
    the decoded value, never bytes read from the checkpoint."""
    data = io.BytesIO()
    torch.save(value, data)
    data.seek(0)
    return data


def _metadata(reader: CheckpointReader) -> tuple[dict[str, str | list[str]], DCPMetadata]:
    """The dotted key of every entry (the name DCP's flattening gives it; several entries
    with one dotted key are listed), and the checkpoint as DCP's ``Metadata``."""
    index = reader.index
    keys: dict[str, str | list[str]] = {}
    entries: dict[str, Any] = {}
    for key in (*index.tensors, *index.objects):
        dotted = display_key(key)
        known = keys.get(dotted)
        if known is None:
            keys[dotted] = key
        else:
            keys[dotted] = [*([known] if isinstance(known, str) else known), key]
    for key, record in index.tensors.items():
        entries.setdefault(
            display_key(key),
            TensorStorageMetadata(
                properties=properties_to_dcp(record.properties),
                size=torch.Size(record.size),
                chunks=[
                    ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
                    for chunk in record.chunks
                ],
            ),
        )
    for key in index.objects:
        entries.setdefault(display_key(key), BytesStorageMetadata())
    meta = StorageMeta(checkpoint_id=reader.path, save_id=index.save.save_id)
    return keys, DCPMetadata(state_dict_metadata=entries, storage_meta=meta)
