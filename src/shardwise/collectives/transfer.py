"""Tensor bytes between ranks: point-to-point moves of raw bytes (every dtype on every
backend), gathers, all-to-all, reductions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.collectives._held import held
from shardwise.collectives.groups import comm_device, global_ranks, group_rank, group_world_size

__all__ = [
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_sum_int",
    "all_to_all",
    "barrier",
    "send_recv_bytes",
]


def all_reduce_sum_int(value: int, process_group: ProcessGroup) -> int:
    """Sum an integer over the group (used for votes)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=comm_device(process_group))
    with held(tensor):
        dist.all_reduce(tensor, group=process_group)
    return int(tensor.item())


def barrier(process_group: ProcessGroup) -> None:
    """Wait for every member of ``process_group``."""
    dist.barrier(group=process_group)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # Move raw bytes so every dtype (bool, complex, float8, ...) travels the same way, whatever
    # the backend supports for arithmetic collectives. A tensor torch calls contiguous may
    # still have a stride other than 1 in a dim of size 1 (e.g. a one-element expand), which
    # view() refuses: such a tensor is copied.
    if tensor.dim() and tensor.stride(-1) != 1:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor.reshape(-1).view(torch.uint8)


def send_recv_bytes(
    process_group: ProcessGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """Point-to-point exchange of contiguous tensors, as raw bytes.

    Args:
        process_group: The group the peers belong to.
        sends: ``(peer global rank, tensor)`` pairs to send.
        recvs: ``(peer global rank, tensor)`` pairs to receive into (filled in place).

    Pairs with the same peer are matched in order on both sides. Empty tensors are skipped
    (both sides know the sizes from the metadata, so they skip the same ones).
    """
    # The byte views the backend reads and writes, made first so that they are held (_held).
    receiving = [(peer, _as_bytes(tensor)) for peer, tensor in recvs if tensor.numel()]
    sending = [(peer, _as_bytes(tensor.contiguous())) for peer, tensor in sends if tensor.numel()]
    works = []
    with held([view for _, view in receiving], [view for _, view in sending]):
        for peer, view in receiving:
            works.append(dist.irecv(view, src=peer, group=process_group))
        for peer, view in sending:
            works.append(dist.isend(view, dst=peer, group=process_group))
        for work in works:
            if work is not None:
                work.wait()


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, op: str, process_group: ProcessGroup) -> None:
    """All-reduce ``tensor`` in place over ``process_group`` (on the group's device).

    Args:
        op: ``"sum"``, ``"max"`` or ``"min"``.
    """
    reduce_op = _REDUCE_OPS[op]
    device = comm_device(process_group)
    if tensor.device == device:
        with held(tensor):
            dist.all_reduce(tensor, op=reduce_op, group=process_group)
        return
    staged = tensor.to(device)
    with held(staged):
        dist.all_reduce(staged, op=reduce_op, group=process_group)
    tensor.copy_(staged)


def all_gather_tensor(tensor: torch.Tensor, process_group: ProcessGroup) -> list[torch.Tensor]:
    """Gather ``tensor`` from every member of ``process_group``, in group-rank order.

    Every member must pass a tensor of the same shape and dtype (agree on them first, e.g.
    with :func:`exchange_or_raise`). Raw bytes travel, so any dtype works on any backend. The
    results are new tensors on ``tensor``'s device; no autograd history.
    """
    world = group_world_size(process_group)
    if tensor.numel() == 0:
        # Nothing to move; gloo also rejects zero-byte collectives on some versions.
        return [torch.empty_like(tensor) for _ in range(world)]
    device = comm_device(process_group)
    payload = _as_bytes(tensor.detach().to(device).contiguous())
    received = [torch.empty_like(payload) for _ in range(world)]
    with held(received, payload):
        dist.all_gather(received, payload, group=process_group)
    return [
        buffer.view(tensor.dtype).reshape(tensor.shape).to(tensor.device) for buffer in received
    ]


def all_to_all(
    sends: Sequence[torch.Tensor],
    recvs: Sequence[torch.Tensor],
    process_group: ProcessGroup,
) -> None:
    """Send ``sends[j]`` to group rank ``j`` and fill ``recvs[j]`` from it, for every ``j``.

    Splits may be uneven (any size per peer, empty included): each side allocates what it
    receives, so both must agree on the sizes. Built on point-to-point messages of raw bytes,
    which every backend supports for every dtype: gloo's list-form ``all_to_all`` rejects
    tensors of different sizes. ``recvs`` are filled in place; the tensor for this rank is
    copied locally.
    """
    me = group_rank(process_group)
    peers = global_ranks(process_group)
    device = comm_device(process_group)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    send_pairs: list[tuple[int, torch.Tensor]] = []
    recv_pairs: list[tuple[int, torch.Tensor]] = []
    for peer_index, (send, recv) in enumerate(zip(sends, recvs, strict=True)):
        if peer_index == me:
            recv.copy_(send)
            continue
        send_pairs.append((peers[peer_index], send.detach().to(device).contiguous()))
        if recv.device == device and recv.is_contiguous():
            recv_pairs.append((peers[peer_index], recv))
        else:
            buffer = torch.empty(recv.shape, dtype=recv.dtype, device=device)
            staged.append((buffer, recv))
            recv_pairs.append((peers[peer_index], buffer))
    send_recv_bytes(process_group, send_pairs, recv_pairs)
    for buffer, recv in staged:
        recv.copy_(buffer)
