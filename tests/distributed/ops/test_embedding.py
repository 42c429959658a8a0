"""Sharded ``F.embedding`` (reference §14) on 4-rank gloo groups.

Every rank builds the same full weight (fixed seed), shards it with ``shard_tensor`` and looks
up its own ids (seeded by its rank, same shape everywhere); the result must equal
``F.embedding`` on the full weight. Each rank can rebuild every other rank's ids locally, so
the references (``max_norm`` over the union of all ids, gradients of the summed losses) need
no communication.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

import shardwise as sw
from shardwise.sharding_spec import ChunkShardingSpec
from tests.distributed.ops import WORLD_SIZE, chunk_spec, seeded_full
from tests.harness import distributed

#: Row-wise and column-wise specs, in rank order and in a permuted placement order.
SPECS = {
    "rows": (0, [0, 1, 2, 3]),
    "rows_permuted": (0, [2, 0, 3, 1]),
    "cols": (1, [0, 1, 2, 3]),
    "cols_permuted": (1, [3, 1, 0, 2]),
}

#: Weight sizes: even, uneven (13 rows: chunks 4, 4, 4, 1; 11 columns: 3, 3, 3, 2) and tiny
#: (5 x 3: the last row chunk and the last column chunk are empty).
SIZES = [(16, 8), (13, 11), (5, 3)]


def rank_ids(rank: int, shape: Sequence[int], rows: int, salt: int = 0) -> torch.Tensor:
    """The ids rank ``rank`` looks up: different on every rank, same shape everywhere."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(0, rows, tuple(shape), generator=generator)


def sharded(full: torch.Tensor, spec_name: str) -> sw.ShardedTensor:
    dim, ranks = SPECS[spec_name]
    return sw.shard_tensor(full, chunk_spec(dim, ranks))


