"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running pickled code.

``.metadata`` (a pickle) is read through an allow-list of inert stand-ins, and each ``*.distcp``
payload with ``torch.load(weights_only=True)``: nothing from the files runs.

The directory is untrusted input: all that ``.metadata`` states is checked before any allocation
(``docs/cli.md``, *Malformed and hostile input*, lists the checks). Every failure is a
:class:`DCPImportError` naming the file, and the key where one is concerned.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterable
from typing import Any

import torch

from shardwise._boxes import region
from shardwise.checkpoint.dcp_import._payloads import (
    MALFORMED,
    decode_dcp_object,
    first_line,
    torch_load,
)
from shardwise.checkpoint.dcp_import._plan import (
    DCPRange,
    DCPTensorPlan,
    dcp_storage,
    error,
    plan_tensor,
)
from shardwise.checkpoint.dcp_import._unpickle import (
    DCPBytesEntry,
    DCPMetadata,
    DCPTensorEntry,
    DCPUnpickler,
    ForbiddenGlobalError,
)
from shardwise.checkpoint.storage import Reader, Storage, UnsafePathError, open_storage
from shardwise.errors import CheckpointStorageError, DCPImportError

__all__ = ["DCPImportError", "DCPReader"]

_DCP_METADATA = ".metadata"
# DCP's metadata for a million chunks pickles to about 200 MB; a larger file is refused unread.
_MAX_METADATA_BYTES = 1 << 30


def _cannot_open(storage: Storage, what: str, err: OSError) -> str:
    """Why ``what`` could not be opened; a refusal names the component below the directory."""
    if not isinstance(err, UnsafePathError):
        return f"cannot open {what}: {err.strerror}"
    shown = str(err.filename).removeprefix(storage.join(""))
    if err.found == "a symbolic link":
        reason = f"{shown!r} is a symbolic link, which convert-dcp does not follow"
    elif err.found is not None:
        reason = f"{shown!r} is {err.found}, not {err.expected}"
    else:
        reason = f"{shown!r}: {err.strerror}"
    return f"refusing to read {what}: {reason}"


