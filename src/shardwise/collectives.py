"""The one module that talks to ``torch.distributed``.

Everything that crosses ranks goes through here: group and rank bookkeeping, JSON metadata
exchange (never pickles), verdict agreement before a collective, and the point-to-point moves
of shard bytes. Keeping it in one place makes the rest of shardwise testable without processes
and keeps the rank/group-rank translation (a classic source of bugs) in one spot.

Every collective is bounded by its process group's timeout: the backend raises once it passes.
For the checkpoint layer (:class:`Comm`, and the ``operation`` keyword of
:func:`exchange_or_raise` and :func:`all_gather_json`) that failure becomes a
:class:`~shardwise.errors.CheckpointTimeoutError` that names the call, the timeout and the
ranks that did not arrive; elsewhere the backend's own error propagates.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.errors import CHECKPOINT_ERRORS, CheckpointError, CheckpointTimeoutError

__all__ = [
    "Comm",
    "RemoteError",
    "all_gather_json",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_sum_int",
    "all_to_all",
    "barrier",
    "comm_device",
    "describe_error",
    "exchange_or_raise",
    "global_rank",
    "global_ranks",
    "group_rank",
    "group_timeout",
    "group_world_size",
    "is_initialized",
    "is_member",
    "new_gloo_group_like",
    "rebuild_error",
    "resolve_group",
    "rpc_initialized",
    "rpc_worker_id",
    "send_recv_bytes",
    "to_group_rank",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The operation a Comm names when its caller does not say which one it runs.
_ANY_OPERATION = "checkpoint"
# The "[path/to/file.cc:123] " that gloo puts in front of its messages.
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*")

# Exception types that can be rebuilt with the same type on a rank that did not raise: the
# built-in ones the API contract uses. Anything else is re-raised as RemoteError.
_REBUILDABLE: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        RuntimeError,
        NotImplementedError,
        AssertionError,
        IndexError,
        KeyError,
        AttributeError,
    )
}


class RemoteError(RuntimeError):
    """Another rank of the group failed; the message names the rank and its error."""


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def resolve_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """``process_group``, or the default group when it is ``None``."""
    if process_group is not None:
        return process_group
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return group


def global_rank() -> int:
    """This process's rank in the default group."""
    return dist.get_rank()


def group_rank(process_group: ProcessGroup) -> int:
    """This process's rank in ``process_group`` (-1 when not a member)."""
    return dist.get_rank(process_group)


def is_member(process_group: ProcessGroup) -> bool:
    """Whether this process belongs to ``process_group``."""
    return group_rank(process_group) >= 0


def group_world_size(process_group: ProcessGroup) -> int:
    """Number of ranks in ``process_group``."""
    return dist.get_world_size(process_group)


