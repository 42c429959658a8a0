"""The host staging area of ``async_save``: one shared-memory buffer per writer process, into
which the training process copies what it holds, and from which the writer process writes.

The buffer is an anonymous memory file (``memfd``; an unlinked temporary file where there is
none), mapped by both processes: no name in ``/dev/shm`` (whose size containers cap), nothing
left behind when either process dies. It is allocated once, grown when a state no longer fits,
and reused by every save (``docs/architecture.md``, *Async save*). Tensors travel as
:class:`Staged` descriptors (where in the buffer, which dtype and shape), never as bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import operator
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.checkpoint.entries.items import LocalBox, TensorValue
from shardwise.checkpoint.saving.snapshot import Snapshot

__all__ = ["SharedBuffer", "Slot", "Staged", "StagingArea", "open_views"]

_ALIGN = 64  # every slot starts at a multiple: any dtype may view it, and copies stay fast
_GROWTH = 1.25  # a grown buffer leaves room for a state that grows a little more
_ROUND = 2 << 20


@dataclass(slots=True)
class Staged:
    """A snapshot as it travels to the writer: per tensor ``(key, size, dtype, properties,
    layout, boxes)``, each box ``(offsets, sizes, offset in the buffer, shape)`` (a tied key
    has none: its target's are its), plus the objects and tied keys. Plain tuples: pickling
    20,000 of them costs a few milliseconds, dataclasses five times more."""

    #: ``None``: the same as the previous save's (the writer keeps its views of them).
    tensors: list[tuple[Any, ...]] | None
    objects: dict[str, Any]
    aliases: dict[str, str]


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
        with contextlib.suppress(OSError):  # refused (a sandbox, an old kernel): a file below
            return int(create("shardwise-staging", getattr(os, "MFD_CLOEXEC", 1)))
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

    def stage(self, snapshot: Snapshot) -> tuple[Staged, SharedBuffer | None, list[Any]]:
        """Copy every local box of ``snapshot`` into the buffer; returns its description as
        :class:`Staged`, the new buffer when it had to grow (the writer must map it), and the
        CUDA events to wait for before the bytes are there (none for CPU tensors).

        Copies from a GPU are issued on a side stream that waits for the current stream's work;
        the current stream then waits for the copies, so a later in-place update of a parameter
        cannot run before its bytes were copied, and the host does not wait for either.
        """
        # Where each box goes: host boxes packed tight, largest element size first (so each
        # starts at a multiple of its own), and copied by one concatenation (per-tensor copies
        # cost ~10 us each: 0.2 s for 20,000 small tensors); GPU boxes one aligned slot each.
        # Each box: (element size, bytes, tensor, (key, box number)); one pass over them.
        host: list[tuple[int, int, torch.Tensor, tuple[str, int]]] = []
        device: list[tuple[int, int, torch.Tensor, tuple[str, int]]] = []
        for fqn, value in snapshot.tensors.items():
            if fqn not in snapshot.aliases:
                for number, box in enumerate(value.boxes):
                    tensor = box.tensor
                    itemsize = tensor.dtype.itemsize
                    item = (itemsize, tensor.numel() * itemsize, tensor, (fqn, number))
                    (device if tensor.is_cuda else host).append(item)
        host.sort(key=operator.itemgetter(0), reverse=True)  # stable: keys stay in order
        offsets: dict[tuple[str, int], int] = {}
        total = 0
        for _, nbytes, _, key in host:
            offsets[key] = total
            total += nbytes
        packed = total
        for _, nbytes, _, key in device:
            total = _aligned(total)
            offsets[key] = total
            total += nbytes
        grown = None
        if self.buffer is None or self.buffer.size < total:
            old = self.buffer
            size = max(total, int((old.size if old is not None else 0) * _GROWTH))
            self.buffer = grown = SharedBuffer.allocate(-(-size // _ROUND) * _ROUND)
            if old is not None:
                old.close()
        buffer = self.buffer
        if packed:
            with torch.no_grad():  # no autograd record of the views of parameters
                parts = [_as_bytes(tensor) for _, nbytes, tensor, _ in host if nbytes]
                torch.cat(parts, out=buffer.bytes[:packed])
        events: list[Any] = []
        with _copy_stream(device, buffer, events) as copy:
            for _, _, tensor, key in device:
                slot = Slot(offsets[key], tensor.dtype, tuple(tensor.shape))
                copy(_view(buffer.bytes, slot), tensor)
        rows = []
        aliases = snapshot.aliases
        for fqn, value in snapshot.tensors.items():
            boxes: tuple[Any, ...] = ()
            if fqn not in aliases:  # a tied key's boxes are its target's
                boxes = tuple(
                    [
                        (box.offsets, box.sizes, offsets[fqn, number], tuple(box.tensor.shape))
                        for number, box in enumerate(value.boxes)
                    ]
                )
            layout = _portable_layout(value.layout)
            rows.append((fqn, value.size, value.dtype, value.properties, layout, boxes))
        return Staged(rows, dict(snapshot.objects), dict(snapshot.aliases)), grown, events

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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` in row-major order, as bytes (a view when contiguous)."""
    flat = tensor.reshape(-1)
    if flat.is_neg() or (tensor.dtype.is_complex and flat.is_conj()):
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8)


@contextlib.contextmanager
def _copy_stream(
    boxes: list[tuple[int, int, torch.Tensor, tuple[str, int]]],
    buffer: SharedBuffer,
    events: list[Any],
) -> Any:
    devices = {tensor.device for _, _, tensor, _ in boxes}
    if not devices:
        yield None
        return
    buffer.pin()
    streams: dict[torch.device, Any] = {}
    for device in devices:  # each copy stream first waits for the work already queued
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        streams[device] = stream

    def copy(target: torch.Tensor, source: torch.Tensor) -> None:
        with torch.cuda.stream(streams[source.device]):
            target.copy_(source.detach(), non_blocking=True)
            source.record_stream(streams[source.device])

    yield copy
    for device, stream in streams.items():  # later work on the training stream waits for them
        torch.cuda.current_stream(device).wait_stream(stream)
        events.append(stream.record_event())


def open_views(staged: Staged, data: torch.Tensor) -> dict[str, TensorValue]:
    """The tensors ``staged`` describes, each box a view of ``data`` (the writer's mapping
    of the buffer)."""
    assert staged.tensors is not None
    tensors: dict[str, TensorValue] = {}
    for fqn, size, dtype, properties, layout, rows in staged.tensors:
        target = staged.aliases.get(fqn)
        if target is not None:
            boxes = tensors[target].boxes
        else:
            boxes = [
                LocalBox(offsets, sizes, _view(data, Slot(offset, dtype, shape)))
                for offsets, sizes, offset, shape in rows
            ]
        tensors[fqn] = TensorValue(size, dtype, properties, boxes, layout)
    return tensors
