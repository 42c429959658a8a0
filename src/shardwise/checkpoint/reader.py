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

Both passes read in batches through :meth:`~shardwise.checkpoint.storage.Storage.read_ranges`
(threads locally, concurrent ranged requests on object stores). On remote storage the first
pass keeps what it verified (:class:`_KeptBytes`: up to 64 MiB in memory, the rest in an
unlinked temporary local file), and the second pass copies from there: each byte is requested from
the store once.
"""

from __future__ import annotations

import bisect
import logging
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
from shardwise.checkpoint.state_dict import display_key
from shardwise.checkpoint.storage import (
    FsspecStorage,
    LocalStorage,
    RangeRequest,
    Reader,
    Storage,
    TemporaryBytes,
    UnsafePathError,
    batches,
    open_storage,
)
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    ChecksumError,
)

__all__ = ["CheckpointReader", "Job", "read_index_bytes"]

logger = logging.getLogger(__name__)

# The verifying pass reads adjacent blocks together, up to this many bytes per read, and
# reads through gaps between needed blocks smaller than _GAP rather than issue another read.
_RUN = 8 << 20
_GAP = 64 << 10
_HEX = 16
# Each pass reads in batches of at most this many bytes (one read_ranges call: concurrent
# requests on an object store), which bounds the memory of buffers in flight: as much as 4
# threads reading runs of _RUN bytes each.
_BATCH = 32 << 20
# Verified bytes kept for the second pass on remote storage stay in memory up to this much;
# the rest go to an unlinked temporary file.
_KEEP_IN_MEMORY = 64 << 20

# A tensor with more chunks than this is planned through a planner.ChunkLookup (a sweep
# order), not by comparing each box with every chunk.
_LOOKUP_CHUNKS = 8


def read_index_bytes(storage: Storage, path: str) -> bytes:
    """The raw index of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: No committed checkpoint there; the message says what is
            there instead (nothing, a file, an empty directory, an interrupted save, a torch
            DCP checkpoint, a Hugging Face model directory, or other files).
        CheckpointFormatError: The index is not a regular file, or too large to be one.
    """
    name = storage.join(INDEX_NAME)
    shown = storage.url(name)
    if not storage.exists(name):
        raise CheckpointNotFoundError(_what_is_there(storage, path), file=shown)
    try:
        reader = storage.open_reader(name)
    except UnsafePathError as err:
        raise CheckpointFormatError(
            f"the checkpoint index is not a regular file ({err.strerror})", file=shown
        ) from err
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"no checkpoint at {path}", file=shown) from err
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot open the index: {err}", file=shown) from err
    try:
        if reader.size > MAX_INDEX_BYTES:
            raise CheckpointFormatError(
                f"the checkpoint index has {reader.size} bytes, more than a reader accepts",
                file=shown,
            )
        data = bytearray(reader.size)
        count = reader.read_into(0, memoryview(data))
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot read the index: {err}", file=shown) from err
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
            return f"no checkpoint at {path}{_missing_bucket(storage)}"
        if _is_file(storage):
            return _a_file(path)
        entries = storage.listdir(storage.root)
    except CheckpointStorageError:
        raise
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


def _missing_bucket(storage: Storage) -> str:
    """Why an object store has nothing at the path, when its bucket is missing (else "")."""
    if isinstance(storage, FsspecStorage) and storage.bucket and not storage.exists(storage.bucket):
        return f": there is no bucket {storage.bucket!r} (or these credentials cannot see it)"
    return ""


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
            err.bare_message, key=err.key, file=storage.url(storage.join(INDEX_NAME))
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
        # Sweep orders of the tensors with many chunks, built on first use (see plan).
        self._lookups: dict[str, planner.ChunkLookup] = {}
        self._kept = _KeptBytes()

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
        """Close every data file this reader opened, and drop the verified bytes it kept."""
        self.release()
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()

    # -- files ------------------------------------------------------------------------------

    def file_path(self, name: str) -> str:
        """The storage path of data file ``name`` (validated: ``data/rank-*.safetensors``)."""
        assert name.startswith("data/") and is_data_file_name(name[5:]), name
        return self.storage.join("data", name[5:])

    def shown(self, name: str) -> str:
        """The path of data file ``name`` as errors show it (an object store's with its
        protocol)."""
        return self.storage.url(self.file_path(name))

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
                    "data file is missing", key=key, file=self.shown(name), rank=self.rank
                ) from err
            except UnsafePathError as err:
                raise CheckpointDataError(
                    f"data file is not a regular file inside the checkpoint: {err.strerror}; "
                    "refusing to read it",
                    key=key,
                    file=self.shown(name),
                    rank=self.rank,
                ) from err
            except CheckpointStorageError:
                raise
            except OSError as err:
                raise CheckpointDataError(
                    f"cannot open data file: {err}", key=key, file=self.shown(name), rank=self.rank
                ) from err
            declared = self.index.files.get(name)
            problem = None
            # The extent (a pass over every chunk) only when the size alone does not settle it.
            if (declared is None or handle.size != declared) and handle.size < self._extent(name):
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
                raise CheckpointDataError(problem, key=key, file=self.shown(name), rank=self.rank)
            self._handles[name] = handle
            return handle

    def check_files(self, items: Iterable[tuple[str, SavedChunk]]) -> None:
        """Open (and so check) the data file of every ``(key, chunk)``."""
        for key, chunk in items:
            if chunk.nbytes:
                self.handle(chunk.file, key)

    # -- planning ---------------------------------------------------------------------------

    def tensor_record(self, fqn: str) -> TensorRecord:
        """The tensor entry ``fqn``; :class:`CheckpointKeyError` if there is none.

        ``fqn`` may also be the dotted key as ``inspect`` shows it (``optim.state.0.exp_avg``)
        of an entry whose path has int parts (stored with their positions, see
        ``docs/format.md``, *Keys*), when exactly one entry has that dotted key."""
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
        """The reads that fill the global ``box`` of tensor ``fqn`` (into destination
        ``target``)."""
        record = self.tensor_record(fqn)
        dtype = record.dtype
        lookup = None
        if len(record.chunks) > _LOOKUP_CHUNKS:
            lookup = self._lookups.get(fqn)
            if lookup is None:
                lookup = planner.ChunkLookup([(c.offsets, c.sizes) for c in record.chunks])
                self._lookups[fqn] = lookup
        try:
            reads = planner.plan_reads(box, record.chunks, dtype.itemsize, lookup=lookup)
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
        keep: bool | None = None,
    ) -> None:
        """Read and check every block of ``blocks`` (each once; adjacent ones in one read).

        Args:
            blocks: The blocks to check.
            problems: Collect mismatches here instead of raising the first.
            progress: Called with the bytes of the blocks checked, batch after batch.
            keep: Keep the verified bytes for the reads that follow (:meth:`fill`,
                :meth:`blob`), until :meth:`release` or :meth:`close`. Default: on remote
                storage, where reading them again means requesting them again, unless
                ``problems`` are collected (an audit, which reads nothing afterwards).

        Raises:
            ChecksumError: A block does not match its checksum (unless ``problems``).
            CheckpointDataError: A data file is missing, unsafe, or shorter than the index says.
        """
        if keep is None:
            keep = self.storage.remote and problems is None
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
        found: list[ChecksumError] = []
        regular = [run for run in runs if _span(run) <= _RUN]
        for batch in batches(regular, _span, _BATCH):
            for mismatches in self._check_runs(batch, keep):
                found.extend(mismatches)
            blocks_bytes = sum(block.end - block.begin for run in batch for block in run)
            self._verified(blocks_bytes, found, problems, progress)
        # A block larger than a run (a version-1 chunk) is read and hashed in pieces.
        for (block,) in (run for run in runs if _span(run) > _RUN):
            found.extend(self._check_streamed(block, keep))
            self._verified(block.end - block.begin, found, problems, progress)
        if problems is not None:
            problems.extend(found)

    def _check_runs(self, runs: list[list[_Block]], keep: bool) -> list[list[ChecksumError]]:
        """Read ``runs`` and return the mismatches of each; keep the runs that match, with
        ``keep``."""
        checked: list[list[ChecksumError]] = [[] for _ in runs]

        def check(number: int, data: memoryview) -> None:
            # On the thread that read the run, while its bytes are in the cache.
            run = runs[number]
            checked[number] = self._check_run(run, data)
            if keep and not checked[number]:
                self._kept.keep(run[0].file, run[0].begin, data)

        # No buffers given: each run is read into a new one by the thread that reads it.
        self._read_all(
            [_Read(run[0].file, run[0].begin, _span(run), run[0].key) for run in runs], check
        )
        return checked

    def _verified(
        self,
        count: int,
        found: list[ChecksumError],
        problems: list[ChecksumError] | None,
        progress: Callable[[int], object] | None,
    ) -> None:
        """Account ``count`` verified bytes (of blocks: gaps read through are not counted);
        raise the first mismatch unless collecting."""
        with self._lock:
            self.bytes_verified += count
        if found and problems is None:
            raise found[0]
        if progress is not None:
            progress(count)

    def _check_run(self, run: list[_Block], buffer: memoryview) -> list[ChecksumError]:
        """The mismatches of the blocks of ``run``, whose bytes are ``buffer``."""
        begin = run[0].begin
        found = []
        for block in run:
            digest = xxhash.xxh3_64_hexdigest(buffer[block.begin - begin : block.end - begin])
            if digest != block.checksum:
                found.append(self._mismatch(block, digest))
        return found

    def _check_streamed(self, block: _Block, keep: bool) -> list[ChecksumError]:
        hasher = xxhash.xxh3_64()
        starts = range(block.begin, block.end, _RUN)
        kept: list[tuple[int, memoryview]] = []
        for batch in batches(starts, lambda start: min(_RUN, block.end - start), _BATCH):
            pieces = self._read_pieces(block, batch)
            for piece in pieces:  # in order: one hash over the whole block
                hasher.update(piece)
            if keep:
                kept.extend(zip(batch, pieces, strict=True))
        digest = hasher.hexdigest()
        if digest != block.checksum:
            return [self._mismatch(block, digest)]
        for start, piece in kept:  # only once the whole block matched
            self._kept.keep(block.file, start, piece)
        return []

    def _read_pieces(self, block: _Block, starts: Sequence[int]) -> list[memoryview]:
        """The pieces of ``block`` (of at most :data:`_RUN` bytes) from ``starts``."""
        pieces = [memoryview(b"")] * len(starts)

        def got(number: int, data: memoryview) -> None:
            pieces[number] = data

        reads = [
            _Read(block.file, start, min(_RUN, block.end - start), block.key) for start in starts
        ]
        self._read_all(reads, got)
        return pieces

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
            file=self.shown(block.file),
            rank=self.rank,
        )

    def _read_all(
        self, reads: Sequence[_Read], then: Callable[[int, memoryview], None] | None = None
    ) -> None:
        """Perform every read: from the kept verified bytes where they hold it, otherwise from
        the storage, all in one batch.

        Args:
            reads: The reads.
            then: Called as ``then(number, data)`` once read ``number`` is complete, with its
                bytes (see :meth:`~shardwise.checkpoint.storage.Storage.read_ranges`).

        Raises:
            CheckpointDataError: A read failed, or came back short (a truncated file).
            CheckpointStorageError: The storage failed.
        """
        pending = []
        for number, read in enumerate(reads):
            if self._kept.holds(read.file):
                buffer = read.buffer
                if buffer is None:
                    buffer = memoryview(bytearray(read.length))
                if self._kept.read(read.file, read.offset, buffer):
                    if then is not None:
                        then(number, buffer)
                    continue
            pending.append(number)
        if not pending:
            return
        requests = []
        for number in pending:
            read = reads[number]
            handle = self.handle(read.file, read.key)
            requests.append(RangeRequest(handle, read.offset, read.length, read.buffer))

        def complete(position: int, data: memoryview) -> None:
            read = reads[pending[position]]
            if len(data) != read.length:
                raise CheckpointDataError(
                    f"data file is truncated: read {len(data)} of {read.length} bytes at "
                    f"offset {read.offset}",
                    key=read.key,
                    file=self.shown(read.file),
                    rank=self.rank,
                )
            if then is not None:
                then(pending[position], data)

        try:
            counts = self.storage.read_ranges(requests, complete)
        except CheckpointError:  # a truncated file, the storage failing: said already
            raise
        except OSError as err:
            failed = next(
                (reads[n] for n in pending if self.file_path(reads[n].file) == err.filename),
                reads[pending[0]],
            )
            raise CheckpointDataError(
                f"cannot read data file: {err}",
                key=failed.key,
                file=self.shown(failed.file),
                rank=self.rank,
            ) from err
        with self._lock:
            self.bytes_read += sum(counts)

    def release(self) -> None:
        """Drop the verified bytes kept so far (see :meth:`verify`)."""
        self._kept.close()

    # -- pass 2: copy -----------------------------------------------------------------------

    def fill(
        self,
        jobs: Sequence[Job],
        targets: Sequence[LocalBox],
        progress: Callable[[int], object] | None = None,
    ) -> None:
        """Perform ``jobs``: read their bytes into the destinations ``targets`` (no checksums:
        run :meth:`verify` on their blocks first)."""
        ordered = sorted(jobs, key=lambda job: (job.chunk.file, job.read.file_offset))
        for batch in batches(ordered, lambda job: job.read.nbytes, _BATCH):
            self._fill_batch([_Fill.prepare(job, targets[job.target]) for job in batch])
            if progress is not None:
                progress(sum(job.read.nbytes for job in batch))

    def _fill_batch(self, fills: list[_Fill]) -> None:
        # A staged read is copied out by the thread that read it, while it is in the cache.
        self._read_all([fill.read for fill in fills], lambda number, _: fills[number].finish())

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
        try:
            if verify:
                self.verify(self.job_blocks(jobs))
            result = torch.empty(box_sizes, dtype=record.dtype)
            self.fill(jobs, [LocalBox(box_offsets, box_sizes, result)])
        finally:
            if verify:  # what it kept was for this read only
                self.release()
        return result

    def blob(self, fqn: str, verify: bool = True) -> bytes:
        """The stored bytes of object ``fqn`` (never decoded), every byte verified."""
        item = self.index.objects.get(fqn)
        if item is None or item.blob is None:
            raise CheckpointKeyError("not a stored object of the checkpoint", key=fqn)
        chunk = item.blob
        self.handle(chunk.file, fqn)
        data = bytearray(chunk.nbytes)
        try:
            if verify:
                self.verify(self.blocks(fqn, chunk, 0, chunk.nbytes))
            self._read_all([_Read.into(chunk.file, chunk.begin, memoryview(data), fqn)])
        finally:
            if verify:  # what it kept was for this read only
                self.release()
        return bytes(data)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as bytes, with a last dim of its itemsize (any strides)."""
    return tensor.unsqueeze(-1).view(torch.uint8)


