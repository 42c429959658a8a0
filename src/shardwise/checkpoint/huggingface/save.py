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

import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from shardwise import collectives
from shardwise._boxes import Box, byte_view
from shardwise._codec import dtype_from_name, dtype_name
from shardwise._progress import JobProgress
from shardwise._sizes import parse_size
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import (
    LocalBox,
    TensorValue,
    describe_tensor,
    is_tensor_value,
    storage_key,
)
from shardwise.checkpoint.entries.state_dict import display_key, flatten
from shardwise.checkpoint.huggingface.directory import DirectoryWriter, WeightFile, weight_files
from shardwise.checkpoint.huggingface.files import (
    DEFAULT_MAX_SHARD_BYTES,
    OutTensor,
    check_unique_names,
    split_files,
    written_dtype,
)
from shardwise.checkpoint.huggingface.keys import KeyMap, Names
from shardwise.checkpoint.index.data_file import safetensors_dtype
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

__all__ = ["Description", "TableRow", "WeightFilesPlan", "plan_files", "save_safetensors"]

logger = logging.getLogger("shardwise.checkpoint.save")  # the name users configure

T = TypeVar("T")


class TableRow(NamedTuple):
    """One tensor of one rank's table, as it travels (a JSON array of these fields, in order).

    Attributes:
        key: The state dict's key (dotted).
        name: Its name in the files (prefix stripped, key map applied).
        dtype: Its dtype (``shardwise.metadata.dtype_name``).
        size: Its size; ``None`` when only the union of the ranks' boxes tells (a
            standalone ``LocalShardsWrapper``).
        boxes: This rank's non-empty boxes, ``[offsets, sizes]`` each.
        tied: The earlier key whose memory this key's is on this rank, if any.
    """

    key: str
    name: str
    dtype: str
    size: list[int] | None
    boxes: list[list[list[int]]]
    tied: str | None


class Description(NamedTuple):
    """What each rank sends in the first exchange (a JSON array ``[token, progress, rows]``):
    rank 0's token and progress flag are the save's."""

    token: str
    progress: bool
    rows: list[TableRow]

    @classmethod
    def from_wire(cls, value: Sequence[Any]) -> Description:
        """A description as received (JSON arrays), its rows typed."""
        token, progress, rows = value
        return cls(token, progress, [TableRow._make(row) for row in rows])


@dataclass(frozen=True, slots=True)
class WeightFilesPlan:
    """What a ``save_safetensors`` writes: the weight files, the tensors (by source key), who
    writes each distinct box of each tensor (key -> ``(box, rank)``), and the tied keys left
    out (key -> target)."""

    files: list[WeightFile]
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


def _table(values: Mapping[str, TensorValue], named: Mapping[str, str]) -> list[TableRow]:
    """This rank's table: a row per key, in key order (the earlier key of a tied one is the
    first key of the same memory)."""
    first: dict[Any, str] = {}
    rows = []
    for fqn, value in values.items():
        identity = storage_key(value)
        alias = None if identity is None else first.setdefault(identity, fqn)
        boxes = [[list(b.offsets), list(b.sizes)] for b in value.boxes if b.tensor.numel()]
        size = None if value.size is None else list(value.size)
        tied = alias if alias != fqn else None
        rows.append(TableRow(fqn, named[fqn], dtype_name(value.dtype), size, boxes, tied))
    return rows


