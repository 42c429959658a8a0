"""The process group as the checkpoint layer sees it (:class:`Comm`), or a single process
without one, and counts shared through the group's store."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import Store

from shardwise.collectives.exchange import (
    agree_or_raise,
    all_gather_json,
    broadcast_json,
    broadcast_or_raise,
    exchange_or_raise,
    gather_json,
    gather_or_raise,
    scatter_json,
    scatter_or_raise,
)
from shardwise.collectives.failures import ANY_OPERATION
from shardwise.collectives.groups import group_rank, group_world_size, is_initialized, resolve_group

__all__ = ["Comm", "SharedCounter"]

T = TypeVar("T")


class Comm:
    """A process group seen by the checkpoint layer, or a single process without one.

    ``Comm(None)`` with no default group initialized is a world of one: gathers return the
    local value. So save/load work in a plain process.

    Every collective is bounded by the group's timeout; when one fails (a rank that never
    calls, or died) it raises :class:`~shardwise.errors.CheckpointTimeoutError` naming
    ``operation``, e.g. ``Comm(process_group, operation="save")``.
    """

    def __init__(
        self, process_group: ProcessGroup | None, *, operation: str = ANY_OPERATION
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
        return broadcast_json(value, self.group, src, operation=self.operation)

    def gather_json(self, value: object, dst: int = 0) -> list[Any] | None:
        """Every rank's JSON-able ``value`` on group rank ``dst`` (``None`` elsewhere)."""
        if self.group is None:
            return [json.loads(json.dumps(value))]
        return gather_json(value, self.group, dst, operation=self.operation)

    def scatter_json(self, values: Sequence[object] | None, src: int = 0) -> Any:
        """``values[r]`` from group rank ``src`` on each rank ``r`` (others pass ``None``)."""
        if self.group is None:
            assert values is not None and len(values) == 1
            return json.loads(json.dumps(values[0]))
        return scatter_json(values, self.group, src, operation=self.operation)

    def exchange_or_raise(
        self, compute: Callable[[], T], encode: Callable[[T], object] = lambda value: value
    ) -> tuple[T, list[Any]]:
        """:func:`exchange_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            local = compute()
            return local, [json.loads(json.dumps(encode(local)))]
        return exchange_or_raise(self.group, compute, encode, operation=self.operation)

    def agree_or_raise(
        self,
        compute: Callable[[], T],
        count: Callable[[T], Sequence[int]] = lambda value: (),
        width: int = 0,
    ) -> tuple[T, list[int]]:
        """:func:`agree_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            local = compute()
            return local, [int(number) for number in count(local)]
        return agree_or_raise(self.group, compute, count, width, operation=self.operation)

    def gather_or_raise(
        self,
        compute: Callable[[], T],
        encode: Callable[[T], object] = lambda value: value,
        dst: int = 0,
    ) -> tuple[T, list[Any] | None]:
        """:func:`gather_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            local = compute()
            return local, [json.loads(json.dumps(encode(local)))]
        return gather_or_raise(self.group, compute, encode, dst=dst, operation=self.operation)

    def scatter_or_raise(self, compute: Callable[[], Sequence[object]], src: int = 0) -> Any:
        """:func:`scatter_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            (value,) = compute()
            return json.loads(json.dumps(value))
        return scatter_or_raise(self.group, compute, src=src, operation=self.operation)

    def broadcast_or_raise(self, compute: Callable[[], object], src: int = 0) -> Any:
        """:func:`broadcast_or_raise` over this group (plain call in a single process)."""
        if self.group is None:
            return json.loads(json.dumps(compute()))
        return broadcast_or_raise(self.group, compute, src=src, operation=self.operation)

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

    def __init__(self, store: Store, key: str) -> None:
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
