"""``shardwise inspect``: what a checkpoint holds, and how it was saved."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.checkpoint import TensorStorageMetadata
from shardwise.cli._common import (
    EXIT_OK,
    _Checkpoint,
    _count,
    _dtype_name,
    _human_bytes,
    _open_checkpoint,
    _stored,
)


def _entry_rows(checkpoint: _Checkpoint) -> list[dict[str, Any]]:
    rows = []
    for fqn, entry in checkpoint.entries.items():
        kind = checkpoint.kind(fqn)
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            itemsize = torch.empty((), dtype=dtype).element_size()
            rows.append(
                {
                    "key": fqn,
                    "kind": kind,
                    "dtype": _dtype_name(dtype),
                    "size": list(entry.size),
                    "num_chunks": len(entry.chunks),
                    "bytes": math.prod(entry.size) * itemsize,
                }
            )
            continue
        info = checkpoint.object_info(fqn)
        if kind == "json":
            nbytes = len(str(info.get("text", "")).encode())
        else:
            nbytes = _stored(fqn, info).nbytes
        rows.append(
            {"key": fqn, "kind": kind, "dtype": None, "size": None, "num_chunks": None,
             "bytes": nbytes}
        )  # fmt: skip
    return rows


def _inspect_summary(checkpoint: _Checkpoint) -> dict[str, Any]:
    rows = _entry_rows(checkpoint)
    planner_data = checkpoint.metadata.planner_data
    facts = dict(planner_data) if isinstance(planner_data, Mapping) else {}
    meta = checkpoint.metadata.storage_meta
    files: set[str] = set()
    for fqn in checkpoint.entries:
        if checkpoint.kind(fqn) == "tensor":
            files.update(item.file for item in checkpoint.chunks(fqn))
        elif (blob := checkpoint.object_blob(fqn)) is not None:
            files.add(blob.file)
    tensors = [row for row in rows if row["kind"] == "tensor"]
    objects = [row for row in rows if row["kind"] != "tensor"]
    return {
        "path": checkpoint.path,
        "format_version": 1,
        "writer": facts.get("writer"),
        "torch_version": facts.get("torch"),
        "world_size": facts.get("world_size"),
        "checksum_algorithm": facts.get("checksum_algorithm"),
        "save_id": None if meta is None else meta.save_id,
        "num_tensors": len(tensors),
        "num_objects": len(objects),
        "tensor_bytes": sum(row["bytes"] for row in tensors),
        "object_bytes": sum(row["bytes"] for row in objects),
        "num_chunks": sum(row["num_chunks"] for row in tensors),
        "num_files": len(files),
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
    """Print the entries of checkpoint ``args.path`` (a table, or JSON with ``--json``)."""
    summary = _inspect_summary(_open_checkpoint(args.path))
    if args.json:
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    header = ["key", "kind", "dtype", "size", "chunks", "bytes"]
    table = [header]
    for row in summary["entries"]:
        table.append(
            [
                row["key"],
                row["kind"],
                row["dtype"] or "-",
                "-" if row["size"] is None else str(row["size"]),
                "-" if row["num_chunks"] is None else str(row["num_chunks"]),
                _human_bytes(row["bytes"]),
            ]
        )
    _print_table(table, right_aligned={4, 5})
    print()
    print(
        f"{_count(summary['num_tensors'], 'tensor')} "
        f"({_human_bytes(summary['tensor_bytes'])} in {_count(summary['num_chunks'], 'chunk')}), "
        f"{_count(summary['num_objects'], 'object')} ({_human_bytes(summary['object_bytes'])}), "
        f"{_count(summary['num_files'], 'data file')}"
    )
    print(
        f"saved by {summary['writer']} with torch {summary['torch_version']}, world size "
        f"{summary['world_size']}, checksums {summary['checksum_algorithm']}, save id "
        f"{summary['save_id']}"
    )
    return EXIT_OK
