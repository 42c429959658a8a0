"""Full reductions of a ShardedTensor: ``sum``, ``mean``, ``max``, ``min``, ``norm``.

Collective over the tensor's group: each rank reduces its own shards, one all-reduce combines
the partial results, and every rank returns the same plain 0-d tensor. Reductions along a dim
would need a sharded result and are not registered (they raise the upstream "not supported"
error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from shardwise import collectives
from shardwise.ops._common import sharded_input
from shardwise.ops.registry import builtin_op


def _unsupported(func: Callable[..., Any], args: Any, kwargs: Any) -> RuntimeError:
    return RuntimeError(
        f"torch function '{func.__name__}', with args: {args} and kwargs: {kwargs} not "
        "supported for ShardedTensor!"
    )


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Partial results travel in a wide type gloo can reduce; the result is cast back.
    if dtype.is_complex:
        return torch.complex128
    if dtype.is_floating_point:
        return torch.float64
    return torch.int64


def _all_reduce(value: torch.Tensor, op: str, st: Any) -> torch.Tensor:
    group = st._process_group
    if value.is_complex():
        real = torch.view_as_real(value.reshape(1)).clone()
        collectives.all_reduce(real, op, group)
        return torch.view_as_complex(real).reshape(())
    value = value.clone()
    collectives.all_reduce(value, op, group)
    return value


def _sum(st: Any, dtype: torch.dtype | None) -> torch.Tensor:
    out_dtype = dtype or torch.sum(torch.empty(0, dtype=st.dtype)).dtype
    partial = torch.zeros((), dtype=_accumulation_dtype(out_dtype))
    for shard in st.local_shards():
        partial += shard.tensor.detach().sum(dtype=partial.dtype)
    return _all_reduce(partial, "sum", st).to(out_dtype)


def _extreme(st: Any, op: str, name: str) -> torch.Tensor:
    if st.numel() == 0:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    acc = _accumulation_dtype(st.dtype) if st.dtype != torch.bool else torch.int64
    identity = -math.inf if name == "max" else math.inf
    if not (acc.is_floating_point):
        info = torch.iinfo(acc)
        identity = info.min if name == "max" else info.max
    partial = torch.full((), identity, dtype=acc)
    reducer = torch.maximum if name == "max" else torch.minimum
    for shard in st.local_shards():
        if shard.tensor.numel():
            local = shard.tensor.detach().max() if name == "max" else shard.tensor.detach().min()
            partial = reducer(partial, local.to(acc))
    return _all_reduce(partial, op, st).to(st.dtype)


def _only_tensor_args(func: Callable[..., Any], args: Any, kwargs: Any, allowed: set[str]) -> None:
    # Defaults that torch fills in (dim=None, keepdim=False) still mean a full reduction.
    extra = {k for k, v in kwargs.items() if v is not None and v is not False} - allowed
    if len(args) > 1 or extra:
        raise _unsupported(func, args, kwargs)


def _register_sum(func: Callable[..., Any]) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        kwargs = dict(kwargs or {})
        _only_tensor_args(func, args, kwargs, {"dtype"})
        return _sum(sharded_input(args), kwargs.get("dtype"))


def _register_mean(func: Callable[..., Any]) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        kwargs = dict(kwargs or {})
        _only_tensor_args(func, args, kwargs, {"dtype"})
        st = sharded_input(args)
        dtype = kwargs.get("dtype") or st.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            raise RuntimeError(
                "mean(): could not infer output dtype. Input dtype must be either a floating "
                f"point or complex dtype. Got: {str(dtype).removeprefix('torch.').capitalize()}"
            )
        total = _sum(st, _accumulation_dtype(dtype))
        return (total / st.numel()).to(dtype)


def _register_extreme(func: Callable[..., Any], name: str, op: str) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        kwargs = dict(kwargs or {})
        _only_tensor_args(func, args, kwargs, set())
        return _extreme(sharded_input(args), op, name)


def _register_norm(func: Callable[..., Any]) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        kwargs = dict(kwargs or {})
        p = args[1] if len(args) > 1 else kwargs.pop("p", "fro")
        if (
            len(args) > 2
            or kwargs.get("dim") is not None
            or kwargs.get("keepdim")
            or kwargs.get("out") is not None
            or set(kwargs) - {"dim", "dtype", "keepdim", "out"}
        ):
            raise _unsupported(func, args, kwargs)
        st = sharded_input(args)
        if p in ("fro", None):
            p = 2
        if not isinstance(p, (int, float)):
            raise _unsupported(func, args, kwargs)
        out_dtype = (
            kwargs.get("dtype") or torch.linalg.vector_norm(torch.empty(0, dtype=st.dtype)).dtype
        )
        if math.isinf(p):
            magnitude = _abs_extreme(st, "max" if p > 0 else "min")
            return magnitude.to(out_dtype)
        acc = torch.float64
        partial = torch.zeros((), dtype=acc)
        for shard in st.local_shards():
            values = shard.tensor.detach().abs().to(acc)
            partial += (values != 0).sum() if p == 0 else values.pow(p).sum()
        total = _all_reduce(partial, "sum", st)
        result = total if p == 0 else total.pow(1.0 / p)
        return result.to(out_dtype)


def _abs_extreme(st: Any, name: str) -> torch.Tensor:
    if st.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    identity = -math.inf if name == "max" else math.inf
    partial = torch.full((), identity, dtype=torch.float64)
    for shard in st.local_shards():
        if shard.tensor.numel():
            values = shard.tensor.detach().abs().to(torch.float64)
            local = values.max() if name == "max" else values.min()
            partial = (
                torch.maximum(partial, local) if name == "max" else torch.minimum(partial, local)
            )
    op = "max" if name == "max" else "min"
    return _all_reduce(partial, op, st)


_SUM_OPS: tuple[Callable[..., Any], ...] = (torch.sum, torch.Tensor.sum)
_MEAN_OPS: tuple[Callable[..., Any], ...] = (torch.mean, torch.Tensor.mean)
_MAX_OPS: tuple[Callable[..., Any], ...] = (
    torch.max,
    torch.Tensor.max,
    torch.amax,
    torch.Tensor.amax,
)
_MIN_OPS: tuple[Callable[..., Any], ...] = (
    torch.min,
    torch.Tensor.min,
    torch.amin,
    torch.Tensor.amin,
)
_NORM_OPS: tuple[Callable[..., Any], ...] = (
    torch.norm,
    torch.Tensor.norm,
    torch.linalg.vector_norm,
)

for _func in _SUM_OPS:
    _register_sum(_func)
for _func in _MEAN_OPS:
    _register_mean(_func)
for _func in _MAX_OPS:
    _register_extreme(_func, "max", "max")
for _func in _MIN_OPS:
    _register_extreme(_func, "min", "min")
for _func in _NORM_OPS:
    _register_norm(_func)
