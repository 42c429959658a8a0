"""``load_safetensors``: fill any state dict from a Hugging Face model directory (or one
safetensors file), each rank reading only the bytes of its shards (``docs/huggingface.md``).

Rank 0 lists the directory, reads the index and every header (bounded) and broadcasts the raw
bytes; every rank checks them the same way (:mod:`.headers`), so all reach one verdict before
the next collective. Then each rank matches its keys (:mod:`.keys`), checks its targets and
plans its reads as a checkpoint load does (one chunk per tensor: a row band is one read, a
column band one read per row), agrees on missing and tied keys with the others, and fills its
tensors through the read pass of ``loading`` (no checksums: safetensors has none).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardwise import collectives
from shardwise.checkpoint.entries.items import LocalBox, is_tensor_value, storage_key
from shardwise.checkpoint.entries.state_dict import display_key, flatten
from shardwise.checkpoint.huggingface.files import (
    MAX_INDEX_JSON_BYTES,
    SINGLE_NAME,
    WEIGHT_INDEX_NAME,
    parse_index_json,
)
from shardwise.checkpoint.huggingface.headers import (
    LENGTH_BYTES,
    MAX_HEADERS_BYTES,
    Catalog,
    catalog,
    length_of,
)
from shardwise.checkpoint.huggingface.keys import KeyMap, Names, match
from shardwise.checkpoint.index import paused_gc
from shardwise.checkpoint.loading.data_files import SourceFiles
from shardwise.checkpoint.loading.fill import Job, fill
from shardwise.checkpoint.loading.index_file import quoted
from shardwise.checkpoint.loading.load import LoadResult, report_load
from shardwise.checkpoint.loading.targets import check_target, describe_target
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.report import exchange_with_bar, job_bar
from shardwise.checkpoint.storage import (
    Reader,
    Storage,
    UnsafePathError,
    open_shared_storage,
    run_concurrently,
)
from shardwise.errors import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["load_safetensors"]

logger = logging.getLogger("shardwise.checkpoint.load")  # the name users configure

_SUFFIX = ".safetensors"
_INDEX_SUFFIX = ".safetensors.index.json"
_SOURCE = "the safetensors file"


def _split(path: str) -> tuple[str, str | None]:
    """The directory of ``path`` and, when ``path`` names one weight file, its name (told by
    the name alone, so every rank reaches the same answer without a look)."""
    if not path.rstrip("/").endswith(_SUFFIX):
        return path, None
    root, slash, name = path.rstrip("/").rpartition("/")
    if not root:  # "m.safetensors": the working directory's; "/m.safetensors": the root's
        return slash or ".", name
    return root, name


class SafetensorsFiles(SourceFiles):
    """The weight files of one directory, of the sizes rank 0 found, for the read pass."""

    declared_by = "when its header was read it had"

    def __init__(self, storage: Storage, sizes: Mapping[str, int], rank: int | None) -> None:
        super().__init__(storage, rank)
        self.sizes = dict(sizes)

    def path(self, name: str) -> str:
        return self.storage.join(name)

    def open(self, name: str) -> Reader:
        # Names come from the index (checked plain names) or from the caller's own path.
        return self.storage.open_below(name)

    def declared_size(self, name: str) -> int:
        return self.sizes[name]


def _open(storage: Storage, name: str) -> Reader:
    """Weight file ``name`` of the directory, a regular file opened without following links."""
    shown = storage.url(storage.join(name))
    try:
        return storage.open_below(name)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError("weight file is missing", file=shown) from err
    except UnsafePathError as err:
        hint = _LINK_HINT if err.errno == errno.ELOOP else ""
        raise CheckpointDataError(
            f"weight file is not a regular file inside the directory: {err.strerror}; "
            f"refusing to read it{hint}",
            file=shown,
        ) from err
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot open weight file: {err}", file=shown) from err


# Why a link is met most: the Hugging Face cache's snapshots are links to blobs.
_LINK_HINT = (
    " (no link is followed out of the directory; for a Hugging Face cache snapshot, whose "
    "files link to blobs, download the files themselves, e.g. with "
    "huggingface_hub.snapshot_download(..., local_dir=DIR), and load DIR)"
)


def _read_exactly(reader: Reader, length: int, shown: str) -> bytes:
    data = bytearray(length)
    try:
        count = reader.read_into(0, memoryview(data))
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot read weight file: {err}", file=shown) from err
    if count != length:
        raise CheckpointDataError(
            f"weight file is truncated: read {count} of its first {length} bytes", file=shown
        )
    return bytes(data)


def _read_headers(storage: Storage, names: list[str]) -> list[list[Any]]:
    """``[name, size, text]`` of each weight file: its length prefix and header as text
    (surrogateescape carries any bytes through JSON), read in parallel and bounded: the
    lengths are checked, together, before any header is read."""
    readers: dict[str, Reader] = {}

    def open_one(name: str) -> tuple[int, int]:
        reader = readers[name] = _open(storage, name)
        shown = storage.url(storage.join(name))
        if reader.size < LENGTH_BYTES:
            return reader.size, length_of(b"", reader.size, shown)
        prefix = _read_exactly(reader, LENGTH_BYTES, shown)
        return reader.size, length_of(prefix, reader.size, shown)

    def read_one(name: str) -> bytes:
        shown = storage.url(storage.join(name))
        return _read_exactly(readers[name], LENGTH_BYTES + lengths[name][1], shown)

    try:
        found = run_concurrently(names, _always_threaded, open_one)
        lengths = dict(zip(names, found, strict=True))
        if sum(length for _, length in found) > MAX_HEADERS_BYTES:
            raise CheckpointFormatError(
                f"the headers of the weight files take more than {MAX_HEADERS_BYTES} bytes",
                file=storage.url(storage.root),
            )
        headers = run_concurrently(names, _always_threaded, read_one)
    finally:
        for reader in readers.values():
            reader.close()
    return [
        [name, lengths[name][0], data.decode("utf-8", "surrogateescape")]
        for name, data in zip(names, headers, strict=True)
    ]


def _always_threaded(_: str) -> int:
    return sys.maxsize


def _choose(storage: Storage, path: str) -> tuple[str | None, list[str]]:
    """The index of the directory (if any) and its weight files, told by the names in it:
    ``model.safetensors.index.json``, else ``model.safetensors``, else the only index, else
    the only weight file."""
    try:
        entries = sorted(storage.listdir(storage.root))
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointNotFoundError(
            f"cannot list {path}: {err.strerror or err}", file=path
        ) from err
    if WEIGHT_INDEX_NAME in entries:
        return WEIGHT_INDEX_NAME, []
    if SINGLE_NAME in entries:
        return None, [SINGLE_NAME]
    indexes = [entry for entry in entries if entry.endswith(_INDEX_SUFFIX)]
    weights = [entry for entry in entries if entry.endswith(_SUFFIX)]
    if len(indexes) == 1:
        return indexes[0], []
    if not indexes and len(weights) == 1:
        return None, weights
    if not indexes and not weights:
        what = f"it holds {quoted(entries)}" if entries else "it is empty or missing"
        raise CheckpointNotFoundError(
            f"no safetensors weights at {path}: {what}; give a Hugging Face model directory "
            f"(with {SINGLE_NAME} or {WEIGHT_INDEX_NAME}) or one *.safetensors file",
            file=path,
        )
    several = indexes or weights
    raise CheckpointNotFoundError(
        f"{path} holds several sets of weights ({quoted(several)}) and no {WEIGHT_INDEX_NAME} or "
        f"{SINGLE_NAME}: give the path of the one file to load",
        file=path,
    )


def _survey(storage: Storage, path: str, single: str | None) -> dict[str, Any]:
    """What rank 0 reads and broadcasts: the index text (if any) and every weight file's
    size and header, raw."""
    index: list[str] | None = None
    names = [single] if single is not None else []
    if single is None:
        index_name, names = _choose(storage, path)
        if index_name is not None:
            shown = storage.url(storage.join(index_name))
            try:
                data = storage.read_small(storage.join(index_name), MAX_INDEX_JSON_BYTES)
            except CheckpointStorageError:
                raise
            except FileNotFoundError as err:
                raise CheckpointNotFoundError("the index is missing", file=shown) from err
            except UnsafePathError as err:  # a link, a directory, a FIFO: not opened
                raise CheckpointDataError(
                    f"the index is not a regular file: {err.strerror or err}; refusing to read it",
                    file=shown,
                ) from err
            except OSError as err:  # larger than the limit, unreadable
                raise CheckpointFormatError(
                    f"cannot read the index: {err.strerror or err}", file=shown
                ) from err
            text = data.decode("utf-8", "surrogateescape")
            index = [index_name, text]
            names = sorted(set(parse_index_json(data, shown).values()))
    return {"index": index, "files": _read_headers(storage, names)}


def _decode_survey(storage: Storage, survey: Mapping[str, Any]) -> Catalog:
    """The checked tensors of the directory from rank 0's survey (the same on every rank)."""

    def shown(name: str) -> str:
        return storage.url(storage.join(name))

    weight_map = None
    if survey["index"] is not None:
        index_name, text = survey["index"]
        weight_map = parse_index_json(text.encode("utf-8", "surrogateescape"), shown(index_name))
    headers = {
        name: (text.encode("utf-8", "surrogateescape"), size)
        for name, size, text in survey["files"]
    }
    return catalog(headers, weight_map, shown)


