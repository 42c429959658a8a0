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
from shardwise.ops._common import sharded_input, unsupported
from shardwise.ops.registry import builtin_op


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


def _only_tensor_args(allowed: set[str]) -> Callable[[Callable[..., Any], Any, Any], None]:
    """The argument check of a full reduction that takes no options but ``allowed``."""

    def check(func: Callable[..., Any], args: Any, kwargs: Any) -> None:
        # Defaults that torch fills in (dim=None, keepdim=False) still mean a full reduction.
        given = {k for k, v in (kwargs or {}).items() if v is not None and v is not False}
        if len(args) > 1 or given - allowed:
            raise unsupported(func, args, kwargs)

    return check


def _check_norm_args(func: Callable[..., Any], args: Any, given: Any) -> None:
    kwargs = given or {}
    order_name = _norm_order_name(func)
    p = args[1] if len(args) > 1 else kwargs.get(order_name, "fro")
    if (
        len(args) > 2
        or kwargs.get("dim") is not None
        or kwargs.get("keepdim")
        or kwargs.get("out") is not None
        or set(kwargs) - {order_name, "dim", "dtype", "keepdim", "out"}
        or not (p in ("fro", None) or isinstance(p, (int, float)))
    ):
        raise unsupported(func, args, given)


def _norm_order_name(func: Callable[..., Any]) -> str:
    # torch.norm and Tensor.norm call the order "p", torch.linalg.vector_norm "ord".
    return "ord" if func is torch.linalg.vector_norm else "p"


#: ``reduce(st, func, args, kwargs, dtype)``: the reduction of a non-empty ShardedTensor,
#: as a 0-d tensor of ``dtype`` (the result dtype of ``func`` on a plain tensor).
_Reduce = Callable[[Any, Callable[..., Any], Any, dict[str, Any], torch.dtype], torch.Tensor]


def _register(
    func: Callable[..., Any],
    check: Callable[[Callable[..., Any], Any, Any], None],
    reduce: _Reduce,
) -> None:
    """Register the full reduction ``func``: ``check`` its arguments, answer like torch for
    an empty tensor (and for the dtypes torch refuses), else ``reduce``."""

    @builtin_op(func)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})
        check(func, args, given)
        st = sharded_input(args)
        answer = _torch_answer(func, args, kwargs)
        if st.numel() == 0:
            return answer
        return reduce(st, func, args, kwargs, answer.dtype)


def _reduce_sum(
    st: Any, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    return _sum(st, dtype)


def _reduce_mean(
    st: Any, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    total = _sum(st, _accumulation_dtype(dtype))
    count: int = st.numel()
    return (total / count).to(dtype)


def _reduce_extreme(name: str) -> _Reduce:
    def reduce(
        st: Any, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype
    ) -> torch.Tensor:
        return _global_extreme(st, name, lambda tensor: tensor).to(dtype)

    return reduce


def _reduce_norm(
    st: Any, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype
) -> torch.Tensor:
    p = args[1] if len(args) > 1 else kwargs.get(_norm_order_name(func), "fro")
    p = 2 if p in ("fro", None) else p
    if math.isinf(p):
        name = "max" if p > 0 else "min"
        magnitude = _global_extreme(st, name, lambda tensor: tensor.abs().to(torch.float64))
        return magnitude.to(dtype)
    partial = torch.zeros((), dtype=torch.float64)
    for shard in st.local_shards():
        values = shard.tensor.detach().abs().to(torch.float64)
        partial += (values != 0).sum() if p == 0 else values.pow(p).sum()
    total = _all_reduce(partial, "sum", st)
    result = total if p == 0 else total.pow(1.0 / p)
    return result.to(dtype)


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
    _register(_func, _only_tensor_args({"dtype"}), _reduce_sum)
for _func in _MEAN_OPS:
    _register(_func, _only_tensor_args({"dtype"}), _reduce_mean)
for _func in _MAX_OPS:
    _register(_func, _only_tensor_args(set()), _reduce_extreme("max"))
for _func in _MIN_OPS:
    _register(_func, _only_tensor_args(set()), _reduce_extreme("min"))
for _func in _NORM_OPS:
    _register(_func, _check_norm_args, _reduce_norm)
