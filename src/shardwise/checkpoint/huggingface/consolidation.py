"""``consolidate``: the tensors of a shardwise checkpoint in full, as the safetensors files of a
Hugging Face model directory (what ``from_pretrained`` loads); ``shardwise consolidate`` runs
it (``docs/huggingface.md``, ``docs/cli.md``).

What is written:

* ``prefix`` keeps the keys under it and strips it: a training checkpoint
  ``{"model": ..., "optim": ..., "step": ...}`` exports its model with ``prefix="model."``.
* Tied tensors (the index's aliases: one tensor saved under several keys) are written once,
  under the key that came first in the saved state dict, as ``save_pretrained`` does (it drops
  the tied output head; ``from_pretrained`` ties it again). An alias whose tensor is not
  selected by ``prefix`` is written with that tensor's data.
* ``dtype`` casts floating-point tensors; ``config`` copies a JSON config to ``config.json``.

How: one tensor at a time is read (every block verified) and streamed into its file, cast
piece by piece, so memory stays near the largest tensor; the directory is written by
:class:`~.directory.DirectoryWriter` (locally all or nothing; on object stores removed again
after a failure).

The steps, which the command line takes one by one to word its refusals as options
(``--prefix``, ``--config``): :func:`read_config`, :func:`selected_keys`, :class:`Consolidation`
(the plan; :meth:`~Consolidation.check_files`, :meth:`~Consolidation.write`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise._boxes import byte_view
from shardwise._json import strict_json
from shardwise._progress import ByteBar, human_bytes
from shardwise._sizes import parse_size
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import LocalBox
from shardwise.checkpoint.entries.state_dict import display_key
from shardwise.checkpoint.huggingface.directory import (
    CONFIG_NAME,
    DirectoryWriter,
    WeightFile,
    weight_files,
)
from shardwise.checkpoint.huggingface.files import (
    DEFAULT_MAX_SHARD_BYTES,
    OutTensor,
    check_unique_names,
    normalized_prefix,
    split_files,
    written_dtype,
)
from shardwise.checkpoint.index import ObjectRecord, TensorRecord
from shardwise.checkpoint.index.data_file import safetensors_dtype
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.planning.planner import Box
from shardwise.checkpoint.storage import Storage, Writer, open_storage
from shardwise.metadata import dtype_name

__all__ = [
    "Consolidated",
    "Consolidation",
    "consolidate",
    "read_config",
    "selected_keys",
    "top_level_parts",
]

logger = logging.getLogger(__name__)

# The largest config accepted (configs are a few KiB).
_MAX_CONFIG_BYTES = 16 << 20
_NUM_KEYS_NAMED = 5


@dataclass(frozen=True, slots=True)
class Consolidated:
    """What :func:`consolidate` wrote.

    Attributes:
        files: The weight files (``model.safetensors.index.json`` beside them when several).
        config: ``"config.json"`` when a config was copied, else None.
        num_tensors: The tensors written.
        nbytes: Their bytes.
        notes: What was left out, and why (``"warning: ..."``, ``"note: ..."``).
    """

    files: list[str]
    config: str | None
    num_tensors: int
    nbytes: int
    notes: list[str]


def _keys_text(keys: Sequence[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_NUM_KEYS_NAMED])
    rest = len(keys) - _NUM_KEYS_NAMED
    return f"{named} and {rest} more" if rest > 0 else named


def _count(number: int, noun: str, plural: str | None = None) -> str:
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def read_config(path: str | os.PathLike[str], option: str = "config") -> bytes:
    """The model config at ``path``, as it is, checked to be a JSON object.

    Args:
        path: The file (e.g. the ``config.json`` that ``model.config.save_pretrained`` wrote).
        option: The argument's name, for the messages (``"--config"`` on the command line).

    Raises:
        ValueError: It cannot be read, is too large, or is not a JSON object.
    """
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ValueError(f"cannot read {option} {path}: {err.strerror or err}") from err
    if len(data) > _MAX_CONFIG_BYTES:
        raise ValueError(f"{option} {path} is larger than {human_bytes(_MAX_CONFIG_BYTES)}")
    try:
        # NaN and Infinity allowed: transformers writes a config with json.dumps' defaults.
        value = strict_json(data, f"{option} {path}", constants=True)
    except ValueError as err:  # not UTF-8, not JSON, a repeated key, nested too deeply
        raise ValueError(str(err)) from None  # it begins with "{option} {path}"
    if not isinstance(value, dict):
        raise ValueError(
            f"{option} {path} holds a JSON {type(value).__name__}; a model config is a JSON "
            "object (as config.json of a Hugging Face model)"
        )
    return data


def top_level_parts(keys: Iterable[str]) -> list[str]:
    """The distinct first parts of ``keys``, as prefixes (``"model."``), or the whole key when
    it has one part (``"step"``), in first-seen order."""
    parts: dict[str, None] = {}
    for key in keys:
        head, dot, _ = key.partition(".")
        parts[head + dot] = None
    return list(parts)


def _entries(reader: CheckpointReader) -> dict[str, TensorRecord | ObjectRecord]:
    """The checkpoint's entries by key, sorted (the index holds each key once)."""
    merged: dict[str, TensorRecord | ObjectRecord] = {**reader.index.tensors}
    merged.update(reader.index.objects)
    return dict(sorted(merged.items()))


