"""shardwise.checkpoint.load_safetensors against DCP's HuggingFaceStorageReader (issue 27).

Run ``python bench/hf_load.py`` (``--quick`` for a smoke run of about a minute; see
``--help``). The model is the GPT-like decoder of ``bench/training_state.py`` (about 106M
parameters: vocab 32,000, d_model 768, 8 Llama-style blocks with SwiGLU width 2,048, untied
embedding and output), its weights written as a split Hugging Face directory by the
``safetensors`` library (``model-0000K-of-0000N.safetensors`` of at most ``--shard-mib`` each,
and ``model.safetensors.index.json``), on tmpfs.

Two worlds: 4 gloo ranks on CPU holding the model with FSDP2 (``fully_shard`` on every block
and the root: each parameter a DTensor sharded by rows), and 1 process holding it whole (a
group of one). In each, every repetition loads the directory into the model's state dict with
shardwise (``load_safetensors``) and with DCP (``dcp.load`` with ``HuggingFaceStorageReader``,
its default thread count), the order rotating; the parameters are zeroed before each load, and
the warm-up checks every rank's every element against ``safe_open(...).get_slice`` of its box.
Times are collective (barrier to barrier, slowest rank), the median of ``--reps`` repetitions
after one warm-up; peak extra memory is the largest rank's resident high-water mark above its
resident size before the load (the parameters are already allocated: what a load adds). The
targets: DCP time / shardwise time >= 3, and peak extra memory <= the rank's shard + 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from _launch import free_port, freeze_gc, rotate, run_rank, run_world
from _training.model import BIG, QUICK_BIG, Decoder, ModelShape

MIB = 1 << 20
GIB = 1 << 30
SPEED_TARGET = 3.0
MEMORY_SLACK_MIB = 64
SHARDWISE = "shardwise"
DCP = "dcp"


@dataclass(frozen=True)
class Config:
    """What every rank of one world needs."""

    world_size: int
    shape: ModelShape
    path: str
    reps: int
    results: str
    port: int


# -- the directory ------------------------------------------------------------------------------


def _weights(shape: ModelShape) -> dict[str, torch.Tensor]:
    """The model's parameters, seeded (the same values in every run)."""
    torch.manual_seed(0)
    return {k: v.detach().contiguous() for k, v in Decoder(shape).state_dict().items()}


def write_directory(shape: ModelShape, path: str, shard_bytes: int) -> dict[str, Any]:
    """The model as a split Hugging Face directory, written by the safetensors library."""
    from safetensors.torch import save_file

    tensors = _weights(shape)
    groups: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    os.makedirs(path)
    weight_map = {}
    for number, keys in enumerate(groups):
        name = f"model-{number + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, os.path.join(path, name), {"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as file:
        json.dump(index, file)
    return {"files": len(groups), "tensors": len(tensors), "bytes": total}


# -- one rank -------------------------------------------------------------------------------------


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's global box of ``value`` (a DTensor's by torch's own rule)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        return (0,) * value.dim(), tuple(value.shape)
    shape, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(offsets), tuple(shape)


def _check(state: dict[str, torch.Tensor], path: str, method: str) -> None:
    """Every local element against the reference library's slice of its box."""
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    for key, value in state.items():
        offsets, sizes = _box(value)
        with safe_open(os.path.join(path, weight_map[key]), framework="pt") as file:
            expected = file.get_slice(key)[
                tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            ]
        if not torch.equal(_local(value), expected):
            raise AssertionError(f"{method} loaded wrong values into {key!r}")


def _load(method: str, state: dict[str, torch.Tensor], path: str) -> None:
    if method == SHARDWISE:
        import shardwise.checkpoint as swckpt

        swckpt.load_safetensors(state, path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))


