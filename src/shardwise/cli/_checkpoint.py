"""The commands' view of a checkpoint, :class:`_Checkpoint`, opened through the one validated
reader (:class:`~shardwise.checkpoint.loading.reader.CheckpointReader`): the whole index is checked
before anything is shown or read, data files are opened only as regular files inside the
checkpoint with the size the index declares, and every byte returned is checked against its
block checksums."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.checkpoint.index import (
    CHECKSUM_ALGORITHM,
    ObjectRecord,
    TensorRecord,
    decode_text,
    load_json_value,
)
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.storage import local_path
from shardwise.errors import CheckpointStorageError


class _Checkpoint:
    """A committed checkpoint as the commands see it: entries by key (sorted), their kinds,
    whole tensors and stored payloads, all through ``reader``.

    Args:
        reader: The checkpoint, its index validated.
    """

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.index = reader.index
        self.path = reader.path
        #: Tied tensors: alias key -> the key whose tensor it is (saved once, under that key).
        self.aliases: dict[str, str] = reader.index.aliases
        merged: dict[str, TensorRecord | ObjectRecord] = {**self.index.tensors}
        merged.update(self.index.objects)  # the index holds each key once
        self.entries = dict(sorted(merged.items()))

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.close()

    def kind(self, fqn: str) -> str:
        """``"tensor"``, or the encoding of an object (``json``, ``bytes``, ...)."""
        entry = self.entries[fqn]
        return "tensor" if isinstance(entry, TensorRecord) else entry.encoding

    def stored(self, fqns: Iterable[str] | None = None) -> list[tuple[str, SavedChunk]]:
        """Every tensor chunk and object blob of ``fqns`` (default: all), with its key."""
        items: list[tuple[str, SavedChunk]] = []
        for fqn in self.entries if fqns is None else fqns:
            entry = self.entries[fqn]
            if isinstance(entry, TensorRecord):
                items.extend((fqn, chunk) for chunk in entry.chunks)
            elif entry.blob is not None:
                items.append((fqn, entry.blob))
        return items

    def check_files(self, fqns: Iterable[str]) -> None:
        """Open (so check, reading nothing) every data file holding bytes of ``fqns``: a
        missing, linked or wrongly sized file fails before any data is read."""
        self.reader.check_files(self.stored(fqns))

    def tensor(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn`` as one CPU tensor, every block verified (allocated only
        after its data files were checked)."""
        return self.reader.read_box(fqn)

    def json_value(self, fqn: str) -> Any:
        """The value of a JSON object entry (kept in the index) as stored: checked, then
        given as JSON, tags and all (a tuple stays ``{"__tuple__": [...]}``, so it differs
        from a list, and every value compares as JSON)."""
        entry = self.entries[fqn]
        assert isinstance(entry, ObjectRecord) and entry.text is not None
        decode_text(entry)
        return load_json_value(entry.text, fqn)

    def payload(self, fqn: str) -> bytes:
        """The stored bytes of object ``fqn`` (the JSON text for a JSON value); never decoded,
        so a pickled entry is compared, not run."""
        entry = self.entries[fqn]
        assert isinstance(entry, ObjectRecord)
        if entry.text is not None:
            return entry.text.encode()
        return self.reader.blob(fqn)

    def save_facts(self) -> dict[str, Any]:
        """Who saved the checkpoint: writer, torch version, world size, checksum algorithm,
        block size and save id."""
        save = self.index.save
        return {
            "writer": save.writer,
            "torch": save.torch,
            "world_size": save.world_size,
            "checksum_algorithm": CHECKSUM_ALGORITHM,  # the index refuses any other
            "block_size": self.index.block_size,
            "save_id": save.save_id,
        }


def check_url(path: str) -> None:
    """Refuse, before anything is opened, a URL that no installed fsspec backend serves.

    Raises:
        CheckpointStorageError: fsspec, or the package of the URL's protocol (e.g. s3fs for
            ``s3://``), is not installed, or the protocol is unknown.
    """
    if local_path(path) is not None:  # as open_storage tells them apart
        return
    protocol = path.split("://", 1)[0]
    try:
        import fsspec  # type: ignore[import-untyped]

        fsspec.get_filesystem_class(protocol)
    except ImportError as err:  # fsspec or the protocol's package is missing
        raise CheckpointStorageError(
            f"cannot open {path}: {err} (pip install 'shardwise[remote]' for fsspec)"
        ) from err
    except ValueError as err:  # "Protocol not known: ..."
        raise CheckpointStorageError(f"cannot open {path}: {err}") from err


def _open_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> _Checkpoint:
    """The checkpoint at ``path`` (a directory or fsspec URL, opened with
    ``storage_options``), its whole index read and validated (no data is read).

    Raises:
        CheckpointError: No committed checkpoint there, its index is invalid, or the storage
            failed.
    """
    check_url(path)
    return _Checkpoint(CheckpointReader.open(path, storage_options))
