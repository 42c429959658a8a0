"""``save`` and ``async_save``.

Order of work (see ``docs/format.md`` for the files):

1. Each rank describes what it holds (no copies) and validates it; one JSON exchange gives every
   rank the same global view and the same verdict (a bad value on one rank raises on all).
2. A pure plan dedups replicated chunks and balances bytes across ranks.
3. Each rank writes its chunks into one safetensors file under a temporary name, straight from
   tensor memory, checksumming as it goes; then fsyncs and renames it.
4. The byte ranges and block checksums are exchanged; the coordinator writes the sealed index
   to a temporary name, fsyncs it and renames it to ``shardwise.json`` — the commit point —
   then removes the data files that the index it replaced named and the new one does not
   (never any other file). Nobody returns before the commit.

Writes never follow a link below the checkpoint: ``data/`` must be a real directory, and files
are created fresh (``O_EXCL | O_NOFOLLOW``) under temporary names and renamed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardwise import __version__ as _version
from shardwise import collectives
from shardwise._progress import JobProgress
from shardwise.checkpoint import data_writer, planner
from shardwise.checkpoint._items import (
    LocalBox,
    ObjectValue,
    TensorValue,
    describe_object,
    describe_tensor,
    is_tensor_value,
    storage_key,
)
from shardwise.checkpoint._report import exchange_with_bar, job_bar, log_done
from shardwise.checkpoint.format import bytes_key, chunk_key
from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    TEXT_ENCODINGS,
    Index,
    ObjectRecord,
    SaveFacts,
    TensorRecord,
    build_index,
    decode_index,
    encode_index,
    is_data_file_name,
    is_temporary_name,
    paused_gc,
)
from shardwise.checkpoint.lock import LOCK_NAME, SaveLock
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.options import SaveOptions
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.state_dict import display_key, flatten
from shardwise.checkpoint.storage import Storage, UnsafePathError, open_shared_storage
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointTimeoutError
from shardwise.metadata import TensorProperties, dtype_name

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["async_save", "save"]

logger = logging.getLogger(__name__)
# The temporary name of the index of a save (see _commit).
_TEMPORARY_INDEX = re.compile(rf"{re.escape(INDEX_NAME)}\.[0-9a-f]{{16}}\.tmp")
# The temporary name under which the save lock is written (see LocalStorage.replace_small).
_TEMPORARY_LOCK = re.compile(rf"{re.escape(LOCK_NAME)}\.[0-9]+\.[0-9]+\.tmp")


@dataclass(slots=True)
class _Snapshot:
    """Everything a rank will write, described locally."""

    tensors: dict[str, TensorValue]
    objects: dict[str, ObjectValue]
    # Keys whose local data is that of an earlier key (tied weights): key -> that key.
    aliases: dict[str, str] = field(default_factory=dict)


def _describe(state_dict: Mapping[str, Any], allow_pickle: bool) -> _Snapshot:
    tensors: dict[str, TensorValue] = {}
    objects: dict[str, ObjectValue] = {}
    try:
        leaves = flatten(state_dict).leaves
    except (TypeError, ValueError):
        raise
    except Exception as err:  # a Stateful object's state_dict() failed
        raise CheckpointError(
            f"cannot save: taking the state dict apart failed with {type(err).__name__}: {err}"
        ) from err
    for key, value in leaves.items():
        fqn = display_key(key)
        try:
            if is_tensor_value(value):
                tensors[key] = describe_tensor(fqn, value)
            else:
                objects[key] = describe_object(fqn, value, allow_pickle)
        except (TypeError, ValueError):
            raise
        # Anything else (an AttributeError while pickling, a RuntimeError of a DTensor
        # helper) is named and shared with every rank like the user errors above, so no rank
        # is left waiting.
        except Exception as err:
            raise CheckpointError(f"cannot save it: {type(err).__name__}: {err}", key=fqn) from err
    return _Snapshot(tensors, objects, _local_aliases(tensors))


def _local_aliases(tensors: Mapping[str, TensorValue]) -> dict[str, str]:
    """Each key whose local data is that of an earlier key, mapped to the first such key."""
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for key, value in tensors.items():
        identity = storage_key(value)
        if identity is not None:
            target = first.setdefault(identity, key)
            if target != key:
                aliases[key] = target
    return aliases


def _describe_or_error(
    state_dict: Mapping[str, Any], allow_pickle: bool, stage: bool
) -> tuple[_Snapshot, BaseException | None]:
    """The local description (staged to CPU memory with ``stage``), or the error that stops
    it: raised later, after every rank has shared its verdict."""
    try:
        snapshot = _describe(state_dict, allow_pickle)
    except Exception as err:
        return _Snapshot({}, {}), err
    try:
        return (_stage(snapshot) if stage else snapshot), None
    except Exception as err:  # e.g. out of memory while copying to staging memory
        error = CheckpointError(f"cannot stage the state dict: {type(err).__name__}: {err}")
        error.__cause__ = err
        return _Snapshot({}, {}), error


def _plan_entries(snapshot: _Snapshot) -> list[dict[str, Any]]:
    entries = []
    for fqn, value in snapshot.tensors.items():
        entries.append(
            {
                "fqn": fqn,
                "dtype": dtype_name(value.dtype),
                "size": None if value.size is None else list(value.size),
                "properties": value.properties.to_dict(),
                "itemsize": value.dtype.itemsize,
                "chunks": [[list(box.offsets), list(box.sizes)] for box in value.boxes],
            }
        )
    return entries


def _build_index(
    plans: dict[str, planner.TensorPlan],
    aliases: dict[str, str],
    objects: dict[str, ObjectValue],
    written: list[dict[str, Any]],
    world_size: int,
    save_id: str,
    path: str,
) -> tuple[bytes, Index]:
    """The sealed index of this save (every rank builds the same bytes), and its records as
    a reader reads them back."""
    files = {part["file"][0]: part["file"][1] for part in written if part}
    where: dict[str, tuple[str, list[Any]]] = {}
    for part in written:
        for key, entry in part.get("entries", {}).items():
            where[key] = (part["file"][0], entry)

    def stored(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> SavedChunk:
        file, (begin, end, sums) = where[key]
        return SavedChunk(offsets, sizes, file, begin, end, sums)

    tensors = []
    properties: dict[tuple[Any, ...], TensorProperties] = {}  # few distinct ones
    for fqn, plan in plans.items():
        chunks = tuple(
            stored(chunk_key(fqn, offsets), offsets, sizes)
            for offsets, sizes in sorted(plan.holders)
        )
        known = tuple(plan.properties.items())
        props = properties.get(known)
        if props is None:
            props = properties[known] = TensorProperties.from_dict(plan.properties)
        tensors.append(TensorRecord(fqn, props, plan.size, chunks))
    records = []
    for fqn, value in objects.items():
        if value.encoding in TEXT_ENCODINGS:
            records.append(ObjectRecord(fqn, value.encoding, text=value.payload.decode()))
        else:
            records.append(ObjectRecord(fqn, value.encoding, blob=stored(bytes_key(fqn), (), ())))
    facts = SaveFacts(f"shardwise {_version}", torch.__version__, world_size, save_id, path)
    ordered = sorted(tensors, key=lambda record: record.fqn)
    records.sort(key=lambda record: record.fqn)
    data = encode_index(facts, files, ordered, records, aliases=aliases)
    return data, build_index(facts, files, ordered, records, aliases)


def _commit(storage: Storage, index: bytes, sync_files: bool, save_id: str) -> None:
    """Write the index: the commit point. Every data file it names is complete and visible
    (every rank acknowledged its own before the coordinator gets here)."""
    name = storage.join(INDEX_NAME)
    if not storage.atomic_rename:
        # Object stores: one PUT makes the whole index visible at once, replacing the
        # previous one; a reader sees the old index or the new, never a part. A failure is
        # a CheckpointStorageError already.
        storage.replace_small(name, index)
        return
    temporary = f"{name}.{save_id}.tmp"
    writer = data_writer.open_fresh(storage, temporary, None)
    try:
        try:
            writer.write(index)
        except BaseException:
            writer.abort()
            raise
        writer.close(sync=sync_files)
        storage.rename(temporary, name)
    except OSError as err:  # a full disk, a lost mount: named, and shared with every rank
        raise CheckpointDataError(
            f"writing the index failed: {err}; the save did not commit", file=name
        ) from err
    if sync_files:
        storage.sync_dir(storage.root)


def _remove_leftovers(storage: Storage, index: Index) -> None:
    """Remove what earlier saves to this path left: every name in ``data/`` that has the
    writer's data-file pattern and that the committed index does not name (files of the index
    it replaced, and of saves that crashed before their commit), the writer's temporary data
    files, and temporary indexes. Safe because this save holds the save lock: no other save is
    writing there. Runs after the commit is acknowledged, so no rank waits for it. Nothing else
    is ever removed: not a file of another name, nothing outside ``data/`` and the index's
    temporary names (a ``data/`` that is a link is refused, not followed)."""
    keep = {name.removeprefix(f"{DATA_DIR}/") for name in index.files}
    stale = [
        storage.join(DATA_DIR, name)
        for name in storage.listdir(storage.join(DATA_DIR))
        if (is_data_file_name(name) and name not in keep) or is_temporary_name(name)
    ]
    stale += [
        storage.join(name)
        for name in storage.listdir(storage.root)
        if _TEMPORARY_INDEX.fullmatch(name) or _TEMPORARY_LOCK.fullmatch(name)
    ]
    for path in stale:
        try:
            storage.remove(path)
        except OSError as err:  # e.g. a directory of that name: skip it, remove the rest
            logger.warning("could not remove %s: %s", path, err)


def _save_snapshot(
    snapshot: _Snapshot,
    path: str,
    comm: collectives.Comm,
    options: SaveOptions,
    local_error: BaseException | None = None,
) -> Metadata:
    """Steps 2 to 4 of a save (see the module's docstring), on every rank of ``comm``; a
    ``local_error`` of step 1 is raised on this rank and shared with the others."""
    started = time.monotonic()
    coordinator_rank = options.coordinator_rank
    storage: Storage | None = None
    lock: SaveLock | None = None

    def local_plan() -> dict[str, Any]:
        nonlocal storage, lock
        if local_error is not None:
            raise local_error
        storage = open_shared_storage(path, options.storage_options, comm.world_size)
        plan: dict[str, Any] = {
            "tensors": _plan_entries(snapshot),
            "aliases": snapshot.aliases,
            "progress": options.progress,
        }
        if comm.rank == coordinator_rank:
            # One save at a time per path, taken before anything is written (see lock.py).
            plan["save_id"] = secrets.token_hex(8)
            storage.makedirs(storage.root)
            taken = SaveLock(storage, plan["save_id"])
            taken.acquire()
            lock = taken  # only a lock this save holds is released by it
            # JSON values travel as text (they go into the index); blobs as their length.
            plan["objects"] = {
                fqn: [obj.encoding, obj.payload.decode() if obj.encoding in TEXT_ENCODINGS else ""]
                for fqn, obj in snapshot.objects.items()
            }
            plan["blob_bytes"] = sum(
                len(obj.payload)
                for obj in snapshot.objects.values()
                if obj.encoding not in TEXT_ENCODINGS
            )
        return plan

    try:
        _, plans = comm.exchange_or_raise(local_plan)
        coordinator_plan = plans[coordinator_rank]
        save_id = coordinator_plan["save_id"]

        def global_plan() -> tuple[
            dict[str, planner.TensorPlan], dict[str, str], list[list[planner.WriteAssignment]]
        ]:
            merged = planner.merge_tensor_plans([plan["tensors"] for plan in plans])
            # A tied tensor is written once; the index names its other keys (aliases).
            aliases = planner.agree_aliases([plan["aliases"] for plan in plans], merged)
            written = {fqn: plan for fqn, plan in merged.items() if fqn not in aliases}
            blob_bytes = {coordinator_rank: coordinator_plan["blob_bytes"]}
            return written, aliases, planner.assign_writers(written, comm.world_size, blob_bytes)

        # Pure in the exchanged plans: every rank reaches the same verdict without talking.
        merged, aliases, assignments = global_plan()
        assert storage is not None
        mine = assignments[comm.rank]
        blobs = []
        if comm.rank == coordinator_rank:
            blobs = [
                (fqn, obj)
                for fqn, obj in snapshot.objects.items()
                if obj.encoding not in TEXT_ENCODINGS
            ]

        def write() -> dict[str, Any]:
            data_dir = storage.join(DATA_DIR)
            try:
                storage.makedirs(data_dir)
            except UnsafePathError as err:
                raise CheckpointDataError(
                    f"refusing to save: {err.filename} is not a real directory (a symbolic link "
                    "or a file?); a checkpoint's data/ must be a directory inside it",
                    file=data_dir,
                    rank=comm.rank,
                ) from err
            try:
                return data_writer.write_data_file(
                    storage,
                    comm.rank,
                    save_id,
                    mine,
                    snapshot.tensors,
                    blobs,
                    options.sync_files,
                    bar,
                )
            except CheckpointError:
                raise
            except OSError as err:  # a full disk, a lost mount: named, on every rank
                raise CheckpointDataError(
                    f"writing this rank's data file failed: {err}; nothing was committed",
                    file=data_dir,
                    rank=comm.rank,
                ) from err

        # Rank 0 asked for a bar: it shows the whole job's bytes, which every rank counts.
        bar: JobProgress | None = None
        if plans[0]["progress"]:
            total = sum(item.nbytes for items in assignments for item in items)
            bar = job_bar(comm, total, f"saving {path}", f"save/{save_id}")
        _, written = exchange_with_bar(comm, write, bar)
        # Only the coordinator's objects are saved; every rank builds the same index from its plan.
        objects = {
            fqn: ObjectValue(encoding, text.encode())
            for fqn, (encoding, text) in coordinator_plan["objects"].items()
        }

        # Every rank builds the same index, and says so before the coordinator commits it:
        # a rank that fails or dies up to here leaves nothing committed.
        def agree() -> tuple[bytes, Index]:
            built = _build_index(merged, aliases, objects, written, comm.world_size, save_id, path)
            if comm.rank == coordinator_rank:
                # What is committed must read back as what every rank built (the decoder
                # validates everything a reader checks).
                if decode_index(built[0]) != built[1]:
                    raise CheckpointError("the index of this save does not read back as built")
                data_writer.check_visible(storage, built[1], path)
            return built

        data, index = comm.exchange_or_raise(agree, lambda _: None)[0]
        committed = False

        def commit() -> None:
            nonlocal committed
            if comm.rank == coordinator_rank:
                _commit(storage, data, options.sync_files, save_id)
                committed = True

        try:
            comm.exchange_or_raise(commit, lambda _: None)
        except CheckpointTimeoutError as err:
            if not committed:
                raise
            # A rank died after agreeing to the commit: the checkpoint is complete and loads.
            raise CheckpointTimeoutError(
                f"the checkpoint at {path} was committed (it is complete and loads), but "
                f"{err.bare_message}",
                file=path,
            ) from err
        if comm.rank == coordinator_rank:
            try:
                _remove_leftovers(storage, index)
            except OSError as err:
                # The checkpoint is committed and complete; stale files only cost space.
                logger.warning("could not remove data files of earlier saves to %s: %s", path, err)
            nbytes = len(data) + sum(size or 0 for size in index.files.values())
            count = len(index.files)
            files = f" in {count} data file{'' if count == 1 else 's'}" if count else ""
            log_done(logger, "saved", path, nbytes, time.monotonic() - started, files)
        return index.to_metadata()
    finally:
        if lock is not None:
            lock.release()


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: ProcessGroup | None = None,
    coordinator_rank: int = 0,
    sync_files: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> Metadata:
    """Save ``state_dict`` to the checkpoint directory (or URL) ``path`` (collective).

    Values: tensors (replicated: written once), ShardedTensor, DTensor, LocalShardsWrapper,
    ``bytes``/``io.BytesIO``, JSON values; nested dicts are flattened to dotted keys. Objects
    are taken from the coordinator rank. Works in a single process with no process group.

    Args:
        state_dict: What to save.
        path: Checkpoint directory or fsspec URL.
        process_group: The ranks saving together (default: the default group, if any).
        coordinator_rank: Group rank that writes the index and the objects.
        sync_files: fsync data files, the index and their directories before committing.
        allow_pickle: Pickle values that are not otherwise storable.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank writes.

    Returns:
        The checkpoint's :class:`Metadata` (the same on every rank).

    Raises:
        TypeError: A value cannot be stored without pickle (the message names the key).
        ValueError: Ranks disagree about a tensor, or its chunks do not tile it.

    Example:
        >>> shardwise.checkpoint.save({"model": model.state_dict(), "step": 10}, "/ckpt/100")
    """
    options = SaveOptions.of_call(locals())
    comm = collectives.Comm(process_group, operation="save")
    _check_coordinator(coordinator_rank, comm)
    with paused_gc():  # see paused_gc: the collector would walk every tensor, many times
        snapshot, error = _describe_or_error(state_dict, allow_pickle, stage=False)
        return _save_snapshot(snapshot, _local_path(path), comm, options, error)


def _local_path(path: str | os.PathLike[str]) -> str:
    return os.path.expanduser(os.fspath(path))


def _check_coordinator(coordinator_rank: int, comm: collectives.Comm) -> None:
    if not 0 <= coordinator_rank < comm.world_size:
        raise ValueError(
            f"coordinator_rank={coordinator_rank} is not a rank of the process group "
            f"(world size {comm.world_size})"
        )


# -- async -------------------------------------------------------------------------------------

_async_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_in_flight: concurrent.futures.Future[Metadata] | None = None
_background_groups: dict[tuple[int, ...], ProcessGroup | None] = {}


def _stage(snapshot: _Snapshot) -> _Snapshot:
    """A copy of every local box in CPU memory (pinned when an accelerator exists)."""
    pin = torch.cuda.is_available()
    tensors: dict[str, TensorValue] = {}
    for fqn, value in snapshot.tensors.items():
        target = snapshot.aliases.get(fqn)
        if target is not None:  # the same local data as an earlier key: staged once
            tensors[fqn] = TensorValue(
                value.size, value.dtype, value.properties, tensors[target].boxes
            )
            continue
        boxes = []
        for box in value.boxes:
            source = box.tensor.detach()
            staged = torch.empty(source.size(), dtype=source.dtype, device="cpu", pin_memory=pin)
            staged.copy_(source)
            boxes.append(LocalBox(box.offsets, box.sizes, staged))
        tensors[fqn] = TensorValue(value.size, value.dtype, value.properties, boxes)
    return _Snapshot(tensors, dict(snapshot.objects), snapshot.aliases)


def _background_group(process_group: ProcessGroup | None) -> ProcessGroup | None:
    """The gloo group background saves over ``process_group``'s ranks use: same ranks, same
    timeout (created on first use; that is collective over the default group)."""
    if not collectives.is_initialized():
        return None
    group = collectives.resolve_group(process_group)
    key = tuple(collectives.global_ranks(group))
    cached = _background_groups.get(key)
    if cached is not None:
        try:
            collectives.global_ranks(cached)
        except (KeyError, ValueError, RuntimeError):
            # Destroyed since (destroy_process_group, a re-initialized job): make a new one.
            cached = None
    # Made for a group over the same ranks with another timeout: background saves must give
    # up when this group would. Every rank sees the same timeouts, so all join the new_group.
    if cached is not None and collectives.group_timeout(cached) != collectives.group_timeout(group):
        cached = None
    if cached is None:
        cached = _background_groups[key] = collectives.new_gloo_group_like(group)
    return cached


def async_save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: ProcessGroup | None = None,
    coordinator_rank: int = 0,
    sync_files: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> concurrent.futures.Future[Metadata]:
    """Like :func:`save` (the same keywords), but returns once the state dict is copied to
    CPU staging memory.

    The writing happens in a background thread over a separate gloo process group (created on
    the first call; that creation is collective over the default group), so it never
    interleaves with the training job's collectives. A call made while an earlier
    ``async_save`` is still writing first waits for it. Errors surface from the future's
    ``result()``.

    Returns:
        A future of the checkpoint's :class:`Metadata`.
    """
    global _executor, _in_flight
    options = SaveOptions.of_call(locals())
    with _async_lock:
        if _in_flight is not None:
            concurrent.futures.wait([_in_flight])
        comm = collectives.Comm(_background_group(process_group), operation="async_save")
        _check_coordinator(coordinator_rank, comm)
        snapshot, error = _describe_or_error(state_dict, allow_pickle, stage=True)
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="shardwise-async-save"
            )
        _in_flight = _executor.submit(
            _save_snapshot, snapshot, _local_path(path), comm, options, error
        )
        return _in_flight
