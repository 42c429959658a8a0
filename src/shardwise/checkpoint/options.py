"""The options of ``save``/``async_save`` and of ``load``: one dataclass each, one field per
keyword, documented here once, carried through the machinery as one value.

``save`` and ``async_save`` keep their keywords (SPEC.md fixes them; a test checks they are
exactly these fields and defaults) and pass them on through :meth:`SaveOptions.of_call`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LoadOptions", "SaveOptions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    """How ``save`` and ``async_save`` save (their keywords)."""

    process_group: ProcessGroup | None = None
    """The ranks saving together (default: the default group, if any)."""

    coordinator_rank: int = 0
    """Group rank that writes the index and the objects."""

    sync_files: bool = True
    """fsync data files, the index and their directories before committing."""

    allow_pickle: bool = False
    """Pickle values that are not otherwise storable."""

    storage_options: dict[str, Any] | None = None
    """fsspec options for URLs."""

    progress: bool = False
    """Show a progress bar on rank 0 (stderr) of the bytes every rank writes."""

    incremental: bool = False
    """Record a content digest (xxh3_128) of every chunk (index version 5), so that a later
    save can build on this checkpoint (``docs/format.md``, *Incremental checkpoints*)."""

    base: str | None = None
    """The checkpoint beside ``path`` (same parent directory: the series root) this save
    builds on: a chunk whose bytes equal the base's chunk of the same key and box is not
    written but referenced. Implies ``incremental``."""

    @property
    def records_digests(self) -> bool:
        """Whether the save is incremental (writes an index of version 5)."""
        return self.incremental or self.base is not None

    @classmethod
    def of_call(cls, arguments: Mapping[str, Any]) -> SaveOptions:
        """The options among ``arguments`` (``locals()`` on entry of ``save``/``async_save``)."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadOptions:
    """How ``load`` loads (its keywords that the work after opening the checkpoint needs)."""

    strict: bool = True
    """Raise when a key of the state dict is missing from the checkpoint."""

    verify: bool = True
    """Check the checksum of every block read."""

    allow_pickle: bool = False
    """Allow loading entries that were pickled."""

    allow_dtype_cast: bool = False
    """Cast a saved floating-point tensor to the target's floating-point dtype."""

    progress: bool = False
    """Show a progress bar on rank 0 (stderr) of the bytes every rank loads."""
