"""One rank of the several-machines test (``tests/distributed/test_multinode.py``), started by
``torchrun`` on one of several "nodes".

Run as ``torchrun ... tests/_multinode_worker.py {save|load} PATH REPORTS``: the process joins
the gloo group torchrun describes (``env://``), then

* ``save`` (4 ranks: 2 nodes x 2 processes) builds the state dict of :func:`expected_state`
  with the tensors of :data:`SAVE_LAYOUT` as DTensors and saves it to ``PATH``;
* ``load`` (3 ranks: 3 nodes x 1 process) builds a target with the same keys, holding none of
  the saved values and sharded as :data:`LOAD_LAYOUT` says, loads ``PATH`` into it and checks
  every value exactly against :func:`expected_state` (recomputed here from the seed).

Either way it writes ``REPORTS/{mode}-rank{RANK}.json`` last, saying who it was (ranks, node,
launcher pid) and what it did, so that the test sees that every rank ran and checked
everything. Any failure is a traceback on stderr and exit status 1. SIGUSR1 dumps every
thread's stack to stderr; the process exits on its own when its launcher disappears.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import shardwise.checkpoint as ckpt

SEED = 20260612
#: The training step saved as a Python int.
STEP = 7
#: Gloo and store timeout: a hung peer fails this rank well within the test's own timeout.
GROUP_TIMEOUT = timedelta(seconds=45)
#: The world each mode expects: (nodes, processes per node).
WORLDS = {"save": (2, 2), "load": (3, 1)}

#: How ``save`` shards the tensors (other tensors stay plain, the same on every rank): key ->
#: (mesh, placements). Mesh "flat" is all 4 ranks; "nodes" is 2-D, (node, process on it).
SAVE_LAYOUT: dict[str, tuple[str, tuple[Placement, ...]]] = {
    "model.embed.weight": ("flat", (Shard(0),)),  # 13 rows: 4, 4, 4, 1
    "model.proj.weight": ("flat", (Shard(0),)),
    "model.proj.bias": ("flat", (Shard(0),)),
    "model.norm.weight": ("flat", (Replicate(),)),
    "optim.state.embed.weight.exp_avg": ("flat", (Shard(0),)),
    "optim.state.embed.weight.exp_avg_sq": ("flat", (Shard(0),)),
    "optim.state.proj.weight.exp_avg": ("flat", (Shard(0),)),
    "optim.state.proj.weight.exp_avg_sq": ("flat", (Shard(0),)),
    "grid": ("nodes", (Shard(0), Shard(1))),
}
#: How ``load`` shards them: one mesh "flat" of 3 ranks, mostly by columns.
LOAD_LAYOUT: dict[str, tuple[str, tuple[Placement, ...]]] = {
    "model.embed.weight": ("flat", (Shard(1),)),  # 8 columns: 3, 3, 2
    "model.proj.weight": ("flat", (Shard(1),)),
    "model.proj.bias": ("flat", (Shard(0),)),
    "model.norm.weight": ("flat", (Shard(0),)),
    "optim.state.embed.weight.exp_avg": ("flat", (Shard(1),)),
    "optim.state.embed.weight.exp_avg_sq": ("flat", (Replicate(),)),
    "optim.state.proj.weight.exp_avg": ("flat", (Shard(1),)),
    "optim.state.proj.weight.exp_avg_sq": ("flat", (Replicate(),)),
    "grid": ("flat", (Shard(1),)),  # 10 columns: 4, 4, 2
}


def _values(key: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The saved value of ``key``: drawn from a generator seeded by the seed and the key."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(key.encode()))
    if dtype.is_floating_point:
        return torch.randn(size, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**40), 2**40, size, generator=gen, dtype=dtype)


def expected_state() -> dict[str, Any]:
    """The full (unsharded) state dict that the save writes, as a training loop holds it:
    model parameters, optimizer state keyed by parameter name with a ``param_groups`` list,
    plain buffers, a tensor sharded over (node, process), and the step as a Python int."""
    params = {
        "embed.weight": ((13, 8), torch.float32),
        "proj.weight": ((8, 6), torch.float32),
        "proj.bias": ((8,), torch.float32),
        "norm.weight": ((6,), torch.bfloat16),
    }
    model = {name: _values(f"model.{name}", size, dtype) for name, (size, dtype) in params.items()}
    state = {
        name: {
            "step": torch.tensor(float(STEP)),
            "exp_avg": _values(f"exp_avg.{name}", params[name][0], torch.float32),
            "exp_avg_sq": _values(f"exp_avg_sq.{name}", params[name][0], torch.float32),
        }
        for name in ("embed.weight", "proj.weight")
    }
    groups = [
        {
            "lr": 1e-3,
            "betas": (0.9, 0.95),
            "weight_decay": 0.1,
            "params": ["embed.weight", "proj.weight"],
        }
    ]
    return {
        "model": model,
        "optim": {"state": state, "param_groups": groups},
        "buffers": {
            "position_ids": _values("position_ids", (16,), torch.int64),
            "scale": _values("scale", (), torch.float64),
        },
        "grid": _values("grid", (12, 10), torch.int64),
        "step": STEP,
    }


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf below ``value`` (dicts, lists and tuples are
    walked; a list's items are keyed by position)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}{key}.")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from leaves(item, f"{path}{index}.")
    else:
        yield path.removesuffix("."), value


def _rebuild(value: Any, leaf: Callable[[str, Any], Any], path: str = "") -> Any:
    """``value`` with every leaf replaced by ``leaf(dotted key, leaf)``; containers keep their
    types."""
    if isinstance(value, dict):
        return {key: _rebuild(item, leaf, f"{path}{key}.") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_rebuild(item, leaf, f"{path}{index}.") for index, item in enumerate(value)]
        return type(value)(items)
    return leaf(path.removesuffix("."), value)


def _blank(value: Any) -> Any:
    """A value of the same type (and shape) holding none of the saved values."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, -1)
    if isinstance(value, (bool, int, float)):
        return type(value)(-1)
    if isinstance(value, str):
        return ""
    raise TypeError(f"no blank for {type(value).__name__}")


