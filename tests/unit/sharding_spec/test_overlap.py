"""validate_non_overlapping_shards_metadata: upstream's verdicts, reported pairs, scale."""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.metadata import ShardMetadata
from shardwise.sharding_spec import check_tensor, validate_non_overlapping_shards_metadata
from shardwise.sharding_spec._internals import (
    _check_shard_metadata_pair_overlap,
    _find_1d_overlapping_shards,
    _find_nd_overlapping_shards,
)
from tests.unit.sharding_spec._layouts import (
    PLACEMENT,
    cut_points,
    reference_overlap,
    tensor_size,
    tiling,
)


def shard(offsets: list[int], sizes: list[int], placement: str = PLACEMENT) -> ShardMetadata:
    return ShardMetadata(offsets, sizes, placement)


def overlap_message(a: ShardMetadata, b: ShardMetadata) -> str:
    return re.escape(f"Shards {a} and {b} overlap")


def verdict(shards: Sequence[ShardMetadata]) -> bool:
    try:
        validate_non_overlapping_shards_metadata(shards)
    except ValueError as err:
        assert str(err).startswith("Shards ") and str(err).endswith(" overlap")
        return True
    return False


class TestSpecialCases:
    @pytest.mark.parametrize("count", [0, 1])
    def test_zero_or_one_shard(self, count: int) -> None:
        validate_non_overlapping_shards_metadata([shard([3, 3], [5, 5])] * count)

    def test_identical_shards_overlap(self) -> None:
        a, b = shard([0, 0], [2, 2]), shard([0, 0], [2, 2], "rank:1/cpu")
        with pytest.raises(ValueError, match=overlap_message(a, b)):
            validate_non_overlapping_shards_metadata([a, b, shard([0, 0], [2, 2])])

    def test_identical_empty_shards_away_from_origin_overlap(self) -> None:
        a, b = shard([1, 0], [0, 2]), shard([1, 0], [0, 2])
        with pytest.raises(ValueError, match=overlap_message(a, b)):
            validate_non_overlapping_shards_metadata([a, b])

    def test_identical_empty_shards_at_origin_are_fine(self) -> None:
        validate_non_overlapping_shards_metadata([shard([0, 0], [0, 2]), shard([0, 0], [0, 2])])

    @pytest.mark.parametrize(
        "shards",
        [
            [shard([0, 0], [5, 5]), shard([5, 0], [5, 5])],
            [shard([0, 0], [5, 5]), shard([0, 5], [5, 5])],
            [shard([5, 0, 5], [5, 5, 5]), shard([5, 5, 5], [5, 5, 5])],
            [shard([0, 0], [2, 2]), shard([2, 2], [2, 2]), shard([0, 2], [2, 2])],
            [shard([0, 0, 0], [1, 1, 1]), shard([1, 1, 1], [1, 1, 1])],
        ],
    )
    def test_touching_is_not_overlap(self, shards: list[ShardMetadata]) -> None:
        validate_non_overlapping_shards_metadata(shards)

    @pytest.mark.parametrize(
        "shards",
        [
            [shard([0, 0], [5, 5]), shard([4, 0], [5, 5])],
            [shard([0, 0], [5, 5]), shard([0, 4], [5, 5])],
            [shard([5, 0, 5], [5, 5, 5]), shard([5, 4, 5], [5, 5, 5])],
            [shard([5, 0, 5], [5, 5, 5]), shard([5, 4, 9], [5, 5, 5])],
        ],
    )
    def test_upstream_overlap_cases(self, shards: list[ShardMetadata]) -> None:
        with pytest.raises(ValueError, match=overlap_message(*shards)):
            validate_non_overlapping_shards_metadata(shards)

    def test_one_dim_reports_sorted_neighbours(self) -> None:
        # Sorted by (start, end): a=[0, 4], b=[4, 6], c=[7, 9]; b is a's neighbour.
        a, b, c = shard([0, 0], [5, 2]), shard([4, 0], [3, 2]), shard([7, 0], [3, 2])
        with pytest.raises(ValueError, match=overlap_message(a, b)):
            validate_non_overlapping_shards_metadata([c, b, a])

    def test_one_dim_reports_first_neighbour_pair(self) -> None:
        # a covers both b and c; the first neighbours in sorted order are (a, b).
        a, b, c = shard([0], [10]), shard([2], [1]), shard([5], [1])
        with pytest.raises(ValueError, match=overlap_message(a, b)):
            validate_non_overlapping_shards_metadata([c, a, b])
        assert _find_1d_overlapping_shards([c, a, b], 0) == (1, 2)

    def test_one_dim_empty_shard_inside_another_overlaps(self) -> None:
        # Upstream's interval rule along a single sharded dim: [2, 1] starts inside [0, 3].
        a, empty = shard([0, 0], [4, 2]), shard([2, 0], [0, 2])
        with pytest.raises(ValueError, match=overlap_message(a, empty)):
            validate_non_overlapping_shards_metadata([empty, a])
        validate_non_overlapping_shards_metadata([a, shard([4, 0], [0, 2])])

    def test_one_dim_all_empty_shards_never_overlap(self) -> None:
        # A 2x2 grid of a (0, 4) tensor: only dim 1 differs, and every shard is empty.
        # Upstream reported an overlap here.
        shards = tiling([[0, 0, 0], [0, 2, 4]])
        assert [s.shard_sizes for s in shards] == [[0, 2], [0, 2], [0, 2], [0, 2]]
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, [0, 4])

    def test_several_dims_empty_shards_never_overlap(self) -> None:
        box = shard([0, 0], [4, 4])
        validate_non_overlapping_shards_metadata([box, shard([1, 1], [0, 2])])
        validate_non_overlapping_shards_metadata(
            [box, shard([1, 1], [2, 0]), shard([2, 2], [0, 0])]
        )
        assert not _check_shard_metadata_pair_overlap(box, shard([1, 1], [0, 2]))

    def test_several_dims_reports_upstream_pair(self) -> None:
        # Sweep along dim 0 (shard 0 ends furthest there); c at [2, 0] is the first shard
        # that meets an active one: b ([0, 1]-[3, 4]) ends before a along the sweep dim.
        a = shard([0, 0], [6, 1])
        b = shard([0, 1], [3, 3])
        c = shard([2, 2], [2, 2])
        with pytest.raises(ValueError, match=overlap_message(b, c)):
            validate_non_overlapping_shards_metadata([a, b, c])
        assert _find_nd_overlapping_shards([a, b, c], [0, 1]) == (1, 2)

    def test_pair_predicate(self) -> None:
        a = shard([0, 0], [2, 2])
        assert _check_shard_metadata_pair_overlap(a, shard([1, 1], [2, 2]))
        assert not _check_shard_metadata_pair_overlap(a, shard([2, 0], [2, 2]))
        assert not _check_shard_metadata_pair_overlap(a, shard([0, 2], [2, 2]))


