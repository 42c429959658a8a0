"""``save_safetensors``: a Hugging Face model directory written straight from a sharded job,
each rank writing the bytes of the parts it holds into the shared files (``docs/huggingface.md``).

Every rank describes the tensors it holds (names by prefix and key map, boxes, tied keys);
one exchange gives every rank all descriptions, from which each computes the same plan
(:func:`plan_files`: the names, dtypes and tied-weight rule of ``shardwise consolidate``, its
``max_shard_size`` split, one writer per distinct box). The coordinator creates the files
under temporary names at their final size with their headers; every rank writes its boxes at
their offsets (a row band is one write, a column band one write per row), from slabs of at
most ``TUNING.read_batch_bytes``; the coordinator removes the index and the weight files of
an earlier save this one does not replace, renames the files, writes the index, and removes
what killed saves left. Positioned writes by several processes need a file system (local or
shared); an object store has none.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shardwise import collectives
from shardwise._boxes import Box, byte_view
from shardwise._codec import dtype_from_name, dtype_name
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import (
    LocalBox,
    TensorValue,
    describe_tensor,
    is_tensor_value,
    storage_key,
)
from shardwise.checkpoint.entries.state_dict import display_key, flatten
from shardwise.checkpoint.huggingface.files import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    LEFTOVER_NAME,
    METADATA,
    OUTPUT_NAME,
    OutTensor,
    check_header_size,
    check_unique_names,
    file_names,
    index_json,
    split_files,
    written_dtype,
)
from shardwise.checkpoint.huggingface.keys import KeyMap, Names
from shardwise.checkpoint.index.data_file import FileEntry, layout_file, safetensors_dtype
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.index.tiling import check_tiling
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.report import exchange_with_bar, job_bar, log_done
from shardwise.checkpoint.storage import LocalStorage, PartWriter, open_shared_storage
from shardwise.errors import (
    CheckpointError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointStorageError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FilePlan", "SavePlan", "plan_files", "save_safetensors"]

logger = logging.getLogger("shardwise.checkpoint.save")  # the name users configure

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One weight file: its name, header (length prefix included), size, and where each of
    its tensors starts (by the key whose data it is)."""

    name: str
    header: bytes
    size: int
    starts: dict[str, int]


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What a save writes: the files, the tensors (by source key), who writes each distinct
    box of each tensor (key -> ``(box, rank)``), and the tied keys left out (key -> target)."""

    files: list[FilePlan]
    tensors: dict[str, OutTensor]
    writers: dict[str, list[tuple[Box, int]]]
    tied: dict[str, str]

    @property
    def total(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


def _describe(
    state_dict: Mapping[str, Any], names: Names
) -> tuple[dict[str, TensorValue], dict[str, str]]:
    """This rank's tensors by key, and the Hugging Face name of each."""
    flat = flatten(state_dict)
    values: dict[str, TensorValue] = {}
    named: dict[str, str] = {}
    for key, value in flat.leaves.items():
        if not is_tensor_value(value):
            continue  # safetensors files hold tensors only
        fqn = display_key(key)
        name = names.name_of(fqn)
        if name is None:
            continue
        try:
            described = describe_tensor(fqn, value)
        except (TypeError, ValueError) as err:
            raise CheckpointMismatchError(str(err), key=fqn) from err
        if any(box.tensor.is_meta for box in described.boxes):
            raise CheckpointMismatchError("a tensor on the meta device holds no data", key=fqn)
        values[fqn] = described
        named[fqn] = name
    return values, named


def _table(values: Mapping[str, TensorValue], named: Mapping[str, str]) -> list[list[Any]]:
    """This rank's description as JSON: per key its name, dtype, size (``None``: only the
    union of the ranks' boxes tells), non-empty boxes, and the earlier key whose memory it is."""
    first: dict[Any, str] = {}
    rows = []
    for fqn, value in values.items():
        identity = storage_key(value)
        alias = None if identity is None else first.setdefault(identity, fqn)
        boxes = [[list(b.offsets), list(b.sizes)] for b in value.boxes if b.tensor.numel()]
        size = None if value.size is None else list(value.size)
        tied = alias if alias != fqn else None
        rows.append([fqn, named[fqn], dtype_name(value.dtype), size, boxes, tied])
    return rows


