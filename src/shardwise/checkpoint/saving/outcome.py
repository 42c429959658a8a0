"""What every rank of a save learns once the index is committed, and what it returns: a
:class:`Metadata` decoded on first use, from the index sent with the outcome when small, else
from storage (``docs/architecture.md``, *Save*); a loop that ignores it pays for neither. And,
for a save whose writer process died before it replied, whether it committed after all."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, cast

from shardwise.checkpoint import tuning
from shardwise.checkpoint.index import decode_index
from shardwise.checkpoint.loading.load import read_metadata
from shardwise.checkpoint.metadata import STORAGE_TYPES, Metadata, StorageMeta
from shardwise.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError

__all__ = ["committed_metadata", "outcome", "returned_metadata"]


def outcome(data: bytes, metadata: Metadata) -> dict[str, Any]:
    """What every rank learns once the index ``data`` is committed: ``metadata``'s facts, and
    ``data`` itself when small."""
    assert metadata.storage_meta is not None
    facts = {
        "planner_data": metadata.planner_data,
        "version": metadata.version,
        "checkpoint_id": metadata.storage_meta.checkpoint_id,
    }
    if len(data) <= tuning.TUNING.sent_index_bytes:
        facts["index"] = data.decode()
    return facts


def returned_metadata(
    received: Mapping[str, Any], path: str, storage_options: Any, save_id: str
) -> Metadata:
    """A non-coordinator rank's return value, from the ``received`` :func:`outcome`."""
    text = received.get("index")

    @functools.cache
    def load() -> Metadata:
        if text is not None:
            return decode_index(text.encode()).to_metadata()
        found = read_metadata(path, storage_options=storage_options)
        if found.storage_meta is None or found.storage_meta.save_id != save_id:
            raise CheckpointError(
                f"the checkpoint at {path} was replaced by a later save since this one "
                "returned; read its metadata with read_metadata",
                file=path,
            )
        return found

    return Metadata(
        state_dict_metadata=cast(
            "dict[str, STORAGE_TYPES]", _OnFirstUse(lambda: load().state_dict_metadata)
        ),
        planner_data=received["planner_data"],
        storage_data=_OnFirstUse(lambda: load().storage_data),
        storage_meta=StorageMeta(checkpoint_id=received["checkpoint_id"], save_id=save_id),
        version=received["version"],
    )


def committed_metadata(path: str, storage_options: Any, save_id: str) -> Metadata | None:
    """The Metadata of the checkpoint at ``path`` when its index is the one the save
    ``save_id`` committed; None when the save did not commit: no index there, an index of
    another save, or one that does not decode (a commit renames a whole, valid index).

    Raises:
        CheckpointError, OSError: The storage failed: whether the save committed is unknown.
    """
    try:
        found = read_metadata(path, storage_options=storage_options)
    except (CheckpointNotFoundError, CheckpointFormatError):
        return None
    if found.storage_meta is None or found.storage_meta.save_id != save_id:
        return None
    return found


class _OnFirstUse(MutableMapping[Any, Any]):
    """The mapping ``source()`` returns, fetched on first use."""

    def __init__(self, source: Callable[[], MutableMapping[Any, Any]]) -> None:
        self._source = source

    def __getitem__(self, key: Any) -> Any:
        return self._source()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._source()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._source()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._source())

    def __len__(self) -> int:
        return len(self._source())

    def __reduce__(self) -> tuple[type[dict[Any, Any]], tuple[dict[Any, Any]]]:
        return dict, (dict(self.items()),)