@dataclass(slots=True)
class _WeightsLoadPlan:
    targets: list[LocalBox] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # display keys no file holds
    tied: list[str] = field(default_factory=list)  # of those, sharing a loaded key's memory
    untied: list[str] = field(default_factory=list)  # the others of which this rank has elements
    unexpected: list[str] = field(default_factory=list)


def _plan(
    state_dict: Mapping[str, Any],
    tensors: Catalog,
    names: Names,
    allow_dtype_cast: bool,
) -> _WeightsLoadPlan:
    """This rank's reads: every tensor of the state dict whose name the files hold, checked."""
    flat = flatten(state_dict)
    wanted: dict[str, str] = {}
    values: dict[str, torch.Tensor] = {}
    under_prefix = False
    for key, value in flat.leaves.items():
        if not is_tensor_value(value):
            continue  # safetensors files hold tensors only
        fqn = display_key(key)
        under_prefix = under_prefix or names.prefix is None or fqn.startswith(names.prefix)
        name = names.name_of(fqn)
        if name is not None:
            wanted[fqn] = name
            values[fqn] = value
    if names.prefix and not under_prefix:  # a typo would load nothing, and miss nothing
        raise CheckpointKeyError(
            f"no tensor of the state dict is under the prefix {names.prefix!r}: nothing to load"
        )
    matched = match(wanted, tensors.tensors)
    plan = _WeightsLoadPlan(absent=matched.absent, unexpected=matched.unexpected)
    loaded: dict[Any, str] = {}
    for fqn, name in matched.pairs.items():
        stored = tensors.tensors[name]
        described = describe_target(fqn, values[fqn])
        check_target(fqn, described, stored.shape, stored.dtype, allow_dtype_cast, _SOURCE)
        _refuse_float8_cast(fqn, stored.dtype, described.dtype)
        identity = storage_key(described)
        if identity is not None:
            if identity in loaded:  # tied to a key being filled: filled through it, once
                continue  # (two reads into one memory at once could leave a mix of both)
            loaded[identity] = fqn
        chunk = stored.chunk()
        for box in described.boxes:
            reads = planner.plan_reads(box.box, [chunk], stored.dtype.itemsize)
            plan.jobs.extend(Job(len(plan.targets), fqn, chunk, r, stored.dtype) for r in reads)
            plan.targets.append(box)
    for fqn in matched.absent:
        identity = storage_key(describe_target(fqn, values[fqn]))
        if identity is not None:
            (plan.tied if identity in loaded else plan.untied).append(fqn)
    return plan


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _refuse_float8_cast(fqn: str, stored: torch.dtype, target: torch.dtype) -> None:
    """Refuse a cast from or to float8 (``docs/huggingface.md``, *Dtypes*): its values mean
    something only with scales stored elsewhere, which a cast does not apply."""
    if stored != target and (_is_float8(stored) or _is_float8(target)):
        raise CheckpointMismatchError(
            f"dtype mismatch: {_SOURCE} has {stored}, the state dict expects {target} "
            "(float8 data is never cast on load, even with allow_dtype_cast=True)",
            key=fqn,
        )


