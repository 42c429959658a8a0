"""``Sharder``: a user-defined way to shard a whole submodule."""

from __future__ import annotations

import abc

from torch import nn

__all__ = ["Sharder"]


class Sharder(abc.ABC):
    """Shards a submodule in a way a per-parameter :class:`ShardingSpec` cannot express.

    Used as a value in a :class:`ShardingPlan`; :func:`shard_module` replaces the submodule at
    that path by what :meth:`shard` returns.
    """

    @abc.abstractmethod
    def shard(self, module: nn.Module) -> nn.Module:
        """Return the sharded version of ``module`` (may be ``module`` changed in place)."""
