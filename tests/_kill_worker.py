"""A save that a test kills: one rank of ``tests/distributed/checkpoint/test_kill.py``.

Run as ``python -m tests._kill_worker PATH TAG`` from the repository root. With
``WORLD_SIZE`` > 1 in the environment (and ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) the
process joins a gloo group through ``env://`` first; otherwise it saves alone, with no group.

Protocol on stdout, one line each, flushed: ``saving`` right before ``save`` is called (the
test starts its kill timer when every rank has said it), then ``saved <seconds>`` when ``save``
returned. Any error is a traceback on stderr and exit status 1. SIGUSR1 dumps every thread's
stack to stderr.

The state dict of a tag (:func:`expected_state`) holds a row-sharded tensor (a ShardedTensor
in a group, a plain tensor alone), replicated tensors (deduplicated and spread over the ranks
by the planner), many small tensors, a JSON value and a blob: every value is distinct per tag
and per key, so a load that mixes two checkpoints is seen.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch

#: Rows and columns of the row-sharded tensor (int64: 64 MiB).
SHARDED_SIZE = (4096, 2048)
#: Replicated tensors: how many, and the size of each (int64: 4 MiB each).
NUM_REPLICATED = 4
REPLICATED_SIZE = (512, 1024)
#: Small tensors: many index entries, gathered into few writes.
NUM_SMALL = 2500
SMALL_SIZE = (16,)
#: Gloo and store timeout: a backstop only, the test kills every process far sooner.
GROUP_TIMEOUT = timedelta(seconds=60)


def _values(tag: int, key_index: int, size: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for dim in size:
        numel *= dim
    base = (tag << 40) + (key_index << 32)
    return (torch.arange(numel, dtype=torch.int64) + base).reshape(size)


def expected_state(tag: int) -> dict[str, Any]:
    """The full (unsharded) state dict that a save of ``tag`` writes."""
    state: dict[str, Any] = {"sharded": _values(tag, 0, SHARDED_SIZE)}
    state["replicated"] = {
        f"layer{i}": _values(tag, 1 + i, REPLICATED_SIZE) for i in range(NUM_REPLICATED)
    }
    state["small"] = {
        f"p{i}": _values(tag, 1 + NUM_REPLICATED + i, SMALL_SIZE) for i in range(NUM_SMALL)
    }
    state["tag"] = tag
    state["blob"] = f"blob of checkpoint {tag}".encode()
    return state


def _state_to_save(tag: int, rank: int, world_size: int) -> dict[str, Any]:
    state = expected_state(tag)
    if world_size == 1:
        return state
    import shardwise

    rows, cols = SHARDED_SIZE
    spec = shardwise.ChunkShardingSpec(
        dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)]
    )
    sharded = shardwise.empty(spec, rows, cols, dtype=torch.int64)
    for shard in sharded.local_shards():
        first = shard.metadata.shard_offsets[0]
        count = shard.metadata.shard_sizes[0]
        shard.tensor.copy_(state["sharded"][first : first + count])
    state["sharded"] = sharded
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="checkpoint directory to save to")
    parser.add_argument("tag", type=int, help="which values to save (see expected_state)")
    args = parser.parse_args(argv)
    # The test sends SIGUSR1 to a rank that seems stuck, to see where.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=GROUP_TIMEOUT)
    import shardwise.checkpoint as ckpt

    state = _state_to_save(args.tag, rank, world_size)
    print("saving", flush=True)
    start = time.perf_counter()
    ckpt.save(state, args.path, sync_files=True)
    print(f"saved {time.perf_counter() - start:.6f}", flush=True)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
