"""``shardwise ls``: the checkpoints of a series that a ``CheckpointManager`` writes under ROOT."""

from __future__ import annotations

import argparse
import time
from typing import Any

from shardwise._progress import human_bytes
from shardwise.checkpoint.manager.policy import RetentionPolicy, retained
from shardwise.checkpoint.manager.series import (
    CheckpointInfo,
    References,
    checkpoint_bytes,
    list_series,
    open_series,
    references_of,
    step_name,
)
from shardwise.cli._common import EXIT_OK, _printable, print_json
from shardwise.errors import CheckpointNotFoundError


def _state(info: CheckpointInfo, read: set[str]) -> str:
    """``read``: the step directories whose data files committed checkpoints reference."""
    if not info.committed:
        return "retired" if step_name(info.step) in read else "uncommitted"
    return "rejected" if info.rejected is not None else "committed"


def _shared_bytes(found: References | None) -> int | None:
    """The sizes an index declares for the data files of other checkpoints it reads; None
    when it does not decode and names some (their sizes are not known then)."""
    if found is None:
        return 0
    sizes = list(found.files.values())
    return None if None in sizes else sum(size or 0 for size in sizes)


def _newest_policy(listing: list[CheckpointInfo]) -> RetentionPolicy | None:
    """The retention policy recorded by the newest step record that has one."""
    return next((info.retention for info in reversed(listing) if info.retention), None)


def _summary(root: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    storage = open_series(root, storage_options)
    if not storage.exists(storage.root):
        raise CheckpointNotFoundError(f"no series at {root}: it does not exist")
    listing = list_series(storage)
    policy = _newest_policy(listing)
    good = {info.step: info.metrics for info in listing if info.good}
    kept = set(good) if policy is None else retained(policy, good)
    references = {
        info.step: references_of(storage, info.step) for info in listing if info.committed
    }
    read = {owner for found in references.values() for owner, _ in found.files}
    checkpoints = [
        {
            "step": info.step,
            "path": info.path,
            "state": _state(info, read),
            "bytes": checkpoint_bytes(storage, info.step),
            # Bytes of other checkpoints' data files it reads (an incremental checkpoint).
            "shared_bytes": _shared_bytes(references.get(info.step)),
            "time": info.time,
            "metrics": info.metrics,
            # Only a good checkpoint is the policy's to keep; the others are never chosen.
            "kept": (info.step in kept) if info.good else None,
            "rejected": info.rejected,
        }
        for info in listing
    ]
    retention = None if policy is None else policy.to_json()
    return {"root": root, "retention": retention, "checkpoints": checkpoints}


def _number(value: float | int | None) -> str:
    """A metric as text: 6 significant digits; ``nan`` for a non-finite one (stored as null)."""
    if value is None:
        return "nan"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _when(saved: float | None) -> str:
    """A save's start time in UTC; empty when unknown or beyond what the platform shows."""
    if saved is None:
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(saved))
    except (OverflowError, OSError, ValueError):  # a step record may hold any finite number
        return ""


def _text(summary: dict[str, Any]) -> str:
    rows = summary["checkpoints"]
    if not rows:
        return f"no checkpoints under {summary['root']}"
    table = [("step", "state", "own", "shared", "saved (UTC)", "kept", "metrics")]
    for row in rows:
        when = _when(row["time"])
        metrics = " ".join(
            f"{_printable(name)}={_number(value)}" for name, value in row["metrics"].items()
        )
        kept = {True: "yes", False: "no", None: ""}[row["kept"]]
        nbytes = row["shared_bytes"]
        shared = "?" if nbytes is None else human_bytes(nbytes) if nbytes else "-"
        table.append(
            (
                str(row["step"]),
                row["state"],
                human_bytes(row["bytes"]),
                shared,
                when,
                kept,
                metrics,
            )
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False))
        + "  "
        + line[-1]
        for line in table
    ]
    lines = [line.rstrip() for line in lines]
    lines += [
        f"step {row['step']} rejected: {_printable(row['rejected'])}"
        for row in rows
        if row["rejected"] is not None
    ]
    policy = summary["retention"]
    if policy is not None:
        if policy["keep_best"] is None:
            policy = {name: value for name, value in policy.items() if name != "best_mode"}
        rules = ", ".join(f"{name}={value}" for name, value in policy.items() if value is not None)
        rules = rules or "keep all"
        lines.append(f"retention (from the newest step record): {rules}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``shardwise ls ROOT [--json]``: one row per step directory, oldest first."""
    summary = _summary(args.root, args.storage_options)
    if args.json:
        print_json(summary)
    else:
        print(_text(summary))
    return EXIT_OK
