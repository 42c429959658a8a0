"""Box arithmetic shared by the sharding and checkpoint layers — the one home of each rule.

A *box* is a rectangular region of a tensor's global index space, written ``(offsets, sizes)``
with one entry per dimension. Shards, saved chunks, load targets and reshard transfers are
all boxes; these helpers intersect them and turn them into views of the local tensors that
hold them. Pure, and below every other module of the package (it imports only torch).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

__all__ = [
    "Box",
    "borrowed_bytes",
    "byte_view",
    "checked_bytes",
    "intersect",
    "narrow_to",
    "origin",
    "region",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a region of a tensor's global index space."""


def intersect(
    a_offsets: Sequence[int],
    a_sizes: Sequence[int],
    b_offsets: Sequence[int],
    b_sizes: Sequence[int],
) -> Box | None:
    """The box two boxes share, or ``None`` when it is empty (including when either box is)."""
    offsets = []
    sizes = []
    for a_off, a_size, b_off, b_size in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True):
        start = max(a_off, b_off)
        stop = min(a_off + a_size, b_off + b_size)
        if stop <= start:
            return None
        offsets.append(start)
        sizes.append(stop - start)
    return tuple(offsets), tuple(sizes)


def narrow_to(
    tensor: torch.Tensor, origin: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """The view of ``tensor`` holding the global box ``(offsets, sizes)``, where ``tensor``
    holds the global box that starts at ``origin`` (the box must lie inside it)."""
    view = tensor
    for dim, (start, offset, size) in enumerate(zip(origin, offsets, sizes, strict=True)):
        if offset != start or size != view.size(dim):
            view = view.narrow(dim, offset - start, size)
    return view


def region(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of a whole (global) ``tensor`` that a shard at ``(offsets, sizes)`` covers.

    An empty trailing shard may start past the end (13 rows in 8 chunks of 2: the last one
    starts at row 14); its view is an empty one at the end rather than an error.
    """
    view = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size != view.size(dim):
            view = view.narrow(dim, min(offset, view.size(dim)), size)
    return view


def origin(ndim: int) -> tuple[int, ...]:
    """The offsets ``(0, ..., 0)`` of a box of ``ndim`` dims: one shared tuple per count (a
    whole tensor's box is made for each of thousands of tensors)."""
    found = _ORIGINS.get(ndim)
    return (0,) * ndim if found is None else found


_ORIGINS = {ndim: (0,) * ndim for ndim in range(9)}


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


# CPython's PyMemoryView_FromMemory (stable C API): a writable memoryview of raw memory.
_memory_at = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_WRITABLE = 0x200  # PyBUF_WRITE


def borrowed_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor`` as a writable memoryview, taken from its
    address: a third of the cost of :func:`byte_view`, which counts for many small tensors.

    The view does not keep the tensor alive: the caller holds the tensor for as long as it
    uses the view. The tensor must hold its values as they are (no lazy conjugation or
    negation).
    """
    assert tensor.is_cpu and tensor.is_contiguous()
    return checked_bytes(tensor)


def checked_bytes(tensor: torch.Tensor) -> memoryview:
    """:func:`borrowed_bytes` of a tensor the caller has checked is contiguous CPU memory
    (for a hot loop that has read those flags already)."""
    nbytes = tensor.nbytes
    if not nbytes:
        return memoryview(bytearray())
    view: memoryview = _memory_at(tensor.data_ptr(), nbytes, _WRITABLE)
    return view
