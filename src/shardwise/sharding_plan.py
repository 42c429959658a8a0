"""``ShardingPlan`` (what to shard, how) and ``ShardingPlanner`` (builds a plan for a module)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from torch import nn

from shardwise.sharder import Sharder
from shardwise.sharding_spec import ShardingSpec

__all__ = ["ShardingPlan", "ShardingPlanner"]


@dataclass
class ShardingPlan:
    """How :func:`shard_module` shards a module.

    Attributes:
        plan: Maps a parameter path (``"fc1.weight"``) to a :class:`ShardingSpec`, or a
            submodule path (``"emb"``) to a :class:`Sharder`.
        output_plan: Maps a submodule path to the spec its ShardedTensor output is resharded
            to (see :func:`reshard_output`).
        return_local_tensor: Submodule paths whose ShardedTensor output is replaced by the
            local tensor (see :func:`collect_local_shard`).
    """

    plan: dict[str, ShardingSpec | Sharder]
    output_plan: dict[str, ShardingSpec] | None = None
    return_local_tensor: list[str] | None = None


class ShardingPlanner(abc.ABC):
    """Builds a :class:`ShardingPlan` for a module (e.g. from its structure and sizes)."""

    @abc.abstractmethod
    def build_plan(self, module: nn.Module) -> ShardingPlan:
        """The plan for ``module``."""
