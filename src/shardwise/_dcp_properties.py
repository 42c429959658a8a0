"""Tensor properties to and from ``torch.distributed.checkpoint``'s own class: one conversion
for every place that speaks DCP (the ShardedTensor protocol, the DCP storage plugins)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.metadata import TensorProperties


def to_dcp(properties: TensorProperties) -> Any:
    """DCP's ``TensorProperties`` with the same five fields (imported here: DCP is needed only
    by code that talks to it)."""
    from torch.distributed.checkpoint.metadata import TensorProperties as DCPTensorProperties

    return DCPTensorProperties(
        dtype=properties.dtype,
        layout=properties.layout,
        requires_grad=properties.requires_grad,
        memory_format=properties.memory_format,
        pin_memory=properties.pin_memory,
    )


def from_dcp(properties: Any, dtype: torch.dtype) -> TensorProperties:
    """Ours from DCP's, with ``dtype`` (the tensor's own: DCP's planners may leave a stale one
    in the properties of a write item)."""
    return TensorProperties(
        dtype=dtype,
        layout=properties.layout,
        requires_grad=properties.requires_grad,
        memory_format=properties.memory_format,
        pin_memory=properties.pin_memory,
    )
