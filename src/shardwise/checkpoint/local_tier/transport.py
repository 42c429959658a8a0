"""Buffers of bytes between ranks of the local tier, over a gloo group, sizes first
(``docs/local-tier.md``, *Save path* and *Restore protocol*).

Three rounds of point-to-point tensors, every pair matched in the order both sides list it:

1. each sender sends the size of its buffer (``-1``: it has none, e.g. its part failed to
   read);
2. each receiver says whether it takes it: its ``place`` for that size gives the buffer the
   bytes land in (a file's mapping, a buffer in memory), or refuses;
3. the accepted buffers travel, straight from the sender's buffer into the receiver's.

So a receiver never makes room for what it did not check, and neither side waits for bytes
the other will not send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives

__all__ = ["exchange_buffers", "Place"]

#: A receiver's answer to an offered size: a writable buffer of exactly that many bytes to
#: receive into, or None (refused). Given the sender's group rank and the size; it must not
#: raise (its peer waits for the answer), a failure is a refusal.
Place = Callable[[int, int], Any]


def exchange_buffers(
    group: ProcessGroup,
    sends: Sequence[tuple[int, Any]],
    receives: Sequence[tuple[int, Place]],
) -> list[Any]:
    """Send each ``(group rank, buffer)`` of ``sends`` (a writable buffer, or None: none)
    and receive one buffer from each ``(group rank, place)`` of ``receives``, in that
    order; for each receive, the buffer its ``place`` gave, filled, or None (the sender had
    none, or ``place`` refused).

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
        [(ranks[peer], size) for (peer, _), size in zip(receives, offered, strict=True)],
    )
    places = [
        place(peer, size) if size >= 0 else None
        for (peer, place), size in zip(
            receives, (int(item.item()) for item in offered), strict=True
        )
    ]
    answers = [torch.tensor([int(buffer is not None)], dtype=torch.int64) for buffer in places]
    agreed = [torch.zeros(1, dtype=torch.int64) for _ in sends]
    collectives.send_recv_bytes(
        group,
        [(ranks[peer], answer) for (peer, _), answer in zip(receives, answers, strict=True)],
        [(ranks[peer], answer) for (peer, _), answer in zip(sends, agreed, strict=True)],
    )
    collectives.send_recv_bytes(
        group,
        [
            (ranks[peer], torch.frombuffer(data, dtype=torch.uint8))
            for (peer, data), answer in zip(sends, agreed, strict=True)
            if data is not None and int(answer.item()) and len(data)
        ],
        [
            (ranks[peer], torch.frombuffer(buffer, dtype=torch.uint8))
            for (peer, _), buffer in zip(receives, places, strict=True)
            if buffer is not None and len(buffer)
        ],
    )
    return places
