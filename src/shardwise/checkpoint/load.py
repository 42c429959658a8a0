"""``load``, ``read_metadata`` and ``load_tensor``: read a checkpoint into any layout.

Every rank lists the boxes its state dict needs (its ShardedTensor shards, its DTensor chunk,
its LocalShardsWrapper shards, or the whole plain tensor), intersects them with the saved
chunks and reads only the bytes it needs: one positioned read straight into the destination
when the overlap is contiguous in the saved chunk, otherwise one read per row piece, or fewer
reads spanning the gaps between pieces where a gap costs less than a read (see
:func:`~shardwise.checkpoint.planner.plan_reads`). A chunk read in full has its checksum
verified. Every check that needs no data (keys, sizes, dtypes, data files present and long
enough) runs on every rank before anything is copied, and a failure on any rank raises the
same error on every rank. Reads run on a thread pool in file and offset order.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shardwise import collectives
from shardwise.checkpoint import planner
from shardwise.checkpoint._items import (
    LocalBox,
    TensorValue,
    decode_object,
    describe_tensor,
    is_tensor_value,
)
from shardwise.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from shardwise.checkpoint.save import CHECKSUM_ALGORITHM, INDEX_NAME
from shardwise.checkpoint.storage import Storage, open_storage
from shardwise.errors import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    PickleNotAllowedError,
)

__all__ = ["load", "load_tensor", "read_metadata"]

# Reads are I/O bound (the GIL is released in preadv and in copies); a few threads overlap them.
_READ_THREADS = 4


def _read_index(storage: Storage, path: str) -> str:
    index = storage.join(INDEX_NAME)
    if not storage.exists(index):
        if storage.exists(storage.join("data")) or storage.exists(storage.root):
            raise CheckpointNotFoundError(
                f"{path} is not a complete shardwise checkpoint: its index {INDEX_NAME} is "
                "missing, so the save that wrote it did not commit (it may have been "
                "interrupted). Save again or load an earlier checkpoint",
                file=index,
            )
        raise CheckpointNotFoundError(f"no checkpoint at {path}", file=index)
    return storage.read(index).decode()


def _parse_index(text: str, index_file: str) -> Metadata:
    try:
        metadata = Metadata.from_json(text)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(str(err), file=index_file) from err
    algorithm = (metadata.planner_data or {}).get("checksum_algorithm")
    if algorithm != CHECKSUM_ALGORITHM:
        raise CheckpointFormatError(
            f"unsupported checksum algorithm {algorithm!r}; this shardwise uses "
            f"{CHECKSUM_ALGORITHM}",
            file=index_file,
        )
    return metadata


def read_metadata(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Metadata:
    """The :class:`Metadata` of the checkpoint at ``path`` (no data is read, no collective).

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        CheckpointFormatError: The index is malformed or of an unknown version.
    """
    storage = open_storage(path, storage_options)
    text = _read_index(storage, os.fspath(path))
    return _parse_index(text, storage.join(INDEX_NAME))


@dataclass(slots=True)
class _Target:
    """One box of a target tensor and where its data goes."""

    fqn: str
    box: LocalBox


def _chunks_of(metadata: Metadata, fqn: str) -> list[planner.SavedChunk]:
    entry = metadata.state_dict_metadata[fqn]
    assert isinstance(entry, TensorStorageMetadata)
    storage_data = metadata.storage_data or {}
    chunks = []
    for chunk in entry.chunks:
        info = storage_data.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            raise CheckpointFormatError(
                f"the index has no storage info for the chunk at {list(chunk.offsets)}", key=fqn
            )
        chunks.append(
            planner.SavedChunk(
                tuple(chunk.offsets),
                tuple(chunk.sizes),
                info["file"],
                int(info["begin"]),
                int(info["end"]),
                info["checksum"],
            )
        )
    return chunks


def _region(tensor: torch.Tensor, origin: tuple[int, ...], box: planner.Box) -> torch.Tensor:
    view = tensor
    for dim, (start, offset, size) in enumerate(zip(origin, box[0], box[1], strict=True)):
        view = view.narrow(dim, offset - start, size)
    return view


def _byte_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


class _Reader:
    """Executes chunk reads for one load, counting bytes and verifying checksums."""

    def __init__(self, storage: Storage, verify: bool, rank: int) -> None:
        self.storage = storage
        self.verify = verify
        self.rank = rank
        self.bytes_read = 0
        self._sizes: dict[str, int] = {}
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _handle(self, path: str) -> Any:
        with self._lock:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = self.storage.open_reader(path)
            return handle

    def close(self) -> None:
        """Close every file this reader opened."""
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()

    def _file_size(self, name: str, fqn: str) -> int:
        if name not in self._sizes:
            path = self.storage.join(*name.split("/"))
            if not self.storage.exists(path):
                raise CheckpointDataError(
                    "data file is missing", key=fqn, file=path, rank=self.rank
                )
            self._sizes[name] = self.storage.size(path)
        return self._sizes[name]

    def check_range(self, name: str, stop: int, fqn: str) -> None:
        """Raise unless data file ``name`` exists and has at least ``stop`` bytes."""
        size = self._file_size(name, fqn)
        if stop > size:
            raise CheckpointDataError(
                f"data file is truncated: it has {size} bytes, the index says it holds bytes "
                f"up to {stop}",
                key=fqn,
                file=self.storage.join(*name.split("/")),
                rank=self.rank,
            )

    def _read(
        self,
        chunk: planner.SavedChunk,
        offset: int,
        buffer: memoryview,
        fqn: str,
        verify_whole: bool = False,
    ) -> None:
        """Read into ``buffer``; with ``verify_whole`` (the buffer is the whole chunk) check
        its checksum piece by piece as the bytes arrive, while they are still in cache."""
        path = self.storage.join(*chunk.file.split("/"))
        self.check_range(chunk.file, offset + len(buffer), fqn)
        handle = self._handle(path)
        view = buffer.cast("B")
        hasher = xxhash.xxh3_64() if verify_whole and self.verify else None
        count = 0
        for start in range(0, max(len(view), 1), _PIECE):
            piece = view[start : start + _PIECE]
            got = handle.read_into(offset + start, piece) if len(piece) else 0
            count += got
            if got != len(piece):
                break
            if hasher is not None:
                hasher.update(piece)
        with self._lock:
            self.bytes_read += count
        if count != len(buffer):
            raise CheckpointDataError(
                f"data file is truncated: read {count} of {len(buffer)} bytes at offset {offset}",
                key=fqn,
                file=path,
                rank=self.rank,
            )
        if hasher is not None:
            self._compare(chunk, hasher.hexdigest(), fqn)

    def fill(
        self,
        fqn: str,
        target: LocalBox,
        chunk: planner.SavedChunk,
        read: planner.ChunkRead,
        dtype: torch.dtype,
    ) -> None:
        """Perform ``read`` of ``chunk`` into the right part of ``target``."""
        overlap = read.overlap
        destination = (
            _region(target.tensor, target.offsets, overlap) if overlap[0] else target.tensor
        )
        direct = (
            read.strides is None
            and destination.is_contiguous()
            and destination.device.type == "cpu"
        )
        if direct:
            self._read(chunk, read.file_offset, _byte_view(destination), fqn, read.whole_chunk)
            return
        buffer = torch.empty(read.nbytes // dtype.itemsize, dtype=dtype)
        self._read(chunk, read.file_offset, _byte_view(buffer), fqn, read.whole_chunk)
        # A strided read covers the overlap from its first to its last element; the overlap
        # is the view of those bytes with the chunk's strides.
        source = (
            buffer.view(overlap[1])
            if read.strides is None
            else buffer.as_strided(overlap[1], read.strides)
        )
        with torch.no_grad():
            destination.copy_(source)

    def _compare(self, chunk: planner.SavedChunk, actual: str, fqn: str) -> None:
        if actual != chunk.checksum:
            raise ChecksumError(
                f"checksum mismatch for the chunk at offsets {list(chunk.offsets)}: expected "
                f"{chunk.checksum}, got {actual} — the data file is corrupt",
                key=fqn,
                file=self.storage.join(*chunk.file.split("/")),
                rank=self.rank,
            )

    def read_blob(self, fqn: str, info: Mapping[str, Any]) -> bytes:
        chunk = planner.SavedChunk(
            (), (), info["file"], info["begin"], info["end"], info["checksum"]
        )
        data = bytearray(chunk.end - chunk.begin)
        self._read(chunk, chunk.begin, memoryview(data), fqn)
        if self.verify and xxhash.xxh3_64_hexdigest(data) != chunk.checksum:
            raise ChecksumError(
                "checksum mismatch for a stored object — the data file is corrupt",
                key=fqn,
                file=self.storage.join(*chunk.file.split("/")),
                rank=self.rank,
            )
        return bytes(data)


def _check_target(fqn: str, described: TensorValue, entry: TensorStorageMetadata) -> None:
    saved_dtype = entry.properties.dtype
    if described.size is not None and tuple(described.size) != tuple(entry.size):
        raise CheckpointMismatchError(
            f"size mismatch: the checkpoint has size {list(entry.size)}, the state dict "
            f"expects {list(described.size)}",
            key=fqn,
        )
    if described.size is None and any(
        o + s > bound
        for box in described.boxes
        if planner.numel(box.sizes) > 0  # an empty shard may sit past the end (ceil rule)
        for o, s, bound in zip(box.offsets, box.sizes, entry.size, strict=True)
    ):
        raise CheckpointMismatchError(
            f"size mismatch: the state dict's shards do not fit the saved size {list(entry.size)}",
            key=fqn,
        )
    if described.dtype != saved_dtype:
        raise CheckpointMismatchError(
            f"dtype mismatch: the checkpoint has {saved_dtype}, the state dict expects "
            f"{described.dtype}",
            key=fqn,
        )


def _plan_load(
    flat: Mapping[str, Any], metadata: Metadata, strict: bool, allow_pickle: bool
) -> tuple[list[_Target], dict[str, Mapping[str, Any]]]:
    targets: list[_Target] = []
    objects: dict[str, Mapping[str, Any]] = {}
    storage_data = metadata.storage_data or {}
    for fqn, value in flat.items():
        entry = metadata.state_dict_metadata.get(fqn)
        if entry is None:
            if strict:
                raise CheckpointKeyError(
                    "missing from the checkpoint (pass strict=False to skip missing keys)",
                    key=fqn,
                )
            continue
        if is_tensor_value(value):
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointMismatchError(
                    "the state dict holds a tensor, the checkpoint an object", key=fqn
                )
            described = describe_tensor(fqn, value)
            _check_target(fqn, described, entry)
            targets.extend(_Target(fqn, box) for box in described.boxes)
        else:
            if not isinstance(entry, BytesStorageMetadata):
                raise CheckpointMismatchError(
                    "the state dict holds an object, the checkpoint a tensor", key=fqn
                )
            info = storage_data.get(MetadataIndex(fqn))
            if not isinstance(info, Mapping) or "encoding" not in info:
                raise CheckpointFormatError("the index has no storage info for it", key=fqn)
            if info["encoding"] == "pickle" and not allow_pickle:
                raise PickleNotAllowedError(
                    "this entry was pickled; pass allow_pickle=True to load it (only for "
                    "checkpoints you trust: unpickling runs code)",
                    key=fqn,
                )
            objects[fqn] = info
    return targets, objects


_Job = tuple[_Target, planner.SavedChunk, planner.ChunkRead, torch.dtype]
# Reads smaller than this run inline in the calling thread (see _run_jobs).
_INLINE_READ = 1 << 20
# Whole chunks are read and hashed in pieces of this size, so hashing finds them in cache.
_PIECE = 4 << 20


def _plan_jobs(reader: _Reader, metadata: Metadata, targets: list[_Target]) -> list[_Job]:
    """Every read the targets need, in file and offset order, after checking that the data
    files exist and are long enough (so those failures come before anything is copied)."""
    jobs: list[_Job] = []
    chunks_by_fqn: dict[str, list[planner.SavedChunk]] = {}
    for target in targets:
        entry = metadata.state_dict_metadata[target.fqn]
        assert isinstance(entry, TensorStorageMetadata)
        chunks = chunks_by_fqn.get(target.fqn)
        if chunks is None:
            chunks = chunks_by_fqn[target.fqn] = _chunks_of(metadata, target.fqn)
        dtype = entry.properties.dtype
        itemsize = dtype.itemsize
        try:
            reads = planner.plan_reads(target.box.box, chunks, itemsize)
        except ValueError as err:
            raise CheckpointFormatError(str(err), key=target.fqn) from err
        jobs.extend((target, chunks[read.chunk], read, dtype) for read in reads)
    jobs.sort(key=lambda job: (job[1].file, job[2].file_offset))
    for target, chunk, _, _ in jobs:
        # The whole chunk, not only the part read: a short file is corrupt whatever we need.
        reader.check_range(chunk.file, chunk.end, target.fqn)
    return jobs


def _run_jobs(reader: _Reader, jobs: list[_Job], bar: Any = None) -> None:
    """Perform the reads (in parallel threads), advancing ``bar`` by the bytes read."""

    def run(batch: list[_Job]) -> int:
        for target, chunk, read, dtype in batch:
            reader.fill(target.fqn, target.box, chunk, read, dtype)
        return sum(job[2].nbytes for job in batch)

    # Small reads run inline: on a thread pool they cost more in GIL hand-offs (measured:
    # 10,000 small reads took 2.1 s on 4 threads and 0.45 s on one). Large reads overlap.
    small = [job for job in jobs if job[2].nbytes < _INLINE_READ]
    large = [job for job in jobs if job[2].nbytes >= _INLINE_READ]
    done = run(small)
    if bar is not None:
        bar.update(done)
    batches = [[job] for job in large]
    if len(batches) <= 1:
        done = sum(run(batch) for batch in batches)
        if bar is not None:
            bar.update(done)
        return
    with concurrent.futures.ThreadPoolExecutor(min(_READ_THREADS, len(batches))) as pool:
        for future in concurrent.futures.as_completed([pool.submit(run, b) for b in batches]):
            nbytes = future.result()
            if bar is not None:
                bar.update(nbytes)


def _set_nested(state_dict: MutableMapping[str, Any], fqn: str, value: Any) -> None:
    """Replace the value at dotted ``fqn`` in a possibly nested state dict."""
    if fqn in state_dict:
        state_dict[fqn] = value
        return
    for split in range(len(fqn.split(".")) - 1, 0, -1):
        prefix = ".".join(fqn.split(".")[:split])
        child = state_dict.get(prefix)
        if isinstance(child, dict):
            _set_nested(child, fqn[len(prefix) + 1 :], value)
            return
    raise KeyError(fqn) from None


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (collective).

    Tensors (plain, ShardedTensor, DTensor, LocalShardsWrapper; any layout, any world size)
    are filled in place from whatever layout was saved; other values are replaced. Keys of the
    checkpoint that the state dict does not have are ignored.

    Args:
        state_dict: The target, with tensors of the right size and dtype.
        path: Checkpoint directory or fsspec URL.
        process_group: The ranks loading together (default: the default group, if any).
        strict: Raise when a key of ``state_dict`` is missing from the checkpoint.
        verify: Check the checksum of every chunk read in full.
        allow_pickle: Allow loading entries that were pickled.
        storage_options: fsspec options for URLs.
        progress: Show a progress bar on rank 0.

    Raises:
        CheckpointError: (a subclass) missing or incomplete checkpoint, unknown version,
            missing key, size or dtype mismatch, checksum mismatch, truncated or missing data
            file, pickled entry without ``allow_pickle``. Checks that need no data run on
            every rank before anything is copied, and every rank raises.
    """
    comm = collectives.Comm(process_group)
    path_text = os.fspath(path)
    storage = open_storage(path, storage_options)

    # Rank 0 reads the index and broadcasts it (or its failure): O(index) bytes per rank.
    envelope: dict[str, Any] | None = None
    error: Exception | None = None
    if comm.rank == 0:
        try:
            envelope = {"text": _read_index(storage, path_text)}
        except Exception as err:
            error = err
            envelope = {"error": collectives.describe_error(err)}
    if comm.group is not None:
        envelope = comm.broadcast_json(envelope, src=0)
    if error is not None:
        raise error
    assert envelope is not None
    if "error" in envelope:
        raise collectives.rebuild_error(envelope["error"], 0)
    metadata = _parse_index(envelope["text"], storage.join(INDEX_NAME))
    reader = _Reader(storage, verify, comm.rank)

    def plan() -> tuple[list[_Job], dict[str, Mapping[str, Any]]]:
        flat = planner.flatten_state_dict(state_dict)
        targets, objects = _plan_load(flat, metadata, strict, allow_pickle)
        jobs = _plan_jobs(reader, metadata, targets)
        for fqn, info in objects.items():
            if info["encoding"] != "json":
                reader.check_range(info["file"], int(info["end"]), fqn)
        return jobs, objects

    # Everything that can be checked without the data is, on every rank, before any copy.
    (jobs, objects), _ = comm.exchange_or_raise(plan, lambda _: None)
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm  # type: ignore[import-untyped]

        total = sum(job[2].nbytes for job in jobs)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path_text}")

    def run() -> dict[str, Any]:
        _run_jobs(reader, jobs, bar)
        values = {}
        for fqn, info in objects.items():
            if info["encoding"] == "json":
                values[fqn] = decode_object("json", info["text"].encode(), pickle.loads)
            else:
                blob = reader.read_blob(fqn, info)
                values[fqn] = decode_object(info["encoding"], blob, pickle.loads)
        return values

    try:
        values, _ = comm.exchange_or_raise(run, lambda _: None)
    finally:
        reader.close()
        if bar is not None:
            bar.close()
    # Objects are replaced only once every rank has loaded everything.
    for fqn, value in values.items():
        _set_nested(state_dict, fqn, value)


