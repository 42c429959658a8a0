"""Launching a benchmark's ranks: shared by bench/checkpoint.py and bench/training_state.py."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def collective_time(operation: Callable[[], object]) -> float:
    """Seconds of ``operation`` on every rank, barrier to barrier."""
    dist.barrier()
    start = time.perf_counter()
    operation()
    dist.barrier()
    return time.perf_counter() - start


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: the rendezvous port of a benchmark's world."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


@contextlib.contextmanager
def work_dir(root: str, prefix: str) -> Iterator[str]:
    """A new directory under ``root`` (a benchmark's checkpoints), removed afterwards."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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


def run_rank(
    rank: int,
    config: Any,
    world_size: int,
    timeout_seconds: int,
    body: Callable[[], dict[str, Any]],
) -> None:
    """One rank's process: a gloo group on 127.0.0.1:``config.port`` with one compute thread
    (as torchrun sets it with several ranks per machine), ``body`` run in it, and its result
    written by rank 0 to ``config.results``. Any failure ends the process at once: a peer may
    be blocked in a collective, so nothing waits for it."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(config.port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_seconds)
    )
    try:
        payload = body()
        if rank == 0:
            with open(config.results, "w") as file:
                json.dump(payload, file)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rotate(items: list[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift``: each repetition starts with another method, so no
    method always runs first (cold) or last."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def freeze_gc() -> None:
    """Collect once and freeze what survives: later collections (before every measurement)
    then skip the long-lived objects of torch and of the state (a full one costs ~0.5 s)."""
    gc.collect()
    gc.freeze()