class TestLargeLayouts:
    """10,000-shard layouts (timed in bench/overlap_validation.py, not here)."""

    @pytest.mark.parametrize("shape", [(10_000,), (100, 100), (22, 22, 21)])
    def test_grid(self, shape: tuple[int, ...]) -> None:
        shards = tiling([list(range(n + 1)) for n in shape])
        random.Random(0).shuffle(shards)
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, shape)
        # Grow one cell in the middle of the longest dim into its neighbour.
        dim = max(range(len(shape)), key=lambda d: shape[d])
        index = next(i for i, s in enumerate(shards) if s.shard_offsets[dim] == shape[dim] // 2)
        grown = shard(list(shards[index].shard_offsets), list(shards[index].shard_sizes))
        grown.shard_sizes[dim] += 1
        shards[index] = grown
        with pytest.raises(ValueError, match="overlap"):
            validate_non_overlapping_shards_metadata(shards)


def grow_into_neighbour(
    shards: list[ShardMetadata], index: int, dim: int, amount: int
) -> ShardMetadata | None:
    """Shard ``index`` grown along ``dim`` into its next non-empty cell, or ``None``."""
    cell = shards[index]
    if 0 in cell.shard_sizes:
        return None
    end = cell.shard_offsets[dim] + cell.shard_sizes[dim]
    for other in shards:
        if (
            other.shard_offsets[dim] == end
            and other.shard_sizes[dim] > 0
            and all(
                other.shard_offsets[d] == cell.shard_offsets[d]
                for d in range(len(cell.shard_offsets))
                if d != dim
            )
        ):
            grown = shard(list(cell.shard_offsets), list(cell.shard_sizes))
            grown.shard_sizes[dim] += min(amount, other.shard_sizes[dim])
            return grown
    return None


def growable(shards: list[ShardMetadata]) -> list[tuple[int, int]]:
    """Every (shard index, dim) that :func:`grow_into_neighbour` can grow."""
    return [
        (index, dim)
        for index in range(len(shards))
        for dim in range(len(shards[index].shard_offsets))
        if grow_into_neighbour(shards, index, dim, 1) is not None
    ]


class TestProperties:
    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points(max_dims=4, max_inner=2), seed=st.randoms(use_true_random=False))
    def test_tilings_are_valid(self, cuts: list[list[int]], seed: random.Random) -> None:
        shards = tiling(cuts)
        seed.shuffle(shards)
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, tensor_size(cuts))
        assert not reference_overlap(shards)

    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points(), data=st.data())
    def test_grown_box_is_detected(self, cuts: list[list[int]], data: st.DataObject) -> None:
        shards = tiling(cuts)
        candidates = growable(shards)
        assume(candidates)
        index, dim = data.draw(st.sampled_from(candidates))
        grown = grow_into_neighbour(shards, index, dim, data.draw(st.integers(1, 3)))
        assert grown is not None
        shards[index] = grown
        shards = data.draw(st.permutations(shards))
        assert reference_overlap(shards)
        with pytest.raises(ValueError, match="overlap"):
            validate_non_overlapping_shards_metadata(shards)

    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points(max_dims=4, max_inner=2), data=st.data())
    def test_perturbed_tiling_agrees_with_brute_force(
        self, cuts: list[list[int]], data: st.DataObject
    ) -> None:
        shards = tiling(cuts)
        for _ in range(data.draw(st.integers(0, 2))):
            index = data.draw(st.integers(0, len(shards) - 1))
            dim = data.draw(st.integers(0, len(cuts) - 1))
            offsets, sizes = list(shards[index].shard_offsets), list(shards[index].shard_sizes)
            offsets[dim] = max(0, offsets[dim] + data.draw(st.integers(-3, 3)))
            sizes[dim] = max(0, sizes[dim] + data.draw(st.integers(-2, 3)))
            shards[index] = shard(offsets, sizes)
        shards = data.draw(st.permutations(shards))
        assert verdict(shards) == reference_overlap(shards)

    @settings(max_examples=100, deadline=None)
    @given(
        boxes=st.integers(1, 4).flatmap(
            lambda num_dims: st.lists(
                st.tuples(
                    st.lists(st.integers(0, 6), min_size=num_dims, max_size=num_dims),
                    st.lists(st.integers(0, 4), min_size=num_dims, max_size=num_dims),
                ),
                max_size=8,
            )
        )
    )
    def test_random_boxes_agree_with_brute_force(
        self, boxes: list[tuple[list[int], list[int]]]
    ) -> None:
        shards = [shard(offsets, sizes) for offsets, sizes in boxes]
        assert verdict(shards) == reference_overlap(shards)


