"""Incremental saves in a checkpoint series against full saves (issue 28).

Run ``python bench/incremental.py`` (``--quick`` for a smoke run of a few seconds). The model:
``--layers`` frozen ``d x d`` float32 linear layers (the base weights) and LoRA adapters of
rank ``--rank`` on each (``A: d x r``, ``B: r x d``, trainable: about 5% of the parameters
with the defaults), the step, and in the second series the Adam state of the adapters
(``exp_avg``, ``exp_avg_sq``). Ten training steps change the adapters (and their Adam state);
after each one the state is saved twice, in one process, into a temporary directory (fsync
on, as by default):

- *full*: ``save(state, path)``, a self-contained checkpoint (index version 4);
- *incremental*: ``save(state, path, base=previous)`` in a series (the first
  ``save(state, path, incremental=True)``): only chunks whose bytes changed are written.

Reported: the bytes written per save and over the 10 saves (data files: what reaches the
disk), their ratio; the median time of a save after the first, both ways; and the time to
load the 10th checkpoint into the model's state both ways (the median of ``--reps`` loads, each
into zeroed tensors, after a warm-up; the files are in the page cache both ways). The targets:
bytes written >= 10x fewer (per save after the first; the first save of a series writes
everything, which bounds the ratio over 10 saves by 10 / (1 + 9 x the changed fraction)), each
incremental save faster than a full one, the 10th loaded within 1.1x of a full checkpoint.
Two series are run: the model alone (the issue's setup: 5% of the parameters change), and
the model with the Adam state of its adapters (what a training checkpoint holds: the changed
bytes triple, so the bytes ratio is about 7.6x with the defaults).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardwise.checkpoint as ckpt

MIB = 1 << 20


def _state(layers: int, width: int, rank: int, optimizer: bool, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        prefix = f"layers.{layer}"
        model[f"{prefix}.weight"] = torch.randn(width, width, generator=generator)
        model[f"{prefix}.bias"] = torch.randn(width, generator=generator)
        for name, shape in (("lora_A", (rank, width)), ("lora_B", (width, rank))):
            key = f"{prefix}.{name}"
            model[key] = torch.randn(*shape, generator=generator) * 0.01
            if optimizer:
                optim[f"{key}.exp_avg"] = torch.zeros(*shape)
                optim[f"{key}.exp_avg_sq"] = torch.zeros(*shape)
    return {"model": model, "optim": optim, "step": 0}


def _train_step(state: dict[str, Any], generator: torch.Generator) -> None:
    """What an optimizer step changes: the adapters and their Adam state."""
    for key, value in state["model"].items():
        if ".lora_" in key:
            grad = torch.randn(value.shape, generator=generator) * 1e-3
            if state["optim"]:
                state["optim"][f"{key}.exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
                state["optim"][f"{key}.exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
            value.sub_(grad)
    state["step"] += 1


def _data_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in (path / "data").iterdir())


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {key: torch.zeros_like(value) for key, value in state["model"].items()},
        "optim": {key: torch.zeros_like(value) for key, value in state["optim"].items()},
        "step": -1,
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a[part][key], b[part][key]) for part in ("model", "optim") for key in a[part]
    )


def run(
    layers: int, width: int, rank: int, saves: int, reps: int, directory: Path, optimizer: bool
) -> None:
    state = _state(layers, width, rank, optimizer)
    total = sum(v.numel() for part in ("model", "optim") for v in state[part].values())
    adapters = sum(v.numel() for k, v in state["model"].items() if ".lora_" in k)
    params = sum(v.numel() for v in state["model"].values())
    what = "the model and the Adam state of its adapters" if optimizer else "the model only"
    print(
        f"\n== {what}: {layers} layers of {width}x{width} + LoRA rank {rank}: "
        f"{params / 1e6:.1f}M parameters, {adapters / params:.1%} trainable; state "
        f"{total * 4 / MIB:.0f} MiB"
    )
    generator = torch.Generator().manual_seed(1)
    full_times, incremental_times = [], []
    full_bytes, incremental_bytes = [], []
    previous: Path | None = None
    for number in range(1, saves + 1):
        _train_step(state, generator)
        full = directory / "full" / f"step-{number:08d}"
        incremental = directory / "series" / f"step-{number:08d}"
        base = {"incremental": True} if previous is None else {"base": previous}
        # Alternate the order so that neither always runs on a warmer cache.
        jobs = [
            ("full", lambda full=full: ckpt.save(state, full)),
            ("incremental", lambda path=incremental, base=base: ckpt.save(state, path, **base)),
        ]
        for name, job in jobs if number % 2 else reversed(jobs):
            seconds = _timed(job)
            (full_times if name == "full" else incremental_times).append(seconds)
        full_bytes.append(_data_bytes(full))
        incremental_bytes.append(_data_bytes(incremental))
        if number < saves:
            shutil.rmtree(full)  # only the 10th full checkpoint is loaded
        previous = incremental
    assert previous is not None

    last_full = directory / "full" / f"step-{saves:08d}"
    loads: dict[str, list[float]] = {"full": [], "incremental": []}
    for repetition in range(reps + 1):
        order = [("full", last_full), ("incremental", previous)]
        for name, path in order if repetition % 2 else reversed(order):
            target = _blank(state)
            seconds = _timed(lambda path=path, target=target: ckpt.load(target, path))
            assert _equal(target, state), f"the {name} checkpoint did not load the state"
            if repetition:  # the first is a warm-up
                loads[name].append(seconds)

    print()
    print(f"{'':28}{'full':>12}{'incremental':>14}{'ratio':>9}")
    per_full, per_incremental = (
        statistics.median(full_bytes[1:]),
        statistics.median(incremental_bytes[1:]),
    )
    rows = [
        ("bytes per save (2nd-10th)", per_full / MIB, per_incremental / MIB, "MiB"),
        (f"bytes over {saves} saves", sum(full_bytes) / MIB, sum(incremental_bytes) / MIB, "MiB"),
        (
            "save time (2nd-10th, median)",
            statistics.median(full_times[1:]) * 1e3,
            statistics.median(incremental_times[1:]) * 1e3,
            "ms",
        ),
        ("first save time", full_times[0] * 1e3, incremental_times[0] * 1e3, "ms"),
        (
            f"load of the {saves}th (median)",
            statistics.median(loads["full"]) * 1e3,
            statistics.median(loads["incremental"]) * 1e3,
            "ms",
        ),
    ]
    for label, a, b, unit in rows:
        print(f"{label:28}{a:>9.1f} {unit:3}{b:>11.1f} {unit:3}{a / b:>8.2f}x")
    print(
        "each save, full / incremental ms: "
        + ", ".join(
            f"{n}: {a * 1e3:.0f}/{b * 1e3:.0f}"
            for n, (a, b) in enumerate(zip(full_times, incremental_times, strict=True), start=1)
        )
    )
    slowest = max(incremental_times[1:]) / statistics.median(full_times[1:])
    print()
    print(
        f"bytes written: {per_full / per_incremental:.1f}x fewer per save after the first "
        f"(target >= 10x); {sum(full_bytes) / sum(incremental_bytes):.1f}x over {saves} saves, "
        "the first writing everything"
    )
    print(
        f"each incremental save after the first: slowest {slowest:.2f}x the median full save "
        "(target < 1)"
    )
    ratio = statistics.median(loads["incremental"]) / statistics.median(loads["full"])
    print(f"load of the {saves}th: {ratio:.2f}x a full checkpoint's (target <= 1.1x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model: a smoke run")
    parser.add_argument("--layers", type=int, default=None, help="frozen layers (default 48)")
    parser.add_argument("--width", type=int, default=None, help="layer width (default 1024)")
    parser.add_argument("--rank", type=int, default=26, help="LoRA rank (default 26: ~5%%)")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--reps", type=int, default=None, help="loads timed (default 5)")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary dir)")
    args = parser.parse_args()
    layers = args.layers or (8 if args.quick else 48)
    width = args.width or (512 if args.quick else 1024)
    rank = args.rank if not args.quick or args.rank != 26 else 13
    reps = args.reps or (2 if args.quick else 5)
    torch.set_num_threads(1)
    parent = args.dir or os.environ.get("TMPDIR") or tempfile.gettempdir()
    print(f"saving to {parent}")
    for optimizer in (False, True):
        with tempfile.TemporaryDirectory(prefix="shardwise-incremental-", dir=parent) as where:
            run(layers, width, rank, args.saves, reps, Path(where), optimizer)


if __name__ == "__main__":
    main()
