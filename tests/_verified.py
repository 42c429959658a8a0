"""Helpers of the distributed tests of a load's verifying pass: which blocks a rank checks,
and every rank's view of a value."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint._verify import Block
from shardwise.checkpoint.reader import CheckpointReader


@contextlib.contextmanager
def recorded_blocks() -> Iterator[list[tuple[str, int, int]]]:
    """The blocks this rank's loads verify while the context is open, as ``(file, begin,
    end)``."""
    seen: list[tuple[str, int, int]] = []
    original = CheckpointReader.verify

    def verify(self: CheckpointReader, blocks: Iterable[Block], *args: Any, **kwargs: Any) -> None:
        blocks = list(blocks)
        seen.extend((block.file, block.begin, block.end) for block in blocks)
        original(self, blocks, *args, **kwargs)

    CheckpointReader.verify = verify  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        CheckpointReader.verify = original  # type: ignore[method-assign]


def everyones(value: Any) -> list[Any]:
    """``value`` of every rank of the default group, in rank order (collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