def _measure_world(rank: int, config: Config) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _ckpt.worker import measure

    with torch.device("meta"):
        model = Decoder(config.shape)
    if config.world_size > 1:
        mesh = init_device_mesh("cpu", (config.world_size,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    state = model.state_dict()
    local_bytes = sum(_local(v).numel() * _local(v).element_size() for v in state.values())
    freeze_gc()
    records = []
    for rep in range(config.reps + 1):
        for method in rotate([SHARDWISE, DCP], rep):
            with torch.no_grad():
                for value in state.values():
                    _local(value).zero_()
            seconds, mem = measure(lambda method=method: _load(method, state, config.path))
            if rep == 0:
                _check(state, config.path, method)
            records.append({"method": method, "rep": rep, "seconds": seconds, "mem_mib": mem})
    largest = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"records": records, "shard_mib": int(largest.item()) / MIB}


def worker(rank: int, config: Config) -> None:
    run_rank(rank, config, config.world_size, 600, lambda: _measure_world(rank, config))


# -- driver ---------------------------------------------------------------------------------------


def _time(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _report(label: str, result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    timed = [r for r in result["records"] if r["rep"] > 0]

    def median(method: str, field: str) -> float:
        return statistics.median(r[field] for r in timed if r["method"] == method)

    sw_s, dcp_s = median(SHARDWISE, "seconds"), median(DCP, "seconds")
    sw_mem, dcp_mem = median(SHARDWISE, "mem_mib"), median(DCP, "mem_mib")
    shard = result["shard_mib"]
    by_rep = {(r["rep"], r["method"]): r["seconds"] for r in timed}
    reps = sorted({r["rep"] for r in timed})
    ratios = [by_rep[rep, DCP] / by_rep[rep, SHARDWISE] for rep in reps]
    print(
        f"{label:<22}{_time(sw_s):>10}{_time(dcp_s):>10}{dcp_s / sw_s:>8.2f}x"
        f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>12}{sw_mem:>9.0f}{dcp_mem:>9.0f}{shard:>10.0f}"
    )
    ratio = dcp_s / sw_s
    limit = shard + MEMORY_SLACK_MIB
    return [
        (f"{label}: >= {SPEED_TARGET:g}x DCP", ratio >= SPEED_TARGET, f"{ratio:.2f}x"),
        (
            f"{label}: peak extra memory <= shard + {MEMORY_SLACK_MIB} MiB ({limit:.0f} MiB)",
            sw_mem <= limit,
            f"{sw_mem:.0f} MiB (DCP {dcp_mem:.0f} MiB)",
        ),
    ]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after 1 warm-up)")
    parser.add_argument("--quick", action="store_true", help="smoke run: a 7M-parameter model")
    parser.add_argument("--tmpfs-dir", default="/dev/shm", help="directory on tmpfs")
    parser.add_argument("--shard-mib", type=int, default=100, help="most MiB per weight file")
    parser.add_argument("--world", type=int, default=4, help="ranks of the FSDP2 world")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    shape = QUICK_BIG if args.quick else BIG
    reps = min(args.reps, 2) if args.quick else args.reps
    root = tempfile.mkdtemp(prefix="shardwise-hf-bench-", dir=args.tmpfs_dir)
    try:
        path = os.path.join(root, "model")
        facts = write_directory(shape, path, args.shard_mib * MIB)
        print(
            f"model: {shape.num_params() / 1e6:.1f}M parameters (vocab {shape.vocab}, d_model "
            f"{shape.dim}, {shape.layers} layers, SwiGLU {shape.hidden}, untied), "
            f"{facts['tensors']} float32 tensors, {facts['bytes'] / GIB:.2f} GiB in "
            f"{facts['files']} files; {reps} reps after 1 warm-up; torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs"
        )
        header = (
            f"{'case':<22}{'shardwise':>10}{'DCP':>10}{'DCP/sw':>9}{'per rep':>12}"
            f"{'sw MiB':>9}{'DCP MiB':>9}{'shard MiB':>10}"
        )
        print(header)
        print("-" * len(header))
        verdicts = []
        for world, label in ((args.world, f"FSDP2, {args.world} ranks"), (1, "1 process")):
            results = os.path.join(root, f"results-{world}.json")
            config = Config(world, shape, path, reps, results, free_port())
            verdicts += _report(label, run_world(worker, config, world))
        missed = sum(not ok for _, ok, _ in verdicts)
        print(f"\n## Targets: {len(verdicts) - missed} PASS, {missed} MISS")
        for name, ok, detail in verdicts:
            print(f"  {'PASS' if ok else 'MISS'}  {name}: {detail}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
