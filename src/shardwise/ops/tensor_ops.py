"""Built-in tensor ops of upstream: ``type_as``, ``__deepcopy__``, ``clone``, ``copy_``,
``_has_compatible_shallow_copy_type``, the ``*_like`` creators and ``nn.init`` initializers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from shardwise.metadata import keeps_requires_grad
from shardwise.ops._common import sharded_input
from shardwise.ops.registry import builtin_op
from shardwise.sharded_tensor import factories
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.like import rebuild
from shardwise.sharded_tensor.shard import Shard


@builtin_op(torch.Tensor.type_as)
def _type_as(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    if len(args) < 2:
        raise ValueError("Needs to give a tensor to cast type as!")
    other = args[1]
    if not isinstance(other, torch.Tensor):
        raise ValueError("Needs to give a Tensor or ShardedTensor to cast type as!")
    if st.dtype == other.dtype:
        return st
    target = other.local_tensor() if isinstance(other, ShardedTensor) else other
    shards = [Shard(shard.tensor.type_as(target), shard.metadata) for shard in st.local_shards()]
    metadata = copy.deepcopy(st.metadata())
    metadata.tensor_properties.dtype = other.dtype
    metadata.tensor_properties.requires_grad = keeps_requires_grad(st.requires_grad, other.dtype)
    return rebuild(st, shards, metadata)


@builtin_op(torch.Tensor.__deepcopy__)
def _deepcopy(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    memo = args[1] if len(args) > 1 else (kwargs or {}).get("memo", {})
    shards = copy.deepcopy(st.local_shards(), memo)
    metadata = copy.deepcopy(st.metadata(), memo)
    return rebuild(st, shards, metadata)


@builtin_op(torch.Tensor.clone)
def _clone(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    memory_format = (kwargs or {}).get("memory_format")
    if memory_format and memory_format != torch.preserve_format:
        raise RuntimeError("Only support torch.preserve_format for ShardedTensor!")
    shards = [
        Shard(shard.tensor.clone(), copy.deepcopy(shard.metadata)) for shard in st.local_shards()
    ]
    metadata = copy.deepcopy(st.metadata())
    metadata.tensor_properties.requires_grad = keeps_requires_grad(st.requires_grad, st.dtype)
    return rebuild(st, shards, metadata)


@builtin_op(torch.Tensor.copy_)
def _copy_(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    src = args[1] if len(args) > 1 else (kwargs or {})["src"]
    non_blocking = args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)
    pairs = list(zip(st.local_shards(), src.local_shards(), strict=False))
    # Check every pair before touching any data, so a mismatch copies nothing.
    if any(mine.metadata != theirs.metadata for mine, theirs in pairs):
        raise RuntimeError(
            "inplace copy can only happen between two ShardedTensor with same metadata!"
        )
    for mine, theirs in pairs:
        mine.tensor.copy_(theirs.tensor, non_blocking)
    return st


@builtin_op(torch._has_compatible_shallow_copy_type)
def _has_compatible_shallow_copy_type(
    types: Any, args: Any, kwargs: Any, process_group: Any
) -> Any:
    # False makes nn.Module._apply replace a sharded parameter instead of assigning .data.
    return False


def _register_like(op: Callable[..., Any], factory_name: str, takes_fill: bool) -> None:
    @builtin_op(op)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        st = sharded_input(args)
        # A None keyword means "not given" (torch's *_like keep the source dtype for dtype=None).
        options = {key: value for key, value in (kwargs or {}).items() if value is not None}
        options.pop("memory_format", None)
        dtype = options.setdefault("dtype", st.dtype)
        # Kept only where it can hold: an integer tensor cannot require grad.
        options.setdefault(
            "requires_grad", keeps_requires_grad(st.requires_grad, dtype, new_leaf=True)
        )
        options.setdefault("process_group", st._process_group)
        factory = getattr(factories, factory_name)
        if takes_fill:
            fill_value = args[1] if len(args) > 1 else options.pop("fill_value")
            return factory(st.sharding_spec(), st.size(), fill_value, **options)
        return factory(st.sharding_spec(), st.size(), *args[1:], **options)


for _op, _name, _fill in (
    (torch.empty_like, "empty", False),
    (torch.zeros_like, "zeros", False),
    (torch.ones_like, "ones", False),
    (torch.rand_like, "rand", False),
    (torch.randn_like, "randn", False),
    (torch.full_like, "full", True),
):
    _register_like(_op, _name, _fill)


def _required(kwargs: dict[str, Any], *names: str) -> list[Any]:
    values = []
    for name in ("tensor", *names):
        if kwargs.get(name) is None:
            raise ValueError(f"param: {name} shouldn't be None!")
        values.append(kwargs[name])
    return values


def _register_init(op: Callable[..., Any], names: tuple[str, ...]) -> None:
    @builtin_op(op)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        # torch.nn.init passes everything as keywords; upstream insists on them.
        if kwargs is None:
            raise ValueError("param: kwargs shouldn't be None!")
        options = dict(kwargs)
        if args:
            options.setdefault("tensor", args[0])
        st, *values = _required(options, *names)
        extra = {}
        if options.get("generator") is not None:
            extra["generator"] = options["generator"]
        with torch.no_grad():
            for shard in st.local_shards():
                op(shard.tensor, *values, **extra)
        return st


_register_init(torch.nn.init.uniform_, ("a", "b"))
_register_init(torch.nn.init.normal_, ("mean", "std"))
_register_init(torch.nn.init.kaiming_uniform_, ("a", "mode", "nonlinearity"))
_register_init(torch.nn.init.constant_, ("val",))


def _register_cast(op: Callable[..., Any], dtype: torch.dtype) -> None:
    @builtin_op(op)
    def impl(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        # Tensor.double() and friends, so that module.double()/float()/half() convert sharded
        # parameters like module.to(dtype) does.
        return sharded_input(args).to(dtype)


_CASTS: tuple[tuple[Callable[..., Any], torch.dtype], ...] = (
    (torch.Tensor.float, torch.float32),
    (torch.Tensor.double, torch.float64),
    (torch.Tensor.half, torch.float16),
    (torch.Tensor.bfloat16, torch.bfloat16),
)
for _cast, _dtype in _CASTS:
    _register_cast(_cast, _dtype)
