"""The host staging area of ``async_save``: one shared-memory buffer per writer process, into
which the training process copies what it holds, and from which the writer process writes.

The buffer is an anonymous memory file (``memfd``; an unlinked temporary file where there is
none), mapped by both processes: no name in ``/dev/shm`` (whose size containers cap), nothing
left behind when either process dies. It is allocated once, grown when a state no longer fits,
and reused by every save (``docs/architecture.md``, *Async save*). Tensors travel as
:class:`Slot` descriptors (where in the buffer, which dtype and shape), never as bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint.entries.items import LocalBox, TensorValue
from shardwise.checkpoint.saving.snapshot import Snapshot

__all__ = ["SharedBuffer", "Slot", "StagingArea", "open_views"]

_ALIGN = 64  # every slot starts at a multiple: any dtype may view it, and copies stay fast
_GROWTH = 1.25  # a grown buffer leaves room for a state that grows a little more
_ROUND = 2 << 20


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a staged tensor lies in the shared buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SharedBuffer:
    """A shared-memory byte buffer mapped in this process, made here or received as a file
    descriptor from the process that made it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size) if size else None
        self.bytes = (
            torch.frombuffer(self._map, dtype=torch.uint8)
            if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self.pinned = False

    @classmethod
    def allocate(cls, size: int) -> SharedBuffer:
        """A new buffer of ``size`` bytes, its memory reserved now: a full memory file system
        fails here with an OSError, not later with a bus error while copying."""
        fd = _memory_file()
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def pin(self) -> None:
        """Page-lock the buffer for the CUDA driver, so device-to-host copies into it are
        asynchronous (CUDA only)."""
        if self.size and not self.pinned and torch.cuda.is_available():
            runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            code = runtime.cudaHostRegister(self.bytes.data_ptr(), self.size, 0)
            self.pinned = int(code) == 0

    def close(self) -> None:
        if self.pinned:
            with contextlib.suppress(Exception):
                runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                runtime.cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
                self._map.close()
            self._map = None
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _memory_file() -> int:
    create = getattr(os, "memfd_create", None)
    if create is not None:
        try:
            return int(create("shardwise-staging", getattr(os, "MFD_CLOEXEC", 1)))
        except OSError:
            pass
    shm = "/dev/shm"
    directory = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    fd, name = tempfile.mkstemp(prefix="shardwise-staging-", dir=directory)
    os.unlink(name)  # only the descriptor names it now: nothing to clean up after a crash
    return fd


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _portable_layout(layout: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``layout`` without live objects: a DTensor's mesh becomes ``(shape, global ranks)``,
    which the save tables read the same way."""
    if layout is None or layout[0] != "mesh" or isinstance(layout[1], tuple):
        return layout
    mesh = layout[1].mesh
    return ("mesh", (tuple(mesh.shape), mesh.flatten().tolist()), layout[2])


class StagingArea:
    """The staging buffer of one writer process, reused across saves."""

    def __init__(self) -> None:
        self.buffer: SharedBuffer | None = None

    def stage(self, snapshot: Snapshot) -> tuple[Snapshot, SharedBuffer | None, list[Any]]:
        """Copy every local box of ``snapshot`` into the buffer; returns its description in
        :class:`Slot` form, the new buffer when it had to grow (the writer must map it), and
        the CUDA events to wait for before the bytes are there (none for CPU tensors).

        Copies from a GPU are issued on a side stream that waits for the current stream's work;
        the current stream then waits for the copies, so a later in-place update of a parameter
        cannot run before its bytes were copied, and the host does not wait for either.
        """
        sizes: dict[str, list[int]] = {}
        total = 0
        for fqn, value in snapshot.tensors.items():
            if fqn in snapshot.aliases:
                continue
            offsets = []
            for box in value.boxes:
                offsets.append(total)
                total += _aligned(box.tensor.numel() * box.tensor.element_size())
            sizes[fqn] = offsets
        grown = None
        if self.buffer is None or self.buffer.size < total:
            old = self.buffer
            size = max(total, int((old.size if old is not None else 0) * _GROWTH))
            self.buffer = grown = SharedBuffer.allocate(-(-size // _ROUND) * _ROUND)
            if old is not None:
                old.close()
        buffer = self.buffer
        described: dict[str, TensorValue] = {}
        events: list[Any] = []
        with _copy_stream(snapshot, buffer, events) as copy:
            for fqn, value in snapshot.tensors.items():
                target = snapshot.aliases.get(fqn)
                if target is not None:  # the same local data as an earlier key: staged once
                    boxes = described[target].boxes
                else:
                    boxes = []
                    for box, offset in zip(value.boxes, sizes[fqn], strict=True):
                        source = box.tensor
                        slot = Slot(offset, source.dtype, tuple(source.shape))
                        copy(_view(buffer.bytes, slot), source)
                        boxes.append(LocalBox(box.offsets, box.sizes, slot))  # type: ignore[arg-type]
                described[fqn] = TensorValue(
                    value.size,
                    value.dtype,
                    value.properties,
                    boxes,
                    _portable_layout(value.layout),
                )
        return Snapshot(described, dict(snapshot.objects), dict(snapshot.aliases)), grown, events

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def _view(data: torch.Tensor, slot: Slot) -> torch.Tensor:
    nbytes = _numel(slot.shape) * slot.dtype.itemsize
    if nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    return data[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


@contextlib.contextmanager
def _copy_stream(snapshot: Snapshot, buffer: SharedBuffer, events: list[Any]) -> Any:
    devices = {
        box.tensor.device
        for value in snapshot.tensors.values()
        for box in value.boxes
        if box.tensor.device.type == "cuda"
    }
    if not devices:
        yield lambda target, source: target.copy_(source.detach())
        return
    buffer.pin()
    streams = {}
    for device in devices:  # each copy stream first waits for the work already queued
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        streams[device] = stream

    def copy(target: torch.Tensor, source: torch.Tensor) -> None:
        if source.device.type != "cuda":
            target.copy_(source.detach())
            return
        with torch.cuda.stream(streams[source.device]):
            target.copy_(source.detach(), non_blocking=True)
            source.record_stream(streams[source.device])

    yield copy
    for device, stream in streams.items():  # later work on the training stream waits for them
        torch.cuda.current_stream(device).wait_stream(stream)
        events.append(stream.record_event())


def open_views(snapshot: Snapshot, data: torch.Tensor) -> Snapshot:
    """``snapshot`` (in :class:`Slot` form, as :meth:`StagingArea.stage` returns it) with
    every slot replaced by a view of ``data``, the writer's mapping of the buffer."""
    views: dict[Slot, torch.Tensor] = {}
    for value in snapshot.tensors.values():
        for box in value.boxes:
            slot: Any = box.tensor
            if isinstance(slot, Slot):
                view = views.get(slot)
                if view is None:
                    view = views[slot] = _view(data, slot)
                box.tensor = view
    return snapshot
