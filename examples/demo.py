"""The shardwise demo: ``make demo``.

1. Pure spec math: the shard layout a ChunkShardingSpec and an EnumerableShardingSpec produce
   for a small tensor over 4 ranks (no processes needed).
2. Four real gloo ranks on this machine: a row-sharded and a grid-sharded tensor, a real tensor
   scattered from rank 0 and gathered back, with a table of who holds which block.
3. A small ``nn.Module`` whose Linear weight is sharded (``shard_parameter``) runs forward on the
   4 ranks through a registered sharded op and matches the unsharded module.
4. The checkpoint story: the 4 ranks save a model state (ShardedTensor, DTensor, plain tensors,
   a step counter); 2 ranks reload it with a different sharding; a single process without any
   process group reloads it again; both check equality; a summary of the checkpoint is printed.
5. A training run with a ``CheckpointManager`` on 2 ranks: saves every 4 steps in the
   background, keeps the last 2; a SIGTERM to one rank (a preemption notice) saves on both and
   stops the run; a second run resumes from that step and finishes with the same weights as an
   uninterrupted run; ``shardwise ls`` lists the series.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.cli import main as shardwise_cli

WORLD_SIZE = 4


def row_spec(world_size: int = WORLD_SIZE) -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])


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
    print("== 1. Shard layouts (pure spec math, no processes) ==")
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


def _init(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


# -- 2. scatter / gather ------------------------------------------------------------------------


def scatter_gather(rank: int) -> None:
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    for name, spec in (("row-sharded", row_spec()), ("grid-sharded", grid_spec())):
        st = sw.shard_tensor(full, spec, src_rank=0)
        held = [
            (rank, s.metadata.shard_offsets, s.metadata.shard_sizes, float(s.tensor.sum()))
            for s in st.local_shards()
        ]
        table: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(table, held)
        out = torch.empty(10, 6) if rank == 0 else None
        st.gather(dst=0, out=out)
        if rank == 0:
            assert out is not None
            ok = torch.equal(out, full)
            print(f"\n{name}: scatter from rank 0, gather back -> equal: {ok}")
            print(f"  {'rank':<5} {'offsets':<10} {'sizes':<10} {'sum of block':>12}")
            for rows in table:
                for owner, offsets, sizes, total in rows:
                    print(f"  {owner:<5} {offsets!s:<10} {sizes!s:<10} {total:>12.1f}")
            if not ok:
                raise SystemExit(f"{name}: gathered tensor differs from the original")


# -- 3. a sharded Linear -------------------------------------------------------------------------


@sw.custom_sharding_spec_op(sw.ChunkShardingSpec, F.linear)
def sharded_linear(types: Any, args: Any, kwargs: Any, process_group: Any) -> torch.Tensor:
    """``F.linear`` with a weight row-sharded over output features: each rank computes its
    slice of the output, and an all-gather puts the slices side by side."""
    kwargs = kwargs or {}
    inputs, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    local = F.linear(inputs, weight.local_tensor())
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(pieces, local.contiguous(), group=process_group)
    out = torch.cat(pieces, dim=-1)
    return out if bias is None else out + bias


def sharded_module(rank: int) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.load_state_dict(reference.state_dict())
    sw.shard_parameter(model[0], "weight", row_spec())
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = reference(x)
        got = model(x)
    same = torch.allclose(got, expected, atol=1e-6)
    if rank == 0:
        local_rows = model[0].weight.local_tensor().shape[0]
        print(
            f"\nnn.Sequential with Linear(8, 16).weight row-sharded ({local_rows} rows per rank):"
            f" forward on 4 ranks matches the unsharded module: {same}"
        )
    if not same:
        raise SystemExit("sharded forward differs from the unsharded module")


# -- 4. checkpoint -----------------------------------------------------------------------------


def reference_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {
        "embedding": torch.randn(13, 8, generator=generator),
        "proj": torch.randn(6, 10, generator=generator, dtype=torch.float64),
        "norm": torch.randn(8, generator=generator),
    }


def save_model(rank: int, path: str) -> None:
    ref = reference_state()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    state = {
        "model": {
            "embedding": sw.shard_tensor(ref["embedding"], row_spec()),
            "proj": distribute_tensor(ref["proj"], mesh, [Shard(1)]),
            "norm": ref["norm"].clone(),
        },
        "step": 1000,
    }
    ckpt.save(state, path)
    if rank == 0:
        print(f"\n4 ranks saved the model state to {path}")


def reload_two_ranks(rank: int, world_size: int, port: int, path: str) -> None:
    _init(rank, world_size, port)
    try:
        ref = reference_state()
        cols = sw.ChunkShardingSpec(dim=1, placements=["rank:1/cpu", "rank:0/cpu"])
        mesh = init_device_mesh("cpu", (world_size,))
        state: dict[str, Any] = {
            "model": {
                "embedding": sw.zeros(cols, 13, 8),
                "proj": distribute_tensor(
                    torch.zeros(6, 10, dtype=torch.float64), mesh, [Shard(0)]
                ),
                "norm": torch.zeros(8),
            },
            "step": 0,
        }
        ckpt.load(state, path)
        # Each rank checks its own rows of proj (Shard(0)); rank 0 gathers the embedding.
        proj_rows = torch.chunk(ref["proj"], world_size, dim=0)[rank]
        ok = (
            torch.equal(state["model"]["proj"].to_local(), proj_rows)
            and torch.equal(state["model"]["norm"], ref["norm"])
            and state["step"] == 1000
        )
        out = torch.zeros(13, 8) if rank == 0 else None
        state["model"]["embedding"].gather(dst=0, out=out)
        if rank == 0:
            assert out is not None
            ok = ok and torch.equal(out, ref["embedding"])
            print(
                "2 ranks reloaded it (embedding column-sharded instead of row-sharded, proj "
                f"Shard(0) instead of Shard(1)): equal: {ok}"
            )
        if not ok:
            raise SystemExit("2-rank reload differs from what was saved")
    finally:
        dist.destroy_process_group()


def reload_single_process(path: str) -> None:
    ref = reference_state()
    state: dict[str, Any] = {
        "model": {name: torch.zeros_like(tensor) for name, tensor in ref.items()},
        "step": 0,
    }
    ckpt.load(state, path)
    ok = all(torch.equal(state["model"][name], ref[name]) for name in ref)
    ok = ok and state["step"] == 1000
    print(f"1 process without a process group reloaded it into plain tensors: equal: {ok}")
    if not ok:
        raise SystemExit("single-process reload differs from what was saved")
    metadata = ckpt.read_metadata(path)
    print("\nCheckpoint summary:")
    print(f"  {'key':<18} {'kind':<7} {'dtype':<14} {'size':<10} {'chunks':>6}")
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, ckpt.TensorStorageMetadata):
            dtype = str(entry.properties.dtype).removeprefix("torch.")
            print(
                f"  {fqn:<18} {'tensor':<7} {dtype:<14} {list(entry.size)!s:<10} "
                f"{len(entry.chunks):>6}"
            )
        else:
            print(f"  {fqn:<18} {'object':<7} {'-':<14} {'-':<10} {'-':>6}")
    files = sorted(os.listdir(os.path.join(path, "data")))
    print(f"  data files: {files}")


# -- 5. a training run with a CheckpointManager --------------------------------------------------

TRAIN_STEPS = 12


def train_run(rank: int, world_size: int, port: int, root: str, preempt_at: int | None) -> None:
    """Train to TRAIN_STEPS (resuming from the newest checkpoint under ``root``); with
    ``preempt_at``, rank 1 gets a SIGTERM at that step, as a scheduler's notice."""
    _init(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optim": optimizer}
        manager = ckpt.CheckpointManager(
            root,
            save_policy=ckpt.SavePolicy(every_steps=4, last_step=TRAIN_STEPS),
            retention=ckpt.RetentionPolicy(keep_last=2),
            preemption_signals=[signal.SIGTERM],
        )
        with manager:
            start = manager.restore(state) or 0
            if rank == 0:
                print(f"\nrun on {world_size} ranks: starts at step {start}")
            for step in range(start + 1, TRAIN_STEPS + 1):
                batch = torch.Generator().manual_seed(step)  # the same batch on every rank
                x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 1, generator=batch)
                loss = F.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step == preempt_at and rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 hears it
                if manager.save(step, state, metrics={"loss": loss}) and rank == 0:
                    print(f"  step {step:>2}: loss {loss.item():.4f}, saved")
                if manager.preempted:
                    if rank == 0:
                        print(f"  preempted: every rank saved step {step} and stopped")
                    break
        if rank == 0 and not manager.preempted:
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            torch.save(weights, os.path.join(root, "..", "weights.pt"))
    finally:
        dist.destroy_process_group()


