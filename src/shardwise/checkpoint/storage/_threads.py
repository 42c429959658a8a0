"""The I/O threads of the storage layer, and how work is cut into batches for them."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from shardwise.checkpoint import tuning

__all__ = ["batches", "run_concurrently"]

T = TypeVar("T")
R = TypeVar("R")

_pool_lock = threading.Lock()
_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    """The I/O threads of this process, made on first use (starting threads for every batch
    costs more than small batches take), and made again in a forked child, which has none."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = concurrent.futures.ThreadPoolExecutor(
                tuning.TUNING.io_threads, thread_name_prefix="shardwise-io"
            )
            _pool = (os.getpid(), pool)
        return _pool[1]


def run_concurrently(
    items: Sequence[T], size: Callable[[T], int], work: Callable[[T], R]
) -> list[R]:
    """``work`` of every item, in order: small items inline, large ones on a few threads.

    Returns only once every item's work has ended; then the first exception (by item) propagates.
    """
    large = [
        number for number, item in enumerate(items) if size(item) >= tuning.TUNING.inline_bytes
    ]
    if len(large) <= 1:
        return [work(item) for item in items]
    pool = _threads()
    futures = {number: pool.submit(work, items[number]) for number in large}
    results: dict[int, R] = {}
    try:
        for number, item in enumerate(items):
            if number not in futures:
                results[number] = work(item)
    finally:
        # No thread may still be writing into a buffer once the caller moves on.
        concurrent.futures.wait(futures.values())
    for number in large:
        results[number] = futures[number].result()
    return [results[number] for number in range(len(items))]


def batches(items: Sequence[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """``items`` in order, cut into consecutive lists of at most ``limit`` total ``size`` (an
    item larger than ``limit`` alone)."""
    batch: list[T] = []
    total = 0
    for item in items:
        if batch and total + size(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size(item)
    if batch:
        yield batch
