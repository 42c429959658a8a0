"""The local backend: a directory, never followed through a symbolic link below its root.

Directories below the root must be real and files read must be regular (opened ``O_NOFOLLOW``),
else :class:`UnsafePathError`. The root itself may be a link: the caller chose that path.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence

from shardwise.checkpoint.storage._protocol import (
    Finish,
    RangeRequest,
    Reader,
    UnsafePathError,
    Writer,
)
from shardwise.checkpoint.storage._threads import run_concurrently

__all__ = ["LocalStorage", "PartWriter"]

logger = logging.getLogger(__name__)

# Tries of LocalStorage._place_aside (another save's cleanup may remove what it wrote aside).
_ASIDE_ATTEMPTS = 5
# O_NONBLOCK keeps the open of a FIFO from waiting for a writer (it is refused right after,
# unread); O_NOCTTY keeps a terminal from becoming this process's.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# Every file written is created by the open (O_CREAT | O_EXCL: never an existing entry, so
# never a file outside through a hard link or a symbolic link put at its name; O_NOFOLLOW for
# good measure): see _create.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Reopening a file another process created (PartWriter): never a link, and never waiting on a
# FIFO put in its place (refused right after, unwritten).
_REOPEN_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Buffers one preadv or writev takes at most (the kernel refuses more: EINVAL).
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
# What a directory entry is, in words, for the errors of open_below.
_FILE_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _vectored(views: list[memoryview], transfer: Callable[[list[memoryview], int], int]) -> int:
    """``transfer(buffers, done)`` on at most IOV_MAX of ``views`` at a time, resumed where a short
    one stopped, until all are done or one moves 0 bytes; the count moved (``done`` at the end)."""
    total = 0
    first = 0
    while first < len(views):
        count = transfer(views[first : first + _IOV_MAX], total)
        if count == 0:
            break
        total += count
        while first < len(views) and count >= len(views[first]):
            count -= len(views[first])
            first += 1
        if count:  # a short transfer stopped inside this view
            views[first] = views[first][count:]
    return total


def _create(path: str) -> int:
    """A new file at ``path``, opened for writing: the one way this backend opens a file to
    write into it from scratch. An entry already there (a stale file, or a link someone put at
    the name, hard or symbolic, to a file elsewhere) is ``FileExistsError``, never opened and
    so never written through; a caller that may meet its own stale file removes it first
    (``remove`` unlinks the name, never what a link points at)."""
    return os.open(path, _CREATE_FLAGS, 0o644)


def _reopen(path: str) -> int:
    """The file at ``path`` that another process of the same write created (with
    :func:`_create`), opened for writing: a regular file with no other name. A link, FIFO or
    device there is refused unopened; a file with other names (a hard link put in place of
    the one created, to a file elsewhere) is refused unwritten."""
    before = os.lstat(path)
    _refuse_unless(before.st_mode, path, directory=False)
    fd = os.open(path, _REOPEN_FLAGS)
    try:
        opened = os.fstat(fd)
        _refuse_unless(opened.st_mode, path, directory=False)
        if opened.st_nlink != 1 or not os.path.samestat(before, opened):
            raise UnsafePathError(
                errno.EMLINK,
                f"it has {opened.st_nlink} names (a hard link to a file elsewhere?) or changed "
                "while opened",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


class _LocalWriter:
    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        # A writer only ever writes a name it created.
        self._fd, self._recycled = storage.create_file(path)
        self._written = 0

    def write(self, data: memoryview | bytes | bytearray) -> None:
        self.write_vector([data])

    def write_vector(self, parts: Sequence[memoryview | bytes | bytearray]) -> None:
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        expected = sum(map(len, views))
        if _vectored(views, lambda buffers, _: os.writev(self._fd, buffers)) < expected:
            raise OSError(errno.EIO, "writev wrote nothing", self._path)
        self._written += expected

    def close(self, sync: bool) -> None:
        try:
            if self._recycled:  # it ends where the writes did (it may have held more)
                os.ftruncate(self._fd, self._written)
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        try:
            os.close(self._fd)
            self._storage.remove(self._path)
        except OSError as err:  # left for the next save's cleanup
            logger.warning("could not remove %s after a failed write: %s", self._path, err)


class PartWriter:
    """A local file written in parts at given offsets, by several processes at once (each its
    own bytes): the bytes of a Hugging Face weight file come from every rank holding a part."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def write_at(self, offset: int, parts: Sequence[memoryview | bytes | bytearray]) -> None:
        """Write ``parts`` in order from byte ``offset`` (one ``pwritev``)."""
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        expected = sum(map(len, views))
        moved = _vectored(views, lambda buffers, done: os.pwritev(self._fd, buffers, offset + done))
        if moved < expected:
            raise OSError(errno.EIO, "pwritev wrote nothing", self.path)

    def close(self, sync: bool) -> None:
        """Close the file; with ``sync``, make what this process wrote durable first."""
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)


