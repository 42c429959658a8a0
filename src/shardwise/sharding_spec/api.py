"""The sharding-spec and placement-spec base classes.

A :class:`ShardingSpec` says how a global tensor of a given size is cut into shards and
where each shard lives; a :class:`PlacementSpec` says where a whole (unsharded) entity lives.

The spec layer sits below the sharded tensor, yet a spec's ``shard`` makes a ShardedTensor
and upstream keeps ``custom_sharding_spec_op`` here. Both come from the layers above through
:class:`TensorLayer`, which :mod:`shardwise.sharded_tensor` installs when it is imported, so
this layer never imports the layers built on it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwise.metadata import ShardedTensorMetadata, TensorProperties
from shardwise.placement import RemoteDevice

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["DevicePlacementSpec", "PlacementSpec", "ShardingSpec"]


@dataclass(frozen=True, slots=True)
class TensorLayer:
    """What the spec layer uses from the layers built on it (dependency inversion)."""

    scatter: Callable[..., ShardedTensor]
    """``shardwise.sharded_tensor.scatter.scatter``: the engine of the built-in specs' ``shard``."""

    custom_sharding_spec_op: Callable[[type, Callable[..., Any]], Callable[..., Any]]
    """``shardwise.ops.registry.custom_sharding_spec_op``."""


_tensor_layer: TensorLayer | None = None


def install_tensor_layer(layer: TensorLayer) -> None:
    """Called once by :mod:`shardwise.sharded_tensor` when it is imported."""
    global _tensor_layer
    _tensor_layer = layer


def _installed_tensor_layer() -> TensorLayer:
    if _tensor_layer is None:
        # Only the spec layer has been loaded so far (``import shardwise`` before torch, then a
        # spec's ``shard``): loading the sharded-tensor package installs what it provides.
        importlib.import_module("shardwise.sharded_tensor")
    assert _tensor_layer is not None, "shardwise.sharded_tensor did not install its layer"
    return _tensor_layer


class PlacementSpec(ABC):  # noqa: B024 - a marker base: subclasses add what they need
    """Base class of placements of a whole entity (as opposed to a sharded one).

    Subclass it to describe placements the built-in specs do not cover.
    """

    __slots__ = ()


@dataclass(slots=True)
class DevicePlacementSpec(PlacementSpec):
    """Places an entity on a single device.

    Args:
        device: Where the entity lives; anything but a :class:`RemoteDevice` is parsed by
            :class:`RemoteDevice` (``"rank:0/cpu"``, ``"cuda:1"``, ``torch.device(...)``).

    Raises:
        TypeError: ``device`` is neither a string nor a ``torch.device``.
        ValueError: ``device`` is a string :class:`RemoteDevice` cannot parse.
        RuntimeError: The device part is not a valid ``torch.device``.
    """

    device: RemoteDevice | str | torch.device

    def __post_init__(self) -> None:
        if not isinstance(self.device, RemoteDevice):
            self.device = RemoteDevice(self.device)


class ShardingSpec(ABC):
    """Base class of sharding specifications: how a tensor is cut into shards, and where.

    A subclass implements :meth:`build_metadata` (the global metadata every rank agrees on
    when it creates a sharded tensor with this spec) and :meth:`shard` (scatter a tensor).
    """

    __slots__ = ()

    @abstractmethod
    def build_metadata(
        self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        """Lay out a tensor of size ``tensor_sizes`` according to this spec.

        Args:
            tensor_sizes: The global size of the tensor to shard.
            tensor_properties: Properties shared by every shard (dtype, layout, ...).

        Returns:
            The metadata of every shard, the global size and ``tensor_properties``.
        """

    @abstractmethod
    def shard(
        self,
        tensor: torch.Tensor,
        src_rank: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> ShardedTensor:
        """Scatter ``tensor`` from group rank ``src_rank`` according to this spec (collective).

        Args:
            tensor: The full tensor; only the source rank's data is used.
            src_rank: Group rank that holds the data.
            process_group: The group to scatter over (default: the default group).

        Returns:
            The ShardedTensor holding this rank's shards.
        """


class ScatterByMetadata(ShardingSpec):
    """Base of the built-in specs: ``shard`` scatters by the layout of :meth:`build_metadata`."""

    __slots__ = ()

    def shard(
        self,
        tensor: torch.Tensor,
        src_rank: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> ShardedTensor:
        """Scatter ``tensor`` from group rank ``src_rank`` by this spec (collective).

        Every rank calls it with the same spec and ``src_rank``; only the source's data is
        used. Several shards per rank and empty shards are fine.

        Returns:
            The ShardedTensor holding this rank's shards, with ``sharding_spec() is self``.
        """
        scatter = _installed_tensor_layer().scatter
        return scatter(tensor, self, src_rank=src_rank, process_group=process_group)


def custom_sharding_spec_op(sharding_spec_class: type, func: Any) -> Any:
    """Decorator registering an implementation of ``func`` for tensors sharded by
    ``sharding_spec_class`` (upstream's home of this name; see
    :func:`shardwise.ops.registry.custom_sharding_spec_op`)."""
    return _installed_tensor_layer().custom_sharding_spec_op(sharding_spec_class, func)
