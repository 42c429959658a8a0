"""``shardwise consolidate``: the tensors of a checkpoint in full, as the safetensors files of a
Hugging Face model directory (what ``from_pretrained`` loads).

The work is :mod:`shardwise.checkpoint.huggingface.consolidation`'s (what is written, and how);
this command takes its steps one by one so that a refused ``--prefix`` or ``--config`` is a
usage error (exit code 2) worded as the option, and prints the notes, the summary or
``--json`` once all is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from shardwise._progress import ByteBar, human_bytes
from shardwise.checkpoint.huggingface.consolidation import (
    Consolidation,
    read_config,
    selected_keys,
)
from shardwise.checkpoint.huggingface.directory import CONFIG_NAME
from shardwise.checkpoint.huggingface.files import normalized_prefix
from shardwise.checkpoint.storage import open_storage
from shardwise.cli._checkpoint import _open_checkpoint, check_url
from shardwise.cli._common import EXIT_OK, UsageError, _count, print_json
from shardwise.errors import CheckpointError

T = TypeVar("T")


def _as_usage(step: Callable[[], T]) -> T:
    """``step``, an option it refuses (a plain ``ValueError``) raised as a usage error."""
    try:
        return step()
    except CheckpointError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err


def run(args: argparse.Namespace) -> int:
    """Write the tensors of checkpoint ``args.path`` as safetensors into ``args.out``."""
    prefix = None if args.prefix is None else normalized_prefix(args.prefix)
    cast = None if args.dtype is None else getattr(torch, args.dtype)
    config = (
        None if args.config is None else _as_usage(lambda: read_config(args.config, "--config"))
    )
    check_url(args.out)
    with _open_checkpoint(args.path, args.storage_options) as checkpoint:
        reader = checkpoint.reader
        keys = _as_usage(lambda: selected_keys(reader, prefix, "--prefix"))
        consolidation = Consolidation(reader, keys, prefix, cast, args.max_shard_size)
        # A missing, linked or wrongly sized data file fails here, before OUT is touched.
        consolidation.check_files()
        storage = open_storage(args.out, args.storage_options)
        with ByteBar(consolidation.total, f"consolidating into {args.out}") as bar:
            result = consolidation.write(storage, config, bar)
    # Printed once all is written, so that a failure is reported in exactly one line.
    for note in result.notes:
        print(note, file=sys.stderr)
    if args.json:
        print_json(
            {
                "path": args.path,
                "out": args.out,
                "files": result.files,
                "config": result.config,
                "num_tensors": result.num_tensors,
                "bytes": result.nbytes,
            }
        )
        return EXIT_OK
    config_text = f" and {CONFIG_NAME}" if result.config is not None else ""
    print(
        f"wrote {_count(result.num_tensors, 'tensor')} ({human_bytes(result.nbytes)}) to "
        f"{_count(len(result.files), 'file')}{config_text} in {args.out}"
    )
    return EXIT_OK
