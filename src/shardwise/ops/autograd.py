"""Autograd-related ops: ``detach``, ``requires_grad_`` and the ``grad`` attribute.

Autograd works on the local shard tensors (the wrapper has no storage and is never part of a
graph), so that is where gradients land. ``grad`` reads them back as a ShardedTensor laid out
like the tensor, and assigning ``None`` clears them: ``nn.Module.zero_grad`` and every
optimizer's ``zero_grad`` then reach the shards, and code that skips parameters whose
``grad`` is ``None`` no longer skips sharded ones silently.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardwise.ops._common import sharded_input
from shardwise.ops.registry import builtin_op, disabled_torch_function
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.like import rebuild, with_local_tensors
from shardwise.sharded_tensor.shard import Shard


@builtin_op(torch.Tensor.detach)
def _detach(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    shards = [Shard(shard.tensor.detach(), shard.metadata) for shard in st.local_shards()]
    metadata = copy.deepcopy(st.metadata())
    metadata.tensor_properties.requires_grad = False
    return rebuild(st, shards, metadata)


@builtin_op(torch.Tensor.requires_grad_)
def _requires_grad_(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    requires_grad = args[1] if len(args) > 1 else (kwargs or {}).get("requires_grad", True)
    if requires_grad == st.requires_grad:
        return st
    for shard in st.local_shards():
        shard.tensor.requires_grad_(requires_grad)
    disabled_torch_function(torch.Tensor.requires_grad_, (st, requires_grad), None)
    st.metadata().tensor_properties.requires_grad = requires_grad
    return st


def _holds_grad(tensor: torch.Tensor) -> bool:
    # Reading .grad of a non-leaf that does not retain it makes torch warn; it is None anyway.
    return tensor.is_leaf or tensor.retains_grad


@builtin_op(torch.Tensor.grad.__get__)  # type: ignore[attr-defined,union-attr]
def _grad(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    shards = [shard.tensor for shard in st.local_shards()]
    grads = [tensor.grad if _holds_grad(tensor) else None for tensor in shards]
    if all(grad is None for grad in grads):
        # No gradient here yet (or no shard on this rank): the wrapper's own, None.
        return disabled_torch_function(torch.Tensor.grad.__get__, args, kwargs)  # type: ignore[attr-defined,union-attr]
    # A shard that got no gradient while another did (several shards per rank): zeros, as
    # the gradient of a tensor that did not take part is.
    filled = [
        torch.zeros_like(tensor) if grad is None else grad
        for tensor, grad in zip(shards, grads, strict=True)
    ]
    return with_local_tensors(st, filled)


@builtin_op(torch.Tensor.grad.__set__)  # type: ignore[attr-defined,union-attr]
def _set_grad(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st, value = sharded_input(args), args[1]
    local = st.local_shards()
    if value is None:
        for shard in local:
            if _holds_grad(shard.tensor):
                shard.tensor.grad = None
        return None
    if not isinstance(value, ShardedTensor):
        raise TypeError(
            "the grad of a ShardedTensor must be None or a ShardedTensor with the same "
            f"sharding, got {type(value).__name__}"
        )
    theirs = value.local_shards()
    if [shard.metadata for shard in theirs] != [shard.metadata for shard in local]:
        raise RuntimeError(
            "the grad assigned to a ShardedTensor must have the same local shards (offsets, "
            "sizes and placements) as the tensor"
        )
    for shard, grad in zip(local, theirs, strict=True):
        shard.tensor.grad = grad.tensor
    return None


@builtin_op(torch.Tensor.zero_)
def _zero_(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    # For zero_grad(set_to_none=False), which zeroes each gradient in place.
    st = sharded_input(args)
    for shard in st.local_shards():
        shard.tensor.zero_()
    return st
