"""Property test: sharded ``F.embedding`` / ``F.embedding_bag`` equal the unsharded ops.

Hypothesis draws a whole case in the pytest process (weight size and dtype, row- or
column-wise layout in any placement order, every rank's ids, offsets, mode, per-sample
weights, ``padding_idx``, ``max_norm``, and the number of intra-op threads), and the pooled
4-rank group runs it: each rank's result, its shard after ``max_norm`` renormalisation and
the gradients of the shard and of the per-sample weights must equal the unsharded op's.

Small sizes on purpose: fewer columns or rows than ranks give shards with no columns or no
rows. Two threads matter too: torch's CPU pooling kernel splits bags over threads, and only
then did a zero-width table fail (see ``shardwise.ops.embedding``); the pool's workers run
with one thread unless a case asks for two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.distributed.ops import WORLD_SIZE, chunk_spec, from_full, seeded_full
from tests.distributed.ops.test_embedding import local_slice
from tests.harness import run_on_ranks

MODES = ["sum", "mean", "max"]


@dataclass(frozen=True)
class Case:
    """One drawn example; everything a rank needs, for every rank (ranks rebuild the others'
    inputs for the reference)."""

    bag: bool  # F.embedding_bag, else F.embedding
    rows: int
    cols: int
    dim: int  # 0: row-wise, 1: column-wise
    placement_ranks: tuple[int, ...]
    dtype: str
    ids: tuple[Any, ...]  # per rank: nested lists of one shape
    offsets: tuple[int, ...] | None  # bags of 1-D ids (same length on every rank)
    include_last_offset: bool
    mode: str
    per_sample_weights: tuple[tuple[float, ...], ...] | None  # per rank, flat
    padding_idx: int | None
    max_norm: float | None
    norm_type: float
    threads: int


@st.composite
def _ids_shape(draw: st.DrawFn, bag: bool) -> tuple[int, ...]:
    if not bag:
        return tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    if draw(st.booleans()):
        return (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return (draw(st.integers(0, 10)),)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    bag = draw(st.booleans())
    rows, cols = draw(st.integers(1, 20)), draw(st.integers(1, 9))
    shape = draw(_ids_shape(bag))
    numel = math.prod(shape)
    ids = tuple(
        torch.tensor(draw(st.lists(st.integers(0, rows - 1), min_size=numel, max_size=numel)))
        .reshape(shape)
        .tolist()
        for _ in range(WORLD_SIZE)
    )
    offsets: tuple[int, ...] | None = None
    include_last_offset = False
    if bag and len(shape) == 1:
        inner = draw(st.lists(st.integers(0, numel), max_size=4))
        include_last_offset = draw(st.booleans())
        offsets = tuple(sorted([0, *inner])) + ((numel,) if include_last_offset else ())
    mode = draw(st.sampled_from(MODES)) if bag else "sum"
    per_sample_weights = None
    if bag and mode == "sum" and draw(st.booleans()):
        values = st.floats(-2.0, 2.0, allow_nan=False, allow_subnormal=False)
        per_sample_weights = tuple(
            tuple(draw(st.lists(values, min_size=numel, max_size=numel))) for _ in range(WORLD_SIZE)
        )
    return Case(
        bag=bag,
        rows=rows,
        cols=cols,
        dim=draw(st.sampled_from([0, 1])),
        placement_ranks=tuple(draw(st.permutations(range(WORLD_SIZE)))),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        ids=ids,
        offsets=offsets,
        include_last_offset=include_last_offset,
        mode=mode,
        per_sample_weights=per_sample_weights,
        padding_idx=draw(st.none() | st.integers(-rows, rows - 1)),
        max_norm=draw(st.none() | st.floats(0.25, 3.0)),
        norm_type=draw(st.sampled_from([1.0, 2.0, 3.5])),
        threads=draw(st.sampled_from([1, 2])),
    )


def _inputs(case: Case, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    """Rank ``rank``'s ids and keyword arguments (per-sample weights are fresh leaves)."""
    ids = torch.tensor(case.ids[rank], dtype=torch.int64)
    kwargs: dict[str, Any] = {"padding_idx": case.padding_idx}
    if case.bag:
        kwargs["mode"] = case.mode
        kwargs["include_last_offset"] = case.include_last_offset
        if case.offsets is not None:
            kwargs["offsets"] = torch.tensor(case.offsets, dtype=torch.int64)
        if case.per_sample_weights is not None:
            weights = torch.tensor(case.per_sample_weights[rank], dtype=dtype)
            kwargs["per_sample_weights"] = weights.reshape(ids.shape).requires_grad_()
    return ids, kwargs


