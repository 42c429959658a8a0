"""What a save or a load tells the people running it: a progress bar and a summary log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from shardwise import collectives
from shardwise._progress import JobProgress, human_bytes

__all__ = ["exchange_with_bar", "job_bar", "log_done"]

_T = TypeVar("_T")


def job_bar(comm: collectives.Comm, total: int, description: str, key: str) -> JobProgress:
    """The bar of a job of ``total`` bytes (every rank's), drawn on rank 0; every rank counts
    its bytes into the group's shared count ``key`` (unique to the job)."""
    return JobProgress(total, description, show=comm.rank == 0, counter=comm.counter(key))


def exchange_with_bar(
    comm: collectives.Comm, work: Callable[[], _T], bar: JobProgress | None, dst: int | None = None
) -> tuple[_T, list[Any] | None]:
    """``comm.agree_or_raise(work)`` (with ``dst``: ``gather_or_raise``, whose results ``dst``
    receives) for a step ``bar`` (if any) counts: the bar ends full only when every rank
    succeeded."""

    def counted() -> _T:
        try:
            return work()
        finally:
            if bar is not None:
                bar.finish()

    succeeded = False
    try:
        result: tuple[_T, list[Any] | None] = (
            (comm.agree_or_raise(counted)[0], None)
            if dst is None
            else comm.gather_or_raise(counted, dst=dst)
        )
        succeeded = True
        return result
    finally:
        if bar is not None:
            bar.close(succeeded=succeeded)


def log_done(
    logger: logging.Logger, what: str, path: str, nbytes: int, seconds: float, detail: str = ""
) -> None:
    """Log at INFO ``"<what> <path>: <bytes><detail> in <seconds> s (<throughput>/s)"``, e.g.
    ``saved /ckpt/100: 1.5 GiB in 4 files in 2.31 s (664.9 MiB/s)``."""
    rate = human_bytes(nbytes / seconds) if seconds > 0 else "-"
    logger.info(
        "%s %s: %s%s in %.2f s (%s/s)", what, path, human_bytes(nbytes), detail, seconds, rate
    )
