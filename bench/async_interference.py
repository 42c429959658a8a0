"""How much an async save slows the training loop that launched it (one command).

A loop of small torch ops stands in for a training step's Python work. For each state, and
for shardwise's ``async_save`` (a writer process per rank) and DCP's ``async_save`` (a thread),
interleaved in the same run, it measures:

* the loop's rate (iterations per second) while the save writes, as a share of its idle rate
  (target: >= 90% for shardwise, for both states);
* the time ``async_save`` blocks the caller, against one memcpy (clone) of the state
  (target: <= 1.2x);
* the time until the checkpoint is committed, against a synchronous ``shardwise.save`` of the
  same state (target: <= 1.2x).

States: 512 MiB in 32 tensors, and 20,000 small tensors (an optimizer state's shape).
Saves go to tmpfs (``--dir``, default /dev/shm). ``--quick`` runs smaller states once.

    python bench/async_interference.py [--quick] [--reps N] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

import shardwise.checkpoint as ckpt

_LOOP_WIDTH = 256


def _step(x: torch.Tensor) -> torch.Tensor:
    """One iteration of the stand-in training loop: a few small ops, mostly Python work."""
    for _ in range(8):
        x = x * 1.0001 + 0.5
        x = x.clamp_(-1e6, 1e6)
    return x


def _rate_while(done: Callable[[], bool], least: float = 0.0) -> float:
    """Iterations per second of the loop until ``done()`` (and at least ``least`` seconds)."""
    x = torch.ones(_LOOP_WIDTH)
    count = 0
    started = time.perf_counter()
    while True:
        x = _step(x)
        count += 1
        elapsed = time.perf_counter() - started
        if (count & 7) == 0 and done() and elapsed >= least:
            return count / elapsed


def _idle_rate(seconds: float) -> float:
    deadline = time.perf_counter() + seconds
    return _rate_while(lambda: time.perf_counter() >= deadline)


def _states(quick: bool) -> dict[str, dict[str, Any]]:
    big_count, big_numel = 32, (512 << 20) // 32 // 4
    small_count, small_numel = 20_000, 1024
    if quick:
        big_numel //= 8
        small_count //= 4
    torch.manual_seed(0)
    return {
        f"{big_count} tensors, {big_count * big_numel * 4 >> 20} MiB": {
            f"layer{i}.weight": torch.randn(big_numel) for i in range(big_count)
        },
        f"{small_count:,} small tensors, {small_count * small_numel * 4 >> 20} MiB": {
            f"state.{i}.exp_avg": torch.randn(small_numel) for i in range(small_count)
        },
    }


def _memcpy_seconds(state: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    copies = [t.clone() for t in state.values()]
    seconds = time.perf_counter() - started
    del copies
    return seconds


def _shardwise_async(state: dict[str, Any], path: str) -> Future[Any]:
    return ckpt.async_save(state, path)


def _dcp_async(state: dict[str, Any], path: str) -> Future[Any]:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp.async_save(state, checkpoint_id=path)  # type: ignore[return-value]


def _one(method: str, state: dict[str, Any], path: str, idle: float) -> dict[str, float]:
    start = _shardwise_async if method == "shardwise" else _dcp_async
    gc.collect()
    called = time.perf_counter()
    future = start(state, path)
    blocked = time.perf_counter() - called
    rate = _rate_while(future.done, least=0.05)
    future.result()
    committed = time.perf_counter() - called
    return {"share": rate / idle, "blocked": blocked, "committed": committed}


def _sync_seconds(state: dict[str, Any], path: str) -> float:
    gc.collect()
    started = time.perf_counter()
    ckpt.save(state, path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller states, one repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="where checkpoints go (tmpfs)")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="shardwise-async-bench-", dir=args.dir)
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, checkpoints in {args.dir}")
    ok = True
    try:
        # Warm up: the writer process starts on the first async_save; DCP imports lazily.
        warm = {"w": torch.ones(16)}
        ckpt.async_save(warm, f"{root}/warm-sw").result()
        _dcp_async(warm, f"{root}/warm-dcp").result()
        for name, state in _states(args.quick).items():
            results: dict[str, list[dict[str, float]]] = {"shardwise": [], "dcp": []}
            syncs, copies, idles = [], [], []
            for rep in range(reps):
                idle = _idle_rate(1.0)
                idles.append(idle)
                order = ["shardwise", "dcp"] if rep % 2 == 0 else ["dcp", "shardwise"]
                for method in order:
                    path = f"{root}/{method}-{rep}"
                    results[method].append(_one(method, state, path, idle))
                    shutil.rmtree(path, ignore_errors=True)
                syncs.append(_sync_seconds(state, f"{root}/sync-{rep}"))
                shutil.rmtree(f"{root}/sync-{rep}", ignore_errors=True)
                copies.append(_memcpy_seconds(state))
            print(f"\n{name}: idle loop {statistics.median(idles):,.0f} it/s")
            print(f"  {'':<10} {'loop rate':>10} {'blocked':>10} {'committed':>10}")
            for method, runs in results.items():
                share = statistics.median(r["share"] for r in runs)
                blocked = statistics.median(r["blocked"] for r in runs)
                committed = statistics.median(r["committed"] for r in runs)
                times = f"{blocked * 1e3:>8.1f}ms {committed * 1e3:>8.1f}ms"
                print(f"  {method:<10} {share:>9.0%} {times}")
            memcpy, sync = statistics.median(copies), statistics.median(syncs)
            mine = results["shardwise"]
            share = statistics.median(r["share"] for r in mine)
            blocked = statistics.median(r["blocked"] for r in mine) / memcpy
            committed = statistics.median(r["committed"] for r in mine) / sync
            print(f"  one memcpy {memcpy * 1e3:.1f}ms, synchronous save {sync * 1e3:.1f}ms")
            for label, good, value in (
                ("loop rate >= 90% of idle", share >= 0.9, f"{share:.0%}"),
                ("blocked <= 1.2x one memcpy", blocked <= 1.2, f"{blocked:.2f}x"),
                ("committed <= 1.2x a sync save", committed <= 1.2, f"{committed:.2f}x"),
            ):
                ok &= good
                print(f"  {'PASS' if good else 'MISS'} {label}: {value}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
