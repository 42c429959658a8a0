"""A part of a local save as files: read from and written to its directory, its data file
mapped for sending or made and mapped for receiving, and verified against its index
(``docs/local-tier.md``).

A part is a directory holding what :func:`~shardwise.checkpoint.saving.save.save_parts` wrote
for one saved rank: the index of the whole save (``shardwise.json``) and, when that rank
wrote anything, its data file (``data/rank-<R>.<save id>.safetensors``). The part's
``part.json`` (:mod:`.directory`) is not part of it: each holder writes its own. Only data
files travel between ranks: the index is the same on every part of a save, and the receiver
has it already (its own part's at a save; the broadcast one at a restore), which names the
size it takes.

Verifying is pure (bytes in, a verdict out); reading and writing go through descriptors with
``O_NOFOLLOW``, as everything in the tier's directory does.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Callable, Mapping, Sequence

from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    Index,
    block_checksums,
    data_file_name,
    decode_index,
)
from shardwise.checkpoint.index.names import is_data_file_name, is_temporary_name
from shardwise.checkpoint.local_tier.directory import (  # the tier's one set of open flags
    _CREATE_FLAGS,
    _DIRECTORY_FLAGS,
    _READ_FLAGS,
)
from shardwise.checkpoint.storage import LocalStorage, Reader
from shardwise.errors import CheckpointDataError, CheckpointError

__all__ = [
    "check_stored_part",
    "IncomingDataFile",
    "link_part",
    "map_data_file",
    "read_index",
    "ReceivedParts",
    "RecyclingStorage",
    "Take",
    "verify_pieces",
    "write_part",
]

# A data file received is created to be mapped for writing.
_MAP_FLAGS = (_CREATE_FLAGS & ~os.O_WRONLY) | os.O_RDWR
# A mapping received into is filled whole at once: its pages are mapped in one call, not one
# fault each (151 MiB received into a mapping of tmpfs: 0.034 s against 0.070 s).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

Take = Callable[[int, str, "int | None"], "int | None"]
"""A spare file put at a name: ``(directory descriptor, name, size or None)`` -> the file's
descriptor, open to be written over, or None (:meth:`.TierDirectory.take_spare`, bound to
the saved rank)."""


def _is_part_file(name: object) -> bool:
    if name == INDEX_NAME:
        return True
    if not isinstance(name, str) or not name.startswith(f"{DATA_DIR}/"):
        return False
    return is_data_file_name(name.removeprefix(f"{DATA_DIR}/"))


def _read_file(parent: int, name: str, limit: int | None) -> bytes:
    fd = os.open(name, _READ_FLAGS, dir_fd=parent)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if limit is not None and status.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", name)
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_index(path: str) -> bytes:
    """The index of the part in the directory ``path`` (no data is read).

    Raises:
        OSError: It is missing, a link or not a regular file, or cannot be read.
    """
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        return _read_file(fd, INDEX_NAME, MAX_INDEX_BYTES)
    finally:
        os.close(fd)


def _open_data_file(part_fd: int, name: str) -> int | None:
    """The part's data file ``name`` (``data/...``) opened for reading, below the part's
    descriptor with no link followed; None when it (or ``data/``) is missing.

    Raises:
        OSError: A link, not a regular file, or it cannot be opened.
    """
    try:
        directory = os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=part_fd)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(name.removeprefix(f"{DATA_DIR}/"), _READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return None
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", name)
    return fd


def _data_directory(part_fd: int) -> int:
    """The ``data/`` directory of the part directory ``part_fd``, made if missing, opened
    (a link or a file in its place is refused: ``OSError``)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(DATA_DIR, 0o700, dir_fd=part_fd)
    return os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=part_fd)


