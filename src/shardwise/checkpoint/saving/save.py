"""``save`` and ``async_save``: describe (:mod:`.snapshot`), plan, write (:mod:`.writer`),
build the index (:mod:`.build_index`), commit it (:func:`commit_index`), remove what earlier
saves left (:func:`remove_leftovers`); nobody returns before the commit. The exchanges between
ranks are the methods of :class:`_SaveExchange`, which :func:`save_outcome` calls in order.
The files: ``docs/format.md``; the exchanges, step by step: ``docs/architecture.md``, *Save*.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
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
from shardwise.checkpoint.planning.planner import WriteAssignment
from shardwise.checkpoint.report import exchange_with_bar, job_bar, log_done
from shardwise.checkpoint.saving import background as _background
from shardwise.checkpoint.saving import build_index as _save_index
from shardwise.checkpoint.saving import incremental as _incremental
from shardwise.checkpoint.saving import outcome as _save_outcome
from shardwise.checkpoint.saving import writer as data_writer
from shardwise.checkpoint.saving.lock import LOCK_NAME, SaveLock
from shardwise.checkpoint.saving.snapshot import Snapshot, describe_or_error
from shardwise.checkpoint.storage import (
    LocalStorage,
    Storage,
    UnsafePathError,
    open_shared_storage,
    open_storage,
)
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointTimeoutError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "async_save",
    "commit_index",
    "leftovers",
    "remove_files",
    "remove_leftovers",
    "save",
    "save_parts",
]

logger = logging.getLogger("shardwise.checkpoint.save")  # the name users configure
# Temporary names of the index (see commit_index) and of the lock (LocalStorage.replace_small).
_TEMPORARY_INDEX = re.compile(rf"{re.escape(INDEX_NAME)}\.[0-9a-f]{{16}}\.tmp")
_TEMPORARY_LOCK = re.compile(rf"{re.escape(LOCK_NAME)}\.[0-9]+\.[0-9]+\.tmp")


def _save_facts(world_size: int, save_id: str, path: str) -> SaveFacts:
    # The index is UTF-8: a lone surrogate in the path (a name's undecodable bytes) is escaped.
    text = path.encode("utf-8", "backslashreplace").decode()
    return SaveFacts(f"shardwise {_version}", torch.__version__, world_size, save_id, text)


def commit_index(storage: Storage, index: bytes, sync_files: bool, save_id: str) -> None:
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


def remove_leftovers(storage: Storage, index: Index) -> None:
    """Remove what earlier saves to this path left (``docs/format.md``, *Cleanup*): safe
    because this save holds the lock; runs after the commit is acknowledged, so no rank waits."""
    remove_files(storage, leftovers(storage, index))


def leftovers(storage: Storage, index: Index) -> list[str]:
    """What earlier saves to this path left (``docs/format.md``, *Cleanup*): the data files
    ``index`` does not name, temporary data files, indexes and lock files. Listed holding the
    lock, so that no other save's file can be among them."""
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
    return stale


def remove_files(storage: Storage, paths: list[str]) -> None:
    """Remove ``paths`` (what :func:`leftovers` listed); one that cannot be removed is logged
    and skipped."""
    for path in paths:
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Built:
    """What the coordinator committed: the index's bytes, as read back, and its Metadata."""

    data: bytes
    index: Index
    metadata: Metadata


