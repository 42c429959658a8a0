"""``shardwise inspect``: what a checkpoint holds, and how it was saved."""

from __future__ import annotations

import argparse
import math
from typing import Any

from shardwise._progress import human_bytes
from shardwise.checkpoint.index import TensorRecord
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint
from shardwise.cli._common import EXIT_OK, _count, _printable, print_json
from shardwise.metadata import dtype_name

# How many ties the text summary names before it says "and N more".
_MAX_TIES = 5


def _entry_rows(checkpoint: _Checkpoint) -> list[dict[str, Any]]:
    rows = []
    for fqn, entry in checkpoint.entries.items():
        kind = checkpoint.kind(fqn)
        if isinstance(entry, TensorRecord):
            rows.append(
                {
                    "key": fqn,
                    "kind": kind,
                    "dtype": dtype_name(entry.dtype),
                    "size": list(entry.size),
                    "num_chunks": len(entry.chunks),
                    "bytes": math.prod(entry.size) * entry.dtype.itemsize,
                    "tied_to": checkpoint.aliases.get(fqn),
                }
            )
            continue
        nbytes = len((entry.text or "").encode()) if entry.blob is None else entry.blob.nbytes
        rows.append(
            {"key": fqn, "kind": kind, "dtype": None, "size": None, "num_chunks": None,
             "bytes": nbytes, "tied_to": None}
        )  # fmt: skip
    return rows


def _inspect_summary(checkpoint: _Checkpoint) -> dict[str, Any]:
    rows = _entry_rows(checkpoint)
    facts = checkpoint.save_facts()
    tensors = [row for row in rows if row["kind"] == "tensor"]
    objects = [row for row in rows if row["kind"] != "tensor"]
    # A tied tensor's bytes and chunks are its target's: counted once, under the target.
    stored = [row for row in tensors if row["tied_to"] is None]
    return {
        "path": checkpoint.path,
        "format_version": checkpoint.index.format_version,
        "writer": facts["writer"],
        "torch_version": facts["torch"],
        "world_size": facts["world_size"],
        "checksum_algorithm": facts["checksum_algorithm"],
        "block_size": facts["block_size"],
        "save_id": facts["save_id"],
        "num_tensors": len(tensors),
        "num_tied": len(tensors) - len(stored),
        "num_objects": len(objects),
        "tensor_bytes": sum(row["bytes"] for row in stored),
        "object_bytes": sum(row["bytes"] for row in objects),
        "num_chunks": sum(row["num_chunks"] for row in stored),
        "num_files": len(checkpoint.index.files),
        # An incremental checkpoint's data files of earlier checkpoints (../<name>/data/...).
        "referenced_files": checkpoint.index.references,
        "entries": rows,
    }


def _print_table(rows: list[list[str]], right_aligned: set[int]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(width) if column in right_aligned else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def run(args: argparse.Namespace) -> int:
    """Print the entries of checkpoint ``args.path`` (a table, or JSON with ``--json``).

    Only the index is read; every data file is opened (not read) to check that it is a
    regular file inside the checkpoint with the size the index declares.
    """
    with _open_checkpoint(args.path, args.storage_options) as checkpoint:
        checkpoint.check_files(checkpoint.entries)
        summary = _inspect_summary(checkpoint)
    if args.json:
        print_json(summary, indent=2)
        return EXIT_OK
    header = ["key", "kind", "dtype", "size", "chunks", "bytes"]
    table = [header]
    for row in summary["entries"]:
        table.append(
            [
                _printable(row["key"]),
                row["kind"],
                row["dtype"] or "-",
                "-" if row["size"] is None else str(row["size"]),
                "-" if row["num_chunks"] is None else str(row["num_chunks"]),
                human_bytes(row["bytes"]),
            ]
        )
    _print_table(table, right_aligned={4, 5})
    print()
    tied = f"; {summary['num_tied']} tied to another" if summary["num_tied"] else ""
    print(
        f"{_count(summary['num_tensors'], 'tensor')} "
        f"({human_bytes(summary['tensor_bytes'])} in {_count(summary['num_chunks'], 'chunk')}"
        f"{tied}), "
        f"{_count(summary['num_objects'], 'object')} ({human_bytes(summary['object_bytes'])}), "
        f"{_count(summary['num_files'], 'data file')}"
    )
    ties = [(row["key"], row["tied_to"]) for row in summary["entries"] if row["tied_to"]]
    if ties:
        shown_ties = ", ".join(
            f"{_printable(alias)} = {_printable(target)}" for alias, target in ties[:_MAX_TIES]
        )
        more = f" and {len(ties) - _MAX_TIES} more" if len(ties) > _MAX_TIES else ""
        print(f"tied (saved once): {shown_ties}{more}")

    referenced = summary["referenced_files"]
    if referenced:
        owners = sorted({name.split("/")[1] for name in referenced})
        print(
            f"incremental (index version {summary['format_version']}): reads "
            f"{_count(len(referenced), 'data file')} of {_count(len(owners), 'earlier checkpoint')}"
            f" ({', '.join(_printable(owner) for owner in owners[:_MAX_TIES])}"
            f"{' ...' if len(owners) > _MAX_TIES else ''}) beside it"
        )

    def shown(name: str) -> str:
        return _printable(str(summary[name]))

    print(
        f"saved by {shown('writer')} with torch {shown('torch_version')}, world size "
        f"{shown('world_size')}, checksums {summary['checksum_algorithm']}, save id "
        f"{shown('save_id')}"
    )
    return EXIT_OK
