"""``shardwise verify``: read every byte of a checkpoint and check every checksum."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
import xxhash

from shardwise.checkpoint import CheckpointDataError, CheckpointFormatError, TensorStorageMetadata
from shardwise.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    _Checkpoint,
    _count,
    _human_bytes,
    _keys_text,
    _open_checkpoint,
    _progress,
    _Stored,
)

# verify reads data files in pieces of this size: large sequential reads, bounded memory.
_PIECE_BYTES = 16 << 20


def _structure_problems(checkpoint: _Checkpoint) -> tuple[list[str], list[_Stored]]:
    """Problems visible in the index alone, and every stored item to read."""
    problems: list[str] = []
    items: list[_Stored] = []
    for fqn, entry in checkpoint.entries.items():
        try:
            if isinstance(entry, TensorStorageMetadata):
                itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
                covered = 0
                for item in checkpoint.chunks(fqn):
                    assert item.sizes is not None and item.offsets is not None
                    expected = math.prod(item.sizes) * itemsize
                    covered += math.prod(item.sizes)
                    if item.nbytes != expected:
                        problems.append(
                            f"BAD SIZE {item.describe()}: {item.nbytes} bytes stored, "
                            f"{expected} expected"
                        )
                    items.append(item)
                if covered != math.prod(entry.size):
                    problems.append(
                        f"INCOMPLETE key {fqn!r}: the chunks cover {covered} of "
                        f"{math.prod(entry.size)} elements"
                    )
                continue
            blob = checkpoint.object_blob(fqn)
            if blob is not None:
                items.append(blob)
            else:
                json.loads(checkpoint.object_info(fqn)["text"])
        except CheckpointFormatError as err:
            problems.append(f"BAD INDEX key {fqn!r}: {err}")
        except json.JSONDecodeError as err:
            problems.append(f"BAD JSON key {fqn!r}: {err}")
    return problems, items


def _hash_ranges(
    checkpoint: _Checkpoint, name: str, items: list[_Stored], progress: Any
) -> list[str]:
    """The checksum of every item of one data file, reading the file in large sequential
    pieces (items are sorted by offset and lie inside the file)."""
    path = checkpoint.file_path(name)
    hashers = [xxhash.xxh3_64() for _ in items]
    # Spans of touching or overlapping items are read in one sweep each.
    spans: list[tuple[int, int, int, int]] = []  # begin, end, first item, last item + 1
    for index, item in enumerate(items):
        if spans and item.begin <= spans[-1][1]:
            begin, end, first, _ = spans[-1]
            spans[-1] = (begin, max(end, item.end), first, index + 1)
        else:
            spans.append((item.begin, item.end, index, index + 1))
    largest = max((end - begin for begin, end, _, _ in spans), default=0)
    buffer = memoryview(bytearray(min(_PIECE_BYTES, largest)))
    for begin, end, first, stop in spans:
        position = begin
        while position < end:
            count = min(len(buffer), end - position)
            got = checkpoint.storage.read_into(path, position, buffer[:count])
            if got != count:
                raise CheckpointDataError(
                    f"data file is truncated: read {got} of {count} bytes at offset {position}",
                    file=path,
                )
            piece_end = position + count
            while first < stop and items[first].end <= position:
                first += 1
            for index in range(first, stop):
                item = items[index]
                if item.begin >= piece_end:
                    break
                low, high = max(item.begin, position), min(item.end, piece_end)
                if low < high:
                    hashers[index].update(buffer[low - position : high - position])
            progress.update(count)
            position = piece_end
    return [str(hasher.hexdigest()) for hasher in hashers]


def _verify(checkpoint: _Checkpoint) -> tuple[list[str], int, int]:
    """Every problem found, the number of items checked and the bytes read."""
    problems, items = _structure_problems(checkpoint)
    by_file: dict[str, list[_Stored]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    total = sum(item.nbytes for item in items)
    bytes_read = 0
    with _progress(total, f"verifying {checkpoint.path}") as bar:
        for name, file_items in sorted(by_file.items()):
            file_items.sort(key=lambda item: (item.begin, item.end))
            size = checkpoint.file_size(name)
            keys = sorted({item.fqn for item in file_items})
            if size is None:
                problems.append(f"MISSING data file {name}: holds {_keys_text(keys)}")
                continue
            expected = max(item.end for item in file_items)
            readable = [item for item in file_items if item.end <= size]
            if size < expected:
                lost = sorted({item.fqn for item in file_items if item.end > size})
                problems.append(
                    f"TRUNCATED data file {name}: {size} bytes, the index needs {expected}; "
                    f"lost data of {_keys_text(lost)}"
                )
            elif size > expected:
                problems.append(
                    f"SIZE data file {name}: {size} bytes, {size - expected} more than the "
                    f"{expected} the index accounts for"
                )
            digests = _hash_ranges(checkpoint, name, readable, bar)
            bytes_read += sum(item.nbytes for item in readable)
            for item, digest in zip(readable, digests, strict=True):
                if digest != item.checksum:
                    problems.append(
                        f"CHECKSUM {item.describe()}: expected {item.checksum}, got {digest}"
                    )
    return problems, len(items), bytes_read


def run(args: argparse.Namespace) -> int:
    """Check every byte of checkpoint ``args.path``; exit code 1 when a problem is found."""
    checkpoint = _open_checkpoint(args.path)
    problems, count, bytes_read = _verify(checkpoint)
    for problem in problems:
        print(problem)
    entries = len(checkpoint.entries)
    if problems:
        found = _count(len(problems), "problem")
        print(f"{args.path}: {found} in {_count(entries, 'entry', 'entries')}")
        return EXIT_FAILED
    print(
        f"{args.path}: OK, {_count(entries, 'entry', 'entries')}, {count} chunks and blobs, "
        f"{_human_bytes(bytes_read)} checked"
    )
    return EXIT_OK
