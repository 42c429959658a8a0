"""``F.embedding`` and ``F.embedding_bag`` with a chunk-sharded 2-D weight.

Both ops are collective. Every rank of the weight's process group calls the op with its own
ids (the same shape on every rank) and gets the result for its own ids, equal to the op on
the unsharded weight. The weight must hold exactly one shard per rank.

Algorithms (the ids of every rank are all-gathered first):

* **Row-wise** (``dim=0``): each rank looks up (and pools) only the ids inside its own row
  range, for every rank's input: other ids contribute zeros, and a ``max`` bag with none of
  its ids here is ``-inf`` (empty and all-padding bags are zero again at the end). An
  all-to-all sends each rank the partial results for its input, which it reduces: summed
  for lookups and ``sum``/``mean`` bags (``mean`` divides by the bag sizes afterwards, since
  a sum of means is not a mean), maximum for ``max`` bags. In other words a reduce-scatter,
  done with point-to-point messages so that it runs on gloo with any chunk sizes.
* **Column-wise** (``dim=1``): each rank computes its own columns for every rank's input
  (every column is independent, so every mode is exact); an all-to-all with uneven splits
  sends each rank its slices, which it concatenates in column order.

``max_norm`` renormalises the stored local shard in place, as the unsharded op would after
seeing the ids of every rank: row-wise each rank renormalises the rows it owns; column-wise
the per-row norms need every rank's columns, so the powered partial sums are all-reduced
first. The scale is the unsharded op's (``max_norm / (norm + 1e-7)``).

Autograd: the local result is differentiable with respect to the local shard and to
``per_sample_weights`` (the all-to-all is an autograd function whose backward is the reverse
all-to-all), so every rank must run the backward pass.

Validation happens before any data moves and every rank reaches the same verdict (see
:mod:`shardwise.ops._embedding_validation`).

Zero-width tables: torch's CPU pooling kernel has a fast path (float32, half and bfloat16
tables with unit column stride, no ``padding_idx``) that hands each thread's bags to fbgemm;
fbgemm cannot pool rows of width 0 and reports a failure, which torch turns into the
misleading ``Expected i < index_size to be true`` — only when the bags are split over more
than one thread, so it came and went with the machine's thread count. Nothing here ever
passes a zero-width table to the kernel: the validation stand-in has one (broadcast) column,
and a shard with no columns (e.g. 3 columns over 4 ranks) pools to an empty result directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.ops._embedding_validation import (
    agree,
    bind,
    jsonable,
    mode_of,
    norm_type_of,
    validate_embedding,
    validate_embedding_bag,
)
from shardwise.ops.registry import custom_sharding_spec_op
from shardwise.sharding_spec import ChunkShardingSpec

__all__ = ["sharded_embedding", "sharded_embedding_bag"]
#: The unsharded op's guard against dividing by a zero norm in ``embedding_renorm_``.
_RENORM_EPS = 1e-7


def _pool(
    ids: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    *,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    padding_idx: int | None,
) -> torch.Tensor:
    """``F.embedding_bag`` of 1-D ``ids`` in bags starting at ``starts``, any table width.

    A table with no columns gives ``(bags, 0)`` without calling the kernel (see the module
    docstring), still tied to the table and the weights in the autograd graph: the
    exchanges downstream run their backward only on ranks whose inputs need gradients, and
    every rank must take part.
    """
    if table.size(1) > 0:
        return F.embedding_bag(
            ids,
            table,
            starts,
            mode=mode,
            per_sample_weights=per_sample_weights,
            padding_idx=padding_idx,
        )
    empty = table.new_zeros((starts.numel(), 0))
    for source in (table, per_sample_weights):
        if source is not None and source.requires_grad:
            # (source * 0) first: its gradient is then a dense tensor, not a broadcast one.
            empty = empty + (source * 0).sum()
    return empty


# -- layout ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each group rank's shard sits along the sharding dim."""

    me: int
    starts: list[int]
    lengths: list[int]

    @classmethod
    def of(cls, weight: Any, dim: int, group: ProcessGroup) -> _Layout:
        world = collectives.group_world_size(group)
        starts, lengths = [0] * world, [0] * world
        for shard_metadata in weight.metadata().shards_metadata:
            rank = collectives.to_group_rank(group, shard_metadata.placement.rank())
            starts[rank] = shard_metadata.shard_offsets[dim]
            lengths[rank] = shard_metadata.shard_sizes[dim]
        return cls(collectives.group_rank(group), starts, lengths)

    def column_order(self) -> list[int]:
        """Group ranks sorted by where their columns start."""
        return sorted(range(len(self.starts)), key=lambda rank: self.starts[rank])


