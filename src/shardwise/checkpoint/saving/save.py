"""``save`` and ``async_save``: describe (:mod:`.snapshot`), plan, write (:mod:`.writer`),
build the index (:mod:`.build_index`), commit it (:func:`_commit`), remove what earlier saves
left (:func:`_remove_leftovers`); nobody returns before the commit. The files:
``docs/format.md``; the exchanges, step by step: ``docs/architecture.md``, *Save*.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from shardwise import __version__ as _version
from shardwise import collectives
from shardwise._progress import JobProgress
from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    TEXT_ENCODINGS,
    FileFacts,
    Index,
    SaveFacts,
    is_data_file_name,
    is_temporary_name,
    paused_gc,
)
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.options import SaveOptions
from shardwise.checkpoint.planning import tables as _save_tables
from shardwise.checkpoint.report import exchange_with_bar, job_bar, log_done
from shardwise.checkpoint.saving import background as _background
from shardwise.checkpoint.saving import build_index as _save_index
from shardwise.checkpoint.saving import incremental as _incremental
from shardwise.checkpoint.saving import outcome as _save_outcome
from shardwise.checkpoint.saving import writer as data_writer
from shardwise.checkpoint.saving.lock import LOCK_NAME, SaveLock
from shardwise.checkpoint.saving.snapshot import Snapshot, describe_or_error
from shardwise.checkpoint.storage import (
    Storage,
    UnsafePathError,
    open_shared_storage,
    open_storage,
)
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointTimeoutError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["async_save", "save"]

logger = logging.getLogger("shardwise.checkpoint.save")  # the name users configure
# Temporary names of the index (see _commit) and of the lock (LocalStorage.replace_small).
_TEMPORARY_INDEX = re.compile(rf"{re.escape(INDEX_NAME)}\.[0-9a-f]{{16}}\.tmp")
_TEMPORARY_LOCK = re.compile(rf"{re.escape(LOCK_NAME)}\.[0-9]+\.[0-9]+\.tmp")


def _save_facts(world_size: int, save_id: str, path: str) -> SaveFacts:
    # The index is UTF-8: a lone surrogate in the path (a name's undecodable bytes) is escaped.
    text = path.encode("utf-8", "backslashreplace").decode()
    return SaveFacts(f"shardwise {_version}", torch.__version__, world_size, save_id, text)


def _commit(storage: Storage, index: bytes, sync_files: bool, save_id: str) -> None:
    """Write the index: the commit point (every rank's data file is complete by now)."""
    name = storage.join(INDEX_NAME)
    if not storage.atomic_rename:
        # Object stores: one PUT shows a reader the old index or the new, never a part.
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
        try:
            storage.sync_dir(storage.root)
        except OSError as err:  # committed, but not known to be durable: every rank says so
            raise CheckpointDataError(
                f"the index was written, but syncing its directory failed: {err}; the save "
                "committed but may not survive a crash of the host",
                file=name,
            ) from err


def _remove_leftovers(storage: Storage, index: Index) -> None:
    """Remove what earlier saves to this path left (``docs/format.md``, *Cleanup*): safe
    because this save holds the lock; runs after the commit is acknowledged, so no rank waits."""
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


def _base_files(
    base: _incremental.Base | None, options: SaveOptions
) -> dict[str, FileFacts] | None:
    """An incremental save's base files by the name the new index gives them (None: a save
    that is not incremental)."""
    if not options.records_digests:
        return None
    if base is None:
        return {}
    index = base.index
    return {
        base.file_name(name): FileFacts(size, index.data_starts[name], index.file_checksums[name])
        for name, size in index.files.items()
    }


def _members(comm: collectives.Comm) -> dict[int, int]:
    """The save group's rank of each global rank of its members."""
    if comm.group is None:
        return {0: 0}
    return {rank: number for number, rank in enumerate(collectives.global_ranks(comm.group))}


def save_snapshot(
    snapshot: Snapshot,
    path: str,
    comm: collectives.Comm,
    options: SaveOptions,
    local_error: BaseException | None = None,
) -> Metadata:
    """Save ``snapshot`` on every rank of ``comm``; a ``local_error`` is raised on every rank."""
    outcome, save_id, metadata = save_outcome(snapshot, path, comm, options, local_error)
    if metadata is not None:
        return metadata
    return _save_outcome.returned_metadata(outcome, path, options.storage_options, save_id)


def save_outcome(
    snapshot: Snapshot,
    path: str,
    comm: collectives.Comm,
    options: SaveOptions,
    local_error: BaseException | None = None,
    members: dict[int, int] | None = None,
    on_save_id: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], str, Metadata | None]:
    """:func:`save_snapshot`, returning what the commit told every rank (``outcome.outcome``),
    the save's id, and the coordinator's metadata (``None`` on other ranks): what a writer
    process sends back is this small outcome, not a Metadata of thousands of entries.

    Args:
        members: The save group's rank of each global rank of its members (default: those of
            ``comm``'s group; a writer process's own group numbers its ranks differently).
        on_save_id: Called with the save's id once this rank knows it (exchange 2), before
            this rank writes anything, so before the coordinator can commit.
    """
    started = time.monotonic()
    ranks = _members(comm) if members is None else members

    def group_rank_of(rank: int) -> int:
        return ranks.get(rank, -1)

    coordinator_rank = options.coordinator_rank
    coordinating = comm.rank == coordinator_rank
    storage: Storage | None = None
    lock: SaveLock | None = None
    table: _save_tables.RankTable | None = None
    table_error: BaseException | None = local_error
    if coordinating and table_error is None:
        try:
            table = _save_tables.rank_table(snapshot.tensors, comm.rank, group_rank_of)
        except Exception as err:
            table_error = err
    # Exchange 1a: the coordinator's digest (a rank whose table has it sends no table).
    try:
        coordinator_digest = comm.broadcast_json(
            None if table is None else table.digest, coordinator_rank
        )
    except CheckpointTimeoutError as failure:
        if table_error is None:
            raise
        # What this rank must fix comes first (as gather_or_raise does with it).
        table_error.add_note(f"It was not shared with the other ranks: {failure}")
        raise table_error from None
    save_id = ""
    base: _incremental.Base | None = None
    objects = snapshot.objects if coordinating else {}
    blobs = [(fqn, obj) for fqn, obj in objects.items() if obj.encoding not in TEXT_ENCODINGS]

    def envelope() -> dict[str, Any]:
        nonlocal storage, lock, table, save_id, base
        if table_error is not None:
            raise table_error
        storage = open_shared_storage(path, options.storage_options, comm.world_size)
        if options.base is not None:  # every rank reads it: each compares its own chunks
            base = _incremental.open_base(path, options.base, options.storage_options)
        if table is None:
            table = _save_tables.rank_table(snapshot.tensors, comm.rank, group_rank_of)
        sent: dict[str, Any] = {"digest": table.digest, "local": table.local}
        if table.digest != coordinator_digest:
            sent["table"] = table.to_json()
        if snapshot.aliases:
            sent["aliases"] = snapshot.aliases
        if comm.rank == 0:
            sent["progress"] = options.progress
        if coordinating:
            # One save at a time per path, taken before anything is written.
            save_id = secrets.token_hex(8)
            storage.makedirs(storage.root)
            taken = SaveLock(storage, save_id)
            taken.acquire()
            lock = taken  # only a lock this save holds is released by it
        return sent

    try:
        # Exchange 1b: every rank's envelope on the coordinator, the verdict on every rank.
        _, envelopes = comm.gather_or_raise(envelope, dst=coordinator_rank)
        assert storage is not None and table is not None
        planned: _save_tables.CoordinatorPlan | None = None

        def plan() -> list[dict[str, Any]]:
            nonlocal planned
            assert envelopes is not None
            blob_bytes = sum(len(obj.payload) for _, obj in blobs)
            try:
                planned = _save_tables.plan_from_tables(
                    table, envelopes, comm.world_size, {coordinator_rank: blob_bytes}
                )
            except (KeyError, IndexError, TypeError, AttributeError) as err:
                # Planning raises ValueError only: this is an envelope of another shardwise.
                raise CheckpointError(
                    f"a rank sent a malformed save plan ({type(err).__name__}: {err}); "
                    "do all ranks run the same shardwise version?"
                ) from err
            common = {
                "save_id": save_id,
                "progress": envelopes[0].get("progress", False),
                "total": planned.total,
            }
            return [{**assignment, **common} for assignment in planned.assignments]

        # Exchange 2: each rank's assignment (or the plan's error, on every rank).
        assignment = comm.scatter_or_raise(plan, src=coordinator_rank)
        save_id = assignment["save_id"]
        if on_save_id is not None:
            on_save_id(save_id)
        mine, grid_cells = _save_tables.own_file_writes(
            table, snapshot.tensors, assignment, comm.rank
        )

        def write() -> dict[str, Any]:
            writes, cells = mine, grid_cells
            digests: dict[str, str] = {}
            references: dict[str, list[Any]] = {}
            if options.records_digests:  # every chunk listed with its begin: no grid cells
                writes, digests, references = _incremental.split_writes(
                    mine, snapshot.tensors, base
                )
                cells = 0
                if bar is not None:  # the job's total counts them: they are done
                    bar.update(sum(item.nbytes for item in mine) - sum(w.nbytes for w in writes))
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
                facts = data_writer.write_data_file(
                    storage,
                    comm.rank,
                    save_id,
                    writes,
                    snapshot.tensors,
                    blobs,
                    options.sync_files,
                    bar,
                    grid_cells=cells,
                )
                if options.records_digests:
                    facts.update(digests=digests, references=references)
                return facts
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
        if assignment["progress"]:
            bar = job_bar(comm, assignment["total"], f"saving {path}", f"save/{save_id}")
        # Exchange 3: each rank's file facts on the coordinator.
        _, written = exchange_with_bar(comm, write, bar, dst=coordinator_rank)
        committed = False
        built: tuple[bytes, Index, Metadata] | None = None

        def commit() -> dict[str, Any]:
            nonlocal committed, built
            assert planned is not None and written is not None
            try:
                facts = _save_facts(comm.world_size, save_id, path)
                data, index = _save_index.build_index(
                    planned, objects, written, facts, _base_files(base, options)
                )
            except (KeyError, IndexError, TypeError, AttributeError) as err:
                # Building raises CheckpointError only: these are facts of another shardwise.
                raise CheckpointError(
                    f"a rank sent malformed file facts ({type(err).__name__}: {err}); do all "
                    "ranks run the same shardwise version? Nothing was committed"
                ) from err
            if len(data) > MAX_INDEX_BYTES:
                # A reader would refuse it: the checkpoint would be lost.
                raise CheckpointError(
                    f"the index of this save would be {len(data)} bytes, more than the "
                    f"{MAX_INDEX_BYTES} a reader reads; JSON values are kept in the index, so "
                    "store large ones as tensors or bytes. Nothing was committed"
                )
            data_writer.check_visible(storage, index, path)
            _commit(storage, data, options.sync_files, save_id)
            committed = True
            built = data, index, index.to_metadata()
            return _save_outcome.outcome(data, built[2])

        try:
            # Exchange 4: the outcome (and a small index) on every rank.
            outcome = comm.broadcast_or_raise(commit, src=coordinator_rank)
        except CheckpointTimeoutError as err:
            if not committed:
                raise
            # A rank died after sending its file: the checkpoint is complete and loads.
            raise CheckpointTimeoutError(
                f"the checkpoint at {path} was committed (it is complete and loads), but "
                f"{err.bare_message}",
                file=path,
            ) from err
        if built is None:
            return outcome, save_id, None
        data, index, metadata = built
        try:
            _remove_leftovers(storage, index)
        except OSError as err:
            # The checkpoint is committed and complete; stale files only cost space.
            logger.warning("could not remove data files of earlier saves to %s: %s", path, err)
        nbytes = len(data) + sum(size or 0 for size in index.files.values())
        count = len(index.files)
        files = f" in {count} data file{'' if count == 1 else 's'}" if count else ""
        log_done(logger, "saved", path, nbytes, time.monotonic() - started, files)
        return outcome, save_id, metadata
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
    incremental: bool = False,
    base: str | os.PathLike[str] | None = None,
) -> Metadata:
    """Save ``state_dict`` to the checkpoint directory (or URL) ``path`` (collective).

    Values: tensors (replicated: written once), ShardedTensor, DTensor, LocalShardsWrapper,
    ``bytes``/``io.BytesIO``, JSON values; nested dicts are flattened to dotted keys. Objects
    are taken from the coordinator rank. Works in a single process with no process group.

    Args:
        path: Checkpoint directory or fsspec URL.
        process_group: The ranks saving together (default: the default group, if any).
        coordinator_rank: Group rank that writes the index and the objects.
        sync_files: fsync data files, the index and their directories before committing.
        allow_pickle: Pickle values that are not otherwise storable.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank writes.
        incremental: Record a content digest of every chunk (an index of version 5), so that
            a later save can build on this checkpoint.
        base: A checkpoint beside ``path`` (the same parent directory: the series root) to
            build on: each chunk whose bytes equal the base's chunk of the same key and box
            is referenced, not written. Implies ``incremental``. The new checkpoint then reads
            files of the base (or of the checkpoints it references): keep them, or
            materialize it (``shardwise materialize``) before copying it alone.

    Returns:
        The checkpoint's :class:`Metadata` (the same on every rank).

    Raises:
        TypeError: A value cannot be stored without pickle (the message names the key).
        ValueError: Ranks disagree about a tensor, or its chunks do not tile it.

    Example:
        >>> shardwise.checkpoint.save({"model": model.state_dict(), "step": 10}, "/ckpt/100")
    """
    base = None if base is None else os.path.expanduser(os.fspath(base))
    options = SaveOptions.of_call(locals())
    comm = collectives.Comm(process_group, operation="save")
    _check_coordinator(coordinator_rank, comm)
    with paused_gc():  # see paused_gc: the collector would walk every tensor, many times
        snapshot, error = describe_or_error(state_dict, allow_pickle)
        return save_snapshot(snapshot, os.path.expanduser(os.fspath(path)), comm, options, error)