def global_ranks(process_group: ProcessGroup) -> list[int]:
    """Global ranks of ``process_group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(process_group))


def to_group_rank(process_group: ProcessGroup, rank: int) -> int:
    """The group rank of global ``rank`` in ``process_group``."""
    if process_group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(process_group, rank)


def group_timeout(process_group: ProcessGroup) -> timedelta | None:
    """The timeout of ``process_group``'s collectives (``None`` when its backend does not say).

    It is the ``timeout`` given to ``init_process_group``/``new_group`` (or set since), read
    from the backend that runs the group's collectives on :func:`comm_device`.
    """
    try:
        timeout = process_group._get_backend(comm_device(process_group)).options._timeout
    except (AttributeError, RuntimeError, TypeError):  # a backend without options, or fake
        return None
    return timeout if isinstance(timeout, timedelta) else None


def comm_device(process_group: ProcessGroup) -> torch.device:
    """The device collectives of ``process_group`` run on: CPU for gloo, else the accelerator."""
    backend = str(dist.get_backend(process_group))
    if "gloo" in backend.split(":") or "gloo" in backend:
        return torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def _name_ranks(process_group: ProcessGroup, ranks: Sequence[int]) -> str:
    """``ranks`` (group ranks), with their global ranks where those differ."""
    text = ", ".join(str(rank) for rank in ranks)
    members = global_ranks(process_group)
    if any(members[rank] != rank for rank in ranks):
        text += f" (global {', '.join(str(members[rank]) for rank in ranks)})"
    return text


def _collective_failure(
    process_group: ProcessGroup, operation: str, error: BaseException
) -> CheckpointTimeoutError:
    """The error that says checkpoint ``operation`` is collective, after one of its
    collectives over ``process_group`` failed with ``error`` (a timeout, a peer that died).

    Which ranks are missing is known only in a group of two (the other one): a failed
    all-gather or broadcast does not say which peers never came.
    """
    call = (
        "this shardwise.checkpoint call"
        if operation == _ANY_OPERATION
        else f"shardwise.checkpoint.{operation}"
    )
    me = group_rank(process_group)
    others = [rank for rank in range(group_world_size(process_group)) if rank != me]
    timeout = group_timeout(process_group)
    within = "within the process group's timeout"
    if timeout is not None:
        within = f"within {_seconds(timeout)} (the process group's timeout)"
    lines = str(error).strip().splitlines()
    detail = _SOURCE_LOCATION.sub("", lines[0]) if lines else ""
    context = [
        f"this is rank {_name_ranks(process_group, [me])}",
        f"{type(error).__name__}: {detail}",
    ]
    if len(others) == 1:
        missing = f"rank {_name_ranks(process_group, others)}"
    else:
        missing = f"one or more of ranks {_name_ranks(process_group, others)}"
        context.insert(0, "which ones cannot be known from here")
    return CheckpointTimeoutError(
        f"{call} is collective: every rank of the process group must call it; {missing} did "
        f"not arrive {within} or dropped out ({'; '.join(context)}). Call it on every rank: "
        "one that skips it, raises before calling it or dies leaves the others waiting until "
        "the timeout"
    )


@contextlib.contextmanager
def _bounded(process_group: ProcessGroup, operation: str | None) -> Iterator[None]:
    """Raise a failure of the collectives inside as a CheckpointTimeoutError naming
    ``operation`` (as torch raised it when ``operation`` is ``None``)."""
    if operation is None:
        yield
        return
    try:
        yield
    # torch.distributed's errors (DistBackendError, DistNetworkError, ...) are RuntimeErrors,
    # and so are gloo's timeouts and closed connections.
    except RuntimeError as err:
        raise _collective_failure(process_group, operation, err) from err


def all_gather_json(
    value: object, process_group: ProcessGroup, *, operation: str | None = None
) -> list[Any]:
    """Gather one JSON-able ``value`` from every member of ``process_group``, in group-rank order.

    Two collectives: the payload lengths, then the payloads padded to the longest.

    Args:
        operation: The checkpoint operation this gather is part of (``"save"``, ...): a failure
            of the collectives (a rank that never comes, or died) is then raised as
            :class:`~shardwise.errors.CheckpointTimeoutError`. ``None``: as torch raises it.
    """
    device = comm_device(process_group)
    world = group_world_size(process_group)
    payload = _encode(value).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    with _bounded(process_group, operation):
        dist.all_gather(lengths, length, group=process_group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    received = [torch.empty_like(padded) for _ in range(world)]
    with _bounded(process_group, operation):
        dist.all_gather(received, padded, group=process_group)
    return [
        json.loads(bytes(buf[: int(n.item())].cpu().numpy()).decode())
        for buf, n in zip(received, lengths, strict=True)
    ]


def describe_error(error: BaseException) -> dict[str, Any]:
    """A JSON description of ``error`` that :func:`rebuild_error` turns back into one.

    A :class:`~shardwise.errors.CheckpointError` keeps its key, file and rank.
    """
    if isinstance(error, CheckpointError):
        # Its message ends with the context its keywords add; keep the bare message.
        return {
            "type": type(error).__name__,
            "message": error.bare_message,
            "key": error.key,
            "file": error.file,
            "rank": error.rank,
        }
    message = (
        error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)
    )
    return {"type": type(error).__name__, "message": message}


def exchange_or_raise(
    process_group: ProcessGroup,
    compute: Callable[[], T],
    encode: Callable[[T], object] = lambda value: value,
    *,
    operation: str | None = None,
) -> tuple[T, list[Any]]:
    """Run ``compute`` locally, then share its verdict with every member of the group.

    Every rank reaches the same verdict before anyone moves on: if ``compute`` raised on any
    rank, every rank raises — the failing rank its own exception, the others an exception of
    the same built-in type and message as the lowest failing rank (or :class:`RemoteError`).

    Args:
        operation: As for :func:`all_gather_json`. Only the exchange is concerned: what
            ``compute`` raises is shared as usual. A rank whose ``compute`` raised and whose
            exchange then failed raises its own exception, with the failure as a note.

    Returns:
        The local result and the list of every rank's ``encode(result)`` in group-rank order.
    """
    local: T | None = None
    error: BaseException | None = None
    try:
        local = compute()
        envelope: dict[str, object] = {"ok": encode(local)}
    except Exception as err:
        error = err
        envelope = {"error": describe_error(err)}
    try:
        gathered = all_gather_json(envelope, process_group, operation=operation)
    except CheckpointTimeoutError as failure:
        if error is None:
            raise
        # This rank's own error is what its caller must fix; the other ranks never heard of it.
        error.add_note(f"It was not shared with the other ranks: {failure}")
        raise error from None
    if error is not None:
        raise error
    for rank, entry in enumerate(gathered):
        if "error" in entry:
            raise rebuild_error(entry["error"], rank)
    return local, [entry["ok"] for entry in gathered]  # type: ignore[return-value]


def rebuild_error(description: dict[str, Any], rank: int) -> BaseException:
    """An exception equal in type and message to one described by another rank.

    Checkpoint errors come back as the same subclass with the same key and file, naming the
    failing rank.
    """
    checkpoint_cls = CHECKPOINT_ERRORS.get(description["type"])
    if checkpoint_cls is not None and "key" in description:
        failing = description["rank"] if description["rank"] is not None else rank
        return checkpoint_cls(
            description["message"], key=description["key"], file=description["file"], rank=failing
        )
    cls = _REBUILDABLE.get(description["type"])
    if cls is None:
        return RemoteError(
            f"rank {rank} failed with {description['type']}: {description['message']}"
        )
    return cls(description["message"])


def all_reduce_sum_int(value: int, process_group: ProcessGroup) -> int:
    """Sum an integer over the group (used for votes)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=comm_device(process_group))
    dist.all_reduce(tensor, group=process_group)
    return int(tensor.item())


