"""``shardwise consolidate``: every tensor in full, in Hugging Face style safetensors files."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint._items import byte_view
from shardwise.checkpoint.index import TensorRecord
from shardwise.cli._common import (
    EXIT_OK,
    _Checkpoint,
    _count,
    _human_bytes,
    _keys_text,
    _open_checkpoint,
    _progress,
)
from shardwise.metadata import dtype_name

_safetensors_codes: dict[torch.dtype, str | None] = {}


def _safetensors_code(dtype: torch.dtype) -> str | None:
    """The dtype code the installed safetensors library writes for ``dtype``, or None when it
    cannot store it (or stores it in a shape other than torch's, e.g. packed sub-byte types)."""
    if dtype not in _safetensors_codes:
        import safetensors.torch

        probe = torch.zeros(1, dtype=dtype)
        code: str | None = None
        try:
            data = safetensors.torch.save({"x": probe})
        except (KeyError, ValueError, TypeError, RuntimeError):
            data = None  # the library has no code for this dtype
        if data is not None:
            (length,) = struct.unpack("<Q", data[:8])
            entry = json.loads(data[8 : 8 + length])["x"]
            if entry["shape"] == [1] and entry["data_offsets"] == [0, probe.element_size()]:
                code = str(entry["dtype"])
        _safetensors_codes[dtype] = code
    return _safetensors_codes[dtype]


@dataclass(frozen=True, slots=True)
class _OutTensor:
    fqn: str
    code: str
    shape: tuple[int, ...]
    nbytes: int


def _shard(tensors: list[_OutTensor], max_bytes: int) -> list[list[_OutTensor]]:
    """Group tensors, in order, into files of at most ``max_bytes`` each, by Hugging Face's
    rule: a tensor larger than the limit is put in a file of its own right away, while the
    file being filled stays open for the tensors after it."""
    shards: list[list[_OutTensor]] = []
    current: list[_OutTensor] = []
    current_bytes = 0
    for tensor in tensors:
        if tensor.nbytes > max_bytes:
            shards.append([tensor])
            continue
        if current_bytes + tensor.nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current:
        shards.append(current)
    return shards or [[]]


def _write_safetensors(
    checkpoint: _Checkpoint, tensors: list[_OutTensor], path: str, progress: Any
) -> None:
    """Write a safetensors file at ``path``, streaming one assembled tensor at a time (memory
    stays bounded by the largest tensor, not by the file)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for tensor in tensors:
        header[tensor.fqn] = {
            "dtype": tensor.code,
            "shape": list(tensor.shape),
            "data_offsets": [position, position + tensor.nbytes],
        }
        position += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the safetensors library aligns the data section to 8
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for tensor in tensors:
            data = checkpoint.tensor(tensor.fqn)
            file.write(byte_view(data.contiguous()))
            progress.update(tensor.nbytes)


_INDEX_NAME = "model.safetensors.index.json"
_OUTPUT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _plan(checkpoint: _Checkpoint) -> tuple[list[_OutTensor], list[str]]:
    """The tensors to write, in key order, and notes on what is skipped."""
    tensors: list[_OutTensor] = []
    notes = []
    skipped_objects = []
    for fqn, entry in checkpoint.entries.items():
        if not isinstance(entry, TensorRecord):
            skipped_objects.append(fqn)
            continue
        code = _safetensors_code(entry.dtype)
        if code is None:
            notes.append(
                f"warning: skipping {fqn!r}: safetensors cannot store dtype "
                f"{dtype_name(entry.dtype)}"
            )
            continue
        nbytes = math.prod(entry.size) * entry.dtype.itemsize
        tensors.append(_OutTensor(fqn, code, entry.size, nbytes))
    if skipped_objects:
        notes.append(
            f"note: {len(skipped_objects)} non-tensor entries are not written (safetensors "
            f"holds tensors only): {_keys_text(skipped_objects)}"
        )
    return tensors, notes


def _write_all(
    checkpoint: _Checkpoint, out: str, files: dict[str, list[_OutTensor]], total: int
) -> None:
    """Write ``files`` (name: tensors) into ``out``, all or nothing: every file is written
    under a temporary name first and renamed only when all were written, so a corrupt
    checkpoint leaves ``out`` as it was."""
    temporaries = {name: os.path.join(out, f"{name}.tmp") for name in files}
    try:
        with _progress(total, f"consolidating into {out}") as bar:
            for name, tensors in files.items():
                _write_safetensors(checkpoint, tensors, temporaries[name], bar)
        if len(files) > 1:
            weight_map = {tensor.fqn: name for name, shard in files.items() for tensor in shard}
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            temporaries[_INDEX_NAME] = os.path.join(out, f"{_INDEX_NAME}.tmp")
            with open(temporaries[_INDEX_NAME], "w") as file:
                file.write(json.dumps(index, indent=2) + "\n")
        for name, temporary in temporaries.items():
            os.replace(temporary, os.path.join(out, name))
    finally:
        for temporary in temporaries.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)


def run(args: argparse.Namespace) -> int:
    """Write the tensors of checkpoint ``args.path`` as safetensors into ``args.out``."""
    with _open_checkpoint(args.path) as checkpoint:
        tensors, notes = _plan(checkpoint)
        # A missing, linked or wrongly sized data file fails here, before OUT is touched.
        checkpoint.check_files(tensor.fqn for tensor in tensors)
        total = sum(tensor.nbytes for tensor in tensors)
        shards = _shard(tensors, args.max_shard_size)
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
            ]
        created = not os.path.exists(args.out)
        os.makedirs(args.out, exist_ok=True)
        try:
            _write_all(checkpoint, args.out, dict(zip(names, shards, strict=True)), total)
        except BaseException:
            if created:  # leave nothing behind
                with contextlib.suppress(OSError):
                    os.rmdir(args.out)
            raise
    # Printed once all is written, so that a failure is reported in exactly one line.
    for note in notes:
        print(note, file=sys.stderr)
    written = {*names, _INDEX_NAME} if len(shards) > 1 else set(names)
    # Files of an earlier consolidation into the same directory would mix with these.
    for name in os.listdir(args.out):
        if _OUTPUT_NAME.fullmatch(name) and name not in written:
            os.remove(os.path.join(args.out, name))
    print(
        f"wrote {_count(len(tensors), 'tensor')} ({_human_bytes(total)}) to "
        f"{_count(len(names), 'file')} in {args.out}"
    )
    return EXIT_OK
