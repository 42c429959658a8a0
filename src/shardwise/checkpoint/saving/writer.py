"""The data files of a save (``docs/format.md``, *Data files*, *Checksums: blocks*): writing
one rank's, each block of its data section checksummed right before it is written, while in
cache; and checking that the coordinator sees every rank's. GPU tensors reach the host through
one reused pinned buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from shardwise._boxes import byte_view, checked_bytes
from shardwise._progress import JobProgress
from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import ObjectValue, TensorValue
from shardwise.checkpoint.index import BLOCK_SIZE, DATA_DIR, Index, data_file_name
from shardwise.checkpoint.index.data_file import FileEntry, bytes_key, chunk_key, layout_file
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.storage import Storage, UnsafePathError, Writer
from shardwise.errors import CheckpointDataError

__all__ = ["FileBlocks", "check_visible", "open_fresh", "write_data_file"]


def open_fresh(storage: Storage, path: str, rank: int | None) -> Writer:
    """Create ``path``, a name unique to this save, for writing.

    Raises:
        CheckpointDataError: It exists already (something else created it, perhaps a link).
    """
    try:
        return storage.open_write(path)
    except (FileExistsError, UnsafePathError) as err:
        raise CheckpointDataError(
            "refusing to save: this save's file already exists (something else created it, "
            "perhaps a link); nothing was written",
            file=path,
            rank=rank,
        ) from err


class FileBlocks:
    """The block checksums of a stream of bytes: xxh3_64 of each ``block_size`` bytes, hashed
    as they go by (one block of zero bytes when none did)."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self._block_size = block_size
        self._state = xxhash.xxh3_64()
        self._filled = 0
        self._sums: list[str] = []

    def update(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        position = 0
        while position < len(view):
            take = min(len(view) - position, self._block_size - self._filled)
            self._state.update(view[position : position + take])
            position += take
            self._filled += take
            if self._filled == self._block_size:
                self._sums.append(self._state.hexdigest())
                self._state.reset()
                self._filled = 0

    def checksums(self) -> str:
        """Every block's checksum, concatenated (the last block may be short)."""
        if self._filled or not self._sums:
            return "".join(self._sums) + self._state.hexdigest()
        return "".join(self._sums)


class _ChecksummingWriter:
    """Writes entries to a file and checksums its data section as it streams by.

    Entries below ``TUNING.small_write_bytes`` wait and go out together in one vectored write
    (``writev``): tiny ones copied into a shared buffer, the others straight from tensor
    memory (no copy: measured 190 against 210 ms for 288 MiB of 576 KiB shards on tmpfs),
    their tensors held (``_held``) until written.
    """

    def __init__(self, writer: Writer) -> None:
        self._writer = writer
        self._parts: list[memoryview | bytearray] = []
        self._tiny = bytearray()  # the tiny entries after the last part
        self._held: list[torch.Tensor] = []
        self._pending = 0  # bytes waiting
        self.file_blocks = FileBlocks()
        self._unsummed = 0  # leading bytes waiting that no checksum covers (the header)

    def header(self, data: bytes) -> None:
        self._unsummed += len(data)  # before _wait, whose flush skips them
        self._wait(memoryview(data), None)

    def entry(self, tensor: torch.Tensor) -> None:
        if not tensor.is_cpu:  # pragma: no cover - needs a GPU
            self._staged_entry(tensor)
            return
        # Lazy conj/neg views are resolved (a copy); reading the flags first costs less.
        if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg().contiguous()
        view = checked_bytes(tensor)
        if len(view) < tuning.TUNING.small_write_bytes:
            self._wait(view, tensor)
            return
        self.flush()
        piece_bytes = tuning.TUNING.write_piece_bytes
        for start in range(0, len(view), piece_bytes):
            piece = view[start : start + piece_bytes]
            self.file_blocks.update(piece)
            self._writer.write(piece)

    def blob(self, payload: bytes) -> None:
        self._wait(memoryview(payload), None)

    def _wait(self, view: memoryview, owner: torch.Tensor | None) -> None:
        """Queue ``view`` (of ``owner``'s memory) for the next vectored write."""
        if len(view) < _TINY_BYTES:
            self._tiny += view
        else:
            if self._tiny:
                self._parts.append(self._tiny)
                self._tiny = bytearray()
            self._parts.append(view)
            if owner is not None:
                self._held.append(owner)
        self._pending += len(view)
        if self._pending >= tuning.TUNING.write_buffer_bytes or len(self._parts) >= _MAX_PARTS:
            self.flush()

    def _staged_entry(self, tensor: torch.Tensor) -> None:  # pragma: no cover - needs a GPU
        self.flush()
        source = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        staging = _pinned_staging(min(tuning.TUNING.staging_bytes, max(source.numel(), 1)))
        for start in range(0, source.numel(), staging.numel()):
            piece = source[start : start + staging.numel()]
            target = staging[: piece.numel()]
            target.copy_(piece, non_blocking=False)
            view = byte_view(target)
            self.file_blocks.update(view)
            self._writer.write(view)

    def flush(self) -> None:
        if self._tiny:
            self._parts.append(self._tiny)
            self._tiny = bytearray()
        if not self._parts:
            return
        skip = self._unsummed
        for part in self._parts:
            if skip >= len(part):
                skip -= len(part)
                continue
            self.file_blocks.update(memoryview(part)[skip:])
            skip = 0
        self._unsummed = 0
        self._writer.write_vector(self._parts)
        self._parts = []
        self._held = []
        self._pending = 0


# Smaller entries are copied into one buffer: cheaper than an I/O vector entry of their own.
_TINY_BYTES = 16 << 10
# At most this many buffers wait for one vectored write (the kernel's IOV_MAX is 1024).
_MAX_PARTS = 1000

_staging_lock = threading.Lock()
_staging_buffer: torch.Tensor | None = None


def _pinned_staging(nbytes: int) -> torch.Tensor:  # pragma: no cover - needs a GPU
    global _staging_buffer
    with _staging_lock:
        if _staging_buffer is None or _staging_buffer.numel() < nbytes:
            _staging_buffer = torch.empty(
                tuning.TUNING.staging_bytes, dtype=torch.uint8, pin_memory=True
            )
        return _staging_buffer[:nbytes]


def write_data_file(
    storage: Storage,
    rank: int,
    save_id: str,
    assignments: list[planner.WriteAssignment],
    tensors: Mapping[str, TensorValue],
    blobs: list[tuple[str, ObjectValue]],
    sync_files: bool,
    progress: JobProgress | None,
    grid_cells: int,
) -> dict[str, Any]:
    """Write this rank's data file: the chunks ``assignments`` names (their data taken from
    ``tensors``), then the ``blobs``; no file when there are none.

    Args:
        grid_cells: How many of ``assignments`` (leading) are grid cells, in the file's
            order: their byte ranges are not reported (readers derive them).

    Returns:
        ``{"file": [name, size], "data_start", "checksums": the data section's block
        checksums, "grid_bytes": bytes of the grid cells, "begins": {key: begin} of the other
        entries and blobs}``; empty when this rank writes nothing.
    """
    if not assignments and not blobs:
        return {}
    name = data_file_name(rank, save_id)
    entries = []
    sources = []  # the tensor of each assignment
    for item in assignments:
        value = tensors[item.fqn]
        entries.append(
            FileEntry(chunk_key(item.fqn, item.offsets), value.dtype, item.sizes, item.nbytes)
        )
        box = next((box for box in value.boxes if box.offsets == item.offsets), None)
        assert box is not None, f"no local box at {item.offsets}"
        sources.append(box.tensor)
    for fqn, blob in blobs:
        entries.append(FileEntry(bytes_key(fqn), None, (len(blob.payload),), len(blob.payload)))
    layout = layout_file(entries, {"format": "shardwise", "save_id": save_id, "rank": str(rank)})
    final = storage.join(*name.split("/"))
    # Object stores have no rename (a copy, then a delete): the file goes under its final
    # name, unique to this save, where it appears complete when closed.
    staging = f"{final}.tmp" if storage.atomic_rename else final
    writer = open_fresh(storage, staging, rank)
    try:
        out = _ChecksummingWriter(writer)
        out.header(layout.header)
        for tensor, (begin, end) in zip(sources, layout.ranges, strict=False):
            out.entry(tensor.detach() if tensor.requires_grad else tensor)
            if progress is not None:
                progress.update(end - begin)
        for _fqn, blob in blobs:
            out.blob(blob.payload)
        out.flush()
    except BaseException:
        writer.abort()
        raise
    writer.close(sync=sync_files)
    if staging != final:
        storage.rename(staging, final)
        if sync_files:
            storage.sync_dir(storage.join(DATA_DIR))
    data_start = len(layout.header)
    grid_end = layout.ranges[grid_cells - 1][1] if grid_cells else data_start
    others = zip(entries[grid_cells:], layout.ranges[grid_cells:], strict=True)
    return {
        "file": [name, layout.size],
        "data_start": data_start,
        "checksums": out.file_blocks.checksums(),
        "grid_bytes": grid_end - data_start,
        "begins": {entry.key: begin for entry, (begin, _) in others},
    }


def check_visible(storage: Storage, index: Index, path: str) -> None:
    """Check that the coordinator sees every data file ``index`` names (one listing), so that
    a node-local path never commits an index naming files only their writers' nodes have.

    Raises:
        CheckpointDataError: A data file is not there.
    """
    present = {f"{DATA_DIR}/{name}" for name in storage.listdir(storage.join(DATA_DIR))}
    own = (name for name in index.files if name.startswith(f"{DATA_DIR}/"))  # not references
    missing = sorted(name for name in own if name not in present)
    if missing:
        writers = sorted(int(name.split("rank-")[1].split(".")[0]) for name in missing)
        raise CheckpointDataError(
            f"the coordinator does not see the data files of ranks {writers} ({missing[0]}"
            f"{' and more' if len(missing) > 1 else ''}): is {path} on a file system every "
            "node mounts? A node-local path cannot hold a checkpoint of several nodes; "
            "nothing was committed",
            file=storage.join(DATA_DIR),
        )