def blank_state() -> dict[str, Any]:
    """A load target shaped like :func:`expected_state` (same keys, types, shapes and dtypes)
    holding none of its values."""
    return dict(_rebuild(expected_state(), lambda _key, value: _blank(value)))


def _meshes(mode: str) -> dict[str, DeviceMesh]:
    world = dist.get_world_size()
    meshes = {"flat": init_device_mesh("cpu", (world,), mesh_dim_names=("flat",))}
    if mode == "save":
        nodes, per_node = WORLDS["save"]
        meshes["nodes"] = init_device_mesh(
            "cpu", (nodes, per_node), mesh_dim_names=("node", "proc")
        )
    return meshes


def _sharded(
    state: dict[str, Any],
    layout: dict[str, tuple[str, tuple[Placement, ...]]],
    meshes: dict[str, DeviceMesh],
) -> dict[str, Any]:
    """``state`` with the tensors that ``layout`` names as DTensors. Every rank holds the full
    value, so each takes its own piece without communication (``src_data_rank=None``)."""
    seen = set()

    def leaf(key: str, value: Any) -> Any:
        if key not in layout:
            return value
        seen.add(key)
        mesh, placements = layout[key]
        return distribute_tensor(value, meshes[mesh], placements, src_data_rank=None)

    sharded = _rebuild(state, leaf)
    assert seen == layout.keys(), f"layout keys not in the state dict: {layout.keys() - seen}"
    return dict(sharded)