def local_slice(weight: sw.ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank's only shard of ``weight`` holds."""
    (shard,) = weight.local_shards()
    view = full
    for dim, (offset, size) in enumerate(
        zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
    ):
        # An empty trailing chunk may start past the end (offsets are split * i).
        view = view.narrow(dim, min(offset, full.size(dim)), size)
    return view


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", SPECS)
def test_lookup_equals_the_unsharded_op(spec_name: str) -> None:
    rank = dist.get_rank()
    for rows, cols in SIZES:
        full = seeded_full((rows, cols))
        weight = sharded(full, spec_name)
        for salt, shape in enumerate([(7,), (3, 4), (2, 3, 2), (1, 2, 1, 2)]):
            ids = rank_ids(rank, shape, rows, salt)
            out = F.embedding(ids, weight)
            assert type(out) is torch.Tensor
            assert out.shape == (*shape, cols)
            # One contribution per element, whatever the layout: bit-for-bit equal.
            torch.testing.assert_close(out, F.embedding(ids, full), rtol=0, atol=0)
        # The weight is untouched.
        torch.testing.assert_close(weight.local_tensor(), local_slice(weight, full), rtol=0, atol=0)


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
def test_padding_idx_and_int32_ids(spec_name: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 6
    full = seeded_full((rows, cols))
    weight = sharded(full, spec_name)
    ids = rank_ids(rank, (4, 5), rows)
    ids[0, :2] = 3  # make sure the padding row is looked up
    for padding_idx in (3, -10, 12, 0):
        out = F.embedding(ids, weight, padding_idx=padding_idx)
        torch.testing.assert_close(out, F.embedding(ids, full, padding_idx=padding_idx))
    out = F.embedding(ids.int(), weight)
    torch.testing.assert_close(out, F.embedding(ids, full), rtol=0, atol=0)
    # Empty input: an empty result of the right shape.
    empty = torch.empty(0, 3, dtype=torch.long)
    assert F.embedding(empty, weight).shape == (0, 3, cols)


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize(("max_norm", "norm_type"), [(1.25, 2.0), (2.5, 1.0), (0.9, float("inf"))])
def test_max_norm_renormalises_the_local_shard_in_place(
    spec_name: str, max_norm: float, norm_type: float
) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 11
    full = seeded_full((rows, cols))
    weight = sharded(full, spec_name)
    stored = weight.local_tensor()
    shape = (3, 2)
    ids = rank_ids(rank, shape, rows)

    out = F.embedding(ids, weight, max_norm=max_norm, norm_type=norm_type)

    # The unsharded op applied to the ids of every rank renormalises the same rows.
    renormed = full.clone()
    every_id = torch.cat([rank_ids(r, shape, rows).reshape(-1) for r in range(WORLD_SIZE)])
    F.embedding(every_id, renormed, max_norm=max_norm, norm_type=norm_type)
    assert not torch.equal(renormed, full)  # the case does renormalise something
    assert weight.local_tensor() is stored  # in place: the stored tensor, not a new one
    # Row-wise the owner renormalises whole rows exactly as torch does; column-wise the norms
    # are summed from partial norms, so they agree to rounding.
    exact = SPECS[spec_name][0] == 0
    tol = 0.0 if exact else 1e-6
    torch.testing.assert_close(stored, local_slice(weight, renormed), rtol=tol, atol=tol)
    torch.testing.assert_close(out, F.embedding(ids, renormed), rtol=tol, atol=tol)


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
def test_embedding_module_with_a_sharded_weight(spec_name: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 6
    torch.manual_seed(0)  # same module weight on every rank
    module = nn.Embedding(rows, cols, padding_idx=4, max_norm=1.5)
    reference = nn.Embedding(rows, cols, padding_idx=4, max_norm=1.5)
    reference.load_state_dict(module.state_dict())
    dim, ranks = SPECS[spec_name]
    sw.shard_parameter(module, "weight", chunk_spec(dim, ranks))
    assert isinstance(module.weight, sw.ShardedTensor)

    ids = rank_ids(rank, (2, 5), rows)
    out = module(ids)

    with torch.no_grad():
        every_id = torch.cat([rank_ids(r, (2, 5), rows).reshape(-1) for r in range(WORLD_SIZE)])
        reference(every_id)  # renormalises the union of ids, like the sharded call did
    torch.testing.assert_close(out, reference(ids))
    torch.testing.assert_close(
        module.weight.local_tensor().detach(), local_slice(module.weight, reference.weight.detach())
    )


@distributed(world_size=4)
@pytest.mark.parametrize("spec_name", ["rows_permuted", "cols_permuted"])
def test_gradient_reaches_the_local_shard(spec_name: str) -> None:
    rank = dist.get_rank()
    rows, cols = 13, 7
    shape = (3, 4)
    full = seeded_full((rows, cols))
    dim, ranks = SPECS[spec_name]
    weight = sw.shard_tensor(full.clone().requires_grad_(), chunk_spec(dim, ranks))
    shard = weight.local_tensor()
    assert shard.requires_grad and shard.is_leaf

    def upstream_grad(r: int) -> torch.Tensor:
        return seeded_full((*shape, cols), seed=100 + r)

    out = F.embedding(rank_ids(rank, shape, rows), weight, padding_idx=5)
    assert out.requires_grad
    (out * upstream_grad(rank)).sum().backward()  # every rank runs backward (collective)

    reference = full.clone().requires_grad_()
    total = sum(
        (F.embedding(rank_ids(r, shape, rows), reference, padding_idx=5) * upstream_grad(r)).sum()
        for r in range(WORLD_SIZE)
    )
    assert isinstance(total, torch.Tensor)
    total.backward()
    assert reference.grad is not None and shard.grad is not None
    torch.testing.assert_close(shard.grad, local_slice(weight, reference.grad))


@distributed(world_size=4)
def test_negative_sharding_dims_name_rows_and_columns() -> None:
    full = seeded_full((9, 6))
    ids = rank_ids(dist.get_rank(), (5,), 9)
    for dim in (-1, -2):
        weight = sw.shard_tensor(full, chunk_spec(dim))
        torch.testing.assert_close(F.embedding(ids, weight), F.embedding(ids, full))


@distributed(world_size=4)
def test_validation_errors() -> None:
    rank = dist.get_rank()
    full = seeded_full((10, 6))
    weight = sharded(full, "rows")
    ids = rank_ids(rank, (2, 3), 10)

    with pytest.raises(TypeError, match=re.escape("input need to be torch.Tensor")):
        F.embedding([1, 2], weight)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("weight needs to be ShardedTensor")):
        F.embedding(weight, full)
    with pytest.raises(ValueError, match=re.escape("Weight needs to have exactly 2 dims")):
        F.embedding(ids, sw.shard_tensor(seeded_full((8, 2, 2)), chunk_spec(0)))

    # Upstream passes the numbers as extra arguments, so str() shows a tuple (with the number
    # of columns, not rows). Every rank raises, also those whose ids are fine.
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = -3
    with pytest.raises(ValueError, match=re.escape("Index out of range in Input")) as info:
        F.embedding(bad, weight)
    assert str(info.value) == str(("Index out of range in Input %d %d", -3, 6))
    if rank == 1:
        assert info.value.args == ("Index out of range in Input %d %d", -3, 6)
    bad = ids.clone()
    bad[1, 2] = 10
    with pytest.raises(ValueError) as info:
        F.embedding(bad, weight)
    assert info.value.args == ("Index out of range in Input %d %d", 10, 6)

    with pytest.raises(
        RuntimeError,
        match=re.escape(
            'nn.Embedding weight sharded with flag on "scale_grad_by_freq" not supported!'
        ),
    ):
        F.embedding(ids, weight, scale_grad_by_freq=True)
    with pytest.raises(
        RuntimeError,
        match=re.escape('nn.Embedding weight sharded with flag on "sparse" not supported!'),
    ):
        F.embedding(ids, weight, sparse=True)
    with pytest.raises(ValueError, match=re.escape('"max_norm" must be larger than zero!')):
        F.embedding(ids, weight, max_norm=-1.0)

    # Two placements on one rank: that rank holds two shards, the others one.
    doubled = sw.shard_tensor(full, chunk_spec(0, [0, 1, 2, 3, 0]))
    with pytest.raises(ValueError, match=re.escape("Only one local shard supported!")):
        F.embedding(ids, doubled)

    # The unsharded op's own checks run first too, with torch's messages.
    with pytest.raises(
        AssertionError, match=re.escape("Padding_idx must be within num_embeddings")
    ):
        F.embedding(ids, weight, padding_idx=10)
    with pytest.raises(RuntimeError, match="indices"):
        F.embedding(ids.float(), weight)

    # Ranks must agree on the shape of the ids and on the options.
    shaped = rank_ids(rank, (2, 3) if rank else (3, 2), 10)
    expected = (
        "F.embedding with a sharded weight needs the same input shape on every rank, found "
        "[3, 2] on rank 0 and [2, 3] on rank 1"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        F.embedding(shaped, weight)
    with pytest.raises(ValueError, match=re.escape("needs the same max_norm on every rank")):
        F.embedding(ids, weight, max_norm=1.0 + rank)

    # Nothing was left half-done: a correct call still works afterwards.
    torch.testing.assert_close(F.embedding(ids, weight), F.embedding(ids, full))


@distributed(world_size=4)
def test_unsupported_sharding_dim_and_spec_errors() -> None:
    from shardwise.ops.embedding import sharded_embedding

    full = seeded_full((8, 4))
    weight = sharded(full, "rows")
    ids = rank_ids(dist.get_rank(), (3,), 8)
    # A chunk spec whose dim is no dim of a 2-D weight cannot be built through the public API;
    # swap it in to reach upstream's guard.
    weight._sharding_spec = ChunkShardingSpec(dim=2, placements=["rank:0/cpu"])
    with pytest.raises(
        RuntimeError, match=re.escape("nn.Embedding weight sharded on dim 2 not supported!")
    ):
        F.embedding(ids, weight)
    # Only reachable when the op is called directly (dispatch picks ops by spec class).
    weight._sharding_spec = sw.EnumerableShardingSpec(list(weight.metadata().shards_metadata))
    with pytest.raises(
        ValueError, match=re.escape("Only ChunkShardingSpec supported for ShardedTensor ops!")
    ):
        sharded_embedding((), (ids, weight), {}, weight._process_group)


@distributed(world_size=4)
def test_sub_group_with_placements_in_reverse_rank_order() -> None:
    # Group rank and global rank differ here (global 3 is group rank 1): the exchanges must
    # address peers by global rank and order columns by the shards' offsets.
    group = dist.new_group([1, 3])
    rank = dist.get_rank()
    if rank not in (1, 3):
        return
    full = seeded_full((9, 7))
    for dim in (0, 1):
        weight = sw.shard_tensor(full, chunk_spec(dim, [3, 1]), process_group=group)
        ids = rank_ids(rank, (2, 5), 9)
        torch.testing.assert_close(F.embedding(ids, weight), F.embedding(ids, full))
        torch.testing.assert_close(
            F.embedding_bag(ids, weight, mode="max", padding_idx=2),
            F.embedding_bag(ids, full, mode="max", padding_idx=2),
        )
