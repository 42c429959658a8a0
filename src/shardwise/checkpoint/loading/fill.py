"""Reads of saved bytes into destination tensors: :class:`Job` (one planned read) and
:func:`fill`, which turns jobs into segments of the read pass (:mod:`.read`) and runs it
(direct or staged: ``docs/architecture.md``, *Reading trusts nothing*, step 3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from shardwise._boxes import borrowed_bytes, byte_view, narrow_to
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import LocalBox
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.data_files import SourceFiles
from shardwise.checkpoint.loading.read import Segment, read
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.storage import batches

__all__ = ["Job", "fill"]


@dataclass(slots=True)
class Job:
    """One read from saved ``chunk`` (of ``dtype``) into ``targets[target]``, ``key`` for errors.
    Immutable by convention: frozen costs a fifth of a microsecond per field, per job."""

    target: int
    key: str
    chunk: SavedChunk
    read: planner.ChunkRead
    dtype: torch.dtype


def fill(
    files: SourceFiles,
    jobs: Sequence[Job],
    targets: Sequence[LocalBox],
    *,
    verify: bool = True,
    progress: Callable[[int], object] | None = None,
    note: str = "",
    also: Sequence[Segment] = (),
) -> None:
    """Read ``jobs`` into ``targets`` and the segments ``also`` in one pass (:func:`.read.read`)."""
    direct: list[tuple[int, torch.Tensor, list[Segment]]] = []
    staged: list[tuple[Job, torch.Tensor]] = []
    for job in jobs:
        if not job.read.nbytes:
            continue
        target = targets[job.target]
        overlap = job.read.overlap
        destination = target.tensor
        if overlap[0] != target.offsets or overlap[1] != target.sizes:
            destination = narrow_to(target.tensor, target.offsets, overlap[0], overlap[1])
        pieces = _direct_segments(job, destination)
        if pieces is not None:
            direct.append((job.target, destination, pieces))
        else:
            staged.extend(_in_rows(job, destination, tuning.TUNING.read_batch_bytes))
    first, *later = _layers(direct)
    rounds = list(batches(staged, lambda pair: pair[0].read.nbytes, tuning.TUNING.read_batch_bytes))
    # Direct segments go with the first round: a block shared with a staged read is read once.
    for number, group in enumerate(rounds or [[]]):
        stages = _stage(group)
        wanted = ([*also, *first] if number == 0 else []) + [stage.segment for stage in stages]
        read(files, wanted, verify=verify, progress=progress, note=note)
        for stage in stages:
            stage.finish()
    for layer in later:
        read(files, layer, verify=verify, progress=progress, note=note)


def _layers(direct: list[tuple[int, torch.Tensor, list[Segment]]]) -> list[list[Segment]]:
    """The segments of the direct jobs ``(target, destination, segments)`` in layers read one
    after another: the I/O threads read one layer at once, so two jobs whose destinations
    share memory without being the same target (keys tied in the state dict, loaded from two
    saved tensors) go in different layers, the later job in a later one, so that it wins as in
    a load of one key after the other, never a mix of both. Almost always one layer: the check
    is one sort of the destinations' addresses."""
    if len(direct) > 1:
        begins = np.fromiter((d.data_ptr() for _, d, _ in direct), np.int64, len(direct))
        ends = begins + np.fromiter((d.nbytes for _, d, _ in direct), np.int64, len(direct))
        order = np.argsort(begins, kind="stable")
        if (begins[order][1:] < np.maximum.accumulate(ends[order])[:-1]).any():
            return _layered(direct)
    return [[segment for _, _, segments in direct for segment in segments]]


def _layered(direct: list[tuple[int, torch.Tensor, list[Segment]]]) -> list[list[Segment]]:
    """:func:`_layers` when destinations of different targets share memory (rare)."""
    layers: list[list[Segment]] = []
    placed: list[tuple[int, int, int, int]] = []  # (begin, end, target, layer) of each job
    for target, destination, segments in direct:
        begin = destination.data_ptr()
        end = begin + destination.nbytes
        layer = 1 + max(
            (at for b, e, other, at in placed if other != target and b < end and begin < e),
            default=-1,
        )
        placed.append((begin, end, target, layer))
        layers.extend([] for _ in range(layer + 1 - len(layers)))
        layers[layer].extend(segments)
    return layers


