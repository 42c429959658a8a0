"""Element-wise math on ShardedTensors, applied shard by shard.

Unary ops take one ShardedTensor (plus the op's own options); binary ops take a ShardedTensor
and a Python scalar, or two ShardedTensors with identical shard layouts. Mixing a
ShardedTensor with a plain tensor is not registered, so it keeps raising the upstream
"not supported for ShardedTensor!" error: a plain tensor has no sharding to line up with.

The result dtype is computed from an empty tensor of the input dtype, so every rank — also
one that owns no shard — agrees on it, and an op that would fail (e.g. an in-place op that
cannot cast its result) fails on every rank before anything changes.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias

from shardwise.metadata import keeps_requires_grad
from shardwise.ops._common import is_sharded, unsupported
from shardwise.ops.registry import builtin_op, disabled_torch_function
from shardwise.sharded_tensor.like import rebuild
from shardwise.sharded_tensor.shard import Shard

_UNARY_NAMES = [
    "abs",
    "neg",
    "negative",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "square",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
    "sigmoid",
    "relu",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "sign",
    "sgn",
    "reciprocal",
    "erf",
    "erfc",
    "erfinv",
    "logit",
    "nan_to_num",
    "clamp",
    "clip",
    "bitwise_not",
    "logical_not",
    "isnan",
    "isinf",
    "isfinite",
    "signbit",
]
_UNARY_FUNCTIONAL = (
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.mish,
    F.elu,
    F.selu,
    F.celu,
    F.leaky_relu,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.softplus,
    F.softsign,
    F.tanhshrink,
    F.logsigmoid,
    F.sigmoid,
    F.tanh,
    F.dropout,
)
_BINARY_NAMES = [
    "add",
    "sub",
    "subtract",
    "mul",
    "multiply",
    "div",
    "divide",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "pow",
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "atan2",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "logical_and",
    "logical_or",
    "logical_xor",
]
_BINARY_DUNDERS = [
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__pow__",
    "__rpow__",
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__and__",
    "__or__",
    "__xor__",
]
_INPLACE_DUNDERS = [
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
]


def _empty_like_wrapper(st: Any, *, in_place: bool = False) -> torch.Tensor:
    """A 0-element stand-in for ``st``: same dtype and requires_grad, no data.

    For an in-place op the stand-in is not a leaf: whether the real shards are leaves is known
    only where they are, so torch's "leaf Variable ... in-place" check is left to them.
    """
    requires_grad = keeps_requires_grad(bool(st.requires_grad), st.dtype, new_leaf=True)
    stand_in = torch.empty(0, dtype=st.dtype, requires_grad=requires_grad)
    return stand_in.clone() if in_place and stand_in.requires_grad else stand_in


def _in_place_result(st: Any, probe: torch.Tensor) -> Any:
    """``st`` after an in-place op: like a torch tensor, it now requires grad if an operand
    did (the probe says so on every rank, shards or not)."""
    if probe.requires_grad and not st.requires_grad:
        disabled_torch_function(torch.Tensor.requires_grad_, (st, True), None)
        st.metadata().tensor_properties.requires_grad = True
    return st


def _probe(
    func: Callable[..., Any], stand_in: torch.Tensor, rest: tuple[Any, ...], kwargs: Any
) -> Any:
    return func(stand_in, *rest, **kwargs)


def _check_scalar_or_sharded(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], given: Any
) -> None:
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor) and not is_sharded(value):
            raise unsupported(func, args, given)


def _unary(func: Callable[..., Any], inplace: bool) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})  # errors show the kwargs as received
        if not args or not is_sharded(args[0]):
            raise unsupported(func, args, given)
        st, rest = args[0], tuple(args[1:])
        _check_scalar_or_sharded(func, args, kwargs, given)
        if any(is_sharded(value) for value in (*rest, *kwargs.values())):
            raise unsupported(func, args, given)
        in_place = inplace or bool(kwargs.get("inplace", False))
        probe = _probe(func, _empty_like_wrapper(st, in_place=in_place), rest, kwargs)
        results = [func(shard.tensor, *rest, **kwargs) for shard in st.local_shards()]
        if in_place:
            return _in_place_result(st, probe)
        return _wrap(st, results, probe)

    return impl


def _wrap(st: Any, results: list[torch.Tensor], probe: torch.Tensor) -> Any:
    """A ShardedTensor over ``results`` with ``st``'s layout and the probe's dtype/grad."""
    shards = [
        Shard(result, copy.deepcopy(shard.metadata))
        for shard, result in zip(st.local_shards(), results, strict=True)
    ]
    metadata = copy.deepcopy(st.metadata())
    metadata.tensor_properties.dtype = probe.dtype
    metadata.tensor_properties.requires_grad = probe.requires_grad
    return rebuild(st, shards, metadata)


def _binary(func: Callable[..., Any], inplace: bool) -> Callable[..., Any]:
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        given, kwargs = kwargs, dict(kwargs or {})  # errors show the kwargs as received
        if len(args) < 2:
            raise unsupported(func, args, given)
        first, second, rest = args[0], args[1], tuple(args[2:])
        _check_scalar_or_sharded(func, args, kwargs, given)
        for value in (first, second):
            if not is_sharded(value) and not isinstance(value, numbers.Number):
                raise unsupported(func, args, given)
        st = first if is_sharded(first) else second
        if inplace and not is_sharded(first):
            raise unsupported(func, args, given)
        if is_sharded(first) and is_sharded(second):
            if (
                first.metadata().shards_metadata != second.metadata().shards_metadata
                or first.size() != second.size()
            ):
                raise ValueError(
                    f"{getattr(func, '__name__', func)}: ShardedTensors must have the same "
                    "shard layout (offsets, sizes and placements) to be combined element-wise"
                )
            other = _empty_like_wrapper(second)
            probe = _probe(
                lambda a, *r, **k: func(a, other, *r, **k),
                _empty_like_wrapper(first, in_place=inplace),
                rest,
                kwargs,
            )
            pairs = list(zip(first.local_shards(), second.local_shards(), strict=True))
            if any(a.metadata != b.metadata for a, b in pairs):
                raise ValueError(
                    f"{getattr(func, '__name__', func)}: local shards of the two ShardedTensors "
                    "are not in the same order"
                )
            results = [func(a.tensor, b.tensor, *rest, **kwargs) for a, b in pairs]
        elif is_sharded(first):
            probe = _probe(
                func, _empty_like_wrapper(first, in_place=inplace), (second, *rest), kwargs
            )
            results = [func(s.tensor, second, *rest, **kwargs) for s in first.local_shards()]
        else:
            probe = _probe(
                lambda t, *r, **k: func(first, t, *r, **k),
                _empty_like_wrapper(second),
                rest,
                kwargs,
            )
            results = [func(first, s.tensor, *rest, **kwargs) for s in second.local_shards()]
        if results and isinstance(results[0], type(NotImplemented)):
            raise unsupported(func, args, given)
        if inplace:
            return _in_place_result(st, probe)
        return _wrap(st, results, probe)

    return impl


def _register_all() -> None:
    for name in _UNARY_NAMES:
        for owner in (torch, torch.Tensor):
            op = getattr(owner, name, None)
            if op is not None:
                builtin_op(op)(_unary(op, inplace=False))
        for owner in (torch, torch.Tensor):  # torch.relu_ as well as Tensor.relu_
            inplace_op = getattr(owner, f"{name}_", None)
            if inplace_op is not None:
                builtin_op(inplace_op)(_unary(inplace_op, inplace=True))
    for op in _UNARY_FUNCTIONAL:
        builtin_op(op)(_unary(op, inplace=False))
    for op in (torch.Tensor.__neg__, torch.Tensor.__abs__, torch.Tensor.__invert__):
        builtin_op(op)(_unary(op, inplace=False))
    for name in _BINARY_NAMES:
        for owner in (torch, torch.Tensor):
            op = getattr(owner, name, None)
            if op is not None:
                builtin_op(op)(_binary(op, inplace=False))
        inplace_op = getattr(torch.Tensor, f"{name}_", None)
        if inplace_op is not None:
            builtin_op(inplace_op)(_binary(inplace_op, inplace=True))
    for name in _BINARY_DUNDERS:
        op = getattr(torch.Tensor, name)
        builtin_op(op)(_binary(op, inplace=False))
    for name in _INPLACE_DUNDERS:
        op = getattr(torch.Tensor, name)
        builtin_op(op)(_binary(op, inplace=True))


_register_all()
