"""Incremental saves (``docs/format.md``, *Incremental checkpoints*): the checkpoint a save
builds on (its *base*, a sibling of the new checkpoint under the same series root), the
content digest of each chunk a rank writes, and the split of a rank's chunks into those it
writes and those it references, because their bytes equal the base's chunk of the same key
and box.

Equality is decided by content only: the xxh3_128 of the chunk's bytes, taken from the
memory the writer would write, against the digest the base's index records for the chunk
with the same key, offsets, sizes and byte count. Nothing else (a tensor's version counter, a
``requires_grad`` flag) is trusted: a frozen weight changed in place under ``no_grad``, or
loaded into, has a different digest and is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import xxhash

from shardwise._boxes import checked_bytes
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import TensorValue
from shardwise.checkpoint.index import INDEX_NAME, MAX_INDEX_BYTES, Index, decode_index
from shardwise.checkpoint.index.data_file import chunk_key
from shardwise.checkpoint.index.names import (
    DIGEST_HEX,
    PORTABLE_RULE,
    is_checkpoint_name,
    parse_reference,
    reference_name,
)
from shardwise.checkpoint.planning.planner import WriteAssignment
from shardwise.checkpoint.storage import Storage, local_path, open_storage
from shardwise.errors import CheckpointError

__all__ = ["Base", "BaseChunk", "digest_of", "open_base", "split_writes"]


class BaseChunk(NamedTuple):
    """A chunk of the base: its content digest, and where it is (``file`` as the new index
    names it)."""

    digest: str
    file: str
    begin: int


@dataclass(slots=True)
class Base:
    """The checkpoint a save builds on: its directory's name below the series root and its
    validated index (version 4 records no digests: nothing of it is referenced)."""

    name: str
    index: Index
    _positions: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def find(self, item: WriteAssignment) -> BaseChunk | None:
        """The digest, file and begin of the base's chunk of ``item``'s key and box (``file``
        as the new index names it: ``../<checkpoint>/data/...``), or None."""
        digests = self.index.digests.get(item.fqn)
        if digests is None:
            return None
        record = self.index.tensors[item.fqn]
        positions = self._positions.get(item.fqn)
        if positions is None:
            positions = {chunk.offsets: n for n, chunk in enumerate(record.chunks)}
            self._positions[item.fqn] = positions
        position = positions.get(item.offsets)
        if position is None:
            return None
        chunk = record.chunks[position]
        if chunk.sizes != item.sizes or chunk.nbytes != item.nbytes:
            return None
        digest = digests[DIGEST_HEX * position : DIGEST_HEX * (position + 1)]
        return BaseChunk(digest, self.file_name(chunk.file), chunk.begin)

    def file_name(self, name: str) -> str:
        """A data file of the base's index as the new index names it (relative to it)."""
        return name if parse_reference(name) is not None else reference_name(self.name, name)


def _series_parts(path: str) -> tuple[str, str]:
    """``(series root, name)`` of a checkpoint path, lexically (a URL by its last ``/``)."""
    local = local_path(path)
    if local is None:
        head, _, name = path.rstrip("/").rpartition("/")
        return head, name
    local = os.path.abspath(local)
    return os.path.dirname(local), os.path.basename(local)


def open_base(path: str, base: str, storage_options: dict[str, Any] | None) -> Base:
    """The base ``base`` of a save to ``path``, its index read and validated.

    Raises:
        ValueError: ``base`` is not a sibling of ``path`` (the same parent directory), is
            ``path`` itself, or has a directory name that no index may reference (checked
            before anything is read: the same verdict on every rank).
        CheckpointError: Its index cannot be read or is invalid.
    """
    root, name = _series_parts(path)
    base_root, base_name = _series_parts(os.path.expanduser(base))
    if base_root != root or not base_name or base_name in (".", ".."):
        raise ValueError(
            f"base={base!r} is not a checkpoint beside {path!r}: an incremental save builds on "
            "a checkpoint of the same series root (the same parent directory)"
        )
    if base_name == name:
        raise ValueError(f"base={base!r} is the checkpoint being saved: it cannot build on itself")
    if not is_checkpoint_name(base_name):
        # The new index would name ``../<base_name>/data/...``, which every reader refuses.
        raise ValueError(
            f"base={base!r}: its directory name {base_name!r} cannot be referenced by an "
            f"incremental checkpoint's index; a referenced checkpoint's name is {PORTABLE_RULE} "
            "(docs/format.md, Incremental checkpoints): rename the base, or save without it"
        )
    storage: Storage = open_storage(os.path.expanduser(base), storage_options)
    try:
        data = storage.read_small(storage.join(INDEX_NAME), MAX_INDEX_BYTES)
    except FileNotFoundError as err:
        raise CheckpointError(
            f"the base checkpoint {base} of this incremental save is not committed (no "
            f"{INDEX_NAME})",
            file=base,
        ) from err
    except OSError as err:
        raise CheckpointError(f"cannot read the base checkpoint's index: {err}", file=base) from err
    return Base(base_name, decode_index(data))


def digest_of(tensor: torch.Tensor) -> str:
    """The xxh3_128 of ``tensor``'s bytes as the writer writes them (C order), 32 hex digits."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
    if tensor.is_cpu:
        return xxhash.xxh3_128_hexdigest(checked_bytes(tensor))
    state = xxhash.xxh3_128()  # pragma: no cover - needs a GPU
    flat = tensor.reshape(-1).view(torch.uint8)  # pragma: no cover
    piece = max(1, tuning.TUNING.staging_bytes)  # pragma: no cover
    for start in range(0, flat.numel(), piece):  # pragma: no cover
        state.update(checked_bytes(flat[start : start + piece].cpu()))
    return state.hexdigest()  # pragma: no cover


def split_writes(
    mine: Sequence[WriteAssignment], tensors: Mapping[str, TensorValue], base: Base | None
) -> tuple[list[WriteAssignment], dict[str, str], dict[str, list[Any]]]:
    """This rank's chunks to write, the digest of each of its chunks (by entry key), and the
    references ``{entry key: [file, begin]}`` of those whose digest equals the base's."""
    to_write: list[WriteAssignment] = []
    digests: dict[str, str] = {}
    references: dict[str, list[Any]] = {}
    for item in mine:
        value = tensors[item.fqn]
        box = next(box for box in value.boxes if box.offsets == item.offsets)
        key = chunk_key(item.fqn, item.offsets)
        digest = digests[key] = digest_of(box.tensor)
        found = None if base is None else base.find(item)
        if found is not None and found.digest == digest:
            references[key] = [found.file, found.begin]
        else:
            to_write.append(item)
    return to_write, digests, references
