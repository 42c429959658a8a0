"""Train a model with sharded parameters, checkpoint it, and resume on a different world size.

    python examples/train_sharded.py

The model pools a bag of item ids with a row-wise sharded ``nn.EmbeddingBag`` (each rank
holds some of the rows) and classifies the result with a column-wise sharded Linear layer
(each rank holds some of the input columns of its weight; its bias is replicated).
``shardwise.ShardedOptimizer`` (AdamW) steps the local shards and keeps the replicated bias in
step on every rank.

1. 4 ranks train for ``STEPS`` steps and save a checkpoint (model, optimizer, step) after
   step ``SAVE_AT`` with ``shardwise.checkpoint``; the loss goes down.
2. 2 ranks build the model afresh (2 shards per weight instead of 4), load the checkpoint and
   train the remaining steps: their losses are those of the uninterrupted run (to float
   rounding: with fewer ranks the partial sums add up in another order).

Every rank sees its part of one global batch per step (a function of the step), and its loss
is its part of the batch's mean loss, so the sum over ranks is the global loss whatever the
world size. The sharded ops' backward gives each shard the gradient of that sum, and
``sync_replicated_grads=True`` sums the bias's gradients the same way.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt

NUM_ITEMS, DIM, CLASSES, BAG = 64, 16, 8, 4
GLOBAL_BATCH = 32  # divisible by every world size used
STEPS, SAVE_AT = 12, 6
LR = 0.1


def chunk_spec(dim: int, world_size: int) -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world_size)])


class AllToAll(torch.autograd.Function):
    """Send ``sends[j]`` to rank ``j`` (all the same shape); the backward sends the
    gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, *sends: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        received = [torch.empty_like(send) for send in sends]
        dist.all_to_all(received, [send.contiguous() for send in sends])
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        returned = [torch.empty_like(grad) for grad in grads]
        dist.all_to_all(returned, [grad.contiguous() for grad in grads])
        return tuple(returned)


class ColumnWiseLinear(nn.Module):
    """``nn.Linear`` whose weight is sharded by input columns (``ChunkShardingSpec(dim=1)``).

    Collective: every rank passes its own input rows and gets its own outputs. Each rank
    multiplies its input columns of every rank's rows by its weight columns; an all-to-all
    hands each rank the partial products of its rows, which it sums. Through the backward,
    each weight shard gets the gradient of every rank's loss; the replicated bias only its
    own rank's (``sync_replicated_grads`` sums those).
    """

    def __init__(self, linear: nn.Linear, spec: sw.ChunkShardingSpec) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        sw.shard_parameter(self, "weight", spec)  # scattered from rank 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, sw.ShardedTensor)
        (shard,) = weight.local_shards()
        start, width = shard.metadata.shard_offsets[1], shard.metadata.shard_sizes[1]
        every_ranks_rows = AllToAll.apply(*[x] * dist.get_world_size())
        partial = [
            F.linear(rows[:, start : start + width], shard.tensor) for rows in every_ranks_rows
        ]
        mine = AllToAll.apply(*partial)
        return torch.stack(mine).sum(dim=0) + self.bias


class ColumnWiseSharder(sw.Sharder):
    """Replaces an ``nn.Linear`` by a :class:`ColumnWiseLinear` (used by ``shard_module``)."""

    def __init__(self, spec: sw.ChunkShardingSpec) -> None:
        self.spec = spec

    def shard(self, module: nn.Module) -> nn.Module:
        assert isinstance(module, nn.Linear)
        return ColumnWiseLinear(module, self.spec)


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(NUM_ITEMS, DIM, mode="mean")
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bag(ids)))


def build(world_size: int) -> tuple[nn.Module, sw.ShardedOptimizer]:
    """The model sharded over ``world_size`` ranks, and its optimizer (collective)."""
    torch.manual_seed(0)
    model = BagClassifier()
    plan = sw.ShardingPlan(
        plan={
            "bag.weight": chunk_spec(0, world_size),  # row-wise
            "head": ColumnWiseSharder(chunk_spec(1, world_size)),  # column-wise
        }
    )
    sw.shard_module(model, plan)
    optimizer = sw.ShardedOptimizer(
        sw.named_params_with_sharded_tensor(model),
        torch.optim.AdamW,
        lr=LR,
        sync_replicated_grads=True,
    )
    return model, optimizer


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch: bags of item ids and their labels.

    Item ``i`` belongs to class ``i % CLASSES``; a bag holds items of its label's class and
    one random item, so there is something to learn.
    """
    generator = torch.Generator().manual_seed(step)
    labels = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)
    per_class = NUM_ITEMS // CLASSES
    ids = labels[:, None] + CLASSES * torch.randint(
        0, per_class, (GLOBAL_BATCH, BAG), generator=generator
    )
    ids[:, -1] = torch.randint(0, NUM_ITEMS, (GLOBAL_BATCH,), generator=generator)
    per_rank = GLOBAL_BATCH // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return ids[mine], labels[mine]


def train(model: nn.Module, optimizer: sw.ShardedOptimizer, steps: Sequence[int]) -> list[float]:
    """Train on ``steps``; returns the global loss of each step (the same on every rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        ids, labels = batch(step, rank, world_size)
        # This rank's share of the batch's mean loss: the ranks' shares sum to the mean.
        loss = F.cross_entropy(model(ids), labels, reduction="sum") / GLOBAL_BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def run_uninterrupted(path: str) -> list[float]:
    """All steps on the current group, saving the checkpoint after step ``SAVE_AT``."""
    model, optimizer = build(dist.get_world_size())
    losses = train(model, optimizer, range(SAVE_AT))
    ckpt.save({"model": model, "optim": optimizer, "step": SAVE_AT}, path)
    return losses + train(model, optimizer, range(SAVE_AT, STEPS))


def run_resumed(path: str) -> list[float]:
    """Load the checkpoint into a model built for the current group; train the rest."""
    model, optimizer = build(dist.get_world_size())
    state: dict[str, Any] = {"model": model, "optim": optimizer, "step": 0}
    ckpt.load(state, path)  # fills the shards in place, whatever the saving world size
    return train(model, optimizer, range(state["step"], STEPS))


# -- running it on this machine ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, job: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        losses = run_uninterrupted(path) if job == "uninterrupted" else run_resumed(path)
        if rank == 0:
            torch.save(losses, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step-6")
        runs = {}
        for job, world_size in (("uninterrupted", 4), ("resumed", 2)):
            out = os.path.join(tmp, f"{job}.pt")
            args = (world_size, _free_port(), job, path, out)
            mp.spawn(_worker, args=args, nprocs=world_size, join=True)
            runs[job] = torch.load(out)
    uninterrupted, resumed = runs["uninterrupted"], runs["resumed"]
    print(f"{'step':>4}  {'4 ranks':>10}  {'resumed on 2':>12}")
    for step, loss in enumerate(uninterrupted):
        again = f"{resumed[step - SAVE_AT]:12.6f}" if step >= SAVE_AT else ""
        print(f"{step:>4}  {loss:10.6f}  {again}")
    close = all(
        abs(a - b) <= 1e-5 * abs(a) for a, b in zip(uninterrupted[SAVE_AT:], resumed, strict=True)
    )
    print(f"loss {uninterrupted[0]:.4f} -> {uninterrupted[-1]:.4f}; resumed run matches: {close}")
    if not close:
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
