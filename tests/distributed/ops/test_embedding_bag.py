"""Sharded ``F.embedding_bag`` (reference §14) on 4-rank gloo groups.

Same scheme as ``test_embedding.py``: a full weight built from a fixed seed on every rank,
sharded with ``shard_tensor``; each rank pools its own bags (ids seeded by its rank, same
shapes everywhere) and must get ``F.embedding_bag`` on the full weight. Row-wise sums add
partial sums from several ranks, so they agree with the unsharded op to rounding; column-wise
results are bit-for-bit equal.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

import shardwise as sw
from shardwise.sharding_spec import ChunkShardingSpec
from tests.distributed.ops import WORLD_SIZE, chunk_spec, seeded_full
from tests.distributed.ops.test_embedding import SIZES, SPECS, local_slice, rank_ids, sharded
from tests.harness import distributed

MODES = ["sum", "mean", "max"]


def bag_inputs(rank: int, rows: int, salt: int = 0) -> list[dict[str, Any]]:
    """Keyword sets for ``F.embedding_bag``: 2-D input, and 1-D input with offsets (with an
    empty bag)."""
    return [
        {"input": rank_ids(rank, (4, 3), rows, salt)},
        {"input": rank_ids(rank, (10,), rows, salt), "offsets": torch.tensor([0, 3, 3, 7])},
    ]


def check(
    weight: sw.ShardedTensor, full: torch.Tensor, kwargs: dict[str, Any], **options: Any
) -> torch.Tensor:
    """Pool with the sharded weight and compare with the unsharded op; returns the result."""
    kwargs = dict(kwargs)
    ids = kwargs.pop("input")
    out = F.embedding_bag(ids, weight, **kwargs, **options)
    expected = F.embedding_bag(ids, full, **kwargs, **options)
    assert type(out) is torch.Tensor
    assert out.shape == expected.shape
    spec = weight.sharding_spec()
    assert isinstance(spec, ChunkShardingSpec)
    # Column-wise every column is pooled whole on one rank: bit-for-bit equal.
    tol = 0.0 if spec.dim == 1 else 1e-6
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    return out


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", SPECS)
def test_bags_equal_the_unsharded_op(spec_name: str) -> None:
    rank = dist.get_rank()
    # The uneven and the tiny weights (the even one adds nothing here); include_last_offset
    # with "max" is in the module test.
    for salt, (rows, cols) in enumerate(SIZES[1:]):
        full = seeded_full((rows, cols))
        weight = sharded(full, spec_name)
        two_dims, one_dim = bag_inputs(rank, rows, salt)
        for mode in MODES:
            check(weight, full, two_dims, mode=mode)
            check(weight, full, one_dim, mode=mode)
        weights = seeded_full((4, 3), seed=50 + rank)
        check(weight, full, two_dims, mode="sum", per_sample_weights=weights)
        # The input size as last offset: one bag fewer than offsets.
        last = {"input": one_dim["input"], "offsets": torch.tensor([0, 2, 2, 6, 10])}
        out = check(weight, full, last, mode=MODES[salt], include_last_offset=True)
        assert out.shape == (4, cols)
        torch.testing.assert_close(weight.local_tensor(), local_slice(weight, full), rtol=0, atol=0)
    out = check(weight, full, two_dims)
    torch.testing.assert_close(out, F.embedding_bag(two_dims["input"], full, mode="mean"))


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
@pytest.mark.parametrize("mode", MODES)
def test_padding_idx_is_left_out_of_every_bag(spec_name: str, mode: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 6
    full = seeded_full((rows, cols))
    weight = sharded(full, spec_name)
    padded = rank_ids(rank, (5, 4), rows)
    padded[0] = 9  # a bag of padding only
    padded[1, :3] = 9  # padding and one other id (whose row may be on another rank)
    padded[2, 0] = 9
    flat = padded.reshape(-1)
    for padding_idx in (9, -4):
        check(weight, full, {"input": padded}, mode=mode, padding_idx=padding_idx)
        offsets = torch.tensor([0, 4, 4, 10, 11])
        check(weight, full, {"input": flat, "offsets": offsets}, mode=mode, padding_idx=padding_idx)
    if mode == "sum":
        weights = seeded_full(padded.shape, seed=7 + rank)
        check(weight, full, {"input": padded}, mode=mode, padding_idx=9, per_sample_weights=weights)


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("mode", MODES)
def test_max_norm_renormalises_the_local_shard_in_place(spec_name: str, mode: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 11
    max_norm, norm_type = (1.5, 2.0) if mode != "max" else (2.5, 1.0)
    full = seeded_full((rows, cols))
    weight = sharded(full, spec_name)
    stored = weight.local_tensor()
    ids = rank_ids(rank, (10,), rows)
    offsets = torch.tensor([0, 4, 7])

    out = F.embedding_bag(
        ids, weight, offsets, mode=mode, max_norm=max_norm, norm_type=norm_type, padding_idx=2
    )

    renormed = full.clone()
    every_id = torch.cat([rank_ids(r, (10,), rows) for r in range(WORLD_SIZE)])
    F.embedding(every_id, renormed, max_norm=max_norm, norm_type=norm_type)
    assert not torch.equal(renormed, full)
    assert weight.local_tensor() is stored
    exact = SPECS[spec_name][0] == 0
    tol = 0.0 if exact else 1e-6
    torch.testing.assert_close(stored, local_slice(weight, renormed), rtol=tol, atol=tol)
    expected = F.embedding_bag(ids, renormed, offsets, mode=mode, padding_idx=2)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
def test_embedding_bag_module_with_a_sharded_weight(spec_name: str) -> None:
    rank = dist.get_rank()
    rows, cols = 17, 6
    torch.manual_seed(0)
    module = nn.EmbeddingBag(rows, cols, mode="max", include_last_offset=True, padding_idx=3)
    reference = nn.EmbeddingBag(rows, cols, mode="max", include_last_offset=True, padding_idx=3)
    reference.load_state_dict(module.state_dict())
    dim, ranks = SPECS[spec_name]
    sw.shard_parameter(module, "weight", chunk_spec(dim, ranks))
    assert isinstance(module.weight, sw.ShardedTensor)
    ids = rank_ids(rank, (9,), rows)
    offsets = torch.tensor([0, 1, 5, 9])
    torch.testing.assert_close(module(ids, offsets), reference(ids, offsets))


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_reaches_the_local_shard(spec_name: str, mode: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 7
    full = seeded_full((rows, cols))
    dim, ranks = SPECS[spec_name]
    weight = sw.shard_tensor(full.clone().requires_grad_(), chunk_spec(dim, ranks))
    shard = weight.local_tensor()
    offsets = torch.tensor([0, 3, 3, 8])

    # In sum mode the per-sample weights are leaves too: rank r's get gradients from rank r's
    # bags only, which the other ranks pooled column- or row-wise.
    sample_weights = [
        seeded_full((12,), seed=30 + r).requires_grad_() if mode == "sum" else None
        for r in range(WORLD_SIZE)
    ]

    def call(r: int, w: Any) -> torch.Tensor:
        ids = rank_ids(r, (12,), rows)
        out = F.embedding_bag(
            ids, w, offsets, mode=mode, per_sample_weights=sample_weights[r], padding_idx=4
        )
        return (out * seeded_full((4, cols), seed=60 + r)).sum()

    call(rank, weight).backward()  # every rank runs backward (collective)
    mine = sample_weights[rank]
    mine_grad = None if mine is None else mine.grad
    for weights in sample_weights:
        if weights is not None:
            weights.grad = None
    reference = full.clone().requires_grad_()
    torch.stack([call(r, reference) for r in range(WORLD_SIZE)]).sum().backward()
    assert reference.grad is not None and shard.grad is not None
    torch.testing.assert_close(shard.grad, local_slice(weight, reference.grad))
    if mine is not None:
        assert mine_grad is not None and mine.grad is not None
        torch.testing.assert_close(mine_grad, mine.grad)


@distributed(world_size=4)
def test_validation_errors() -> None:
    rank = dist.get_rank()
    full = seeded_full((10, 6))
    weight = sharded(full, "cols")
    ids = rank_ids(rank, (2, 3), 10)
    flat = rank_ids(rank, (6,), 10)
    offsets = torch.tensor([0, 2])

    def raises(error: type[BaseException], message: str, *args: Any, **kwargs: Any) -> None:
        with pytest.raises(error, match=re.escape(message)):
            F.embedding_bag(*args, **kwargs)

    raises(TypeError, "input need to be torch.Tensor", [1, 2], weight, offsets)
    raises(TypeError, "offsets need to be torch.Tensor", flat, weight, [0, 2])
    raises(
        TypeError,
        "per_sample_weights need to be torch.Tensor",
        ids,
        weight,
        mode="sum",
        per_sample_weights=[1.0] * 6,
    )
    raises(TypeError, "weight needs to be ShardedTensor", ids, full, per_sample_weights=weight)
    raises(ValueError, "Input more than 2 dims not supported", ids.reshape(1, 2, 3), weight)
    raises(
        ValueError,
        "Weight needs to have exactly 2 dims",
        ids,
        sw.shard_tensor(seeded_full((8, 2, 2)), chunk_spec(0)),
    )
    with pytest.raises(ValueError) as info:
        F.embedding_bag(ids + 5, weight)  # ids up to 14 on some rank
    assert str(info.value).startswith("('Index out of range in Input %d %d'")
    with pytest.raises(ValueError) as info:
        F.embedding_bag(ids - 10, weight)  # every rank has a negative id
    assert info.value.args == ("Index out of range in Input %d %d", int((ids - 10).min()), 6)
    raises(ValueError, "Input dimension needs to be exactly 1 dim", ids, weight, offsets)
    raises(ValueError, "offsets is required for 1D input", flat, weight)
    raises(
        ValueError,
        "per_sample_weights size torch.Size([3]) not equal to input size torch.Size([2, 3])",
        ids,
        weight,
        mode="sum",
        per_sample_weights=torch.ones(3),
    )
    raises(ValueError, "mode 'min' is not supported", ids, weight, mode="min")
    raises(
        RuntimeError,
        'nn.Embedding weight sharded with flag on "scale_grad_by_freq" not supported!',
        ids,
        weight,
        scale_grad_by_freq=True,
    )
    raises(
        RuntimeError,
        'nn.Embedding weight sharded with flag on "sparse" not supported!',
        ids,
        weight,
        sparse=True,
    )
    raises(
        ValueError,
        'offsets is required for flag "include_last_offset"!',
        ids,
        weight,
        include_last_offset=True,
    )
    raises(
        ValueError,
        'offsets need to have the input size in the end when the flag "include_last_offset" is on!',
        flat,
        weight,
        offsets,
        include_last_offset=True,
    )
    raises(ValueError, '"max_norm" must be larger than zero!', ids, weight, max_norm=-0.5)
    doubled = sw.shard_tensor(full, chunk_spec(1, [0, 1, 2, 3, 3]))
    raises(ValueError, "Only one local shard supported!", ids, doubled)

    # The unsharded op's own checks, with torch's types and messages, before any data moves.
    raises(
        NotImplementedError,
        "per_sample_weights is only supported for mode='sum' (got mode='mean')",
        ids,
        weight,
        per_sample_weights=torch.ones(2, 3),
    )
    raises(RuntimeError, "offsets[0] has to be 0", flat, weight, torch.tensor([1, 2]))
    raises(
        RuntimeError,
        "padding_idx must be within the number of embeddings",
        ids,
        weight,
        padding_idx=10,
    )

    # Ranks must agree on shapes and options.
    raises(
        ValueError,
        "F.embedding_bag with a sharded weight needs the same offsets length on every rank, "
        "found 2 on rank 0 and 3 on rank 1",
        flat,
        weight,
        offsets if rank == 0 else torch.tensor([0, 2, 4]),
    )
    raises(
        ValueError,
        "needs the same mode on every rank, found sum on rank 0 and max on rank 1",
        ids,
        weight,
        mode="sum" if rank == 0 else "max",
    )
    torch.testing.assert_close(F.embedding_bag(ids, weight), F.embedding_bag(ids, full))


@distributed(world_size=4)
def test_unsupported_sharding_dim_error() -> None:
    weight = sharded(seeded_full((8, 4)), "rows")
    weight._sharding_spec = ChunkShardingSpec(dim=3, placements=["rank:0/cpu"])
    with pytest.raises(
        RuntimeError, match=re.escape("nn.EmbeddingBag weight sharded on dim 3 not supported!")
    ):
        F.embedding_bag(rank_ids(dist.get_rank(), (2, 2), 8), weight)