def load_tensor(
    path: str | os.PathLike[str],
    fqn: str,
    *,
    offsets: list[int] | tuple[int, ...] | None = None,
    sizes: list[int] | tuple[int, ...] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Read one tensor, or the box ``offsets``/``sizes`` of it, into a new CPU tensor.

    No process group needed. Checksums of chunks read in full are verified.

    Raises:
        CheckpointKeyError: ``fqn`` is not a tensor of the checkpoint.
        ValueError: The box does not fit the tensor.
    """
    storage = open_storage(path, storage_options)
    metadata = _parse_index(_read_index(storage, os.fspath(path)), storage.join(INDEX_NAME))
    entry = metadata.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointKeyError("not a tensor of the checkpoint", key=fqn)
    size = tuple(entry.size)
    box_offsets = tuple(offsets) if offsets is not None else (0,) * len(size)
    box_sizes = (
        tuple(sizes)
        if sizes is not None
        else tuple(s - o for s, o in zip(size, box_offsets, strict=True))
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
            f"box offsets={list(box_offsets)} sizes={list(box_sizes)} does not fit {fqn!r} of "
            f"size {list(size)}"
        )
    result = torch.empty(box_sizes, dtype=entry.properties.dtype)
    reader = _Reader(storage, True, 0)
    target = _Target(fqn, LocalBox(box_offsets, box_sizes, result))
    try:
        _run_jobs(reader, _plan_jobs(reader, metadata, [target]))
    finally:
        reader.close()
    return result