@dataclass(frozen=True, slots=True)
class _Table:
    """This rank's shard of the weight, its layout, and the options every algorithm reads."""

    shard: torch.Tensor
    layout: _Layout
    padding_idx: int | None
    """Counted from the start of the weight (a negative ``padding_idx`` made positive)."""
    max_norm: float | None
    norm_type: float
    group: ProcessGroup

    @classmethod
    def of(cls, params: Any, dim: int, group: ProcessGroup) -> _Table:
        weight = params["weight"]
        padding_idx = params["padding_idx"]
        if padding_idx is not None and padding_idx < 0:
            padding_idx += weight.size(0)
        return cls(
            shard=weight.local_tensor(),
            layout=_Layout.of(weight, dim, group),
            padding_idx=padding_idx,
            max_norm=params["max_norm"],
            norm_type=norm_type_of(params),
            group=group,
        )

    def own_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` as rows of this rank's shard, and which of them it owns (row-wise).

        With ``max_norm``, the owned rows are renormalised first, as the unsharded op does.
        """
        start, length = self.layout.starts[self.layout.me], self.layout.lengths[self.layout.me]
        local = ids - start
        owned = (local >= 0) & (local < length)
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(
                    self.shard, torch.unique(local[owned]), self.max_norm, self.norm_type
                )
        return local, owned

    def local_padding(self) -> int | None:
        """``padding_idx`` as a row of this rank's shard, or ``None`` if another rank owns it."""
        start, length = self.layout.starts[self.layout.me], self.layout.lengths[self.layout.me]
        if self.padding_idx is None or not start <= self.padding_idx < start + length:
            return None
        return self.padding_idx - start

    def renorm_split_rows(self, ids: torch.Tensor) -> None:
        """With ``max_norm``, renormalise the rows ``ids`` names (column-wise sharding)."""
        if self.max_norm is not None:
            _renorm_split_rows(
                self.shard, torch.unique(ids), self.max_norm, self.norm_type, self.group
            )


# -- autograd-aware exchange ----------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Send the ``j``-th tensor to group rank ``j``; backward sends the gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, group: ProcessGroup, recv_shapes: list[torch.Size], *sends: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.send_shapes = [send.shape for send in sends]
        recvs = [sends[0].new_empty(shape) for shape in recv_shapes]
        collectives.all_to_all([_dense(send) for send in sends], recvs, group)
        return tuple(recvs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        grad_sends = [grads[0].new_empty(shape) for shape in ctx.send_shapes]
        collectives.all_to_all([_dense(grad) for grad in grads], grad_sends, ctx.group)
        return (None, None, *grad_sends)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its own memory, one element after the other.

    ``contiguous()`` is not enough: a one-element tensor broadcast from a scalar (autograd
    makes such gradients) counts as contiguous with a stride of 0, which the byte view of a
    point-to-point message rejects.
    """
    tensor = tensor.contiguous()
    if tensor.dim() > 0 and tensor.stride(-1) != 1:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _exchange(
    sends: Sequence[torch.Tensor], recv_shapes: list[torch.Size], group: ProcessGroup
) -> list[torch.Tensor]:
    received = _AllToAll.apply(group, recv_shapes, *sends)  # type: ignore[no-untyped-call]
    return list(received)


def _reduce_scatter(
    chunks: Sequence[torch.Tensor], group: ProcessGroup, reduce: str
) -> torch.Tensor:
    """Send ``chunks[j]`` to group rank ``j``; reduce what every rank computed for this one.

    A reduce-scatter (``reduce`` is ``"max"``, or anything else for a sum) built on the
    autograd all-to-all; all chunks have the same shape.
    """
    received = torch.stack(_exchange(chunks, [chunk.shape for chunk in chunks], group))
    if reduce == "max":
        return received.max(dim=0).values
    return received.sum(dim=0)


def _per_rank(batch: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Split a batch made of every rank's equal part (rank-major) into those parts."""
    return list(batch.reshape(world, batch.size(0) // world, *batch.shape[1:]).unbind(0))


def _gather_columns(
    pieces_for_ranks: Sequence[torch.Tensor], layout: _Layout, group: ProcessGroup
) -> torch.Tensor:
    """Send each rank its column slice; concatenate the received slices in column order."""
    batch_shape = pieces_for_ranks[0].shape[:-1]
    recv_shapes = [torch.Size([*batch_shape, length]) for length in layout.lengths]
    received = _exchange(pieces_for_ranks, recv_shapes, group)
    return torch.cat([received[rank] for rank in layout.column_order()], dim=-1)


# -- max_norm -------------------------------------------------------------------------------


def _renorm_split_rows(
    shard: torch.Tensor, rows: torch.Tensor, max_norm: float, p: float, group: ProcessGroup
) -> None:
    """Renormalise ``rows`` of a column shard: the row norms need every rank's columns."""
    with torch.no_grad():
        values = shard.index_select(0, rows).to(torch.float64).abs()
        if math.isinf(p):
            # Identity of the reduction for ranks that hold no columns.
            fill = 0.0 if p > 0 else math.inf
            partial = torch.full((rows.numel(),), fill, dtype=torch.float64)
            if values.size(1):
                partial = values.amax(dim=1) if p > 0 else values.amin(dim=1)
            collectives.all_reduce(partial, "max" if p > 0 else "min", group)
            norms = partial
        elif p == 0:
            partial = (values != 0).sum(dim=1, dtype=torch.float64)
            collectives.all_reduce(partial, "sum", group)
            norms = partial
        else:
            partial = values.pow(p).sum(dim=1)
            collectives.all_reduce(partial, "sum", group)
            norms = partial.pow(1.0 / p)
        too_long = norms > max_norm
        scale = (max_norm / (norms[too_long] + _RENORM_EPS)).to(shard.dtype)
        selected = rows[too_long]
        shard.index_copy_(0, selected, shard.index_select(0, selected) * scale.unsqueeze(1))


# -- F.embedding ------------------------------------------------------------------------------


@custom_sharding_spec_op(ChunkShardingSpec, F.embedding)
def sharded_embedding(
    types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any], pg: Any
) -> torch.Tensor:
    """``F.embedding(input, weight, ...)`` with a chunk-sharded weight (collective).

    Every rank passes its own ``input`` of the same shape and gets the embeddings of its own
    ids. Row-wise and column-wise sharding; ``padding_idx`` and ``max_norm`` (which
    renormalises the local shard in place, as for the ids of all ranks together) work as in
    the unsharded op.

    Raises:
        TypeError, ValueError, RuntimeError: The upstream validation errors (a non-tensor
            input, an id out of range, ``sparse``/``scale_grad_by_freq``, ...), the unsharded
            op's own errors, or ranks disagreeing on the input shape or options.

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> weight = shardwise.shard_tensor(torch.randn(10, 4), spec)
        >>> F.embedding(torch.tensor([[1, 7]]), weight).shape
        torch.Size([1, 2, 4])
    """
    params = bind(F.embedding, args, kwargs)
    group = collectives.resolve_group(pg)
    ids = params["input"]

    def describe() -> dict[str, object]:
        return {
            "input shape": list(ids.shape),
            "input dtype": str(ids.dtype),
            **{name: jsonable(params[name]) for name in ("padding_idx", "max_norm", "norm_type")},
        }

    dim = agree("F.embedding", group, lambda: validate_embedding(params), describe)
    table = _Table.of(params, dim, group)
    gathered = torch.stack(collectives.all_gather_tensor(ids, group)).to(torch.int64)
    if dim == 0:
        return _embedding_row_wise(gathered, table)
    table.renorm_split_rows(gathered)
    looked_up = F.embedding(gathered, table.shard, padding_idx=table.padding_idx)
    return _gather_columns(list(looked_up.unbind(0)), table.layout, group)


def _embedding_row_wise(gathered: torch.Tensor, table: _Table) -> torch.Tensor:
    shard = table.shard
    local, owned = table.own_rows(gathered.reshape(-1))
    positions = owned.nonzero().squeeze(1)
    rows = F.embedding(local[positions], shard, padding_idx=table.local_padding())
    partial = shard.new_zeros((local.numel(), shard.size(1))).index_copy(0, positions, rows)
    mine = _reduce_scatter(_per_rank(partial, len(table.layout.starts)), table.group, "sum")
    return mine.reshape(*gathered.shape[1:], shard.size(1))


# -- F.embedding_bag --------------------------------------------------------------------------


@custom_sharding_spec_op(ChunkShardingSpec, F.embedding_bag)
def sharded_embedding_bag(
    types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any], pg: Any
) -> torch.Tensor:
    """``F.embedding_bag(input, weight, ...)`` with a chunk-sharded weight (collective).

    Every rank passes its own ``input`` (and ``offsets`` / ``per_sample_weights``) of the
    same shapes and gets the bags of its own input. Modes ``sum``, ``mean`` (default) and
    ``max``; ``offsets`` for 1-D input, ``include_last_offset``, ``per_sample_weights``
    (``sum`` mode), ``padding_idx`` and ``max_norm`` work as in the unsharded op.

    Raises:
        TypeError, ValueError, RuntimeError, NotImplementedError: The upstream validation
            errors, the unsharded op's own errors, or ranks disagreeing on shapes or options.
    """
    params = bind(F.embedding_bag, args, kwargs)
    group = collectives.resolve_group(pg)
    ids = params["input"]
    offsets, per_sample_weights = params["offsets"], params["per_sample_weights"]

    def describe() -> dict[str, object]:
        return {
            "input shape": list(ids.shape),
            "input dtype": str(ids.dtype),
            "offsets length": None if offsets is None else offsets.numel(),
            "per_sample_weights": per_sample_weights is not None,
            "mode": jsonable(mode_of(params)),
            **{
                name: jsonable(params[name])
                for name in ("include_last_offset", "padding_idx", "max_norm", "norm_type")
            },
        }

    dim = agree("F.embedding_bag", group, lambda: validate_embedding_bag(params), describe)
    table = _Table.of(params, dim, group)
    bags = _Bags.gather(params, group)
    mode = mode_of(params)
    if dim == 0:
        return _embedding_bag_row_wise(bags, table, mode)
    table.renorm_split_rows(bags.ids)
    pooled = _pool(
        bags.ids,
        table.shard,
        bags.starts,
        mode=mode,
        per_sample_weights=bags.per_sample_weights,
        padding_idx=table.padding_idx,
    )
    return _gather_columns(_per_rank(pooled, len(table.layout.starts)), table.layout, group)


@dataclass(frozen=True, slots=True)
class _Bags:
    """Every rank's bags as one 1-D batch: ids, weights, and the start of each bag.

    Rank ``r``'s bags come ``r``-th, ``per_rank`` bags each; starts are positions in ``ids``.
    """

    ids: torch.Tensor
    starts: torch.Tensor
    per_sample_weights: torch.Tensor | None
    per_rank: int
    own_ids: torch.Tensor
    own_starts: torch.Tensor

    @classmethod
    def gather(cls, params: Any, group: ProcessGroup) -> _Bags:
        ids, offsets = params["input"], params["offsets"]
        flat = ids.reshape(-1).to(torch.int64)
        if ids.dim() == 2:
            starts = torch.arange(ids.size(0), dtype=torch.int64, device=ids.device) * ids.size(1)
        else:
            starts = offsets.to(torch.int64)
            if params["include_last_offset"]:
                # Without the trailing offset, the last bag runs to the end of the input.
                starts = starts[:-1]
        count = flat.numel()
        packed = collectives.all_gather_tensor(torch.cat([flat, starts]), group)
        all_ids = torch.cat([entry[:count] for entry in packed])
        all_starts = torch.cat([entry[count:] + rank * count for rank, entry in enumerate(packed)])
        weights = params["per_sample_weights"]
        all_weights = None
        if weights is not None:
            # Through the autograd all-to-all, so that the weights get their gradients back.
            mine = weights.reshape(-1)
            world = collectives.group_world_size(group)
            all_weights = torch.cat(_exchange([mine] * world, [mine.shape] * world, group))
        return cls(all_ids, all_starts, all_weights, starts.numel(), flat, starts)

    def own_sizes(self, padding_idx: int | None) -> torch.Tensor:
        """Number of non-padding ids in each of this rank's bags."""
        counted = self.own_ids != padding_idx if padding_idx is not None else None
        bag_of = _bag_of(self.own_starts, self.own_ids.numel())
        if counted is not None:
            bag_of = bag_of[counted]
        return torch.bincount(bag_of, minlength=self.per_rank)


def _bag_of(starts: torch.Tensor, count: int) -> torch.Tensor:
    """For each of ``count`` positions, the bag it belongs to (``starts`` is sorted)."""
    positions = torch.arange(count, device=starts.device)
    return torch.searchsorted(starts, positions, right=True) - 1


def _embedding_bag_row_wise(bags: _Bags, table: _Table, mode: str) -> torch.Tensor:
    local, owned = table.own_rows(bags.ids)
    padding_idx = table.padding_idx
    # Drop the ids other ranks own; each bag now starts after the kept ids before it.
    kept_before = torch.cat([owned.new_zeros(1, dtype=torch.int64), owned.cumsum(0)])
    positions = owned.nonzero().squeeze(1)
    weights = bags.per_sample_weights
    partial = _pool(
        local[positions],
        table.shard,
        kept_before[bags.starts],
        mode="sum" if mode == "mean" else mode,
        per_sample_weights=None if weights is None else weights[positions],
        padding_idx=table.local_padding(),
    )
    if mode == "max":
        # A bag with none of its ids here must not win the max with the op's empty-bag zero.
        counted = owned if padding_idx is None else owned & (bags.ids != padding_idx)
        bag_of = _bag_of(bags.starts, bags.ids.numel())
        here = torch.bincount(bag_of[counted], minlength=bags.starts.numel()) > 0
        partial = torch.where(here.unsqueeze(1), partial, -math.inf)
    mine = _reduce_scatter(_per_rank(partial, len(table.layout.starts)), table.group, mode)
    if mode == "sum":
        return mine
    sizes = bags.own_sizes(padding_idx).unsqueeze(1)
    if mode == "mean":
        # Empty and all-padding bags are zero, as in the unsharded op.
        return mine / sizes.clamp(min=1).to(mine.dtype)
    return torch.where(sizes > 0, mine, 0.0)
