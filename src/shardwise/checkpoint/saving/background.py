"""The training side of ``async_save``: one writer process per rank (:mod:`.writer_process`),
fed descriptors of the staging area (:mod:`.staging`) it shares with this process.

The writers of a job meet through the job's key-value store: group rank 0 publishes a token
and the store's address under a key of the save group's store, and every writer joins a gloo
group of its own under that token. A writer that dies (or whose training process dies) sets
the token's *abort* key: every other writer then reports it and exits, so each rank's future
fails naming the rank, or, when no save was in flight, its next ``async_save`` raises; the
call after that starts new writers. A save in flight whose writers failed may have committed
all the same (a writer killed after the index was renamed into place): each rank then reads
the index at the path, once no writer can still commit, and the future succeeds when it is the
save's own. Protocol: ``docs/architecture.md``, *Async save*.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
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
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

import shardwise
from shardwise import collectives
from shardwise._codec import strict_json
from shardwise.checkpoint import tuning
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.options import SaveOptions
from shardwise.checkpoint.saving.outcome import committed_metadata, returned_metadata
from shardwise.checkpoint.saving.snapshot import Snapshot
from shardwise.checkpoint.saving.staging import SharedBuffer, Staged, StagingArea
from shardwise.checkpoint.saving.writer_messages import (
    Aborted,
    Buffer,
    Done,
    Failed,
    Failure,
    Log,
    Reply,
    Save,
    SaveId,
    Stop,
    read_reply,
    row,
)
from shardwise.checkpoint.storage import LocalStorage, open_storage
from shardwise.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["WriterProcess", "claim_abort", "in_flight", "shutdown_writers", "writer_for"]

logger = logging.getLogger("shardwise.checkpoint.save")
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo groups
_STOP_SECONDS = 30.0
#: How long a rank whose save's writers failed waits to see the coordinator's writer end
#: before it reads the index (only that writer renames it into place).
_FINAL_SECONDS = 30.0
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
        found = strict_json(group_store.get(key), "the async writers' rendezvous record")
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
    found: dict[str, Any] = strict_json(store.get(key), "the abort reason")
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class _Unsettled:
    """A save in flight whose writers failed: what it takes to learn whether it committed."""

    future: concurrent.futures.Future[Metadata]
    save_id: str | None  # None: the writer never learned it, so nothing can have committed
    path: str
    directory: str  # the training process's directory at submit (a relative path's base)
    storage_options: dict[str, Any] | None
    coordinator: int


def _not_committed(cause: str, starts: str, rank: int | None) -> CheckpointError:
    return CheckpointError(
        f"{cause}; the save in flight, if any, was not committed (the previous checkpoint is "
        f"intact), and the next async_save starts {starts}",
        rank=rank,
    )


def _unconfirmed(
    cause: str, starts: str, rank: int | None, save: _Unsettled, why: BaseException
) -> CheckpointError:
    error = CheckpointError(
        f"{cause}; the save in flight to {save.path} may have committed: reading its index to "
        f"find out failed ({type(why).__name__}: {why}). It committed if "
        f"read_metadata({save.path!r}).storage_meta.save_id is {save.save_id!r}; if not, the "
        f"checkpoint there before it is untouched. The next async_save starts {starts}",
        rank=rank,
    )
    error.__cause__ = why
    return error


def _located(path: str, directory: str, storage_options: dict[str, Any] | None) -> str:
    """``path`` as the writer opened it: a relative local path from ``directory``."""
    storage = open_storage(path, storage_options)
    if isinstance(storage, LocalStorage) and not os.path.isabs(storage.root):
        return os.path.join(directory, storage.root)
    return path


class WriterProcess:
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
        #: The id of the save in flight, once the writer sent it (before anything commits).
        self.save_id: str | None = None
        self._directory = ""  # this process's directory at submit: a relative path's base
        self._coordinator = 0
        #: The id of the last save the writer replied "done" to.
        self._last_done: str | None = None
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
        request = Save(sent, path, options, local_error, self.members, os.getcwd())
        try:
            payload = pickle.dumps(row(request), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # e.g. storage_options holding a live object
            error = CheckpointError(
                f"cannot hand the save to the writer process: {type(err).__name__}: {err}"
            )
            empty = Staged([], {}, {})
            self._last_tensors = None
            payload = pickle.dumps(row(request._replace(staged=empty, local_error=error)))
        with self._lock:
            self.future, self.path, self.save_id = future, path, None
            self.storage_options = options.storage_options
            self._directory, self._coordinator = os.getcwd(), options.coordinator_rank
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
                self.conn.send(row(Buffer(grown.size)))
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
            reason = strict_json(self._store.get(self._abort_key), "the abort reason")
        except Exception:
            return
        self._aborted(reason)

    # -- the receiving thread --------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                reply = read_reply(self.conn.recv())
            except (EOFError, OSError):
                break
            except Exception as err:  # a reply that does not unpickle here, or is not a reply
                reply = Failure(CheckpointError(f"unreadable reply: {err}"), True)
            self._handle(reply)
        returncode = None
        try:
            returncode = self.process.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._store is not None:  # another rank's verdict on the save may wait for this
            with contextlib.suppress(Exception):
                self._store.set(self._gone_key(self.rank), "1")
        with self._lock:
            expected = self.dead  # stopped, aborted, or broken: already reported
        if not expected:
            self._died(_how(returncode), publish=True)

    def _handle(self, reply: Reply | None) -> None:
        """Act on one reply of the writer (``None``: a kind this process ignores)."""
        if isinstance(reply, Log):
            logging.getLogger(reply.logger).log(reply.level, "%s", reply.message)
        elif isinstance(reply, SaveId):
            with self._lock:
                self.save_id = reply.save_id
        elif isinstance(reply, Done):
            with self._lock:
                self._last_done = reply.save_id
            self._settle(self._metadata(reply.outcome, reply.save_id), None)
        elif isinstance(reply, Failure):
            if reply.broken:  # the writers' group broke: this writer exits now
                self._broken(reply.error)
            else:
                self._settle(None, reply.error)
        elif isinstance(reply, Aborted):
            reason: Any
            try:
                reason = strict_json(reply.reason, "the abort reason")
            except ValueError:
                reason = reply.reason
            self._aborted(reason)
        elif isinstance(reply, Failed):
            self._died(f"could not start: {reply.why}")

    def _metadata(self, outcome: dict[str, Any], save_id: str) -> Metadata | None:
        """The save's Metadata, decoded on first use (from the index sent with the outcome
        when small, else from storage): a loop that ignores it pays nothing for it."""
        with self._lock:
            path, storage_options = self.path, self.storage_options
        return returned_metadata(outcome, path, storage_options, save_id)

    def _settle(
        self,
        result: Metadata | None,
        error: BaseException | None,
        future: concurrent.futures.Future[Metadata] | None = None,
    ) -> None:
        """Settle ``future`` (default: the save in flight), no longer in flight after."""
        with self._lock:
            if future is None:
                future = self.future
            if self.future is future:
                self.future = None
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
        self._fail(
            f"the background writer of rank {rank} failed: {why}",
            "new writer processes",
            rank if isinstance(rank, int) else None,
            report_later=kind == "death",
            during=reason.get("save_id"),
        )

    def _died(self, how: str, publish: bool = False) -> None:
        if publish and self._store is not None:
            with self._lock:  # the save it died in, if any: see _fail's ``during``
                save_id = self.save_id if self.future is not None else None
            with contextlib.suppress(Exception):
                reason = {
                    "kind": "death",
                    "rank": self.rank,
                    "reason": f"its process {how}",
                    "save_id": save_id,
                }
                claim_abort(self._store, self._abort_key, reason)
        self._fail(
            f"the background writer process of rank {self.rank} {how}",
            "a new writer process",
            self.rank,
            report_later=True,
        )

    def _broken(self, error: BaseException) -> None:
        """The save failed and broke the writers' group: it may have committed first."""

        def unconfirmed(save: _Unsettled, why: BaseException) -> CheckpointError:
            cause = f"the save failed ({type(error).__name__}: {error})"
            found = _unconfirmed(cause, "new writer processes", None, save, why)
            found.__cause__ = error  # the failure itself; the message names the reading's
            return found

        with self._lock:
            self.dead = True
            save = self._unsettled()
        if save is not None:
            self._conclude(save, error, unconfirmed)

    def _fail(
        self,
        cause: str,
        starts: str,
        rank: int | None,
        report_later: bool,
        during: Any = None,
    ) -> None:
        """The writers failed: settle the save in flight by what is true at its path, or
        (``report_later``) keep the error for the next call. ``during``: the id of the save a
        writer of another rank died in; when this writer replied "done" to it, it committed,
        and that rank's future succeeds by the same reading: nothing is left to report."""
        with self._lock:
            if self.dead:
                return
            self.dead = True
            save = self._unsettled()
            if save is None:
                if report_later and (during is None or during != self._last_done):
                    self.pending = _not_committed(cause, starts, rank)
                return
        self._conclude(
            save,
            _not_committed(cause, starts, rank),
            functools.partial(_unconfirmed, cause, starts, rank),
        )

    def _unsettled(self) -> _Unsettled | None:
        """The save in flight (the lock held); it stays in flight until it is settled, so the
        next ``async_save`` waits for its verdict."""
        if self.future is None:
            return None
        return _Unsettled(
            self.future,
            self.save_id,
            self.path,
            self._directory,
            self.storage_options,
            self._coordinator,
        )

    def _conclude(
        self,
        save: _Unsettled,
        error: BaseException,
        unconfirmed: Callable[[_Unsettled, BaseException], BaseException],
    ) -> None:
        """Settle ``save``, whose writers failed: a success when its index is at the path,
        else ``error``; ``unconfirmed(save, why)`` when the index cannot be read."""
        if save.save_id is None:  # its writer died before exchange 2, so before any commit
            self._settle(None, error, save.future)
            return
        threading.Thread(  # storage reads and waits: never on the receiving thread
            target=self._confirm,
            args=(save, error, unconfirmed),
            name="shardwise-async-confirm",
            daemon=True,
        ).start()

    def _confirm(
        self,
        save: _Unsettled,
        error: BaseException,
        unconfirmed: Callable[[_Unsettled, BaseException], BaseException],
    ) -> None:
        assert save.save_id is not None
        try:
            self._wait_until_final(save.coordinator)
            path = _located(save.path, save.directory, save.storage_options)
            metadata = committed_metadata(path, save.storage_options, save.save_id)
        except Exception as err:  # whatever failed, the future settles, saying it is unknown
            self._settle(None, unconfirmed(save, err), save.future)
            return
        if metadata is None:
            self._settle(None, error, save.future)
        else:  # committed: the save is durable, however its writer ended
            self._settle(metadata, None, save.future)

    def _wait_until_final(self, coordinator: int) -> None:
        """Return once no writer can still commit the save: this rank's own has ended, and so
        has the coordinator's (only it renames the index into place), as its training
        process publishes; every rank then reads the same index, and reaches the same verdict.

        Raises:
            CheckpointError: The coordinator's writer was not seen to end in time.
        """
        with contextlib.suppress(OSError):
            self.process.kill()  # failed: it exits anyway, and must not commit meanwhile
        self.process.wait()
        if self._store is None or coordinator == self.rank:
            return
        host, port = self.rendezvous.host, self.rendezvous.port
        assert host is not None and port is not None  # a store: a group of more than one
        limit = datetime.timedelta(seconds=_FINAL_SECONDS)
        try:  # a client of its own: a wait holds a client's lock, check_abort would queue
            store = TCPStore(host, port, None, False, limit, wait_for_workers=False)
            store.wait([self._gone_key(coordinator)], limit)
        except Exception as err:  # a timeout, or the store is gone: not known, said so
            raise CheckpointError(
                f"the writer process of rank {coordinator}, the save's coordinator, was not "
                f"seen to end within {_FINAL_SECONDS:.0f} s ({type(err).__name__}: {err})"
            ) from err

    def _gone_key(self, rank: int) -> str:
        """Set once ``rank``'s writer process of this generation has ended."""
        return f"shardwise/async/{self.rendezvous.token}/gone/{rank}"

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
            self.conn.send(row(Stop()))
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
_writers: dict[tuple[Any, ...], WriterProcess] = {}
_made: dict[tuple[Any, ...], int] = {}


def writer_for(group: ProcessGroup | None) -> WriterProcess:
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
            writer = _writers[key] = WriterProcess(rank, world_size, members, timeout, rendezvous)
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