def check_loaded(
    loaded: dict[str, Any],
    expected: dict[str, Any],
    layout: dict[str, tuple[str, tuple[Placement, ...]]],
) -> tuple[int, int]:
    """Assert that every leaf of ``loaded`` equals ``expected`` exactly, with its type and
    dtype; the keys of ``layout`` must be DTensors with its placements, every other tensor a
    plain one. Returns (leaves, tensor elements) checked."""
    got = dict(leaves(loaded))
    want = dict(leaves(expected))
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    elements = 0
    for key, value in want.items():
        actual = got[key]
        if isinstance(value, torch.Tensor):
            if key in layout:
                assert isinstance(actual, DTensor), f"{key}: {type(actual).__name__}"
                assert actual.placements == layout[key][1], f"{key}: {actual.placements}"
                actual = actual.full_tensor()  # collective: every rank walks the same keys
            assert type(actual) is torch.Tensor, f"{key}: {type(actual).__name__}"
            assert actual.dtype == value.dtype, f"{key}: {actual.dtype} != {value.dtype}"
            assert torch.equal(actual, value), f"{key}: loaded values differ from the saved ones"
            elements += value.numel()
        else:
            assert type(actual) is type(value) and actual == value, f"{key}: {actual!r}"
    assert isinstance(loaded["optim"]["param_groups"][0]["betas"], tuple)
    return len(want), elements


def _save(path: str, meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    state = _sharded(expected_state(), SAVE_LAYOUT, meshes)
    metadata = ckpt.save(state, path)
    # The same state through async_save: each rank's writer process meets the others' through
    # the store of torchrun's rendezvous, across the nodes.
    written = ckpt.async_save(state, f"{path}-async").result(timeout=120)
    assert written.state_dict_metadata == metadata.state_dict_metadata
    return {"save_id": metadata.storage_meta.save_id if metadata.storage_meta else None}


def _load(path: str, meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    expected = expected_state()
    target = _sharded(blank_state(), LOAD_LAYOUT, meshes)
    result = ckpt.load(target, path)
    assert not result.missing_keys and not result.unexpected_keys, result
    num_leaves, elements = check_loaded(target, expected, LOAD_LAYOUT)
    return {"leaves": num_leaves, "elements": elements}


def _exit_with_launcher() -> None:
    """Exit when the launcher (torchrun, the parent) is gone: a killed launcher must not leave
    this rank waiting in a collective until the group's timeout."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=sorted(WORLDS))
    parser.add_argument("path")
    parser.add_argument("reports", type=Path)
    args = parser.parse_args(argv)

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The test stops (and dumps the stacks of) leftover workers by these pids.
    (args.reports / f"pid-{os.getpid()}").touch()
    _exit_with_launcher()
    # As in the test suite: a warning from shardwise is a failure (one with stacklevel=2 is
    # attributed to this script).
    warnings.filterwarnings("error", module=r"(shardwise(\.|$)|__main__$)")
    torch.set_num_threads(1)

    nodes, per_node = WORLDS[args.mode]
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == nodes * per_node, f"{args.mode}: world size {world}"
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == per_node
    try:
        meshes = _meshes(args.mode)
        done = _save(args.path, meshes) if args.mode == "save" else _load(args.path, meshes)
    finally:
        dist.destroy_process_group()
    report = {
        "rank": rank,
        "world_size": world,
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "launcher": os.getppid(),
        **done,
    }
    final = args.reports / f"{args.mode}-rank{rank}.json"
    temporary = final.with_suffix(".tmp")
    temporary.write_text(json.dumps(report))
    temporary.rename(final)
    print(f"rank {rank} (node {report['node']}): {args.mode} done {done}", flush=True)


def _exit(code: int) -> None:
    """Exit at once, skipping the interpreter's teardown: there, torch 2.13 sometimes aborts
    a process that used gloo ("terminate called without an active exception", SIGABRT) even
    after ``destroy_process_group`` (about one process in 30 on this test's 3-rank load; a
    script without shardwise does it too). The harness's workers exit the same way."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except SystemExit as exit_:  # argparse: usage errors
        _exit(exit_.code if isinstance(exit_.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        _exit(1)
    _exit(0)
