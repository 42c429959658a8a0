"""The local tier (``docs/local-tier.md``): restore time against the durable tier, and the
training loop's speed while local saves run every step.

Run ``python bench/local_tier.py`` (``--quick``: a smaller model, fewer repetitions). 4 gloo
ranks on CPU as 2 simulated nodes of 2 ranks, each node its own tier directory under
``/dev/shm``, one replica of each part on the other node.

* **Restore**: the training-state bench's state (``bench/training_state.py``: a GPT-like
  decoder of about 106M parameters under FSDP2, AdamW after two real steps), restored by
  ``CheckpointManager.restore`` from the durable tier (a series on tmpfs, and one on the disk
  of ``--dir`` with its files evicted from the page cache first, as after a restart on
  another machine) and from the local tier (every part on its own node; and node 0's
  directory gone, its ranks fetching their parts from node 1's replicas). Times are
  collective (barrier to barrier), medians of ``--reps``, after a warm-up whose result is
  checked value by value. Target: the local tier at least 3x faster than the durable tier on
  disk.
* **Loop**: a smaller FSDP2 model trains on 2 ranks (2 nodes of one rank: on 2 cores, as the
  async_interference bench's FSDP2 loop); its steps per second with a local save at every
  step (``async_save``: staged by the step, written in the background) against the same loop
  with no manager, and, for reference, with a durable ``async_save`` every step to tmpfs.
  Target: at least 90%. Also a local save every 4 steps: on 2 cores the training and the
  save compete for the same CPU, and a save every step cannot keep up with a step. Each
  case is timed after a new manager's first 3 saves (the tier's group, its staging buffer
  and the first files are made there; later saves write into the files of the steps they
  prune), as in a long run; the rate of those first steps is printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardwise.checkpoint as ckpt
from _launch import collective_time, free_port, freeze_gc, fresh_dir, run_rank, run_world
from _training import state as training
from _training.model import BIG, QUICK_BIG, ModelShape

WORLD = 4
LOCAL = 2
LOOP_WORLD = 2  # with 2 cores: the async_interference bench's FSDP2 loop
SPARSE = 4  # the loop's other case: a local save every SPARSE steps
# A new manager's first saves make the tier's group and staging buffer, and the files that
# later saves write into (pruned steps' files are reused): a long run's loop is timed after.
WARM_SAVES = 3
MIB = 1 << 20
TIERS = "/dev/shm/local-tier-bench-nodes"
LOOP_SHAPE = ModelShape(vocab=16000, dim=384, layers=8, heads=6, hidden=1024)
QUICK_LOOP_SHAPE = ModelShape(vocab=4000, dim=128, layers=4, heads=4, hidden=352)


@dataclass(frozen=True, slots=True)
class Config:
    port: int
    results: str
    directories: tuple[str, ...]
    reps: int
    quick: bool


def _evict(path: str) -> None:
    """Drop ``path``'s files from the page cache (their pages are clean: they were synced),
    so the next read comes from the disk, as on a machine that did not write them."""
    for folder, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _tier(rank: int, local: int = LOCAL, every: int = 1) -> ckpt.LocalTier:
    return ckpt.LocalTier(
        every_steps=every,
        replicas=1,
        job_id="local-tier-bench",
        directory=f"{TIERS}/node{rank // local}",
        local_world_size=local,
        min_free_bytes=0,
    )


def _restore(
    state: training.TrainingState, root: str, tier: ckpt.LocalTier | None, expected: str
) -> float:
    """The time of one collective restore of ``root`` (and ``tier``) into ``state``."""
    manager = ckpt.CheckpointManager(root, async_save=False, local_tier=tier)
    state.clear()
    seconds = collective_time(lambda: manager.restore(None, state.state))
    if manager.restored_from != expected:
        raise AssertionError(f"restored from {manager.restored_from}, not {expected}")
    manager.close()
    return seconds


def _restores(rank: int, config: Config, state: training.TrainingState) -> dict[str, Any]:
    results = {
        directory: _restores_in(rank, config, state, directory) for directory in config.directories
    }
    fresh_dir(TIERS, rank)
    return results


def _restores_in(
    rank: int, config: Config, state: training.TrainingState, directory: str
) -> dict[str, float]:
    """The median restore times with the durable tier in ``directory``."""
    never = ckpt.SavePolicy(every_steps=10**9)  # the local tier's saves only
    root = fresh_dir(os.path.join(directory, "local-tier-bench"), rank)
    fresh_dir(TIERS, rank)
    durable, tiered = os.path.join(root, "durable"), os.path.join(root, "tiered")
    with ckpt.CheckpointManager(durable, async_save=False) as manager:
        manager.save(1, state.state)
    tier = _tier(rank)

    def local_save() -> None:
        with ckpt.CheckpointManager(
            tiered, save_policy=never, async_save=False, local_tier=tier
        ) as manager:
            manager.save(1, state.state)

    def durable_restore() -> float:
        if directory != "/dev/shm" and rank == 0:
            _evict(durable)
        return _restore(state, durable, None, "durable")

    def own_restore() -> float:
        local_save()  # untimed: both nodes hold every part (again)
        return _restore(state, tiered, tier, "local")

    def peers_restore() -> float:
        local_save()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{TIERS}/node0")  # node 0 lost: its ranks restart empty
        return _restore(state, tiered, tier, "local")

    cases = {
        "durable": durable_restore,
        "local, own node": own_restore,
        "local, node 0 lost": peers_restore,
    }
    for name, case in cases.items():  # warm-up, each result checked
        case()
        state.check(f"{name} restore from {directory}")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repetition in range(config.reps):
        names = list(cases)
        names = names[repetition % 3 :] + names[: repetition % 3]
        for name in names:
            times[name].append(cases[name]())
    state.fill()
    fresh_dir(root, rank)
    return {name: statistics.median(values) for name, values in times.items()}


def _save_at(
    manager: ckpt.CheckpointManager, repetition: int, model: training.TrainingState, number: int
) -> None:
    manager.save(repetition * 1000 + number, model.state)  # a new step in every repetition


def _loop(rank: int, config: Config) -> dict[str, Any]:
    shape = QUICK_LOOP_SHAPE if config.quick else LOOP_SHAPE
    mesh = init_device_mesh("cpu", (LOOP_WORLD,))
    model = training.build(shape, mesh, per_layer=True, steps=1)
    generator = torch.Generator().manual_seed(2)

    def step() -> None:
        tokens = torch.randint(0, shape.vocab, (1, 16), generator=generator)
        logits = model.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        model.optim.step()
        model.optim.zero_grad(set_to_none=True)

    def rate(steps: int, after: Callable[[int], None], first: int = 1) -> float:
        dist.barrier()
        started = time.perf_counter()
        for number in range(first, first + steps):
            step()
            after(number)
        dist.barrier()
        return steps / (time.perf_counter() - started)

    steps = 6 if config.quick else 12
    root = fresh_dir("/dev/shm/local-tier-bench-loop", rank)
    fresh_dir(TIERS, rank)
    rate(3, lambda _: None)  # warm-up
    never, every = ckpt.SavePolicy(every_steps=10**9), ckpt.SavePolicy(every_steps=1)
    keep = ckpt.RetentionPolicy(keep_last=2)
    # Each case: its options, and the steps between its saves.
    cases: dict[str, tuple[dict[str, Any], int]] = {
        "local tier": ({"save_policy": never, "local_tier": _tier(rank, local=1)}, 1),
        f"local tier, every {SPARSE}": (
            {"save_policy": never, "local_tier": _tier(rank, local=1, every=SPARSE)},
            SPARSE,
        ),
        "async_save": ({"save_policy": every, "retention": keep}, 1),
    }
    rates: dict[str, list[float]] = {"idle": [], **{name: [] for name in cases}}
    rates["first saves"] = []
    for repetition in range(config.reps):
        rates["idle"].append(rate(steps, lambda _: None))
        for name, (options, interval) in cases.items():
            run = os.path.join(root, f"{name.replace(' ', '-').replace(',', '')}-{repetition}")
            manager = ckpt.CheckpointManager(run, **options)
            save = functools.partial(_save_at, manager, repetition, model)
            warm = WARM_SAVES * interval
            first = rate(warm, save)  # the new manager's first saves, timed apart
            if name == "local tier":
                rates["first saves"].append(first)
            rates[name].append(rate(steps, save, first=warm + 1))
            manager.close()
    held = sorted(os.listdir(f"{TIERS}/node{rank}"))
    fresh_dir(root, rank)
    fresh_dir(TIERS, rank)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {**medians, "state_bytes": model.local_bytes, "held": held}


def _loop_rank(rank: int, config: Config) -> None:
    def body() -> dict[str, Any]:
        freeze_gc()
        return _loop(rank, config)

    run_rank(rank, config, LOOP_WORLD, 900, body)


def _body(rank: int, config: Config) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    state = training.build(QUICK_BIG if config.quick else BIG, mesh, per_layer=True, steps=2)
    state.fill()
    freeze_gc()
    results: dict[str, Any] = {"bytes": state.global_bytes}
    results["restore"] = _restores(rank, config, state)
    return results


def _rank(rank: int, config: Config) -> None:
    run_rank(rank, config, WORLD, 900, lambda: _body(rank, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    parser.add_argument("--dir", default=os.getcwd(), help="the disk directory (default: cwd)")
    parser.add_argument(
        "--only", choices=("restore", "loop"), help="time the restores or the loop alone"
    )
    args = parser.parse_args()
    directories = ("/dev/shm", os.path.abspath(args.dir))
    with tempfile.NamedTemporaryFile(suffix=".json") as results:
        config = Config(
            free_port(),
            results.name,
            directories,
            args.reps or (2 if args.quick else 5),
            args.quick,
        )
        found = run_world(_rank, config, WORLD) if args.only != "loop" else None
        config = dataclasses.replace(config, port=free_port())
        loop = run_world(_loop_rank, config, LOOP_WORLD) if args.only != "restore" else None
    if found is not None:
        _print_restores(found, directories)
    if loop is not None:
        _print_loop(loop)


def _print_restores(found: dict[str, Any], directories: tuple[str, ...]) -> None:
    print(
        f"CheckpointManager.restore, {WORLD} gloo ranks as 2 nodes x {LOCAL}, FSDP2 state of "
        f"{found['bytes'] / MIB:.0f} MiB; the local tier in /dev/shm, one replica"
    )
    print(f"{'durable tier in':<20}{'durable (s)':>12}{'local (s)':>11}{'ratio':>8}  local from")
    for directory in directories:
        timing = found["restore"][directory]
        for case in ("local, own node", "local, node 0 lost"):
            ratio = timing["durable"] / timing[case]
            print(
                f"{directory:<20}{timing['durable']:>12.3f}{timing[case]:>11.3f}"
                f"{ratio:>7.2f}x  {case.removeprefix('local, ')}"
            )


def _print_loop(loop: dict[str, Any]) -> None:
    idle = loop["idle"]
    sparse = loop[f"local tier, every {SPARSE}"]
    print(
        f"training loop, FSDP2 on {LOOP_WORLD} ranks as 2 nodes, "
        f"{loop['state_bytes'] / MIB:.0f} MiB of state per rank, {idle:.2f} steps/s idle: "
        f"a local save every step {loop['local tier']:.2f} ({loop['local tier'] / idle:.0%}), "
        f"every {SPARSE} steps {sparse:.2f} ({sparse / idle:.0%}); durable async_save to "
        f"/dev/shm every step {loop['async_save']:.2f} ({loop['async_save'] / idle:.0%}); "
        f"each timed after a new manager's first {WARM_SAVES} saves (with a local save every "
        f"step, those ran at {loop['first saves']:.2f} steps/s); "
        f"local steps held at the end: {', '.join(loop['held'])}"
    )


if __name__ == "__main__":
    main()
