"""``shardwise materialize``: a self-contained copy of a checkpoint (an incremental one reads
files of earlier checkpoints of its series; its copy holds every byte it needs), every byte
verified as it is copied (:mod:`shardwise.checkpoint.manager.materialize`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from shardwise._progress import ByteBar, human_bytes
from shardwise.checkpoint.index import Index
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.manager.materialize import materialize
from shardwise.cli._checkpoint import check_url
from shardwise.cli._common import EXIT_OK, _count, print_json


def _stored(index: Index) -> Iterator[int]:
    """The bytes of every stored entry of ``index`` (tensor chunks, blobs)."""
    for fqn, record in index.tensors.items():
        if fqn not in index.aliases:
            yield from (chunk.nbytes for chunk in record.chunks)
    yield from (item.blob.nbytes for item in index.objects.values() if item.blob is not None)


def run(args: argparse.Namespace) -> int:
    """Copy ``args.path`` into a self-contained checkpoint at ``args.out``."""
    check_url(args.path)
    check_url(args.out)
    with CheckpointReader.open(args.path, args.storage_options) as reader:
        total = sum(_stored(reader.index))
    bar = ByteBar(total, f"materializing {args.path}")
    try:
        materialize(args.path, args.out, storage_options=args.storage_options, progress=bar.update)
    finally:
        bar.close()
    with CheckpointReader.open(args.out, args.storage_options) as reader:  # the copy, read back
        index = reader.index
    nbytes = sum(_stored(index))
    num_tensors = len(index.tensors) - len(index.aliases)
    if args.json:
        print_json(
            {
                "path": args.path,
                "out": args.out,
                "num_tensors": num_tensors,
                "num_objects": len(index.objects),
                "num_files": len(index.files),
                "bytes": nbytes,
            }
        )
        return EXIT_OK
    print(
        f"wrote {_count(num_tensors, 'tensor')} "
        f"({human_bytes(nbytes)}) and {_count(len(index.objects), 'object')} to {args.out} "
        f"in {_count(len(index.files), 'data file')}: it reads no other checkpoint"
    )
    return EXIT_OK
