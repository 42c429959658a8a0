"""Pickling of ShardedTensors (``torch.save`` / ``torch.load``) and ``load_with_process_group``.

Each rank pickles only its own shards together with the global metadata and the rank and
world size it had at save time; loading checks them against the group it is loaded into, in
upstream's order (group rank, global rank, group world size, global world size). Loading never
communicates. The classes involved are registered as safe globals, so
``torch.load(..., weights_only=True)`` works too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.metadata import (
    MEM_FORMAT_ENCODING,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardwise.placement import RemoteDevice
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

if TYPE_CHECKING:
    from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["get_state", "load_with_process_group", "set_state"]

_CURRENT_PROCESS_GROUP: ProcessGroup | None = None


@dataclass
class ProcessGroupState:
    """Where a ShardedTensor was saved: rank and world size in its group and in the world."""

    local_rank: int
    global_rank: int
    local_world_size: int
    global_world_size: int


@contextlib.contextmanager
def load_with_process_group(process_group: ProcessGroup) -> Iterator[ProcessGroup]:
    """Unpickle ShardedTensors into ``process_group`` instead of the default group.

    Raises:
        RuntimeError: Already inside another ``load_with_process_group``.
    """
    global _CURRENT_PROCESS_GROUP
    if _CURRENT_PROCESS_GROUP is not None:
        raise RuntimeError(
            'ProcessGroup already set by previous "load_with_process_group" context manager'
        )
    _CURRENT_PROCESS_GROUP = process_group
    try:
        yield process_group
    finally:
        _CURRENT_PROCESS_GROUP = None


def get_current_process_group() -> ProcessGroup:
    """The group set by :func:`load_with_process_group`, else the default group."""
    return collectives.resolve_group(_CURRENT_PROCESS_GROUP)


def get_state(st: ShardedTensor) -> tuple[Any, ...]:
    """The pickled state: local shards, metadata, where it was saved, spec, init_rrefs."""
    group = st._process_group
    where = ProcessGroupState(
        collectives.group_rank(group),
        collectives.global_rank(),
        collectives.group_world_size(group),
        collectives.group_world_size(collectives.resolve_group(None)),
    )
    return (st._local_shards, st._metadata, where, st._sharding_spec, st._init_rrefs)


def set_state(st: ShardedTensor, state: tuple[Any, ...]) -> None:
    """Restore a pickled ShardedTensor into the current group, checking that it fits."""
    st._sharded_tensor_id = None
    if not collectives.is_initialized():
        raise RuntimeError(
            'Need to initialize default process group using "init_process_group" before '
            "loading ShardedTensor"
        )
    local_shards, metadata, saved, sharding_spec, init_rrefs = state
    st._local_shards = local_shards
    st._metadata = metadata
    st._sharding_spec = sharding_spec
    st._init_rrefs = init_rrefs
    st._remote_shards = {}
    group = get_current_process_group()
    st._process_group = group
    now = ProcessGroupState(
        collectives.group_rank(group),
        collectives.global_rank(),
        collectives.group_world_size(group),
        collectives.group_world_size(collectives.resolve_group(None)),
    )
    for label, before, after in (
        ("Local rank", saved.local_rank, now.local_rank),
        ("Global rank", saved.global_rank, now.global_rank),
        ("Local world size", saved.local_world_size, now.local_world_size),
        ("Global world size", saved.global_world_size, now.global_world_size),
    ):
        if before != after:
            raise RuntimeError(f"{label} at save time was {before}, but at load time was {after}")
    st._post_init()


def register_safe_globals(sharded_type: type[torch.Tensor]) -> None:
    """Allow ``torch.load(..., weights_only=True)`` to rebuild ShardedTensors.

    ``sharded_type`` is ``ShardedTensor``, passed in by the package that defines it.
    """
    torch.serialization.add_safe_globals(
        [
            sharded_type,
            Shard,
            ShardMetadata,
            ShardedTensorMetadata,
            TensorProperties,
            MEM_FORMAT_ENCODING,
            RemoteDevice,
            ProcessGroupState,
            ChunkShardingSpec,
            EnumerableShardingSpec,
        ]
    )
