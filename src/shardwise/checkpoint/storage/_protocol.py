"""The storage protocol: what the checkpoint layer asks of a file system, and its types."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Finish", "RangeRequest", "Reader", "Storage", "UnsafePathError", "Writer"]


class UnsafePathError(OSError):
    """A path below the storage root is a link, or not the regular file or directory expected."""

    #: What the entry at ``filename`` is (``"a symbolic link"``, ...), where the backend knows.
    found: str | None = None
    #: What it should have been (``"a regular file"`` or ``"a directory"``).
    expected: str | None = None


class Writer(Protocol):
    """A file being written sequentially."""

    def write(self, data: memoryview | bytes | bytearray) -> None:
        """Append ``data``."""

    def write_vector(self, parts: Sequence[memoryview | bytes | bytearray]) -> None:
        """Append ``parts`` in order (one system call where the storage has one, no copy)."""

    def close(self, sync: bool) -> None:
        """Finish the file; with ``sync``, make it durable (fsync) first."""

    def abort(self) -> None:
        """Give the file up after a failure: nothing of it stays (errors are logged, not raised)."""


class Reader(Protocol):
    """A regular file opened for positioned reads (safe to share between threads)."""

    path: str
    #: The file's size in bytes when it was opened.
    size: int

    @property
    def identity(self) -> object:
        """Equal for two readers of one file (hard links to it included)."""

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns the count read."""

    def read_vector(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in turn from ``offset``; the count read (short only at EOF)."""

    def close(self) -> None:
        """Release the file."""


#: ``then(number, data)`` of :meth:`Storage.read_ranges`.
Finish = Callable[[int, memoryview], None]


@dataclass(frozen=True, slots=True)
class RangeRequest:
    """One positioned read: ``length`` bytes of ``reader``'s file from ``offset``."""

    reader: Reader
    offset: int
    length: int
    #: None: a new buffer made by the thread that reads (a worker thread's allocator reuses its
    #: memory, the main thread's maps new pages each time).
    buffer: memoryview | None = None


class Storage(Protocol):
    """The operations the checkpoint layer needs from a file system."""

    root: str
    #: Whether only this process sees the files (``memory://``): no use to a group.
    process_local: bool
    #: Whether :meth:`rename` atomically replaces its target; where not (object stores), writers
    #: put each file under its final name, where it appears complete when it is closed.
    atomic_rename: bool
    #: Whether a read is a request to a remote service (latency, cost per request).
    remote: bool

    def join(self, *parts: str) -> str:
        """``root`` joined with ``parts``."""

    def url(self, path: str) -> str:
        """``path`` as the user would write it (with its protocol, for messages)."""

    def parent(self) -> Storage:
        """The storage of the directory holding ``root`` (a checkpoint's series root), as the
        user reached ``root``: lexically, no link resolved (``ValueError`` at the top)."""

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""

    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes."""

    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no error if it exists)."""

    def open_write(self, path: str) -> Writer:
        """Open ``path`` for writing from scratch."""

    def read_ranges(
        self, requests: Sequence[RangeRequest], then: Finish | None = None
    ) -> list[int]:
        """Every read of ``requests``, concurrently where it can; each one's count (short at EOF).

        ``then(number, data)`` gets each complete request's bytes on the thread that read them
        (while they are in the cache); what it raises propagates.

        Raises:
            OSError: A read failed (its ``filename`` names the file, where known).
        """

    def open_reader(self, path: str) -> Reader:
        """Open the regular file ``path`` for reads (FileNotFoundError, UnsafePathError)."""

    def open_below(self, relative: str) -> Reader:
        """Open the regular file ``relative`` below the root, each component inside the one before.

        Raises:
            FileNotFoundError: The file or a directory on the way is missing.
            NotADirectoryError: The root is not a directory.
            UnsafePathError: A component is a link or not a directory (the file: a regular file).
        """

    def rename(self, source: str, target: str) -> None:
        """Atomically replace ``target`` by ``source`` where the backend can."""

    def remove(self, path: str) -> None:
        """Delete the file ``path`` (no error if it is gone); a link is removed, not followed."""

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of directory ``path``; empty if it is missing."""

    def remove_directory(self, path: str) -> None:
        """Remove the empty directory ``path`` (OSError if it is not empty; nothing to do where
        directories are only key prefixes, as on object stores)."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create the file ``path`` holding ``data`` unless it exists (then return False)."""

    def replace_small(self, path: str, data: bytes) -> None:
        """Atomically replace the small file ``path`` by one holding ``data``."""

    def read_small(self, path: str, limit: int) -> bytes:
        """The file ``path`` (a regular file of at most ``limit`` bytes, else OSError)."""

    def sync_dir(self, path: str) -> None:
        """Make renames and creations inside directory ``path`` durable."""
