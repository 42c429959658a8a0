"""A part of a local save as bytes: its files read from and written to its directory, packed
into one message for another rank, and verified against its index (``docs/local-tier.md``).

A part is a directory holding what :func:`~shardwise.checkpoint.saving.save.save_parts` wrote
for one saved rank: the index of the whole save (``shardwise.json``) and, when that rank
wrote anything, its data file (``data/rank-<R>.<save id>.safetensors``). The part's
``part.json`` (:mod:`.directory`) is not part of it: each holder writes its own.

A packed part, as sent between ranks::

    8 bytes: N, little-endian    N bytes: JSON [[name, size], ...]    the files' bytes, in order

Packing, unpacking and verifying are pure (bytes in, bytes out); reading and writing go
through descriptors with ``O_NOFOLLOW``, as everything in the tier's directory does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Mapping, Sequence

from shardwise._codec import strict_json
from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    Index,
    block_checksums,
    data_file_name,
    decode_index,
)
from shardwise.checkpoint.index.names import is_data_file_name
from shardwise.checkpoint.local_tier.directory import (  # the tier's one set of open flags
    _CREATE_FLAGS,
    _DIRECTORY_FLAGS,
    _READ_FLAGS,
)
from shardwise.checkpoint.storage import LocalStorage, Reader
from shardwise.errors import CheckpointError

__all__ = [
    "index_of",
    "link_part",
    "check_stored_part",
    "pack_part",
    "read_index",
    "read_packed_part",
    "read_part",
    "ReceivedParts",
    "unpack_part",
    "verify_part",
    "write_part",
]

# A packed part's header lists at most two files, a few hundred bytes.
_MAX_HEADER = 4096


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


def read_part(path: str, rank: int, save_id: str) -> dict[str, bytes]:
    """The files of saved rank ``rank``'s part of save ``save_id`` in the directory ``path``:
    its index, and its data file when the directory holds one.

    Raises:
        OSError: A file is missing, a link or not a regular file, or cannot be read.
    """
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        files = {INDEX_NAME: _read_file(fd, INDEX_NAME, MAX_INDEX_BYTES)}
        try:
            data_fd = os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return files
        try:
            name = data_file_name(rank, save_id)
            with contextlib.suppress(FileNotFoundError):
                files[name] = _read_file(data_fd, name.removeprefix(f"{DATA_DIR}/"), None)
        finally:
            os.close(data_fd)
        return files
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


def _read_exactly(fd: int, view: memoryview, offset: int, name: str) -> bool:
    """Fill ``view`` from byte ``offset`` of ``fd``; False if the file ends first."""
    done = 0
    while done < len(view):
        moved = os.preadv(fd, [view[done:]], offset + done)
        if moved == 0:
            return False
        done += moved
    return True


def read_packed_part(path: str, rank: int, save_id: str) -> bytearray:
    """``pack_part(read_part(path, rank, save_id))``, read straight into the message: one
    buffer, no copy of the data file in between (on this project's machines, each fresh
    300 MiB copy cost about a second).

    Raises:
        OSError: As :func:`read_part`.
    """
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        index = _read_file(fd, INDEX_NAME, MAX_INDEX_BYTES)
        name = data_file_name(rank, save_id)
        data_fd = _open_data_file(fd, name)
    finally:
        os.close(fd)
    try:
        listed: list[list[object]] = [[INDEX_NAME, len(index)]]
        size = 0 if data_fd is None else os.fstat(data_fd).st_size
        if data_fd is not None:
            listed.append([name, size])
        header = json.dumps(listed).encode()
        start = 8 + len(header) + len(index)
        message = bytearray(start + size)
        message[:8] = len(header).to_bytes(8, "little")
        message[8 : 8 + len(header)] = header
        message[8 + len(header) : start] = index
        if data_fd is not None and not _read_exactly(data_fd, memoryview(message)[start:], 0, name):
            raise OSError(errno.EIO, "shorter than its size", name)
        return message
    finally:
        if data_fd is not None:
            os.close(data_fd)


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
                with contextlib.suppress(FileExistsError):
                    os.mkdir(DATA_DIR, 0o700, dir_fd=fd)
                parent = os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=fd)
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
            with contextlib.suppress(FileExistsError):
                os.mkdir(DATA_DIR, 0o700, dir_fd=target_fd)
            into = os.open(DATA_DIR, _DIRECTORY_FLAGS, dir_fd=target_fd)
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


def pack_part(files: Mapping[str, bytes]) -> bytes:
    """One message of a part's ``files`` (module docstring)."""
    header = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return b"".join([len(header).to_bytes(8, "little"), header, *files.values()])


