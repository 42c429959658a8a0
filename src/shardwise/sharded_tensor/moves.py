"""Device and dtype moves of a ShardedTensor (``cpu``, ``cuda``, ``to``).

What the methods of :class:`~shardwise.sharded_tensor.api.ShardedTensor` share: the
arguments of ``Tensor.to``, the moved local shards and the metadata of the moved tensor. The
methods build the new ShardedTensor from what these return.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata
from shardwise.sharded_tensor.shard import Shard

__all__ = [
    "ToArgs",
    "check_memory_format",
    "force_current_accelerator_index",
    "metadata_on_device",
    "moved_shards",
    "parse_to_args",
]


@dataclass(frozen=True, slots=True)
class ToArgs:
    """The arguments of one ``ShardedTensor.to`` call, defaults filled in."""

    device: torch.device
    dtype: torch.dtype
    non_blocking: bool
    copy: bool
    memory_format: torch.memory_format
    process_group: ProcessGroup | None


def parse_to_args(
    device: torch.device, dtype: torch.dtype, args: Sequence[Any], kwargs: dict[str, Any]
) -> ToArgs:
    """Read ``to``'s arguments; ``device`` and ``dtype`` are the tensor's current ones.

    Accepts ``to(dtype)``, ``to(device)``, ``to(tensor)``, ``to(device, dtype)``, the
    ``(device, dtype, non_blocking)`` form that ``nn.Module.to`` uses, and the keywords
    ``device``, ``dtype``, ``non_blocking``, ``copy``, ``memory_format``, ``process_group``.
    """
    non_blocking = kwargs.get("non_blocking", False)
    if len(args) == 1:
        arg = args[0]
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, torch.device):
            device = arg
        elif isinstance(arg, (str, int)):
            device = torch.device(arg)
        elif isinstance(arg, torch.Tensor):
            dtype, device = arg.dtype, arg.device
        else:
            raise RuntimeError(f"ShardedTensor.to() have wrong arguments: {args}")
    elif len(args) in (2, 3):
        # (device, dtype) and nn.Module.to's (device, dtype, non_blocking).
        if args[0] is not None:
            device = torch.device(args[0])
        if args[1] is not None:
            dtype = args[1]
        if len(args) == 3:
            non_blocking = bool(args[2])
    if kwargs.get("dtype") is not None:
        dtype = kwargs["dtype"]
    if kwargs.get("device") is not None:
        device = torch.device(kwargs["device"])
    return ToArgs(
        device=device,
        dtype=dtype,
        non_blocking=non_blocking,
        copy=kwargs.get("copy", False),
        memory_format=kwargs.get("memory_format", torch.preserve_format),
        process_group=kwargs.get("process_group"),
    )


def check_memory_format(memory_format: torch.memory_format) -> None:
    """Refuse a memory format other than preserve or contiguous (shards are contiguous)."""
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        raise RuntimeError(
            "Only `torch.contiguous_format` or `torch.preserve_format` is supported!"
        )


def moved_shards(
    shards: Sequence[Shard], move: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> list[Shard]:
    """``shards`` with each tensor passed through ``move``, their placements on ``device``."""
    return [Shard(move(shard.tensor), _on_device(shard.metadata, device)) for shard in shards]


def _on_device(metadata: ShardMetadata, device: torch.device) -> ShardMetadata:
    moved = copy.deepcopy(metadata)
    if moved.placement is not None:
        moved.placement._device = device
    return moved


def metadata_on_device(
    metadata: ShardedTensorMetadata, new_device: Callable[[torch.device], torch.device]
) -> ShardedTensorMetadata:
    """A copy of ``metadata`` with every placement's device replaced by ``new_device(old)``."""
    moved = copy.deepcopy(metadata)
    for shard in moved.shards_metadata:
        if shard.placement is not None:
            shard.placement._device = new_device(shard.placement.device())
    return moved


def force_current_accelerator_index(device: torch.device) -> torch.device:  # pragma: no cover
    """The current device of ``device``'s accelerator type; warns when ``device`` differs."""
    index = torch.accelerator.current_device_index()
    current = torch.device(device.type, index)
    if device != current:
        warnings.warn(
            "ShardedTensor.to only move tensor to its current device"
            "If you want to put to different device, use `reshard` instead.",
            UserWarning,
            stacklevel=3,
        )
    return current
