"""Tensor-like properties answered by the wrapper: size, dtype, device, is_meta, ..."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.ops._common import sharded_input
from shardwise.ops.registry import builtin_op, disabled_torch_function

# Answered by the wrapper tensor, which carries the global size, dtype, layout and
# requires_grad (and no storage).
_WRAPPER_OPS = (
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.grad_fn.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined,union-attr]
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
)


def _register_wrapper_op(op: Any) -> None:
    @builtin_op(op)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return disabled_torch_function(op, args, kwargs)


for _op in _WRAPPER_OPS:
    _register_wrapper_op(_op)


@builtin_op(torch.Tensor.contiguous)
def _contiguous(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    # Every local shard is contiguous by construction.
    return args[0]


@builtin_op(torch.Tensor.device.__get__)  # type: ignore[attr-defined,union-attr]
def _device(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    return sharded_input(args)._current_device()


@builtin_op(torch.Tensor.is_meta.__get__)  # type: ignore[attr-defined,union-attr]
def _is_meta(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    return sharded_input(args).local_tensor().is_meta


@builtin_op(torch.Tensor.__reduce_ex__)
def _reduce_ex(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    # torch's own wrapper-subclass pickling, which calls ShardedTensor.__getstate__.
    return disabled_torch_function(torch.Tensor.__reduce_ex__, args, kwargs)