def _check_coordinator(coordinator_rank: int, comm: collectives.Comm) -> None:
    if not 0 <= coordinator_rank < comm.world_size:
        raise ValueError(
            f"coordinator_rank={coordinator_rank} is not a rank of the process group "
            f"(world size {comm.world_size})"
        )


_async_lock = threading.Lock()


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
    incremental: bool = False,
    base: str | os.PathLike[str] | None = None,
) -> concurrent.futures.Future[Metadata]:
    """Like :func:`save`, but returns once the state dict is copied to host staging memory.

    A writer process per rank (started on the first call, through the process group's
    key-value store) writes it from memory it shares with this process, over a gloo group of
    its own: the training process only hands over descriptors, so the save neither takes this
    process's GIL nor interleaves with the job's collectives. A call waits for the previous
    ``async_save`` to finish. Errors surface from the future's ``result()``; a writer process
    that died while no save was in flight raises at the next call, on every rank.

    Returns:
        A future of the checkpoint's :class:`Metadata`.
    """
    base = None if base is None else os.path.expanduser(os.fspath(base))
    options = SaveOptions.of_call(locals())
    path = os.path.expanduser(os.fspath(path))
    if open_storage(path, storage_options).process_local:  # the same verdict on every rank
        raise CheckpointError(
            f"{path} is in a store that only this process sees (memory://), but async_save "
            "writes from a writer process of its own, which would write its own copy; use "
            "save, or a file system or object store",
            file=path,
        )
    with _async_lock:
        concurrent.futures.wait(_background.in_flight())
        comm = collectives.Comm(process_group, operation="async_save")
        _check_coordinator(coordinator_rank, comm)
        writer = _background.writer_for(comm.group)
        with paused_gc():
            snapshot, error = describe_or_error(state_dict, allow_pickle)
            return writer.submit(snapshot, path, options, error)