def _refuse(message: str, key: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(message, key=key)


def plan_files(
    tables: Sequence[list[list[Any]]], cast: torch.dtype | None, max_bytes: int
) -> SavePlan:
    """The plan of a save from every rank's table (pure: every rank computes the same one).

    Raises:
        CheckpointMismatchError: The ranks disagree on a key's name, dtype or size, its boxes
            do not tile it, safetensors has no code for its dtype, two keys share a name, or
            a file's header would be over what safetensors reads.
    """
    keys = [row[0] for row in tables[0]]
    facts: dict[str, list[Any]] = {row[0]: row for row in tables[0]}
    holders: dict[str, dict[Box, list[int]]] = {key: {} for key in keys}
    aliases: list[dict[str, str]] = []
    for rank, table in enumerate(tables):
        if [row[0] for row in table] != keys:
            other = sorted(set(keys).symmetric_difference(row[0] for row in table))
            raise _refuse(
                f"rank {rank} does not hold the keys rank 0 holds; every rank must pass a state "
                "dict with the same keys",
                other[0] if other else keys[0],
            )
        for key, name, dtype, size, boxes, _ in table:
            known = facts[key]
            if (name, dtype) != (known[1], known[2]) or (
                size is not None and known[3] is not None and size != known[3]
            ):
                raise _refuse(
                    f"rank {rank} has name {name!r}, dtype {dtype} and size {size}, rank 0 "
                    f"{known[1]!r}, {known[2]} and {known[3]}",
                    key,
                )
            if known[3] is None:
                known[3] = size
            for offsets, sizes in boxes:
                holders[key].setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
        aliases.append({row[0]: row[5] for row in table if row[5] is not None})
    merged = {}
    for key in keys:
        size = facts[key][3]
        if size is None:  # a standalone LocalShardsWrapper: the union of every rank's boxes
            boxes = list(holders[key])
            ndim = len(boxes[0][0]) if boxes else 0
            size = [max((o[d] + s[d] for o, s in boxes), default=0) for d in range(ndim)]
            facts[key][3] = size
        merged[key] = planner.TensorPlan(facts[key][2], tuple(size), {}, holders[key])
    tied = planner.agree_aliases(aliases, merged)
    tensors: dict[str, OutTensor] = {}
    for key in keys:
        if key in tied:
            continue
        _, name, dtype_text, size, _, _ = facts[key]
        dtype = written_dtype(dtype_from_name(dtype_text), cast)
        if safetensors_dtype(dtype) is None:
            raise _refuse(f"safetensors cannot store dtype {dtype_name(dtype)}", key)
        shape = tuple(size)
        try:
            check_tiling(shape, list(holders[key]) or [((0,) * len(shape), shape)])
        except ValueError as err:
            raise _refuse(f"the ranks' shards do not make up the tensor: {err}", key) from err
        tensors[key] = OutTensor(name, key, dtype, shape, math.prod(shape) * dtype.itemsize)
    check_unique_names(list(tensors.values()), "the state dict")
    groups = split_files(list(tensors.values()), _nbytes, max_bytes)
    files = []
    for file_name, group in zip(file_names(len(groups)), groups, strict=True):
        entries = [FileEntry(t.name, t.dtype, t.shape, t.nbytes) for t in group]
        layout = layout_file(entries, METADATA)
        if group:
            check_header_size(layout.header, file_name, group[0].source)
        starts = {t.source: begin for t, (begin, _) in zip(group, layout.ranges, strict=True)}
        files.append(FilePlan(file_name, layout.header, layout.size, starts))
    return SavePlan(files, tensors, _writers(tensors, holders), {k: tied[k] for k in tied})


def _nbytes(tensor: OutTensor) -> int:
    return tensor.nbytes


def _writers(
    tensors: Mapping[str, OutTensor], holders: Mapping[str, Mapping[Box, list[int]]]
) -> dict[str, list[tuple[Box, int]]]:
    """One writer per distinct box: of the ranks holding it, the one with the fewest bytes to
    write so far (replicated tensors spread over their holders)."""
    load: dict[int, int] = {}
    writers: dict[str, list[tuple[Box, int]]] = {}
    for key, tensor in tensors.items():
        chosen = []
        for box, ranks in holders[key].items():
            rank = min(ranks, key=lambda r: (load.get(r, 0), r))
            load[rank] = load.get(rank, 0) + math.prod(box[1]) * tensor.dtype.itemsize
            chosen.append((box, rank))
        writers[key] = chosen
    return writers


def _slabs(box: LocalBox, limit: int) -> list[LocalBox]:
    """``box`` cut along its first dim into boxes of about ``limit`` bytes at most."""
    if not box.sizes or box.tensor.numel() * box.tensor.element_size() <= limit:
        return [box]
    row = max(1, box.tensor[0].numel() * box.tensor.element_size())
    rows = max(1, limit // row)
    slabs = []
    for first in range(0, box.sizes[0], rows):
        count = min(rows, box.sizes[0] - first)
        offsets = (box.offsets[0] + first, *box.offsets[1:])
        sizes = (count, *box.sizes[1:])
        slabs.append(LocalBox(offsets, sizes, box.tensor[first : first + count]))
    return slabs


def _write_box(writer: PartWriter, box: LocalBox, tensor: OutTensor, start: int) -> int:
    """Write ``box`` of ``tensor`` (stored from byte ``start`` of its file); the bytes written."""
    chunk = SavedChunk((0,) * len(tensor.shape), tensor.shape, "", start, start + tensor.nbytes)
    itemsize = tensor.dtype.itemsize
    written = 0
    for slab in _slabs(box, tuning.TUNING.read_batch_bytes):
        # A contiguous CPU slab of the written dtype is written from its own memory.
        source = slab.tensor.detach().to("cpu", tensor.dtype).contiguous()
        source = source.resolve_conj().resolve_neg()
        data = byte_view(source)
        strides = [math.prod(slab.sizes[d + 1 :]) for d in range(len(slab.sizes))]
        for run in planner.plan_reads(slab.box, [chunk], itemsize, read_cost=0):
            offsets = run.overlap[0]
            at = itemsize * sum(
                (o - b) * s for o, b, s in zip(offsets, slab.offsets, strides, strict=True)
            )
            writer.write_at(run.file_offset, [data[at : at + run.nbytes]])
            written += run.nbytes
    return written


def save_safetensors(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: ProcessGroup | None = None,
    prefix: str | None = None,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
    sync_files: bool = True,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> list[str]:
    """Write the tensors of ``state_dict`` as the weight files of a Hugging Face model
    directory at ``path`` (collective: every rank writes the bytes it holds, no rank gathers
    a tensor).

    The rules of ``shardwise consolidate``: only keys under ``prefix``, named without it (then
    through ``key_map``); ``dtype`` casts floating-point tensors; a key whose memory is an
    earlier key's on every rank (tied weights) is written once, under the earlier key, as
    ``save_pretrained`` does; files split above ``max_shard_size`` bytes, named and indexed as
    ``save_pretrained`` names them. Other values (non-tensors) are not written. The files
    appear only once all are written; weight files of an earlier save that this one did not
    write are removed first (a save stopped midway leaves no model of old and new files), and
    what killed saves left under temporary names last. Write ``config.json`` apart (e.g.
    ``model.config.save_pretrained``).

    Args:
        state_dict: The tensors (plain, DTensor, ShardedTensor, LocalShardsWrapper).
        path: The directory, on a local or shared file system (created if missing).
        process_group: The ranks saving together (default: the default group, if any).
        prefix: Only keys under this prefix are written, named without it (none under it:
            ``CheckpointKeyError``, nothing written).
        key_map: The name in the files of a key (prefix stripped); ``None`` leaves it out.
        dtype: The floating-point dtype to write floating-point tensors in.
        max_shard_size: The most bytes of tensors per file (a larger tensor gets its own),
            a positive int.
        sync_files: fsync the files and the directory before returning.
        storage_options: fsspec options for URLs (refused: see above).
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank writes.

    Returns:
        The names of the files written, in ``path``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``, ``max_shard_size`` not an int,
            ``prefix`` not a str, or ``key_map`` not callable.
        ValueError: ``max_shard_size`` is not positive.
        CheckpointError: (a subclass) an object-store URL, ranks that disagree on a tensor,
            shards that do not make up their tensor, a dtype safetensors cannot store, two
            keys of one name; ``CheckpointStorageError`` for a write that fails. Every rank
            raises the same error.

    Example:
        >>> shardwise.checkpoint.save_safetensors(model.state_dict(), "/out/model")
    """
    started = time.monotonic()
    comm = collectives.Comm(process_group, operation="save_safetensors")
    path_text = os.path.expanduser(os.fspath(path))
    storage = open_shared_storage(path_text, storage_options, comm.world_size)
    if not isinstance(storage, LocalStorage):
        raise CheckpointError(
            "save_safetensors writes every rank's part of a file in place, which object "
            "stores cannot do: save to a local or shared file system, then upload",
            file=path_text,
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise CheckpointMismatchError(
            f"dtype={dtype} is not a floating-point dtype; only floating-point tensors are cast"
        )
    if dtype is not None and safetensors_dtype(dtype) is None:
        raise CheckpointMismatchError(
            f"dtype={dtype} has no safetensors code: it cannot be written"
        )
    max_shard_size = _byte_count(max_shard_size)
    names = Names.of(prefix, key_map)
    values: dict[str, TensorValue] = {}
    token = secrets.token_hex(8)

    def describe() -> list[list[Any]]:
        nonlocal values
        values, named = _describe(state_dict, names)
        return _table(values, named)

    _, tables = comm.exchange_or_raise(describe, lambda rows: [token, progress, rows])
    if names.prefix and not any(entry[2] for entry in tables):
        raise CheckpointKeyError(  # as consolidate: a typo would replace a model with nothing
            f"no tensor of the state dict is under the prefix {names.prefix!r} (or key_map "
            f"leaves them all out): nothing to write, and the weight files at {path_text} are "
            "left as they are",
            file=path_text,
        )
    shared_token = tables[0][0]
    plan = plan_files([entry[2] for entry in tables], dtype, max_shard_size)
    temporary = {f.name: storage.join(f".{f.name}.{shared_token}.tmp") for f in plan.files}

    def create() -> None:
        if comm.rank != 0:
            return
        storage.makedirs(storage.root)
        _refuse_directories(storage)
        for file in plan.files:
            writer = storage.open_parts(temporary[file.name], file.size)
            try:
                writer.write_at(0, [file.header])
            finally:
                writer.close(sync=sync_files)

    mine = [
        (key, box)
        for key, chosen in plan.writers.items()
        for box, rank in chosen
        if rank == comm.rank
    ]
    file_of = {key: file for file in plan.files for key in file.starts}
    bar = None
    try:
        comm.agree_or_raise(_in_words(create, "create the files in", path_text))
        if tables[0][1]:  # every byte of every tensor is written once, by one rank
            bar = job_bar(comm, plan.total, f"saving {path_text}", f"save/{shared_token}")

        def write() -> None:
            writers: dict[str, PartWriter] = {}
            try:
                for key, box in mine:
                    file = file_of[key]
                    if file.name not in writers:
                        writers[file.name] = storage.open_parts(temporary[file.name])
                    local = _local_box(values[key], box)
                    count = _write_box(
                        writers[file.name], local, plan.tensors[key], file.starts[key]
                    )
                    if bar is not None:
                        bar.update(count)
            finally:
                for writer in writers.values():
                    writer.close(sync=sync_files)

        exchange_with_bar(comm, _in_words(write, "write", path_text), bar)

        def commit() -> list[str]:
            written = [file.name for file in plan.files]
            if len(plan.files) > 1:
                written.append(INDEX_NAME)
            # Out of the way first: the old index, and the weight files of an earlier save
            # that this one does not replace. Removed last, a save stopped between its renames
            # would leave the old index (or model.safetensors) beside new files: a model of
            # old and new tensors, loaded without a word. Removed first, a stopped save leaves
            # several weight files and no index, which no loader takes for a model.
            for name in storage.listdir(storage.root):
                if OUTPUT_NAME.fullmatch(name) and (name == INDEX_NAME or name not in written):
                    storage.remove(storage.join(name))
            for file in plan.files:
                storage.rename(temporary[file.name], storage.join(file.name))
            if len(plan.files) > 1:
                weight_map = {
                    plan.tensors[key].name: file.name for file in plan.files for key in file.starts
                }
                storage.replace_small(storage.join(INDEX_NAME), index_json(weight_map, plan.total))
            for name in storage.listdir(storage.root):  # what killed saves left
                if LEFTOVER_NAME.fullmatch(name):
                    with contextlib.suppress(OSError):  # best effort: the save is done
                        storage.remove(storage.join(name))
            if sync_files:
                storage.sync_dir(storage.root)
            return written

        written: list[str] = comm.broadcast_or_raise(_in_words(commit, "commit", path_text), src=0)
    except BaseException:
        if comm.rank == 0:
            for temp in temporary.values():
                with contextlib.suppress(OSError):
                    storage.remove(temp)
        raise
    if comm.rank == 0:
        log_done(logger, "saved", path_text, plan.total, time.monotonic() - started)
    return written


def _refuse_directories(storage: LocalStorage) -> None:
    """Refuse a directory under a name the commit replaces or removes, before any file is
    written (else the commit would fail with some files of the save in place).

    Raises:
        CheckpointStorageError: Naming it.
    """
    for name in storage.listdir(storage.root):
        path = storage.join(name)
        if OUTPUT_NAME.fullmatch(name) and stat.S_ISDIR(os.lstat(path).st_mode):
            raise CheckpointStorageError(
                f"{path} is a directory, where the save puts or removes a weight file: "
                "remove it, or save elsewhere",
                file=path,
            )


def _byte_count(value: object) -> int:
    """``max_shard_size`` checked: a positive int of bytes (refused on every rank alike,
    before any collective, as every rank passes the same arguments).

    Raises:
        TypeError: Not an int (a string such as ``"5GB"``, a float, a bool).
        ValueError: Zero or negative.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"max_shard_size must be an int number of bytes (e.g. 5_000_000_000), got {value!r}"
        )
    if value <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {value}")
    return int(value)


def _in_words(step: Callable[[], T], doing: str, path: str) -> Callable[[], T]:
    """``step``, its file-system errors raised as one-line ``CheckpointStorageError``s."""

    def run() -> T:
        try:
            return step()
        except CheckpointError:
            raise
        except OSError as err:
            where = err.filename if err.filename is not None else path
            raise CheckpointStorageError(
                f"cannot {doing} {path}: {err.strerror or err}", file=where
            ) from err

    return run


def _local_box(value: TensorValue, box: Box) -> LocalBox:
    """The local box of ``value`` that is exactly ``box`` (the plan assigns only held boxes)."""
    return next(local for local in value.boxes if local.box == box)
