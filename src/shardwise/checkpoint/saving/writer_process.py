"""The writer process of ``async_save``: one per training rank, started by
:mod:`.background` as ``python -m shardwise.checkpoint.saving.writer_process SETUP``.

It maps the staging buffer the training process fills, and runs the save itself
(:func:`~shardwise.checkpoint.saving.save.save_outcome`) over a gloo group of its own, made
with the writer processes of the other ranks through the job's key-value store: the training
process only hands over descriptors, and no GIL of its own is taken. Its life is the methods
of :class:`_WriterServer`, in order; the messages are :mod:`.writer_messages`. The protocol,
the abort key and the exits: ``docs/architecture.md``, *Async save*.
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
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from shardwise import collectives
from shardwise._codec import strict_json
from shardwise.checkpoint.saving.background import claim_abort
from shardwise.checkpoint.saving.save import save_outcome
from shardwise.checkpoint.saving.snapshot import Snapshot
from shardwise.checkpoint.saving.staging import SharedBuffer, open_views
from shardwise.checkpoint.saving.writer_messages import (
    Aborted,
    Buffer,
    Done,
    Failed,
    Failure,
    Log,
    Ready,
    Reply,
    Save,
    SaveId,
    Stop,
    read_request,
    row,
)
from shardwise.errors import CheckpointError, CheckpointTimeoutError

#: Exit codes: the training process died; the writers' group was aborted.
EXIT_ORPHANED = 4
EXIT_ABORTED = 3
#: Exit code: a save failed and broke the writers' group (or another writer's failure did).
EXIT_BROKEN = 2
#: Exit code: the writer could not join the writers' group.
EXIT_NOT_JOINED = 1
_PARENT_POLL_SECONDS = 0.2
_PEER_DEATH_SECONDS = 2.0


class _Link:
    """The connection to the training process; messages may come from two threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, reply: Reply) -> None:
        with self._lock:
            try:
                self.conn.send(row(reply))
            except Exception as err:  # e.g. an exception that does not pickle: sent as text
                if not isinstance(reply, Failure):
                    raise
                self.conn.send(row(reply._replace(error=_plain(reply.error, err))))


def _plain(error: BaseException, why: BaseException) -> BaseException:
    return CheckpointError(f"{type(error).__name__}: {error} (not picklable: {why})")


class _Forward(logging.Handler):
    """Log records of ``shardwise`` go to the training process, which logs them there."""

    def __init__(self, link: _Link) -> None:
        super().__init__()
        self._link = link

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # the training process is gone: nowhere to log
            self._link.send(Log(record.name, record.levelno, record.getMessage()))


def _watch_parent(parent: int, abort: Callable[[str, str], Any]) -> None:
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
        if strict_json(reason, "the abort reason").get("rank") == rank:
            return  # this writer's own abort: its main thread reports it, then exits
    try:
        link.send(Aborted(reason))
    finally:
        os._exit(EXIT_ABORTED)


def _breaks_group(error: BaseException) -> bool:
    """Whether the writers' group is unusable after ``error``: every failure of a save is
    shared with every rank in step, except a collective that failed or timed out."""
    if isinstance(error, CheckpointTimeoutError):
        return True
    return not isinstance(error, CheckpointError | TypeError | ValueError)