def unpack_part(message: bytes | bytearray | memoryview) -> dict[str, bytes | memoryview]:
    """The files of a packed part (from another rank: untrusted).

    Raises:
        CheckpointError: It is not a packed part (sizes that do not add up, names that are no
            part file, the index missing or twice).
    """
    view = memoryview(message).cast("B")
    if len(view) < 8:
        raise CheckpointError(f"a packed part of {len(view)} bytes has no header")
    length = int.from_bytes(view[:8], "little")
    if length > min(_MAX_HEADER, len(view) - 8):
        raise CheckpointError(f"a packed part's header of {length} bytes does not fit")
    try:
        listed = strict_json(bytes(view[8 : 8 + length]), "a packed part's header")
    except ValueError as err:
        raise CheckpointError(f"a packed part's header does not read: {err}") from err
    if not isinstance(listed, list) or not all(
        isinstance(entry, list)
        and len(entry) == 2
        and _is_part_file(entry[0])
        and type(entry[1]) is int
        and entry[1] >= 0
        for entry in listed
    ):
        raise CheckpointError("a packed part's header is not a list of [part file, size]")
    names = [entry[0] for entry in listed]
    if len(set(names)) != len(names) or INDEX_NAME not in names or len(names) > 2:
        raise CheckpointError(f"a packed part holds {names}, not an index and one data file")
    position = 8 + length
    if position + sum(entry[1] for entry in listed) != len(view):
        raise CheckpointError("a packed part's sizes do not add up to its length")
    files: dict[str, bytes | memoryview] = {}
    for name, size in listed:
        piece = view[position : position + size]
        # The index as bytes (small, compared and kept); the data file a view of the message.
        files[name] = bytes(piece) if name == INDEX_NAME else piece
        position += size
    return files


def index_of(files: Mapping[str, bytes]) -> bytes:
    """The index of a part's ``files``."""
    return files[INDEX_NAME]


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


def verify_part(
    files: Mapping[str, bytes | memoryview], rank: int, save_id: str, world_size: int
) -> str | None:
    """Why the ``files`` of saved rank ``rank``'s part of save ``save_id`` (by
    ``world_size`` ranks) are not that part, checked against their own index (the index
    decodes and is of that save; the data file is there exactly when the index names it, of
    its size, every block's checksum right); None when they are."""
    if set(files) - {INDEX_NAME, data_file_name(rank, save_id)} or INDEX_NAME not in files:
        return f"holds {sorted(files)}"
    index, problem = _index_problem(bytes(files[INDEX_NAME]), rank, save_id, world_size)
    if index is None:
        return problem
    name = data_file_name(rank, save_id)
    data = files.get(name)
    if name not in index.files:
        return None if data is None else "it holds a data file its index does not name"
    if data is None:
        return f"its data file {name} is missing"
    if len(data) != index.files[name]:
        return f"its data file {name} is {len(data)} bytes, not {index.files[name]}"
    start = index.data_starts[name]
    if block_checksums(memoryview(data)[start:], index.block_size) != index.file_checksums[name]:
        return f"its data file {name} fails its block checksums"
    return None


# Blocks checked per read by check_stored_part: one buffer, reused (reading a 300 MiB part into
# new memory first took four times as long as checking it through this buffer).
_CHECK_BLOCKS = 16


def check_stored_part(path: str, rank: int, save_id: str, world_size: int) -> str | None:
    """:func:`verify_part` of the part in the directory ``path``, its data file checked as
    it is read, a few blocks at a time, never held whole.

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
        return _check_data_file(data_fd, name, index)
    finally:
        os.close(data_fd)


def _check_data_file(fd: int, name: str, index: Index) -> str | None:
    size, start = index.files[name], index.data_starts[name]
    actual = os.fstat(fd).st_size
    if actual != size:
        return f"its data file {name} is {actual} bytes, not {size}"
    if not 0 <= start <= size:  # the decoder checks this; a part is read from disk anyway
        return f"its data file {name} has its data start {start} outside its {size} bytes"
    block, expected = index.block_size, index.file_checksums[name]
    if start == size:  # no data: the checksum of nothing
        return None if block_checksums(b"", block) == expected else _FAILS.format(name)
    buffer = memoryview(bytearray(block * _CHECK_BLOCKS))
    position, checked = start, 0  # checked: checksum characters compared so far
    while position < size:
        piece = buffer[: min(len(buffer), size - position)]
        if not _read_exactly(fd, piece, position, name):
            return f"its data file {name} ends before {size} bytes"
        sums = block_checksums(piece, block)
        if expected[checked : checked + len(sums)] != sums:
            return _FAILS.format(name)
        checked += len(sums)
        position += len(piece)
    return None if checked == len(expected) else _FAILS.format(name)


_FAILS = "its data file {} fails its block checksums"


class _MemoryReader:
    """A data file received from another rank, read from the message it came in."""

    def __init__(self, path: str, data: memoryview) -> None:
        self.path = path
        self.size = len(data)
        self._data = data

    @property
    def identity(self) -> object:
        return ("received", id(self._data))

    def read_into(self, offset: int, buffer: memoryview) -> int:
        count = max(0, min(len(buffer), self.size - offset))
        buffer[:count] = self._data[offset : offset + count]
        return count

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
    ``received`` data files (``data/...`` name: the bytes, verified) are read from memory:
    writing them into ``/dev/shm`` first, to read them back once, cost more than the load."""

    def __init__(self, root: str, received: Mapping[str, memoryview]) -> None:
        super().__init__(root)
        self._received = {self.join(name): view for name, view in received.items()}

    def open_reader(self, path: str) -> Reader:
        view = self._received.get(path)
        if view is not None:
            return _MemoryReader(path, view)
        return super().open_reader(path)
