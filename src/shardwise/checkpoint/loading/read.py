"""The one read pass: each checksummed block a read touches is read once, checked, and its
bytes used (:func:`read`); and the audit of whole data files (:func:`audit`). Spans and scatter
reads: ``docs/architecture.md`` (*Reading trusts nothing*, step 3); hashing costs a few ms per
GiB over an unverified read. A mismatch is known only after its span is read: a failed read
leaves its destinations undefined."""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from shardwise.checkpoint import tuning
from shardwise.checkpoint.loading.data_files import DataFiles, SourceFiles
from shardwise.checkpoint.storage import RangeRequest, batches, run_concurrently
from shardwise.errors import ChecksumError

__all__ = ["Segment", "audit", "read", "scratch"]

_HEX = 16
# Buffers per scatter read (the kernel takes up to 1,024 in one ``preadv``).
_MAX_BUFFERS = 1024

_local = threading.local()


def scratch() -> memoryview:
    """This thread's reused buffer (no allocation and no page faults per piece)."""
    size = tuning.TUNING.hot_buffer_bytes
    buffer: memoryview | None = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) != size:
        buffer = _local.buffer = memoryview(bytearray(size))
    return buffer


@dataclass(slots=True)
class Segment:
    """Bytes ``[begin, end)`` of data file ``file``, read into ``memory``; ``key`` for errors."""

    file: str
    begin: int
    memory: memoryview
    key: str

    @property
    def end(self) -> int:
        return self.begin + len(self.memory)


@dataclass(slots=True)
class _Span:
    """Bytes ``[begin, end)`` of ``file`` read together; ``checked``: whole blocks, hashed."""

    file: str
    begin: int
    end: int
    segments: list[Segment] = field(default_factory=list)
    checked: bool = True
    owners: list[_Owner] | None = None  # an audit's entries, to name blocks

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def key(self) -> str:
        return self.segments[0].key if self.segments else ""

    @property
    def wanted(self) -> int:
        if self.owners is not None:
            return self.length
        return sum(min(s.end, self.end) - max(s.begin, self.begin) for s in self.segments)


def read(
    files: SourceFiles,
    segments: Iterable[Segment],
    *,
    verify: bool = True,
    progress: Callable[[int], object] | None = None,
    note: str = "",
) -> None:
    """Read every segment (one overlapping another in a later round), checking every block it
    touches (with ``verify``: ``files`` of a checkpoint); ``note`` ends a checksum error's
    message.

    Raises:
        ChecksumError: A block does not match its checksum.
        CheckpointDataError: A data file is missing, unsafe, or shorter than the index says.
    """
    pending = [segment for segment in segments if len(segment.memory)]
    while pending:
        spans, pending = _plan(files, pending, verify)
        _perform(files, spans, None, progress, note)


def audit(
    files: DataFiles,
    names: Iterable[str],
    problems: list[ChecksumError],
    progress: Callable[[int], object] | None = None,
    owners: Mapping[str, Sequence[tuple[int, int, str]]] | None = None,
) -> None:
    """Check every block of the files ``names`` into ``problems``; ``owners`` (per file, its
    entries' ``(begin, end, key)`` in file order) name a block's first entry in its error."""
    spans = []
    run = _run_bytes(files)
    for name in names:
        files.handle(name)
        start, size = files.index.data_starts[name], files.index.files[name] or 0
        if start == size:  # an empty section: one block of zero bytes
            _compare(files, name, 0, xxhash.xxh3_64_hexdigest(b""), "", problems, "")
            continue
        named = [_Owner(*owner) for owner in (owners or {}).get(name, ())]
        for begin in range(start, size, run):
            end = min(begin + run, size)
            touching = [o for o in named if o.begin < end and begin < o.end]
            spans.append(_Span(name, begin, end, owners=touching))
    _perform(files, spans, problems, progress, "")


