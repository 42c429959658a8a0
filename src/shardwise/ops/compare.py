"""``torch.equal`` and ``torch.allclose`` on ShardedTensors: a collective vote.

Each rank compares its own shards (and the global metadata); the verdicts are summed over the
group, so every rank returns the same answer. The vote lives on the group's own device (CPU
for gloo), so it works on hosts without an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise import collectives
from shardwise.ops.registry import builtin_op
from shardwise.sharded_tensor.api import ShardedTensor


def _register_compare(op: Callable[..., Any], name: str) -> None:
    @builtin_op(op)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        if len(args) != 2:
            raise ValueError(f"Expected two arguments for torch.{name}")
        first, second = args
        if not isinstance(first, ShardedTensor) or not isinstance(second, ShardedTensor):
            raise TypeError(f"Both arguments to torch.{name} need to be of type ShardedTensor")
        group = first._process_group
        if second._process_group is not group:
            return False
        if not collectives.is_member(group):
            # Outside the group there is nothing to compare and nobody to vote with.
            return True
        local = _local_verdict(op, first, second, kwargs or {})
        votes = collectives.all_reduce_sum_int(int(local), group)
        return votes == collectives.group_world_size(group)


def _local_verdict(op: Callable[..., Any], first: Any, second: Any, kwargs: dict[str, Any]) -> bool:
    if first.metadata() != second.metadata():
        return False
    if len(first.local_shards()) != len(second.local_shards()):
        return False
    for mine, theirs in zip(first.local_shards(), second.local_shards(), strict=True):
        if mine.metadata != theirs.metadata:
            return False
        if not op(mine.tensor, theirs.tensor, **kwargs):
            return False
    return True


_register_compare(torch.equal, "equal")
_register_compare(torch.allclose, "allclose")
