"""The writer process of ``async_save``: one per training rank, started by
:mod:`.background` as ``python -m shardwise.checkpoint.saving.writer_process SETUP``.

It maps the staging buffer the training process fills, and runs the save itself
(:func:`~shardwise.checkpoint.saving.save.save_snapshot`) over a gloo group of its own, made
with the writer processes of the other ranks through the job's key-value store: the training
process only hands over descriptors, and no GIL of its own is taken. The protocol, the abort
key and the exits: ``docs/architecture.md``, *Async save*.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch

#: Exit codes: the training process died; the writers' group was aborted.
EXIT_ORPHANED = 4
EXIT_ABORTED = 3
_PARENT_POLL_SECONDS = 0.2
_PEER_DEATH_SECONDS = 2.0


class _Link:
    """The connection to the training process; messages may come from two threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except Exception as err:  # e.g. an exception that does not pickle: sent as text
                if message[0] != "error":
                    raise
                self.conn.send(("error", _plain(message[1], err), *message[2:]))


def _plain(error: BaseException, why: BaseException) -> BaseException:
    from shardwise.errors import CheckpointError

    return CheckpointError(f"{type(error).__name__}: {error} (not picklable: {why})")


class _Forward(logging.Handler):
    """Log records of ``shardwise`` go to the training process, which logs them there."""

    def __init__(self, link: _Link) -> None:
        super().__init__()
        self._link = link

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # the training process is gone: nowhere to log
            self._link.send(("log", record.name, record.levelno, record.getMessage()))


def _watch_parent(parent: int, abort: Any) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_SECONDS)
    abort("death", "its training process exited")
    os._exit(EXIT_ORPHANED)


def _watch_abort(store: Any, key: str, link: _Link, rank: int) -> None:
    while True:
        try:
            store.wait([key], datetime.timedelta(hours=1))
            reason = store.get(key).decode("utf-8", "replace")
            break
        except Exception as err:
            if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                continue
            return  # the store is gone (the job ended): nothing to watch
    with contextlib.suppress(ValueError, AttributeError):  # not a reason it wrote
        if json.loads(reason).get("rank") == rank:
            return  # this writer's own abort: its main thread reports it, then exits
    try:
        link.send(("aborted", reason))
    finally:
        os._exit(EXIT_ABORTED)


def _breaks_group(error: BaseException) -> bool:
    """Whether the writers' group is unusable after ``error``: every failure of a save is
    shared with every rank in step, except a collective that failed or timed out."""
    from shardwise.errors import CheckpointError, CheckpointTimeoutError

    if isinstance(error, CheckpointTimeoutError):
        return True
    return not isinstance(error, CheckpointError | TypeError | ValueError)


def main(setup: dict[str, Any]) -> int:
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    from shardwise import collectives
    from shardwise.checkpoint.saving.background import claim_abort
    from shardwise.checkpoint.saving.save import save_outcome
    from shardwise.checkpoint.saving.snapshot import Snapshot
    from shardwise.checkpoint.saving.staging import SharedBuffer, open_views
    from shardwise.errors import CheckpointError

    os.nice(setup["nice"])  # on busy cores the training step comes first (tuning.py)
    torch.set_num_threads(1)  # intra-op threads would only compete with the training loop
    # The collector would walk every tensor of a save, many times (see paused_gc): it runs
    # once after each save instead, when the save's objects are garbage.
    gc.disable()
    link = _Link(Connection(setup["fd"]))
    rank, world = setup["rank"], setup["world_size"]
    shardwise_logger = logging.getLogger("shardwise")
    shardwise_logger.setLevel(setup["log_level"])
    shardwise_logger.addHandler(_Forward(link))
    shardwise_logger.propagate = False
    timeout = datetime.timedelta(seconds=setup["timeout"])
    store = None
    abort_key = f"shardwise/async/{setup.get('token')}/abort"

    def abort(kind: str, why: str) -> dict[str, Any] | None:
        """Abort this generation's writers (the first reason holds), returned when another."""
        if store is None:
            return None
        with contextlib.suppress(Exception):
            if kind == "break":
                # A peer that died fails this save too: its rank names the cause, if it is
                # published soon (its training process does so as soon as it sees it die).
                with contextlib.suppress(Exception):
                    store.wait([abort_key], datetime.timedelta(seconds=_PEER_DEATH_SECONDS))
            held = claim_abort(store, abort_key, {"kind": kind, "rank": rank, "reason": why})
            return held if held.get("rank") != rank else None
        return None

    threading.Thread(target=_watch_parent, args=(setup["parent"], abort), daemon=True).start()
    if world > 1:
        try:
            store = TCPStore(setup["host"], setup["port"], None, False, timeout)
            watcher = TCPStore(setup["host"], setup["port"], None, False, timeout)
            threading.Thread(
                target=_watch_abort, args=(watcher, abort_key, link, rank), daemon=True
            ).start()
            group_store = PrefixStore(f"shardwise/async/{setup['token']}/group", store)
            dist.init_process_group(
                "gloo", store=group_store, rank=rank, world_size=world, timeout=timeout
            )
        except Exception as err:
            abort("break", f"its writer could not join the writers' group: {err}")
            link.send(("failed", f"{type(err).__name__}: {err}"))
            return 1

    def announce(save_id: str) -> None:
        """Tell the training process the save's id before anything can commit: should this
        process die later, it reads the index at the path to learn whether the save did (the
        socket delivers this before the end of the stream, even after a kill)."""
        with contextlib.suppress(OSError, ValueError):  # gone: its watcher ends this process
            link.send(("save_id", save_id))

    gc.freeze()  # what the imports made lives for ever: the collections after saves skip it
    link.send(("ready", os.getpid()))
    buffer: SharedBuffer | None = None
    tensors: dict[str, Any] | None = None  # the last save's, as views of the buffer
    while True:
        try:
            message = link.conn.recv()
        except (EOFError, OSError):  # the training process closed the link or died
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "buffer":
            tensors = None  # views of the old buffer
            if buffer is not None:
                buffer.close()
            buffer = SharedBuffer(recv_handle(link.conn), message[1])
            continue
        _, staged, path, options, local_error, members, directory = message
        data = buffer.bytes if buffer is not None else torch.empty(0, dtype=torch.uint8)
        comm = collectives.Comm(None, operation="async_save")
        snapshot: Snapshot | None = None
        try:
            os.chdir(directory)
            if staged.tensors is not None:  # else the same tensors as last time, restaged
                tensors = None
                tensors = open_views(staged, data)
            if tensors is None:
                raise CheckpointError("the writer lost the layout of the staged tensors")
            snapshot = Snapshot(tensors, staged.objects, staged.aliases)
            outcome, save_id, _ = save_outcome(
                snapshot, path, comm, options, local_error, members, announce
            )
        except BaseException as err:
            broken = _breaks_group(err)
            if broken:
                cause = abort("break", f"its save to {path} failed: {err}")
                if cause is not None:  # another writer failed first: that is the cause
                    link.send(("aborted", json.dumps(cause)))
                    return 2
            link.send(("error", err, broken))
            if broken:
                return 2
            gc.collect()
            continue
        finally:
            snapshot = staged = None  # the views go; the buffer stays
        link.send(("done", outcome, save_id))
        gc.collect()  # after the reply: the caller does not wait for it
    if buffer is not None:
        buffer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
