"""Deleting a checkpoint of a series so that a kill at any point leaves nothing that looks
committed, and what a killed deletion left is finished later (``docs/manager.md``, *Deletion*).

The order: take the checkpoint's save lock (so no save writes it meanwhile, and a killed
save's leftovers are ours to remove), remove the index (the checkpoint stops being committed at
that instant), make that durable, remove the data files and the other files, release the lock,
remove the directories. A kill after the first removal leaves an uncommitted step directory
older than a committed one: :func:`finish_deletions` removes those.

Retention by reference: a data file that an incremental checkpoint which stays references
(:func:`protected_files`, computed from every committed index before anything is removed) is
never removed; its step directory stays, uncommitted, holding only such files, until no
committed checkpoint references them.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable

from shardwise.checkpoint.index import DATA_DIR, INDEX_NAME
from shardwise.checkpoint.manager.policy import RetentionPolicy, retained
from shardwise.checkpoint.manager.series import (
    CheckpointInfo,
    list_series,
    references_of,
    step_name,
)
from shardwise.checkpoint.saving.lock import LOCK_NAME, SaveLock
from shardwise.checkpoint.storage import Storage, UnsafePathError
from shardwise.errors import CheckpointError, CheckpointLockedError

__all__ = [
    "DELETION_ERRORS",
    "apply_retention",
    "delete_checkpoint",
    "finish_deletions",
    "protected_files",
]

logger = logging.getLogger("shardwise.checkpoint.manager")

#: What a deletion may raise that leaves that checkpoint (or what is left of it) for a later
#: try, and the others to delete: a failure of the storage, or a hostile file in the step
#: directory (a save lock naming a process id beyond the platform's, ...).
DELETION_ERRORS = (OSError, ArithmeticError, ValueError, CheckpointError)


def _remove_files(storage: Storage, *parts: str, keep: Callable[[str], bool]) -> None:
    """Remove the entries of directory ``parts`` (below the root) but those ``keep`` names."""
    for name in storage.listdir(storage.join(*parts)):
        if name != DATA_DIR and not keep(name):
            storage.remove(storage.join(*parts, name))


def protected_files(
    storage: Storage, listing: Iterable[CheckpointInfo], deleting: Iterable[int] = ()
) -> frozenset[tuple[str, str]]:
    """``(step directory, "data/<file>")`` of every data file that a committed checkpoint of
    ``listing``, but those of ``deleting``, references (:func:`references_of`: what the
    validated reader reads through its index, or every reference name an index that does not
    decode holds): what no deletion may remove.

    Raises:
        CheckpointError: An index could not be read (then nothing may be deleted: it may
            reference anything).
    """
    skip = set(deleting)
    protected: set[tuple[str, str]] = set()
    for info in listing:
        if info.committed and info.step not in skip:
            protected.update(references_of(storage, info.step).files)
    return frozenset(protected)


def delete_checkpoint(
    storage: Storage,
    step: int,
    open_step: Callable[[int], Storage],
    protected: frozenset[tuple[str, str]] = frozenset(),
) -> bool:
    """Delete the checkpoint of ``step`` from the series at ``storage``'s root, but the data
    files of ``protected`` (:func:`protected_files`), which stay in its ``data/``.

    Args:
        open_step: The storage of a step's directory (for its save lock).

    Returns:
        False when a save holds the checkpoint's lock: it was left alone.

    Raises:
        OSError: The storage failed (what was removed stays removed; a later call finishes),
            or the step's name is not a real directory (``UnsafePathError``: nothing done).
    """
    name = step_name(step)
    # A real directory below the root, or nothing is done: the lock's storage starts at the
    # step's path, and would follow a link there (taking over, then removing, a lock file out
    # of the root). Listed as a directory, it may have become a link since.
    storage.listdir(storage.join(name))
    lock = SaveLock(open_step(step), f"delete-{secrets.token_hex(4)}")
    try:
        lock.acquire()
    except CheckpointLockedError:
        logger.info("not deleting %s: a save to it is running", storage.url(storage.join(name)))
        return False
    try:
        # The commit marker first: from here on nothing reads it as a checkpoint.
        storage.remove(storage.join(name, INDEX_NAME))
        storage.sync_dir(storage.join(name))
        # Compared without case: on a file system that ignores it (macOS, Windows), a
        # reference to STEP-00000001/data/RANK-... reads this directory's files.
        kept = {
            file.casefold().removeprefix(f"{DATA_DIR}/")
            for owner, file in protected
            if owner.casefold() == name.casefold()
        }

        def keep(entry: str) -> bool:
            return entry.casefold() in kept

        if DATA_DIR in storage.listdir(storage.join(name)):
            try:
                _remove_files(storage, name, DATA_DIR, keep=keep)
            except UnsafePathError:  # a link (or a file) named data: removed, never followed
                storage.remove(storage.join(name, DATA_DIR))
            else:
                if not any(map(keep, storage.listdir(storage.join(name, DATA_DIR)))):
                    storage.remove_directory(storage.join(name, DATA_DIR))
        _remove_files(storage, name, keep=lambda entry: entry.startswith(LOCK_NAME))
    finally:
        lock.release()
    if DATA_DIR in storage.listdir(storage.join(name)):
        return True  # later checkpoints read files of it: the directory stays for them
    # A save may have taken the lock since: then the directory is not empty, and stays.
    storage.remove_directory(storage.join(name))
    return True


def finish_deletions(
    storage: Storage,
    listing: Iterable[CheckpointInfo],
    open_step: Callable[[int], Storage],
    *,
    writing: int | None,
    protected: frozenset[tuple[str, str]] = frozenset(),
) -> list[int]:
    """Delete the uncommitted step directories older than the newest committed checkpoint:
    deletions that a kill interrupted, and saves killed before their commit that no resumed run
    will finish. ``writing`` (the step a save of this manager writes) is never touched, nor a
    data file of ``protected``.

    Returns:
        The steps deleted. A failure is logged and the rest go on (a later call retries).
    """
    listed = list(listing)
    newest = max((info.step for info in listed if info.committed), default=None)
    deleted = []
    for info in listed:
        if newest is None or info.committed or info.step >= newest or info.step == writing:
            continue
        try:
            if delete_checkpoint(storage, info.step, open_step, protected):
                deleted.append(info.step)
        except DELETION_ERRORS as err:
            logger.warning("could not finish deleting %s: %s; a later call retries", info.path, err)
    return deleted


def apply_retention(
    storage: Storage,
    retention: RetentionPolicy,
    own: list[int],
    writing: int | None,
    open_step: Callable[[int], Storage],
    shown: Callable[[int], str],
) -> None:
    """Delete the committed checkpoints ``retention`` drops (never ``own``: the step being
    written and the manager's last commit) and finish interrupted deletions; ``shown(step)``
    names a checkpoint in the log. Failures are logged, not raised: space is lost, not a
    checkpoint, and the caller tries again at its next commit (a failure that lasts would
    otherwise cost a listing, and a warning, at every training step)."""
    try:
        listing = list_series(storage, records=retention.keep_best is not None)
        good = {info.step: info.metrics for info in listing if info.good}
        dropped = sorted(set(good) - retained(retention, good, own))
        # Before anything is removed: the files that the checkpoints staying reference.
        protected = protected_files(storage, listing, dropped)
        for step in dropped:
            try:
                if delete_checkpoint(storage, step, open_step, protected):
                    logger.info("deleted %s (retention)", shown(step))
            except DELETION_ERRORS as err:  # this one stays for the next try; the others go on
                logger.warning("could not delete %s: %s", shown(step), err)
        finish_deletions(storage, listing, open_step, writing=writing, protected=protected)
    except DELETION_ERRORS as err:
        logger.warning(
            "could not apply the retention policy under %s: %s", storage.url(storage.root), err
        )
