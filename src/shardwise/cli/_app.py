"""The ``shardwise`` argument parser, the dispatch to the commands and their exit codes.

Nothing here imports torch or the checkpoint code: a command's module is imported only when
that command runs, so ``shardwise --help`` (and every ``shardwise COMMAND --help``) answers
without the seconds torch takes to import.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from shardwise import __version__
from shardwise._sizes import parse_size as parse_size  # re-exported by shardwise.cli
from shardwise.cli._common import (
    EXIT_INPUT,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    UsageError,
    parse_storage_options,
)
from shardwise.errors import CheckpointError, CheckpointStorageError

# Hugging Face's default shard size for save_pretrained.
_DEFAULT_MAX_SHARD_SIZE = "5GB"

# The module (in shardwise.cli) that runs each command, imported only when it runs.
_HANDLERS = {
    "inspect": "inspect",
    "verify": "verify",
    "diff": "diff",
    "consolidate": "consolidate",
    "convert-dcp": "convert_dcp",
    "ls": "ls",
    "materialize": "materialize",
}
# --dtype choices (names of torch dtypes; kept here as text so that --help needs no torch).
_DTYPES = ("bfloat16", "float16", "float32")
# The packages whose exceptions are failures of the storage, not bugs of shardwise: the user
# sees one line for them (what failed, and the exception's type), never a traceback.
_STORAGE_LIBRARIES = frozenset(
    {
        "adlfs",
        "aiobotocore",
        "aiohttp",
        "boto3",
        "botocore",
        "fsspec",
        "gcsfs",
        "requests",
        "s3fs",
        "urllib3",
    }
)
# The exit code of each exception type a command may end with (docs/cli.md, *Exit codes*): the
# first type of an exception's MRO found here decides. An exception of a storage library is
# a storage failure too (exit_code); any other exception is a bug of shardwise.
_EXIT_CODES: dict[type[BaseException], int] = {
    UsageError: EXIT_USAGE,
    CheckpointStorageError: EXIT_STORAGE,
    CheckpointError: EXIT_INPUT,  # not found, malformed, corrupt, a DCP directory refused
    OSError: EXIT_STORAGE,  # the file system failed (permission, a full disk)
}
_EXIT_CODES_TEXT = (
    "Exit codes: 0 success, 1 verification or comparison failed, 2 bad usage, 3 invalid or "
    "corrupt input, 4 storage failure."
)


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


def _storage_options_argument(text: str) -> dict[str, Any]:
    try:
        return parse_storage_options(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _with_storage_options(parser: argparse.ArgumentParser, applies_to: str) -> None:
    parser.add_argument(
        "--storage-options",
        type=_storage_options_argument,
        default=None,
        metavar="JSON",
        help=f"fsspec storage options for {applies_to}, as a JSON object, e.g. "
        """'{"endpoint_url": "http://127.0.0.1:9000", "anon": false}'""",
    )


def _with_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as one JSON object")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Inspect, verify, compare, consolidate and convert shardwise checkpoints, "
        "and list a series of them.",
        epilog=_EXIT_CODES_TEXT,
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub = commands.add_parser("inspect", help="list the entries of a checkpoint")
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    _with_json(sub, "the summary")
    _with_storage_options(sub, "PATH")

    sub = commands.add_parser("verify", help="read all data and check every checksum")
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    _with_json(sub, "the problems and counts")
    _with_storage_options(sub, "PATH")

    sub = commands.add_parser("diff", help="compare two checkpoints")
    sub.add_argument("a", help="first checkpoint")
    sub.add_argument("b", help="second checkpoint")
    sub.add_argument(
        "--atol", type=_tolerance_argument, default=0.0, help="absolute tolerance (default 0)"
    )
    sub.add_argument(
        "--rtol", type=_tolerance_argument, default=0.0, help="relative tolerance (default 0)"
    )
    _with_json(sub, "the differences")
    _with_storage_options(sub, "both checkpoints")

    sub = commands.add_parser(
        "consolidate",
        help="write the tensors in full to Hugging Face style safetensors (from_pretrained)",
    )
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    sub.add_argument("out", help="output directory or fsspec URL")
    sub.add_argument(
        "--prefix",
        metavar="P",
        help="write only the keys under P, without it: --prefix model. turns a training "
        "checkpoint's model.lm_head.weight into lm_head.weight",
    )
    sub.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="cast floating-point tensors to this dtype (others are written as saved)",
    )
    sub.add_argument(
        "--config", metavar="FILE", help="a JSON model config to copy to OUT/config.json"
    )
    sub.add_argument(
        "--max-shard-size",
        type=_size_argument,
        default=parse_size(_DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help="split into several files above this size: 500MB, 2GB, 1GiB or bytes "
        f"(default {_DEFAULT_MAX_SHARD_SIZE})",
    )
    _with_json(sub, "what was written")
    _with_storage_options(sub, "PATH and OUT")

    sub = commands.add_parser(
        "convert-dcp", help="convert a torch.distributed.checkpoint directory (no pickled code)"
    )
    sub.add_argument(
        "dcp_dir", help="DCP checkpoint directory or fsspec URL (.metadata + .distcp files)"
    )
    sub.add_argument("out", help="output shardwise checkpoint directory or URL")
    _with_json(sub, "what was written")
    _with_storage_options(sub, "DCP_DIR and OUT")

    sub = commands.add_parser(
        "materialize",
        help="copy a checkpoint into a self-contained one (an incremental one reads files of "
        "earlier checkpoints of its series)",
    )
    sub.add_argument("path", help="checkpoint directory or fsspec URL")
    sub.add_argument("out", help="new checkpoint directory or URL (must not hold a checkpoint)")
    _with_json(sub, "what was written")
    _with_storage_options(sub, "PATH and OUT")

    sub = commands.add_parser(
        "ls", help="list the checkpoints of a series (a CheckpointManager's root)"
    )
    sub.add_argument("root", help="the series' root directory or fsspec URL")
    _with_json(sub, "the listing")
    _with_storage_options(sub, "ROOT")
    return parser


def _from_storage_library(err: BaseException) -> bool:
    """Whether ``err`` is a storage library's: its type (or a base of it) is defined by one,
    or a built-in error raised inside one, e.g. the ``TypeError`` s3fs raises for an unknown
    storage option."""
    for cls in type(err).__mro__:
        if cls.__module__.partition(".")[0] in _STORAGE_LIBRARIES:
            return True
    if not isinstance(err, (TypeError, ValueError, AttributeError, KeyError)):
        return False
    traceback = err.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    module = str(traceback.tb_frame.f_globals.get("__name__", ""))
    return module.partition(".")[0] in _STORAGE_LIBRARIES


def _foreign_storage_error(err: BaseException) -> bool:
    """Whether ``err`` is a storage library's own (not one shardwise raised about it)."""
    return not isinstance(err, (UsageError, CheckpointError)) and _from_storage_library(err)


