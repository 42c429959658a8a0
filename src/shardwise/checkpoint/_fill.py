"""The second pass of every read of a checkpoint: the needed bytes, already verified by the
first pass (:mod:`._verify`), read into their destinations (:func:`fill`).

Locally, the work is cut into units of about ``TUNING.read_run_bytes`` that the I/O threads
share (a large tensor in pieces), each read from the verified bytes the first pass kept where
it kept them, otherwise from the file:

- A read whose bytes are the destination's as they are (C order, same dtype, a contiguous
  CPU tensor: nearly every read of a load) goes straight into the destination's memory.
- A strided read (a part of a chunk whose rows are not adjacent in the file, e.g. a column
  block of row-wise chunks) goes a few rows at a time (:class:`_Rows`): rows 32 KiB or more
  apart are read one by one straight into the destination (the gaps are not read); closer
  ones of 16 KiB and more go in one scatter read (``preadv``) that puts each row into the
  destination and each gap into a scratch buffer; shorter, closer rows go through each
  thread's reused buffer and are copied out at once.

On an object store, and for anything else (a cast, a destination that is not contiguous CPU
memory), reads go in batches through ``read_ranges``; a read that cannot go straight into its
destination goes into a staging buffer and is copied from there by the thread that read it,
while the bytes are in the cache. Buffers in flight are bounded by ``TUNING.read_batch_bytes``.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from shardwise._boxes import borrowed_bytes, byte_view, narrow_to
from shardwise.checkpoint import planner
from shardwise.checkpoint._data_files import HOT_BYTES, DataFiles, Read, hot_buffer
from shardwise.checkpoint._items import LocalBox
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.storage import batches, run_concurrently
from shardwise.checkpoint.tuning import TUNING

__all__ = ["Job", "fill"]

# Buffers per scatter read (the kernel takes up to 1,024 in one ``preadv``).
_SCATTER_BUFFERS = 1024

# The smallest gap between the runs of a strided read that is skipped (each run then read
# on its own, straight into its place) rather than read through. Measured on tmpfs, the
# left halves of 256 MiB of rows loaded by a process's I/O threads (``bench/load_passes.py
# --only resharded``): rows of 64 KiB took 50 ms either way, reading 1.00x instead of 2.00x
# the bytes needed and 10% less CPU; rows of 32 KiB took 80 ms run by run against 54 ms
# through the gaps (a read per 16 KiB run costs more than copying the gap, once two threads
# take turns at the GIL for every read). Skipping is what keeps a resharded load reading
# the bytes it needs, not twice as many.
_SKIP_GAP = 32 << 10


@dataclass(slots=True)
class Job:
    """One read of saved bytes into a destination box (treated as immutable; not frozen,
    which costs a fifth of a microsecond per field on construction, per job).

    Attributes:
        target: Index of the destination in the list given to :func:`fill`.
        key: The state-dict key (for errors).
        chunk: The saved chunk read from.
        read: What to read and where it goes.
        dtype: The saved dtype.
    """

    target: int
    key: str
    chunk: SavedChunk
    read: planner.ChunkRead
    dtype: torch.dtype


def fill(
    files: DataFiles,
    jobs: Sequence[Job],
    targets: Sequence[LocalBox],
    progress: Callable[[int], object] | None = None,
) -> None:
    """Perform ``jobs``: read their bytes into the destinations ``targets`` (no checksums:
    verify their blocks first).

    Raises:
        CheckpointDataError: A read failed, or came back short (a truncated file).
        CheckpointStorageError: The storage failed.
    """
    local = not files.storage.remote
    direct: list[Read] = []
    strided: list[_Rows] = []
    staged: list[tuple[Job, torch.Tensor]] = []
    for job in sorted(jobs, key=_file_order):
        if not job.read.nbytes:
            continue
        destination = _destination(job, targets[job.target])
        memory = _memory_of(job, destination)
        if memory is not None:
            direct.append(Read(job.chunk.file, job.read.file_offset, len(memory), job.key, memory))
            continue
        rows = _Rows.split(job, destination, files.kept.holds(job.chunk.file)) if local else None
        if rows is None:
            staged.append((job, destination))
        else:
            strided.extend(rows)
    limit = TUNING.read_batch_bytes
    if local:
        # Units of work of about a run each, shared by the I/O threads. They hold no buffers
        # (straight into the destinations, or through the threads' own buffers): batches
        # only pace the progress reports, and without any, one batch keeps every thread busy
        # to the end (measured: 36 ms instead of 30 for 300 MiB in batches of 32 MiB).
        units = _units([*_gathered(_pieces(direct, TUNING.read_run_bytes)), *strided])
        unit_batch = limit if progress is not None else sys.maxsize
        for batch in batches(units, _unit_length, unit_batch):
            run_concurrently(batch, _thread_worth, lambda unit: _perform(files, unit))
            _report(progress, sum(map(_unit_length, batch)))
    else:  # one batch of concurrent requests at a time
        for reads in batches(direct, _length, limit):
            files.read_all(reads)
            _report(progress, sum(map(_length, reads)))
    # Staging buffers are made batch by batch: at most a batch of them at a time.
    for group in batches(staged, lambda pair: pair[0].read.nbytes, limit):
        _read_staged(files, [_Staged.prepare(job, destination) for job, destination in group])
        _report(progress, sum(job.read.nbytes for job, _ in group))


def _read_staged(files: DataFiles, group: list[_Staged]) -> None:
    # A staged read is copied out by the thread that read it, while it is in the cache.
    files.read_all([fill.read for fill in group], lambda number, _: group[number].finish())


def _file_order(job: Job) -> tuple[str, int]:
    return job.chunk.file, job.read.file_offset


def _length(read: Read) -> int:
    return read.length


def _report(progress: Callable[[int], object] | None, count: int) -> None:
    if progress is not None:
        progress(count)


def _destination(job: Job, target: LocalBox) -> torch.Tensor:
    """The part of the target that ``job`` fills (a whole target, the common case, as it
    is)."""
    overlap = job.read.overlap
    if overlap[0] == target.offsets and overlap[1] == target.sizes:
        return target.tensor
    return narrow_to(target.tensor, target.offsets, overlap[0], overlap[1])


def _memory_of(job: Job, destination: torch.Tensor) -> memoryview | None:
    """The memory of ``destination`` when ``job``'s bytes go there as they are (else None).

    Taken from its address (the destination stays referenced by the caller's targets while
    the read runs): a third of the cost of a NumPy view (``byte_view``), which counts for
    many small tensors."""
    if (
        job.read.strides is not None
        or destination.dtype != job.dtype
        or not destination.is_cpu
        or not destination.is_contiguous()
        or destination.is_conj()  # its memory does not hold its values as they are
        or destination.is_neg()
    ):
        return None
    return borrowed_bytes(destination)


def _pieces(reads: list[Read], size: int) -> list[Read]:
    """``reads`` with every read larger than ``size`` cut into pieces of ``size``."""
    pieces = []
    for read in reads:
        if read.length <= size:
            pieces.append(read)
            continue
        assert read.buffer is not None
        for start in range(0, read.length, size):
            view = read.buffer[start : start + size]
            pieces.append(Read(read.file, read.offset + start, len(view), read.key, view))
    return pieces


def _units(tasks: list[_Task]) -> list[list[_Task]]:
    """``tasks`` (in file order) grouped into units of about ``TUNING.read_run_bytes``."""
    units: list[list[_Task]] = []
    size = 0
    for task in tasks:
        if not units or size + task.length > TUNING.read_run_bytes:
            units.append([])
            size = 0
        units[-1].append(task)
        size += task.length
    return units


def _unit_length(unit: list[_Task]) -> int:
    return sum(task.length for task in unit)


def _thread_worth(unit: list[_Task]) -> int:
    """The size by which ``run_concurrently`` decides whether ``unit`` goes to a thread: its
    bytes, unless its tasks are small ones, whose Python work (under the GIL) outweighs the
    copies a thread would overlap; those stay on the calling thread (0)."""
    length = _unit_length(unit)
    return length if length >= TUNING.small_task_bytes * len(unit) else 0


def _gathered(reads: list[Read]) -> list[Read | _Gather]:
    """``reads`` (in file order), each run of small ones that follow each other in a file
    (up to :data:`HOT_BYTES`) made one :class:`_Gather`."""
    tasks: list[Read | _Gather] = []
    group: list[Read] = []

    def flush() -> None:
        tasks.extend(group if len(group) < 2 else [_Gather.of(group)])
        group.clear()

    for read in reads:
        if read.length >= TUNING.small_task_bytes:
            flush()
            tasks.append(read)
            continue
        if group and not (
            read.file == group[0].file
            and read.offset == group[-1].offset + group[-1].length
            and read.offset + read.length - group[0].offset <= HOT_BYTES
        ):
            flush()
        group.append(read)
    flush()
    return tasks


def _perform(files: DataFiles, unit: list[_Task]) -> None:
    """Perform the tasks of ``unit`` on this thread."""
    for task in unit:
        if isinstance(task, Read):
            assert task.buffer is not None
            _read_local(files, task.file, task.offset, task.buffer, task.key)
        else:
            task.perform(files)


def _read_local(
    files: DataFiles, file: str, offset: int, buffer: memoryview, key: str | None
) -> None:
    """Fill ``buffer`` from the kept bytes if they hold it, else from the file."""
    if files.kept.holds(file) and files.kept.read(file, offset, buffer):
        return
    files.read_into(file, offset, buffer, key)


@dataclass(frozen=True, slots=True)
class _Rows:
    """Leading rows of a strided read (a part of a chunk whose rows are not adjacent in the
    file, e.g. a column block of row-wise chunks), into a contiguous destination of the saved
    dtype, in one of three ways:

    - **separately** (``separate`` set: gaps of at least :data:`_SKIP_GAP` bytes, from the
      file): each contiguous run read on its own, straight into its place in the
      destination; the gaps are not read.
    - **scattered** (``run`` set: contiguous runs of at least ``TUNING.scatter_run_bytes``
      bytes, from the file): one ``preadv`` puts each run straight into its place in the
      destination and each gap between two runs into this thread's reused buffer (read
      through, never looked at). No copy at all.
    - otherwise into this thread's reused buffer, and copied out at once, while in the cache
      (short runs, where a buffer per run costs more than a copy; or from the kept bytes).

    Neither a staging buffer as large as the read nor its page faults.
    """

    file: str
    offset: int
    length: int
    key: str
    destination: torch.Tensor  # these rows of the destination, contiguous
    strides: tuple[int, ...]  # of the saved bytes, in bytes (the last dim: 1)
    run: int | None  # scattered: the bytes of each contiguous run (None: through a buffer)
    separate: bool  # each run read on its own (``run`` is set)

    @classmethod
    def split(cls, job: Job, destination: torch.Tensor, kept: bool) -> list[_Rows] | None:
        """The rows of ``job`` in pieces: scattered ones (unless the bytes are ``kept``) of
        at most ``TUNING.read_run_bytes`` and :data:`_SCATTER_BUFFERS` buffers, the others of
        at most :data:`HOT_BYTES`; None when the job is not one for this (a cast, a
        destination that is not contiguous CPU memory, or rows too long for one buffer)."""
        read = job.read
        sizes, strides = read.overlap[1], read.strides
        if (
            strides is None
            or not sizes
            or destination.dtype != job.dtype
            or destination.device.type != "cpu"
            or not destination.is_contiguous()
        ):
            return None
        itemsize = job.dtype.itemsize
        byte_strides = (*(stride * itemsize for stride in strides), 1)
        row_span = itemsize * (
            1 + sum((n - 1) * s for n, s in zip(sizes[1:], strides[1:], strict=True))
        )
        run, gap = (None, 0) if kept else _runs_of(destination, sizes, byte_strides[:-1])
        separate = run is not None and gap >= _SKIP_GAP
        if run is not None and not separate and run < TUNING.scatter_run_bytes:
            run = None  # short runs close together: through the buffer
        if run is not None:
            runs_per_row = math.prod(sizes) * itemsize // run // sizes[0]
            per_piece = max(
                1,
                min(
                    _SCATTER_BUFFERS // (runs_per_row if separate else 2 * runs_per_row),
                    (TUNING.read_run_bytes - row_span) // byte_strides[0] + 1,
                ),
            )
        else:
            per_piece = (HOT_BYTES - row_span) // byte_strides[0] + 1
            if row_span > HOT_BYTES or per_piece < 1:
                return None
        pieces = []
        for first in range(0, sizes[0], per_piece):
            count = min(per_piece, sizes[0] - first)
            pieces.append(
                cls(
                    job.chunk.file,
                    read.file_offset + first * byte_strides[0],
                    (count - 1) * byte_strides[0] + row_span,
                    job.key,
                    destination[first : first + count],
                    byte_strides,
                    run,
                    separate,
                )
            )
        return pieces

    def perform(self, files: DataFiles) -> None:
        """Read the rows into the destination (see the class docstring)."""
        if self.run is not None:
            starts = self._starts()
            memory = borrowed_bytes(self.destination)
            run = self.run
            if self.separate:
                files.read_runs(
                    self.file,
                    [
                        (self.offset + start, memory[at : at + run])
                        for at, start in zip(range(0, len(starts) * run, run), starts, strict=True)
                    ],
                    self.key,
                )
                return
            files.read_vector(self.file, self.offset, self._buffers(starts, memory), self.key)
            return
        view = hot_buffer()[: self.length]
        _read_local(files, self.file, self.offset, view, self.key)
        source = torch.frombuffer(view, dtype=torch.uint8)
        target = _bytes_of(self.destination)
        with torch.no_grad():
            target.copy_(source.as_strided(target.shape, self.strides))

    def _starts(self) -> list[int]:
        """Where each contiguous run starts in the file, from :attr:`offset`, in row-major
        order (the destination's order), built a dim at a time: a few list operations per
        piece, not per run."""
        destination = self.destination
        shape = destination.shape
        outer = len(shape) - _contiguous_dims(shape, self.strides[:-1], destination.element_size())
        starts = [0]
        for count, stride in zip(shape[:outer], self.strides[:outer], strict=True):
            starts = [base + k * stride for base in starts for k in range(count)]
        return starts

    def _buffers(self, starts: list[int], memory: memoryview) -> list[memoryview]:
        """The buffers of the scatter read: the destination's runs, the gaps between."""
        assert self.run is not None
        run = self.run
        gap_sizes = [after - before - run for before, after in itertools.pairwise(starts)]
        scratch = hot_buffer()
        gaps = {size: scratch[:size] for size in set(gap_sizes)}
        buffers = [scratch[:0]] * (2 * len(starts) - 1)
        buffers[0::2] = [memory[at : at + run] for at in range(0, len(starts) * run, run)]
        buffers[1::2] = [gaps[size] for size in gap_sizes]
        return buffers


def _contiguous_dims(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """How many trailing dims of a box with byte ``strides`` are contiguous in the file."""
    run, dims = itemsize, 0
    for count, stride in zip(reversed(shape), reversed(strides), strict=True):
        if count != 1 and stride != run:
            break
        run *= count
        dims += 1
    return dims


def _runs_of(
    destination: torch.Tensor, sizes: Sequence[int], strides: Sequence[int]
) -> tuple[int | None, int]:
    """The bytes of each contiguous run of a strided read of ``sizes`` with byte ``strides``
    into ``destination``, and the smallest gap between two runs, when the runs can be read
    straight into ``destination`` (gaps that fit a thread's buffer, or that are skipped; a
    destination whose memory holds its values as they are); else ``(None, 0)``."""
    if destination.is_conj() or destination.is_neg():
        return None, 0
    itemsize = destination.element_size()
    dims = _contiguous_dims(sizes, strides, itemsize)
    if dims == len(sizes):
        return None, 0
    run = itemsize * math.prod(sizes[len(sizes) - dims :])
    # The innermost dim of more than one element that is not contiguous sets the smallest
    # gap: a step along an outer dim skips at least as much.
    steps = [
        stride
        for count, stride in zip(sizes[: len(sizes) - dims], strides, strict=False)
        if count != 1
    ]
    gap = min(steps) - run if steps else 0
    if gap < _SKIP_GAP and strides[0] - run > HOT_BYTES:
        return None, 0
    return run, gap


@dataclass(frozen=True, slots=True)
class _Gather:
    """Small reads that follow each other in a file: their bytes read at once into this
    thread's reused buffer (one read instead of one each), then copied to each destination
    while in the cache. (A scatter read straight into the destinations measured no faster
    here: 54 ms of pass 2 either way for 10,000 tensors of 0.25 to 4 KiB.)"""

    file: str
    offset: int
    length: int
    key: str | None
    reads: tuple[Read, ...]

    @classmethod
    def of(cls, reads: list[Read]) -> _Gather:
        first, last = reads[0], reads[-1]
        length = last.offset + last.length - first.offset
        return cls(first.file, first.offset, length, first.key, tuple(reads))

    def perform(self, files: DataFiles) -> None:
        """Read the bytes, and copy each read's part into its buffer."""
        view = hot_buffer()[: self.length]
        _read_local(files, self.file, self.offset, view, self.key)
        for read in self.reads:
            assert read.buffer is not None
            start = read.offset - self.offset
            read.buffer[:] = view[start : start + read.length]


_Task: TypeAlias = Read | _Rows | _Gather


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as bytes, with a last dim of its itemsize (any strides)."""
    return tensor.unsqueeze(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class _Staged:
    """A job read into ``staging``, then copied into ``destination``."""

    job: Job
    read: Read
    destination: torch.Tensor
    staging: torch.Tensor

    @classmethod
    def prepare(cls, job: Job, destination: torch.Tensor) -> _Staged:
        staging = torch.empty(job.read.nbytes // job.dtype.itemsize, dtype=job.dtype)
        read = Read.into(job.chunk.file, job.read.file_offset, byte_view(staging), job.key)
        return cls(job, read, destination, staging)

    def finish(self) -> None:
        """Copy the staged bytes into the destination."""
        overlap, strides = self.job.read.overlap, self.job.read.strides
        # A strided read covers the overlap from its first to its last element; the overlap
        # is the view of those bytes with the chunk's strides.
        source = (
            self.staging.view(overlap[1])
            if strides is None
            else self.staging.as_strided(overlap[1], strides)
        )
        with torch.no_grad():
            if (
                self.destination.dtype != self.job.dtype  # allow_dtype_cast=True: cast values
                or self.destination.is_conj()  # its memory holds other values than it shows
                or self.destination.is_neg()
            ):
                self.destination.copy_(source)
                return
            # As bytes (the saved and destination dtypes are the same): torch copies no
            # elements of some dtypes (int1 to int7, uint1 to uint7) and rewrites others (a
            # bool byte 2 becomes 1), which a read straight into the destination does not.
            _bytes_of(self.destination).copy_(_bytes_of(source))
