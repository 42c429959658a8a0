"""Time shard-overlap validation on large layouts.

Run ``python bench/overlap_validation.py``. For each layout it prints the number of shards
and the median wall time of :func:`validate_non_overlapping_shards_metadata` plus
:func:`check_tensor` (what building an ``EnumerableShardingSpec`` costs), then compares the
validation with a brute-force all-pairs check at a size where that is still feasible, and
with upstream ``torch.distributed._shard`` when it is installed.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

from shardwise.metadata import ShardMetadata
from shardwise.sharding_spec import check_tensor, validate_non_overlapping_shards_metadata

Box = tuple[list[int], list[int]]


def grid(shape: Sequence[int]) -> list[Box]:
    """Unit cells of a tensor of size ``shape`` (one shard per element)."""
    return [([*cell], [1] * len(shape)) for cell in itertools.product(*(range(n) for n in shape))]


def guillotine(size: Sequence[int], count: int, seed: int) -> list[Box]:
    """``count`` boxes from repeatedly cutting the largest box at a random point."""
    rng = random.Random(seed)
    heap: list[tuple[int, int, list[int], list[int]]] = [
        (-_volume(size), 0, [0] * len(size), [*size])
    ]
    serial = 1
    while len(heap) < count:
        _, _, offsets, sizes = heapq.heappop(heap)
        dim = rng.choice([d for d, n in enumerate(sizes) if n > 1])
        cut = rng.randint(1, sizes[dim] - 1)
        for start, length in ((0, cut), (cut, sizes[dim] - cut)):
            part_offsets, part_sizes = [*offsets], [*sizes]
            part_offsets[dim] += start
            part_sizes[dim] = length
            heapq.heappush(heap, (-_volume(part_sizes), serial, part_offsets, part_sizes))
            serial += 1
    return [(offsets, sizes) for _, _, offsets, sizes in heap]


def _volume(sizes: Sequence[int]) -> int:
    volume = 1
    for n in sizes:
        volume *= n
    return volume


def brute_force(shards: Sequence[ShardMetadata]) -> None:
    """All-pairs overlap check: the quadratic baseline."""
    for a, b in itertools.combinations(shards, 2):
        if all(
            max(oa, ob) < min(oa + sa, ob + sb)
            for oa, sa, ob, sb in zip(
                a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes, strict=True
            )
        ):
            raise ValueError(f"Shards {a} and {b} overlap")


def median_seconds(repeat: int, func: Callable[..., object], *args: object) -> float:
    """Median wall time of ``func(*args)`` over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _upstream() -> tuple[type, Callable[[list[object]], None]] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.distributed._shard.metadata import ShardMetadata as UpstreamShardMetadata
            from torch.distributed._shard.sharding_spec._internals import (
                validate_non_overlapping_shards_metadata as upstream_validate,
            )
    except ImportError:
        return None
    return UpstreamShardMetadata, upstream_validate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement")
    args = parser.parse_args()

    layouts: list[tuple[str, list[int], list[Box]]] = [
        ("1-D chunks 10000", [10_000], grid([10_000])),
        ("2-D grid 100x100", [100, 100], grid([100, 100])),
        ("3-D grid 22x22x21", [22, 22, 21], grid([22, 22, 21])),
        ("3-D grid 2x2x2500", [2, 2, 2500], grid([2, 2, 2500])),
        ("4-D grid 10x10x10x10", [10] * 4, grid([10] * 4)),
        ("2-D guillotine", [4096, 4096], guillotine([4096, 4096], 10_000, seed=0)),
        ("3-D guillotine", [512, 512, 512], guillotine([512, 512, 512], 10_000, seed=0)),
        ("2-D grid 32x32", [32, 32], grid([32, 32])),
        ("3-D grid 10x10x10", [10, 10, 10], grid([10, 10, 10])),
    ]
    brute_force_limit = 1_100
    upstream = _upstream()

    header = f"{'layout':<22} {'shards':>7} {'validate s':>11} {'check s':>9} {'all-pairs s':>12}"
    if upstream is not None:
        header += f" {'upstream s':>11}"
    print(header)
    for name, size, boxes in layouts:
        rng = random.Random(0)
        rng.shuffle(boxes)
        shards = [ShardMetadata(o, s, "rank:0/cpu") for o, s in boxes]
        validate = median_seconds(args.repeat, validate_non_overlapping_shards_metadata, shards)
        check = median_seconds(args.repeat, check_tensor, shards, size)
        row = f"{name:<22} {len(shards):>7} {validate:>11.4f} {check:>9.4f}"
        if len(shards) <= brute_force_limit:
            row += f" {median_seconds(args.repeat, brute_force, shards):>12.4f}"
        else:
            row += f" {'-':>12}"
        if upstream is not None:
            upstream_class, upstream_validate = upstream
            upstream_shards = [upstream_class(o, s, "rank:0/cpu") for o, s in boxes]
            row += f" {median_seconds(1, upstream_validate, upstream_shards):>11.4f}"
        print(row)


if __name__ == "__main__":
    main()