def manager_story(tmp: str) -> None:
    root = os.path.join(tmp, "series")
    mp.spawn(train_run, args=(2, _free_port(), root, 6), nprocs=2, join=True)
    mp.spawn(train_run, args=(2, _free_port(), root, None), nprocs=2, join=True)
    resumed = torch.load(os.path.join(tmp, "weights.pt"))
    other = os.path.join(tmp, "uninterrupted", "series")
    mp.spawn(train_run, args=(2, _free_port(), other, None), nprocs=2, join=True)
    uninterrupted = torch.load(os.path.join(tmp, "uninterrupted", "weights.pt"))
    same = torch.equal(resumed, uninterrupted)
    print(f"\nresumed run's weights equal the uninterrupted run's: {same}")
    if not same:
        raise SystemExit("the resumed run differs from the uninterrupted one")
    print(f"\n$ shardwise ls {root}")
    sys.stdout.flush()
    shardwise_cli(["ls", root])


# -- driver ----------------------------------------------------------------------------------


def _four_rank_main(rank: int, port: int, path: str) -> None:
    _init(rank, WORLD_SIZE, port)
    try:
        if rank == 0:
            print("\n== 2. 4 gloo ranks: scatter from rank 0, gather back to rank 0 ==")
            sys.stdout.flush()
        scatter_gather(rank)
        if rank == 0:
            print("\n== 3. A module with a sharded parameter ==")
        sharded_module(rank)
        if rank == 0:
            print("\n== 4. Checkpoint: save on 4 ranks, reload on 2 ranks and on 1 process ==")
        save_model(rank, path)
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec_math()
    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        mp.spawn(_four_rank_main, args=(_free_port(), path), nprocs=WORLD_SIZE, join=True)
        mp.spawn(reload_two_ranks, args=(2, _free_port(), path), nprocs=2, join=True)
        reload_single_process(path)
        print("\n== 5. A training run with a CheckpointManager: preempted, resumed ==")
        sys.stdout.flush()
        manager_story(tmp)
    print("\ndemo finished")


if __name__ == "__main__":
    main()