class _LocalReader:
    """A regular file opened for positioned reads; the reader owns the descriptor."""

    def __init__(self, path: str, fd: int, status: os.stat_result) -> None:
        self.path = path
        self._fd = fd
        self.size = status.st_size
        self.identity = (status.st_dev, status.st_ino)

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return self._preadv(offset, [buffer])

    def read_vector(self, offset: int, buffers: Sequence[memoryview]) -> int:
        return self._preadv(offset, buffers)

    # preadv takes the offset explicitly, so threads can share the descriptor.
    def _preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        views = [buffer.cast("B") for buffer in buffers]
        return _vectored(views, lambda part, done: os.preadv(self._fd, part, offset + done))

    def close(self) -> None:
        os.close(self._fd)


def _open_file(path: str) -> _LocalReader:
    """The regular file ``path`` opened for reading; a link or special file is refused unopened."""
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise UnsafePathError(errno.EINVAL, "it is a link, FIFO, device or directory", path)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(errno.ELOOP, "it is a symbolic link", path) from err
        raise
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or not os.path.samestat(before, opened):
        os.close(fd)
        raise UnsafePathError(errno.EINVAL, "it changed into a non-regular file", path)
    return _LocalReader(path, fd, opened)


def _refuse_unless(mode: int, path: str, *, directory: bool) -> None:
    """Raise :class:`UnsafePathError` unless ``mode`` is a directory's (or a regular file's)."""
    if stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode):
        return
    found = next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "a special file")
    err = UnsafePathError(
        errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL, f"it is {found}", path
    )
    err.found, err.expected = found, "a directory" if directory else "a regular file"
    raise err


