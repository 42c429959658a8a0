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


def _torch_answer(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """What ``func`` gives for a plain tensor of the sharded tensor's dtype.

    For an empty sharded tensor that is the answer itself (0, nan, or torch's error for max of
    nothing); otherwise a one-element stand-in tells the result dtype and raises torch's own
    error for a dtype the op does not support (int mean, complex max, ...). The global size
    and dtype are the same on every rank, so every rank gets the same answer without
    communicating.
    """
    st = args[0]
    shape = st.size() if st.numel() == 0 else (1,)
    return func(torch.zeros(shape, dtype=st.dtype), *args[1:], **kwargs)


def _sum(st: Any, dtype: torch.dtype) -> torch.Tensor:
    partial = torch.zeros((), dtype=_accumulation_dtype(dtype))
    for shard in st.local_shards():
        partial += shard.tensor.detach().sum(dtype=partial.dtype)
    return _all_reduce(partial, "sum", st).to(dtype)


def _global_extreme(
    st: Any, name: str, values: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``max`` or ``min`` of ``values(shard)`` over every shard of every rank (at least one
    element overall): float64 with NaN propagated for floating values, else int64."""
    local = [values(shard.tensor.detach()) for shard in st.local_shards() if shard.tensor.numel()]
    floating = values(torch.zeros(1, dtype=st.dtype)).dtype.is_floating_point
    if not floating:
        info = torch.iinfo(torch.int64)
        partial = torch.tensor(info.min if name == "max" else info.max, dtype=torch.int64)
        for tensor in local:
            extreme = tensor.max() if name == "max" else tensor.min()
            partial = (
                torch.maximum(partial, extreme)
                if name == "max"
                else torch.minimum(partial, extreme)
            )
        return _all_reduce(partial, name, st)
    # gloo's MAX and MIN mishandle NaN (the result is garbage, not NaN), so NaN travels as a
    # flag beside the largest non-NaN value, and min is computed as -max(-x): one all-reduce
    # of [value, saw_nan] with MAX.
    sign = 1.0 if name == "max" else -1.0
    best, saw_nan = -math.inf, 0.0
    for tensor in local:
        extreme = (tensor.to(torch.float64) * sign).max()
        if torch.isnan(extreme):
            saw_nan = 1.0
        else:
            best = max(best, float(extreme))
    packed = _all_reduce(torch.tensor([best, saw_nan], dtype=torch.float64), "max", st)
    value = math.nan if packed[1].item() > 0 else sign * packed[0].item()
    return torch.tensor(value, dtype=torch.float64)


def _only_tensor_args(func: Callable[..., Any], args: Any, kwargs: Any, allowed: set[str]) -> None:
    # Defaults that torch fills in (dim=None, keepdim=False) still mean a full reduction.
    extra = {k for k, v in (kwargs or {}).items() if v is not None and v is not False} - allowed
    if len(args) > 1 or extra:
        raise _unsupported(func, args, kwargs)


def _register_sum(func: Callable[..., Any]) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})
        _only_tensor_args(func, args, given, {"dtype"})
        st = sharded_input(args)
        answer = _torch_answer(func, args, kwargs)
        if st.numel() == 0:
            return answer
        return _sum(st, answer.dtype)


def _register_mean(func: Callable[..., Any]) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})
        _only_tensor_args(func, args, given, {"dtype"})
        st = sharded_input(args)
        answer = _torch_answer(func, args, kwargs)
        if st.numel() == 0:
            return answer
        total = _sum(st, _accumulation_dtype(answer.dtype))
        return (total / st.numel()).to(answer.dtype)


def _register_extreme(func: Callable[..., Any], name: str) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})
        _only_tensor_args(func, args, given, set())
        st = sharded_input(args)
        answer = _torch_answer(func, args, kwargs)
        if st.numel() == 0:
            return answer
        return _global_extreme(st, name, lambda tensor: tensor).to(answer.dtype)


def _register_norm(func: Callable[..., Any], order_name: str) -> None:
    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})
        p = args[1] if len(args) > 1 else kwargs.get(order_name, "fro")
        if (
            len(args) > 2
            or kwargs.get("dim") is not None
            or kwargs.get("keepdim")
            or kwargs.get("out") is not None
            or set(kwargs) - {order_name, "dim", "dtype", "keepdim", "out"}
            or not (p in ("fro", None) or isinstance(p, (int, float)))
        ):
            raise _unsupported(func, args, given)
        st = sharded_input(args)
        answer = _torch_answer(func, args, kwargs)
        if st.numel() == 0:
            return answer
        p = 2 if p in ("fro", None) else p
        if math.isinf(p):
            name = "max" if p > 0 else "min"
            magnitude = _global_extreme(st, name, lambda tensor: tensor.abs().to(torch.float64))
            return magnitude.to(answer.dtype)
        partial = torch.zeros((), dtype=torch.float64)
        for shard in st.local_shards():
            values = shard.tensor.detach().abs().to(torch.float64)
            partial += (values != 0).sum() if p == 0 else values.pow(p).sum()
        total = _all_reduce(partial, "sum", st)
        result = total if p == 0 else total.pow(1.0 / p)
        return result.to(answer.dtype)


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
    _register_extreme(_func, "max")
for _func in _MIN_OPS:
    _register_extreme(_func, "min")
for _func in _NORM_OPS:
    # torch.norm and Tensor.norm call the order "p", torch.linalg.vector_norm "ord".
    _register_norm(_func, "ord" if _func is torch.linalg.vector_norm else "p")