class _SaveExchange:
    """One save as its exchanges between the ranks of ``comm``, one method each, in the order
    :func:`save_outcome` calls them; what a step learns (the storage, the plan, this rank's
    assignment, the ranks' file facts) is kept here for the next. Every exchange is a
    collective that raises the same error on every rank when any rank's part fails (the
    ``*_or_raise`` collectives), so no rank is left waiting: validate first, communicate
    second, write third.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        path: str,
        comm: collectives.Comm,
        options: SaveOptions,
        local_error: BaseException | None,
        members: dict[int, int] | None,
        parts: bool = False,
        storage: Storage | None = None,
    ) -> None:
        self.snapshot = snapshot
        #: Each rank's ``path`` is a directory of its own (:func:`save_parts`): no rank sees
        #: another's data file, and every rank writes the index into its own.
        self.parts = parts
        self.path = path
        self.comm = comm
        self.options = options
        self._ranks = _members(comm) if members is None else members
        self.coordinator_rank = options.coordinator_rank
        self.coordinating = comm.rank == self.coordinator_rank
        #: The storage of ``path`` (opened in exchange 1b, unless given).
        self.storage: Storage | None = storage
        #: The save lock, once this save holds it (only a lock this save holds is released).
        self.lock: SaveLock | None = None
        self.table: _save_tables.RankTable | None = None
        #: What this rank cannot save (its own error, or its table's): raised in exchange 1b.
        self.table_error: BaseException | None = local_error
        self.coordinator_digest: str | None = None
        self.save_id = ""
        self.base: _incremental.Base | None = None
        self.objects = snapshot.objects if self.coordinating else {}
        self.blobs = [
            (fqn, obj) for fqn, obj in self.objects.items() if obj.encoding not in TEXT_ENCODINGS
        ]
        #: The coordinator's: every rank's envelope (exchange 1b) and the plan (exchange 2).
        self.envelopes: list[dict[str, Any]] | None = None
        self.planned: _save_tables.CoordinatorPlan | None = None
        self.assignment: dict[str, Any] = {}
        self.bar: JobProgress | None = None
        #: The coordinator's: every rank's file facts (exchange 3).
        self.written: list[dict[str, Any]] | None = None
        #: The coordinator's, once the index is in place (exchange 4).
        self.committed = False
        self.built: _Built | None = None

    def _group_rank_of(self, rank: int) -> int:
        return self._ranks.get(rank, -1)

    def share_digest(self) -> None:
        """Exchange 1a (broadcast, JSON): the digest of the coordinator's rank table, so that a
        rank whose table has the same digest sends no table in its envelope.

        Raises:
            BaseException: This rank's own error when the broadcast timed out with one (what it
                must fix comes first, as ``gather_or_raise`` does with it).
        """
        if self.coordinating and self.table_error is None:
            try:
                self.table = self._rank_table()
            except Exception as err:
                self.table_error = err
        try:
            self.coordinator_digest = self.comm.broadcast_json(
                None if self.table is None else self.table.digest, self.coordinator_rank
            )
        except CheckpointTimeoutError as failure:
            if self.table_error is None:
                raise
            # What this rank must fix comes first (as gather_or_raise does with it).
            self.table_error.add_note(f"It was not shared with the other ranks: {failure}")
            raise self.table_error from None

    def _rank_table(self) -> _save_tables.RankTable:
        return _save_tables.rank_table(self.snapshot.tensors, self.comm.rank, self._group_rank_of)

    def gather_envelopes(self) -> None:
        """Exchange 1b (gather on the coordinator, JSON): every rank's envelope, ``{"digest",
        "local"}`` and, where they apply, its ``"table"`` (a digest unlike the coordinator's),
        ``"aliases"`` and rank 0's ``"progress"``; the verdict (or the first rank's error) on
        every rank. The coordinator takes the save lock while building its envelope, before
        anything is written."""
        _, self.envelopes = self.comm.gather_or_raise(self._envelope, dst=self.coordinator_rank)
        assert self.storage is not None and self.table is not None

    def _envelope(self) -> dict[str, Any]:
        if self.table_error is not None:
            raise self.table_error
        options = self.options
        if self.storage is None:
            self.storage = open_shared_storage(
                self.path, options.storage_options, self.comm.world_size
            )
        storage = self.storage
        if options.base is not None:  # every rank reads it: each compares its own chunks
            self.base = _incremental.open_base(self.path, options.base, options.storage_options)
        if self.table is None:
            self.table = self._rank_table()
        table = self.table
        sent: dict[str, Any] = {"digest": table.digest, "local": table.local}
        if table.digest != self.coordinator_digest:
            sent["table"] = table.to_json()
        if self.snapshot.aliases:
            sent["aliases"] = self.snapshot.aliases
        if self.comm.rank == 0:
            sent["progress"] = options.progress
        if self.coordinating:
            # One save at a time per path, taken before anything is written.
            self.save_id = secrets.token_hex(8)
            storage.makedirs(storage.root)
            taken = SaveLock(storage, self.save_id)
            taken.acquire()
            self.lock = taken  # only a lock this save holds is released by it
        return sent

    def scatter_assignments(self) -> str:
        """Exchange 2 (scatter from the coordinator, JSON): each rank's assignment from the
        plan (its writes, and the ``"save_id"``, ``"progress"`` and ``"total"`` bytes common to
        all), or the plan's error on every rank; returns the save's id."""
        self.assignment = self.comm.scatter_or_raise(self._plan, src=self.coordinator_rank)
        self.save_id = self.assignment["save_id"]
        return self.save_id

    def _plan(self) -> list[dict[str, Any]]:
        assert self.envelopes is not None and self.table is not None
        envelopes = self.envelopes
        blob_bytes = sum(len(obj.payload) for _, obj in self.blobs)
        try:
            self.planned = planned = _save_tables.plan_from_tables(
                self.table, envelopes, self.comm.world_size, {self.coordinator_rank: blob_bytes}
            )
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            # Planning raises ValueError only: this is an envelope of another shardwise.
            raise CheckpointError(
                f"a rank sent a malformed save plan ({type(err).__name__}: {err}); "
                "do all ranks run the same shardwise version?"
            ) from err
        common = {
            "save_id": self.save_id,
            "progress": envelopes[0].get("progress", False),
            "total": planned.total,
        }
        return [{**assignment, **common} for assignment in planned.assignments]

    def write_files(self) -> None:
        """Exchange 3 (gather on the coordinator, JSON): each rank writes its data file, then
        sends its file facts (:func:`~.writer.write_data_file`; in an incremental save also
        its chunks' digests and references to the base), or its error to every rank."""
        assert self.table is not None
        mine, grid_cells = _save_tables.own_file_writes(
            self.table, self.snapshot.tensors, self.assignment, self.comm.rank
        )
        # Rank 0 asked for a bar: it shows the whole job's bytes, which every rank counts.
        if self.assignment["progress"]:
            self.bar = job_bar(
                self.comm,
                self.assignment["total"],
                f"saving {self.path}",
                f"save/{self.save_id}",
            )
        write = functools.partial(self._write, mine, grid_cells)
        _, self.written = exchange_with_bar(self.comm, write, self.bar, dst=self.coordinator_rank)

    def _write(self, mine: list[WriteAssignment], grid_cells: int) -> dict[str, Any]:
        storage, options, rank = self.storage, self.options, self.comm.rank
        assert storage is not None
        writes, cells = mine, grid_cells
        digests: dict[str, str] = {}
        references: dict[str, list[Any]] = {}
        if options.records_digests:  # every chunk listed with its begin: no grid cells
            writes, digests, references = _incremental.split_writes(
                mine, self.snapshot.tensors, self.base
            )
            cells = 0
            if self.bar is not None:  # the job's total counts them: they are done
                self.bar.update(sum(item.nbytes for item in mine) - sum(w.nbytes for w in writes))
        data_dir = storage.join(DATA_DIR)
        try:
            storage.makedirs(data_dir)
        except UnsafePathError as err:
            raise CheckpointDataError(
                f"refusing to save: {err.filename} is not a real directory (a symbolic link "
                "or a file?); a checkpoint's data/ must be a directory inside it",
                file=data_dir,
                rank=rank,
            ) from err
        try:
            facts = data_writer.write_data_file(
                storage,
                rank,
                self.save_id,
                writes,
                self.snapshot.tensors,
                self.blobs,
                options.sync_files,
                self.bar,
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
                rank=rank,
            ) from err

    def commit(self) -> dict[str, Any]:
        """Exchange 4 (broadcast from the coordinator, JSON): the coordinator builds the index
        from every rank's file facts and commits it (:func:`commit_index`); every rank gets
        the outcome (``outcome.outcome``: the index itself when small), or the error.

        Raises:
            CheckpointTimeoutError: Saying the checkpoint was committed, when a rank died after
                sending its file facts and the coordinator had committed.
        """
        try:
            outcome: dict[str, Any] = self.comm.broadcast_or_raise(
                self._build_and_commit, src=self.coordinator_rank
            )
        except CheckpointTimeoutError as err:
            if not self.committed:
                raise
            # A rank died after sending its file: the checkpoint is complete and loads.
            raise CheckpointTimeoutError(
                f"the checkpoint at {self.path} was committed (it is complete and loads), but "
                f"{err.bare_message}",
                file=self.path,
            ) from err
        if self.parts:  # every rank's own copy of the index, the verdict on every rank
            self.comm.agree_or_raise(functools.partial(self._commit_part, outcome["index"]))
        return outcome

    def _commit_part(self, index: str) -> None:
        if self.coordinating:
            return  # committed in _build_and_commit
        assert self.storage is not None
        commit_index(self.storage, index.encode(), self.options.sync_files, self.save_id)

    def _build_and_commit(self) -> dict[str, Any]:
        storage, options = self.storage, self.options
        assert storage is not None and self.planned is not None and self.written is not None
        try:
            facts = _save_facts(self.comm.world_size, self.save_id, self.path)
            data, index = _save_index.build_index(
                self.planned, self.objects, self.written, facts, _base_files(self.base, options)
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
        if not self.parts:  # a part's directory holds its own data file only
            data_writer.check_visible(storage, index, self.path)
        commit_index(storage, data, options.sync_files, self.save_id)
        self.committed = True
        self.built = _Built(data, index, index.to_metadata())
        outcome = _save_outcome.outcome(data, self.built.metadata)
        if self.parts:  # every rank writes it, whatever its size
            outcome["index"] = data.decode()
        return outcome

    def clean_up(self, started: float) -> None:
        """The coordinator, after every rank has the outcome (no rank waits for this): remove
        what earlier saves left (:func:`remove_leftovers`) and log the save."""
        assert self.storage is not None and self.built is not None
        data, index = self.built.data, self.built.index
        try:
            remove_leftovers(self.storage, index)
        except OSError as err:
            # The checkpoint is committed and complete; stale files only cost space.
            logger.warning("could not remove data files of earlier saves to %s: %s", self.path, err)
        nbytes = len(data) + sum(size or 0 for size in index.files.values())
        count = len(index.files)
        files = f" in {count} data file{'' if count == 1 else 's'}" if count else ""
        log_done(logger, "saved", self.path, nbytes, time.monotonic() - started, files)

    def release(self) -> None:
        """Release the save lock, if this save holds it (after the commit and the cleanup)."""
        if self.lock is not None:
            self.lock.release()


def save_outcome(
    snapshot: Snapshot,
    path: str,
    comm: collectives.Comm,
    options: SaveOptions,
    local_error: BaseException | None = None,
    members: dict[int, int] | None = None,
    on_save_id: Callable[[str], None] | None = None,
    parts: bool = False,
    storage: Storage | None = None,
) -> tuple[dict[str, Any], str, Metadata | None]:
    """:func:`save_snapshot`, returning what the commit told every rank (``outcome.outcome``),
    the save's id, and the coordinator's metadata (``None`` on other ranks): what a writer
    process sends back is this small outcome, not a Metadata of thousands of entries.

    Args:
        members: The save group's rank of each global rank of its members (default: those of
            ``comm``'s group; a writer process's own group numbers its ranks differently).
        on_save_id: Called with the save's id once this rank knows it (exchange 2), before
            this rank writes anything, so before the coordinator can commit.
        parts: Each rank's ``path`` is its own directory (:func:`save_parts`).
        storage: The storage of ``path`` to write through (default: opened from ``path``).
    """
    started = time.monotonic()
    exchange = _SaveExchange(snapshot, path, comm, options, local_error, members, parts, storage)
    # Exchange 1a: the coordinator's digest (a rank whose table has it sends no table).
    exchange.share_digest()
    try:
        # Exchange 1b: every rank's envelope on the coordinator, the verdict on every rank;
        # the coordinator holds the lock from here, before anything is written.
        exchange.gather_envelopes()
        # Exchange 2: each rank's assignment (or the plan's error, on every rank).
        save_id = exchange.scatter_assignments()
        if on_save_id is not None:  # before this rank writes, so before anything commits
            on_save_id(save_id)
        # Exchange 3: each rank's file facts on the coordinator, once its file is complete.
        exchange.write_files()
        # Exchange 4: the index is committed only after every rank's file is complete; the
        # outcome (and a small index) on every rank.
        outcome = exchange.commit()
        if exchange.built is None:
            return outcome, save_id, None
        # After the commit is acknowledged: no rank waits for the cleanup; the lock, still
        # held, makes removing earlier saves' files safe.
        exchange.clean_up(started)
        return outcome, save_id, exchange.built.metadata
    finally:
        exchange.release()


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


def save_parts(
    snapshot: Snapshot,
    path: str,
    comm: collectives.Comm,
    *,
    local_error: BaseException | None = None,
    sync_files: bool = True,
    storage: LocalStorage | None = None,
) -> str:
    """Save ``snapshot`` (:func:`~.snapshot.describe_or_error`'s) as parts (collective over
    ``comm``): ``path`` is a directory of this rank's own (node-local), where it writes its
    data file and the index of the whole save, the same on every rank. Any complete set of
    the ranks' data files, beside one copy of the index, is the checkpoint :func:`save` would
    have written (the local tier's parts: ``docs/local-tier.md``). Each ``path`` should be
    new: the save's lock and its cleanup of earlier saves are the coordinator's, in its own
    directory only. A ``local_error`` is raised on every rank. ``storage``, the storage of
    ``path``, is written through when given (the local tier's, which recycles files).

    Returns:
        The save's id (the same on every rank).
    """
    options = SaveOptions(process_group=comm.group, sync_files=sync_files)
    with paused_gc():
        _, save_id, _ = save_outcome(
            snapshot, path, comm, options, local_error, parts=True, storage=storage
        )
    return save_id


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
