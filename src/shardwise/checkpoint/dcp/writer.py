"""``StorageWriter``: DCP's save steps writing a shardwise checkpoint (``docs/dcp.md``).

DCP plans (what each rank writes: its planner deduplicates replicated items); this writer
stores it as shardwise does. Step by step:

1. ``prepare_global_plan`` (coordinator): a save id, and each rank's file number, in the plans;
2. ``write_data`` (every rank): one data file (safetensors, each block checksummed as written,
   under a temporary name then renamed), the objects described without pickle (JSON text,
   bytes), each item's place returned in its ``WriteResult``;
3. ``finish`` (coordinator): the index from DCP's global metadata and every rank's results,
   read back by the strict decoder, then committed under the path's save lock as ``save``
   commits (the data files it names checked visible, the index written last); what earlier
   saves left is removed after ``finish`` returns, by a thread that holds the lock until it
   is done, so no rank waits in DCP's last exchange for it (the next save of this process to
   the path waits for it in ``prepare_global_plan``, before any rank writes).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import Metadata as DCPMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shardwise import __version__ as _version
from shardwise.checkpoint.entries.items import (
    LocalBox,
    ObjectValue,
    TensorValue,
    describe_object,
)
from shardwise.checkpoint.entries.state_dict import key_of_path
from shardwise.checkpoint.index import (
    DATA_DIR,
    MAX_INDEX_BYTES,
    TEXT_ENCODINGS,
    FileFacts,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    decode_index,
    encode_index,
)
from shardwise.checkpoint.index.data_file import bytes_key, chunk_key
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.metadata import properties_from_dcp
from shardwise.checkpoint.planning.planner import WriteAssignment
from shardwise.checkpoint.saving import save as _save
from shardwise.checkpoint.saving import writer as data_writer
from shardwise.checkpoint.saving.lock import SaveLock, wait_for_cleanup
from shardwise.checkpoint.storage import UnsafePathError, local_path, open_storage
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointFormatError

__all__ = ["StorageWriter"]

logger = logging.getLogger("shardwise.checkpoint.save")


@dataclasses.dataclass(frozen=True, slots=True)
class _Assignment:
    """What the coordinator tells a rank in its plan's ``storage_data``."""

    save_id: str
    file_number: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    """Where a rank stored one write item (a ``WriteResult``'s ``storage_data``)."""

    key: str  # the checkpoint's key of the item (its state-dict path, as ``save`` names it)
    file: str | None = None  # the data file; None: an object kept in the index as text
    begin: int = 0
    nbytes: int = 0
    encoding: str | None = None  # an object's
    text: str | None = None  # an object's JSON text
    facts: tuple[int, int, str] | None = None  # (size, data start, checksums), once a file