def barrier(process_group: ProcessGroup) -> None:
    """Wait for every member of ``process_group``."""
    dist.barrier(group=process_group)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # Move raw bytes so every dtype (bool, complex, float8, ...) travels the same way, whatever
    # the backend supports for arithmetic collectives. A tensor torch calls contiguous may
    # still have a stride other than 1 in a dim of size 1 (e.g. a one-element expand), which
    # view() refuses: such a tensor is copied.
    if tensor.dim() and tensor.stride(-1) != 1:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor.reshape(-1).view(torch.uint8)


def send_recv_bytes(
    process_group: ProcessGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """Point-to-point exchange of contiguous tensors, as raw bytes.

    Args:
        process_group: The group the peers belong to.
        sends: ``(peer global rank, tensor)`` pairs to send.
        recvs: ``(peer global rank, tensor)`` pairs to receive into (filled in place).

    Pairs with the same peer are matched in order on both sides. Empty tensors are skipped
    (both sides know the sizes from the metadata, so they skip the same ones).
    """
    works = []
    for peer, tensor in recvs:
        if tensor.numel():
            works.append(dist.irecv(_as_bytes(tensor), src=peer, group=process_group))
    for peer, tensor in sends:
        if tensor.numel():
            works.append(dist.isend(_as_bytes(tensor.contiguous()), dst=peer, group=process_group))
    for work in works:
        if work is not None:
            work.wait()


def rpc_initialized() -> bool:
    """Whether ``torch.distributed.rpc`` has an agent in this process."""
    try:
        from torch.distributed import rpc
    except ImportError:  # pragma: no cover - torch built without distributed RPC
        return False
    return bool(rpc.is_available() and rpc._is_current_rpc_agent_set())  # type: ignore[attr-defined]


def rpc_worker_id(worker_name: str) -> int:
    """The RPC id of the worker called ``worker_name``.

    Raises:
        RuntimeError: RPC is not initialized.
        ValueError: No worker has that name.
    """
    if not rpc_initialized():
        raise RuntimeError(
            f"RPC framework needs to be initialized for using worker names: {worker_name}"
        )
    from torch.distributed import rpc

    for info in rpc._get_current_rpc_agent().get_worker_infos():  # type: ignore[attr-defined]
        if info.name == worker_name:
            return int(info.id)
    raise ValueError(f"Invalid worker name: {worker_name}")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, op: str, process_group: ProcessGroup) -> None:
    """All-reduce ``tensor`` in place over ``process_group`` (on the group's device).

    Args:
        op: ``"sum"``, ``"max"`` or ``"min"``.
    """
    reduce_op = _REDUCE_OPS[op]
    device = comm_device(process_group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=reduce_op, group=process_group)
        return
    staged = tensor.to(device)
    dist.all_reduce(staged, op=reduce_op, group=process_group)
    tensor.copy_(staged)


