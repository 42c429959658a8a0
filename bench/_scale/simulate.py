"""Today's save and load metadata path of an R-rank job, run in one process, step by step.

Every step calls the shardwise function the ranks run (``planner.merge_tensor_plans``,
``planner.assign_writers``, ``save._build_index``, ``index.decode_index``,
``CheckpointReader.plan``, ...) on what the ranks would exchange; only the collectives are
replaced by what they amount to (``json.dumps`` on the sender, ``json.loads`` of every
payload on each receiver, as ``collectives.all_gather_json`` and ``Comm.broadcast_json`` do).

The global steps hold every rank's entries at once, which for a thousand ranks is more memory
than a shared machine has. So the state is cut into slices of whole tensors (every rank's
entries for those tensors) and each step runs slice after slice, its times summed. Every step
is a loop over tensors (or chunks) whose cost per tensor depends on the rank count, not on the
other tensors, except two sorts (``assign_writers``'s work list and ``decode_index``'s ranges
per file), which pay a log factor of the slice instead of the whole. Sizes are summed so that
they are those of the whole payloads (see :class:`_Joined`).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from _scale.model import ITEMSIZE, Tensor, box_of, plan_entries
from shardwise.checkpoint import planner
from shardwise.checkpoint.format import FileEntry, chunk_key, layout_file
from shardwise.checkpoint.index import (
    BLOCK_SIZE,
    Index,
    SaveFacts,
    data_file_name,
    decode_index,
    encode_index,
    num_blocks,
    paused_gc,
)
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.storage import open_storage

# The module (the package exports its function of the same name).
save_module = importlib.import_module("shardwise.checkpoint.save")

T = TypeVar("T")

SAVE_ID = "0123456789abcdef"
PATH = "/checkpoints/step-1000"
_HEX = "0123456789abcdef"


def timed(clock: dict[str, float], step: str, work: Callable[[], T]) -> T:
    """Run ``work``, adding the CPU time of this thread it takes to ``clock[step]`` (CPU time,
    not wall time: the machine is shared). The simulation runs with the garbage collector
    paused, as ``save`` and ``load`` run their work (``index.paused_gc``; the index broadcast
    of ``load`` comes before its pause, but allocates a handful of objects)."""
    start = time.thread_time()
    result = work()
    clock[step] = clock.get(step, 0.0) + time.thread_time() - start
    return result


class _Joined:
    """The length of a JSON payload whose one list or dict is split across slices: every
    slice's payload has the same text around it (``overhead``, measured with it empty), and
    the whole joins the slices' items with ``", "``."""

    def __init__(self, overhead: int) -> None:
        self.overhead = overhead
        self.items = 0
        self.parts = 0

    def add(self, length: int) -> None:
        if length > self.overhead:
            self.items += length - self.overhead
            self.parts += 1

    @property
    def total(self) -> int:
        return self.overhead + self.items + 2 * max(0, self.parts - 1)


@dataclass
class Result:
    """What one simulated job measured.

    Attributes:
        ranks: Ranks saving (and, unless ``load_ranks`` differs, loading).
        load_ranks: Ranks of the loading job (the rank measured is ``load_rank``).
        tensors: Tensor keys (sharded and replicated).
        chunks: Distinct saved chunks (index rows).
        entries: Chunk entries the ranks send in the plan exchange (one per rank and key).
        seconds: CPU time per step, summed over slices.
        plan_bytes: Each rank's plan payload (the JSON ``all_gather_json`` sends).
        result_bytes: Each rank's results payload (its written chunks).
        index_bytes: The index.
        broadcast_bytes: The load's index broadcast payload (the index as a JSON string).
        parsed_plan_bytes: Python memory of one rank's parsed plan (every rank holds all).
        load_reads: Reads the measured loading rank plans; ``load_boxes``: its boxes.
        slices: How many slices the state was cut into.
        last_index: The index of the last slice (for :func:`index_memory`).
    """

    ranks: int
    load_ranks: int
    load_rank: int
    tensors: int
    chunks: int = 0
    entries: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    plan_bytes: list[int] = field(default_factory=list)
    result_bytes: list[int] = field(default_factory=list)
    index_bytes: int = 0
    broadcast_bytes: int = 0
    parsed_plan_bytes: int = 0
    load_reads: int = 0
    load_boxes: int = 0
    slices: int = 0
    last_index: bytes = b""


