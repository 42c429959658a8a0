"""``load``, ``read_metadata`` and ``load_tensor``: read a checkpoint into any layout, each
step agreed by all ranks before the next (``docs/architecture.md``, *Reading trusts nothing*)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import secrets
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from shardwise import collectives
from shardwise._warnings import warn_at_caller
from shardwise.checkpoint.entries.items import (
    LocalBox,
    decode_object,
    describe_tensor,
    is_tensor_value,
)
from shardwise.checkpoint.entries.state_dict import Flat, display_key, flatten, restore
from shardwise.checkpoint.index import Index, ObjectRecord, TensorRecord, decode_text, paused_gc
from shardwise.checkpoint.loading.index_file import quoted
from shardwise.checkpoint.loading.reader import CheckpointReader, Job, decode, read_index_bytes
from shardwise.checkpoint.loading.targets import check_target, describe_target
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.options import LoadOptions
from shardwise.checkpoint.report import exchange_with_bar, job_bar, log_done
from shardwise.checkpoint.storage import LocalStorage, Storage, open_shared_storage
from shardwise.errors import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointMismatchError,
    PickleNotAllowedError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "LoadResult",
    "ranges_read",
    "load",
    "load_from_storage",
    "load_tensor",
    "read_metadata",
]

logger = logging.getLogger("shardwise.checkpoint.load")  # the name users configure


def read_metadata(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Metadata:
    """The :class:`Metadata` of the checkpoint at ``path`` (no data read, no collective).

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        CheckpointFormatError: The index is corrupt, malformed or of an unknown version.
    """
    with CheckpointReader.open(path, storage_options) as reader:
        return reader.index.to_metadata()


class LoadResult(NamedTuple):
    """What :func:`load` did, like ``nn.Module.load_state_dict``'s result.

    Attributes:
        missing_keys: Keys of the state dict the checkpoint lacks (only with ``strict=False``).
        unexpected_keys: Keys of the checkpoint the state dict lacks (not loaded).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _match(
    flat: Flat, index: Index
) -> tuple[dict[str, str], dict[str, list[str]], list[str], list[str]]:
    """Pair the state dict's keys with the checkpoint's: by key and int positions, else by
    the dotted key when that names one entry (a checkpoint converted from DCP records no ints).
    An empty Mapping under which the checkpoint has entries (an unstepped optimizer's
    ``state``) is grown: those entries are loaded into it. Returns the pairs, the grown
    Mappings (key to checkpoint keys), the missing and unexpected keys."""
    saved = [*index.tensors, *index.objects]
    by_display: dict[str, list[str]] = {}
    for key in saved:
        by_display.setdefault(display_key(key), []).append(key)
    pairs: dict[str, str] = {}
    used: set[str] = set()
    unmatched = []
    for key in flat.leaves:
        if key in index.tensors or key in index.objects:
            found: str | None = key
        else:
            candidates = by_display.get(display_key(key), [])
            found = candidates[0] if len(candidates) == 1 else None
        if found is None or found in used:
            unmatched.append(key)
        else:
            pairs[key] = found
            used.add(found)
    grown: dict[str, list[str]] = {}
    missing = []
    for key in unmatched:
        value = flat.leaves[key]
        prefix = display_key(key) + "."
        under = (
            [k for k in saved if k not in used and display_key(k).startswith(prefix)]
            if isinstance(value, MutableMapping) and not value
            else []
        )
        if under:
            grown[key] = under
            used.update(under)
        else:
            missing.append(display_key(key))
    unexpected = [display_key(key) for key in saved if key not in used]
    return pairs, grown, missing, unexpected


_Parts = tuple[str | int, ...]


