"""What the commands share: exit codes, output and progress helpers, and :class:`_Checkpoint`,
the commands' view of a checkpoint opened through the one validated reader
(:class:`~shardwise.checkpoint.reader.CheckpointReader`): the whole index is checked before
anything is shown or read, data files are opened only as regular files inside the checkpoint
with the size the index declares, and every byte returned is checked against its block
checksums."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardwise.checkpoint.index import (
    CHECKSUM_ALGORITHM,
    ObjectRecord,
    TensorRecord,
    decode_text,
)
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.reader import CheckpointReader

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2

# How many keys a problem line names before it says "and N more".
_MAX_NAMED_KEYS = 5


def _progress(total: int, description: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr, shown only when stderr is a terminal."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=description,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``, ``"2 entries"`` (with ``plural="entries"``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _keys_text(keys: Sequence[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_MAX_NAMED_KEYS])
    rest = len(keys) - _MAX_NAMED_KEYS
    return f"{named} and {rest} more" if rest > 0 else named


def _printable(text: str) -> str:
    """``text`` as it is when printable, else its escaped repr: a checkpoint's keys and
    strings come from strangers, and must not break lines or drive the terminal."""
    return text if text.isprintable() else repr(text)


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
        """The value of a JSON object entry (kept in the index)."""
        entry = self.entries[fqn]
        assert isinstance(entry, ObjectRecord) and entry.text is not None
        return decode_text(entry)

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
        block size (``None``: one checksum per chunk) and save id."""
        facts: dict[str, Any] = {
            "writer": None,
            "torch": None,
            "world_size": None,
            "checksum_algorithm": CHECKSUM_ALGORITHM,  # the index refuses any other
            "block_size": self.index.block_size,
            "save_id": None,
        }
        save, legacy = self.index.save, self.index.legacy
        if save is not None:
            facts.update(
                writer=save.writer, torch=save.torch, world_size=save.world_size,
                save_id=save.save_id,
            )  # fmt: skip
        elif legacy is not None:
            # Version 1 kept these as free JSON values; shown as they are.
            planner_data = legacy.planner_data if isinstance(legacy.planner_data, dict) else {}
            facts.update(
                writer=planner_data.get("writer"),
                torch=planner_data.get("torch"),
                world_size=planner_data.get("world_size"),
                save_id=None if legacy.storage_meta is None else legacy.storage_meta.save_id,
            )
        return facts


def _open_checkpoint(path: str) -> _Checkpoint:
    """The checkpoint at ``path``, its whole index read and validated (no data is read).

    Raises:
        CheckpointError: No committed checkpoint there, or its index is invalid.
    """
    return _Checkpoint(CheckpointReader.open(path))
