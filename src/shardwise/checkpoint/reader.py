"""The one reader of checkpoints: every path that reads one (``load``, ``load_tensor``,
``read_metadata``, the CLI) goes through :class:`CheckpointReader`.

It reads the index without following links (at most :data:`~.index.MAX_INDEX_BYTES`), has
:func:`~shardwise.checkpoint.index.decode_index` validate all of it, opens data files only as
regular files inside ``<ckpt>/data`` whose size agrees with the index, and reads in two passes:

1. :meth:`CheckpointReader.verify` reads every checksummed block a set of reads touches (each
   block once, adjacent blocks in one large read) and checks it; nothing is copied anywhere.
2. :meth:`CheckpointReader.fill` then reads the needed bytes straight into their destinations.

So a corrupt block raises before a single byte reaches a caller's tensor, which is what lets
``load`` promise that a failed load leaves the state dict unchanged. The second pass reads
bytes the first has just checked; checkpoint files are never modified after their commit.
"""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shardwise.checkpoint import planner
from shardwise.checkpoint._items import LocalBox, byte_view, narrow_to
from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    Index,
    TensorRecord,
    decode_index,
    is_data_file_name,
    is_temporary_name,
)
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.storage import (
    LocalStorage,
    Reader,
    Storage,
    UnsafePathError,
    open_storage,
)
from shardwise.errors import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    ChecksumError,
)

__all__ = ["CheckpointReader", "Job", "read_index_bytes"]

# Reads are I/O bound (the GIL is released in preadv, hashing and copies); a few threads
# overlap them.
_THREADS = 4
# Work smaller than this runs inline: on a thread pool it costs more in GIL hand-offs
# (measured: 10,000 small reads took 2.1 s on 4 threads and 0.45 s on one).
_INLINE = 1 << 20
# The verifying pass reads adjacent blocks together, up to this many bytes per read, and
# reads through gaps between needed blocks smaller than _GAP rather than issue another read.
_RUN = 8 << 20
_GAP = 64 << 10
_HEX = 16


def read_index_bytes(storage: Storage, path: str) -> bytes:
    """The raw index of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: No committed checkpoint there; the message says what is
            there instead (nothing, a file, an empty directory, an interrupted save, a torch
            DCP checkpoint, a Hugging Face model directory, or other files).
        CheckpointFormatError: The index is not a regular file, or too large to be one.
    """
    name = storage.join(INDEX_NAME)
    if not storage.exists(name):
        raise CheckpointNotFoundError(_what_is_there(storage, path), file=name)
    try:
        reader = storage.open_reader(name)
    except UnsafePathError as err:
        raise CheckpointFormatError(
            f"the checkpoint index is not a regular file ({err.strerror})", file=name
        ) from err
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"no checkpoint at {path}", file=name) from err
    except OSError as err:
        raise CheckpointDataError(f"cannot open the index: {err}", file=name) from err
    try:
        if reader.size > MAX_INDEX_BYTES:
            raise CheckpointFormatError(
                f"the checkpoint index has {reader.size} bytes, more than a reader accepts",
                file=name,
            )
        data = bytearray(reader.size)
        count = reader.read_into(0, memoryview(data))
    except OSError as err:
        raise CheckpointDataError(f"cannot read the index: {err}", file=name) from err
    finally:
        reader.close()
    return bytes(data[:count])


