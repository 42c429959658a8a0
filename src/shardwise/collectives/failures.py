"""What a failed collective or a failing rank becomes: a timeout that names the call and the
ranks that did not come, and errors described in JSON on one rank and rebuilt on the others
with the same type and message."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import ProcessGroup

from shardwise.collectives.groups import global_ranks, group_rank, group_timeout, group_world_size
from shardwise.errors import CHECKPOINT_ERRORS, CheckpointError, CheckpointTimeoutError, RemoteError

__all__ = ["ANY_OPERATION", "RemoteError", "bounded", "describe_error", "rebuild_error"]

# The operation a Comm names when its caller does not say which one it runs.
ANY_OPERATION = "checkpoint"
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
        if operation == ANY_OPERATION
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
def bounded(process_group: ProcessGroup, operation: str | None) -> Iterator[None]:
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
