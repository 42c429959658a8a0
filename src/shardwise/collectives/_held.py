"""The tensors of a collective, let go only once the backend has let go of them.

A gloo process group runs each collective on a worker thread, which still holds the
collective's tensors for a moment after the caller's ``wait`` has returned. If the caller drops
its last reference to such a tensor in that moment, the tensor's Python object is handed to
the worker thread, which then needs the GIL to free it. When the interpreter is already
exiting by then (a script whose last call was a save, then ``destroy_process_group`` and
exit), the worker thread cannot get the GIL, dies inside C++ and the process aborts with
"terminate called without an active exception" (seen in about one run in eight of a script
ending with a 4-rank save on 2 cores; the C++ stack: ``ProcessGroupGloo::runLoop`` freeing an
``AsyncBroadcastWork`` whose tensors decref their Python objects, pytorch/pytorch#190489).

So every collective of :mod:`shardwise.collectives` runs inside :func:`held`: after it
returns, its tensors are kept until their use counts are back where they were before the call
(the worker has dropped them), waiting at most :data:`WAIT_SECONDS` for CPU tensors; tensors
still held then, and GPU tensors still held at once (a backend that keeps them until its
watchdog looks), are parked until the next collective, so that their last reference is not
dropped while a thread may hold them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator

import torch

__all__ = ["WAIT_SECONDS", "held"]

#: How long a collective's caller waits for the backend to drop its tensors.
WAIT_SECONDS = 0.005

# The tensors of the last collective whose backend had not dropped them in time.
_parked: list[torch.Tensor] = []


@contextlib.contextmanager
def held(*tensors: torch.Tensor | Iterable[torch.Tensor] | None) -> Iterator[None]:
    """Run the collective of ``tensors`` (tensors, lists of them, ``None``) inside: they are
    released only after the backend has released them (or parked, see the module)."""
    flat = [t for item in tensors for t in _tensors(item)]
    before = [_uses(tensor) for tensor in flat]
    yield  # a collective that raised may never complete: nothing to wait for then
    _release(flat, before)


def _tensors(item: torch.Tensor | Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    if item is None:
        return []
    if isinstance(item, torch.Tensor):
        return [item]
    return [tensor for tensor in item if isinstance(tensor, torch.Tensor)]


def _uses(tensor: torch.Tensor) -> int:
    count = getattr(tensor, "_use_count", None)  # a private torch method: 0 where missing
    return int(count()) if count is not None else 0


def _release(tensors: list[torch.Tensor], before: list[int]) -> None:
    # A GPU backend lets go of its tensors when its watchdog next looks (much later than a
    # CPU worker thread): those are parked at once rather than waited for.
    deadline = time.monotonic() + (WAIT_SECONDS if all(t.is_cpu for t in tensors) else 0.0)
    busy = [(tensor, count) for tensor, count in zip(tensors, before, strict=True) if count]
    while busy:
        busy = [(tensor, count) for tensor, count in busy if _uses(tensor) > count]
        if not busy:
            break
        if time.monotonic() >= deadline:
            _parked[:] = [tensor for tensor, _ in busy]
            return
        _yield()
    _parked.clear()


def _yield() -> None:
    """Let the backend's thread run (on a busy machine, it may share this core)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:  # pragma: no cover - not Linux
        time.sleep(0)