# What a path without an index is, told by the names in it (never by their contents).
_DCP_METADATA = ".metadata"
_DCP_SUFFIX = ".distcp"
_HF_NAMES = frozenset(
    {
        "adapter_config.json",
        "config.json",
        "generation_config.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
)
_HF_SUFFIXES = (".safetensors", ".safetensors.index.json")
_SHOWN = 5


def _what_is_there(storage: Storage, path: str) -> str:
    """Why there is no checkpoint at ``path`` (whose index is missing), for the error.

    Cheap and safe: names only, from at most one listing of ``path`` and one of its ``data/``;
    no file is read and no link below ``path`` is followed.
    """
    storage = _resolve_root(storage)
    try:
        if not storage.exists(storage.root):
            return f"no checkpoint at {path}"
        if _is_file(storage):
            return _a_file(path)
        entries = storage.listdir(storage.root)
    except OSError as err:
        reason = err.strerror or str(err)
        return f"no checkpoint at {path}: it has no {INDEX_NAME} and cannot be listed ({reason})"
    if not entries:
        return f"no checkpoint at {path}: it is an empty directory"
    if DATA_DIR in entries and _holds_shardwise_data(storage):
        return (
            f"{path} is not a complete shardwise checkpoint: its index {INDEX_NAME} is "
            "missing, so the save that wrote it did not commit (it may have been "
            "interrupted). Save again or load an earlier checkpoint"
        )
    num_distcp = sum(entry.endswith(_DCP_SUFFIX) for entry in entries)
    if num_distcp or _DCP_METADATA in entries:
        found = [repr(_DCP_METADATA)] if _DCP_METADATA in entries else []
        if num_distcp:
            found.append(f"{num_distcp} *{_DCP_SUFFIX} file{'s' if num_distcp > 1 else ''}")
        return (
            f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not a shardwise one "
            f"(it has {' and '.join(found)} and no {INDEX_NAME}): convert it with "
            f"`shardwise convert-dcp {shlex.quote(path)} <out>`, or load it with "
            "torch.distributed.checkpoint.load"
        )
    hugging_face = [e for e in entries if e in _HF_NAMES or e.endswith(_HF_SUFFIXES)]
    if hugging_face:
        return (
            f"{path} is a Hugging Face model directory (it has {_names(hugging_face)}), not a "
            f"shardwise checkpoint (a directory with {INDEX_NAME} and data/): load its files "
            "with safetensors.torch.load_file (or the model with transformers' from_pretrained)"
        )
    return (
        f"{path} is not a shardwise checkpoint: it has no {INDEX_NAME}; it holds {_names(entries)}"
    )


def _resolve_root(storage: Storage) -> Storage:
    """``storage``, its root resolved if it is a local link: the checkpoint path itself may be
    one (the user chose it, as for any read), but local listings refuse links."""
    if isinstance(storage, LocalStorage) and os.path.islink(storage.root):
        return LocalStorage(os.path.realpath(storage.root))
    return storage


def _is_file(storage: Storage) -> bool:
    """Whether the checkpoint path is a regular file (opened to check, never read)."""
    try:
        storage.open_reader(storage.root).close()
    except OSError:  # a directory, or something unsafe to open
        return False
    return True


def _a_file(path: str) -> str:
    """Why the file at ``path`` is no checkpoint (and, for an index, where one is)."""
    message = (
        f"no checkpoint at {path}: it is a file, and a shardwise checkpoint is a directory "
        f"holding {INDEX_NAME} and data/"
    )
    parent, base = os.path.split(path.rstrip("/"))
    if base == INDEX_NAME:
        message += f"; to read the checkpoint of this index, give its directory {parent or '.'}"
    return message


def _holds_shardwise_data(storage: Storage) -> bool:
    """Whether ``data/`` holds a data file the writer makes (final or temporary name)."""
    try:
        names = storage.listdir(storage.join(DATA_DIR))
    except OSError:  # not a real directory: nothing of ours
        return False
    return any(is_data_file_name(name) or is_temporary_name(name) for name in names)


def _names(entries: Sequence[str]) -> str:
    """Up to :data:`_SHOWN` of ``entries``, quoted (a name may hold any character)."""
    shown = ", ".join(repr(entry) for entry in entries[:_SHOWN])
    more = len(entries) - _SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def decode(data: bytes, storage: Storage) -> Index:
    """:func:`decode_index`, naming the index file in its errors."""
    try:
        return decode_index(data)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(
            err.bare_message, key=err.key, file=storage.join(INDEX_NAME)
        ) from err


@dataclass(frozen=True, slots=True)
class Job:
    """One read of saved bytes into a destination box.

    Attributes:
        target: Index of the destination in the list given to :meth:`CheckpointReader.fill`.
        key: The state-dict key (for errors).
        chunk: The saved chunk read from.
        read: What to read and where it goes.
        dtype: The saved dtype.
    """

    target: int
    key: str
    chunk: SavedChunk
    read: planner.ChunkRead
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _Block:
    """One checksummed block to read and check."""

    file: str
    begin: int  # absolute, in the file
    end: int
    checksum: str
    key: str
    chunk: SavedChunk
    number: int


class CheckpointReader:
    """A committed checkpoint, its index validated, opened for verified reads.

    Args:
        storage: Where the checkpoint lives.
        index: Its validated index.
        path: The path as the user gave it (for messages).
        rank: The rank reading (named in errors), if any.
    """

    def __init__(self, storage: Storage, index: Index, path: str, rank: int | None = None) -> None:
        self.storage = storage
        self.index = index
        self.path = path
        self.rank = rank
        self.bytes_read = 0
        self.bytes_verified = 0
        self._handles: dict[str, Reader] = {}
        self._lock = threading.Lock()
        self._extents: dict[str, int] | None = None

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
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()

    # -- files ------------------------------------------------------------------------------

    def file_path(self, name: str) -> str:
        """The storage path of data file ``name`` (validated: ``data/rank-*.safetensors``)."""
        assert name.startswith("data/") and is_data_file_name(name[5:]), name
        return self.storage.join("data", name[5:])

    def _extent(self, name: str) -> int:
        """How far into file ``name`` the index's byte ranges reach."""
        if self._extents is None:
            extents: dict[str, int] = {}
            for chunk in self._stored():
                extents[chunk.file] = max(extents.get(chunk.file, 0), chunk.end)
            self._extents = extents
        return self._extents.get(name, 0)

    def _stored(self) -> Iterable[SavedChunk]:
        for tensor in self.index.tensors.values():
            yield from tensor.chunks
        for item in self.index.objects.values():
            if item.blob is not None:
                yield item.blob

    def handle(self, name: str, key: str | None = None) -> Reader:
        """Data file ``name`` opened for reads, after checking it is a regular file inside
        ``<ckpt>/data`` whose size agrees with the index (opened once per reader)."""
        with self._lock:
            handle = self._handles.get(name)
            if handle is not None:
                return handle
            path = self.file_path(name)
            try:
                handle = self.storage.open_reader(path)
            except FileNotFoundError as err:
                raise CheckpointDataError(
                    "data file is missing", key=key, file=path, rank=self.rank
                ) from err
            except UnsafePathError as err:
                raise CheckpointDataError(
                    f"data file is not a regular file inside the checkpoint: {err.strerror}; "
                    "refusing to read it",
                    key=key,
                    file=path,
                    rank=self.rank,
                ) from err
            except OSError as err:
                raise CheckpointDataError(
                    f"cannot open data file: {err}", key=key, file=path, rank=self.rank
                ) from err
            declared = self.index.files.get(name)
            problem = None
            if handle.size < self._extent(name):
                problem = (
                    f"data file is truncated: it has {handle.size} bytes, the index says it "
                    f"holds bytes up to {self._extent(name)}"
                )
            elif declared is not None and handle.size != declared:
                problem = (
                    f"data file has the wrong size: it has {handle.size} bytes, the index says "
                    f"{declared}"
                )
            if problem is not None:
                handle.close()
                raise CheckpointDataError(problem, key=key, file=path, rank=self.rank)
            self._handles[name] = handle
            return handle

    def check_files(self, items: Iterable[tuple[str, SavedChunk]]) -> None:
        """Open (and so check) the data file of every ``(key, chunk)``."""
        for key, chunk in items:
            if chunk.nbytes:
                self.handle(chunk.file, key)

    # -- planning ---------------------------------------------------------------------------

    def tensor_record(self, fqn: str) -> TensorRecord:
        """The tensor entry ``fqn``; :class:`CheckpointKeyError` if there is none."""
        record = self.index.tensors.get(fqn)
        if record is None:
            raise CheckpointKeyError("not a tensor of the checkpoint", key=fqn)
        return record

    def plan(self, fqn: str, box: planner.Box, target: int) -> list[Job]:
        """The reads that fill the global ``box`` of tensor ``fqn`` (into destination
        ``target``)."""
        record = self.tensor_record(fqn)
        dtype = record.dtype
        try:
            reads = planner.plan_reads(box, record.chunks, dtype.itemsize)
        except ValueError as err:  # the chunks tile the tensor: only a box outside it fails
            raise CheckpointFormatError(str(err), key=fqn) from err
        return [Job(target, fqn, record.chunks[read.chunk], read, dtype) for read in reads]

    # -- pass 1: verify ---------------------------------------------------------------------

    def blocks(self, key: str, chunk: SavedChunk, begin: int, end: int) -> Iterable[_Block]:
        """The checksummed blocks of ``chunk`` that its bytes ``[begin, end)`` (relative to
        the chunk) touch."""
        size = self.index.block_size_of(chunk)
        if end <= begin:
            return
        for number in range(begin // size, (end - 1) // size + 1):
            start = chunk.begin + number * size
            yield _Block(
                chunk.file,
                start,
                min(start + size, chunk.end),
                chunk.checksums[number * _HEX : (number + 1) * _HEX],
                key,
                chunk,
                number,
            )

    def job_blocks(self, jobs: Iterable[Job]) -> Iterable[_Block]:
        """Every block the reads of ``jobs`` touch."""
        for job in jobs:
            relative = job.read.file_offset - job.chunk.begin
            yield from self.blocks(job.key, job.chunk, relative, relative + job.read.nbytes)

    def verify(
        self,
        blocks: Iterable[_Block],
        problems: list[ChecksumError] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Read and check every block of ``blocks`` (each once; adjacent ones in one read).

        Args:
            blocks: The blocks to check.
            problems: Collect mismatches here instead of raising the first.
            progress: Called with the bytes of each finished read.

        Raises:
            ChecksumError: A block does not match its checksum (unless ``problems``).
            CheckpointDataError: A data file is missing, unsafe, or shorter than the index says.
        """
        unique = {(block.file, block.begin): block for block in blocks}
        ordered = sorted(unique.values(), key=lambda block: (block.file, block.begin))
        runs: list[list[_Block]] = []
        for block in ordered:
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and last.file == block.file
                and block.begin - last.end <= _GAP
                and block.end - runs[-1][0].begin <= _RUN
            ):
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:  # open every file first: a missing one fails before any read
            self.handle(run[0].file, run[0].key)
        lock = threading.Lock()

        def check(run: list[_Block]) -> int:
            found = self._check_run(run)
            with lock:
                self.bytes_verified += run[-1].end - run[0].begin
                if found and problems is None:
                    raise found[0]
                if problems is not None:
                    problems.extend(found)
            if progress is not None:
                progress(sum(block.end - block.begin for block in run))
            return 0

        _run_all(runs, lambda run: run[-1].end - run[0].begin, check)

    def _check_run(self, run: list[_Block]) -> list[ChecksumError]:
        handle = self.handle(run[0].file, run[0].key)
        begin, end = run[0].begin, run[-1].end
        if end - begin > _RUN:  # one block larger than a run (a version-1 chunk): stream it
            (block,) = run
            return self._check_streamed(handle, block)
        buffer = memoryview(bytearray(end - begin))
        self._read_exact(handle, begin, buffer, run[0])
        found = []
        for block in run:
            digest = xxhash.xxh3_64_hexdigest(buffer[block.begin - begin : block.end - begin])
            if digest != block.checksum:
                found.append(self._mismatch(block, digest))
        return found

    def _check_streamed(self, handle: Reader, block: _Block) -> list[ChecksumError]:
        hasher = xxhash.xxh3_64()
        buffer = memoryview(bytearray(_RUN))
        for start in range(block.begin, block.end, _RUN):
            piece = buffer[: min(_RUN, block.end - start)]
            self._read_exact(handle, start, piece, block)
            hasher.update(piece)
        digest = hasher.hexdigest()
        return [] if digest == block.checksum else [self._mismatch(block, digest)]

    def _mismatch(self, block: _Block, digest: str) -> ChecksumError:
        chunk = block.chunk
        blob = block.key in self.index.objects
        what = "a stored object" if blob else f"the chunk at offsets {list(chunk.offsets)}"
        if not blob or self.index.block_size is not None:
            what += f" in block {block.number} (bytes {block.begin}-{block.end})"
        return ChecksumError(
            f"checksum mismatch for {what}: expected {block.checksum}, got {digest} — the data "
            "file is corrupt",
            key=block.key,
            file=self.file_path(block.file),
            rank=self.rank,
        )

    def _read_exact(self, handle: Reader, offset: int, buffer: memoryview, where: Any) -> None:
        try:
            count = handle.read_into(offset, buffer)
        except OSError as err:
            raise CheckpointDataError(
                f"cannot read data file: {err}",
                key=where.key,
                file=self.file_path(where.file),
                rank=self.rank,
            ) from err
        with self._lock:
            self.bytes_read += count
        if count != len(buffer):
            raise CheckpointDataError(
                f"data file is truncated: read {count} of {len(buffer)} bytes at offset {offset}",
                key=where.key,
                file=self.file_path(where.file),
                rank=self.rank,
            )

    # -- pass 2: copy -----------------------------------------------------------------------

    def fill(
        self,
        jobs: Sequence[Job],
        targets: Sequence[LocalBox],
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Perform ``jobs``: read their bytes into the destinations ``targets`` (no checksums:
        run :meth:`verify` on their blocks first)."""

        def run(job: Job) -> int:
            self._fill_one(job, targets[job.target])
            if progress is not None:
                progress(job.read.nbytes)
            return 0

        ordered = sorted(jobs, key=lambda job: (job.chunk.file, job.read.file_offset))
        _run_all(ordered, lambda job: job.read.nbytes, run)

    def _fill_one(self, job: Job, target: LocalBox) -> None:
        read, chunk = job.read, job.chunk
        overlap = read.overlap
        destination = (
            narrow_to(target.tensor, target.offsets, overlap) if overlap[0] else (target.tensor)
        )
        handle = self.handle(chunk.file, job.key)
        where = _Where(job.key, chunk.file)
        if (
            read.strides is None
            and destination.is_contiguous()
            and destination.device.type == "cpu"
            and destination.dtype == job.dtype
        ):
            self._read_exact(handle, read.file_offset, byte_view(destination), where)
            return
        buffer = torch.empty(read.nbytes // job.dtype.itemsize, dtype=job.dtype)
        self._read_exact(handle, read.file_offset, byte_view(buffer), where)
        # A strided read covers the overlap from its first to its last element; the overlap
        # is the view of those bytes with the chunk's strides.
        source = (
            buffer.view(overlap[1])
            if read.strides is None
            else buffer.as_strided(overlap[1], read.strides)
        )
        with torch.no_grad():
            if destination.dtype != job.dtype:  # load(allow_dtype_cast=True): cast values
                destination.copy_(source)
                return
            # As bytes (the saved and destination dtypes are the same): torch copies no
            # elements of some dtypes (int1 to int7, uint1 to uint7) and rewrites others (a
            # bool byte 2 becomes 1), which a read straight into the destination does not.
            _bytes_of(destination).copy_(_bytes_of(source))

    # -- whole values -----------------------------------------------------------------------

    def read_box(
        self,
        fqn: str,
        offsets: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
        verify: bool = True,
    ) -> torch.Tensor:
        """The box ``offsets``/``sizes`` (default: all) of tensor ``fqn`` as a new CPU tensor,
        every byte verified. The tensor is allocated only after its files were checked.

        Raises:
            CheckpointKeyError: ``fqn`` is not a tensor of the checkpoint.
            ValueError: The box does not fit the tensor.
        """
        record = self.tensor_record(fqn)
        size = record.size
        box_offsets = tuple(int(o) for o in offsets) if offsets is not None else (0,) * len(size)
        box_sizes = (
            tuple(int(s) for s in sizes)
            if sizes is not None
            else tuple(s - o for s, o in zip(size, box_offsets, strict=False))
        )
        if (
            len(box_offsets) != len(size)
            or len(box_sizes) != len(size)
            or any(
                o < 0 or n < 0 or o + n > s
                for o, n, s in zip(box_offsets, box_sizes, size, strict=True)
            )
        ):
            raise ValueError(
                f"box offsets={list(box_offsets)} sizes={list(box_sizes)} does not fit {fqn!r} "
                f"of size {list(size)}"
            )
        jobs = self.plan(fqn, (box_offsets, box_sizes), 0)
        self.check_files((job.key, job.chunk) for job in jobs)
        if verify:
            self.verify(self.job_blocks(jobs))
        result = torch.empty(box_sizes, dtype=record.dtype)
        self.fill(jobs, [LocalBox(box_offsets, box_sizes, result)])
        return result

    def blob(self, fqn: str, verify: bool = True) -> bytes:
        """The stored bytes of object ``fqn`` (never decoded), every byte verified."""
        item = self.index.objects.get(fqn)
        if item is None or item.blob is None:
            raise CheckpointKeyError("not a stored object of the checkpoint", key=fqn)
        chunk = item.blob
        handle = self.handle(chunk.file, fqn)
        if verify:
            self.verify(self.blocks(fqn, chunk, 0, chunk.nbytes))
        data = bytearray(chunk.nbytes)
        self._read_exact(handle, chunk.begin, memoryview(data), _Where(fqn, chunk.file))
        return bytes(data)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as bytes, with a last dim of its itemsize (any strides)."""
    return tensor.unsqueeze(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class _Where:
    key: str
    file: str


def _run_all(items: Sequence[Any], size: Callable[[Any], int], work: Callable[[Any], int]) -> None:
    """Run ``work`` on every item: small ones inline, large ones on a few threads."""
    small = [item for item in items if size(item) < _INLINE]
    large = [item for item in items if size(item) >= _INLINE]
    for item in small:
        work(item)
    if len(large) <= 1:
        for item in large:
            work(item)
        return
    with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(large))) as pool:
        for future in concurrent.futures.as_completed([pool.submit(work, i) for i in large]):
            future.result()
