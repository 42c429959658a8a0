"""A prototype of the proposed index (format version 4 of the design note), sized and timed on
the state of ``model.py``: not shardwise code, a sketch to check the design's numbers.

What changes from version 2 (one row per chunk, each with its byte range and block checksums):

- A tensor sharded on a regular grid (a DTensor's ``Shard`` placements, a ChunkShardingSpec)
  is one row: ``["grid", steps, files]``. ``steps[d]`` is the chunk length along dim ``d``
  (torch's ceil rule: cells ``[k * step, min((k + 1) * step, size))``, none past the end);
  ``files = [first, stride_0, stride_1, ...]`` says that cell ``(k_0, k_1, ...)`` is in data
  file ``first + sum(k_d * stride_d)`` (for FSDP over the whole group: file ``k``).
- A tensor written whole by one rank (a replicated tensor) is ``["whole", file, begin]``.
- Byte ranges of grid cells are not stored: a data file holds its grid cells first, from its
  ``data_start``, in index order and cell order, packed (safetensors has no holes), so a
  cell's range is a prefix sum over that file's cells, which a reader computes for the files
  it reads from (``O(tensors)`` per file).
- Block checksums are per data file (1 MiB blocks of its data section), not per chunk.

So the index is ``O(tensors + files + data / 1 MiB)``, and a reader validates each tensor row in
``O(dims)``, checking a file's cells against its declared size when it first reads from it.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from _scale.model import ITEMSIZE, Tensor, fsdp_box
from shardwise.checkpoint.index import BLOCK_SIZE, data_file_name, num_blocks, paused_gc, seal

T = TypeVar("T")

_SAVE_ID = "0123456789abcdef"
_HEX = re.compile(r"[0-9a-f]*")
_SEAL = len(b'"index_checksum":"') + 16 + 2


@dataclass
class Measured:
    """The prototype's figures for one job."""

    index_bytes: int
    encode_seconds: float
    decode_seconds: float
    plan_seconds: float
    files_read: int
    reads: int