def _grown_paths(grown: dict[str, list[str]], typed: bool) -> dict[str, list[tuple[_Parts, str]]]:
    """Where each checkpoint entry goes inside its grown Mapping: its key's parts after the
    Mapping's, ints where the checkpoint recorded ints (``typed``: it records them at all).

    Raises:
        CheckpointFormatError: One entry's parts are a prefix of another's.
        CheckpointMismatchError: The checkpoint does not record key types and a part is all
            digits: guessing int or str wrong would leave the state unused without a word.
    """
    paths: dict[str, list[tuple[_Parts, str]]] = {}
    for key, saved_keys in grown.items():
        prefix = display_key(key)
        offset = prefix.count(".") + 1
        entries = []
        for saved in saved_keys:
            name, _, positions = saved.partition("\x00")
            ints = {int(p) - offset for p in positions.split(",") if p}
            parts = tuple(
                int(part) if i in ints else part
                for i, part in enumerate(name[len(prefix) + 1 :].split("."))
            )
            entries.append((parts, saved))
        ambiguous = [
            saved
            for parts, saved in entries
            if any(isinstance(part, str) and part.lstrip("-").isdigit() for part in parts)
        ]
        if ambiguous and not typed:
            raise CheckpointMismatchError(
                f"the state dict's {prefix!r} is empty and the checkpoint's entries under it "
                f"(e.g. {display_key(ambiguous[0])!r}) have number-like keys whose type the "
                "checkpoint does not record (it was converted from DCP): fill the Mapping "
                "first (step a fresh optimizer once, or build the target with "
                "torch.distributed.checkpoint.state_dict.get_state_dict), so its keys are known",
                key=prefix,
            )
        leaves = {parts for parts, _ in entries}
        for parts, saved in entries:
            if any(parts[:n] in leaves for n in range(1, len(parts))):
                raise CheckpointFormatError(
                    "this entry lies under another entry's value; it cannot be placed in "
                    f"the empty {prefix!r} of the state dict",
                    key=display_key(saved),
                )
        paths[key] = entries
    return paths


def _grow(flat: Flat, paths: dict[str, list[tuple[_Parts, str]]], values: dict[str, Any]) -> None:
    """Build the entries of each grown Mapping: nested dicts down to the loaded values."""
    for key, entries in paths.items():
        for parts, saved in entries:
            node = flat.leaves[key]
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = values[saved]


def _parameters_of(flat: Flat, paths: dict[str, list[tuple[_Parts, str]]]) -> dict[str, Any]:
    """By checkpoint key, the parameter of each grown ``state.<n>.<name>`` of an optimizer."""
    optimizers = {
        id(state["state"]): stateful
        for stateful, state in flat.statefuls
        if isinstance(stateful, torch.optim.Optimizer) and isinstance(state.get("state"), dict)
    }
    found: dict[str, Any] = {}
    for key, entries in paths.items():
        optimizer = optimizers.get(id(flat.leaves[key]))
        if optimizer is None:
            continue
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for parts, saved in entries:
            number = parts[0]
            if len(parts) == 2 and type(number) is int and 0 <= number < len(params):
                found[saved] = params[number]
    return found


def _allocate(record: TensorRecord, parameter: Any) -> torch.Tensor:
    """A new tensor for a grown entry: like ``parameter`` when of its global size (a DTensor
    stays sharded, so an FSDP optimizer resumes with sharded state), else whole on the CPU."""
    if (
        isinstance(parameter, torch.Tensor)
        and tuple(parameter.shape) == record.size
        and not parameter.is_meta  # no memory to be like
    ):
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if type(parameter) in (torch.Tensor, torch.nn.Parameter) or (
            dtensor is not None and isinstance(parameter, dtensor)
        ):
            with torch.no_grad():
                return torch.empty_like(parameter, dtype=record.dtype, requires_grad=False)
    return torch.empty(record.size, dtype=record.dtype)


@dataclass(slots=True)
class _CheckpointLoadPlan:
    targets: list[LocalBox]
    jobs: list[Job]
    objects: list[tuple[str, ObjectRecord]]  # (state dict or grown checkpoint key, record)
    grown: dict[str, list[tuple[_Parts, str]]]  # (see _match and _grown_paths)
    new_tensors: dict[str, torch.Tensor]  # checkpoint key -> tensor allocated to grow into
    missing: list[str]
    unexpected: list[str]


def _check_pickle(item: ObjectRecord, key: str, allow_pickle: bool) -> None:
    if item.encoding == "pickle" and not allow_pickle:
        raise PickleNotAllowedError(
            "this entry was pickled; pass allow_pickle=True to load it (only for "
            "checkpoints you trust: unpickling runs code)",
            key=key,
        )