def _read_exactly(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from byte ``offset`` of ``fd``; False if the file ends first."""
    done = 0
    while done < len(view):
        moved = os.preadv(fd, [view[done:]], offset + done)
        if moved == 0:
            return False
        done += moved
    return True


def map_data_file(path: str, rank: int, save_id: str) -> mmap.mmap | None:
    """Saved rank ``rank``'s data file of the part in the directory ``path``, mapped: a
    buffer the transport sends from with no copy (a copy-on-write mapping, never written:
    gloo wants a writable buffer); None when the part has none. Reading a fresh copy of a
    300 MiB part first cost more than sending it. The file must keep its size while mapped
    (a mapping read past a shrunk file's end faults): the tier's files are never truncated.

    Raises:
        OSError: A link, not a regular file, or it cannot be opened or mapped.
    """
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        data_fd = _open_data_file(fd, data_file_name(rank, save_id))
    finally:
        os.close(fd)
    if data_fd is None:
        return None
    try:
        size = os.fstat(data_fd).st_size
        if size == 0:  # nothing to map; a data file holds a header at least
            raise OSError(errno.EINVAL, "an empty data file", path)
        # Not populated: a private writable mapping is populated by write faults, a copy of
        # every page (31 ms for 151 MiB); read faults map the file's own pages.
        return mmap.mmap(data_fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(data_fd)


class IncomingDataFile:
    """A data file ``name`` (``data/...``) of ``size`` bytes made in the part directory
    ``path`` for the transport to receive into: a spare when ``take`` gives one (its old
    bytes are all written over), else a new file; its blocks reserved first (a full file
    system is an ``OSError`` here, never a fault while it is written), then mapped, so that
    the bytes land in the file with no copy. :meth:`close` when the transfer is over."""

    def __init__(self, path: str, name: str, size: int, take: Take | None = None) -> None:
        if not _is_part_file(name) or name == INDEX_NAME or size <= 0:
            raise ValueError(f"not a part's data file: {name!r} of {size} bytes")
        fd = os.open(path, _DIRECTORY_FLAGS)
        try:
            directory = _data_directory(fd)
        finally:
            os.close(fd)
        base = name.removeprefix(f"{DATA_DIR}/")
        try:
            out = None if take is None else take(directory, base, size)
            if out is None:
                out = os.open(base, _MAP_FLAGS, 0o600, dir_fd=directory)
        finally:
            os.close(directory)
        try:
            os.ftruncate(out, size)  # a spare may be longer, a new file is empty
            os.posix_fallocate(out, 0, size)
            self._map: mmap.mmap | None = mmap.mmap(
                out, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(out)

    @property
    def buffer(self) -> mmap.mmap:
        assert self._map is not None, "closed"
        return self._map

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # still exported after a failed transfer
                self._map.close()
            self._map = None


class RecyclingStorage(LocalStorage):
    """The storage a local save writes its part through (the directory ``root``): a data file
    is put in place from a spare when ``take`` gives one, written over and truncated where
    the writes end (:meth:`LocalStorage.create_file`); every other file is new."""

    def __init__(self, root: str, take: Take) -> None:
        super().__init__(root)
        self._take = take

    def create_file(self, path: str) -> tuple[int, bool]:
        directory, name = os.path.split(path)
        if is_data_file_name(name) or is_temporary_name(name):
            parent = os.open(directory, _DIRECTORY_FLAGS)
            try:
                fd = self._take(parent, name, None)
            finally:
                os.close(parent)
            if fd is not None:
                return fd, True
        return super().create_file(path)


def write_part(path: str, files: Mapping[str, bytes | memoryview], *, sync: bool = False) -> None:
    """Write a part's ``files`` into the (new, empty) directory ``path``.

    Raises:
        ValueError: A name that is no part file.
        OSError: Writing failed, or a file is there already.
    """
    if not all(_is_part_file(name) for name in files):
        raise ValueError(f"not the files of a part: {sorted(files)}")
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        for name, data in files.items():
            parent = fd
            if name != INDEX_NAME:
                parent = _data_directory(fd)
            try:
                out = os.open(os.path.basename(name), _CREATE_FLAGS, 0o600, dir_fd=parent)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view) :]
                    if sync:
                        os.fsync(out)
                finally:
                    os.close(out)
            finally:
                if parent != fd:
                    os.close(parent)
    finally:
        os.close(fd)


def link_part(source: str, target: str, rank: int, save_id: str) -> bytes:
    """Put saved rank ``rank``'s data file of the part in directory ``source`` into directory
    ``target``'s ``data/`` (a hard link: no copy; a copy where the two are on different file
    systems), if the part has one; the part's index.

    Raises:
        OSError: A file is missing, a link or not a regular file, or cannot be linked.
    """
    name = data_file_name(rank, save_id).removeprefix(f"{DATA_DIR}/")
    source_fd = os.open(source, _DIRECTORY_FLAGS)
    try:
        index = _read_file(source_fd, INDEX_NAME, MAX_INDEX_BYTES)
        try:
            data_fd = os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=source_fd)
        except FileNotFoundError:
            return index
        try:
            status = os.stat(name, dir_fd=data_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(data_fd)
            return index
        target_fd = os.open(target, _DIRECTORY_FLAGS)
        try:
            into = _data_directory(target_fd)
            try:
                if not stat.S_ISREG(status.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file", name)
                try:
                    os.link(name, name, src_dir_fd=data_fd, dst_dir_fd=into, follow_symlinks=False)
                except OSError as err:
                    if err.errno != errno.EXDEV:
                        raise
                    data = _read_file(data_fd, name, None)
                    write_part(target, {f"{DATA_DIR}/{name}": data})
            finally:
                os.close(into)
        finally:
            os.close(target_fd)
            os.close(data_fd)
        return index
    finally:
        os.close(source_fd)


def _index_problem(
    data: bytes, rank: int, save_id: str, world_size: int
) -> tuple[Index | None, str | None]:
    """The index of saved rank ``rank``'s part of save ``save_id``, or why ``data`` is not."""
    try:
        index = decode_index(data)
    except (CheckpointError, ValueError, RecursionError) as err:
        return None, f"its index does not decode ({err})"
    if index.save.save_id != save_id or index.save.world_size != world_size:
        return None, (
            f"its index is of save {index.save.save_id} by {index.save.world_size} ranks, not "
            f"{save_id} by {world_size}"
        )
    return index, None


def verify_pieces(
    pieces: Sequence[tuple[int, bytes | bytearray | memoryview]], name: str, index: Index
) -> str | None:
    """Why the ``pieces`` (from another rank: untrusted; ``(begin, bytes)``) are not bytes of
    the data file ``name`` of the save of ``index``: a name it does not list, a piece outside
    the file or not of whole blocks, or a block whose checksum is wrong; None when they are."""
    if name not in index.files:
        return f"its index names no data file {name}"
    size, start, block = index.files[name], index.data_starts[name], index.block_size
    for begin, data in pieces:
        view = memoryview(data).cast("B")
        end = begin + len(view)
        if not start <= begin < end <= size:  # blocks are the data section's
            return (
                f"bytes [{begin}, {end}) of its data file {name} are outside its data section "
                f"[{start}, {size})"
            )
        if not block:
            return f"its data file {name} has no block checksums"
        first, sums = index.blocks_of(name, begin, end)
        if first != begin or (end != size and (end - start) % block):
            return f"bytes [{begin}, {end}) of its data file {name} are not whole blocks"
        if block_checksums(view, block) != "".join(sums):
            return _FAILS.format(name)
    return None


# Blocks checked per read by check_stored_part: one buffer, reused (reading a 300 MiB part into
# new memory first took four times as long as checking it through this buffer).
_CHECK_BLOCKS = 16


def check_stored_part(
    path: str, rank: int, save_id: str, world_size: int, *, blocks: bool = True
) -> str | None:
    """Why the part in the directory ``path`` is not saved rank ``rank``'s part of save
    ``save_id`` by ``world_size`` ranks (its index decodes and is of that save; its data
    file is there exactly when the index names it, of its size, and, with ``blocks``, every
    block's checksum right: checked as it is read, a few blocks at a time, never held
    whole); None when it is. Without ``blocks`` nothing of the data file is read: for a part
    whose blocks a load checks as it reads them.

    Raises:
        OSError: A file cannot be opened or read (a link, not a regular file, I/O).
    """
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        index, problem = _index_problem(
            _read_file(fd, INDEX_NAME, MAX_INDEX_BYTES), rank, save_id, world_size
        )
        if index is None:
            return problem
        name = data_file_name(rank, save_id)
        data_fd = _open_data_file(fd, name)
    finally:
        os.close(fd)
    if data_fd is None:
        return None if name not in index.files else f"its data file {name} is missing"
    try:
        if name not in index.files:
            return "it holds a data file its index does not name"
        return _check_data_file(data_fd, name, index, blocks)
    finally:
        os.close(data_fd)


def _check_data_file(fd: int, name: str, index: Index, blocks: bool) -> str | None:
    size, start = index.files[name], index.data_starts[name]
    actual = os.fstat(fd).st_size
    if actual != size:
        return f"its data file {name} is {actual} bytes, not {size}"
    if not 0 <= start <= size:  # the decoder checks this; a part is read from disk anyway
        return f"its data file {name} has its data start {start} outside its {size} bytes"
    if not blocks:
        return None
    block, expected = index.block_size, index.file_checksums[name]
    if start == size:  # no data: the checksum of nothing
        return None if block_checksums(b"", block) == expected else _FAILS.format(name)
    buffer = memoryview(bytearray(block * _CHECK_BLOCKS))
    position, checked = start, 0  # checked: checksum characters compared so far
    while position < size:
        piece = buffer[: min(len(buffer), size - position)]
        if not _read_exactly(fd, piece, position):
            return f"its data file {name} ends before {size} bytes"
        sums = block_checksums(piece, block)
        if expected[checked : checked + len(sums)] != sums:
            return _FAILS.format(name)
        checked += len(sums)
        position += len(piece)
    return None if checked == len(expected) else _FAILS.format(name)


_FAILS = "its data file {} fails its block checksums"


class _MemoryReader:
    """A data file of ``size`` bytes received from another rank as ``pieces`` (``(begin,
    bytes)``, in order, disjoint), read from the memory they came in: only their bytes (the
    blocks the load reads), anything else is a :class:`CheckpointDataError`."""

    def __init__(self, path: str, size: int, pieces: Sequence[tuple[int, memoryview]]) -> None:
        self.path = path
        self.size = size
        self._pieces = sorted(pieces, key=lambda piece: piece[0])
        self._begins = [begin for begin, _ in self._pieces]

    @property
    def identity(self) -> object:
        return ("received", id(self))

    def read_into(self, offset: int, buffer: memoryview) -> int:
        total, wanted = 0, min(len(buffer), max(0, self.size - offset))
        while total < wanted:
            at = offset + total
            number = bisect.bisect_right(self._begins, at) - 1
            begin, data = self._pieces[number] if number >= 0 else (0, memoryview(b""))
            if not begin <= at < begin + len(data):
                raise CheckpointDataError(
                    f"byte {at} of {self.path} was not received (only the blocks this rank's "
                    "load was planned to read were)"
                )
            count = min(wanted - total, begin + len(data) - at)
            buffer[total : total + count] = data[at - begin : at - begin + count]
            total += count
        return total

    def read_vector(self, offset: int, buffers: Sequence[memoryview]) -> int:
        total = 0
        for buffer in buffers:
            count = self.read_into(offset + total, buffer)
            total += count
            if count < len(buffer):
                break
        return total

    def close(self) -> None:
        return None


class ReceivedParts(LocalStorage):
    """A restore directory (its index, the node's parts hard-linked into ``data/``) whose
    ``received`` data files (``data/...`` name: the pieces received, ``(begin, bytes)``) are
    read from memory: writing them into ``/dev/shm`` first, to read them back once, cost more
    than the load. Their sizes are ``index``'s."""

    def __init__(
        self, root: str, index: Index, received: Mapping[str, Sequence[tuple[int, memoryview]]]
    ) -> None:
        super().__init__(root)
        self._received = {
            self.join(name): (index.files[name], pieces) for name, pieces in received.items()
        }

    def open_reader(self, path: str) -> Reader:
        found = self._received.get(path)
        if found is not None:
            return _MemoryReader(path, *found)
        return super().open_reader(path)