def scaled(result: Result, factor: float) -> Result:
    """``result`` of a sample of the state, scaled to the whole (``factor`` times as many
    tensors, each with the same entries): every step is a loop over tensors."""

    def times(value: float) -> int:
        return round(value * factor)

    return Result(
        ranks=result.ranks,
        load_ranks=result.load_ranks,
        load_rank=result.load_rank,
        tensors=times(result.tensors),
        chunks=times(result.chunks),
        entries=times(result.entries),
        seconds={step: seconds * factor for step, seconds in result.seconds.items()},
        plan_bytes=[times(n) for n in result.plan_bytes],
        result_bytes=[times(n) for n in result.result_bytes],
        index_bytes=times(result.index_bytes),
        broadcast_bytes=times(result.broadcast_bytes),
        parsed_plan_bytes=times(result.parsed_plan_bytes),
        load_reads=times(result.load_reads),
        load_boxes=times(result.load_boxes),
        slices=result.slices,
        last_index=result.last_index,
    )


def index_memory(data: bytes) -> tuple[float, float, float]:
    """Python memory per chunk of the index ``data`` decoded (held, and at the peak of
    ``decode_index``), and of its ``to_metadata()``: traced with ``tracemalloc`` (slow: give
    it an index of a few hundred thousand chunks)."""
    tracemalloc.start()
    try:
        index = decode_index(data)
        held, peak = tracemalloc.get_traced_memory()
        kept = index.to_metadata()
        metadata = tracemalloc.get_traced_memory()[0] - held
        del kept
    finally:
        tracemalloc.stop()
    chunks = sum(len(record.chunks) for record in index.tensors.values())
    return held / chunks, peak / chunks, metadata / chunks