def _missing(absent: list[str], offers: list[list[Any]]) -> list[str]:
    """The absent keys that are not tied: a key is tied when a rank holding elements of it
    found its memory to be a loaded key's, and no rank holding elements found otherwise
    (``offers[r][0]``: rank ``r``'s tied keys, ``[1]``: its other absent keys with elements)."""
    tied = {key for offer in offers for key in offer[0]}
    untied = {key for offer in offers for key in offer[1]}
    return [key for key in absent if key not in tied or key in untied]


def load_safetensors(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: ProcessGroup | None = None,
    prefix: str | None = None,
    key_map: KeyMap | None = None,
    strict: bool = True,
    allow_dtype_cast: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> LoadResult:
    """Fill the tensors of ``state_dict`` in place from the Hugging Face safetensors weights
    at ``path`` (collective; no rank reads more than its shards' bytes).

    Tensors of any kind and layout (plain, DTensor on any mesh, ShardedTensor,
    LocalShardsWrapper; CPU or GPU) are filled; other values are left alone. A key is filled
    from the tensor named by the key, under ``prefix`` (stripped) and through ``key_map``;
    a key whose name no file holds but whose memory is a filled key's (tied weights, such as
    an output head tied to the embedding) counts as filled. Nothing is changed when a check
    fails; a read that fails leaves the tensors being filled undefined.

    Args:
        state_dict: The target, with tensors of the right size and dtype.
        path: A model directory (``model.safetensors``, or ``model.safetensors.index.json``
            and the files it names), or one ``*.safetensors`` file; local or an fsspec URL.
        process_group: The ranks loading together (default: the default group, if any).
        prefix: Only keys under this prefix are loaded, named without it (``"model."``
            loads ``{"model": ..., "optim": ...}``'s model from files of ``model.state_dict()``).
        key_map: The name in the files of a key (prefix stripped); ``None`` leaves it out.
        strict: Raise when a key is missing from the files; with ``False``, a warning names
            the missing keys and the tensors not loaded.
        allow_dtype_cast: Cast a stored floating-point tensor to a floating-point target's
            dtype (e.g. bfloat16 weights into float32 parameters); never from or to float8.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank loads.

    Returns:
        The keys missing from the files and the tensors of the files not loaded.

    Raises:
        TypeError: ``prefix`` is not a str, or ``key_map`` is not callable.
        CheckpointError: (a subclass) no weights at ``path``, a malformed or inconsistent
            header or index, a file named outside the directory, a missing key (with
            ``strict``), a size or dtype mismatch, a missing or truncated file. Every rank
            raises the same error.

    Example:
        >>> shardwise.checkpoint.load_safetensors(model.state_dict(), "/models/Qwen3-0.6B")
    """
    started = time.monotonic()
    names = Names.of(prefix, key_map)  # the arguments checked first, alike on every rank
    comm = collectives.Comm(process_group, operation="load_safetensors")
    path_text = os.path.expanduser(os.fspath(path))
    root, single = _split(path_text)
    storage = open_shared_storage(root, storage_options, comm.world_size)
    # Rank 0's wish for a bar rules, and names the count every rank adds its bytes to.
    survey = comm.broadcast_or_raise(
        lambda: {**_survey(storage, path_text, single), "bar": [progress, secrets.token_hex(8)]},
        src=0,
    )
    tensors = _decode_survey(storage, survey)
    files = SafetensorsFiles(storage, tensors.sizes, comm.rank)
    wish, token = survey["bar"]

    def plan() -> _WeightsLoadPlan:
        planned = _plan(state_dict, tensors, names, allow_dtype_cast)
        for job in planned.jobs:  # a missing, unsafe or changed file fails before any read
            if job.read.nbytes:
                files.handle(job.chunk.file, job.key)
        return planned

    def counts(planned: _WeightsLoadPlan) -> list[int]:
        nbytes = sum(job.read.nbytes for job in planned.jobs)
        return [nbytes, len(planned.tied) + len(planned.untied)]

    try:
        with paused_gc():
            planned, (total, tying) = comm.agree_or_raise(plan, counts, 2)
            missing = planned.absent
            if tying:  # some rank holds elements of an absent key: tied or not, they tell
                offers = comm.all_gather_json([planned.tied, planned.untied])
                missing = _missing(planned.absent, offers)
            if strict and missing:
                raise CheckpointKeyError(
                    "missing from the safetensors files (pass strict=False to skip missing keys"
                    + (f"; {len(missing)} keys are missing" if len(missing) > 1 else "")
                    + ")",
                    key=missing[0],
                    file=path_text,
                )
            bar = job_bar(comm, total, f"loading {path_text}", f"load/{token}") if wish else None

            def read() -> None:
                progressed = None if bar is None else bar.update
                fill(files, planned.jobs, planned.targets, verify=False, progress=progressed)

            exchange_with_bar(comm, read, bar)
    finally:
        files.close()
    result = LoadResult(missing, planned.unexpected)
    report_load(comm, path_text, total, started, result, strict, "the safetensors files")
    return result