def _refuse(message: str, key: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(message, key=key)


def plan_files(
    tables: Sequence[Sequence[TableRow | Sequence[Any]]], cast: torch.dtype | None, max_bytes: int
) -> WeightFilesPlan:
    """The plan of a save from every rank's table (pure: every rank computes the same one).

    Args:
        tables: Each rank's rows, in rank order (:class:`TableRow`, or the JSON arrays they
            travel as).
        cast: The dtype floating-point tensors are written in, if any.
        max_bytes: The most bytes of tensors per file.

    Raises:
        CheckpointMismatchError: The ranks disagree on a key's name, dtype or size, its boxes
            do not tile it, safetensors has no code for its dtype, two keys share a name, or
            a file's header would be over what safetensors reads.
    """
    typed = [[TableRow._make(row) for row in table] for table in tables]
    keys = [row.key for row in typed[0]]
    first = {row.key: row for row in typed[0]}
    sizes = {row.key: row.size for row in typed[0]}  # completed by the ranks that know it
    holders: dict[str, dict[Box, list[int]]] = {key: {} for key in keys}
    aliases: list[dict[str, str]] = []
    for rank, table in enumerate(typed):
        if [row.key for row in table] != keys:
            other = sorted(set(keys).symmetric_difference(row.key for row in table))
            raise _refuse(
                f"rank {rank} does not hold the keys rank 0 holds; every rank must pass a state "
                "dict with the same keys",
                other[0] if other else keys[0],
            )
        for row in table:
            known, size = first[row.key], sizes[row.key]
            if (row.name, row.dtype) != (known.name, known.dtype) or (
                row.size is not None and size is not None and row.size != size
            ):
                raise _refuse(
                    f"rank {rank} has name {row.name!r}, dtype {row.dtype} and size "
                    f"{row.size}, rank 0 {known.name!r}, {known.dtype} and {size}",
                    row.key,
                )
            if size is None:
                sizes[row.key] = row.size
            for offsets, box_sizes in row.boxes:
                holders[row.key].setdefault((tuple(offsets), tuple(box_sizes)), []).append(rank)
        aliases.append({row.key: row.tied for row in table if row.tied is not None})
    shapes: dict[str, tuple[int, ...]] = {}
    merged = {}
    for key in keys:
        size = sizes[key]
        if size is None:  # a standalone LocalShardsWrapper: the union of every rank's boxes
            boxes = list(holders[key])
            ndim = len(boxes[0][0]) if boxes else 0
            size = [max((o[d] + s[d] for o, s in boxes), default=0) for d in range(ndim)]
        shapes[key] = tuple(size)
        merged[key] = planner.TensorPlan(first[key].dtype, shapes[key], {}, holders[key])
    tied = planner.agree_aliases(aliases, merged)
    tensors: dict[str, OutTensor] = {}
    for key in keys:
        if key in tied:
            continue
        dtype = written_dtype(dtype_from_name(first[key].dtype), cast)
        if safetensors_dtype(dtype) is None:
            raise _refuse(f"safetensors cannot store dtype {dtype_name(dtype)}", key)
        shape = shapes[key]
        try:
            check_tiling(shape, list(holders[key]) or [((0,) * len(shape), shape)])
        except ValueError as err:
            raise _refuse(f"the ranks' shards do not make up the tensor: {err}", key) from err
        name = first[key].name
        tensors[key] = OutTensor(name, key, dtype, shape, math.prod(shape) * dtype.itemsize)
    check_unique_names(list(tensors.values()), "the state dict")
    files = weight_files(split_files(list(tensors.values()), _nbytes, max_bytes))
    return WeightFilesPlan(files, tensors, _writers(tensors, holders), dict(tied))


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
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
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
        max_shard_size: The most bytes of tensors per file (a larger tensor gets its own):
            a positive int, or a size as ``save_pretrained`` takes it, ``"5GB"`` (decimal
            units KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024).
        sync_files: fsync the files and the directory before returning.
        storage_options: fsspec options for URLs (refused: see above).
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank writes.

    Returns:
        The names of the files written, in ``path``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``, ``max_shard_size`` neither an int nor
            a str (a float, a bool), ``prefix`` not a str, or ``key_map`` not callable.
        ValueError: ``max_shard_size`` is not positive, or a str that is no size; ``dtype``
            is not floating point, or safetensors has no code for it.
        CheckpointError: (a subclass) an object-store URL, ranks that disagree on a tensor,
            shards that do not make up their tensor, a dtype safetensors cannot store, two
            keys of one name; ``CheckpointStorageError`` for a write that fails. Every rank
            raises the same error (the arguments are checked before any collective).

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
    _check_dtype(dtype)
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    names = Names.of(prefix, key_map)
    save = _SafetensorsSave(comm, storage, path_text, dtype, max_bytes, sync_files)
    written = save.run(state_dict, names, progress)
    if comm.rank == 0:
        log_done(logger, "saved", path_text, save.plan.total, time.monotonic() - started)
    return written


def _check_dtype(dtype: object) -> None:
    """Refuse a ``dtype`` that is not a floating-point ``torch.dtype`` safetensors stores."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    # A bad argument, not a mismatch with any checkpoint: a plain ValueError.
    if not dtype.is_floating_point:
        raise ValueError(
            f"dtype={dtype} is not a floating-point dtype; only floating-point tensors are cast"
        )
    if safetensors_dtype(dtype) is None:
        raise ValueError(f"dtype={dtype} has no safetensors code: it cannot be written")


class _SafetensorsSave:
    """One ``save_safetensors`` on one rank, its arguments checked: a method per step, each
    one collective of the group (:meth:`run` calls them in order).

    1. :meth:`describe` (an all-gather of JSON): every rank's :class:`Description`, the plan.
    2. :meth:`create` (an agreement): rank 0 makes the directory and the files.
    3. :meth:`write` (an agreement, counted by the bar): every rank writes its boxes.
    4. :meth:`commit` (a broadcast from rank 0): rank 0 puts the files in place; every rank
       gets their names.

    A failure of any step is raised on every rank; rank 0 then removes what was written.
    """

    def __init__(
        self,
        comm: collectives.Comm,
        storage: LocalStorage,
        path: str,
        dtype: torch.dtype | None,
        max_bytes: int,
        sync: bool,
    ) -> None:
        self.comm = comm
        self.storage = storage
        self.path = path
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.sync = sync
        self.values: dict[str, TensorValue] = {}  # this rank's tensors, by key
        self.plan = WeightFilesPlan([], {}, {}, {})
        self.token = ""
        self.progress = False
        self.directory = DirectoryWriter(storage, "", "the save", "save elsewhere")

    def run(self, state_dict: Mapping[str, Any], names: Names, progress: bool) -> list[str]:
        """The whole save; the names of the files written."""
        self.describe(state_dict, names, progress)
        bar = None
        try:
            self.comm.agree_or_raise(_in_words(self.create, "create the files in", self.path))
            if self.progress:  # every byte of every tensor is written once, by one rank
                bar = job_bar(
                    self.comm, self.plan.total, f"saving {self.path}", f"save/{self.token}"
                )
            exchange_with_bar(
                self.comm, _in_words(lambda: self.write(bar), "write", self.path), bar
            )
            written: list[str] = self.comm.broadcast_or_raise(
                _in_words(self.commit, "commit", self.path), src=0
            )
        except BaseException:
            if self.comm.rank == 0:
                self.directory.discard()
            raise
        return written

    def describe(self, state_dict: Mapping[str, Any], names: Names, progress: bool) -> None:
        """Exchange the ranks' :class:`Description` (a random token, the progress flag and
        this rank's :class:`TableRow` s) and plan the save from all of them.

        Rank 0's token names the temporary files, its progress flag decides the bar.

        Raises:
            CheckpointKeyError: A ``prefix`` no tensor is under (on every rank).
            CheckpointMismatchError: What :func:`plan_files` refuses (on every rank).
        """
        token = secrets.token_hex(8)

        def rows() -> list[TableRow]:
            self.values, named = _describe(state_dict, names)
            return _table(self.values, named)

        _, wire = self.comm.exchange_or_raise(rows, lambda own: Description(token, progress, own))
        descriptions = [Description.from_wire(entry) for entry in wire]
        if names.prefix and not any(d.rows for d in descriptions):
            raise CheckpointKeyError(  # as consolidate: a typo would replace a model with nothing
                f"no tensor of the state dict is under the prefix {names.prefix!r} (or key_map "
                f"leaves them all out): nothing to write, and the weight files at {self.path} "
                "are left as they are",
                file=self.path,
            )
        self.token, self.progress = descriptions[0].token, descriptions[0].progress
        self.plan = plan_files([d.rows for d in descriptions], self.dtype, self.max_bytes)
        self.directory = DirectoryWriter(self.storage, self.token, "the save", "save elsewhere")

    def create(self) -> None:
        """Rank 0: make the directory and create every weight file under its temporary name,
        at its final size, with its header (nothing travels but success or the error)."""
        if self.comm.rank != 0:
            return
        self.directory.prepare()
        for file in self.plan.files:
            self.directory.create(file, self.sync)

    def write(self, bar: JobProgress | None) -> None:
        """Every rank: write the boxes the plan gives it, each at its offsets in its file
        (nothing travels but success or the error; ``bar`` counts the bytes)."""
        file_of = {key: file for file in self.plan.files for key in file.starts}
        writers: dict[str, PartWriter] = {}
        try:
            for key, chosen in self.plan.writers.items():
                for box, rank in chosen:
                    if rank != self.comm.rank:
                        continue
                    file = file_of[key]
                    if file.name not in writers:
                        path = self.directory.temporary(file.name)
                        writers[file.name] = self.storage.open_parts(path)
                    local = _local_box(self.values[key], box)
                    tensor = self.plan.tensors[key]
                    count = _write_box(writers[file.name], local, tensor, file.starts[key])
                    if bar is not None:
                        bar.update(count)
        finally:
            for writer in writers.values():
                writer.close(sync=self.sync)

    def commit(self) -> list[str]:
        """Rank 0 (the only one that runs it): write the index, put the files in place
        (:meth:`DirectoryWriter.commit`); the names of the files, which it broadcasts."""
        self.directory.write_index(self.plan.files, self.sync)
        return self.directory.commit(self.sync)


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
