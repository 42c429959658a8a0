"""Launching a benchmark's ranks: shared by bench/checkpoint.py and bench/training_state.py."""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable
from typing import Any


def run_world(target: Callable[..., Any], config: Any, world_size: int) -> dict[str, Any]:
    """Run ``target(rank, config)`` in ``world_size`` fresh processes and return the JSON
    results rank 0 wrote to ``config.results``; a failing rank stops them all."""
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=target, args=(rank, config), name=f"bench-rank{rank}")
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        while any(p.is_alive() for p in processes):
            if any(p.exitcode not in (None, 0) for p in processes):
                raise SystemExit("a rank failed (traceback above)")
            time.sleep(0.2)
        if any(p.exitcode != 0 for p in processes):
            raise SystemExit("a rank failed (traceback above)")
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    with open(config.results) as file:
        result: dict[str, Any] = json.load(file)
    return result


def fresh_dir(path: str, rank: int) -> str:
    """``path`` emptied by rank 0 (collective: every rank waits for it)."""
    import shutil

    import torch.distributed as dist

    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def remove_dir(path: str, rank: int) -> None:
    """``path`` removed by rank 0 once every rank is done with it (collective)."""
    import torch.distributed as dist

    dist.barrier()
    fresh_dir(path, rank)
