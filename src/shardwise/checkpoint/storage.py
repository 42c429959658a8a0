"""Where checkpoint bytes live: a small storage protocol with a local and an fsspec backend.

This is the only module of shardwise that touches files. Paths are plain ``str`` joined with
``/`` so that URLs (``s3://bucket/ckpt``, ``memory://ckpt``) survive untouched. Local paths
need no fsspec; a URL needs the ``fsspec`` package (extra ``remote``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, BinaryIO, Protocol

__all__ = ["FsspecStorage", "LocalStorage", "Reader", "Storage", "Writer", "open_storage"]


class Writer(Protocol):
    """A file being written sequentially."""

    def write(self, data: memoryview | bytes | bytearray) -> None:
        """Append ``data``."""

    def close(self, sync: bool) -> None:
        """Finish the file; with ``sync``, make it durable (fsync) first."""


class Reader(Protocol):
    """A file opened for positioned reads (safe to share between threads)."""

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns the count read."""

    def close(self) -> None:
        """Release the file."""


class Storage(Protocol):
    """The operations the checkpoint layer needs from a file system."""

    root: str

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
        """Open ``path`` for many positioned reads (one open instead of one per read)."""

    def read(self, path: str) -> bytes:
        """The whole file."""

    def rename(self, source: str, target: str) -> None:
        """Atomically replace ``target`` by ``source`` where the backend can."""

    def remove(self, path: str) -> None:
        """Delete the file ``path`` (no error if it is gone)."""

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of directory ``path``; empty if it is missing."""

    def sync_dir(self, path: str) -> None:
        """Make renames and creations inside directory ``path`` durable."""


class _LocalWriter:
    def __init__(self, path: str) -> None:
        self._file: BinaryIO = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()

    def write(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = self._file.write(view)
            assert written is not None
            view = view[written:]

    def close(self, sync: bool) -> None:
        try:
            if sync:
                os.fsync(self._file.fileno())
        finally:
            self._file.close()


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
        self._fd = os.open(path, os.O_RDONLY)

    def read_into(self, offset: int, buffer: memoryview) -> int:
        # preadv takes the offset explicitly, so threads can share the descriptor.
        return _pread_into(self._fd, offset, buffer)

    def close(self) -> None:
        os.close(self._fd)


class LocalStorage:
    """A directory on a local (or mounted shared) file system."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> Writer:
        return _LocalWriter(path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        reader = _LocalReader(path)
        try:
            return reader.read_into(offset, buffer)
        finally:
            reader.close()

    def open_reader(self, path: str) -> Reader:
        return _LocalReader(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as file:
            return file.read()

    def rename(self, source: str, target: str) -> None:
        os.replace(source, target)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
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
