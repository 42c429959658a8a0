"""Element-wise math and full reductions on ShardedTensors (shardwise's own ops, beyond
upstream).

Element-wise ops run shard by shard: each local shard of the result must equal the matching
slice of the same op applied to the unsharded tensor. Reductions are collective: every rank must
return the same value, equal to the unsharded op's. Both run on every layout of
``tests.distributed.ops.LAYOUTS`` (even, uneven with an empty chunk, by columns in shuffled
placement order, an enumerable grid, two shards per rank, ranks without shards, 1-D).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias

import shardwise as sw
from tests.distributed.ops import (
    LAYOUTS,
    assert_close,
    assert_same_on_all_ranks,
    assert_shards_match,
    chunk_spec,
    from_full,
    narrow,
    seeded_full,
)
from tests.harness import distributed

Op = Callable[..., Any]

NOT_SUPPORTED = re.escape("not supported for ShardedTensor!") + "$"
LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation."


def _layout_mismatch(name: str) -> str:
    return "^" + re.escape(
        f"{name}: ShardedTensors must have the same shard layout (offsets, sizes and "
        "placements) to be combined element-wise"
    )


UNARY: list[Op] = [
    torch.neg,
    lambda t: -t,
    torch.abs,
    abs,
    torch.exp,
    lambda t: t.exp(),
    torch.relu,
    F.relu,
    F.gelu,
    lambda t: F.gelu(t, approximate="tanh"),
    torch.sigmoid,
    F.sigmoid,
    torch.tanh,
    torch.sin,
    F.silu,
    lambda t: F.leaky_relu(t, 0.2),
    lambda t: F.elu(t, alpha=0.5),
    lambda t: torch.clamp(t, min=-0.5, max=0.5),
    lambda t: t.clamp(min=0.1),
    torch.square,
    lambda t: torch.sqrt(torch.abs(t)),  # chained: each step returns a ShardedTensor
    torch.sign,
    torch.round,
    torch.floor,
    torch.reciprocal,
    torch.isfinite,
    lambda t: F.softplus(t, beta=2.0),
]

WITH_SCALAR: list[Op] = [
    lambda t: t + 2,
    lambda t: 2 + t,
    lambda t: t - 2.5,
    lambda t: 2.5 - t,
    lambda t: t * 3,
    lambda t: 3 * t,
    lambda t: t / 4,
    lambda t: 4 / t,
    lambda t: t**2,
    lambda t: 2**t,
    lambda t: t // 0.5,
    lambda t: t % 0.75,
    lambda t: torch.add(t, 2, alpha=3),
    lambda t: torch.sub(t, 1, alpha=2),
    lambda t: torch.mul(t, -1.5),
    lambda t: torch.div(t, 3),
    lambda t: torch.div(t, 0.3, rounding_mode="floor"),
    lambda t: t > 0,
    lambda t: t <= 0.5,
    lambda t: torch.maximum(t, t * 0 + 0.25),  # two sharded operands with the same layout
    lambda t: t + True,
]

WITH_SHARDED: list[Op] = [
    lambda a, b: a + b,
    lambda a, b: a - b,
    lambda a, b: a * b,
    lambda a, b: a / b,
    lambda a, b: torch.add(a, b, alpha=2),
    lambda a, b: torch.sub(a, b, alpha=0.5),
    lambda a, b: torch.mul(a, b),
    lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    lambda a, b: torch.maximum(a, b),
    lambda a, b: torch.minimum(a, b),
    lambda a, b: torch.atan2(a, b),
    lambda a, b: a > b,
    lambda a, b: a == b,
    lambda a, b: a ** b.abs(),
]


def _in_place_cases() -> list[tuple[Op, Op]]:
    """(op on a ShardedTensor pair, same op on plain tensors): each mutates its first operand
    and returns it."""

    def iadd(a: Any, b: Any) -> Any:
        a += b
        return a

    def iadd_scalar(a: Any, b: Any) -> Any:
        a += 1.5
        return a

    def itruediv(a: Any, b: Any) -> Any:
        a /= 4
        return a

    def imul(a: Any, b: Any) -> Any:
        a *= b
        return a

    same: list[Op] = [
        iadd,
        iadd_scalar,
        itruediv,
        imul,
        lambda a, b: a.add_(b),
        lambda a, b: a.add_(b, alpha=-2),
        lambda a, b: a.sub_(3),
        lambda a, b: a.mul_(b),
        lambda a, b: a.div_(2),
        lambda a, b: a.neg_(),
        lambda a, b: a.exp_(),
        lambda a, b: a.clamp_(min=0),
        lambda a, b: F.relu(a, inplace=True),
        lambda a, b: torch.relu_(a),
    ]
    return [(op, op) for op in same]


# -- element-wise -------------------------------------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unary_ops_match_the_unsharded_op(layout: str) -> None:
    spec, size = LAYOUTS[layout]
    full = seeded_full(size)
    st = from_full(full, spec)
    for op in UNARY:
        result = op(st)
        assert isinstance(result, sw.ShardedTensor)
        assert result.sharding_spec() is spec
        assert result.metadata().shards_metadata == st.metadata().shards_metadata
        assert_shards_match(result, op(full))
    # The source is untouched.
    assert_shards_match(st, full, exact=True)


@distributed(world_size=4)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_binary_ops_match_the_unsharded_op(layout: str) -> None:
    spec, size = LAYOUTS[layout]
    full_a, full_b = seeded_full(size, seed=1), seeded_full(size, seed=2)
    a, b = from_full(full_a, spec), from_full(full_b, spec)
    for op in WITH_SCALAR:
        assert_shards_match(op(a), op(full_a))
    for op in WITH_SHARDED:
        result = op(a, b)
        assert isinstance(result, sw.ShardedTensor)
        assert_shards_match(result, op(full_a, full_b), equal_nan=True)
    assert_shards_match(a, full_a, exact=True)
    assert_shards_match(b, full_b, exact=True)


@distributed(world_size=4)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_ops_mutate_the_shards_and_return_self(layout: str) -> None:
    spec, size = LAYOUTS[layout]
    full_b = seeded_full(size, seed=2)
    b = from_full(full_b, spec)
    for sharded_op, plain_op in _in_place_cases():
        full_a = seeded_full(size, seed=1)
        a = from_full(full_a, spec)
        shard_tensors = [shard.tensor for shard in a.local_shards()]
        pointers = [tensor.data_ptr() for tensor in shard_tensors]
        assert sharded_op(a, b) is a
        expected = plain_op(full_a.clone(), full_b)
        assert_shards_match(a, expected)
        assert [shard.tensor for shard in a.local_shards()] == shard_tensors
        assert [tensor.data_ptr() for tensor in shard_tensors] == pointers
    assert_shards_match(b, full_b, exact=True)


@distributed(world_size=4)
def test_dtype_promotion_follows_torch() -> None:
    spec, size = LAYOUTS["two_ranks"]
    ints = seeded_full(size, torch.int64, seed=3)
    int32s = seeded_full(size, torch.int32, seed=4)
    bools = seeded_full(size, torch.bool, seed=5)
    floats = seeded_full(size, seed=6)
    doubles = seeded_full(size, torch.float64, seed=7)
    complexes = seeded_full(size, torch.complex64, seed=8)
    cases: list[tuple[Op, tuple[torch.Tensor, ...], torch.dtype]] = [
        (lambda t: t / 2, (ints,), torch.float32),
        (lambda t: t + 1.5, (ints,), torch.float32),
        (lambda t: t * 2, (ints,), torch.int64),
        (lambda t: t // 3, (ints,), torch.int64),
        (lambda t: t + 1, (bools,), torch.int64),
        (lambda t: t & 6, (ints,), torch.int64),
        (lambda t: ~t, (bools,), torch.bool),
        (lambda t: t > 0, (ints,), torch.bool),
        (torch.sqrt, (ints.abs(),), torch.float32),
        (lambda t: t * 2, (doubles,), torch.float64),
        (lambda t: t * 2j, (floats,), torch.complex64),
        (lambda t: t.abs(), (complexes,), torch.float32),
        (lambda a, b: a + b, (ints, int32s), torch.int64),
        (lambda a, b: a / b, (ints, int32s.abs() + 1), torch.float32),
        (lambda a, b: a + b, (floats, doubles), torch.float64),
        (lambda a, b: a * b, (bools, floats), torch.float32),
    ]
    for op, fulls, dtype in cases:
        result = op(*(from_full(full, spec) for full in fulls))
        assert result.dtype == dtype
        assert result.metadata().tensor_properties.dtype == dtype
        assert_shards_match(result, op(*fulls))
        assert result.requires_grad is False


@distributed(world_size=4)
def test_in_place_op_that_cannot_keep_the_dtype_fails_on_every_rank() -> None:
    # Ranks 0 and 3 own no shard and still raise (the check does not need the data).
    spec, size = LAYOUTS["two_ranks"]
    full = seeded_full(size, torch.int64)
    st = from_full(full, spec)
    message = "^" + re.escape("result type Float can't be cast to the desired output type Long")

    def iadd() -> None:
        nonlocal st
        st += 0.5

    for call in (lambda: st.div_(2), lambda: st.mul_(1.5), iadd, lambda: st.sqrt_()):
        with pytest.raises(RuntimeError, match=message):
            call()
    assert_shards_match(st, full, exact=True)


@distributed(world_size=4)
def test_mixing_with_a_plain_tensor_is_not_supported() -> None:
    st = sw.rand(chunk_spec(0), 8, 4)
    plain = torch.ones(8, 4)
    cases: list[Callable[[], object]] = [
        lambda: torch.add(st, plain),
        lambda: st + plain,
        lambda: plain + st,
        lambda: st * plain,
        lambda: torch.mul(plain, st),
        lambda: st + torch.tensor(2.0),  # a 0-d tensor is a plain tensor too
        lambda: torch.maximum(st, plain),
        lambda: st.add_(plain),
        lambda: torch.clamp(st, min=torch.tensor(0.5)),
        lambda: torch.add(st, 1, out=plain),
    ]
    before = st.local_tensor().clone()
    for call in cases:
        with pytest.raises(RuntimeError, match=NOT_SUPPORTED):
            call()
    assert_close(st.local_tensor(), before, exact=True)
    assert_close(plain, torch.ones(8, 4), exact=True)


@distributed(world_size=4)
def test_mismatched_layouts_raise_on_every_rank() -> None:
    full = seeded_full((8, 8))
    rows = from_full(full, chunk_spec(0))
    cols = from_full(full, chunk_spec(1))
    reordered = from_full(full, chunk_spec(0, [1, 0, 3, 2]))
    smaller = from_full(full[:, :6].contiguous(), chunk_spec(0))
    for other in (cols, reordered, smaller):
        with pytest.raises(ValueError, match=_layout_mismatch("add")):  # `+` is Tensor.add
            rows + other
        with pytest.raises(ValueError, match=_layout_mismatch("add")):
            torch.add(rows, other, alpha=2)
        with pytest.raises(ValueError, match=_layout_mismatch("mul_")):
            rows.mul_(other)
        with pytest.raises(ValueError, match=_layout_mismatch("maximum")):
            torch.maximum(other, rows)
    # Nothing was modified by the failed in-place op.
    assert_shards_match(rows, full, exact=True)

    # Same global layout, but one rank lists its two local shards in another order.
    spec = chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0])
    a, b = from_full(seeded_full((16, 2)), spec), from_full(seeded_full((16, 2)), spec)
    if dist.get_rank() == 2:
        b._local_shards.reverse()
        with pytest.raises(ValueError, match="are not in the same order"):
            a + b
    else:
        assert_shards_match(a + b, seeded_full((16, 2)) * 2)


# -- autograd -------------------------------------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("layout", ["uneven_rows", "two_per_rank", "two_ranks"])
def test_backward_through_element_wise_ops(layout: str) -> None:
    spec, size = LAYOUTS[layout]
    full_x, full_w = seeded_full(size, seed=1), seeded_full(size, seed=2)
    x = from_full(full_x, spec, requires_grad=True)
    w = from_full(full_w, spec, requires_grad=True)
    y = torch.sigmoid(x * 3 + 1) * w - F.gelu(x) / 2
    assert y.requires_grad is True
    assert y.metadata().tensor_properties.requires_grad is True
    assert all(shard.tensor.grad_fn is not None for shard in y.local_shards())
    # The local part of sum(y): gradients are element-wise, so each shard's gradient is the
    # matching slice of the unsharded gradient.
    local = [shard.tensor.sum() for shard in y.local_shards()]
    if local:
        torch.stack(local).sum().backward()

    ref_x = full_x.clone().requires_grad_(True)
    ref_w = full_w.clone().requires_grad_(True)
    (torch.sigmoid(ref_x * 3 + 1) * ref_w - F.gelu(ref_x) / 2).sum().backward()
    for st, ref in ((x, ref_x), (w, ref_w)):
        grads = [shard.tensor.grad for shard in st.local_shards()]
        assert all(grad is not None for grad in grads)
        for shard in st.local_shards():
            assert_close(shard.tensor.grad, narrow(ref.grad, shard.metadata))


@distributed(world_size=4)
def test_autograd_rules_of_element_wise_ops() -> None:
    spec, size = LAYOUTS["rows"]
    full = seeded_full(size)
    x = from_full(full, spec, requires_grad=True)

    with torch.no_grad():
        y = x * 2
    assert y.requires_grad is False
    assert not y.local_tensor().requires_grad
    assert (x.detach() + 1).requires_grad is False

    # In place on a leaf that requires grad: torch's own error.
    with pytest.raises(RuntimeError, match="^" + re.escape(LEAF_IN_PLACE)):
        x.add_(1)
    with pytest.raises(RuntimeError, match="^" + re.escape(LEAF_IN_PLACE)):
        F.relu(x, inplace=True)

    # In place on a non-leaf is fine and recorded.
    y = x * 2
    assert y.add_(1) is y
    y += x
    assert F.relu(y, inplace=True) is y
    assert y.requires_grad is True
    y.local_tensor().sum().backward()
    expected = torch.where(full * 3 + 1 > 0, 3.0, 0.0)
    assert_close(x.local_tensor().grad, expected[2 * dist.get_rank() : 2 * dist.get_rank() + 2])

    # In place with an operand that requires grad makes the result require grad, as in torch.
    x.local_tensor().grad = None
    acc = sw.zeros(spec, size)
    assert acc.requires_grad is False
    acc.add_(x, alpha=3)
    assert acc.requires_grad is True
    assert acc.metadata().tensor_properties.requires_grad is True
    doubled = acc * 2  # still a consistent ShardedTensor
    assert doubled.requires_grad is True
    doubled.local_tensor().sum().backward()
    assert_close(x.local_tensor().grad, torch.full((2, 6), 6.0))


# -- reductions ---------------------------------------------------------------------------------

REDUCTIONS: list[Op] = [
    torch.sum,
    lambda t: t.sum(),
    lambda t: torch.sum(t, dtype=torch.float64),
    torch.mean,
    lambda t: t.mean(),
    torch.max,
    lambda t: t.max(),
    torch.amax,
    torch.min,
    lambda t: t.min(),
    torch.amin,
    torch.norm,
    lambda t: t.norm(),
    lambda t: torch.norm(t, p=1),
    lambda t: t.norm(3),
    lambda t: torch.norm(t, p=math.inf),
    lambda t: torch.norm(t, p=-math.inf),
    lambda t: torch.norm(t, p=0),
    lambda t: torch.norm(t, dtype=torch.float64),
    torch.linalg.vector_norm,
    lambda t: torch.linalg.vector_norm(t, 2.5),
    lambda t: torch.linalg.vector_norm(t, ord=1),
    lambda t: torch.linalg.vector_norm(t, ord=math.inf),
]


def _check_reduction(op: Op, st: Any, full: torch.Tensor) -> None:
    """``op(st)`` equals ``op(full)`` and is the same on every rank; if torch refuses
    ``op(full)``, ``op(st)`` raises the same error on every rank."""
    try:
        expected = op(full)
    except Exception as error:
        with pytest.raises(type(error), match="^" + re.escape(str(error)) + "$"):
            op(st)
        return
    result = op(st)
    assert type(result) is torch.Tensor
    assert result.shape == torch.Size([])
    assert_close(result, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert_same_on_all_ranks(result, st._process_group)


@distributed(world_size=4)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_reductions_match_the_unsharded_op(layout: str) -> None:
    spec, size = LAYOUTS[layout]
    full = seeded_full(size, seed=11)
    st = from_full(full, spec)
    for op in REDUCTIONS:
        _check_reduction(op, st, full)


@distributed(world_size=4)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.int64, torch.bool, torch.complex64]
)
def test_full_reductions_of_other_dtypes(dtype: torch.dtype) -> None:
    # Every case either matches torch or raises torch's own error (int mean, complex max...).
    for layout in ("uneven_rows", "two_ranks"):
        spec, size = LAYOUTS[layout]
        full = seeded_full(size, dtype, seed=12)
        st = from_full(full, spec)
        for op in REDUCTIONS:
            with warnings.catch_warnings():
                # sum(complex, dtype=float64) drops the imaginary part with torch's UserWarning,
                # for the sharded tensor as for the plain one.
                warnings.filterwarnings("ignore", "Casting complex values to real", UserWarning)
                _check_reduction(op, st, full)


@distributed(world_size=4)
def test_full_reductions_of_an_empty_tensor() -> None:
    # Every shard is empty: torch's answers for empty tensors (0, nan, or its error).
    for dtype in (torch.float32, torch.int64):
        full = torch.empty(0, 3, dtype=dtype)
        st = from_full(full, sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)]))
        for op in REDUCTIONS:
            _check_reduction(op, st, full)


@distributed(world_size=4)
def test_reductions_propagate_nan_and_inf_from_any_rank() -> None:
    spec, size = LAYOUTS["two_per_rank"]
    ops: list[Op] = [torch.max, torch.min, torch.amax, torch.amin, torch.sum, torch.mean]
    ops += [torch.norm, lambda t: torch.norm(t, p=math.inf), lambda t: torch.norm(t, p=-math.inf)]
    for row in (5, 15):  # owned by rank 2, and by rank 0 (its second shard)
        for value in (math.nan, math.inf, -math.inf):
            full = seeded_full(size, seed=13)
            full[row, 1] = value
            st = from_full(full, spec)
            for op in ops:
                _check_reduction(op, st, full)


@distributed(world_size=4)
def test_reductions_on_a_group_object_and_with_requires_grad() -> None:
    group = dist.new_group([3, 1, 2, 0])
    full = seeded_full((9, 4), seed=14)
    st = from_full(full, chunk_spec(1, [3, 1, 2, 0]), requires_grad=True, process_group=group)
    for op in (torch.sum, torch.mean, torch.max, torch.min, torch.norm):
        _check_reduction(op, st, full.detach())


@distributed(world_size=4)
def test_reductions_along_a_dim_are_not_supported() -> None:
    st = sw.rand(chunk_spec(0), 8, 4)
    cases: list[Callable[[], object]] = [
        lambda: st.sum(0),
        lambda: torch.sum(st, dim=1),
        lambda: torch.mean(st, 0),
        lambda: torch.max(st, 0),
        lambda: torch.max(st, dim=1, keepdim=True),
        lambda: torch.max(st, st),
        lambda: torch.amin(st, dim=0),
        lambda: st.norm(dim=0),
        lambda: torch.norm(st, p="nuc"),
        lambda: torch.norm(st, keepdim=True),
        lambda: torch.linalg.vector_norm(st, dim=0),
        lambda: torch.mean(st, dim=[0], keepdim=True),
    ]
    for call in cases:
        with pytest.raises(RuntimeError, match=NOT_SUPPORTED):
            call()
