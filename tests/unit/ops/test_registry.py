"""The op registry without processes: signature validation at registration, the validation
every registered op runs before its body, and the errors of the dispatch helpers (reference
§12, error table rows 17-22)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.ops import registry

SIGNATURE_ERROR = (
    "Custom sharded op function expects signature: (types, args, kwargs, process_group), "
    "but received signature: "
)


@pytest.fixture
def clean_tables() -> Iterator[None]:
    """Leave the process-global tables as they were."""
    custom = dict(registry._CUSTOM_SHARDED_OPS)
    per_spec = {name: dict(table) for name, table in registry._CUSTOM_SHARDING_SPEC_OPS.items()}
    builtin = dict(registry._SHARDED_OPS)
    yield
    registry._CUSTOM_SHARDED_OPS.clear()
    registry._CUSTOM_SHARDED_OPS.update(custom)
    registry._CUSTOM_SHARDING_SPEC_OPS.clear()
    registry._CUSTOM_SHARDING_SPEC_OPS.update(per_spec)
    assert builtin == registry._SHARDED_OPS


# Unannotated, so that the signature in the message reads as a user would write it.
def _five(types, args, kwargs, process_group, extra): ...  # type: ignore[no-untyped-def]


def _one(types): ...  # type: ignore[no-untyped-def]


def _varargs(*args): ...  # type: ignore[no-untyped-def]


def _four(t: Any, a: Any, k: Any, pg: Any) -> Any:
    return ("ran", a, k, pg)


def _decorators() -> list[Callable[[Callable[..., Any]], Any]]:
    return [
        lambda func: sw.custom_sharded_op_impl(torch.cosh)(func),
        lambda func: sw.custom_sharding_spec_op(sw.ChunkShardingSpec, torch.cosh)(func),
    ]


@pytest.mark.parametrize("decorate", _decorators(), ids=["sharded_op", "spec_op"])
@pytest.mark.parametrize(
    ("func", "shown"),
    [
        (_five, "(types, args, kwargs, process_group, extra)"),
        (_one, "(types)"),
        (_varargs, "(*args)"),
        (lambda: None, "()"),
    ],
)
def test_registration_requires_four_parameters(
    clean_tables: None, decorate: Callable[[Callable[..., Any]], Any], func: Any, shown: str
) -> None:
    with pytest.raises(TypeError, match="^" + re.escape(SIGNATURE_ERROR + shown) + "$"):
        decorate(func)
    # Nothing was registered.
    assert torch.cosh not in registry._CUSTOM_SHARDED_OPS
    assert torch.cosh not in registry._CUSTOM_SHARDING_SPEC_OPS.get("ChunkShardingSpec", {})


def test_registration_returns_the_validating_wrapper(clean_tables: None) -> None:
    wrapper = sw.custom_sharded_op_impl(torch.cosh)(_four)
    assert registry._CUSTOM_SHARDED_OPS[torch.cosh] is wrapper
    assert wrapper is not _four
    assert wrapper.__name__ == "_four"
    assert wrapper.__wrapped__ is _four

    spec_wrapper = sw.custom_sharding_spec_op(sw.EnumerableShardingSpec, torch.cosh)(_four)
    assert registry._CUSTOM_SHARDING_SPEC_OPS["EnumerableShardingSpec"][torch.cosh] is spec_wrapper


@pytest.mark.parametrize("kwargs", [None, {}])
def test_wrapper_rejects_a_call_without_inputs(clean_tables: None, kwargs: Any) -> None:
    wrapper = sw.custom_sharded_op_impl(torch.cosh)(_four)
    with pytest.raises(ValueError, match="^" + re.escape(" No input for 'cosh'!") + "$"):
        wrapper((), (), kwargs, None)


def test_wrapper_rejects_a_call_without_a_sharded_tensor(clean_tables: None) -> None:
    wrapper = sw.custom_sharding_spec_op(sw.ChunkShardingSpec, torch.cosh)(_four)
    args = (torch.zeros(2), [torch.ones(1)])
    message = (
        "torch function 'cosh', with args: (tensor([0., 0.]), [tensor([1.])]) and kwargs: "
        "{'alpha': 2} are called without any distributed tensor!"
    )
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        wrapper((), args, {"alpha": 2}, None)
    # The same for a built-in op, and for kwargs=None.
    with pytest.raises(TypeError, match=re.escape("and kwargs: None are called without any")):
        registry._SHARDED_OPS[torch.Tensor.clone]((), (torch.zeros(1),), None, None)


def test_dispatch_without_a_sharded_tensor_is_not_supported() -> None:
    message = "torch function 'add', with args: (tensor([1.]), 2) and kwargs: {} not supported"
    with pytest.raises(RuntimeError, match="^" + re.escape(message + " for ShardedTensor!") + "$"):
        registry.dispatch(torch.add, (), (torch.ones(1), 2), {})


def test_dispatch_custom_op_names_the_op_and_the_spec_class() -> None:
    spec = sw.ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
    assert not registry._has_custom_op(spec, torch.cosh)
    message = f"Custom op: {torch.cosh} not registered for ChunkShardingSpec"
    with pytest.raises(RuntimeError, match="^" + re.escape(message) + "$"):
        registry._dispatch_custom_op(spec, torch.cosh, (), (), None, None)


def test_dispatch_custom_op_calls_the_registered_function(clean_tables: None) -> None:
    spec = sw.ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
    registered = sw.custom_sharding_spec_op(sw.ChunkShardingSpec, torch.cosh)(_four)
    assert registry._has_custom_op(spec, torch.cosh)
    # Other spec classes have their own table.
    assert not registry._has_custom_op(
        sw.EnumerableShardingSpec([sw.ShardMetadata([0], [1], "rank:0/cpu")]), torch.cosh
    )
    # Called directly the wrapper still validates; with no sharded tensor it refuses.
    with pytest.raises(TypeError, match=r"are called without any distributed tensor!$"):
        registry._dispatch_custom_op(spec, torch.cosh, (), (torch.ones(1),), None, "pg")
    assert registered.__wrapped__ is _four
