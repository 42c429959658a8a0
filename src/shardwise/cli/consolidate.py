"""``shardwise consolidate``: the tensors of a checkpoint in full, as the safetensors files of a
Hugging Face model directory (what ``from_pretrained`` loads).

What is written:

* ``--prefix P`` keeps the keys under ``P`` and strips it: a training checkpoint
  ``{"model": ..., "optim": ..., "step": ...}`` exports its model with ``--prefix model.``.
* Tied tensors (the index's aliases: one tensor saved under several keys) are written once,
  under the key that came first in the saved state dict, as ``save_pretrained`` does (it drops
  the tied output head; ``from_pretrained`` ties it again). An alias whose tensor is not
  selected by ``--prefix`` is written with that tensor's data.
* ``--dtype`` casts floating-point tensors; ``--config`` copies a JSON config to
  ``config.json``.

How: one tensor at a time is read (every block verified) and streamed into its file through
the storage layer, cast piece by piece, so memory stays near the largest tensor. Locally every
file is written under a temporary name and renamed once all were written (a failure leaves
``OUT`` as it was; one during the renames, no old and new files that load as one model).
Object stores have no rename (it is a copy): the weight files are written under their final
names, the index and ``config.json`` last, and a failure removes what the run wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardwise._boxes import byte_view
from shardwise._progress import ByteBar, human_bytes
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.state_dict import display_key
from shardwise.checkpoint.huggingface.files import (
    INDEX_NAME,
    LEFTOVER_NAME,
    METADATA,
    OUTPUT_NAME,
    OutTensor,
    check_header_size,
    check_unique_names,
    file_names,
    index_json,
    normalized_prefix,
    split_files,
    written_dtype,
)
from shardwise.checkpoint.index import ObjectRecord, TensorRecord
from shardwise.checkpoint.index.data_file import FileEntry, layout_file, safetensors_dtype
from shardwise.checkpoint.storage import LocalStorage, Storage, Writer, open_storage
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint, check_url
from shardwise.cli._common import EXIT_OK, UsageError, _count, _keys_text, print_json
from shardwise.errors import CheckpointStorageError
from shardwise.metadata import dtype_name

_CONFIG_NAME = "config.json"
# The largest --config accepted (configs are a few KiB).
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a consolidation writes, and the notes to print once it is done."""

    tensors: list[OutTensor]
    notes: list[str]


def _top_level_parts(keys: list[str]) -> list[str]:
    """The distinct first parts of ``keys``, as prefixes (``"model."``), or the whole key when
    it has one part (``"step"``), in first-seen order."""
    parts: dict[str, None] = {}
    for key in keys:
        head, dot, _ = key.partition(".")
        parts[head + dot] = None
    return list(parts)


def _plan(checkpoint: _Checkpoint, prefix: str | None, cast: torch.dtype | None) -> _Plan:
    """The tensors to write, in key order, and notes on what is not written.

    Raises:
        UsageError: No key is under ``prefix``.
        CheckpointKeyError: Two keys would get the same name.
    """
    shown = {key: display_key(key) for key in checkpoint.entries}
    selected = list(checkpoint.entries)
    if prefix is not None:
        selected = [key for key in selected if shown[key].startswith(prefix)]
        if not selected:
            parts = _top_level_parts(sorted(shown.values()))
            raise UsageError(
                f"no key of the checkpoint starts with {prefix!r}; its top-level parts are "
                f"{_keys_text(parts)}: give one of them to --prefix"
            )

    def name_of(key: str) -> str:
        return shown[key][len(prefix) :] if prefix is not None else shown[key]

    chosen = set(selected)
    tensors: list[OutTensor] = []
    notes: list[str] = []
    objects: list[str] = []
    tied: list[str] = []
    for key in selected:
        entry = checkpoint.entries[key]
        if isinstance(entry, ObjectRecord):
            objects.append(name_of(key))
            continue
        source = checkpoint.aliases.get(key, key)
        if source != key and source in chosen:
            tied.append(f"{name_of(key)!r}, tied to {name_of(source)!r}")
            continue
        dtype = written_dtype(entry.dtype, cast)
        if safetensors_dtype(dtype) is None:
            notes.append(
                f"warning: skipping {name_of(key)!r}: safetensors cannot store dtype "
                f"{dtype_name(dtype)}"
            )
            continue
        nbytes = math.prod(entry.size) * dtype.itemsize
        tensors.append(OutTensor(name_of(key), source, dtype, entry.size, nbytes))
    check_unique_names(tensors, "the checkpoint")
    if tied:
        one = len(tied) == 1
        notes.append(
            f"note: {_count(len(tied), 'tied tensor')} not written ({'; '.join(tied)}): "
            f"save_pretrained leaves {'it' if one else 'them'} out too, and from_pretrained "
            f"ties {'it' if one else 'them'} again"
        )
    if objects:
        are = "is" if len(objects) == 1 else "are"
        notes.append(
            f"note: {_count(len(objects), 'non-tensor entry', 'non-tensor entries')} {are} not "
            f"written (safetensors holds tensors only): {_keys_text(objects)}"
        )
    if prefix is None:
        notes.extend(_prefix_hint(checkpoint, shown))
    return _Plan(tensors, notes)