def _plan_load(flat: Flat, reader: CheckpointReader, options: LoadOptions) -> _CheckpointLoadPlan:
    index: Index = reader.index
    pairs, grown, missing, unexpected = _match(flat, index)
    if options.strict and missing:
        raise CheckpointKeyError(
            "missing from the checkpoint (pass strict=False to skip missing keys"
            + (f"; {len(missing)} keys are missing" if len(missing) > 1 else "")
            + ")",
            key=missing[0],
        )
    typed = any("\x00" in saved for saved in (*index.tensors, *index.objects))
    plan = _CheckpointLoadPlan([], [], [], _grown_paths(grown, typed), {}, missing, unexpected)
    templates = _parameters_of(flat, plan.grown)
    for saved_key in itertools.chain.from_iterable(grown.values()):
        record = index.tensors.get(saved_key)
        if record is None:
            stored = index.objects[saved_key]
            _check_pickle(stored, display_key(saved_key), options.allow_pickle)
            plan.objects.append((saved_key, stored))
            continue
        # Allocated only once its data files are known to hold it.
        reader.check_files((saved_key, chunk) for chunk in record.chunks)
        allocated = _allocate(record, templates.get(saved_key))
        plan.new_tensors[saved_key] = allocated
        for box in describe_tensor(display_key(saved_key), allocated).boxes:
            plan.jobs.extend(reader.plan(saved_key, box.box, len(plan.targets)))
            plan.targets.append(box)
    for key, saved_key in pairs.items():
        value = flat.leaves[key]
        fqn = display_key(key)
        tensor = index.tensors.get(saved_key)
        if is_tensor_value(value):
            if tensor is None:
                raise CheckpointMismatchError(
                    "the state dict holds a tensor, the checkpoint an object", key=fqn
                )
            described = describe_target(fqn, value)
            check_target(fqn, described, tensor.size, tensor.dtype, options.allow_dtype_cast)
            for box in described.boxes:
                plan.jobs.extend(reader.plan(saved_key, box.box, len(plan.targets)))
                plan.targets.append(box)
            continue
        item = index.objects.get(saved_key)
        if item is None:
            raise CheckpointMismatchError(
                "the state dict holds an object, the checkpoint a tensor", key=fqn
            )
        _check_pickle(item, fqn, options.allow_pickle)
        plan.objects.append((key, item))
    return plan


class _PlanningReader(CheckpointReader):
    """A reader that only plans: no data file is opened (there may be none yet)."""

    def check_files(self, items: Any) -> None:
        return None


def ranges_read(
    state_dict: MutableMapping[str, Any], index: Index, options: LoadOptions
) -> dict[str, list[tuple[int, int]]]:
    """The bytes of the data files (``data/...`` names of ``index``) that loading
    ``state_dict`` from a checkpoint of ``index`` reads on this rank, planned as :func:`load`
    plans, nothing read: by file, ``[begin, end)`` ranges in order, disjoint and not
    touching, each of whole blocks (a verified read reads the whole blocks it touches; the
    last block ends at the file's end), and covering every read (the local tier fetches only
    these). Raises what planning the load raises."""
    reader = _PlanningReader(LocalStorage("."), index, "")  # its storage is never used
    planned = _plan_load(flatten(state_dict), reader, options)
    spans = [
        (job.chunk.file, job.read.file_offset, job.read.file_offset + job.read.nbytes)
        for job in planned.jobs
        if job.read.nbytes
    ]
    spans.extend(
        (item.blob.file, item.blob.begin, item.blob.end)
        for _, item in planned.objects
        if item.blob is not None and item.blob.nbytes
    )
    ranges: dict[str, list[tuple[int, int]]] = {}
    for file, begin, end in sorted(spans):
        if index.block_size:
            first, sums = index.blocks_of(file, begin, end)
            begin, end = first, min(first + len(sums) * index.block_size, index.files[file])
        runs = ranges.setdefault(file, [])
        if runs and begin <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((begin, end))
    return ranges


