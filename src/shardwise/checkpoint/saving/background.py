"""The training side of ``async_save``: one writer process per rank (:mod:`.writer_process`),
fed descriptors of the staging area (:mod:`.staging`) it shares with this process.

The writers of a job meet through the job's key-value store: group rank 0 publishes a token
and the store's address under a key of the save group's store, and every writer joins a gloo
group of its own under that token. A writer that dies (or whose training process dies) sets
the token's *abort* key: every other writer then reports it and exits, so each rank's future
fails naming the rank, or, when no save was in flight, its next ``async_save`` raises; the
call after that starts new writers. Protocol: ``docs/architecture.md``, *Async save*.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

import shardwise
from shardwise import collectives
from shardwise.checkpoint import tuning
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.options import SaveOptions
from shardwise.checkpoint.saving.outcome import returned_metadata
from shardwise.checkpoint.saving.snapshot import Snapshot
from shardwise.checkpoint.saving.staging import SharedBuffer, Staged, StagingArea
from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Writer", "shutdown_writers", "writer_for"]

logger = logging.getLogger("shardwise.checkpoint.save")
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo groups
_STOP_SECONDS = 30.0
_WRITER_MODULE = "shardwise.checkpoint.saving.writer_process"


def _how(returncode: int | None) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


@dataclasses.dataclass(slots=True)
class _Rendezvous:
    """Where the writers of one save group meet (``None`` fields: a group of one)."""

    token: str | None = None
    host: str | None = None
    port: int | None = None
    store: Any = None  # a store this process serves, kept alive while its writers live


def _tcp_address(store: Any) -> tuple[str, int] | None:
    while store is not None:
        if isinstance(store, TCPStore):
            return str(store.host), int(store.port)
        store = getattr(store, "underlying_store", None)
    return None


def _rendezvous(group: ProcessGroup | None, rank: int, number: int) -> _Rendezvous:
    """Group rank 0 publishes a token and a store address; every rank reads them (the job's
    own store serves when it is a TCP store, else one served here)."""
    if group is None or collectives.group_world_size(group) == 1:
        return _Rendezvous()
    group_store = dist.distributed_c10d._get_process_group_store(group)
    key = f"shardwise/async-writers/{number}"
    if rank != 0:
        found = json.loads(group_store.get(key))
        return _Rendezvous(found["token"], found["host"], found["port"])
    served = None
    address = _tcp_address(group_store)
    if address is None:  # e.g. a file store: serve one on this host
        timeout = collectives.group_timeout(group) or _DEFAULT_TIMEOUT
        served = TCPStore(socket.gethostname(), 0, None, True, timeout, wait_for_workers=False)
        address = socket.gethostname(), int(served.port)
    token = secrets.token_hex(8)
    group_store.set(key, json.dumps({"token": token, "host": address[0], "port": address[1]}))
    return _Rendezvous(token, address[0], address[1], served)


def claim_abort(store: Any, key: str, reason: dict[str, Any]) -> dict[str, Any]:
    """Abort the writers of ``key``'s generation for ``reason``, unless someone did first;
    returns the reason that holds (the first one, which names the rank that failed first)."""
    if store.add(f"{key}/claims", 1) == 1:
        store.set(key, json.dumps(reason))
        return reason
    store.wait([key], datetime.timedelta(seconds=30))
    found: dict[str, Any] = json.loads(store.get(key))
    return found


class Writer:
    """This rank's writer process for one save group, and the save it has in flight."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        members: dict[int, int],
        timeout: datetime.timedelta,
        rendezvous: _Rendezvous,
    ) -> None:
        self.rank = rank
        self.members = members
        self.rendezvous = rendezvous
        self.staging = StagingArea()
        self.future: concurrent.futures.Future[Metadata] | None = None
        self.path = ""
        self.storage_options: dict[str, Any] | None = None
        # What the writer was last sent of the staged tensors (it keeps its views of them).
        self._last_tensors: list[tuple[Any, ...]] | None = None
        self._last_aliases: dict[str, str] = {}
        #: An error no future reported (the writers were aborted while idle).
        self.pending: CheckpointError | None = None
        self.dead = False
        self._lock = threading.Lock()
        self._abort_key = f"shardwise/async/{rendezvous.token}/abort"
        self._store: Any = None
        if rendezvous.token is not None:
            assert rendezvous.host is not None and rendezvous.port is not None
            self._store = TCPStore(
                rendezvous.host, rendezvous.port, None, False, timeout, wait_for_workers=False
            )
        ours, theirs = socket.socketpair()
        setup = {
            "fd": theirs.fileno(),
            "rank": rank,
            "world_size": world_size,
            "token": rendezvous.token,
            "host": rendezvous.host,
            "port": rendezvous.port,
            "timeout": timeout.total_seconds(),
            "parent": os.getpid(),
            "log_level": logging.getLogger("shardwise").getEffectiveLevel(),
            "nice": min(19, tuning.TUNING.async_writer_nice),
        }
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(shardwise.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", _WRITER_MODULE, json.dumps(setup)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        self._sender = concurrent.futures.ThreadPoolExecutor(1, "shardwise-async-send")
        self._receiver = threading.Thread(
            target=self._receive, name="shardwise-async-receive", daemon=True
        )
        self._receiver.start()

    # -- the training thread ---------------------------------------------------------------

    def submit(
        self,
        snapshot: Snapshot,
        path: str,
        options: SaveOptions,
        local_error: BaseException | None,
    ) -> concurrent.futures.Future[Metadata]:
        """Stage ``snapshot`` and hand it to the writer; returns the save's future."""
        future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        staged, grown = Staged([], {}, {}), None
        events: list[Any] = []
        if local_error is None:
            try:
                staged, grown, events = self.staging.stage(snapshot)
            except Exception as err:  # e.g. no memory left for the staging buffer
                local_error = CheckpointError(
                    f"cannot stage the state dict: {type(err).__name__}: {err}"
                )
                local_error.__cause__ = err
        options = dataclasses.replace(options, process_group=None)
        sent = staged
        if (
            local_error is None
            and grown is None
            and staged.tensors == self._last_tensors
            and staged.aliases == self._last_aliases
        ):  # the writer has them: a state of 20,000 tensors saves ~0.1 s sooner
            sent = Staged(None, staged.objects, staged.aliases)
        self._last_tensors = staged.tensors if local_error is None else None
        self._last_aliases = staged.aliases
        # The writer resolves a relative path where this process would: in its directory now.
        message = ("save", sent, path, options, local_error, self.members, os.getcwd())
        try:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # e.g. storage_options holding a live object
            error = CheckpointError(
                f"cannot hand the save to the writer process: {type(err).__name__}: {err}"
            )
            empty = Staged([], {}, {})
            self._last_tensors = None
            payload = pickle.dumps(("save", empty, path, options, error, self.members, os.getcwd()))
        with self._lock:
            self.future, self.path = future, path
            self.storage_options = options.storage_options
            if self.dead:  # died since the caller looked: fail like a save it was writing
                self._fail_in_flight(self.pending or CheckpointError("the writer process died"))
                return future
        self._sender.submit(self._send, payload, grown, events)
        return future

    def _send(self, payload: bytes, grown: SharedBuffer | None, events: list[Any]) -> None:
        # A writer that is gone raises OSError or ValueError here: the receiver reports how.
        with contextlib.suppress(OSError, ValueError):
            for event in events:  # the copies from GPUs are done
                event.synchronize()
            if grown is not None:
                self.conn.send(("buffer", grown.size))
                send_handle(self.conn, grown.fd, self.process.pid)
            self.conn.send_bytes(payload)

    def check_abort(self) -> None:
        """Learn now, from the store, whether the writers were aborted (not when this writer
        gets around to saying so): every rank then starts new writers at the same call."""
        if self._store is None or self.dead:
            return
        try:
            if not self._store.check([self._abort_key]):
                return
            reason = json.loads(self._store.get(self._abort_key))
        except Exception:
            return
        self._aborted(reason)

    # -- the receiving thread --------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as err:  # a reply that does not unpickle here
                message = ("error", CheckpointError(f"unreadable reply: {err}"), True)
            kind = message[0]
            if kind == "log":
                logging.getLogger(message[1]).log(message[2], "%s", message[3])
            elif kind == "done":
                self._settle(self._metadata(message[1], message[2]), None)
            elif kind == "error":
                self._settle(None, message[1])
                if message[2]:  # the writers' group broke: this writer exits now
                    with self._lock:
                        self.dead = True
            elif kind == "aborted":
                try:
                    reason = json.loads(message[1])
                except ValueError:
                    reason = message[1]
                self._aborted(reason)
            elif kind == "failed":
                self._died(f"could not start: {message[1]}")
        returncode = None
        try:
            returncode = self.process.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with self._lock:
            expected = self.dead  # stopped, aborted, or broken: already reported
        if not expected:
            self._died(_how(returncode), publish=True)

    def _metadata(self, outcome: dict[str, Any], save_id: str) -> Metadata | None:
        """The save's Metadata, decoded on first use (from the index sent with the outcome
        when small, else from storage): a loop that ignores it pays nothing for it."""
        with self._lock:
            path, storage_options = self.path, self.storage_options
        return returned_metadata(outcome, path, storage_options, save_id)

    def _settle(self, result: Metadata | None, error: BaseException | None) -> None:
        with self._lock:
            future, self.future = self.future, None
        if future is None or future.done():
            return
        if error is not None:
            self._last_tensors = None  # what the writer kept is unknown now
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def _aborted(self, reason: Any) -> None:
        if not isinstance(reason, dict):  # not what a writer claims: reported as it is
            reason = {"reason": repr(reason)[:200]}
        rank, why, kind = reason.get("rank"), reason.get("reason"), reason.get("kind")
        error = CheckpointError(
            f"the background writer of rank {rank} failed: {why}; the save in flight, if any, "
            "was not committed (the previous checkpoint is intact), and the next async_save "
            "starts new writer processes",
            rank=rank if isinstance(rank, int) else None,
        )
        self._fail(error, report_later=kind == "death")

    def _died(self, how: str, publish: bool = False) -> None:
        error = CheckpointError(
            f"the background writer process of rank {self.rank} {how}; the save in flight, if "
            "any, was not committed (the previous checkpoint is intact), and the next "
            "async_save starts a new writer process",
            rank=self.rank,
        )
        if publish and self._store is not None:
            with contextlib.suppress(Exception):
                reason = {"kind": "death", "rank": self.rank, "reason": f"its process {how}"}
                claim_abort(self._store, self._abort_key, reason)
        self._fail(error, report_later=True)

    def _fail(self, error: CheckpointError, report_later: bool) -> None:
        with self._lock:
            if self.dead:
                return
            self.dead = True
            if self.future is not None:
                self._fail_in_flight(error)
            elif report_later:
                self.pending = error

    def _fail_in_flight(self, error: CheckpointError) -> None:
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_exception(error)

    # -- shutdown --------------------------------------------------------------------------

    def stop(self, wait: bool) -> None:
        """Finish the save in flight (``wait``), then end the writer process."""
        future = self.future
        if wait and future is not None:
            concurrent.futures.wait([future], timeout=None)
        with self._lock:
            self.dead = True
            self.pending = None
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop",))
        try:
            self.process.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._sender.shutdown(wait=False)
        with contextlib.suppress(OSError):
            self.conn.close()
        self.staging.close()


#: This process's writers, by save group (global ranks and timeout), and how many were made
#: for each (the number every rank counts alike, naming the rendezvous key).
_writers: dict[tuple[Any, ...], Writer] = {}
_made: dict[tuple[Any, ...], int] = {}


def writer_for(group: ProcessGroup | None) -> Writer:
    """This rank's live writer for ``group`` (started on first use, collectively over the
    group's store); raises, once, the failure of writers that died while idle."""
    if group is None:
        key: tuple[Any, ...] = ("local",)
        rank, world_size, members = 0, 1, {0: 0}
        timeout = _DEFAULT_TIMEOUT
    else:
        ranks = collectives.global_ranks(group)
        timeout = collectives.group_timeout(group) or _DEFAULT_TIMEOUT
        key = (tuple(ranks), timeout.total_seconds())
        rank, world_size = collectives.group_rank(group), len(ranks)
        members = {global_rank: number for number, global_rank in enumerate(ranks)}
    writer = _writers.get(key)
    if writer is not None:
        writer.check_abort()
        if writer.dead:
            error = writer.pending
            del _writers[key]
            writer.stop(wait=False)
            if error is not None:
                raise error
            writer = None
    if writer is None:
        number = _made[key] = _made.get(key, 0) + 1
        try:
            rendezvous = _rendezvous(group, rank, number)
            writer = _writers[key] = Writer(rank, world_size, members, timeout, rendezvous)
        # No process, no store, or a rendezvous record that is not what rank 0 writes.
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"could not start the async_save writer process of rank {rank}: "
                f"{type(err).__name__}: {err}",
                rank=rank,
            ) from err
    return writer


def in_flight() -> list[concurrent.futures.Future[Metadata]]:
    return [w.future for w in _writers.values() if w.future is not None]


def shutdown_writers() -> None:
    """Finish every save in flight and end the writer processes (at exit, and for tests)."""
    while _writers:
        _, writer = _writers.popitem()
        writer.stop(wait=True)


def _forget_writers() -> None:
    """In a forked child: the writers are the parent's (their sockets too); never use or stop
    them from here (a DataLoader worker that exits must not end its parent's writer)."""
    _writers.clear()
    _made.clear()


atexit.register(shutdown_writers)
os.register_at_fork(after_in_child=_forget_writers)