def _op(case: Case) -> Any:
    return F.embedding_bag if case.bag else F.embedding


def _check_case(case: Case) -> None:
    rank = dist.get_rank()
    dtype = getattr(torch, case.dtype)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    op = _op(case)
    full = seeded_full((case.rows, case.cols), dtype=dtype, seed=case.rows * 31 + case.cols)
    weight = from_full(full, chunk_spec(case.dim, case.placement_ranks), requires_grad=True)
    (shard,) = weight.local_shards()

    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        ids, kwargs = _inputs(case, rank, dtype)
        norm = {"max_norm": case.max_norm, "norm_type": case.norm_type}
        out = op(ids, weight, **kwargs, **norm)
        coefficients = seeded_full(out.shape, dtype=dtype, seed=100 + rank)
        (out * coefficients).sum().backward()  # every rank: the backward is collective

        # The reference: the unsharded weight renormalised by the ids of every rank (what
        # the sharded op does to the stored shards), then every rank's loss on one weight.
        renormed = full.clone()
        if case.max_norm is not None:
            every_id = torch.cat([torch.tensor(i, dtype=torch.int64).reshape(-1) for i in case.ids])
            F.embedding(every_id, renormed, **norm)
        reference = renormed.clone().requires_grad_()
        losses, own_weights = [], None
        for r in range(WORLD_SIZE):
            ids_r, kwargs_r = _inputs(case, r, dtype)
            out_r = op(ids_r, reference, **kwargs_r)
            if r == rank:
                expected = out_r.detach()
                own_weights = kwargs_r.get("per_sample_weights")
            losses.append((out_r * seeded_full(out_r.shape, dtype=dtype, seed=100 + r)).sum())
        torch.stack(losses).sum().backward()
    finally:
        torch.set_num_threads(threads)

    assert type(out) is torch.Tensor and out.shape == expected.shape
    torch.testing.assert_close(out.detach(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(
        shard.tensor.detach(), local_slice(weight, renormed), rtol=tol, atol=tol
    )
    assert reference.grad is not None and shard.tensor.grad is not None
    torch.testing.assert_close(
        shard.tensor.grad, local_slice(weight, reference.grad), rtol=tol, atol=tol
    )
    mine = kwargs.get("per_sample_weights")
    if mine is not None:
        assert own_weights is not None and own_weights.grad is not None
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad, own_weights.grad, rtol=tol, atol=tol)


@pytest.mark.distributed(world_size=WORLD_SIZE, fresh=False, rpc=False)
@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_sharded_embedding_ops_equal_the_unsharded_ops(case: Case) -> None:
    run_on_ranks(_check_case, WORLD_SIZE, args=(case,))


def _upstream_inputs(dim: int) -> None:
    """Upstream's random test inputs for the sharded op: ids ``[5, 5]``, weight 17 x 14, mode
    ``sum``. Its validation step failed with ``Expected i < index_size`` whenever torch used
    more than one thread (the stand-in weight had no columns)."""
    rank = dist.get_rank()
    full = seeded_full((17, 14))
    weight = from_full(full, chunk_spec(dim))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(5):
            generator = torch.Generator().manual_seed(10 * seed + rank)
            ids = torch.randint(0, 17, (5, 5), generator=generator)
            out = F.embedding_bag(ids, weight, mode="sum")
            torch.testing.assert_close(out, F.embedding_bag(ids, full, mode="sum"))
        # A shard with no columns (3 columns over 4 ranks: 1, 1, 1, 0) on the same path.
        narrow = seeded_full((17, 3))
        ids = torch.randint(0, 17, (5, 5), generator=torch.Generator().manual_seed(rank))
        out = F.embedding_bag(ids, from_full(narrow, chunk_spec(dim)), mode="sum")
        torch.testing.assert_close(out, F.embedding_bag(ids, narrow, mode="sum"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.distributed(world_size=WORLD_SIZE, fresh=False, rpc=False)
@pytest.mark.parametrize("dim", [0, 1])
def test_upstream_inputs_with_two_threads(dim: int) -> None:
    run_on_ranks(_upstream_inputs, WORLD_SIZE, args=(dim,))