class _Owner(NamedTuple):
    """The bytes ``[begin, end)`` of entry ``key`` (to name a block in an audit)."""

    begin: int
    end: int
    key: str


def _run_bytes(files: DataFiles) -> int:
    """``TUNING.read_run_bytes`` in whole blocks."""
    size = files.index.block_size or 1
    return max(1, tuning.TUNING.read_run_bytes // size) * size


def _plan(
    files: SourceFiles, segments: list[Segment], verify: bool
) -> tuple[list[_Span], list[Segment]]:
    """The spans that read the ``segments`` no earlier one overlaps, and the rest."""
    segments.sort(key=lambda s: (s.file, s.begin))
    taken: list[Segment] = []
    later: list[Segment] = []
    file, end = "", 0
    for segment in segments:
        if segment.file == file and segment.begin < end:
            later.append(segment)
            continue
        taken.append(segment)
        file, end = segment.file, segment.end
    spans: list[_Span] = []
    for _, grouped in itertools.groupby(taken, key=lambda segment: segment.file):
        group = list(grouped)
        for segment in group:  # a missing or unsafe file fails before any read
            files.handle(segment.file, segment.key)
        spans.extend(_blocks_spans(_indexed(files), group) if verify else _plain_spans(group))
    return spans, later


def _blocks_spans(files: DataFiles, group: list[Segment]) -> list[_Span]:
    """Runs of the whole blocks that ``group`` (disjoint segments of one file, in order) touches."""
    if not group:
        return []
    index = files.index
    name = group[0].file
    size = index.block_size
    assert size is not None
    start, file_end = index.data_starts[name], index.files[name] or 0
    run = _run_bytes(files)
    spans: list[_Span] = []
    for segment in group:
        first = start + (segment.begin - start) // size * size
        last = min(start + -(-(segment.end - start) // size) * size, file_end)
        if spans and first < spans[-1].end:  # shares a block with the span before
            first = spans[-1].end
            spans[-1].segments.append(segment)
        while first < last:
            span = _Span(name, first, min(first + run, last), [segment])
            if spans and spans[-1].end == first and spans[-1].length + span.length <= run:
                spans[-1].end = span.end  # the span before grows to a run
                if spans[-1].segments[-1] is not segment:
                    spans[-1].segments.append(segment)
            else:
                spans.append(span)
            first = span.end
    return spans


def _indexed(files: SourceFiles) -> DataFiles:
    """``files`` as a checkpoint's: checked spans need its index's blocks and checksums."""
    assert isinstance(files, DataFiles), "checksums are known only for a checkpoint's files"
    return files


def _plain_spans(group: list[Segment]) -> list[_Span]:
    """Spans of the bytes ``group`` wants: close segments together, a large one in runs."""
    gap = min(tuning.TUNING.read_gap_bytes, tuning.TUNING.hot_buffer_bytes)
    run = tuning.TUNING.read_run_bytes
    spans: list[_Span] = []
    for segment in group:
        last = spans[-1] if spans else None
        if last is not None and segment.begin - last.end <= gap and segment.end - last.begin <= run:
            last.end = segment.end
            last.segments.append(segment)
            continue
        for begin in range(segment.begin, segment.end, run):
            end = min(begin + run, segment.end)
            spans.append(_Span(segment.file, begin, end, [segment], False))
    return spans


def _perform(
    files: SourceFiles,
    spans: list[_Span],
    problems: list[ChecksumError] | None,
    progress: Callable[[int], object] | None,
    note: str,
) -> None:
    """Read every span (on the I/O threads locally, as concurrent requests remotely)."""
    remote = files.storage.remote
    # Batches bound remote buffers in flight and pace progress; local reads otherwise go in
    # one batch (no thread waits at the end of a batch for its slowest span).
    limit = tuning.TUNING.read_batch_bytes if remote or progress is not None else sys.maxsize
    for batch in batches(spans, _length, limit):
        if remote:
            found = _read_remote(files, batch, note)
        else:
            found = run_concurrently(batch, _length, lambda span: _read_local(files, span, note))
        for mismatches in found:
            if mismatches and problems is None:
                raise mismatches[0]
            if problems is not None:
                problems.extend(mismatches)
        if progress is not None:
            progress(sum(span.wanted for span in batch))


def _length(span: _Span) -> int:
    return span.length


def _parts(span: _Span) -> Iterator[tuple[int, memoryview | None]]:
    """The bytes of ``span`` in order as ``(length, memory)`` (None: no segment wants them)."""
    position = span.begin
    for segment in span.segments:
        begin, end = max(segment.begin, span.begin), min(segment.end, span.end)
        if begin > position:
            yield begin - position, None
        yield end - begin, segment.memory[begin - segment.begin : end - segment.begin]
        position = end
    if span.end > position:
        yield span.end - position, None


def _pieces(span: _Span, limit: int, buffer: memoryview) -> Iterator[list[memoryview]]:
    """The buffers of each scatter read of ``span``, unwanted bytes in ``buffer``."""
    piece: list[memoryview] = []
    length = used = 0
    for size, memory in _parts(span):
        offset = 0
        while offset < size:
            if length == limit or len(piece) == _MAX_BUFFERS:
                yield piece
                piece, length, used = [], 0, 0
            take = min(size - offset, limit - length)
            if memory is not None:
                piece.append(memory[offset : offset + take])
            elif span.checked:
                piece.append(buffer[used : used + take])
                used += take
            else:
                piece.append(buffer[:take])
            length += take
            offset += take
    if piece:
        yield piece


def _read_local(files: SourceFiles, span: _Span, note: str) -> list[ChecksumError]:
    """Read ``span`` on this thread, hashing each piece after it is read; the mismatches."""
    buffer = scratch()
    # Hashed pieces must fit the scratch buffer; unhashed ones are as long as a run.
    limit = len(buffer) if span.checked else tuning.TUNING.read_run_bytes
    checker = _Checker(_indexed(files), span, note) if span.checked else None
    position = span.begin
    for piece in _pieces(span, limit, buffer):
        files.read_vector(span.file, position, piece, span.key)
        if checker is not None:
            for part in piece:
                checker.feed(part)
        position += sum(len(part) for part in piece)
    return checker.mismatches if checker is not None else []


def _read_remote(files: SourceFiles, spans: list[_Span], note: str) -> list[list[ChecksumError]]:
    """Read ``spans`` as one batch of concurrent requests; the mismatches of each."""
    found: list[list[ChecksumError]] = [[] for _ in spans]

    def finish(number: int, data: memoryview) -> None:
        span = spans[number]
        if span.checked:
            checker = _Checker(_indexed(files), span, note)
            checker.feed(data)
            found[number] = checker.mismatches
            if checker.mismatches:
                return
        if _direct(span) is None:
            for segment in span.segments:
                begin, end = max(segment.begin, span.begin), min(segment.end, span.end)
                target = segment.memory[begin - segment.begin : end - segment.begin]
                target[:] = data[begin - span.begin : end - span.begin]

    requests = [
        RangeRequest(files.handle(span.file, span.key), span.begin, span.length, _direct(span))
        for span in spans
    ]
    files.read_ranges(requests, [(span.file, span.key) for span in spans], finish)
    return found


def _direct(span: _Span) -> memoryview | None:
    """The memory of the one segment that takes all of ``span``, if any."""
    if len(span.segments) == 1:
        segment = span.segments[0]
        if segment.begin <= span.begin and span.end <= segment.end:
            return segment.memory[span.begin - segment.begin : span.end - segment.begin]
    return None


class _Checker:
    """Hashes a span's bytes (whole blocks), fed in order, block by block."""

    __slots__ = ("_begin", "_end", "_files", "_hasher", "_note", "_position", "_span", "mismatches")

    def __init__(self, files: DataFiles, span: _Span, note: str) -> None:
        self._files = files
        self._span = span
        self._note = note
        self._hasher: xxhash.xxh3_64 | None = None
        self._begin = self._position = span.begin
        self._end = self._block_end(span.begin)
        self.mismatches: list[ChecksumError] = []

    def _block_end(self, begin: int) -> int:
        index = self._files.index
        assert index.block_size is not None
        return min(begin + index.block_size, index.files[self._span.file] or 0)

    def feed(self, data: memoryview) -> None:
        """Hash ``data``, the span's next bytes."""
        offset = 0
        while offset < len(data):
            take = min(len(data) - offset, self._end - self._position)
            part = data[offset : offset + take]
            offset += take
            if self._hasher is None and take == self._end - self._begin:
                digest = xxhash.xxh3_64_hexdigest(part)  # a whole block in one piece: one call
            else:
                if self._hasher is None:
                    self._hasher = xxhash.xxh3_64()
                self._hasher.update(part)
                self._position += take
                if self._position < self._end:
                    continue
                digest = self._hasher.hexdigest()
            self._done(digest)

    def _done(self, digest: str) -> None:
        """Compare block ``[_begin, _end)``'s ``digest``, move to the next."""
        index, span = self._files.index, self._span
        assert index.block_size is not None
        number = (self._begin - index.data_starts[span.file]) // index.block_size
        key = _key_at(span.segments if span.owners is None else span.owners, self._begin, self._end)
        _compare(self._files, span.file, number, digest, key, self.mismatches, self._note)
        self._hasher = None
        self._begin = self._position = self._end
        self._end = self._block_end(self._end)


def _key_at(segments: Sequence[Segment | _Owner], begin: int, end: int) -> str:
    """The key of the first of ``segments`` (in file order) with bytes in ``[begin, end)``."""
    number = bisect.bisect_right(segments, begin, key=lambda s: s.end)
    if number < len(segments) and segments[number].begin < end:
        return segments[number].key
    return ""


def _compare(
    files: DataFiles,
    name: str,
    number: int,
    digest: str,
    key: str,
    mismatches: list[ChecksumError],
    note: str,
) -> None:
    """Add block ``number`` of file ``name`` to ``mismatches`` if ``digest`` is not its sum."""
    index = files.index
    expected = index.file_checksums[name][number * _HEX : (number + 1) * _HEX]
    if digest == expected:
        return
    assert index.block_size is not None
    begin = index.data_starts[name] + number * index.block_size
    end = min(begin + index.block_size, index.files[name] or 0)
    what = "a stored object" if key in index.objects else "a chunk of this tensor"
    if not key:
        what = "the data"
    what += f" in block {number} of the file (bytes {begin}-{end})"
    if key and _shared_block(files, key, name, begin, end):
        # A checksum cannot tell which entry's bytes changed.
        what += ", which also holds bytes of other entries (the changed bytes may be theirs)"
    mismatches.append(
        ChecksumError(
            f"checksum mismatch for {what}: expected {expected}, got {digest} — the data file "
            f"is corrupt{note}",
            key=key,
            file=files.shown(name),
            rank=files.rank,
        )
    )


def _shared_block(files: DataFiles, key: str, name: str, begin: int, end: int) -> bool:
    """Whether block ``[begin, end)`` of ``name`` may hold bytes of other entries than
    ``key`` (known without building chunks only for a blob or a single-chunk tensor)."""
    item = files.index.objects.get(key)
    chunk = item.blob if item is not None else None
    if chunk is None:
        tensor = files.index.tensors.get(key)
        chunks = tensor.chunks if tensor is not None else ()
        if type(chunks) is tuple and len(chunks) == 1:
            chunk = chunks[0]
    return chunk is None or chunk.file != name or not chunk.begin <= begin < end <= chunk.end
