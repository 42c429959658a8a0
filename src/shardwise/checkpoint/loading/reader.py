"""The one reader of checkpoints: every path that reads one (``load``, ``load_tensor``,
``read_metadata``, the CLI) goes through :class:`CheckpointReader`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from shardwise.checkpoint import tuning
from shardwise.checkpoint.entries.items import LocalBox
from shardwise.checkpoint.entries.state_dict import display_key
from shardwise.checkpoint.index import INDEX_NAME, Index, ObjectRecord, TensorRecord
from shardwise.checkpoint.index.layouts import LayoutChunks
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.data_files import DataFiles
from shardwise.checkpoint.loading.fill import Job, fill
from shardwise.checkpoint.loading.index_file import decode, read_index_bytes
from shardwise.checkpoint.loading.read import Segment, read
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.storage import Storage, open_storage
from shardwise.errors import CheckpointFormatError, CheckpointKeyError

__all__ = ["CheckpointReader", "Job", "decode", "read_index_bytes"]


class CheckpointReader:
    """A committed checkpoint, its index validated, opened for verified reads (``path``: as
    the user gave it; ``rank``: the rank reading, named in errors)."""

    def __init__(self, storage: Storage, index: Index, path: str, rank: int | None = None) -> None:
        self.storage = storage
        self.index = index
        self.path = path
        self.rank = rank
        self.files = DataFiles(storage, index, rank)
        # Sweep orders of the tensors with many chunks, built on first use (see plan).
        self._lookups: dict[str, planner.ChunkLookup] = {}

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        rank: int | None = None,
    ) -> CheckpointReader:
        """Read and validate the index of the checkpoint at ``path`` (no data is read)."""
        text = os.path.expanduser(os.fspath(path))
        storage = open_storage(text, storage_options)
        return cls(storage, decode(read_index_bytes(storage, text), storage), text, rank)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every data file this reader opened."""
        self.files.close()

    def check_files(self, items: Iterable[tuple[str, SavedChunk]]) -> None:
        """Open (and so check) the data file of every ``(key, chunk)``."""
        for key, chunk in items:
            if chunk.nbytes:
                self.files.handle(chunk.file, key)

    def tensor_record(self, fqn: str) -> TensorRecord:
        """The tensor entry ``fqn``, or the one whose dotted key (as ``inspect`` shows) it is."""
        record = self.index.tensors.get(fqn)
        if record is None and display_key(fqn) == fqn:
            dotted = [key for key in self.index.tensors if key != fqn and display_key(key) == fqn]
            if len(dotted) > 1:
                raise CheckpointKeyError(
                    f"{len(dotted)} tensors of the checkpoint have this dotted key (their "
                    "paths differ in int and str parts, e.g. {0: ...} and {'0': ...})",
                    key=fqn,
                )
            record = self.index.tensors[dotted[0]] if dotted else None
        if record is None:
            raise CheckpointKeyError("not a tensor of the checkpoint", key=fqn)
        return record

    def plan(self, fqn: str, box: planner.Box, target: int) -> list[Job]:
        """The reads that fill the global ``box`` of tensor ``fqn`` into ``target``."""
        record = self.tensor_record(fqn)
        chunks = record.chunks
        lookup: planner.Candidates | None = None
        reads = None
        if type(chunks) is not tuple and isinstance(chunks, LayoutChunks):  # (an ABC: slow)
            # A grid answers by arithmetic and builds only the chunks it finds.
            lookup = chunks
        elif (
            len(chunks) > 1
            and record.size
            and box[1] == record.size
            and len(box[0]) == len(box[1])
            and not any(box[0])
        ):  # the whole tensor (a key the state dict lacks, a consolidation): every chunk
            reads = planner.whole_reads(chunks)
        elif len(chunks) > tuning.TUNING.lookup_chunks:
            if fqn not in self._lookups:
                self._lookups[fqn] = planner.ChunkLookup([(c.offsets, c.sizes) for c in chunks])
            lookup = self._lookups[fqn]
        try:
            if reads is None:
                reads = planner.plan_reads(box, chunks, record.dtype.itemsize, lookup=lookup)
        except CheckpointFormatError as err:  # grid cells that do not fill their file
            index_url = self.storage.url(self.storage.join(INDEX_NAME))
            raise CheckpointFormatError(err.bare_message, key=fqn, file=index_url) from err
        except ValueError as err:  # the chunks tile the tensor: only a box outside it fails
            raise CheckpointFormatError(str(err), key=fqn) from err
        return [Job(target, fqn, chunks[read.chunk], read, record.dtype) for read in reads]

    def fill(
        self,
        jobs: Sequence[Job],
        targets: Sequence[LocalBox],
        *,
        verify: bool = True,
        progress: Callable[[int], object] | None = None,
        note: str = "",
        also: Sequence[Segment] = (),
    ) -> None:
        """Perform ``jobs`` into ``targets`` and read ``also`` in one pass (:func:`.fill.fill`)."""
        fill(self.files, jobs, targets, verify=verify, progress=progress, note=note, also=also)

    def blob_segment(self, item: ObjectRecord) -> tuple[Segment, bytearray]:
        """A segment reading the blob of object ``item``, and the buffer it fills."""
        chunk = item.blob
        assert chunk is not None
        data = bytearray(chunk.nbytes)
        return Segment(chunk.file, chunk.begin, memoryview(data), item.fqn), data

    def read_box(
        self,
        fqn: str,
        offsets: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """See :func:`~shardwise.checkpoint.load_tensor` (allocated once its files are checked)."""
        record = self.tensor_record(fqn)
        size = record.size
        box_offsets = tuple(int(o) for o in offsets) if offsets is not None else (0,) * len(size)
        box_sizes = (
            tuple(int(s) for s in sizes)
            if sizes is not None
            else tuple(s - o for s, o in zip(size, box_offsets, strict=False))
        )
        fits = len(box_offsets) == len(box_sizes) == len(size) and all(
            o >= 0 and n >= 0 and o + n <= s
            for o, n, s in zip(box_offsets, box_sizes, size, strict=True)
        )
        if not fits:
            raise ValueError(
                f"box offsets={list(box_offsets)} sizes={list(box_sizes)} does not fit {fqn!r} "
                f"of size {list(size)}"
            )
        jobs = self.plan(fqn, (box_offsets, box_sizes), 0)
        self.check_files((job.key, job.chunk) for job in jobs)
        result = torch.empty(box_sizes, dtype=record.dtype)
        self.fill(jobs, [LocalBox(box_offsets, box_sizes, result)])
        return result

    def blob(self, fqn: str) -> bytes:
        """The stored bytes of object ``fqn`` (never decoded), every byte verified."""
        item = self.index.objects.get(fqn)
        if item is None or item.blob is None:
            raise CheckpointKeyError("not a stored object of the checkpoint", key=fqn)
        segment, data = self.blob_segment(item)
        read(self.files, [segment])
        return bytes(data)
