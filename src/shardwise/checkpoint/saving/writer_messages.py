"""The messages between a training process (:mod:`.background`) and its ``async_save`` writer
process (:mod:`.writer_process`), over the socket pair they share.

On the socket a message is a pickled plain tuple whose first item names its kind, then the
fields in order (``("done", outcome, save_id)``); here each kind is a NamedTuple, made from a
row by :func:`read_request` or :func:`read_reply` and turned back into one by :func:`row`.
A "save" request is pickled by the training process itself (a state that does not pickle is
reported there); a "buffer" request is followed on the socket by the buffer's file
descriptor. The protocol: ``docs/architecture.md``, *Async save*.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from shardwise.checkpoint.options import SaveOptions
    from shardwise.checkpoint.saving.staging import Staged

__all__ = [
    "Aborted",
    "Buffer",
    "Done",
    "Failed",
    "Failure",
    "Log",
    "Ready",
    "Reply",
    "Request",
    "Save",
    "SaveId",
    "Stop",
    "read_reply",
    "read_request",
    "row",
]


# -- the training process to its writer ----------------------------------------------------


class Stop(NamedTuple):
    """Finish: the writer leaves its loop and exits."""


class Buffer(NamedTuple):
    """A new staging buffer of ``size`` bytes, whose file descriptor follows."""

    size: int


class Save(NamedTuple):
    """Save the staged snapshot to ``path``, as one rank of the save group."""

    staged: Staged
    path: str
    options: SaveOptions
    #: Raised on every rank by the save (this rank could not describe or stage its state).
    local_error: BaseException | None
    #: The save group's rank of each global rank of its members.
    members: dict[int, int]
    #: The training process's directory: a relative path's base.
    directory: str


Request = Stop | Buffer | Save

# -- the writer to its training process ----------------------------------------------------


class Ready(NamedTuple):
    """The writer is set up and waits for requests."""

    pid: int


class Log(NamedTuple):
    """A log record of ``shardwise`` in the writer, logged again by the training process."""

    logger: str
    level: int
    message: str


class SaveId(NamedTuple):
    """The id of the save in flight, sent before anything can commit."""

    save_id: str


class Done(NamedTuple):
    """The save committed: what the commit told every rank (``outcome.outcome``)."""

    outcome: dict[str, Any]
    save_id: str


class Failure(NamedTuple):
    """The save failed with ``error`` (``broken``: the writers' group too; the writer exits)."""

    error: BaseException
    broken: bool


class Aborted(NamedTuple):
    """Another writer aborted the group; ``reason`` is the abort key's JSON, as it was set."""

    reason: str


class Failed(NamedTuple):
    """The writer could not join the writers' group (``why``: the error, as text)."""

    why: str


Reply = Ready | Log | SaveId | Done | Failure | Aborted | Failed

_REQUESTS: dict[str, type[Request]] = {"stop": Stop, "buffer": Buffer, "save": Save}
_REPLIES: dict[str, type[Reply]] = {
    "ready": Ready,
    "log": Log,
    "save_id": SaveId,
    "done": Done,
    "error": Failure,
    "aborted": Aborted,
    "failed": Failed,
}
_KINDS: dict[type[Any], str] = {
    kind: name for table in (_REQUESTS, _REPLIES) for name, kind in table.items()
}


def row(message: Request | Reply) -> tuple[Any, ...]:
    """``message`` as it travels: its kind's name, then its fields."""
    return (_KINDS[type(message)], *message)


def _read(table: dict[str, type[Any]], message: tuple[Any, ...]) -> Any:
    kind = table.get(message[0])
    if kind is None:
        return None
    return kind._make(message[1:])


def read_request(message: tuple[Any, ...]) -> Request | None:
    """The request ``message`` is (``None``: a kind this writer does not know)."""
    request: Request | None = _read(_REQUESTS, message)
    return request


def read_reply(message: tuple[Any, ...]) -> Reply | None:
    """The reply ``message`` is (``None``: a kind this process does not know).

    Raises:
        TypeError: ``message`` does not have the fields of its kind.
    """
    reply: Reply | None = _read(_REPLIES, message)
    return reply
