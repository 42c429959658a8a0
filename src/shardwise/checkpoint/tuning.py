"""Every tunable of the checkpoint machinery, each overridable from the environment.

The defaults are measured choices (the reason stands beside each field). Set
``SHARDWISE_<FIELD NAME IN CAPITALS>`` before importing ``shardwise.checkpoint`` to override one
(docs/tuning.md). Read once, at import: every rank of a job reads the same environment,
so ranks agree on every value without exchanging them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TUNING", "Tuning", "from_environment"]

_KIB = 1 << 10
_SUFFIXES = {"": 1, "KIB": _KIB, "MIB": _KIB**2, "GIB": _KIB**3}
_BYTES = re.compile(r"\s*([0-9]+)\s*([KMG]iB)?\s*", re.IGNORECASE)
_PREFIX = "SHARDWISE_"


@dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """The tunables. Fields ending in ``_bytes`` are byte counts, in ``_seconds`` durations."""

    io_threads: int = dataclasses.field(default_factory=lambda: min(4, os.cpu_count() or 1))
    """Threads that read (and, on object stores, write) concurrently: 4, or fewer cores. Reads
    release the GIL, but more threads than cores only add hand-offs (measured on 2 cores: the
    verifying pass over 300 MiB took 21 ms on 2 threads and 28 ms on 4)."""

    inline_bytes: int = 1 << 20
    """Work on fewer bytes runs on the calling thread, as a pool costs more in GIL hand-offs
    (measured: 10,000 small reads took 2.1 s on 4 threads, 0.45 s on one)."""

    request_bytes: int = 8 << 20
    """The most bytes one request to a remote store reads (a large read: concurrent requests)."""

    storage_batch_bytes: int = 64 << 20
    """The most bytes one batched ranged read (``cat_ranges``, held in memory) asks for."""

    read_batch_bytes: int = 32 << 20
    """The most bytes each pass of a load reads in one batch: bounds the buffers in flight."""

    read_run_bytes: int = 8 << 20
    """A load reads adjacent checksummed blocks together up to this much (one thread's span)."""

    read_gap_bytes: int = 64 << 10
    """A load with ``verify=False`` reads through a smaller gap rather than issue another read."""

    hot_buffer_bytes: int = 1 << 20
    """A load reads a span in pieces of at most this much, hashing each while in cache, and
    each I/O thread's reused scratch buffer is this large (measured, 300 MiB on tmpfs: 49 ms
    with fresh 8 MiB buffers, 28 ms with a reused 1 MiB one)."""

    read_cost_bytes: int = 64 << 10
    """What one more read costs, in bytes: a load reads through a smaller gap in a chunk."""

    sent_index_bytes: int = 4 << 20
    """A save sends its committed index to every rank with the outcome up to this size; above,
    each rank's returned ``Metadata`` reads it from storage when walked."""

    scatter_run_bytes: int = 16 << 10
    """The shortest run of a strided read that is read straight into its destination (one
    ``preadv``); shorter ones go through a thread's buffer, since building a buffer per run
    costs more (measured from tmpfs: 0.79x for 4 KiB runs, 0.98x for 8 KiB, 1.05x for 16 KiB,
    1.19x for 32 KiB, 1.47x for 48 KiB)."""

    lookup_chunks: int = 8
    """A tensor saved in more chunks is planned through a sweep order (``ChunkLookup``)."""

    small_write_bytes: int = 1 << 20
    """Smaller entries share a buffer's write (else 10,000 small tensors cost 10,000 writes)."""

    write_buffer_bytes: int = 8 << 20
    """The size of that buffer: it is written out when full."""

    write_piece_bytes: int = 4 << 20
    """Large entries are written in pieces of this size (a multiple of the 1 MiB checksum
    block), each block hashed right before it is written, while it is in cache."""

    staging_bytes: int = 64 << 20
    """GPU tensors are copied to the host through a reused pinned buffer of this size."""

    lock_heartbeat_seconds: float = 5.0
    """The holder of a save lock renews its heartbeat this often."""

    lock_stale_seconds: float = 120.0
    """A lock with an older heartbeat is a dead save's, to take over (a margin for clock skew)."""

    consolidate_piece_bytes: int = 8 << 20
    """``shardwise consolidate`` converts a tensor this many bytes at a time (its extra memory)."""

    async_writer_nice: int = 10
    """How much lower the CPU priority of ``async_save``'s writer processes is than their
    training process's (1 to 19): on busy cores the training step comes first, and the save
    takes the cycles it leaves (measured, an FSDP2 step on 2 ranks of 2 cores while both
    writers wrote 151 MiB each: 65% of its idle rate at the same priority, 91% at 10)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not math.isfinite(value):
                raise ValueError(f"{_PREFIX}{field.name.upper()} must be finite, got {value}")
            if not value > 0:
                raise ValueError(f"{_PREFIX}{field.name.upper()} must be positive, got {value}")
        if self.write_piece_bytes % (1 << 20):
            raise ValueError(
                f"{_PREFIX}WRITE_PIECE_BYTES must be a multiple of 1 MiB (the checksum block), "
                f"got {self.write_piece_bytes}"
            )


def _parse(name: str, text: str, kind: str) -> int | float:
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    if name.endswith("_BYTES"):
        match = _BYTES.fullmatch(text)
        if match is None:
            raise ValueError(f"{name} must be a byte count such as 8388608 or 8MiB, got {text!r}")
        return int(match.group(1)) * _SUFFIXES[(match.group(2) or "").upper()]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def from_environment(environ: Mapping[str, str]) -> Tuning:
    """The defaults, overridden by every ``SHARDWISE_<FIELD>`` variable set in ``environ``.

    Raises ``ValueError`` naming the variable when a value does not parse or is out of range.
    """
    values: dict[str, int | float] = {}
    for field in dataclasses.fields(Tuning):
        name = _PREFIX + field.name.upper()
        text = environ.get(name)
        if text is not None and text.strip():
            values[field.name] = _parse(name, text, str(field.type))
    return Tuning(**values)  # type: ignore[arg-type]


#: The values this process uses.
TUNING = from_environment(os.environ)