def _decode(reader: CheckpointReader, item: ObjectRecord, like: Any, payload: bytes | None) -> Any:
    """A stored object's value (``like``: the value it replaces; ``payload``: a blob's bytes)."""
    if item.text is not None:
        return decode_text(item, like)
    assert payload is not None
    if item.encoding != "pickle":
        return decode_object(item.encoding, payload, pickle.loads)
    try:
        return pickle.loads(payload)
    # A verified payload that does not unpickle fails in whatever way its classes do.
    except Exception as err:
        raise CheckpointDataError(
            f"the pickled value cannot be loaded: {type(err).__name__}: {err}",
            key=item.fqn,
            rank=reader.rank,
        ) from err


#: The end of a checksum error's message in ``load``: what the mismatch left behind.
_UNDEFINED = (
    "; the tensors this load was filling are undefined (partly filled) and no Python value of "
    "the state dict was replaced: load another checkpoint"
)


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: ProcessGroup | None = None,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
    allow_dtype_cast: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (collective).

    Tensors (plain, ShardedTensor, DTensor, LocalShardsWrapper; any layout, any world size)
    are filled in place, other values replaced in their containers, Stateful objects given
    their filled ``state_dict()``. A failed check leaves the state dict unchanged; after a
    checksum mismatch the tensors being filled are undefined and no value was replaced.

    Args:
        state_dict: The target, with tensors of the right size and dtype.
        path: Checkpoint directory or fsspec URL (``~`` is expanded).
        process_group: The ranks loading together (default: the default group, if any).
        strict: Raise when a key of ``state_dict`` is missing from the checkpoint; with
            ``False``, a warning names the missing keys and those not loaded.
        verify: Check the checksum of every block read.
        allow_pickle: Allow loading entries that were pickled.
        allow_dtype_cast: Cast a saved floating-point tensor to a floating-point target's dtype.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0 (stderr) of the bytes every rank loads.

    Raises:
        CheckpointError: (a subclass) missing or incomplete checkpoint, corrupt or malformed
            index, unknown version, missing key, size or dtype mismatch, checksum mismatch,
            missing, unsafe or truncated data file, pickled entry without ``allow_pickle``.
            Every rank raises the same error.

    Example:
        >>> result = shardwise.checkpoint.load({"model": model, "optim": optim}, "/ckpt/100")
    """
    started = time.monotonic()
    comm = collectives.Comm(process_group, operation="load")
    path_text = os.path.expanduser(os.fspath(path))
    storage = open_shared_storage(path_text, storage_options, comm.world_size)
    options = LoadOptions(
        strict=strict,
        verify=verify,
        allow_pickle=allow_pickle,
        allow_dtype_cast=allow_dtype_cast,
        progress=progress,
    )
    result, nbytes = load_from_storage(state_dict, storage, path_text, comm, options)
    report_load(comm, path_text, nbytes, started, result, strict, "the checkpoint")
    return result


def load_from_storage(
    state_dict: MutableMapping[str, Any],
    storage: Storage,
    path_text: str,
    comm: collectives.Comm,
    options: LoadOptions,
) -> tuple[LoadResult, int]:
    """:func:`load` from ``storage`` opened at ``path_text`` (the local tier's, which serves
    the parts it received from memory), before :func:`report_load`: the result, and the
    bytes every rank read."""
    progress = options.progress

    # surrogateescape carries arbitrary bytes through the JSON broadcast unchanged.
    envelope: dict[str, Any] = {}
    error: Exception | None = None
    if comm.rank == 0:
        try:
            raw = read_index_bytes(storage, path_text)
            # Rank 0's wish for a bar rules, and names the count every rank adds its bytes to.
            bar = [progress, secrets.token_hex(8)]
            envelope = {"text": raw.decode("utf-8", "surrogateescape"), "bar": bar}
        except Exception as err:  # any failure reaches every rank, none waits for the index
            error = err
            envelope = {"error": collectives.describe_error(err)}
    if comm.group is not None:
        envelope = comm.broadcast_json(envelope, src=0)
    if error is not None:
        raise error
    if "error" in envelope:
        raise collectives.rebuild_error(envelope["error"], 0)
    data = envelope["text"].encode("utf-8", "surrogateescape")
    reader = CheckpointReader(storage, decode(data, storage), path_text, comm.rank)
    wish, token = envelope["bar"]
    options = dataclasses.replace(options, progress=wish)
    try:
        with paused_gc():  # see paused_gc: the collector would walk every tensor, many times
            result, nbytes = _load(reader, comm, state_dict, options, token)
    finally:
        reader.close()
    return result, nbytes


def report_load(
    comm: collectives.Comm,
    path_text: str,
    nbytes: int,
    started: float,
    result: LoadResult,
    strict: bool,
    source: str,
) -> None:
    """The log line of a finished load (rank 0), and with ``strict=False`` the warning that
    names the keys missing from ``source`` and those it has that the state dict lacks,
    attributed to the caller of the public function that called this."""
    if comm.rank == 0:
        ranks = f" by {comm.world_size} ranks" if comm.world_size > 1 else ""
        log_done(logger, "loaded", path_text, nbytes, time.monotonic() - started, ranks)
    found = (
        (f"missing from {source}", result.missing_keys),
        (f"in {source} but not in the state dict (not loaded)", result.unexpected_keys),
    )
    parts = [
        f"{len(keys)} key{'s' if len(keys) > 1 else ''} {what} ({quoted(keys, 10)})"
        for what, keys in found
        if keys
    ]
    if not strict and parts:
        warn_at_caller(f"loading {path_text}: {'; '.join(parts)}", UserWarning)


def _load(
    reader: CheckpointReader,
    comm: collectives.Comm,
    state_dict: MutableMapping[str, Any],
    options: LoadOptions,
    token: str,
) -> tuple[LoadResult, int]:
    """Plan, verify and fill (``options.progress``: rank 0's wish for a bar, counted under
    ``token``); returns the result and the bytes every rank read."""
    flat = Flat()
    values: dict[str, Any] = {}

    def plan() -> _CheckpointLoadPlan:
        nonlocal flat
        flat = flatten(state_dict)
        planned = _plan_load(flat, reader, options)
        blobs = [(item.fqn, item.blob) for _, item in planned.objects if item.blob is not None]
        jobs = ((job.key, job.chunk) for job in planned.jobs)
        reader.check_files(itertools.chain(jobs, blobs))
        # A malformed value kept in the index fails before anything is read.
        for key, item in planned.objects:
            if item.text is not None:
                values[key] = _decode(reader, item, flat.leaves.get(key), None)
        return planned

    def nbytes(planned: _CheckpointLoadPlan) -> list[int]:
        return [sum(job.read.nbytes for job in planned.jobs)]

    planned, (total,) = comm.agree_or_raise(plan, nbytes, 1)
    description = f"loading {reader.path}"
    bar = job_bar(comm, total, description, f"load/{token}") if options.progress else None

    def fill() -> None:
        blobs = [
            (key, item, *reader.blob_segment(item))
            for key, item in planned.objects
            if item.blob is not None
        ]
        reader.fill(
            planned.jobs,
            planned.targets,
            verify=options.verify,
            progress=None if bar is None else bar.update,
            note=_UNDEFINED,
            also=[segment for _, _, segment, _ in blobs],
        )
        for key, item, _, data in blobs:
            values[key] = _decode(reader, item, flat.leaves.get(key), bytes(data))

    exchange_with_bar(comm, fill, bar)
    _grow(flat, planned.grown, {**values, **planned.new_tensors})
    restore(state_dict, flat, values)
    return LoadResult(planned.missing, planned.unexpected), total


def load_tensor(
    path: str | os.PathLike[str],
    fqn: str,
    *,
    offsets: list[int] | tuple[int, ...] | None = None,
    sizes: list[int] | tuple[int, ...] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Read one tensor, or its box ``offsets``/``sizes``, into a new CPU tensor (no process
    group; every byte verified).

    Raises:
        CheckpointKeyError: ``fqn`` is not a tensor of the checkpoint.
        ValueError: The box does not fit the tensor.
    """
    with CheckpointReader.open(path, storage_options, rank=0) as reader:
        return reader.read_box(fqn, offsets, sizes)
