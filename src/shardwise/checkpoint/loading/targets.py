"""What a load may fill: a target tensor described, its memory checked, its size and dtype
compared with what is stored (a checkpoint's record, or a safetensors file's entry)."""

from __future__ import annotations

import torch

from shardwise.checkpoint.entries.items import LocalBox, TensorValue, describe_tensor, unstorable
from shardwise.checkpoint.planning import planner
from shardwise.errors import CheckpointMismatchError

__all__ = ["check_memory", "check_target", "describe_target"]


def _outside(box: LocalBox, size: tuple[int, ...]) -> bool:
    """Whether a shard does not fit a tensor of ``size`` (an empty one may: the ceil rule)."""
    if len(box.sizes) != len(size):
        return True
    return planner.numel(box.sizes) > 0 and any(
        o + s > bound for o, s, bound in zip(box.offsets, box.sizes, size, strict=True)
    )


def check_target(
    fqn: str,
    described: TensorValue,
    size: tuple[int, ...],
    dtype: torch.dtype,
    allow_dtype_cast: bool,
    source: str = "the checkpoint",
) -> None:
    """Refuse to fill ``described`` with stored elements of ``size`` and ``dtype``: memory
    it cannot take them in, another size, or another dtype unless both are floating-point and
    ``allow_dtype_cast``; ``source`` names where they are stored in the messages.

    Raises:
        CheckpointMismatchError: Naming ``fqn``.
    """
    for box in described.boxes:
        check_memory(fqn, box.tensor)
    if described.size is not None and tuple(described.size) != size:
        raise CheckpointMismatchError(
            f"size mismatch: {source} has size {list(size)}, the state dict "
            f"expects {list(described.size)}",
            key=fqn,
        )
    if described.size is None and any(_outside(box, size) for box in described.boxes):
        raise CheckpointMismatchError(
            f"size mismatch: the state dict's shards do not fit the saved size {list(size)}",
            key=fqn,
        )
    castable = dtype.is_floating_point and described.dtype.is_floating_point
    if described.dtype != dtype and not (allow_dtype_cast and castable):
        hint = (
            "; pass allow_dtype_cast=True to cast it on load"
            if castable
            else " (only floating-point dtypes are cast on load)"
        )
        raise CheckpointMismatchError(
            f"dtype mismatch: {source} has {dtype}, the state dict expects {described.dtype}{hint}",
            key=fqn,
        )


def check_memory(fqn: str, tensor: torch.Tensor) -> None:
    """Refuse a target whose memory cannot take the saved elements as they are."""
    if tensor.is_meta:
        raise CheckpointMismatchError(
            "cannot load into a tensor on the meta device, which holds no data; materialize "
            "it first (e.g. module.to_empty(device=...)) or load into a tensor on a real device",
            key=fqn,
        )
    kind = unstorable(tensor)
    if kind is not None:
        raise CheckpointMismatchError(
            f"cannot load into {kind}: a checkpoint holds the elements of strided tensors; "
            "load into a strided (dense) tensor, then convert it",
            key=fqn,
        )
    if not tensor.is_contiguous() and any(
        stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    ):
        # What torch's own copy_ refuses as internal overlap.
        raise CheckpointMismatchError(
            "cannot load into a tensor whose elements share memory (made by expand()): "
            "several elements would take one place; load into a tensor of its own memory "
            "(e.g. value.clone())",
            key=fqn,
        )


def describe_target(fqn: str, value: torch.Tensor) -> TensorValue:
    """The boxes of a tensor to load into, or a :class:`CheckpointMismatchError`."""
    try:
        return describe_tensor(fqn, value)
    except (TypeError, ValueError) as err:
        check_memory(fqn, value)  # a sparse, nested or quantized tensor, named as such
        # Else, e.g., a DTensor with a Partial placement.
        reason = str(err).removeprefix(f"cannot checkpoint {fqn!r}: ")
        raise CheckpointMismatchError(f"cannot load into it: {reason}", key=fqn) from err
