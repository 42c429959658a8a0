"""Tables of sharded-tensor op implementations and the dispatch through them.

Priority at dispatch (upstream's): ops registered by users with :func:`custom_sharded_op_impl`,
then ops registered for the tensor's sharding-spec class with :func:`custom_sharding_spec_op`,
then the built-in table. :func:`dispatch` is ShardedTensor's ``__torch_function__``:
:mod:`shardwise.sharded_tensor` installs it when it is imported.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardwise.ops._common import is_sharded, unsupported

__all__ = [
    "OpImpl",
    "builtin_op",
    "custom_sharded_op_impl",
    "custom_sharding_spec_op",
    "dispatch",
    "first_sharded_tensor",
]

#: ``impl(types, args, kwargs, process_group)``
OpImpl = Callable[[tuple[type, ...], tuple[Any, ...], dict[str, Any], Any], Any]

_SHARDED_OPS: dict[Callable[..., Any], OpImpl] = {}
_CUSTOM_SHARDED_OPS: dict[Callable[..., Any], OpImpl] = {}
_CUSTOM_SHARDING_SPEC_OPS: dict[str, dict[Callable[..., Any], OpImpl]] = {}


def _group_of(st: Any) -> Any:
    # A tensor built by ShardedTensorBase without a process group has none.
    return getattr(st, "_process_group", None)


def first_sharded_tensor(args: Any, kwargs: Any) -> Any:
    """The first ShardedTensor among the leaves of ``args`` then ``kwargs``, or ``None``."""
    for leaf in pytree.tree_leaves((args, kwargs or {})):
        if is_sharded(leaf):
            return leaf
    return None


def _basic_validation(op: Callable[..., Any], args: Any, kwargs: Any) -> None:
    if not args and not kwargs:
        raise ValueError(f" No input for '{op.__name__}'!")
    group = None
    found = False
    for leaf in pytree.tree_leaves((args, kwargs or {})):
        if is_sharded(leaf):
            if found and _group_of(leaf) is not group:
                raise RuntimeError(
                    "All distributed tensors should use the same ProcessGroup if used together "
                    "in an op."
                )
            found = True
            group = _group_of(leaf)
    if not found:
        raise TypeError(
            f"torch function '{op.__name__}', with args: {args} and kwargs: {kwargs} are called "
            "without any distributed tensor!"
        )


def _check_signature(func: Callable[..., Any]) -> None:
    parameters = inspect.signature(func).parameters
    if len(parameters) != 4:
        raise TypeError(
            "Custom sharded op function expects signature: (types, args, kwargs, process_group), "
            f"but received signature: {inspect.signature(func)}"
        )


def _validated(op: Callable[..., Any], func: OpImpl) -> OpImpl:
    @functools.wraps(func)
    def wrapper(
        types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: Any = None, pg: Any = None
    ) -> Any:
        _basic_validation(op, args, kwargs)
        return func(types, args, kwargs, pg)

    return wrapper


def _register(
    table: dict[Callable[..., Any], OpImpl], op: Callable[..., Any]
) -> Callable[[OpImpl], OpImpl]:
    def decorator(func: OpImpl) -> OpImpl:
        _check_signature(func)
        wrapper = _validated(op, func)
        table[op] = wrapper
        return wrapper

    return decorator


def builtin_op(op: Callable[..., Any]) -> Callable[[OpImpl], OpImpl]:
    """Register a built-in implementation of ``op`` (shardwise's own ops)."""
    return _register(_SHARDED_OPS, op)


def custom_sharded_op_impl(func: Callable[..., Any]) -> Callable[[OpImpl], OpImpl]:
    """Decorator: use the decorated function for ``func`` on ShardedTensors, before built-ins.

    The decorated function takes ``(types, args, kwargs, process_group)``.

    Example:
        >>> @custom_sharded_op_impl(torch.nn.functional.linear)
        ... def my_linear(types, args, kwargs, process_group): ...
    """
    return _register(_CUSTOM_SHARDED_OPS, func)


def custom_sharding_spec_op(
    sharding_spec_class: type, func: Callable[..., Any]
) -> Callable[[OpImpl], OpImpl]:
    """Decorator: implement ``func`` for ShardedTensors whose spec is a ``sharding_spec_class``."""
    table = _CUSTOM_SHARDING_SPEC_OPS.setdefault(sharding_spec_class.__qualname__, {})
    return _register(table, func)


def _has_custom_op(sharding_spec: object, op: Callable[..., Any]) -> bool:
    table = _CUSTOM_SHARDING_SPEC_OPS.get(type(sharding_spec).__qualname__)
    return table is not None and op in table


def _dispatch_custom_op(
    sharding_spec: object,
    op: Callable[..., Any],
    types: tuple[type, ...],
    args: tuple[Any, ...],
    kwargs: Any,
    process_group: Any,
) -> Any:
    class_name = type(sharding_spec).__qualname__
    if not _has_custom_op(sharding_spec, op):
        raise RuntimeError(f"Custom op: {op} not registered for {class_name}")
    return _CUSTOM_SHARDING_SPEC_OPS[class_name][op](types, args, kwargs, process_group)


def dispatch(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: Any
) -> Any:
    """Route a torch function call with a ShardedTensor argument to its implementation."""
    st = first_sharded_tensor(args, kwargs)
    if func in _CUSTOM_SHARDED_OPS:
        group = None if st is None else _group_of(st)
        return _CUSTOM_SHARDED_OPS[func](types, args, kwargs, group)
    if st is not None and _has_custom_op(st._sharding_spec, func):
        return _dispatch_custom_op(st._sharding_spec, func, types, args, kwargs, _group_of(st))
    if st is not None and func in _SHARDED_OPS:
        return _SHARDED_OPS[func](types, args, kwargs, _group_of(st))
    raise unsupported(func, args, kwargs)


def disabled_torch_function(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Call ``func`` on the wrapper itself, bypassing ``__torch_function__``."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))
