"""``load``, ``read_metadata`` and ``load_tensor``: read a checkpoint into any layout.

Every rank lists the boxes its state dict needs (its ShardedTensor shards, its DTensor chunk,
its LocalShardsWrapper shards, or the whole plain tensor), intersects them with the saved
chunks and reads only the bytes it needs: one positioned read straight into the destination
when the overlap is contiguous in the saved chunk, otherwise one read per row piece, or fewer
reads spanning the gaps between pieces where a gap costs less than a read (see
:func:`~shardwise.checkpoint.planner.plan_reads`).

The order of work keeps the state dict untouched by any failure (every step is agreed by all
ranks before the next starts):

1. The index is read by rank 0 and broadcast; every rank validates it (same bytes, same
   verdict). Keys, sizes and dtypes are checked against the state dict, and every data file
   needed is opened and checked (regular file, size as the index says).
2. Every checksummed block the reads will touch is read and verified, and the objects are
   decoded (:meth:`~shardwise.checkpoint.reader.CheckpointReader.verify`).
3. Only then are the bytes read into the state dict's tensors and the objects replaced.
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from shardwise import collectives
from shardwise.checkpoint import planner
from shardwise.checkpoint._items import (
    LocalBox,
    TensorValue,
    decode_object,
    describe_tensor,
    is_tensor_value,
)
from shardwise.checkpoint.index import Index, ObjectRecord, TensorRecord, load_json_value
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.reader import CheckpointReader, Job, decode, read_index_bytes
from shardwise.checkpoint.storage import open_storage
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointMismatchError,
    PickleNotAllowedError,
)

__all__ = ["load", "load_tensor", "read_metadata"]


def read_metadata(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Metadata:
    """The :class:`Metadata` of the checkpoint at ``path`` (no data is read, no collective).

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        CheckpointFormatError: The index is corrupt, malformed or of an unknown version.
    """
    with CheckpointReader.open(path, storage_options) as reader:
        return reader.index.to_metadata()


def _outside(box: LocalBox, size: tuple[int, ...]) -> bool:
    """Whether a shard has other dims than a tensor of ``size`` or holds elements outside it
    (an empty shard may sit past the end: the ceil rule)."""
    if len(box.sizes) != len(size):
        return True
    return planner.numel(box.sizes) > 0 and any(
        o + s > bound for o, s, bound in zip(box.offsets, box.sizes, size, strict=True)
    )


def _check_target(fqn: str, described: TensorValue, record: TensorRecord) -> None:
    saved_dtype = record.dtype
    if described.size is not None and tuple(described.size) != record.size:
        raise CheckpointMismatchError(
            f"size mismatch: the checkpoint has size {list(record.size)}, the state dict "
            f"expects {list(described.size)}",
            key=fqn,
        )
    if described.size is None and any(_outside(box, record.size) for box in described.boxes):
        raise CheckpointMismatchError(
            f"size mismatch: the state dict's shards do not fit the saved size {list(record.size)}",
            key=fqn,
        )
    if described.dtype != saved_dtype:
        raise CheckpointMismatchError(
            f"dtype mismatch: the checkpoint has {saved_dtype}, the state dict expects "
            f"{described.dtype}",
            key=fqn,
        )


def _plan_load(
    flat: Mapping[str, Any], reader: CheckpointReader, strict: bool, allow_pickle: bool
) -> tuple[list[LocalBox], list[Job], list[ObjectRecord]]:
    index: Index = reader.index
    targets: list[LocalBox] = []
    jobs: list[Job] = []
    objects: list[ObjectRecord] = []
    for fqn, value in flat.items():
        tensor = index.tensors.get(fqn)
        item = index.objects.get(fqn)
        if tensor is None and item is None:
            if strict:
                raise CheckpointKeyError(
                    "missing from the checkpoint (pass strict=False to skip missing keys)",
                    key=fqn,
                )
            continue
        if is_tensor_value(value):
            if tensor is None:
                raise CheckpointMismatchError(
                    "the state dict holds a tensor, the checkpoint an object", key=fqn
                )
            described = describe_tensor(fqn, value)
            _check_target(fqn, described, tensor)
            for box in described.boxes:
                jobs.extend(reader.plan(fqn, box.box, len(targets)))
                targets.append(box)
            continue
        if item is None:
            raise CheckpointMismatchError(
                "the state dict holds an object, the checkpoint a tensor", key=fqn
            )
        if item.encoding == "pickle" and not allow_pickle:
            raise PickleNotAllowedError(
                "this entry was pickled; pass allow_pickle=True to load it (only for "
                "checkpoints you trust: unpickling runs code)",
                key=fqn,
            )
        objects.append(item)
    return targets, jobs, objects


def _decode(reader: CheckpointReader, item: ObjectRecord) -> Any:
    if item.text is not None:
        try:
            return load_json_value(item.text, item.fqn)
        except CheckpointFormatError as err:
            raise CheckpointFormatError(err.bare_message, key=item.fqn) from err
    payload = reader.blob(item.fqn, verify=False)  # its blocks were verified with the rest
    if item.encoding != "pickle":
        return decode_object(item.encoding, payload, pickle.loads)
    try:
        return pickle.loads(payload)
    # The caller opted in to pickle for a checkpoint it trusts; a payload that passed its
    # checksums but does not unpickle fails in whatever way the pickled classes do.
    except Exception as err:
        raise CheckpointDataError(
            f"the pickled value cannot be loaded: {type(err).__name__}: {err}",
            key=item.fqn,
            rank=reader.rank,
        ) from err


def _set_nested(state_dict: MutableMapping[str, Any], fqn: str, value: Any) -> None:
    """Replace the value at dotted ``fqn`` in a possibly nested state dict."""
    if fqn in state_dict:
        state_dict[fqn] = value
        return
    for split in range(len(fqn.split(".")) - 1, 0, -1):
        prefix = ".".join(fqn.split(".")[:split])
        child = state_dict.get(prefix)
        if isinstance(child, dict):
            _set_nested(child, fqn[len(prefix) + 1 :], value)
            return
    raise KeyError(fqn) from None


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (collective).

    Tensors (plain, ShardedTensor, DTensor, LocalShardsWrapper; any layout, any world size)
    are filled in place from whatever layout was saved; other values are replaced. Keys of the
    checkpoint that the state dict does not have are ignored. Nothing is copied into the state
    dict before every rank has validated the index and verified every block it will read: a
    failure leaves the state dict unchanged.

    Args:
        state_dict: The target, with tensors of the right size and dtype.
        path: Checkpoint directory or fsspec URL.
        process_group: The ranks loading together (default: the default group, if any).
        strict: Raise when a key of ``state_dict`` is missing from the checkpoint.
        verify: Check the checksum of every block read (``False`` skips this).
        allow_pickle: Allow loading entries that were pickled.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0.

    Raises:
        CheckpointError: (a subclass) missing or incomplete checkpoint, corrupt or malformed
            index, unknown version, missing key, size or dtype mismatch, checksum mismatch,
            missing, unsafe or truncated data file, pickled entry without ``allow_pickle``.
            Every rank raises the same error.
    """
    comm = collectives.Comm(process_group)
    path_text = os.path.expanduser(os.fspath(path))
    storage = open_storage(path_text, storage_options)

    # Rank 0 reads the index and broadcasts it (or its failure): O(index) bytes per rank.
    # surrogateescape carries arbitrary bytes through the JSON broadcast unchanged.
    envelope: dict[str, Any] = {}
    error: Exception | None = None
    if comm.rank == 0:
        try:
            raw = read_index_bytes(storage, path_text)
            envelope = {"text": raw.decode("utf-8", "surrogateescape")}
        except CheckpointError as err:
            error = err
            envelope = {"error": collectives.describe_error(err)}
    if comm.group is not None:
        envelope = comm.broadcast_json(envelope, src=0)
    if error is not None:
        raise error
    if "error" in envelope:
        raise collectives.rebuild_error(envelope["error"], 0)
    data = envelope["text"].encode("utf-8", "surrogateescape")
    # Every rank decodes the same bytes, so every rank reaches the same verdict.
    reader = CheckpointReader(storage, decode(data, storage), path_text, comm.rank)
    try:
        _load(reader, comm, state_dict, strict, verify, allow_pickle, progress)
    finally:
        reader.close()


