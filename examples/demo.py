"""The shardwise demo: ``make demo``.

1. Pure spec math: the shard layout a ChunkShardingSpec and an EnumerableShardingSpec produce
   for a small tensor over 4 ranks (no processes needed).
2. Four real gloo ranks on this machine: a row-sharded and a grid-sharded tensor, a real tensor
   scattered from rank 0 and gathered back, with a table of who holds which block.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardwise as sw

WORLD_SIZE = 4


def row_spec() -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(WORLD_SIZE)])


def grid_spec() -> sw.EnumerableShardingSpec:
    # An uneven 2x2 grid of a 10x6 tensor: rows split 4/6, columns 2/4.
    return sw.EnumerableShardingSpec(
        [
            sw.ShardMetadata([0, 0], [4, 2], "rank:0/cpu"),
            sw.ShardMetadata([0, 2], [4, 4], "rank:1/cpu"),
            sw.ShardMetadata([4, 0], [6, 2], "rank:2/cpu"),
            sw.ShardMetadata([4, 2], [6, 4], "rank:3/cpu"),
        ]
    )


def print_layout(title: str, metadata: sw.ShardedTensorMetadata) -> None:
    print(f"\n{title}: global size {list(metadata.size)}")
    print(f"  {'placement':<12} {'offsets':<10} {'sizes':<10}")
    for shard in metadata.shards_metadata:
        print(f"  {shard.placement!s:<12} {shard.shard_offsets!s:<10} {shard.shard_sizes!s:<10}")


def spec_math() -> None:
    print("== Shard layouts (pure spec math, no processes) ==")
    properties = sw.TensorProperties()
    print_layout(
        "ChunkShardingSpec(dim=0) over 4 ranks, 10x6",
        row_spec().build_metadata(torch.Size([10, 6]), properties),
    )
    print_layout(
        "ChunkShardingSpec(dim=0) over 4 ranks, 5x6 (empty last chunk)",
        row_spec().build_metadata(torch.Size([5, 6]), properties),
    )
    print_layout(
        "EnumerableShardingSpec 2x2 grid, 10x6",
        grid_spec().build_metadata(torch.Size([10, 6]), properties),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
        for name, spec in (("row-sharded", row_spec()), ("grid-sharded", grid_spec())):
            st = sw.shard_tensor(full, spec, src_rank=0)
            held = [
                (rank, shard.metadata.shard_offsets, shard.metadata.shard_sizes,
                 float(shard.tensor.sum()))
                for shard in st.local_shards()
            ]
            table: list[object] = [None] * WORLD_SIZE
            dist.all_gather_object(table, held)
            out = torch.empty(10, 6) if rank == 0 else None
            st.gather(dst=0, out=out)
            if rank == 0:
                assert out is not None
                ok = torch.equal(out, full)
                print(f"\n{name}: scatter from rank 0, gather back -> equal: {ok}")
                print(f"  {'rank':<5} {'offsets':<10} {'sizes':<10} {'sum of block':>12}")
                for rows in table:
                    for owner, offsets, sizes, total in rows:  # type: ignore[union-attr]
                        print(f"  {owner:<5} {offsets!s:<10} {sizes!s:<10} {total:>12.1f}")
                if not ok:
                    raise SystemExit(f"{name}: gathered tensor differs from the original")
    finally:
        dist.destroy_process_group()


def distributed_demo() -> None:
    print("\n== 4 gloo ranks: scatter from rank 0, gather back to rank 0 ==")
    sys.stdout.flush()
    mp.spawn(_rank_main, args=(_free_port(),), nprocs=WORLD_SIZE, join=True)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec_math()
    distributed_demo()
    print("\ndemo finished")


if __name__ == "__main__":
    main()