def _steps(tensor: Tensor, ranks: int) -> list[int]:
    return [-(-tensor.shape[0] // ranks), *tensor.shape[1:]]


def document(tensors: Sequence[Tensor], ranks: int) -> dict[str, Any]:
    """The version-4 index of ``tensors`` saved by ``ranks`` ranks (FSDP: cell ``k`` in file
    ``k``; each replicated tensor written by the least loaded rank, as the coordinator would
    assign it with a heap)."""
    ordered = sorted(tensors, key=lambda tensor: tensor.fqn)
    steps = [0] * (ranks + 2)  # a difference array of the bytes of each rank's grid cells
    for tensor in ordered:
        if not tensor.replicated:
            per = -(-tensor.shape[0] // ranks)
            full, rest = divmod(tensor.shape[0], per)
            row = math.prod(tensor.shape[1:]) * ITEMSIZE
            steps[0] += per * row
            steps[full] -= per * row
            steps[full] += rest * row
            steps[full + 1] -= rest * row
    grid_bytes = list(itertools.accumulate(steps[:ranks]))
    data_start = 1 << 16  # the safetensors header, padded
    heap = [(grid_bytes[rank], rank) for rank in range(ranks)]
    heapq.heapify(heap)
    extra = [0] * ranks
    rows = []
    for tensor in ordered:
        if tensor.replicated:
            load, rank = heapq.heappop(heap)
            begin = data_start + grid_bytes[rank] + extra[rank]
            extra[rank] += tensor.nbytes
            heapq.heappush(heap, (load + tensor.nbytes, rank))
            layout: list[Any] = ["whole", rank, begin]
        else:
            layout = ["grid", _steps(tensor, ranks), [0, 1] + [0] * (len(tensor.shape) - 1)]
        rows.append([tensor.fqn, 1 if tensor.requires_grad else 0, list(tensor.shape), layout])
    files = []
    for rank in range(ranks):
        data = grid_bytes[rank] + extra[rank]
        sums = "0123456789abcdef" * num_blocks(data, BLOCK_SIZE)
        files.append([data_file_name(rank, _SAVE_ID), data_start + data, data_start, sums])
    return {
        "format": "shardwise-checkpoint",
        "format_version": 4,
        "save": {"world_size": ranks, "save_id": _SAVE_ID},
        "checksum": {"algorithm": "xxh3_64", "block_size": BLOCK_SIZE, "scope": "file"},
        "files": files,
        "properties": [
            ["float32", "strided", False, "contiguous_format", False],
            ["float32", "strided", True, "contiguous_format", False],
        ],
        "tensors": rows,
        "objects": [],
    }


@dataclass
class _Grid:
    size: tuple[int, ...]
    steps: tuple[int, ...]
    counts: tuple[int, ...]
    files: tuple[int, ...]
    itemsize: int


def decode(data: bytes) -> tuple[list[list[Any]], dict[str, Any]]:
    """The prototype reader's work on a version-4 index: the seal, the parse, and every check
    that needs no data file (a file's cells are checked against its size when first read)."""
    prefix = data[:-_SEAL]
    if xxhash.xxh3_64_hexdigest(prefix).encode() != data[-18:-2]:
        raise ValueError("corrupt")
    document = json.loads(data)
    files = document["files"]
    for name, size, start, sums in files:
        if not (isinstance(name, str) and type(size) is int and type(start) is int):
            raise ValueError("malformed file")
        if len(sums) != 16 * num_blocks(size - start, BLOCK_SIZE):
            raise ValueError("malformed checksums")
    if _HEX.fullmatch("".join(row[3] for row in files)) is None:
        raise ValueError("not hex")
    tensors: dict[str, Any] = {}
    for fqn, properties, size, layout in document["tensors"]:
        if type(fqn) is not str or fqn in tensors or type(properties) is not int:
            raise ValueError("malformed tensor")
        if any(type(v) is not int or v < 0 for v in size):
            raise ValueError("malformed size")
        if layout[0] == "grid":
            steps, placement = layout[1], layout[2]
            if len(steps) != len(size) or len(placement) != len(size) + 1:
                raise ValueError("malformed grid")
            counts = tuple(-(-s // max(step, 1)) for s, step in zip(size, steps, strict=True))
            strides = placement[1:]
            last = placement[0] + sum((n - 1) * st for n, st in zip(counts, strides, strict=True))
            if not 0 <= placement[0] <= last < len(files):
                raise ValueError("grid files out of range")
            tensors[fqn] = _Grid(tuple(size), tuple(steps), counts, tuple(placement), ITEMSIZE)
        elif layout[0] == "whole":
            file, begin = layout[1], layout[2]
            if not 0 <= file < len(files) or begin < files[file][2]:
                raise ValueError("malformed whole")
            tensors[fqn] = (tuple(size), file, begin)
        else:
            raise ValueError("unknown layout")
    return files, tensors


def _file_order(tensors: dict[str, Any], file: int) -> dict[str, int]:
    """Begin offsets (from the data start) of the grid cells in ``file``: a prefix sum over
    the tensors in index order (1-D grids, as in this state)."""
    begins = {}
    at = 0
    for fqn, record in tensors.items():
        if not isinstance(record, _Grid):
            continue
        first, stride = record.files[0], record.files[1]
        k = file - first
        if stride == 0 or k % stride or not 0 <= k // stride < record.counts[0]:
            continue
        cell = k // stride
        rows = min(record.steps[0], record.size[0] - cell * record.steps[0])
        begins[fqn] = at
        at += rows * math.prod(record.size[1:]) * record.itemsize
    return begins


def plan(files: list[list[Any]], tensors: dict[str, Any], boxes: dict[str, Any]) -> tuple[int, int]:
    """One rank's reads for its target ``boxes`` (fqn -> (offsets, sizes)): overlapping cells
    by division, byte offsets from the prefix sums of the files touched. Returns the number of
    files touched and of reads."""
    orders: dict[int, dict[str, int]] = {}
    reads = 0
    for fqn, (offsets, sizes) in boxes.items():
        record = tensors[fqn]
        if not isinstance(record, _Grid):
            reads += 1
            continue
        if not sizes or sizes[0] == 0:
            continue
        step = record.steps[0]
        for cell in range(offsets[0] // step, (offsets[0] + sizes[0] - 1) // step + 1):
            file = record.files[0] + cell * record.files[1]
            order = orders.get(file)
            if order is None:
                order = orders[file] = _file_order(tensors, file)
            start = max(offsets[0], cell * step) - cell * step
            row_bytes = math.prod(record.size[1:]) * record.itemsize
            _ = files[file][2] + order[fqn] + start * row_bytes  # the read's file offset
            reads += 1
    return len(orders), reads


def _best(work: Callable[[], T], repeat: int = 3) -> tuple[T, float]:
    """``work``'s result and its least CPU time over ``repeat`` runs (the machine is shared)."""
    best = math.inf
    for _ in range(repeat):
        start = time.thread_time()
        result = work()
        best = min(best, time.thread_time() - start)
    return result, best


def measure(tensors: Sequence[Tensor], ranks: int, load_ranks: int, load_rank: int) -> Measured:
    """Size and time the prototype for ``tensors`` saved by ``ranks`` ranks, and the load
    planning of rank ``load_rank`` of ``load_ranks`` (least time of 3 runs each, the garbage
    collector paused as shardwise pauses it)."""
    with paused_gc():
        return _measure(tensors, ranks, load_ranks, load_rank)


def _measure(tensors: Sequence[Tensor], ranks: int, load_ranks: int, load_rank: int) -> Measured:
    built = document(tensors, ranks)
    data, encode_seconds = _best(lambda: seal(built))
    (files, records), decode_seconds = _best(lambda: decode(data))
    boxes = {}
    for tensor in tensors:
        if tensor.replicated:
            boxes[tensor.fqn] = ((), ())
        else:
            boxes[tensor.fqn] = fsdp_box(tensor.shape, load_ranks, load_rank)
    (touched, reads), plan_seconds = _best(lambda: plan(files, records, boxes))
    return Measured(len(data), encode_seconds, decode_seconds, plan_seconds, touched, reads)
