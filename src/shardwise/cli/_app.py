"""The ``shardwise`` argument parser, the dispatch to the commands and their exit codes."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence

from shardwise import __version__
from shardwise.checkpoint import CheckpointError
from shardwise.cli import consolidate, convert_dcp, diff, inspect, verify
from shardwise.cli._common import EXIT_ERROR, EXIT_OK

# Hugging Face's default shard size for save_pretrained.
_DEFAULT_MAX_SHARD_SIZE = "5GB"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """A byte count from ``"500MB"``, ``"2GB"``, ``"1GiB"``, ``"1.5GB"`` or ``"1048576"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000 as in Hugging Face; KiB, MiB, GiB, TiB
    are powers of 1024. Case does not matter.

    Raises:
        ValueError: Not a positive size with a known unit.
    """
    match = _SIZE_PATTERN.fullmatch(text)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(
            f"invalid size {text!r}: use a number of bytes or a number with a unit "
            f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 500MB or 1GiB"
        )
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: it must be positive")
    return size


def _size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _tolerance_argument(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"invalid tolerance {text!r}: use a number >= 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Inspect, verify, compare, consolidate and convert shardwise checkpoints.",
        epilog="Exit codes: 0 success, 1 verification or comparison failed, 2 bad usage or "
        "unreadable input.",
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub = commands.add_parser("inspect", help="list the entries of a checkpoint")
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    sub.add_argument("--json", action="store_true", help="print a JSON summary")
    sub.set_defaults(handler=inspect.run)

    sub = commands.add_parser("verify", help="read all data and check every checksum")
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    sub.set_defaults(handler=verify.run)

    sub = commands.add_parser("diff", help="compare two checkpoints")
    sub.add_argument("a", help="first checkpoint")
    sub.add_argument("b", help="second checkpoint")
    sub.add_argument(
        "--atol", type=_tolerance_argument, default=0.0, help="absolute tolerance (default 0)"
    )
    sub.add_argument(
        "--rtol", type=_tolerance_argument, default=0.0, help="relative tolerance (default 0)"
    )
    sub.set_defaults(handler=diff.run)

    sub = commands.add_parser(
        "consolidate", help="write every tensor in full to Hugging Face style safetensors"
    )
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    sub.add_argument("out", help="output directory")
    sub.add_argument(
        "--max-shard-size",
        type=_size_argument,
        default=parse_size(_DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help="split into several files above this size: 500MB, 2GB, 1GiB or bytes "
        f"(default {_DEFAULT_MAX_SHARD_SIZE})",
    )
    sub.set_defaults(handler=consolidate.run)

    sub = commands.add_parser(
        "convert-dcp", help="convert a torch.distributed.checkpoint directory (no pickled code)"
    )
    sub.add_argument("dcp_dir", help="DCP checkpoint directory (.metadata + .distcp files)")
    sub.add_argument("out", help="output shardwise checkpoint directory or URL")
    sub.set_defaults(handler=convert_dcp.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardwise`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 verification or comparison failed, 2 bad usage or
        unreadable input.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits on --help, --version and usage errors; report its code instead.
        code = exit_.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_ERROR)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (CheckpointError, OSError) as err:
        # One line, whatever a message quotes from the input.
        message = " ".join(str(err).splitlines())
        print(f"shardwise {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
