"""Where checkpoint bytes live: a small storage protocol with a local and an fsspec backend.

This is the only module of shardwise that touches files. Paths are plain ``str`` joined with
``/`` so that URLs (``s3://bucket/ckpt``, ``memory://ckpt``) survive untouched. Local paths
need no fsspec; a URL needs the ``fsspec`` package (extra ``remote``).

Below the root, the local backend never follows a symbolic link: every directory between the
root and a file must be a real directory (``lstat``), files are opened with ``O_NOFOLLOW`` (and
``O_NONBLOCK``, so a FIFO cannot block an open), and a file opened for reading must be a regular
file (``fstat``). Anything else raises :class:`UnsafePathError`. The root itself may be a link:
the caller chose that path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from typing import Any, Protocol

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "Reader",
    "Storage",
    "UnsafePathError",
    "Writer",
    "open_shared_storage",
    "open_storage",
]


class UnsafePathError(OSError):
    """A path below the storage root is a symbolic link, or not the regular file or directory
    it should be."""


class Writer(Protocol):
    """A file being written sequentially."""

    def write(self, data: memoryview | bytes | bytearray) -> None:
        """Append ``data``."""

    def close(self, sync: bool) -> None:
        """Finish the file; with ``sync``, make it durable (fsync) first."""


class Reader(Protocol):
    """A regular file opened for positioned reads (safe to share between threads)."""

    #: The file's size in bytes when it was opened.
    size: int

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns the count read."""

    def close(self) -> None:
        """Release the file."""


class Storage(Protocol):
    """The operations the checkpoint layer needs from a file system."""

    root: str
    #: Whether only this process sees the files (``memory://``): no use to a group.
    process_local: bool

    def join(self, *parts: str) -> str:
        """``root`` joined with ``parts``."""

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""

    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes."""

    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no error if it exists)."""

    def open_write(self, path: str) -> Writer:
        """Open ``path`` for writing from scratch."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns the count read."""

    def open_reader(self, path: str) -> Reader:
        """Open the regular file ``path`` for many positioned reads.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            UnsafePathError: ``path`` or a directory on the way is a link or not a regular
                file (directory).
        """

    def rename(self, source: str, target: str) -> None:
        """Atomically replace ``target`` by ``source`` where the backend can."""

    def remove(self, path: str) -> None:
        """Delete the file ``path`` (no error if it is gone); a link is removed, not followed."""

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of directory ``path``; empty if it is missing."""

    def check_directory(self, path: str) -> None:
        """Raise :class:`UnsafePathError` if ``path`` exists but is not a real directory."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create the file ``path`` holding ``data`` unless it exists (then return False)."""

    def replace_small(self, path: str, data: bytes) -> None:
        """Atomically replace the small file ``path`` by one holding ``data``."""

    def read_small(self, path: str, limit: int) -> bytes:
        """The file ``path`` (a regular file of at most ``limit`` bytes, else OSError)."""

    def sync_dir(self, path: str) -> None:
        """Make renames and creations inside directory ``path`` durable."""


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _LocalWriter:
    def __init__(self, path: str) -> None:
        # O_EXCL: a writer only ever creates a fresh (temporary) name; never an existing file.
        self._fd = os.open(path, _WRITE_FLAGS, 0o644)

    def write(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self, sync: bool) -> None:
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)


def _pread_into(fd: int, offset: int, buffer: memoryview) -> int:
    view = buffer.cast("B")
    total = 0
    while total < len(view):
        count = os.preadv(fd, [view[total:]], offset + total)
        if count == 0:
            break
        total += count
    return total


