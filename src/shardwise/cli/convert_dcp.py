"""``shardwise convert-dcp``: a ``torch.distributed.checkpoint`` directory into a shardwise
checkpoint, without running pickled code (the reading is :mod:`shardwise.checkpoint.dcp_import`).
Both may be fsspec URLs: the reading and the writing go through the storage layer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardwise._progress import count_bar
from shardwise.checkpoint import save
from shardwise.checkpoint.dcp_import import DCPImportError, DCPReader
from shardwise.cli._checkpoint import check_url
from shardwise.cli._common import EXIT_OK, _count, print_json


def run(args: argparse.Namespace) -> int:
    """Convert ``args.dcp_dir`` into a shardwise checkpoint at ``args.out``.

    Raises:
        DCPImportError: The DCP directory is malformed, cannot be read without running pickled
            code, or holds a state dict shardwise cannot save.
    """
    directory = args.dcp_dir
    check_url(directory)
    check_url(args.out)
    reader = DCPReader(directory, storage_options=args.storage_options)
    state_dict: dict[str, Any] = {}
    num_tensors = 0
    with count_bar(len(reader.keys), f"reading {directory}", unit="key") as bar:
        for fqn in reader.keys:
            state_dict[fqn] = reader.read(fqn)
            if reader.is_tensor(fqn):
                num_tensors += 1
            bar.update(1)
    try:
        save(
            state_dict,
            args.out,
            storage_options=args.storage_options,
            progress=sys.stderr.isatty(),
        )
    except (TypeError, ValueError) as err:
        # save's user errors here come from the DCP input, e.g. keys that DCP kept apart and
        # that collide once the dict values are flattened into dotted keys.
        raise DCPImportError(f"cannot convert {directory}: {err}") from err
    if args.json:
        print_json(
            {
                "dcp_dir": directory,
                "out": args.out,
                "num_tensors": num_tensors,
                "num_objects": len(state_dict) - num_tensors,
            }
        )
        return EXIT_OK
    print(
        f"converted {_count(num_tensors, 'tensor')} and "
        f"{_count(len(state_dict) - num_tensors, 'object')} from {directory} to {args.out}"
    )
    return EXIT_OK
