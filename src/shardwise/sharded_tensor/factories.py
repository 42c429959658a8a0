"""SPMD factory functions: ``empty``, ``zeros``, ``ones``, ``full``, ``rand``, ``randn``.

Call them on every rank with the same arguments; each rank allocates and fills only its own
shards (random ones from its local generator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharding_spec import ShardingSpec

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]


def empty(
    sharding_spec: ShardingSpec,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: ProcessGroup | None = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """An uninitialized ShardedTensor of the given global size.

    Args:
        sharding_spec: How to split the tensor over ranks.
        *size: Global size as varargs (``10, 20``), a list, a tuple or a ``torch.Size``.
        dtype: Element type (default: the default dtype).
        layout: Only ``torch.strided``.
        requires_grad: Whether autograd records operations on the shards.
        pin_memory: Pinned shards (needs an accelerator runtime; raises otherwise).
        memory_format: Only ``torch.contiguous_format``.
        process_group: Group of the shards (default: the default group).
        init_rrefs: Exchange RPC references to every shard.

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> st = shardwise.empty(spec, 10, 20)
    """
    return ShardedTensor(
        sharding_spec,
        *size,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )


def _size_tuple(size: Sequence[Any]) -> Any:
    return size[0] if len(size) == 1 and isinstance(size[0], Sequence) else tuple(size)


def full(
    sharding_spec: ShardingSpec,
    size: Any,
    fill_value: complex | bool,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: ProcessGroup | None = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """A ShardedTensor filled with ``fill_value``.

    ``size`` is one argument (a sequence or an int). With ``dtype=None`` the dtype is inferred
    from ``fill_value`` like ``torch.full`` (bool, int64, the default float or complex dtype).
    """
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    st = empty(
        sharding_spec,
        size,
        dtype=dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    with torch.no_grad():
        for shard in st.local_shards():
            shard.tensor.fill_(fill_value)
    return st


def zeros(sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> ShardedTensor:
    """A ShardedTensor filled with 0 (keywords as :func:`empty`)."""
    kwargs.setdefault("dtype", None)
    if kwargs["dtype"] is None:
        kwargs["dtype"] = torch.get_default_dtype()
    return full(sharding_spec, _size_tuple(size), 0, **kwargs)


def ones(sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> ShardedTensor:
    """A ShardedTensor filled with 1 (keywords as :func:`empty`)."""
    kwargs.setdefault("dtype", None)
    if kwargs["dtype"] is None:
        kwargs["dtype"] = torch.get_default_dtype()
    return full(sharding_spec, _size_tuple(size), 1, **kwargs)


def rand(sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> ShardedTensor:
    """Uniform [0, 1) values; each local shard equals ``torch.rand(shard shape)`` drawn from
    this rank's generator in local-shard order (keywords as :func:`empty`)."""
    st = empty(sharding_spec, *size, **kwargs)
    with torch.no_grad():
        for shard in st.local_shards():
            shard.tensor.uniform_(0, 1)
    return st


def randn(sharding_spec: ShardingSpec, *size: Any, **kwargs: Any) -> ShardedTensor:
    """Standard normal values; each local shard equals ``torch.randn(shard shape)`` drawn from
    this rank's generator in local-shard order (keywords as :func:`empty`)."""
    st = empty(sharding_spec, *size, **kwargs)
    with torch.no_grad():
        for shard in st.local_shards():
            shard.tensor.normal_(0, 1)
    return st