class _LocalReader:
    def __init__(self, path: str) -> None:
        self.path = path
        # lstat first: a link or special file is refused without being opened at all.
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            raise UnsafePathError(errno.EINVAL, "it is a link, FIFO, device or directory", path)
        try:
            self._fd = os.open(path, _READ_FLAGS)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UnsafePathError(errno.ELOOP, "it is a symbolic link", path) from err
            raise
        opened = os.fstat(self._fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (
            before.st_dev,
            before.st_ino,
        ):
            os.close(self._fd)
            raise UnsafePathError(errno.EINVAL, "it changed into a non-regular file", path)
        self.size = opened.st_size

    def read_into(self, offset: int, buffer: memoryview) -> int:
        # preadv takes the offset explicitly, so threads can share the descriptor.
        return _pread_into(self._fd, offset, buffer)

    def close(self) -> None:
        os.close(self._fd)


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a link (False when it does not exist)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


class LocalStorage:
    """A directory on a local (or mounted shared) file system."""

    process_local = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _check_parents(self, path: str) -> None:
        """Every directory between the root and ``path`` is real (no link is followed)."""
        relative = os.path.relpath(path, self.root)
        parts = relative.split(os.sep)
        if relative == os.curdir:
            return
        if os.pardir in parts or os.path.isabs(relative):
            raise UnsafePathError(errno.EINVAL, "outside the checkpoint", path)
        current = self.root
        for part in parts[:-1]:
            current = os.path.join(current, part)
            if os.path.lexists(current) and not _real_directory(current):
                raise UnsafePathError(errno.ENOTDIR, "not a real directory (a link?)", current)

    def check_directory(self, path: str) -> None:
        self._check_parents(path)
        if os.path.lexists(path) and not _real_directory(path):
            raise UnsafePathError(errno.ENOTDIR, "not a real directory (a link?)", path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def size(self, path: str) -> int:
        return os.lstat(path).st_size

    def makedirs(self, path: str) -> None:
        # Checked first too: a file or link in its place is unsafe, not "already there".
        self.check_directory(path)
        os.makedirs(path, exist_ok=True)
        self.check_directory(path)

    def open_write(self, path: str) -> Writer:
        self._check_parents(path)
        return _LocalWriter(path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        reader = self.open_reader(path)
        try:
            return reader.read_into(offset, buffer)
        finally:
            reader.close()

    def open_reader(self, path: str) -> Reader:
        self._check_parents(path)
        return _LocalReader(path)

    def read(self, path: str) -> bytes:
        reader = self.open_reader(path)
        try:
            data = bytearray(reader.size)
            count = reader.read_into(0, memoryview(data))
            return bytes(data[:count])
        finally:
            reader.close()

    def rename(self, source: str, target: str) -> None:
        self._check_parents(source)
        self._check_parents(target)
        # os.replace swaps the name: a link at ``target`` is replaced, never followed.
        os.replace(source, target)

    def remove(self, path: str) -> None:
        self._check_parents(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        self.check_directory(path)
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def _written_aside(self, path: str, data: bytes) -> str:
        """A new file beside ``path`` (a name unique to this thread) holding ``data``."""
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        self.remove(temporary)
        writer = self.open_write(temporary)
        try:
            writer.write(data)
        finally:
            writer.close(sync=False)
        return temporary

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # Written in full under a unique name, then linked into place: link() fails if the
        # name exists, so no reader ever sees the file without its content.
        temporary = self._written_aside(path, data)
        try:
            os.link(temporary, path, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)
        return True

    def replace_small(self, path: str, data: bytes) -> None:
        self.rename(self._written_aside(path, data), path)

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
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _FsspecWriter:
    def __init__(self, fs: Any, path: str) -> None:
        self._file = fs.open(path, "wb")

    def write(self, data: memoryview | bytes | bytearray) -> None:
        self._file.write(memoryview(data).cast("B"))

    def close(self, sync: bool) -> None:
        # Object stores make a file visible atomically when it is closed; there is no fsync.
        self._file.close()


class _FsspecReader:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        info = storage.fs.info(path)
        if info.get("type") != "file":
            raise UnsafePathError(errno.EINVAL, "it is not a regular file", path)
        self.size = int(info["size"])

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return self._storage.read_into(self._path, offset, buffer)

    def close(self) -> None:
        return None


class FsspecStorage:
    """Any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError as err:  # pragma: no cover - fsspec is a test dependency
            raise ImportError(
                f"reading or writing {url!r} needs fsspec: pip install 'shardwise[remote]'"
            ) from err
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.process_local = "memory" in protocols

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> Writer:
        return _FsspecWriter(self.fs, path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        view = buffer.cast("B")
        data = self.fs.cat_file(path, start=offset, end=offset + len(view))
        view[: len(data)] = data
        return len(data)

    def open_reader(self, path: str) -> Reader:
        return _FsspecReader(self, path)

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def rename(self, source: str, target: str) -> None:
        self.fs.mv(source, target)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path)

    def listdir(self, path: str) -> list[str]:
        if not self.fs.exists(path):
            return []
        return sorted(
            entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)
        )

    def check_directory(self, path: str) -> None:
        # Object stores have no links; a "directory" is a key prefix.
        return None

    def create_exclusive(self, path: str, data: bytes) -> bool:
        # Object stores have no exclusive create that every backend offers: this check and
        # write can race (documented: concurrent saves to one URL are the caller's to avoid).
        if self.fs.exists(path):
            return False
        with self.fs.open(path, "wb") as file:
            file.write(data)
        return True

    def replace_small(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as file:  # a PUT replaces an object atomically
            file.write(data)

    def read_small(self, path: str, limit: int) -> bytes:
        reader = _FsspecReader(self, path)
        if reader.size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
        return bytes(self.fs.cat_file(path))

    def sync_dir(self, path: str) -> None:
        return None


def open_storage(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Storage:
    """The storage backend for ``path``: local for plain paths, fsspec for URLs."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return FsspecStorage(text, storage_options)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStorage(text)


def open_shared_storage(
    path: str, storage_options: dict[str, Any] | None, world_size: int
) -> Storage:
    """:func:`open_storage`, refused when ``world_size`` processes would not share it.

    Raises:
        CheckpointError: A process-local store (``memory://``) for more than one process.
    """
    from shardwise.errors import CheckpointError

    storage = open_storage(path, storage_options)
    if storage.process_local and world_size > 1:
        raise CheckpointError(
            f"{path} is in a store that only this process sees (memory://), but {world_size} "
            "processes save or load it together: each would have its own copy. Use a shared "
            "file system or object store, or one process",
            file=path,
        )
    return storage