def _upstream() -> tuple[type, Callable[..., Any], Callable[..., Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        internals = pytest.importorskip("torch.distributed._shard.sharding_spec._internals")
        metadata = pytest.importorskip("torch.distributed._shard.metadata")
    return (
        metadata.ShardMetadata,
        internals.validate_non_overlapping_shards_metadata,
        internals._find_nd_overlapping_shards,
    )


def _message(validate: Callable[..., Any], shards: Sequence[Any]) -> str | None:
    try:
        validate(shards)
    except ValueError as err:
        return str(err)
    return None


class TestAgainstUpstream:
    """Differential tests against the installed torch.distributed._shard, where it exists.

    Only non-empty shards: upstream calls an empty shard that lies strictly inside another
    box an overlap in the several-dims case, shardwise never does.
    """

    @settings(max_examples=100, deadline=None)
    @given(
        boxes=st.integers(1, 4).flatmap(
            lambda num_dims: st.lists(
                st.tuples(
                    st.lists(st.integers(0, 6), min_size=num_dims, max_size=num_dims),
                    st.lists(st.integers(1, 4), min_size=num_dims, max_size=num_dims),
                ),
                max_size=8,
            )
        )
    )
    def test_same_verdict_and_pair(self, boxes: list[tuple[list[int], list[int]]]) -> None:
        upstream_class, upstream_validate, _ = _upstream()
        ours = [shard(o, s) for o, s in boxes]
        theirs = [upstream_class(o, s, PLACEMENT) for o, s in boxes]
        assert _message(validate_non_overlapping_shards_metadata, ours) == _message(
            upstream_validate, theirs
        )

    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points(min_dims=2, max_dims=3), data=st.data())
    def test_same_pair_on_grown_grids(self, cuts: list[list[int]], data: st.DataObject) -> None:
        upstream_class, _, upstream_find = _upstream()
        shards = [s for s in tiling(cuts) if 0 not in s.shard_sizes]
        assume(len(shards) >= 2)
        candidates = growable(shards)
        assume(candidates)
        for index, dim in data.draw(st.lists(st.sampled_from(candidates), max_size=3)):
            grown = grow_into_neighbour(shards, index, dim, data.draw(st.integers(1, 3)))
            if grown is not None:
                shards[index] = grown
        shards = data.draw(st.permutations(shards))
        dims = list(range(len(cuts)))
        theirs = [upstream_class(s.shard_offsets, s.shard_sizes, PLACEMENT) for s in shards]
        assert _find_nd_overlapping_shards(shards, dims) == upstream_find(theirs, dims)


def test_reference_helper_examples() -> None:
    # The brute-force reference itself, on the cases spelled out in the reference.
    assert reference_overlap([shard([1, 0], [0, 2])] * 2)
    assert not reference_overlap([shard([0, 0], [0, 2])] * 2)
    assert not reference_overlap([shard([0, 0], [2, 2]), shard([0, 2], [2, 2])])
    assert reference_overlap([shard([0], [4]), shard([2], [0])])
    assert not reference_overlap([shard([0, 0], [4, 4]), shard([2, 2], [0, 1])])