def _read_dcp_metadata(storage: Storage, directory: str) -> DCPMetadata:
    path = storage.url(storage.join(_DCP_METADATA))
    try:
        reader = storage.open_below(_DCP_METADATA)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise DCPImportError(
            f"{directory} is not a torch.distributed.checkpoint directory: {path} is missing"
        ) from err
    except CheckpointStorageError:
        raise  # already one line naming the URL and the cause
    except OSError as err:
        raise DCPImportError(_cannot_open(storage, path, err)) from err
    try:
        if reader.size > _MAX_METADATA_BYTES:
            raise DCPImportError(
                f"refusing to read {path}: it holds {reader.size} bytes, more than the "
                f"{_MAX_METADATA_BYTES} DCP's metadata could need"
            )
        data = bytearray(reader.size)
        count = reader.read_into(0, memoryview(data))
    finally:
        reader.close()
    if count != reader.size:
        raise DCPImportError(f"cannot read {path}: it changed while being read")
    try:
        metadata = DCPUnpickler(io.BytesIO(data)).load()
    except ForbiddenGlobalError as err:
        raise DCPImportError(f"refusing to read {path}: {err}") from err
    except (*MALFORMED, RecursionError) as err:
        raise DCPImportError(f"cannot read {path}: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, DCPMetadata):
        raise DCPImportError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


def _open_data_file(storage: Storage, relative: str, fqn: str) -> Reader:
    path = storage.url(storage.join(relative))
    try:
        return storage.open_below(relative)
    except FileNotFoundError as err:
        raise error(fqn, "its DCP data file is missing", path) from err
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise error(fqn, _cannot_open(storage, "its DCP data file", err), path) from err


def _check_storage_files(storage: Storage, ranges: Iterable[DCPRange]) -> None:
    """Check that every range lies inside its data file and that no two ranges of one file
    (hard links to it included) overlap."""
    by_path: dict[str, list[DCPRange]] = {}
    for where in ranges:
        by_path.setdefault(where.file, []).append(where)
    by_file: dict[object, list[DCPRange]] = {}
    for relative, in_file in by_path.items():
        path = storage.url(storage.join(relative))
        reader = _open_data_file(storage, relative, in_file[0].fqn)
        reader.close()
        for where in in_file:
            if where.offset + where.length > reader.size:
                raise error(
                    where.fqn,
                    f"its DCP storage range ({where.length} bytes at offset {where.offset}) "
                    f"reaches past the end of its data file ({reader.size} bytes): the "
                    "file is truncated or the metadata is corrupt",
                    path,
                )
        by_file.setdefault(reader.identity, []).extend(in_file)
    for in_file in by_file.values():
        spans = sorted((w for w in in_file if w.length), key=lambda w: (w.offset, w.length))
        # Sorted by offset, a range that overlaps a later one overlaps its successor.
        for before, after in itertools.pairwise(spans):
            if after.offset < before.offset + before.length:
                raise error(
                    after.fqn,
                    f"its DCP storage range ({after.length} bytes at offset {after.offset}) "
                    f"overlaps that of {before.fqn!r} ({before.length} bytes at offset "
                    f"{before.offset}) in the same data file",
                    storage.url(storage.join(after.file)),
                )


def _read_range(storage: Storage, where: DCPRange) -> bytes:
    path = storage.url(storage.join(where.file))
    reader = _open_data_file(storage, where.file, where.fqn)
    data = bytearray(where.length)
    try:
        # Checked when the reader was created; the file may have changed since.
        fits = where.offset + where.length <= reader.size
        count = reader.read_into(where.offset, memoryview(data)) if fits else 0
    finally:
        reader.close()
    if count != where.length:
        raise error(
            where.fqn,
            f"its DCP data file is truncated (read {count} of {where.length} bytes at "
            f"offset {where.offset})",
            path,
        )
    return bytes(data)


def _dcp_tensor(
    storage: Storage, fqn: str, plan: DCPTensorPlan, metadata_path: str
) -> torch.Tensor:
    try:
        result = torch.empty(plan.size, dtype=plan.dtype)
    except RuntimeError as err:
        raise error(fqn, f"cannot allocate it: {first_line(err)}", metadata_path) from err
    for chunk in plan.chunks:
        path = storage.url(storage.join(chunk.where.file))
        data = torch_load(_read_range(storage, chunk.where), fqn, path)
        matches = (
            isinstance(data, torch.Tensor)
            and data.layout == torch.strided
            and not data.is_nested
            and data.device.type == "cpu"
            and data.dtype == plan.dtype
            and data.shape == chunk.sizes
        )
        if not matches:
            found = (
                f"{data.dtype} {list(data.shape)} ({data.layout} on {data.device})"
                if isinstance(data, torch.Tensor) and not data.is_nested
                else type(data).__name__
            )
            raise error(
                fqn,
                f"the chunk at offsets {list(chunk.offsets)} holds {found}, the metadata says "
                f"{plan.dtype} {list(chunk.sizes)}",
                path,
            )
        try:
            region(result, chunk.offsets, chunk.sizes).copy_(data.detach())
        except RuntimeError as err:
            raise error(
                fqn, f"the chunk at offsets {list(chunk.offsets)}: {first_line(err)}", path
            ) from err
    if plan.requires_grad and (plan.dtype.is_floating_point or plan.dtype.is_complex):
        result.requires_grad_(True)
    return result


class DCPReader:
    """A DCP checkpoint directory opened for reading; no pickled code from it ever runs.

    Args:
        directory: The DCP checkpoint directory (``.metadata`` plus ``*.distcp`` files): a
            local path or an fsspec URL.
        storage_options: fsspec's options for a URL (credentials, ``endpoint_url``, ...).

    Raises:
        DCPImportError: ``.metadata`` is missing, malformed or not only DCP's metadata, or what
            it states fails a check (``docs/cli.md``, *Malformed and hostile input*).
        CheckpointStorageError: The storage of a URL failed (no credentials, ...).

    Example::

        reader = DCPReader("/checkpoints/step-100")
        state_dict = {key: reader.read(key) for key in reader.keys}
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.directory = os.fspath(directory)
        self._storage = open_storage(self.directory, storage_options)
        metadata_path = self._storage.url(self._storage.join(_DCP_METADATA))
        metadata = _read_dcp_metadata(self._storage, self.directory)
        entries = metadata.get("state_dict_metadata")
        if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
            raise DCPImportError(
                "malformed DCP metadata: state_dict_metadata is not a dict of keys",
                file=metadata_path,
            )
        ranges = dcp_storage(metadata, metadata_path)
        _check_storage_files(self._storage, ranges.values())
        self._metadata_path = metadata_path
        self._entries: dict[str, DCPTensorPlan | DCPRange] = {}
        for fqn, entry in entries.items():
            if isinstance(entry, DCPTensorEntry):
                self._entries[fqn] = plan_tensor(fqn, entry, ranges, metadata_path)
            elif isinstance(entry, DCPBytesEntry):
                where = ranges.get((fqn, None))
                if where is None:
                    raise error(fqn, "no storage for this object", metadata_path)
                self._entries[fqn] = where
            else:
                raise error(
                    fqn, f"malformed DCP metadata: it is a {type(entry).__name__}", metadata_path
                )

    @property
    def keys(self) -> list[str]:
        """The keys of the saved state dict, in the metadata's order."""
        return list(self._entries)

    def is_tensor(self, fqn: str) -> bool:
        """Whether ``fqn`` was saved as a tensor (else as an object).

        Raises:
            KeyError: ``fqn`` is not one of :attr:`keys`.
        """
        return isinstance(self._entries[fqn], DCPTensorPlan)

    def read(self, fqn: str) -> Any:
        """The value saved under ``fqn``: a whole CPU tensor assembled from its chunks, or an
        object (``bytes``, ``io.BytesIO`` or a JSON value).

        Raises:
            KeyError: ``fqn`` is not one of :attr:`keys`.
            DCPImportError: A payload is missing, malformed, or needs pickle to be read.
        """
        entry = self._entries[fqn]
        if isinstance(entry, DCPTensorPlan):
            return _dcp_tensor(self._storage, fqn, entry, self._metadata_path)
        return decode_dcp_object(
            _read_range(self._storage, entry),
            fqn,
            self._storage.url(self._storage.join(entry.file)),
        )