def _open_in(parent: int, name: str, path: str, *, directory: bool) -> int:
    """Open ``name`` in the directory ``parent`` without following a symbolic link: the lstat
    refuses a link, FIFO or device unopened (opening some devices has effects); the fstat of what
    was opened is the check that counts, since the entry may have been replaced in between."""
    _refuse_unless(
        os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode, path, directory=directory
    )
    flags = _DIRECTORY_FLAGS | os.O_NOFOLLOW if directory else _READ_FLAGS
    fd = os.open(name, flags, dir_fd=parent)
    try:
        _refuse_unless(os.fstat(fd).st_mode, path, directory=directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_real_directory(path: str) -> None:
    """Raise :class:`UnsafePathError` if ``path`` exists but is not a real directory."""
    if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
        raise UnsafePathError(errno.ENOTDIR, "not a real directory (a link?)", path)


class LocalStorage:
    """A directory on a local (or mounted shared) file system."""

    process_local = False
    atomic_rename = True
    remote = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def url(self, path: str) -> str:
        return path

    def parent(self) -> LocalStorage:
        absolute = os.path.abspath(self.root)
        if os.path.dirname(absolute) == absolute:
            raise ValueError(f"{self.root} has no parent directory")
        return LocalStorage(os.path.dirname(absolute))

    def _check_parents(self, path: str) -> None:
        """Check that every directory between the root and ``path`` is real."""
        relative = os.path.relpath(path, self.root)
        parts = relative.split(os.sep)
        if relative == os.curdir:
            return
        if os.pardir in parts or os.path.isabs(relative):
            raise UnsafePathError(errno.EINVAL, "outside the checkpoint", path)
        current = self.root
        for part in parts[:-1]:
            current = os.path.join(current, part)
            _check_real_directory(current)

    def check_directory(self, path: str) -> None:
        """Raise :class:`UnsafePathError` if ``path`` exists but is not a real directory."""
        self._check_parents(path)
        _check_real_directory(path)

    def exists(self, path: str) -> bool:
        self._check_parents(path)  # no link below the root is followed, even to look
        return os.path.lexists(path)

    def size(self, path: str) -> int:
        self._check_parents(path)
        return os.lstat(path).st_size

    def makedirs(self, path: str) -> None:
        # Checked first too: a file or link in its place is unsafe, not "already there".
        self.check_directory(path)
        os.makedirs(path, exist_ok=True)
        self.check_directory(path)

    def open_write(self, path: str) -> Writer:
        self._check_parents(path)
        return _LocalWriter(self, path)

    def create_file(self, path: str) -> tuple[int, bool]:
        """A descriptor of a new file at ``path``, open for writing from its start (what
        :meth:`open_write` writes through), and whether it is recycled: :func:`_create`'s,
        never. A subclass may hand out a file it recycles instead (the local tier's spares),
        put at ``path`` the same way (never over an existing entry), regular, of one name:
        its old bytes are written over, and the writer truncates it where its writes end."""
        return _create(path), False

    def open_parts(self, path: str, size: int | None = None) -> PartWriter:
        """``path`` for writes in parts: created (never an existing entry: ``FileExistsError``)
        with ``size`` bytes when ``size`` is given, else the file another process created so,
        reopened (:func:`_reopen`: ``UnsafePathError`` for a link, a special file, or a file
        with other names)."""
        self._check_parents(path)
        if size is None:
            return PartWriter(path, _reopen(path))
        fd = _create(path)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return PartWriter(path, fd)

    def read_ranges(
        self, requests: Sequence[RangeRequest], then: Finish | None = None
    ) -> list[int]:
        def read(number: int) -> int:
            request = requests[number]
            buffer = request.buffer
            if buffer is None:  # made on the reading thread (see RangeRequest)
                buffer = memoryview(bytearray(request.length))
            try:
                count = request.reader.read_into(request.offset, buffer)
            except OSError as err:
                if err.filename is None:
                    err.filename = request.reader.path
                raise
            if then is not None:
                then(number, buffer[:count])
            return count

        return run_concurrently(range(len(requests)), lambda n: requests[n].length, read)

    def open_reader(self, path: str) -> Reader:
        self._check_parents(path)
        return _open_file(path)

    def open_below(self, relative: str) -> Reader:
        parts = relative.split("/")
        # The root may be reached through links (the caller chose it); nothing below it is.
        current = os.open(self.root, _DIRECTORY_FLAGS)
        try:
            for number, part in enumerate(parts):
                path = self.join(*parts[: number + 1])
                opened = _open_in(current, part, path, directory=number < len(parts) - 1)
                current, parent = opened, current
                os.close(parent)
            status = os.fstat(current)
        except BaseException:
            os.close(current)
            raise
        return _LocalReader(self.join(relative), current, status)

    def rename(self, source: str, target: str) -> None:
        self._check_parents(source)
        self._check_parents(target)
        # os.replace swaps the name: a link at ``target`` is replaced, never followed.
        os.replace(source, target)

    def remove(self, path: str) -> None:
        self._check_parents(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_directory(self, path: str) -> None:
        """Remove the empty directory ``path`` (OSError if it is not empty)."""
        self.check_directory(path)
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        self.check_directory(path)
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def _place_aside(self, path: str, data: bytes, place: Callable[[str], None]) -> None:
        """Write ``data`` beside ``path`` (a name unique to this thread), then ``place`` it; written
        again if the save holding the lock removed it first as a leftover (FileNotFoundError)."""
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        for attempt in range(_ASIDE_ATTEMPTS):
            self.remove(temporary)
            writer = self.open_write(temporary)
            try:
                writer.write(data)
            finally:
                writer.close(sync=False)
            try:
                place(temporary)
                return
            except FileNotFoundError:
                if attempt + 1 == _ASIDE_ATTEMPTS:
                    raise
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # Linked in whole (no reader sees it without its content); link() fails if the name exists.
        try:
            self._place_aside(path, data, lambda aside: os.link(aside, path, follow_symlinks=False))
        except FileExistsError:
            return False
        return True

    def replace_small(self, path: str, data: bytes) -> None:
        self._place_aside(path, data, lambda aside: self.rename(aside, path))

    def read_small(self, path: str, limit: int) -> bytes:
        reader = self.open_reader(path)
        try:
            if reader.size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
            data = bytearray(reader.size)
            return bytes(data[: reader.read_into(0, memoryview(data))])
        finally:
            reader.close()

    def sync_dir(self, path: str) -> None:
        self._check_parents(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