def _span(run: list[_Block]) -> int:
    """The bytes of a run of blocks, gaps included."""
    return run[-1].end - run[0].begin


@dataclass(frozen=True, slots=True)
class _Read:
    """Bytes ``[offset, offset + length)`` of data file ``file``, into ``buffer`` (None: a new
    buffer); ``key`` names the entry in errors."""

    file: str
    offset: int
    length: int
    key: str | None
    buffer: memoryview | None = None

    @classmethod
    def into(cls, file: str, offset: int, buffer: memoryview, key: str | None) -> _Read:
        """A read that fills ``buffer``."""
        view = buffer.cast("B")
        return cls(file, offset, len(view), key, view)


@dataclass(frozen=True, slots=True)
class _Fill:
    """One job of :meth:`CheckpointReader.fill`: its read, straight into the destination
    where the bytes fit it as they are, otherwise into ``staging`` and then copied."""

    job: Job
    read: _Read
    destination: torch.Tensor
    staging: torch.Tensor | None

    @classmethod
    def prepare(cls, job: Job, target: LocalBox) -> _Fill:
        read, chunk = job.read, job.chunk
        overlap = read.overlap
        # Narrowed only to a part of the target (a whole target, the common case, is not).
        whole = overlap[0] == target.offsets and overlap[1] == target.sizes
        destination = target.tensor if whole else narrow_to(target.tensor, target.offsets, overlap)
        if (
            read.strides is None
            and destination.is_contiguous()
            and destination.device.type == "cpu"
            and destination.dtype == job.dtype
        ):
            where = _Read.into(chunk.file, read.file_offset, byte_view(destination), job.key)
            return cls(job, where, destination, None)
        staging = torch.empty(read.nbytes // job.dtype.itemsize, dtype=job.dtype)
        where = _Read.into(chunk.file, read.file_offset, byte_view(staging), job.key)
        return cls(job, where, destination, staging)

    def finish(self) -> None:
        """Copy the staged bytes into the destination (nothing to do for a direct read)."""
        if self.staging is None:
            return
        overlap, strides = self.job.read.overlap, self.job.read.strides
        # A strided read covers the overlap from its first to its last element; the overlap
        # is the view of those bytes with the chunk's strides.
        source = (
            self.staging.view(overlap[1])
            if strides is None
            else self.staging.as_strided(overlap[1], strides)
        )
        with torch.no_grad():
            if self.destination.dtype != self.job.dtype:  # allow_dtype_cast=True: cast values
                self.destination.copy_(source)
                return
            # As bytes (the saved and destination dtypes are the same): torch copies no
            # elements of some dtypes (int1 to int7, uint1 to uint7) and rewrites others (a
            # bool byte 2 becomes 1), which a read straight into the destination does not.
            _bytes_of(self.destination).copy_(_bytes_of(source))


@dataclass(frozen=True, slots=True)
class _Segment:
    """Kept bytes ``[begin, end)`` of a file: in ``memory``, or at ``spilled`` in the
    temporary file."""

    begin: int
    end: int
    memory: memoryview | None
    spilled: int


class _KeptBytes:
    """Bytes the first pass verified, kept for the second on remote storage, so that each byte
    is requested from the store once.

    Up to ``memory_limit`` bytes stay in memory; more go to a :class:`TemporaryBytes` file.
    If that file cannot be written (a full disk), the bytes are dropped, and read from the
    store again when they are needed: slower, never wrong.
    """

    def __init__(self, memory_limit: int | None = None) -> None:
        self._memory_limit = _KEEP_IN_MEMORY if memory_limit is None else memory_limit
        self._in_memory = 0
        self._segments: dict[str, list[_Segment]] = {}
        self._spill = TemporaryBytes()
        self._spill_failed = False
        self._lock = threading.Lock()

    @property
    def spilled(self) -> int:
        """Bytes in the temporary file."""
        return self._spill.size

    def holds(self, file: str) -> bool:
        """Whether any bytes of ``file`` are kept."""
        return file in self._segments

    def keep(self, file: str, begin: int, data: memoryview) -> None:
        """Keep ``data``, the verified bytes of ``file`` from ``begin`` (unless they are kept
        already)."""
        with self._lock:
            segments = self._segments.get(file, [])
            index = bisect.bisect_right(segments, begin, key=_begin) - 1
            if index >= 0 and segments[index].end >= begin + len(data):
                return
            if self._in_memory + len(data) <= self._memory_limit:
                segment = _Segment(begin, begin + len(data), data, -1)
                self._in_memory += len(data)
            else:
                offset = self._write_spill(data)
                if offset is None:
                    return
                segment = _Segment(begin, begin + len(data), None, offset)
            bisect.insort(self._segments.setdefault(file, []), segment, key=_begin)

    def _write_spill(self, data: memoryview) -> int | None:
        if self._spill_failed:
            return None
        try:
            return self._spill.append(data)
        except OSError as err:
            self._spill_failed = True
            logger.warning(
                "cannot keep verified bytes in a temporary file (%s): they will be read from "
                "the storage again",
                err,
            )
            return None

    def read(self, file: str, offset: int, buffer: memoryview) -> bool:
        """Copy the kept bytes ``[offset, offset + len(buffer))`` of ``file`` into ``buffer``;
        False if they are not all kept (then ``buffer`` must be read from the storage)."""
        view = buffer.cast("B")
        end = offset + len(view)
        with self._lock:
            segments = self._segments.get(file)
            if not segments:
                return not view
            position = offset
            while position < end:
                # The last segment starting at or before ``position``: it must contain it.
                index = bisect.bisect_right(segments, position, key=_begin) - 1
                if index < 0 or segments[index].end <= position:
                    return False
                segment = segments[index]
                stop = min(end, segment.end)
                target = view[position - offset : stop - offset]
                if segment.memory is not None:
                    target[:] = segment.memory[position - segment.begin : stop - segment.begin]
                else:
                    self._spill.read_into(segment.spilled + position - segment.begin, target)
                position = stop
            return True

    def close(self) -> None:
        """Drop everything kept (the temporary file is deleted)."""
        with self._lock:
            self._segments.clear()
            self._in_memory = 0
            self._spill_failed = False
            self._spill.close()


def _begin(segment: _Segment) -> int:
    return segment.begin
