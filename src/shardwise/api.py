"""Module-level sharding APIs: scatter a tensor (``shard_tensor``) or a module parameter
(``shard_parameter``) from a source rank.

``scatter`` itself, the engine the built-in specs' ``shard`` runs, lives in the sharded-tensor
layer (:mod:`shardwise.sharded_tensor.scatter`) and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.scatter import check_same_call, describe_call, scatter
from shardwise.sharding_spec import ShardingSpec

__all__ = ["scatter", "shard_parameter", "shard_tensor"]


def _shard_tensor(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
    local_check: Callable[[], None] | None = None,
) -> ShardedTensor:
    group = collectives.resolve_group(process_group)

    def describe() -> dict[str, Any]:
        if local_check is not None:
            local_check()
        return describe_call(tensor, sharding_spec, src_rank)

    if collectives.is_member(group):
        _, entries = collectives.exchange_or_raise(group, describe)
        check_same_call(entries, src_rank, sharding_spec, collectives.group_rank(group))
    else:
        describe()  # outside the group: local checks only, nobody to compare with
    return sharding_spec.shard(tensor, src_rank=src_rank, process_group=group)


def shard_tensor(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> ShardedTensor:
    """Scatter ``tensor`` from group rank ``src_rank`` into a ShardedTensor (collective).

    Every rank calls it with the same ``src_rank`` and spec; only the source's ``tensor``
    data is used (other ranks may pass any contiguous tensor, e.g. the same one). Any spec
    works, including several shards per rank and enumerable layouts.

    Raises:
        ValueError: The tensor is not contiguous, or ranks disagree on ``src_rank`` or the
            spec. Every rank raises before any data moves.

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> st = shardwise.shard_tensor(torch.arange(8.0), spec)
    """
    return _shard_tensor(tensor, sharding_spec, src_rank, process_group)


def shard_parameter(
    module: nn.Module,
    param_name: str,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> None:
    """Replace ``module.<param_name>`` by a ShardedTensor parameter scattered from ``src_rank``.

    Raises:
        AttributeError: The module has no such attribute.
        ValueError: It is not a tensor, or not contiguous.
    """
    value = getattr(module, param_name, None)

    def check() -> None:
        if not hasattr(module, param_name):
            raise AttributeError(f"{type(module).__name__} has no attribute `{param_name}`")
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"Expected {type(module).__name__}.{param_name} to be a Tensor, but found "
                f"{type(value).__name__}"
            )
        if not value.is_contiguous():
            raise ValueError(f"param: {param_name} is not a contiguous Tensor")

    tensor = value if isinstance(value, torch.Tensor) else torch.empty(0)
    st = _shard_tensor(tensor, sharding_spec, src_rank, process_group, local_check=check)
    delattr(module, param_name)
    module.register_parameter(param_name, nn.Parameter(st, requires_grad=st.requires_grad))