class Comm:
    """A process group seen by the checkpoint layer, or a single process without one.

    ``Comm(None)`` with no default group initialized is a world of one: gathers return the
    local value, barriers return at once. So save/load work in a plain process.

    Every collective is bounded by the group's timeout; when one fails (a rank that never
    calls, or died) it raises :class:`~shardwise.errors.CheckpointTimeoutError` naming
    ``operation``, e.g. ``Comm(process_group, operation="save")``.
    """

    def __init__(
        self, process_group: ProcessGroup | None, *, operation: str = _ANY_OPERATION
    ) -> None:
        #: The checkpoint call this is for (``"save"``, ``"async_save"``, ``"load"``): a failed
        #: collective raises :class:`~shardwise.errors.CheckpointTimeoutError` naming it.
        self.operation = operation
        self.group: ProcessGroup | None
        if process_group is None and not is_initialized():
            self.group = None
            self.rank = 0
            self.world_size = 1
        else:
            self.group = resolve_group(process_group)
            self.rank = group_rank(self.group)
            self.world_size = group_world_size(self.group)

    def all_gather_json(self, value: object) -> list[Any]:
        """Every rank's JSON-able ``value``, in group-rank order."""
        if self.group is None:
            return [json.loads(json.dumps(value))]
        return all_gather_json(value, self.group, operation=self.operation)

    def broadcast_json(self, value: object, src: int) -> Any:
        """Group rank ``src``'s JSON-able ``value`` on every rank (others pass anything)."""
        if self.group is None:
            return json.loads(json.dumps(value))
        device = comm_device(self.group)
        payload = _encode(value).to(device) if self.rank == src else None
        length = torch.tensor([0 if payload is None else payload.numel()], device=device)
        src_global = dist.get_global_rank(self.group, src)
        with _bounded(self.group, self.operation):
            dist.broadcast(length, src=src_global, group=self.group)
        buffer = (
            payload
            if payload is not None
            else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        )
        with _bounded(self.group, self.operation):
            dist.broadcast(buffer, src=src_global, group=self.group)
        return json.loads(bytes(buffer.cpu().numpy()).decode())

    def exchange_or_raise(
        self, compute: Callable[[], T], encode: Callable[[T], object] = lambda value: value
    ) -> tuple[T, list[Any]]:
        """:func:`exchange_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            local = compute()
            return local, [json.loads(json.dumps(encode(local)))]
        return exchange_or_raise(self.group, compute, encode, operation=self.operation)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.group is not None:
            with _bounded(self.group, self.operation):
                barrier(self.group)

    def counter(self, key: str) -> SharedCounter | None:
        """A count every rank of this group adds to and any rank reads, without a collective,
        through the group's key-value store; ``None`` in a single process or when the group
        has no store."""
        if self.group is None:
            return None
        try:
            store = dist.distributed_c10d._get_process_group_store(self.group)
        except (AttributeError, KeyError, RuntimeError, ValueError):
            return None
        return SharedCounter(store, f"shardwise/counter/{key}")


class SharedCounter:
    """A count summed over the ranks of a group in its c10d store (see :meth:`Comm.counter`):
    used for progress, so no rank ever waits on it."""

    def __init__(self, store: Any, key: str) -> None:
        self._store = store
        self._key = key

    def add(self, amount: int) -> None:
        """Add ``amount`` (a failing store is ignored: a count is never worth a failure)."""
        with contextlib.suppress(RuntimeError, ValueError):
            self._store.add(self._key, amount)

    def read(self) -> int | None:
        """The sum so far, or ``None`` when the store cannot be reached."""
        try:
            return int(self._store.add(self._key, 0))
        except (RuntimeError, ValueError):
            return None

    def remove(self) -> None:
        """Delete the count from the store (once every rank is done adding)."""
        with contextlib.suppress(RuntimeError, ValueError):
            self._store.delete_key(self._key)


def new_gloo_group_like(process_group: ProcessGroup | None) -> ProcessGroup | None:
    """A new gloo group over the same ranks, with the same timeout (collective over the default
    group).

    Background checkpoint writes use it so that they never interleave with the training
    job's own collectives on the original group; they wait for a missing rank no longer than
    the original group would (not torch's default of 30 minutes).
    """
    if process_group is None and not is_initialized():
        return None
    original = resolve_group(process_group)
    group: ProcessGroup | None = dist.new_group(
        ranks=global_ranks(original), timeout=group_timeout(original), backend="gloo"
    )
    return group


def all_gather_tensor(tensor: torch.Tensor, process_group: ProcessGroup) -> list[torch.Tensor]:
    """Gather ``tensor`` from every member of ``process_group``, in group-rank order.

    Every member must pass a tensor of the same shape and dtype (agree on them first, e.g.
    with :func:`exchange_or_raise`). Raw bytes travel, so any dtype works on any backend. The
    results are new tensors on ``tensor``'s device; no autograd history.
    """
    world = group_world_size(process_group)
    if tensor.numel() == 0:
        # Nothing to move; gloo also rejects zero-byte collectives on some versions.
        return [torch.empty_like(tensor) for _ in range(world)]
    device = comm_device(process_group)
    payload = _as_bytes(tensor.detach().to(device).contiguous())
    received = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(received, payload, group=process_group)
    return [
        buffer.view(tensor.dtype).reshape(tensor.shape).to(tensor.device) for buffer in received
    ]


def all_to_all(
    sends: Sequence[torch.Tensor],
    recvs: Sequence[torch.Tensor],
    process_group: ProcessGroup,
) -> None:
    """Send ``sends[j]`` to group rank ``j`` and fill ``recvs[j]`` from it, for every ``j``.

    Splits may be uneven (any size per peer, empty included): each side allocates what it
    receives, so both must agree on the sizes. Built on point-to-point messages of raw bytes,
    which every backend supports for every dtype: gloo's list-form ``all_to_all`` rejects
    tensors of different sizes. ``recvs`` are filled in place; the tensor for this rank is
    copied locally.
    """
    me = group_rank(process_group)
    peers = global_ranks(process_group)
    device = comm_device(process_group)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    send_pairs: list[tuple[int, torch.Tensor]] = []
    recv_pairs: list[tuple[int, torch.Tensor]] = []
    for peer_index, (send, recv) in enumerate(zip(sends, recvs, strict=True)):
        if peer_index == me:
            recv.copy_(send)
            continue
        send_pairs.append((peers[peer_index], send.detach().to(device).contiguous()))
        if recv.device == device and recv.is_contiguous():
            recv_pairs.append((peers[peer_index], recv))
        else:
            buffer = torch.empty(recv.shape, dtype=recv.dtype, device=device)
            staged.append((buffer, recv))
            recv_pairs.append((peers[peer_index], buffer))
    send_recv_bytes(process_group, send_pairs, recv_pairs)
    for buffer, recv in staged:
        recv.copy_(buffer)
