"""The metadata path, measured on the state of ``model.py`` through shardwise's own code: the
coordinator's planning from tables of layouts (``checkpoint.planning.save_plan.plan_save``), the
index (``index.encode_index``, ``index.decode_index``), one rank's load planning from the
layouts (``planner.plan_reads`` with a grid's ``LayoutChunks`` as its lookup), and the lazily
built ``Index.to_metadata``.

The pure code ``save``/``load`` call, without their exchanges (see
``docs/design/archive/scale.md``).
The data files are not written; their block checksums are made-up hex of the right length,
as the decoder checks lengths and digits, not values.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from _scale.model import ITEMSIZE, Tensor, fsdp_box
from shardwise.checkpoint.index import (
    BLOCK_SIZE,
    FileFacts,
    LayoutRecord,
    SaveFacts,
    data_file_name,
    decode_index,
    encode_index,
    num_blocks,
    paused_gc,
)
from shardwise.checkpoint.index.layouts import LayoutChunks
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.planning.save_plan import SavePlan, TableRow, plan_save
from shardwise.metadata import TensorProperties

T = TypeVar("T")

_SAVE_ID = "0123456789abcdef"
_DATA_START = 1 << 16  # a padded safetensors header
_PROPERTIES = {
    flag: TensorProperties(dtype=torch.float32, requires_grad=flag) for flag in (False, True)
}


@dataclass
class Measured:
    """The figures of the metadata path for one job."""

    table_bytes: int
    assignment_bytes: tuple[float, int]  # mean, max over ranks
    plan_seconds: float
    index_bytes: int
    encode_seconds: float
    decode_seconds: float
    metadata_seconds: float
    load_seconds: float
    files_read: int
    reads: int


def _table(tensors: Sequence[Tensor]) -> list[TableRow]:
    """Every rank's table (FSDP: the same on every rank): sharded tensors on the one mesh
    of all ranks, ``Shard(0)``; the steps whole."""
    rows = []
    for tensor in tensors:
        layout: tuple[Any, ...] = ("whole",) if tensor.replicated else ("mesh", 0, ["S0"])
        properties = _PROPERTIES[tensor.requires_grad].to_dict()
        rows.append(TableRow(tensor.fqn, "float32", ITEMSIZE, tensor.shape, properties, layout))
    return rows


def _records(
    tensors: Sequence[Tensor], plan: SavePlan, ranks: int
) -> tuple[dict[str, FileFacts], list[LayoutRecord]]:
    """The files and layout records of the save ``plan`` describes, as the writers lay their
    files out: grid cells first (their bytes per file summed with a difference array of
    rows), then the whole tensors each rank was told to write."""
    names = [data_file_name(rank, _SAVE_ID) for rank in range(ranks)]
    steps = [0] * (ranks + 2)
    for tensor in tensors:
        grid = plan.grids.get(tensor.fqn)
        if grid is None:
            continue
        per = grid.steps[0]
        full, rest = divmod(tensor.shape[0], per)
        row = math.prod(tensor.shape[1:]) * ITEMSIZE
        steps[0] += per * row
        steps[full] -= per * row
        steps[full] += rest * row
        steps[full + 1] -= rest * row
    position = []
    total = 0
    for rank in range(ranks):
        total += steps[rank]
        position.append(_DATA_START + total)
    records = []
    for tensor in tensors:
        properties = _PROPERTIES[tensor.requires_grad]
        grid = plan.grids.get(tensor.fqn)
        if grid is not None:
            records.append(LayoutRecord(tensor.fqn, properties, tensor.shape, grid))
            continue
        rank = plan.whole[tensor.fqn]
        begin = position[rank]
        position[rank] += tensor.nbytes
        chunk = SavedChunk((), tensor.shape, names[rank], begin, begin + tensor.nbytes)
        records.append(LayoutRecord(tensor.fqn, properties, tensor.shape, (chunk,)))
    files = {
        name: FileFacts(
            end, _DATA_START, "0123456789abcdef" * num_blocks(end - _DATA_START, BLOCK_SIZE)
        )
        for name, end in zip(names, position, strict=True)
    }
    return files, records


def _load_plan(data: bytes, boxes: dict[str, planner.Box]) -> tuple[int, int, float]:
    """One rank's reads for its ``boxes``, on a freshly decoded index (so that the file
    orders are computed inside the timing): files touched, reads, CPU seconds."""
    index = decode_index(data)
    start = time.thread_time()
    reads = 0
    files = set()
    for key, box in boxes.items():
        chunks = index.tensors[key].chunks
        lookup = chunks if isinstance(chunks, LayoutChunks) else None
        for read in planner.plan_reads(box, chunks, ITEMSIZE, lookup=lookup):
            files.add(chunks[read.chunk].file)
            reads += 1
    return len(files), reads, time.thread_time() - start


def _best(work: Callable[[], T], repeat: int = 3) -> tuple[T, float]:
    """``work``'s result and its least CPU time over ``repeat`` runs (the machine is shared)."""
    best = math.inf
    result: T
    for _ in range(repeat):
        start = time.thread_time()
        result = work()
        best = min(best, time.thread_time() - start)
    return result, best


def measure(tensors: Sequence[Tensor], ranks: int, load_ranks: int, load_rank: int) -> Measured:
    """Time the metadata path for ``tensors`` saved by ``ranks`` ranks, and the load planning of
    rank ``load_rank`` of ``load_ranks`` (least CPU time of 3 runs each; the garbage collector
    paused, as shardwise pauses it)."""
    with paused_gc():
        return _measure(tensors, ranks, load_ranks, load_rank)


def _measure(tensors: Sequence[Tensor], ranks: int, load_ranks: int, load_rank: int) -> Measured:
    table = _table(tensors)
    table_bytes = len(json.dumps([[r.key, r.dtype, list(r.size), r.layout] for r in table]))
    mesh = ((ranks,), tuple(range(ranks)))
    plan, plan_seconds = _best(lambda: plan_save([table], [range(ranks)], [mesh], {}, ranks))
    told = [len(json.dumps(value)) for value in plan.assignments()]
    files, records = _records(tensors, plan, ranks)
    facts = SaveFacts("shardwise bench", torch.__version__, ranks, _SAVE_ID, None)
    data, encode_seconds = _best(lambda: encode_index(facts, list(files.items()), records, []))
    index, decode_seconds = _best(lambda: decode_index(data))
    _, metadata_seconds = _best(index.to_metadata)
    boxes = {
        t.fqn: ((), ()) if t.replicated else fsdp_box(t.shape, load_ranks, load_rank)
        for t in tensors
    }
    runs = [_load_plan(data, boxes) for _ in range(3)]
    touched, reads, _ = runs[0]
    return Measured(
        table_bytes=table_bytes,
        assignment_bytes=(sum(told) / len(told), max(told)),
        plan_seconds=plan_seconds,
        index_bytes=len(data),
        encode_seconds=encode_seconds,
        decode_seconds=decode_seconds,
        metadata_seconds=metadata_seconds,
        load_seconds=min(run[2] for run in runs),
        files_read=touched,
        reads=reads,
    )
