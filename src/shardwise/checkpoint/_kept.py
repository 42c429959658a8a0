"""Bytes the verifying pass of a load checked, kept for the pass that copies them, so that
they are read once: :class:`KeptBytes`."""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass

from shardwise.checkpoint.storage import TemporaryBytes
from shardwise.checkpoint.tuning import TUNING

__all__ = ["KeptBytes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Segment:
    """Kept bytes ``[begin, end)`` of a file: in ``memory``, or at ``spilled`` in the
    temporary file."""

    begin: int
    end: int
    memory: memoryview | None
    spilled: int


class KeptBytes:
    """Bytes the first pass verified, kept for the second, so that each is read once.

    Up to ``memory_limit`` bytes (default: ``TUNING.keep_in_memory_bytes``) stay in memory.
    With ``spill`` (remote storage, where reading again means requesting again), more go to a
    :class:`TemporaryBytes` file; if that file cannot be written (a full disk), the bytes are
    dropped, and read from the store again when they are needed: slower, never wrong. Without
    ``spill`` (a local file, which the page cache serves again as fast as a temporary file
    would), bytes beyond the limit are not kept.
    """

    def __init__(self, memory_limit: int | None = None, spill: bool = True) -> None:
        self._memory_limit = TUNING.keep_in_memory_bytes if memory_limit is None else memory_limit
        self._spill_allowed = spill
        self._in_memory = 0
        self._segments: dict[str, list[_Segment]] = {}
        self._spill = TemporaryBytes()
        self._spill_failed = False
        self._lock = threading.Lock()

    @property
    def room(self) -> int:
        """Bytes that can still be kept in memory."""
        with self._lock:
            return self._memory_limit - self._in_memory

    @property
    def spilled(self) -> int:
        """Bytes in the temporary file."""
        return self._spill.size

    def holds(self, file: str) -> bool:
        """Whether any bytes of ``file`` are kept."""
        return file in self._segments

    def keep(self, file: str, begin: int, data: memoryview) -> None:
        """Keep ``data``, the verified bytes of ``file`` from ``begin`` (unless they are kept
        already)."""
        with self._lock:
            segments = self._segments.get(file, [])
            index = bisect.bisect_right(segments, begin, key=_begin) - 1
            if index >= 0 and segments[index].end >= begin + len(data):
                return
            if self._in_memory + len(data) <= self._memory_limit:
                segment = _Segment(begin, begin + len(data), data, -1)
                self._in_memory += len(data)
            else:
                offset = self._write_spill(data)
                if offset is None:
                    return
                segment = _Segment(begin, begin + len(data), None, offset)
            bisect.insort(self._segments.setdefault(file, []), segment, key=_begin)

    def _write_spill(self, data: memoryview) -> int | None:
        if self._spill_failed or not self._spill_allowed:
            return None
        try:
            return self._spill.append(data)
        except OSError as err:
            self._spill_failed = True
            logger.warning(
                "cannot keep verified bytes in a temporary file (%s): they will be read from "
                "the storage again",
                err,
            )
            return None

    def read(self, file: str, offset: int, buffer: memoryview) -> bool:
        """Copy the kept bytes ``[offset, offset + len(buffer))`` of ``file`` into ``buffer``;
        False if they are not all kept (then ``buffer`` must be read from the storage)."""
        view = buffer.cast("B")
        end = offset + len(view)
        with self._lock:
            segments = self._segments.get(file)
            if not segments:
                return not view
            position = offset
            while position < end:
                # The last segment starting at or before ``position``: it must contain it.
                index = bisect.bisect_right(segments, position, key=_begin) - 1
                if index < 0 or segments[index].end <= position:
                    return False
                segment = segments[index]
                stop = min(end, segment.end)
                target = view[position - offset : stop - offset]
                if segment.memory is not None:
                    target[:] = segment.memory[position - segment.begin : stop - segment.begin]
                else:
                    self._spill.read_into(segment.spilled + position - segment.begin, target)
                position = stop
            return True

    def close(self) -> None:
        """Drop everything kept (the temporary file is deleted)."""
        with self._lock:
            self._segments.clear()
            self._in_memory = 0
            self._spill_failed = False
            self._spill.close()


def _begin(segment: _Segment) -> int:
    return segment.begin