def _load(
    reader: CheckpointReader,
    comm: collectives.Comm,
    state_dict: MutableMapping[str, Any],
    strict: bool,
    verify: bool,
    allow_pickle: bool,
    progress: bool,
) -> None:
    def plan() -> tuple[list[LocalBox], list[Job], list[ObjectRecord]]:
        flat = planner.flatten_state_dict(state_dict)
        planned = _plan_load(flat, reader, strict, allow_pickle)
        _, jobs, objects = planned
        blobs = [(item.fqn, item.blob) for item in objects if item.blob is not None]
        reader.check_files(itertools.chain(((job.key, job.chunk) for job in jobs), blobs))
        return planned

    (targets, jobs, objects), _ = comm.exchange_or_raise(plan, lambda _: None)

    def check() -> dict[str, Any]:
        if verify:
            blobs = (
                reader.blocks(item.fqn, item.blob, 0, item.blob.nbytes)
                for item in objects
                if item.blob is not None
            )
            reader.verify(itertools.chain(reader.job_blocks(jobs), *blobs))
        return {item.fqn: _decode(reader, item) for item in objects}

    values, _ = comm.exchange_or_raise(check, lambda _: None)
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm  # type: ignore[import-untyped]

        total = sum(job.read.nbytes for job in jobs)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {reader.path}")
    try:
        comm.exchange_or_raise(
            lambda: reader.fill(jobs, targets, None if bar is None else bar.update),
            lambda _: None,
        )
    finally:
        if bar is not None:
            bar.close()
    # Objects are replaced only once every rank has loaded everything.
    for fqn, value in values.items():
        _set_nested(state_dict, fqn, value)


def load_tensor(
    path: str | os.PathLike[str],
    fqn: str,
    *,
    offsets: list[int] | tuple[int, ...] | None = None,
    sizes: list[int] | tuple[int, ...] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Read one tensor, or the box ``offsets``/``sizes`` of it, into a new CPU tensor.

    No process group needed. Every byte returned is verified against its block checksum.

    Raises:
        CheckpointKeyError: ``fqn`` is not a tensor of the checkpoint.
        ValueError: The box does not fit the tensor.
    """
    with CheckpointReader.open(path, storage_options, rank=0) as reader:
        return reader.read_box(fqn, offsets, sizes)
