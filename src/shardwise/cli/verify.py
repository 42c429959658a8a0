"""``shardwise verify``: :func:`shardwise.checkpoint.verify` (every byte of a checkpoint read, every
block checksum, data file and safetensors header checked against the index), printed."""

from __future__ import annotations

import argparse
import sys

from shardwise._progress import human_bytes
from shardwise.checkpoint.loading.verify import verify
from shardwise.cli._checkpoint import check_url
from shardwise.cli._common import EXIT_FAILED, EXIT_OK, _count, print_json


def run(args: argparse.Namespace) -> int:
    """Check every byte of checkpoint ``args.path``; exit code 1 when a problem is found."""
    check_url(args.path)
    on_terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
    report = verify(args.path, storage_options=args.storage_options, progress=on_terminal)
    entries = _count(report.num_entries, "entry", "entries")
    if args.json:
        print_json(
            {
                "path": args.path,
                "ok": report.ok,
                "problems": [problem.to_json() for problem in report.problems],
                "num_problems": len(report.problems),
                "num_entries": report.num_entries,
                "num_chunks_and_blobs": report.num_chunks_and_blobs,
                "bytes_checked": report.bytes_checked,
            }
        )
        return EXIT_OK if report.ok else EXIT_FAILED
    for problem in report.problems:
        print(problem.line())
    if not report.ok:
        print(f"{args.path}: {_count(len(report.problems), 'problem')} in {entries}")
        return EXIT_FAILED
    print(
        f"{args.path}: OK, {entries}, {report.num_chunks_and_blobs} chunks and blobs, "
        f"{human_bytes(report.bytes_checked)} checked"
    )
    return EXIT_OK