def selected_keys(
    reader: CheckpointReader, prefix: str | None, option: str = "prefix"
) -> list[str]:
    """The keys of the checkpoint under ``prefix`` (a :func:`~.files.normalized_prefix`; all
    for None), sorted.

    Raises:
        ValueError: No key is under ``prefix`` (naming the top-level parts, and ``option``).
    """
    shown = {key: display_key(key) for key in _entries(reader)}
    if prefix is None:
        return list(shown)
    selected = [key for key in shown if shown[key].startswith(prefix)]
    if not selected:
        parts = top_level_parts(sorted(shown.values()))
        raise ValueError(
            f"no key of the checkpoint starts with {prefix!r}; its top-level parts are "
            f"{_keys_text(parts)}: give one of them to {option}"
        )
    return selected


class Consolidation:
    """The plan of one consolidation of ``reader``'s checkpoint, and its steps.

    Args:
        reader: The checkpoint, open.
        keys: The keys to write (:func:`selected_keys`).
        prefix: The prefix stripped from their names (normalized), if any.
        cast: The dtype floating-point tensors are written in, if any.
        max_bytes: The most bytes of tensors per weight file.

    Raises:
        CheckpointKeyError: Two keys would get the same name.
        CheckpointMismatchError: A file's header would be over what safetensors reads.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        keys: Sequence[str],
        prefix: str | None,
        cast: torch.dtype | None,
        max_bytes: int,
    ) -> None:
        self.reader = reader
        self.tensors, self.notes = _plan(reader, keys, prefix, cast)
        self.files: list[WeightFile] = weight_files(split_files(self.tensors, _nbytes, max_bytes))

    @property
    def total(self) -> int:
        """The bytes of tensor data written."""
        return sum(tensor.nbytes for tensor in self.tensors)

    def check_files(self) -> None:
        """Open (so check, reading nothing) every data file holding bytes of the tensors to
        write: a missing, linked or wrongly sized file fails before the output is touched."""
        index = self.reader.index
        self.reader.check_files(
            (tensor.source, chunk)
            for tensor in self.tensors
            for chunk in index.tensors[tensor.source].chunks
        )

    def write(self, storage: Storage, config: bytes | None, bar: ByteBar) -> Consolidated:
        """Write the weight files (one tensor at a time), the index and ``config`` into
        ``storage``, all or nothing (:class:`~.directory.DirectoryWriter`); ``bar`` counts the
        bytes of tensor data."""
        directory = DirectoryWriter(storage, str(os.getpid()), "consolidate", "write elsewhere")
        try:
            directory.prepare()
            for file in self.files:
                with directory.open(file.name) as writer:
                    writer.write(file.header)
                    for tensor in file.tensors:
                        self._write_tensor(writer, tensor, bar)
            directory.write_index(self.files)
            if config is not None:
                directory.write(CONFIG_NAME, config)
            directory.commit()
        except BaseException:
            directory.discard()
            raise
        config_name = CONFIG_NAME if config is not None else None
        weights = [file.name for file in self.files]
        return Consolidated(weights, config_name, len(self.tensors), self.total, self.notes)

    def _write_tensor(self, writer: Writer, tensor: OutTensor, bar: ByteBar) -> None:
        """Stream ``tensor`` into ``writer``, read (every block verified first) and cast piece
        by piece: memory holds about ``TUNING.consolidate_piece_bytes`` of it at a time, never
        all of it."""
        record = self.reader.index.tensors[tensor.source]
        ratio = max(1, tensor.dtype.itemsize // record.dtype.itemsize)
        limit = max(1, tuning.TUNING.consolidate_piece_bytes // ratio)
        for piece in _pieces(self.reader, tensor.source, limit):
            data = byte_view(piece if piece.dtype == tensor.dtype else piece.to(tensor.dtype))
            writer.write(data)
            bar.update(len(data))


def _plan(
    reader: CheckpointReader, keys: Sequence[str], prefix: str | None, cast: torch.dtype | None
) -> tuple[list[OutTensor], list[str]]:
    """The tensors to write, in key order, and notes on what is not written."""
    entries = _entries(reader)
    aliases = reader.index.aliases
    shown = {key: display_key(key) for key in entries}

    def name_of(key: str) -> str:
        return shown[key][len(prefix) :] if prefix is not None else shown[key]

    chosen = set(keys)
    tensors: list[OutTensor] = []
    notes: list[str] = []
    objects: list[str] = []
    tied: list[str] = []
    for key in keys:
        entry = entries[key]
        if isinstance(entry, ObjectRecord):
            objects.append(name_of(key))
            continue
        source = aliases.get(key, key)
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
        notes.extend(_prefix_hint(entries, shown))
    return tensors, notes


def _prefix_hint(
    entries: Mapping[str, TensorRecord | ObjectRecord], shown: Mapping[str, str]
) -> list[str]:
    """A note suggesting a prefix when the checkpoint looks like a training checkpoint:
    tensors under several top-level parts, next to non-tensor values (a step, an optimizer's
    param_groups). A model's own state dict (``model.*`` and ``lm_head.*``) holds tensors
    only, and gets no note."""
    tensor_keys = [shown[key] for key, e in entries.items() if isinstance(e, TensorRecord)]
    parts = [part for part in top_level_parts(tensor_keys) if part.endswith(".")]
    if len(parts) < 2 or len(tensor_keys) == len(entries):
        return []
    example = "model." if "model." in parts else parts[0]
    return [
        f"note: the tensors come from {len(parts)} top-level parts ({_keys_text(parts)}), as "
        "in a training checkpoint; all were written. To export one model for "
        f"from_pretrained, select its keys with --prefix, e.g. --prefix {example}"
    ]


def _nbytes(tensor: OutTensor) -> int:
    return tensor.nbytes


def _pieces(reader: CheckpointReader, fqn: str, limit: int) -> Iterator[torch.Tensor]:
    """Tensor ``fqn`` as consecutive pieces, in C order, of at most ``limit`` bytes each: the
    whole tensor streamed in memory of a piece, however large it is (every block a piece
    needs is read once for it, checked, and used)."""
    record = reader.tensor_record(fqn)
    for box in contiguous_boxes(record.size, record.dtype.itemsize, limit):
        jobs = reader.plan(fqn, box, 0)
        reader.check_files((job.key, job.chunk) for job in jobs)
        piece = torch.empty(box[1], dtype=record.dtype)
        reader.fill(jobs, [LocalBox(box[0], box[1], piece)])
        yield piece


def contiguous_boxes(size: Sequence[int], itemsize: int, limit: int) -> Iterator[Box]:
    """Boxes that tile a tensor of ``size`` in C order, each a contiguous run of its elements
    of at most ``limit`` bytes (at least one element): whole blocks of rows of the first dim
    whose rows fit, with single indices in the dims before it.

    >>> list(contiguous_boxes((4, 3), 4, 24))
    [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    """
    if not size:
        yield (), ()
        return
    dims = len(size)
    row_bytes = [math.prod(size[dim + 1 :]) * itemsize for dim in range(dims)]
    split = next(dim for dim in range(dims) if row_bytes[dim] <= limit)
    step = max(1, limit // row_bytes[split])
    rest = tuple(size[split + 1 :])
    for index in itertools.product(*(range(n) for n in size[:split])):
        for start in range(0, size[split], step):
            count = min(step, size[split] - start)
            yield (*index, start, *(0,) * len(rest)), (*(1,) * split, count, *rest)


def consolidate(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> Consolidated:
    """Write the tensors of the checkpoint at ``path`` in full as a Hugging Face model
    directory at ``out`` (what ``from_pretrained`` loads): ``shardwise consolidate`` in
    Python, in one process.

    The files are named, split and indexed as ``save_pretrained`` writes them; tied tensors
    are written once; non-tensor entries and dtypes safetensors cannot store are left out (the
    result's ``notes`` say which, also logged). Locally the files appear only once all are
    written, replacing the weight files of an earlier write; on an object store a failure
    removes what was written.

    Args:
        path: The checkpoint (a directory or fsspec URL).
        out: The model directory (a directory or fsspec URL; created if missing).
        max_shard_size: The most bytes of tensors per file (a larger tensor gets its own): a
            positive int, or a size such as ``"5GB"`` (KB..TB powers of 1000, KiB..TiB of
            1024).
        prefix: Only keys under this prefix are written, named without it (``"model"`` and
            ``"model."`` alike).
        dtype: The floating-point dtype to write floating-point tensors in.
        config: A JSON model config file, copied to ``out/config.json`` as it is.
        storage_options: fsspec options for ``path`` and ``out``.
        progress: Show a progress bar of the bytes written (stderr).

    Returns:
        What was written.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``, or ``max_shard_size`` neither an int
            nor a str.
        ValueError: ``max_shard_size`` is no positive size, ``dtype`` is not floating point,
            no key is under ``prefix``, or ``config`` cannot be read or is not a JSON object
            (all checked before ``out`` is touched).
        CheckpointError: (a subclass) no checkpoint at ``path``, a corrupt block, two keys of
            one name; ``CheckpointStorageError`` for a write that fails.

    Example:
        >>> shardwise.checkpoint.consolidate("/ckpt/100", "/out/model", prefix="model.",
        ...                                  config="/out/config.json", dtype=torch.bfloat16)
    """
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(
            f"dtype={dtype} is not a floating-point dtype; only floating-point tensors are cast"
        )
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {prefix!r}")
    chosen = None if prefix is None else normalized_prefix(prefix)
    config_data = None if config is None else read_config(config)
    out_text = os.path.expanduser(os.fspath(out))
    with CheckpointReader.open(path, storage_options) as reader:
        consolidation = Consolidation(
            reader, selected_keys(reader, chosen), chosen, dtype, max_bytes
        )
        consolidation.check_files()
        storage = open_storage(out_text, storage_options)
        with ByteBar(consolidation.total, f"consolidating into {out_text}", progress) as bar:
            result = consolidation.write(storage, config_data, bar)
    for note in result.notes:
        (logger.warning if note.startswith("warning:") else logger.info)("%s", note)
    return result