def _prefix_hint(checkpoint: _Checkpoint, shown: dict[str, str]) -> list[str]:
    """A note suggesting ``--prefix`` when the checkpoint looks like a training checkpoint:
    tensors under several top-level parts, next to non-tensor values (a step, an
    optimizer's param_groups). A model's own state dict (``model.*`` and ``lm_head.*``) holds
    tensors only, and gets no note."""
    tensor_keys = [
        shown[key] for key, e in checkpoint.entries.items() if isinstance(e, TensorRecord)
    ]
    parts = [part for part in _top_level_parts(tensor_keys) if part.endswith(".")]
    if len(parts) < 2 or len(tensor_keys) == len(checkpoint.entries):
        return []
    example = "model." if "model." in parts else parts[0]
    return [
        f"note: the tensors come from {len(parts)} top-level parts ({_keys_text(parts)}), as "
        "in a training checkpoint; all were written. To export one model for "
        f"from_pretrained, select its keys with --prefix, e.g. --prefix {example}"
    ]


def _write_tensor(checkpoint: _Checkpoint, writer: Writer, tensor: OutTensor, bar: ByteBar) -> None:
    """Stream ``tensor`` into ``writer``, read (every block verified first) and cast piece
    by piece: memory holds about ``TUNING.consolidate_piece_bytes`` of it at a time, never all
    of it."""
    record = checkpoint.index.tensors[tensor.source]
    ratio = max(1, tensor.dtype.itemsize // record.dtype.itemsize)
    for piece in checkpoint.pieces(
        tensor.source, max(1, tuning.TUNING.consolidate_piece_bytes // ratio)
    ):
        data = byte_view(piece if piece.dtype == tensor.dtype else piece.to(tensor.dtype))
        writer.write(data)
        bar.update(len(data))


def _write_file(
    checkpoint: _Checkpoint, writer: Writer, name: str, tensors: list[OutTensor], bar: ByteBar
) -> None:
    """Stream a safetensors file of ``tensors`` into ``writer``: the header laid out by the
    format module (as shardwise's own data files: metadata ``{"format": "pt"}``, the data
    64-byte aligned, so 8-byte aligned as safetensors writes it), then one tensor at a
    time."""
    entries = [FileEntry(t.name, t.dtype, t.shape, t.nbytes) for t in tensors]
    header = layout_file(entries, METADATA).header
    if tensors:
        check_header_size(header, name, tensors[0].source)
    writer.write(header)
    for tensor in tensors:
        _write_tensor(checkpoint, writer, tensor, bar)


def _read_config(path: str) -> bytes:
    """The ``--config`` file, checked to be a JSON object.

    Raises:
        UsageError: It cannot be read, or is not a JSON object.
    """
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise UsageError(f"cannot read --config {path}: {err.strerror or err}") from err
    if len(data) > _MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path} is larger than {human_bytes(_MAX_CONFIG_BYTES)}")
    try:
        value = json.loads(data)
    except ValueError as err:  # not UTF-8, or not JSON
        raise UsageError(f"--config {path} is not JSON: {err}") from err
    except RecursionError:
        raise UsageError(f"--config {path} is nested too deeply") from None
    if not isinstance(value, dict):
        raise UsageError(
            f"--config {path} holds a JSON {type(value).__name__}; a model config is a JSON "
            "object (as config.json of a Hugging Face model)"
        )
    return data


class _Output:
    """The files of one consolidation into ``storage``: written all or nothing locally, and
    removed again after a failure on object stores.

    Local files are written under temporary names and renamed by :meth:`commit`. Object
    stores have no rename (fsspec copies), so files are written under their final names in
    the order given (weights, then the index and the config), and :meth:`discard` removes
    them.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.local = isinstance(storage, LocalStorage)
        self.created = not storage.exists(storage.root)
        storage.makedirs(storage.root)
        if self.local:
            self._refuse_directories()
        self._written: dict[str, str] = {}  # final name: the path written

    def _refuse_directories(self) -> None:
        """Refuse a directory under a name the commit replaces or removes, before any file
        is written (else the commit would fail with some files in place)."""
        for name in self.storage.listdir(self.storage.root):
            path = self.storage.join(name)
            if OUTPUT_NAME.fullmatch(name) and stat.S_ISDIR(os.lstat(path).st_mode):
                raise CheckpointStorageError(
                    f"{path} is a directory, where consolidate puts or removes a weight file: "
                    "remove it, or write elsewhere",
                    file=path,
                )

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[Writer]:
        """A writer for the output file ``name``: closed (durable, locally) when the block
        ends, given up (nothing of it stays) when it raises."""
        if self.local:
            path = self.storage.join(f".{name}.{os.getpid()}.tmp")
            self.storage.remove(path)  # left by a killed run of the same pid
        else:
            path = self.storage.join(name)
        writer = self.storage.open_write(path)
        self._written[name] = path
        try:
            yield writer
        except BaseException:
            # Given up, not closed: closing would upload what an object store has so far.
            writer.abort()
            raise
        writer.close(sync=self.local)

    def write(self, name: str, data: bytes) -> None:
        with self.open(name) as writer:
            writer.write(data)

    def commit(self) -> None:
        """Put every file written in place (locally: rename them, in the order written).

        Locally the old index and the weight files of an earlier run that this one does not
        replace are removed first: removed last, a run stopped between its renames would
        leave the old index (or ``model.safetensors``) beside new files, a model of old and
        new tensors that loads without a word; removed first, a stopped run leaves several
        weight files and no index, which no loader takes for a model. What killed runs left
        under temporary names is removed last."""
        if self.local:
            for name in self.storage.listdir(self.storage.root):
                if OUTPUT_NAME.fullmatch(name) and (
                    name == INDEX_NAME or name not in self._written
                ):
                    self.storage.remove(self.storage.join(name))
            for name, path in self._written.items():
                self.storage.rename(path, self.storage.join(name))
            for name in self.storage.listdir(self.storage.root):
                if LEFTOVER_NAME.fullmatch(name):
                    with contextlib.suppress(OSError):  # best effort: the run is done
                        self.storage.remove(self.storage.join(name))
            self.storage.sync_dir(self.storage.root)

    def discard(self) -> None:
        """Remove every file this run wrote (and ``OUT`` itself, if it made it locally)."""
        for path in self._written.values():
            with contextlib.suppress(OSError):
                self.storage.remove(path)
        if isinstance(self.storage, LocalStorage) and self.created:
            with contextlib.suppress(OSError):
                self.storage.remove_directory(self.storage.root)

    def remove_stale(self) -> None:
        """Remove the weight files of an earlier consolidation that this one did not write:
        they would mix with the new ones."""
        for name in self.storage.listdir(self.storage.root):
            if OUTPUT_NAME.fullmatch(name) and name not in self._written:
                self.storage.remove(self.storage.join(name))


def _nbytes(tensor: OutTensor) -> int:
    return tensor.nbytes


def run(args: argparse.Namespace) -> int:
    """Write the tensors of checkpoint ``args.path`` as safetensors into ``args.out``."""
    prefix = None if args.prefix is None else normalized_prefix(args.prefix)
    cast = None if args.dtype is None else getattr(torch, args.dtype)
    config = None if args.config is None else _read_config(args.config)
    check_url(args.out)
    with _open_checkpoint(args.path, args.storage_options) as checkpoint:
        plan = _plan(checkpoint, prefix, cast)
        # A missing, linked or wrongly sized data file fails here, before OUT is touched.
        checkpoint.check_files(tensor.source for tensor in plan.tensors)
        total = sum(tensor.nbytes for tensor in plan.tensors)
        shards = split_files(plan.tensors, _nbytes, args.max_shard_size)
        files = dict(zip(file_names(len(shards)), shards, strict=True))
        output = _Output(open_storage(args.out, args.storage_options))
        try:
            with ByteBar(total, f"consolidating into {args.out}") as bar:
                for name, tensors in files.items():
                    with output.open(name) as writer:
                        _write_file(checkpoint, writer, name, tensors, bar)
            if len(files) > 1:
                weight_map = {
                    tensor.name: name for name, shard in files.items() for tensor in shard
                }
                output.write(INDEX_NAME, index_json(weight_map, total))
            if config is not None:
                output.write(_CONFIG_NAME, config)
            output.commit()
        except BaseException:
            output.discard()
            raise
    output.remove_stale()
    # Printed once all is written, so that a failure is reported in exactly one line.
    for note in plan.notes:
        print(note, file=sys.stderr)
    if args.json:
        print_json(
            {
                "path": args.path,
                "out": args.out,
                "files": list(files),
                "config": _CONFIG_NAME if config is not None else None,
                "num_tensors": len(plan.tensors),
                "bytes": total,
            }
        )
        return EXIT_OK
    config_text = f" and {_CONFIG_NAME}" if config is not None else ""
    print(
        f"wrote {_count(len(plan.tensors), 'tensor')} ({human_bytes(total)}) to "
        f"{_count(len(files), 'file')}{config_text} in {args.out}"
    )
    return EXIT_OK
