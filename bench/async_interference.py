"""How much an async save slows the training loop that launched it (one command).

A loop of small torch ops stands in for a training step's Python work. For each state, and
for shardwise's ``async_save`` (a writer process per rank) and DCP's ``async_save`` (a thread),
interleaved in the same run, it measures:

* the loop's rate (iterations per second) while the save writes, as a share of its idle rate
  (target: >= 90% for shardwise, for both states);
* the time ``async_save`` blocks the caller, against one memcpy (clone) of the state
  (target: <= 1.2x);
* the time until the checkpoint is committed, against a synchronous ``shardwise.save`` of the
  same state (target: <= 1.2x): measured with the loop beside it ("committed", where the two
  compete for the cores) and alone ("alone", the one the target compares).

States: 512 MiB in 32 tensors, and 20,000 small tensors (an optimizer state's shape).
Then an FSDP2 training step on 2 gloo ranks (a decoder and its AdamW state, as torchtitan
checkpoints it): its steps per second while each method's async save writes, against idle.
Saves go to tmpfs (``--dir``, default /dev/shm). ``--quick`` runs smaller states once.

    python bench/async_interference.py [--quick] [--reps N] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import dataclasses
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_rank, run_world

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


_DCP_GROUP: Any = None  # DCP's background thread needs a group of its own beside training's


def _dcp_async(state: dict[str, Any], path: str) -> Future[Any]:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp.async_save(  # type: ignore[return-value]
            state, checkpoint_id=path, process_group=_DCP_GROUP
        )


def _one(method: str, state: dict[str, Any], path: str, idle: float) -> dict[str, float]:
    gc.collect()
    called = time.perf_counter()
    future = _start(method, state, path)
    blocked = time.perf_counter() - called
    rate = _rate_while(future.done, least=0.05)
    future.result()
    committed = time.perf_counter() - called
    shutil.rmtree(path, ignore_errors=True)
    gc.collect()
    called = time.perf_counter()
    _start(method, state, path).result()  # the same save with no loop beside it
    alone = time.perf_counter() - called
    return {"share": rate / idle, "blocked": blocked, "committed": committed, "alone": alone}


def _sync_seconds(state: dict[str, Any], path: str) -> float:
    gc.collect()
    started = time.perf_counter()
    ckpt.save(state, path)
    return time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class _FsdpConfig:
    port: int
    results: str
    root: str
    quick: bool
    reps: int


def _fsdp_rank(rank: int, config: _FsdpConfig) -> None:
    run_rank(rank, config, 2, 300, lambda: _fsdp_body(rank, config))


def _fsdp_body(rank: int, config: _FsdpConfig) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from _training.model import ModelShape
    from _training.state import build

    shape = (
        ModelShape(vocab=4000, dim=128, layers=4, heads=4, hidden=352)
        if config.quick
        else ModelShape(vocab=16000, dim=384, layers=8, heads=6, hidden=1024)
    )
    global _DCP_GROUP
    _DCP_GROUP = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (2,))
    training = build(shape, mesh, per_layer=True, steps=1)
    generator = torch.Generator().manual_seed(2)
    flag = torch.zeros(1)

    def step() -> None:
        tokens = torch.randint(0, shape.vocab, (1, 16), generator=generator)
        logits = training.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        training.optim.step()
        training.optim.zero_grad(set_to_none=True)

    def steps_per_second(done: Callable[[], bool], least: float) -> float:
        count, started = 0, time.perf_counter()
        while True:
            step()
            count += 1
            elapsed = time.perf_counter() - started
            flag.fill_(float(done() and elapsed >= least))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank stops at the same step
            if flag.item() == 1.0:
                return count / elapsed

    state = training.state
    nbytes = sum(leaf.numel() * leaf.element_size() for leaf in _tensors(state))
    for method in ("shardwise", "dcp"):  # warm up: writers start, DCP imports
        _start(method, state, f"{config.root}/warm-{method}").result()
    shares: dict[str, list[float]] = {"shardwise": [], "dcp": []}
    for rep in range(config.reps):
        idle = _idle_steps(steps_per_second)
        order = ["shardwise", "dcp"] if rep % 2 == 0 else ["dcp", "shardwise"]
        for method in order:
            future = _start(method, state, f"{config.root}/{method}-{rep}")
            shares[method].append(steps_per_second(future.done, 0.2) / idle)
            future.result()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(f"{config.root}/{method}-{rep}", ignore_errors=True)
    return {"shares": shares, "bytes_per_rank": nbytes, "params": shape.num_params()}


def _idle_steps(steps_per_second: Callable[[Callable[[], bool], float], float]) -> float:
    """Steps per second over 2 s without a save."""
    return steps_per_second(lambda: True, 2.0)


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        local = getattr(node, "_local_tensor", node)
        return [local]
    if isinstance(node, dict):
        return [t for child in node.values() for t in _tensors(child)]
    if isinstance(node, (list, tuple)):
        return [t for child in node for t in _tensors(child)]
    return []


def _start(method: str, state: dict[str, Any], path: str) -> Future[Any]:
    return _shardwise_async(state, path) if method == "shardwise" else _dcp_async(state, path)


def _fsdp(args: argparse.Namespace, root: str) -> bool:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = f"{root}/fsdp-results.json"
    reps = 1 if args.quick else args.reps
    config = _FsdpConfig(port, results, f"{root}/fsdp", args.quick, reps)
    found = run_world(_fsdp_rank, config, 2)
    print(
        f"\nFSDP2 training step on 2 ranks ({found['params'] / 1e6:.0f}M parameters, "
        f"{found['bytes_per_rank'] >> 20} MiB of state per rank): steps/s while saving"
    )
    ok = True
    for method, shares in found["shares"].items():
        share = statistics.median(shares)
        print(f"  {method:<10} {share:>9.0%} of idle")
        if method == "shardwise":
            ok = share >= 0.9
            print(f"  {'PASS' if ok else 'MISS'} training step >= 90% of idle: {share:.0%}")
    return ok


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
            print(f"  {'':<10} {'loop rate':>10} {'blocked':>10} {'committed':>10} {'alone':>10}")
            for method, runs in results.items():
                share = statistics.median(r["share"] for r in runs)
                times = "".join(
                    f" {statistics.median(r[field] for r in runs) * 1e3:>8.1f}ms"
                    for field in ("blocked", "committed", "alone")
                )
                print(f"  {method:<10} {share:>9.0%}{times}")
            memcpy, sync = statistics.median(copies), statistics.median(syncs)
            mine = results["shardwise"]
            share = statistics.median(r["share"] for r in mine)
            blocked = statistics.median(r["blocked"] for r in mine) / memcpy
            committed = statistics.median(r["alone"] for r in mine) / sync
            print(f"  one memcpy {memcpy * 1e3:.1f}ms, synchronous save {sync * 1e3:.1f}ms")
            for label, good, value in (
                ("loop rate >= 90% of idle", share >= 0.9, f"{share:.0%}"),
                ("blocked <= 1.2x one memcpy", blocked <= 1.2, f"{blocked:.2f}x"),
                ("committed <= 1.2x a sync save", committed <= 1.2, f"{committed:.2f}x"),
            ):
                ok &= good
                print(f"  {'PASS' if good else 'MISS'} {label}: {value}")
        ok &= _fsdp(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
