"""The files of a Hugging Face model directory, pure: their names, how tensors are split
into them (``save_pretrained``'s ``max_shard_size`` rule), and ``model.safetensors.index.json``
written and read (``docs/huggingface.md``). ``shardwise consolidate`` and
:func:`~shardwise.checkpoint.save_safetensors` write by these rules; the loader reads by them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from shardwise._codec import strict_json
from shardwise.checkpoint.index.data_file import MAX_HEADER_BYTES
from shardwise.checkpoint.index.names import PORTABLE_RULE, is_portable_name
from shardwise.errors import CheckpointFormatError, CheckpointKeyError, CheckpointMismatchError

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "WEIGHT_INDEX_NAME",
    "LEFTOVER_NAME",
    "MAX_INDEX_JSON_BYTES",
    "METADATA",
    "METADATA_KEY",
    "OUTPUT_NAME",
    "SINGLE_NAME",
    "OutTensor",
    "check_header_size",
    "check_unique_names",
    "file_names",
    "index_json",
    "is_unicode_text",
    "is_weight_file_name",
    "normalized_prefix",
    "parse_index_json",
    "split_files",
    "written_dtype",
]

#: The one weight file of an unsplit model, as ``save_pretrained`` names it.
SINGLE_NAME = "model.safetensors"
#: The index of a split model: which file holds each tensor.
WEIGHT_INDEX_NAME = "model.safetensors.index.json"
#: The names a writer of this module makes (a later write removes those it did not make).
#: (Matched whole, digits as ``[0-9]``: ``\d`` takes Unicode digits, names no writer makes.)
OUTPUT_NAME = re.compile(r"model(-[0-9]{5}-of-[0-9]{5})?\.safetensors(\.index\.json)?")
#: The temporary names those writers write under (``save_safetensors``: a token of 16 hex
#: digits; ``shardwise consolidate``: a process id; the index written aside: process and
#: thread ids): what a killed write leaves, which a later write removes.
LEFTOVER_NAME = re.compile(
    r"\.(model(-[0-9]{5}-of-[0-9]{5})?\.safetensors(\.index\.json)?|config\.json)"
    r"\.([0-9a-f]{16}|[0-9]+)\.tmp"
    r"|model\.safetensors\.index\.json\.[0-9]+\.[0-9]+\.tmp"
)
#: The header metadata transformers writes and requires ("pt": PyTorch tensors).
METADATA = {"format": "pt"}
#: The header's key of that metadata: no tensor may have this name.
METADATA_KEY = "__metadata__"
#: The most bytes of tensors per file unless told otherwise (``shardwise consolidate``'s 5GB).
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
#: The largest index a reader accepts (one of a model of thousands of tensors is a few MiB).
MAX_INDEX_JSON_BYTES = 64 << 20
_WEIGHT_SUFFIX = ".safetensors"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor to write.

    Attributes:
        name: Its name in the output (the state dict's key, prefix stripped, key map applied).
        source: The key whose data it is.
        dtype: The dtype written (the cast applied).
        shape: Its shape.
        nbytes: The bytes written.
    """

    name: str
    source: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def written_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is written in: ``cast`` applies to floating point only."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def check_unique_names(tensors: Sequence[OutTensor], source: str) -> None:
    """Refuse two tensors of one name (the names of a safetensors file are unique): keys of
    ``source`` (``"the checkpoint"``, ``"the state dict"``) that differ only in the int-ness
    of a part (``{0: x}`` and ``{"0": y}``), or that a key map gives one name; and a tensor
    named :data:`METADATA_KEY`, the header's metadata (no reader accepts such a file).

    Raises:
        CheckpointKeyError: Naming the name.
    """
    names: set[str] = set()
    for tensor in tensors:
        if tensor.name == METADATA_KEY:
            raise CheckpointKeyError(
                f"a tensor of {source} would be written as {METADATA_KEY!r}, the name "
                "safetensors reserves for the header's metadata: rename it (prefix, key_map)",
                key=tensor.source,
            )
        if tensor.name in names:
            raise CheckpointKeyError(
                f"two tensors of {source} would both be written as {tensor.name!r} "
                "(keys that differ only in an int part and a str part, as {0: x} and "
                '{"0": y}, or that a key map names alike), and the names of a safetensors '
                "file are unique"
            )
        names.add(tensor.name)