class _WriterServer:
    """This writer process's life, a method per step: :meth:`set_up` (and join the writers'
    group), :meth:`serve` each request of the training process until it stops, then
    :meth:`shut_down`; :meth:`abort` and :meth:`announce` are called along the way.

    Args:
        setup: What the training process passed (``background.WriterProcess``): the socket's
            file descriptor, ``rank``, ``world_size``, the rendezvous ``token``, ``host`` and
            ``port``, the groups' ``timeout``, the ``parent`` pid, ``log_level``, ``nice``.
    """

    def __init__(self, setup: dict[str, Any]) -> None:
        self.setup = setup
        self.link = _Link(Connection(setup["fd"]))
        self.rank: int = setup["rank"]
        self.world: int = setup["world_size"]
        self.timeout = datetime.timedelta(seconds=setup["timeout"])
        #: This generation's client of the job's store (``None``: a group of one, or none yet).
        self.store: Any = None
        self.abort_key = f"shardwise/async/{setup.get('token')}/abort"
        self.buffer: SharedBuffer | None = None
        #: The last save's tensors, as views of the buffer.
        self.tensors: dict[str, Any] | None = None

    def set_up(self) -> int | None:
        """Lower this process's priority, forward its logs, watch its training process, and
        join the writers' group (``world_size`` > 1), watching its abort key; then say
        "ready". Returns the exit code when the group could not be joined."""
        setup = self.setup
        os.nice(setup["nice"])  # on busy cores the training step comes first (tuning.py)
        torch.set_num_threads(1)  # intra-op threads would only compete with the training loop
        # The collector would walk every tensor of a save, many times (see paused_gc): it runs
        # once after each save instead, when the save's objects are garbage.
        gc.disable()
        shardwise_logger = logging.getLogger("shardwise")
        shardwise_logger.setLevel(setup["log_level"])
        shardwise_logger.addHandler(_Forward(self.link))
        shardwise_logger.propagate = False
        threading.Thread(
            target=_watch_parent, args=(setup["parent"], self.abort), daemon=True
        ).start()
        if self.world > 1:
            try:
                self._join(setup["host"], setup["port"], setup["token"])
            except Exception as err:
                self.abort("break", f"its writer could not join the writers' group: {err}")
                self.link.send(Failed(f"{type(err).__name__}: {err}"))
                return EXIT_NOT_JOINED
        gc.freeze()  # what the imports made lives for ever: the collections after saves skip it
        self.link.send(Ready(os.getpid()))
        return None

    def _join(self, host: str, port: int, token: str) -> None:
        self.store = TCPStore(host, port, None, False, self.timeout)
        watcher = TCPStore(host, port, None, False, self.timeout)
        threading.Thread(
            target=_watch_abort, args=(watcher, self.abort_key, self.link, self.rank), daemon=True
        ).start()
        group_store = PrefixStore(f"shardwise/async/{token}/group", self.store)
        dist.init_process_group(
            "gloo", store=group_store, rank=self.rank, world_size=self.world, timeout=self.timeout
        )

    def abort(self, kind: str, why: str) -> dict[str, Any] | None:
        """Abort this generation's writers (the first reason holds), returned when another."""
        store = self.store
        if store is None:
            return None
        with contextlib.suppress(Exception):
            if kind == "break":
                # A peer that died fails this save too: its rank names the cause, if it is
                # published soon (its training process does so as soon as it sees it die).
                with contextlib.suppress(Exception):
                    store.wait([self.abort_key], datetime.timedelta(seconds=_PEER_DEATH_SECONDS))
            reason = {"kind": kind, "rank": self.rank, "reason": why}
            held = claim_abort(store, self.abort_key, reason)
            return held if held.get("rank") != self.rank else None
        return None

    def announce(self, save_id: str) -> None:
        """Tell the training process the save's id before anything can commit: should this
        process die later, it reads the index at the path to learn whether the save did (the
        socket delivers this before the end of the stream, even after a kill)."""
        with contextlib.suppress(OSError, ValueError):  # gone: its watcher ends this process
            self.link.send(SaveId(save_id))

    def serve(self) -> int | None:
        """Serve the training process's requests until it says stop, closes the link or dies
        (``None``), or a save breaks the writers' group (its exit code)."""
        while True:
            try:
                message = self.link.conn.recv()
            except (EOFError, OSError):  # the training process closed the link or died
                return None
            request = read_request(message)
            if isinstance(request, Stop):
                return None
            if isinstance(request, Buffer):
                self._map_buffer(request)
            elif isinstance(request, Save):
                exit_code = self._save(request)
                if exit_code is not None:
                    return exit_code

    def _map_buffer(self, request: Buffer) -> None:
        """Map the new staging buffer, whose descriptor follows on the socket."""
        self.tensors = None  # views of the old buffer
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = SharedBuffer(recv_handle(self.link.conn), request.size)

    def _save(self, request: Save) -> int | None:
        """Run one save as this rank of the save group and reply "done" or "error"; returns
        the exit code when the save broke the writers' group."""
        staged, path = request.staged, request.path
        data = self.buffer.bytes if self.buffer is not None else torch.empty(0, dtype=torch.uint8)
        comm = collectives.Comm(None, operation="async_save")
        snapshot: Snapshot | None = None
        try:
            os.chdir(request.directory)
            if staged.tensors is not None:  # else the same tensors as last time, restaged
                self.tensors = None
                self.tensors = open_views(staged, data)
            if self.tensors is None:
                raise CheckpointError("the writer lost the layout of the staged tensors")
            snapshot = Snapshot(self.tensors, staged.objects, staged.aliases)
            outcome, save_id, _ = save_outcome(
                snapshot,
                path,
                comm,
                request.options,
                request.local_error,
                request.members,
                self.announce,
            )
        except BaseException as err:
            broken = _breaks_group(err)
            if broken:
                cause = self.abort("break", f"its save to {path} failed: {err}")
                if cause is not None:  # another writer failed first: that is the cause
                    self.link.send(Aborted(json.dumps(cause)))
                    return EXIT_BROKEN
            self.link.send(Failure(err, broken))
            if broken:
                return EXIT_BROKEN
            gc.collect()
            return None
        finally:
            snapshot = None  # the views go; the buffer stays
        self.link.send(Done(outcome, save_id))
        gc.collect()  # after the reply: the caller does not wait for it
        return None

    def shut_down(self) -> None:
        """Unmap the buffer and leave the writers' group."""
        if self.buffer is not None:
            self.buffer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(setup: dict[str, Any]) -> int:
    """The writer process: set up, serve, shut down; returns the exit code."""
    process = _WriterServer(setup)
    exit_code = process.set_up()
    if exit_code is not None:
        return exit_code
    exit_code = process.serve()
    if exit_code is not None:  # the group is broken: nothing to leave cleanly
        return exit_code
    process.shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(main(strict_json(sys.argv[1], "the writer's setup")))
