"""One save at a time per checkpoint path (``docs/format.md``, *One save at a time*): the
coordinator holds ``<ckpt>/shardwise.lock`` from before the first data file is written until
after the commit and the removal of killed saves' leftovers, which holding it makes safe.

A save whose last step every rank waits for (the DCP ``StorageWriter``'s ``finish``) removes
the leftovers after it returns (:meth:`SaveLock.release_after`), still holding the lock; the
next save of this process to the path waits for that removal (:func:`wait_for_cleanup`)
before anything of it is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from shardwise._codec import strict_json
from shardwise.checkpoint import tuning
from shardwise.checkpoint.storage import LocalStorage, Storage
from shardwise.errors import CheckpointLockedError, CheckpointStorageError

__all__ = ["LOCK_NAME", "SaveLock", "wait_for_cleanup"]

logger = logging.getLogger("shardwise.checkpoint.lock")

#: Name of the lock file, in the checkpoint directory.
LOCK_NAME = "shardwise.lock"
_MAX_LOCK_BYTES = 4096
# Process ids are C ints (os.kill raises OverflowError past them).
_MAX_PID = 2**31


# The cleanups running after their save returned, by lock (``_lock_key``): each thread holds
# its save's lock until its work is done.
_cleanups: dict[str, threading.Thread] = {}
_cleanups_guard = threading.Lock()


def _lock_key(storage: Storage) -> str:
    path = storage.join(LOCK_NAME)
    if isinstance(storage, LocalStorage):
        return os.path.realpath(path)  # one key for every spelling of a local path
    return f"{type(storage).__name__}:{path}"


def wait_for_cleanup(storage: Storage) -> None:
    """Wait for the cleanup a save of this process to ``storage`` still runs, if any
    (:meth:`SaveLock.release_after`): it removes temporary data files, so no data file of a
    new save may be written before it ends."""
    with _cleanups_guard:
        thread = _cleanups.get(_lock_key(storage))
    if thread is not None:
        thread.join()


class SaveLock:
    """The save lock of one checkpoint path, held by this process while it coordinates a save."""

    def __init__(self, storage: Storage, save_id: str) -> None:
        self._storage = storage
        self._path = storage.join(LOCK_NAME)
        self._save_id = save_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardwise-save-lock", daemon=True)

    def _content(self) -> bytes:
        holder = {"save_id": self._save_id, "host": socket.gethostname(), "pid": os.getpid()}
        return json.dumps({**holder, "heartbeat": time.time()}).encode()

    def _holder(self) -> dict[str, Any] | None:
        """The current holder as recorded, or None when there is no lock (or it is unreadable,
        which only a holder killed mid-write leaves: treated as stale)."""
        try:
            data = self._storage.read_small(self._path, _MAX_LOCK_BYTES)
        except FileNotFoundError:
            return None
        except CheckpointStorageError:
            raise  # the storage failed (no credentials, ...): no verdict on the lock
        except OSError:
            return {}
        try:
            holder = strict_json(data, "the save lock")
        except ValueError:  # not strict JSON (strict_json refuses deep nesting too)
            return {}
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict[str, Any]) -> bool:
        heartbeat, host, pid = holder.get("heartbeat"), holder.get("host"), holder.get("pid")
        # The lock is a file like any other: a value no holder writes (a pid that is not a
        # process id, a heartbeat that is not a time or is from the future) marks it stale
        # rather than held forever.
        if type(heartbeat) not in (int, float) or not math.isfinite(float(heartbeat or 0)):
            return True
        if type(pid) is not int or not 0 < pid < _MAX_PID:
            return True
        if host == socket.gethostname():
            try:
                with contextlib.suppress(PermissionError):  # it exists, owned by someone else
                    os.kill(pid, 0)
            except ProcessLookupError:
                return True
        return abs(time.time() - float(holder["heartbeat"])) > tuning.TUNING.lock_stale_seconds

    def acquire(self) -> None:
        """Take the lock (replacing a stale one) and start the heartbeat.

        Raises:
            CheckpointLockedError: Another save to this path is running.
        """
        wait_for_cleanup(self._storage)  # this process's own earlier save, finishing
        for _ in range(3):
            if self._storage.create_exclusive(self._path, self._content()):
                self._thread.start()
                return
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile: try again
            if not self._stale(holder):
                stale = int(tuning.TUNING.lock_stale_seconds)
                raise CheckpointLockedError(
                    f"another save to this path is running (save {holder.get('save_id')!r}, "
                    f"process {holder.get('pid')} on {holder.get('host')!r}); saves to one "
                    "path run one at a time: wait for it, or save to another path. A lock "
                    f"whose save died is taken over after {stale} s without a heartbeat",
                    file=self._path,
                )
            try:
                self._storage.remove(self._path)
            except FileNotFoundError:
                continue  # released meanwhile
            except CheckpointStorageError:
                raise
            except OSError as err:  # a directory, or a file this process may not remove
                raise CheckpointStorageError(
                    f"the save lock cannot be taken over: {err.strerror or err} (a directory "
                    "in its place?); remove it if no save to this path is running",
                    file=self._path,
                ) from err
        raise CheckpointLockedError(
            "could not take the save lock: other saves keep taking it", file=self._path
        )

    def _beat(self) -> None:
        while not self._stop.wait(tuning.TUNING.lock_heartbeat_seconds):
            try:
                self._storage.replace_small(self._path, self._content())
            except OSError:
                return  # the save fails or finishes on its own; a missed beat is harmless

    def release(self) -> None:
        """Stop the heartbeat and remove the lock; a failure to remove it is only logged."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        try:
            self._storage.remove(self._path)
        except OSError as err:
            logger.warning(
                "could not remove the save lock %s: %s; another save takes it over after %d s",
                self._path,
                err,
                int(tuning.TUNING.lock_stale_seconds),
            )

    def release_after(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` in a thread holding the lock, then release it; return at once.

        The thread is not a daemon (the interpreter waits for it at exit); a failure of
        ``cleanup`` is logged (the save is committed: what it leaves only costs space, and
        the next save removes it). The next save of this process to the path waits for it
        (:func:`wait_for_cleanup`, which :meth:`acquire` calls).
        """
        key = _lock_key(self._storage)

        def run() -> None:
            try:
                cleanup()
            except Exception as err:  # a lost mount, a store's error: logged, never raised
                logger.warning("the cleanup after a save to %s failed: %s", self._path, err)
            finally:
                self.release()
                with _cleanups_guard:
                    if _cleanups.get(key) is threading.current_thread():
                        del _cleanups[key]

        thread = threading.Thread(target=run, name="shardwise-save-cleanup")
        with _cleanups_guard:  # acquire waited for the one before: none is running
            _cleanups[key] = thread
        thread.start()