def exit_code(err: BaseException) -> int | None:
    """The exit code a command that raised ``err`` ends with (2 usage, 3 invalid input, 4
    storage failure), or None for a bug of shardwise (its traceback is kept)."""
    if _foreign_storage_error(err):
        return EXIT_STORAGE
    return next((_EXIT_CODES[cls] for cls in type(err).__mro__ if cls in _EXIT_CODES), None)


def _error_line(command: str, message: str) -> None:
    # One line, whatever a message quotes from the input.
    print(f"shardwise {command}: error: {' '.join(message.splitlines())}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardwise`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 verification or comparison failed, 2 bad usage, 3
        invalid or corrupt input, 4 storage failure (2 to 4: one line on stderr, no
        traceback).
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits on --help, --version and usage errors; report its code instead.
        code = exit_.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    try:
        module = importlib.import_module(f"shardwise.cli.{_HANDLERS[args.command]}")
        handler: Callable[[argparse.Namespace], int] = module.run
        return handler(args)
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout left (`shardwise inspect CKPT | head`): stop quietly, and keep
        # the interpreter's last flush of stdout from failing again.
        with contextlib.suppress(OSError, ValueError):  # stdout without a descriptor
            stdout = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stdout)
            os.close(devnull)
        return 141  # as a shell reports a process ended by SIGPIPE
    except Exception as err:  # sorted by exit_code: anything else is re-raised
        code = exit_code(err)
        if code is None:
            raise  # a bug: its traceback is what helps
        if _foreign_storage_error(err):
            _error_line(args.command, f"{str(err) or 'failed'} ({type(err).__name__})")
        else:
            _error_line(args.command, str(err))
        return code
