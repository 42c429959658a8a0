"""``__torch_function__`` dispatch of ShardedTensor (reference §12): the upstream priority
(user ops, then sharding-spec ops, then built-ins), the "not supported" error, the validation
every registered op runs first, and a user-registered sharded ``F.linear``.

Registrations made here are removed again in ``finally`` blocks: the pooled workers keep module
state from one test to the next, and the tables are process-global.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

import shardwise as sw
from shardwise.ops import registry
from tests.distributed.ops import assert_close, chunk_spec, from_full, grid_spec, seeded_full
from tests.harness import distributed

NOT_SUPPORTED = "not supported for ShardedTensor!"
SAME_GROUP = "All distributed tensors should use the same ProcessGroup if used together in an op."


def _not_supported(op_name: str) -> str:
    """Regex of the upstream error for an unregistered op: starts with the op, ends with the
    fixed text (upstream tests anchor it with ``$``)."""
    return rf"(?s)^torch function '{re.escape(op_name)}', with args: .* and kwargs: .* " + (
        re.escape(NOT_SUPPORTED) + "$"
    )


@contextmanager
def _registered(table: dict[Callable[..., Any], Any], op: Callable[..., Any]) -> Iterator[None]:
    """Remove whatever the block registers for ``op`` in ``table``, restoring what was there."""
    before = table.get(op)
    try:
        yield
    finally:
        if before is None:
            table.pop(op, None)
        else:
            table[op] = before


def _spec_table(spec_class: type) -> dict[Callable[..., Any], Any]:
    return registry._CUSTOM_SHARDING_SPEC_OPS.setdefault(spec_class.__qualname__, {})


@distributed(world_size=4)
def test_unregistered_ops_raise_the_upstream_error() -> None:
    st = sw.rand(chunk_spec(), 8, 4)
    plain = torch.ones(8, 4)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("add", lambda: torch.add(st, plain)),
        ("add", lambda: st + plain),
        ("linear", lambda: F.linear(torch.ones(2, 4), st)),
        ("matmul", lambda: torch.matmul(st, torch.ones(4, 2))),
        ("cat", lambda: torch.cat([st, st])),  # found inside a list, like upstream's pytree walk
        ("softmax", lambda: F.softmax(st, dim=0)),
        ("sum", lambda: st.sum(0)),  # reductions along a dim are not registered
        ("t", lambda: st.t()),
    ]
    for name, call in cases:
        with pytest.raises(RuntimeError, match=_not_supported(name)):
            call()

    # Property setters are not registered either: the error names the descriptor's __set__.
    with pytest.raises(RuntimeError, match=_not_supported("__set__")) as info:
        st.requires_grad = True
    assert "torch function '__set__'" in str(info.value)
    assert str(info.value).endswith("and kwargs: None " + NOT_SUPPORTED)
    assert st.requires_grad is False


@distributed(world_size=4)
def test_linear_with_a_sharded_weight_fails_without_a_registered_op() -> None:
    fc = nn.Linear(8, 4)
    sw.shard_parameter(fc, "weight", chunk_spec(0))
    with pytest.raises(RuntimeError, match=_not_supported("linear")):
        fc(torch.ones(3, 8))


def _custom_asin(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    # Like upstream's test: the asin of this rank's only shard, as a plain tensor.
    return torch.asin(args[0].local_shards()[0].tensor)


@distributed(world_size=4)
def test_custom_sharded_op_impl_is_dispatched_with_the_tensors_group() -> None:
    group = dist.new_group(list(range(4)))
    st = sw.rand(chunk_spec(), 8, 3, process_group=group)
    calls: list[tuple[Any, ...]] = []

    def spy(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        calls.append((types, args, kwargs, process_group))
        return "custom result"

    with _registered(registry._CUSTOM_SHARDED_OPS, torch.asin):
        wrapper = sw.custom_sharded_op_impl(torch.asin)(spy)
        # The decorator returns the validating wrapper, named after the decorated function.
        assert wrapper is registry._CUSTOM_SHARDED_OPS[torch.asin]
        assert wrapper.__name__ == "spy"
        assert torch.asin(st) == "custom result"
        ((types, args, kwargs, process_group),) = calls
        assert sw.ShardedTensor in types
        assert args == (st,)
        assert not kwargs
        assert process_group is group

        sw.custom_sharded_op_impl(torch.asin)(_custom_asin)
        result = torch.asin(st)
        assert_close(result, torch.asin(st.local_tensor()))

    # Unregistered again: back to the built-in (element-wise) asin.
    back = torch.asin(st)
    assert isinstance(back, sw.ShardedTensor)
    assert_close(back.local_tensor(), torch.asin(st.local_tensor()))


@distributed(world_size=4)
def test_dispatch_priority_user_then_spec_then_builtin() -> None:
    chunked = sw.rand(chunk_spec(), 8, 4)
    gridded = sw.rand(grid_spec(8, 4), 8, 4)

    def spec_op(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return "spec op"

    def user_op(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return "user op"

    spec_table = _spec_table(sw.ChunkShardingSpec)
    with (
        _registered(spec_table, torch.sin),
        _registered(registry._CUSTOM_SHARDED_OPS, torch.sin),
    ):
        sw.custom_sharding_spec_op(sw.ChunkShardingSpec, torch.sin)(spec_op)
        # The spec op wins over the built-in, only for tensors with that spec class.
        assert torch.sin(chunked) == "spec op"
        assert isinstance(torch.sin(gridded), sw.ShardedTensor)

        sw.custom_sharded_op_impl(torch.sin)(user_op)
        # A user op wins over both, whatever the spec.
        assert torch.sin(chunked) == "user op"
        assert torch.sin(gridded) == "user op"

        # The spec-op table is keyed by the class's __qualname__, as upstream.
        assert torch.sin in registry._CUSTOM_SHARDING_SPEC_OPS["ChunkShardingSpec"]

    builtin = torch.sin(chunked)
    assert isinstance(builtin, sw.ShardedTensor)
    assert_close(builtin.local_tensor(), torch.sin(chunked.local_tensor()))


@distributed(world_size=4)
def test_custom_op_overrides_a_builtin_tensor_op() -> None:
    st = sw.ones(chunk_spec(), 4, 4)

    def my_clone(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return ("cloned", kwargs)

    with _registered(registry._CUSTOM_SHARDED_OPS, torch.Tensor.clone):
        sw.custom_sharded_op_impl(torch.Tensor.clone)(my_clone)
        assert st.clone(memory_format=torch.contiguous_format) == (
            "cloned",
            {"memory_format": torch.contiguous_format},
        )
    assert isinstance(st.clone(), sw.ShardedTensor)


@distributed(world_size=4)
def test_registered_ops_reject_tensors_on_different_group_objects() -> None:
    # Same ranks, different objects: still an error (upstream compares with `is`).
    first = sw.ones(chunk_spec(), 4, 4)
    other_group = dist.new_group(list(range(4)))
    second = sw.ones(chunk_spec(), 4, 4, process_group=other_group)
    for call in (
        lambda: first + second,
        lambda: torch.add(first, second, alpha=2),
        lambda: torch.equal(first, second),
        lambda: torch.allclose(first, second),
        lambda: first.copy_(second),
    ):
        with pytest.raises(RuntimeError, match=re.escape(SAME_GROUP)):
            call()

    def user_op(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return "ran"

    with _registered(registry._CUSTOM_SHARDED_OPS, torch.atan2):
        sw.custom_sharded_op_impl(torch.atan2)(user_op)
        assert torch.atan2(first, first) == "ran"
        with pytest.raises(RuntimeError, match=re.escape(SAME_GROUP)):
            torch.atan2(first, second)
        # Through kwargs too.
        with pytest.raises(RuntimeError, match=re.escape(SAME_GROUP)):
            torch.atan2(first, other=second)


@distributed(world_size=4)
def test_registered_op_wrapper_validates_its_inputs() -> None:
    st = sw.ones(chunk_spec(), 4, 4)

    def user_op(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
        return args

    with _registered(registry._CUSTOM_SHARDED_OPS, torch.atan):
        wrapper = sw.custom_sharded_op_impl(torch.atan)(user_op)
        with pytest.raises(ValueError, match=re.escape(" No input for 'atan'!")):
            wrapper((), (), None, None)
        with pytest.raises(ValueError, match=r"^ No input for 'atan'!$"):
            wrapper((), (), {}, None)
        with pytest.raises(TypeError, match=r"are called without any distributed tensor!$") as info:
            wrapper((), (torch.ones(2),), {"out": None}, None)
        assert str(info.value).startswith("torch function 'atan', with args: (tensor([1., 1.]),)")
        assert "and kwargs: {'out': None} are called" in str(info.value)
        # A ShardedTensor only in the kwargs is enough.
        assert wrapper((), (), {"input": st}, None) == ()


@distributed(world_size=4)
def test_builtin_handlers_check_their_first_argument() -> None:
    st = sw.ones(chunk_spec(), 4, 4)
    for op in (torch.Tensor.device.__get__, torch.Tensor.requires_grad_):  # type: ignore[attr-defined]
        handler = registry._SHARDED_OPS[op]
        with pytest.raises(TypeError, match=r"^input needs to be a ShardedTensor$"):
            handler((), (torch.ones(1), st), None, st._process_group)


def _column_parallel_linear(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    """F.linear with a weight sharded by rows of the weight (= columns of the output): each rank
    computes its output columns, then every rank all-gathers them and concatenates in offset
    order. Shards may be uneven; they are padded to the largest for the all-gather."""
    kwargs = dict(kwargs or {})
    inputs, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    metadata = weight.metadata()
    width = max(md.shard_sizes[0] for md in metadata.shards_metadata)
    mine = torch.zeros(*inputs.shape[:-1], width, dtype=inputs.dtype)
    shard = weight.local_shards()[0] if weight.local_shards() else None
    if shard is not None:
        mine[..., : shard.metadata.shard_sizes[0]] = inputs @ shard.tensor.t()
    pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(pieces, mine, group=process_group)
    columns = []
    for md in sorted(metadata.shards_metadata, key=lambda md: md.shard_offsets[0]):
        group_rank = dist.get_group_rank(process_group, md.placement.rank())
        columns.append(pieces[group_rank][..., : md.shard_sizes[0]])
    out = torch.cat(columns, dim=-1)
    return out if bias is None else out + bias


@distributed(world_size=4)
def test_custom_sharding_spec_op_runs_a_linear_with_a_sharded_weight() -> None:
    torch.manual_seed(0)  # the same module on every rank
    fc = nn.Linear(6, 10)  # 10 output features over 4 ranks: 3, 3, 3, 1
    weight, bias = fc.weight.detach().clone(), fc.bias.detach().clone()
    x = seeded_full((5, 6), seed=1)
    sw.shard_parameter(fc, "weight", chunk_spec(0, [2, 0, 3, 1]))
    assert isinstance(fc.weight, sw.ShardedTensor)

    table = _spec_table(sw.ChunkShardingSpec)
    with _registered(table, F.linear):
        sw.custom_sharding_spec_op(sw.ChunkShardingSpec, F.linear)(_column_parallel_linear)
        assert_close(fc(x), F.linear(x, weight, bias))
        assert_close(F.linear(x, fc.weight), F.linear(x, weight))
        # Registered for ChunkShardingSpec only: another spec class is not routed to it.
        gridded = from_full(weight, grid_spec(10, 6))
        with pytest.raises(RuntimeError, match=_not_supported("linear")):
            F.linear(x, gridded)
    with pytest.raises(RuntimeError, match=_not_supported("linear")):
        fc(x)