def check_header_size(header: bytes, file: str, first: str) -> None:
    """Refuse to write weight file ``file`` with ``header`` (its length prefix included) when
    the header is over the :data:`MAX_HEADER_BYTES` safetensors reads: no reader (this
    module's included) would accept the file. ``first``: the key of its first tensor.

    Raises:
        CheckpointMismatchError: Naming ``first``.
    """
    length = len(header) - 8
    if length > MAX_HEADER_BYTES:
        raise CheckpointMismatchError(
            f"the header of {file} would take {length} bytes, more than the "
            f"{MAX_HEADER_BYTES} bytes safetensors reads (too many tensors for one file): "
            "give a smaller max_shard_size",
            key=first,
        )


def normalized_prefix(prefix: str) -> str:
    """A key prefix as whole key parts: ``model`` and ``model.`` both mean ``model.``; the
    empty prefix is every key, as it is (not ``"."``, under which no key is)."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def split_files(items: Sequence[T], nbytes: Callable[[T], int], max_bytes: int) -> list[list[T]]:
    """Group ``items``, in order, into files of at most ``max_bytes`` each, by Hugging Face's
    rule: an item larger than the limit is put in a file of its own right away, while the
    file being filled stays open for the items after it. Never empty (``[[]]`` for none)."""
    files: list[list[T]] = []
    current: list[T] = []
    current_bytes = 0
    for item in items:
        size = nbytes(item)
        if size > max_bytes:
            files.append([item])
            continue
        if current_bytes + size > max_bytes:
            files.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += size
    if current:
        files.append(current)
    return files or [[]]


def file_names(num_files: int) -> list[str]:
    """The names of ``num_files`` weight files: ``model.safetensors`` alone, else
    ``model-00001-of-0000N.safetensors`` and so on."""
    if num_files == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]


def index_json(weight_map: dict[str, str], total_size: int) -> bytes:
    """The text of ``model.safetensors.index.json``: ``total_size`` (bytes of tensor data)
    and, by tensor name in sorted order, the file that holds it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form: no lone surrogate (which a JSON ``\\ud800`` escape
    or a caller's string may hold), so a safetensors file can name it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_weight_file_name(name: str) -> bool:
    """Whether an index may name ``name`` as a weight file: a portable file name of this
    directory (``index.names.is_portable_name``: ASCII letters, digits, ``._-``, not hidden,
    at most 255) ending in ``.safetensors``, as ``model-00001-of-00004.safetensors``."""
    return name.endswith(_WEIGHT_SUFFIX) and is_portable_name(name)


def _refuse(message: str, file: str) -> CheckpointFormatError:
    return CheckpointFormatError(message, file=file)


def parse_index_json(data: bytes, file: str) -> dict[str, str]:
    """The ``weight_map`` of an index (``file``: its URL, for errors): tensor name -> weight
    file name, every name checked.

    Raises:
        CheckpointFormatError: Not a JSON object with a ``weight_map`` object of strings, a
            key repeated in an object (which of its values counts is the parser's choice), or
            a file name that is not a plain ``*.safetensors`` name of the directory.
    """
    if len(data) > MAX_INDEX_JSON_BYTES:
        raise _refuse(f"the index has more than {MAX_INDEX_JSON_BYTES} bytes", file)
    try:
        document: Any = strict_json(data, "the index")
    except ValueError as err:
        raise _refuse(str(err), file) from err
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise _refuse('the index must be a JSON object with a "weight_map" object', file)
    for name, value in weight_map.items():
        if not isinstance(value, str):
            raise CheckpointFormatError(
                f"the index maps this tensor to {value!r}, not a file name", key=name, file=file
            )
        if not is_weight_file_name(value):
            raise CheckpointFormatError(
                f"the index places this tensor in {value!r}, which is not a plain "
                f"*.safetensors name in the model directory ({PORTABLE_RULE}); refusing to "
                "open it",
                key=name,
                file=file,
            )
    return weight_map
