"""SPMD factory functions: ``empty``, ``zeros``, ``ones``, ``full``, ``rand``, ``randn``.

Call them on every rank with the same arguments; each rank allocates and fills only its own
shards (random ones from its local generator). Every factory takes the keywords of
:class:`TensorOptions`, the keywords of the :class:`ShardedTensor` constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.distributed import ProcessGroup

from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.utils import size_dims
from shardwise.sharding_spec import ShardingSpec

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack needs Python 3.11

__all__ = ["TensorOptions", "empty", "full", "ones", "rand", "randn", "zeros"]


class TensorOptions(TypedDict, total=False):
    """The keywords every factory takes (all optional)."""

    dtype: torch.dtype | None
    """Element type (default: the default dtype; for :func:`full`, inferred from the value)."""
    layout: torch.layout
    """Only ``torch.strided``."""
    requires_grad: bool
    """Whether autograd records operations on the shards (default: false)."""
    pin_memory: bool
    """Pinned shards (needs an accelerator runtime; raises otherwise)."""
    memory_format: torch.memory_format
    """Only ``torch.contiguous_format``."""
    process_group: ProcessGroup | None
    """Group of the shards (default: the default group)."""
    init_rrefs: bool
    """Exchange RPC references to every shard (default: false)."""


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
        dtype, layout, requires_grad, pin_memory, memory_format, process_group, init_rrefs:
            As in :class:`TensorOptions`.

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
    options = TensorOptions(
        dtype=torch.full((), fill_value).dtype if dtype is None else dtype,
        layout=layout,
        requires_grad=requires_grad,
        pin_memory=pin_memory,
        memory_format=memory_format,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )
    return _filled(sharding_spec, (size,), options, lambda tensor: tensor.fill_(fill_value))


def zeros(
    sharding_spec: ShardingSpec, *size: Any, **options: Unpack[TensorOptions]
) -> ShardedTensor:
    """A ShardedTensor filled with 0 (keywords as :func:`empty`)."""
    return _full_of_default_dtype(sharding_spec, size, 0, options)


def ones(
    sharding_spec: ShardingSpec, *size: Any, **options: Unpack[TensorOptions]
) -> ShardedTensor:
    """A ShardedTensor filled with 1 (keywords as :func:`empty`)."""
    return _full_of_default_dtype(sharding_spec, size, 1, options)


def rand(
    sharding_spec: ShardingSpec, *size: Any, **options: Unpack[TensorOptions]
) -> ShardedTensor:
    """Uniform [0, 1) values; each local shard equals ``torch.rand(shard shape)`` drawn from
    this rank's generator in local-shard order (keywords as :func:`empty`)."""
    return _filled(sharding_spec, size, options, lambda tensor: tensor.uniform_(0, 1))


def randn(
    sharding_spec: ShardingSpec, *size: Any, **options: Unpack[TensorOptions]
) -> ShardedTensor:
    """Standard normal values; each local shard equals ``torch.randn(shard shape)`` drawn from
    this rank's generator in local-shard order (keywords as :func:`empty`)."""
    return _filled(sharding_spec, size, options, lambda tensor: tensor.normal_(0, 1))


def _full_of_default_dtype(
    sharding_spec: ShardingSpec, size: tuple[Any, ...], value: int, options: TensorOptions
) -> ShardedTensor:
    # The default dtype, not the int64 that full would infer from the value.
    if options.get("dtype") is None:
        options["dtype"] = torch.get_default_dtype()
    return full(sharding_spec, size_dims(size), value, **options)


def _filled(
    sharding_spec: ShardingSpec,
    size: tuple[Any, ...],
    options: TensorOptions,
    fill: Callable[[torch.Tensor], object],
) -> ShardedTensor:
    """A new ShardedTensor whose every local shard ``fill`` fills in place (not recorded)."""
    st = empty(sharding_spec, *size, **options)
    with torch.no_grad():
        for shard in st.local_shards():
            fill(shard.tensor)
    return st