class StorageWriter(_DCPStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer that writes a shardwise checkpoint.

    Args:
        path: The checkpoint directory, or an fsspec URL (``s3://...``); ``~`` is expanded.
            ``dcp.save(..., checkpoint_id=...)`` replaces it.
        sync_files: Make each data file and the index durable (``fsync``) before the commit.
        allow_pickle: Pickle objects that have no other stored form (as ``save``): else such
            an object is a ``TypeError`` naming its key.
        storage_options: fsspec options for a URL.

    Example::

        import torch.distributed.checkpoint as dcp
        from shardwise.checkpoint.dcp import StorageWriter

        dcp.save(state_dict, storage_writer=StorageWriter("/ckpt/step-100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync_files: bool = True,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = _path_of(path)
        self.sync_files = sync_files
        self.allow_pickle = allow_pickle
        self.storage_options = storage_options
        self.is_coordinator = False
        self._save_id = ""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (to ``checkpoint_id``, when given)."""
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether shardwise can open ``checkpoint_id``: a local path, or an fsspec URL."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        return _openable(os.fspath(checkpoint_id))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give every rank the save id and its file number (its place among the plans), once
        the cleanup of this process's last save to the path is done (it removes temporary
        data files: no rank writes before this returns)."""
        wait_for_cleanup(open_storage(self.path, self.storage_options))
        save_id = self._save_id = secrets.token_hex(8)
        return [
            dataclasses.replace(plan, storage_data=_Assignment(save_id, number))
            for number, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its data file; their places are the results."""
        assignment = plan.storage_data
        if not isinstance(assignment, _Assignment):
            raise CheckpointError(
                "the save plan holds no shardwise assignment: was prepare_global_plan of this "
                "StorageWriter run? (every rank must use a shardwise StorageWriter)"
            )
        keys = _Keys(planner)
        tensors: dict[str, TensorValue] = {}
        writes: list[WriteAssignment] = []
        blobs: list[tuple[str, ObjectValue]] = []
        # Per item: its key, how it is stored (an object's form), its entry in the data file
        # (None: JSON text kept in the index), and its bytes.
        places: list[tuple[str, ObjectValue | None, str | None, int]] = []
        for item in plan.items:
            key = keys.of(item.index.fqn)
            if item.type == WriteItemType.BYTE_IO:
                stored = describe_object(key, _object_of(item, planner), self.allow_pickle)
                entry = None if stored.encoding in TEXT_ENCODINGS else bytes_key(key)
                if entry is not None:
                    blobs.append((key, stored))
                places.append((key, stored, entry, len(stored.payload)))
                continue
            write = _tensor_write(item, planner, key, tensors)
            writes.append(write)
            places.append((key, None, chunk_key(key, write.offsets), write.nbytes))
        self._save_id = assignment.save_id
        storage = open_storage(self.path, self.storage_options)
        data_dir = storage.join(DATA_DIR)
        try:
            if writes or blobs:
                storage.makedirs(data_dir)
            written = data_writer.write_data_file(
                storage,
                assignment.file_number,
                assignment.save_id,
                writes,
                tensors,
                blobs,
                self.sync_files,
                None,
                grid_cells=0,
            )
        except UnsafePathError as err:
            raise CheckpointDataError(
                f"refusing to save: {err.filename} is not a real directory (a symbolic link "
                "or a file?); a checkpoint's data/ must be a directory inside it",
                file=data_dir,
            ) from err
        except OSError as err:
            raise CheckpointDataError(
                f"writing this rank's data file failed: {err}; nothing was committed",
                file=data_dir,
            ) from err
        results = _results(plan.items, places, written)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: DCPMetadata, results: list[list[WriteResult]]) -> None:
        """Build the index from ``metadata`` and every rank's ``results``; commit it."""
        storage = open_storage(self.path, self.storage_options)
        save_id = self._save_id
        index = _index_bytes(metadata, results, _files(results), save_id, self.path)
        lock = SaveLock(storage, save_id)
        storage.makedirs(storage.join(DATA_DIR))
        lock.acquire()
        try:
            decoded = decode_index(index)
            data_writer.check_visible(storage, decoded, self.path)
            _save.commit_index(storage, index, self.sync_files, save_id)
        except BaseException:
            lock.release()
            raise
        try:
            stale = _save.leftovers(storage, decoded)
        except OSError as err:  # committed and complete: stale files only cost space
            logger.warning("could not list the files of earlier saves to %s: %s", self.path, err)
            stale = []
        if not stale:
            lock.release()
        else:
            # DCP's last exchange waits for this method, and unlinking large files takes a
            # while (0.2 s for 1.2 GiB on tmpfs): they are removed after it returns, by a
            # thread that holds the lock until it is done.
            lock.release_after(lambda: _save.remove_files(storage, stale))
        logger.info("saved %s through torch.distributed.checkpoint", self.path)


def _path_of(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path is a str or os.PathLike, not {type(path).__name__}")
    return os.path.expanduser(os.fspath(path))


def _openable(text: str) -> bool:
    if local_path(text) is not None:
        return True
    try:
        import fsspec  # type: ignore[import-untyped]

        fsspec.get_filesystem_class(text.split("://", 1)[0])
    except (ImportError, ValueError):
        return False
    return True


class _Keys:
    """The checkpoint's key of each DCP fqn: the path DCP's planner flattened it from (its
    ``mappings``), named as ``save`` names it (so ``load`` of the same nested state dict, int
    keys of optimizers included, finds it); the fqn itself without them."""

    def __init__(self, planner: SavePlanner) -> None:
        mappings = getattr(planner, "mappings", None)
        self._paths: Mapping[str, Any] = mappings if isinstance(mappings, Mapping) else {}

    def of(self, fqn: str) -> str:
        path = self._paths.get(fqn)
        if isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path):
            return key_of_path(path)
        return key_of_path((fqn,))


def _object_of(item: WriteItem, planner: SavePlanner) -> Any:
    """The state dict's object of a ``BYTE_IO`` item: from the planner's lookup where it has
    one (DCP's default planner), else from the bytes its ``resolve_data`` gives, read back
    with ``weights_only=True`` (those bytes are this process's own ``torch.save``)."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        data.seek(0)
        try:
            return torch.load(data, weights_only=True)
        except Exception as err:
            raise TypeError(
                f"cannot save {item.index.fqn!r} without pickle: the planner gave it as "
                f"pickled bytes that hold more than plain values ({err})"
            ) from err
    return data


def _tensor_write(
    item: WriteItem, planner: SavePlanner, key: str, tensors: dict[str, TensorValue]
) -> WriteAssignment:
    """The write of a tensor item, its data (resolved now) added to ``tensors[key]``."""
    data = item.tensor_data
    assert data is not None, "a tensor write item has tensor data"
    offsets, sizes = tuple(data.chunk.offsets), tuple(data.chunk.sizes)
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes:
        raise CheckpointError(
            f"the planner resolved {item.index.fqn!r} at {list(offsets)} to "
            f"{type(tensor).__name__} {list(getattr(tensor, 'shape', []))}, not a tensor of "
            f"its chunk's size {list(sizes)}"
        )
    tensor = tensor.detach()
    value = tensors.get(key)
    if value is None:
        value = tensors[key] = TensorValue(
            tuple(data.size), tensor.dtype, properties_from_dcp(data.properties, tensor.dtype), []
        )
    value.boxes.append(LocalBox(offsets, sizes, tensor))
    return WriteAssignment(key, offsets, sizes, tensor.numel() * tensor.element_size())


def _results(
    items: Sequence[WriteItem],
    places: Sequence[tuple[str, ObjectValue | None, str | None, int]],
    written: Mapping[str, Any],
) -> list[WriteResult]:
    """Every item's ``WriteResult``: its place in this rank's data file, or its JSON text; the
    first one in the file carries the file's facts."""
    begins: Mapping[str, int] = written.get("begins", {})
    file: str | None = written["file"][0] if written else None
    facts = (written["file"][1], written["data_start"], written["checksums"]) if written else None
    results = []
    for item, (key, stored, entry, nbytes) in zip(items, places, strict=True):
        encoding = None if stored is None else stored.encoding
        if entry is None:
            assert stored is not None
            where = _Stored(key, encoding=encoding, text=stored.payload.decode())
        else:
            where = _Stored(key, file, begins[entry], nbytes, encoding=encoding, facts=facts)
            facts = None
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=where))
    return results


def _files(
    results: Sequence[Sequence[WriteResult]],
) -> list[tuple[str, FileFacts] | None]:
    """The data file of each rank (by its file number, the place of its results), or None."""
    files: list[tuple[str, FileFacts] | None] = []
    for rank_results in results:
        found = None
        for result in rank_results:
            where = result.storage_data
            if not isinstance(where, _Stored):
                raise CheckpointError(
                    "a rank's write results hold no shardwise storage data: does every rank "
                    "use a shardwise StorageWriter?"
                )
            if where.facts is not None and where.file is not None:
                size, start, checksums = where.facts
                found = (where.file, FileFacts(size, start, checksums))
        files.append(found)
    return files


def _index_bytes(
    metadata: DCPMetadata,
    results: Sequence[Sequence[WriteResult]],
    files: list[tuple[str, FileFacts] | None],
    save_id: str,
    path: str,
) -> bytes:
    """The sealed index of DCP's global ``metadata``, the items at the places ``results`` say.

    Raises:
        CheckpointError: An entry of the metadata was not written, or the index would be one
            no reader reads; nothing is committed then.
    """
    places: dict[tuple[str, tuple[int, ...] | None], _Stored] = {}
    for rank_results in results:
        for result in rank_results:
            offset = result.index.offset
            places[(result.index.fqn, None if offset is None else tuple(offset))] = (
                result.storage_data
            )
    tensors: list[LayoutRecord] = []
    objects: list[ObjectRecord] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            where = _place(places, fqn, None)
            assert where.encoding is not None
            if where.text is not None:
                objects.append(ObjectRecord(where.key, where.encoding, text=where.text))
            else:
                assert where.file is not None
                blob = SavedChunk((), (), where.file, where.begin, where.begin + where.nbytes)
                objects.append(ObjectRecord(where.key, where.encoding, blob=blob))
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{fqn!r}: DCP metadata of unknown kind {type(entry).__name__}")
        chunks = []
        key = None
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            where = _place(places, fqn, offsets)
            assert where.file is not None
            key = where.key
            chunks.append(
                SavedChunk(offsets, sizes, where.file, where.begin, where.begin + where.nbytes)
            )
        if key is None:
            raise CheckpointError(f"{fqn!r}: DCP planned no chunk of it; nothing was committed")
        properties = properties_from_dcp(entry.properties, entry.properties.dtype)
        tensors.append(LayoutRecord(key, properties, tuple(entry.size), chunks))
    facts = SaveFacts(f"shardwise {_version}", torch.__version__, len(results), save_id, path)
    data = encode_index(facts, files, tensors, objects)
    if len(data) > MAX_INDEX_BYTES:
        raise CheckpointError(
            f"the index of this save would be {len(data)} bytes, more than the "
            f"{MAX_INDEX_BYTES} a reader reads; nothing was committed"
        )
    try:
        decode_index(data)
    except CheckpointFormatError as err:
        raise CheckpointError(
            f"the index this save would write is not one a reader reads ({err}); nothing was "
            "committed"
        ) from err
    return data


def _place(
    places: Mapping[tuple[str, tuple[int, ...] | None], _Stored],
    fqn: str,
    offsets: tuple[int, ...] | None,
) -> _Stored:
    where = places.get((fqn, offsets))
    if where is None:
        at = "" if offsets is None else f" at {list(offsets)}"
        raise CheckpointError(
            f"{fqn!r}{at} is in DCP's metadata, but no rank wrote it; nothing was committed"
        )
    return where
