"""Messages of bytes between ranks of the local tier, over a gloo group, sizes first
(``docs/local-tier.md``, *Save path* and *Restore protocol*).

Three rounds of point-to-point tensors, every pair matched in the order both sides list it:

1. each sender sends the size of its message (``-1``: it has none, e.g. its part failed to
   read);
2. each receiver says whether it takes it (``accept``: a size it has room for);
3. the accepted messages travel.

So a receiver never allocates what it did not check, and neither side waits for a message
the other will not send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives

__all__ = ["exchange_messages"]


def exchange_messages(
    group: ProcessGroup,
    sends: Sequence[tuple[int, bytes | bytearray | None]],
    receives: Sequence[int],
    accept: Callable[[int, int], bool],
) -> list[memoryview | None]:
    """Send each ``(group rank, message)`` of ``sends`` (None: none) and receive one message
    from each group rank of ``receives``, in that order; the messages received, as views of
    the buffers they arrived in (None: the sender had none, or ``accept(sender, size)``
    refused its size).

    Collective over the ranks named on both sides: each pair must be listed by both.
    """
    ranks = collectives.global_ranks(group)
    sizes = [
        torch.tensor([-1 if data is None else len(data)], dtype=torch.int64) for _, data in sends
    ]
    offered = [torch.zeros(1, dtype=torch.int64) for _ in receives]
    collectives.send_recv_bytes(
        group,
        [(ranks[peer], size) for (peer, _), size in zip(sends, sizes, strict=True)],
        [(ranks[peer], size) for peer, size in zip(receives, offered, strict=True)],
    )
    taken = [
        size >= 0 and accept(peer, size)
        for peer, size in zip(receives, (int(size.item()) for size in offered), strict=True)
    ]
    answers = [torch.tensor([int(take)], dtype=torch.int64) for take in taken]
    agreed = [torch.zeros(1, dtype=torch.int64) for _ in sends]
    collectives.send_recv_bytes(
        group,
        [(ranks[peer], answer) for peer, answer in zip(receives, answers, strict=True)],
        [(ranks[peer], answer) for (peer, _), answer in zip(sends, agreed, strict=True)],
    )
    outgoing = [
        (ranks[peer], torch.frombuffer(_writable(data), dtype=torch.uint8))
        for (peer, data), answer in zip(sends, agreed, strict=True)
        if data is not None and int(answer.item()) and data
    ]
    buffers: list[torch.Tensor | None] = [
        torch.empty(int(size.item()), dtype=torch.uint8) if take else None
        for size, take in zip(offered, taken, strict=True)
    ]
    collectives.send_recv_bytes(
        group,
        outgoing,
        [
            (ranks[peer], buffer)
            for peer, buffer in zip(receives, buffers, strict=True)
            if buffer is not None and buffer.numel()
        ],
    )
    # Views of the buffers received: a message of 300 MiB is not copied again.
    return [None if buffer is None else memoryview(buffer.numpy()) for buffer in buffers]  # type: ignore[arg-type]


def _writable(data: bytes | bytearray) -> bytearray:
    """``data`` as the writable buffer ``torch.frombuffer`` takes without a warning (a copy
    only of read-only bytes)."""
    return data if isinstance(data, bytearray) else bytearray(data)