def _slices(tensors: Sequence[Tensor], ranks: int, budget: int) -> Iterator[list[Tensor]]:
    """Runs of whole tensors holding at most ``budget`` rank entries each (at least one)."""
    per = max(1, budget // ranks)
    for start in range(0, len(tensors), per):
        yield list(tensors[start : start + per])


def deep_size(value: object) -> int:
    """Bytes of Python memory held by a parsed JSON value (shared objects counted once)."""
    seen: set[int] = set()
    stack = [value]
    total = 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _checksums(nbytes: int) -> str:
    """A block-checksum string of the right length (the bench has no data to hash)."""
    return _HEX * num_blocks(nbytes, BLOCK_SIZE)


def _own_entries(tensors: Sequence[Tensor], ranks: int, rank: int) -> list[FileEntry]:
    entries = []
    for tensor in tensors:
        offsets, sizes = box_of(tensor, ranks, rank)
        nbytes = math.prod(sizes) * ITEMSIZE
        if nbytes or tensor.replicated:
            entries.append(FileEntry(chunk_key(tensor.fqn, offsets), torch.float32, sizes, nbytes))
    return entries


def own_work(tensors: Sequence[Tensor], ranks: int, rank: int) -> dict[str, float]:
    """The steps one rank does for itself alone, over the whole state: describing its chunks
    (the former ``save._plan_entries``, as :func:`~_scale.model.plan_entries` builds them)
    and sending them, and laying out its data file
    (``format.layout_file``)."""
    with paused_gc():  # as save runs
        return _own_work(tensors, ranks, rank)


def _own_work(tensors: Sequence[Tensor], ranks: int, rank: int) -> dict[str, float]:
    clock: dict[str, float] = {}
    entries = timed(clock, "own: _plan_entries", lambda: plan_entries(tensors, ranks, rank))
    plan = {"tensors": entries, "aliases": {}, "progress": False}
    timed(clock, "own: plan json.dumps", lambda: json.dumps({"ok": plan}).encode())
    files = _own_entries(tensors, ranks, rank)
    timed(clock, "own: layout_file", lambda: layout_file(files, {"format": "shardwise"}))
    return clock


def simulate(
    tensors: Sequence[Tensor],
    ranks: int,
    load_ranks: int,
    load_rank: int,
    slice_entries: int,
    progress: Callable[[str], None] = lambda _: None,
) -> Result:
    """Run today's save and load metadata steps of ``ranks`` ranks holding ``tensors``, and
    the load planning of rank ``load_rank`` of ``load_ranks``."""
    with paused_gc():  # as save and load run (see timed)
        return _simulate(tensors, ranks, load_ranks, load_rank, slice_entries, progress)


def _simulate(
    tensors: Sequence[Tensor],
    ranks: int,
    load_ranks: int,
    load_rank: int,
    slice_entries: int,
    progress: Callable[[str], None],
) -> Result:
    result = Result(ranks, load_ranks, load_rank, len(tensors))
    clock = result.seconds
    storage = open_storage(tempfile.gettempdir())
    names = [data_file_name(rank, SAVE_ID) for rank in range(ranks)]
    header = len(layout_file(_own_entries(tensors, ranks, 1), {}).header)
    replicated = sum(tensor.replicated for tensor in tensors) * ITEMSIZE
    sizes = [header + replicated] * ranks
    for tensor in tensors:
        if not tensor.replicated:
            for rank in range(ranks):
                sizes[rank] += math.prod(box_of(tensor, ranks, rank)[1]) * ITEMSIZE
    position = [header] * ranks
    load = [0] * ranks

    def plan_of(rank: int, part: Sequence[Tensor]) -> dict[str, Any]:
        plan: dict[str, Any] = {
            "tensors": plan_entries(part, ranks, rank),
            "aliases": {},
            "progress": False,
        }
        if rank == 0:
            plan.update(save_id=SAVE_ID, objects={}, blob_bytes=0)
        return plan

    plan_lengths = [_Joined(len(json.dumps({"ok": plan_of(rank, [])}))) for rank in range(ranks)]
    result_lengths = [
        _Joined(len(json.dumps({"ok": {"file": [names[rank], sizes[rank]], "entries": {}}})))
        for rank in range(ranks)
    ]
    files = dict(zip(names, sizes, strict=True))
    facts = SaveFacts("shardwise bench", "torch", ranks, SAVE_ID, PATH)
    empty_index = encode_index(facts, files, [], [])
    index_length = _Joined(len(empty_index) - 2)
    empty_envelope = len(json.dumps({"text": empty_index.decode()}))
    broadcast_length = _Joined(empty_envelope - 2)
    deep_sized = False

    for number, part in enumerate(_slices(tensors, ranks, slice_entries)):
        result.slices += 1
        progress(f"R={ranks}: slice {number + 1}, {len(part)} tensors")
        # -- save: the plan exchange (every rank sends its entries, every rank parses all)
        payloads = [json.dumps({"ok": plan_of(rank, part)}) for rank in range(ranks)]
        for rank, payload in enumerate(payloads):
            plan_lengths[rank].add(len(payload))
        received = timed(
            clock, "plan exchange: parse all", lambda p=payloads: [json.loads(x) for x in p]
        )
        del payloads
        plans = [envelope["ok"] for envelope in received]
        if not deep_sized:
            share = deep_size(plans[1]["tensors"]) / len(part)
            result.parsed_plan_bytes = round(share * len(tensors))
            deep_sized = True
        result.entries += sum(len(plan["tensors"]) for plan in plans)
        merged = timed(
            clock,
            "merge_tensor_plans",
            lambda p=plans: planner.merge_tensor_plans([plan["tensors"] for plan in p]),
        )
        aliases = timed(
            clock,
            "agree_aliases",
            lambda p=plans, m=merged: planner.agree_aliases([plan["aliases"] for plan in p], m),
        )
        del received, plans
        written_plans = {fqn: plan for fqn, plan in merged.items() if fqn not in aliases}
        assignments = timed(
            clock,
            "assign_writers",
            lambda w=written_plans: planner.assign_writers(w, ranks, dict(enumerate(load))),
        )
        # -- save: each rank's results (its byte ranges), exchanged, parsed by every rank
        results = [
            _results(items, names[rank], sizes[rank], position, load, rank)
            for rank, items in enumerate(assignments)
        ]
        del assignments
        result_payloads = [json.dumps({"ok": part_result}) for part_result in results]
        for rank, payload in enumerate(result_payloads):
            result_lengths[rank].add(len(payload))
        del results
        written = timed(
            clock,
            "results exchange: parse all",
            lambda p=result_payloads: [json.loads(x)["ok"] for x in p],
        )
        del result_payloads
        # -- save: every rank builds the index (records, encode_index, build_index); the
        # coordinator also decodes it (a self-check: the "decode_index" step below)
        data, index = timed(
            clock,
            "_build_index",
            lambda m=written_plans, a=aliases, w=written: save_module._build_index(
                m, a, {}, w, ranks, SAVE_ID, PATH
            ),
        )
        del written, merged, written_plans
        result.chunks += sum(len(record.chunks) for record in index.tensors.values())
        timed(clock, "index.to_metadata", index.to_metadata)  # what save returns, on every rank
        index_length.add(len(data) - 2)
        timed(
            clock,
            "encode_index",
            lambda i=index: encode_index(i.save, i.files, list(i.tensors.values()), []),
        )
        # -- load: rank 0 broadcasts the index, every rank parses and validates all of it
        envelope = timed(
            clock,
            "index broadcast: encode (rank 0)",
            lambda d=data: json.dumps({"text": d.decode("utf-8", "surrogateescape")}),
        )
        broadcast_length.add(len(envelope) - 2)
        raw = timed(
            clock,
            "index broadcast: parse (every rank)",
            lambda e=envelope: json.loads(e)["text"].encode("utf-8", "surrogateescape"),
        )
        del envelope
        timed(clock, "decode_index", lambda r=raw: decode_index(r))
        result.last_index = data
        del raw, data
        _plan_load(clock, result, storage, index, part, load_ranks, load_rank)
        del index

    result.plan_bytes = [length.total for length in plan_lengths]
    result.result_bytes = [length.total for length in result_lengths]
    result.index_bytes = index_length.total
    result.broadcast_bytes = broadcast_length.total
    return result


def _results(
    items: Sequence[planner.WriteAssignment],
    name: str,
    size: int,
    position: list[int],
    load: list[int],
    rank: int,
) -> dict[str, Any]:
    """What ``save._write_data_file`` returns for rank ``rank``'s chunks: their byte ranges,
    one after the other from ``position[rank]``, and their block checksums."""
    if not items:
        return {}
    entries = {}
    at = position[rank]
    for item in items:
        entries[chunk_key(item.fqn, item.offsets)] = [at, at + item.nbytes, _checksums(item.nbytes)]
        at += item.nbytes
        load[rank] += item.nbytes
    position[rank] = at
    return {"file": [name, size], "entries": entries}


def _plan_load(
    clock: dict[str, float],
    result: Result,
    storage: Any,
    index: Index,
    part: Sequence[Tensor],
    load_ranks: int,
    load_rank: int,
) -> None:
    """One loading rank's planning: its target boxes through ``CheckpointReader.plan`` (which
    builds a ``ChunkLookup`` per tensor of more than 8 chunks, on first use), and through
    ``planner.plan_reads`` without a lookup (every chunk compared with every box)."""
    boxes = [(tensor.fqn, box_of(tensor, load_ranks, load_rank)) for tensor in part]
    result.load_boxes += len(boxes)
    reader = CheckpointReader(storage, index, PATH, load_rank)

    def with_lookup() -> int:
        return sum(len(reader.plan(fqn, box, target)) for target, (fqn, box) in enumerate(boxes))

    result.load_reads += timed(clock, "load plan: CheckpointReader.plan", with_lookup)

    def lookups() -> None:
        for record in index.tensors.values():
            if len(record.chunks) > 8:
                planner.ChunkLookup([(c.offsets, c.sizes) for c in record.chunks])

    timed(clock, "load plan: ChunkLookup builds", lookups)

    def without_lookup() -> None:
        for fqn, box in boxes:
            planner.plan_reads(box, index.tensors[fqn].chunks, ITEMSIZE)

    timed(clock, "load plan: plan_reads, no lookup", without_lookup)
    fresh = CheckpointReader(storage, index, PATH, load_rank)
    first = next(iter(index.files))
    timed(clock, "load: reader._extent (first open)", lambda: fresh._extent(first))