def _stage(group: list[tuple[Job, torch.Tensor]]) -> list[_Staged]:
    """The jobs of one round staged in one host buffer (pinned when a destination is on a GPU),
    each at a 64-byte boundary: one allocation per round, not per job."""
    places, total = [], 0
    for job, _ in group:
        places.append(total)
        total += -(-job.read.nbytes // 64) * 64
    pin = torch.cuda.is_available() and any(destination.is_cuda for _, destination in group)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    return [
        _Staged.prepare(job, destination, buffer[at : at + job.read.nbytes])
        for (job, destination), at in zip(group, places, strict=True)
    ]


def _direct_segments(job: Job, destination: torch.Tensor) -> list[Segment] | None:
    """The segments that read ``job`` straight into ``destination`` (None: it is staged)."""
    if not (
        destination.dtype == job.dtype
        and destination.is_cpu
        and destination.is_contiguous()
        and not destination.is_conj()
        and not destination.is_neg()
    ):
        return None
    read, file, key = job.read, job.chunk.file, job.key
    # From its address (the caller's targets keep it alive): a third of the cost of a NumPy
    # view, which counts for many small tensors.
    memory = borrowed_bytes(destination)
    if read.strides is None:
        return [Segment(file, read.file_offset, memory, key)]
    itemsize = job.dtype.itemsize
    sizes = read.overlap[1]
    byte_strides = [stride * itemsize for stride in read.strides]
    inner = _contiguous_dims(sizes, byte_strides, itemsize)
    run = itemsize * math.prod(sizes[len(sizes) - inner :])
    if run < tuning.TUNING.scatter_run_bytes or inner == len(sizes):
        return None  # short runs: staged whole, copied with their strides
    starts = [0]
    for count, stride in zip(sizes[: len(sizes) - inner], byte_strides, strict=False):
        starts = [base + k * stride for base in starts for k in range(count)]
    return [
        Segment(file, read.file_offset + start, memory[at : at + run], key)
        for at, start in zip(range(0, len(starts) * run, run), starts, strict=True)
    ]


def _contiguous_dims(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """How many trailing dims of a box with byte ``strides`` are contiguous in the file."""
    run, dims = itemsize, 0
    for count, stride in zip(reversed(shape), reversed(strides), strict=True):
        if count != 1 and stride != run:
            break
        run *= count
        dims += 1
    return dims


def _in_rows(job: Job, destination: torch.Tensor, limit: int) -> Iterator[tuple[Job, torch.Tensor]]:
    """``job`` cut into jobs of whole rows, about ``limit`` bytes at most each."""
    read = job.read
    sizes = read.overlap[1]
    if read.nbytes <= limit or not sizes or sizes[0] <= 1:
        yield job, destination
        return
    itemsize = job.dtype.itemsize
    if read.strides is None:
        step = itemsize * math.prod(sizes[1:])
        span = step
    else:
        step = itemsize * read.strides[0]
        span = itemsize * (
            1 + sum((n - 1) * s for n, s in zip(sizes[1:], read.strides[1:], strict=True))
        )
    rows = max(1, (limit - span) // step + 1) if step else sizes[0]
    offsets = read.overlap[0]
    for first in range(0, sizes[0], rows):
        count = min(rows, sizes[0] - first)
        box = ((offsets[0] + first, *offsets[1:]), (count, *sizes[1:]))
        piece = replace(
            read,
            file_offset=read.file_offset + first * step,
            nbytes=(count - 1) * step + span,
            overlap=box,
            whole_chunk=False,
        )
        yield replace(job, read=piece), destination[first : first + count]


@dataclass(frozen=True, slots=True)
class _Staged:
    """A job read into host ``staging``, then copied into ``destination``."""

    job: Job
    segment: Segment
    destination: torch.Tensor
    staging: torch.Tensor

    @classmethod
    def prepare(cls, job: Job, destination: torch.Tensor, memory: torch.Tensor) -> _Staged:
        """``job`` staged in ``memory`` (its bytes, aligned for its dtype)."""
        staging = memory.view(job.dtype)
        segment = Segment(job.chunk.file, job.read.file_offset, byte_view(memory), job.key)
        return cls(job, segment, destination, staging)

    def finish(self) -> None:
        """Copy the staged (verified) bytes into the destination."""
        overlap, strides = self.job.read.overlap, self.job.read.strides
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
            # As bytes: torch copies no elements of some dtypes (int1 to int7, uint1 to uint7)
            # and rewrites others (a bool byte 2 becomes 1), unlike a direct read.
            destination = self.destination.unsqueeze(-1).view(torch.uint8)
            destination.copy_(source.unsqueeze(-1).view(torch.uint8))
