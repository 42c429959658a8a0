"""Where checkpoint bytes live: a small storage protocol with a local and an fsspec backend.

This is the only module of shardwise that touches files. Paths are plain ``str`` joined with
``/`` so that URLs (``s3://bucket/ckpt``, ``memory://ckpt``) survive untouched. Local paths
need no fsspec; a URL needs the ``fsspec`` package (extra ``remote``).

Below the root, the local backend never follows a symbolic link: every directory between the
root and a file must be a real directory (``lstat``), files are opened with ``O_NOFOLLOW`` (and
``O_NONBLOCK``, so a FIFO cannot block an open), and a file opened for reading must be a regular
file (``fstat``). Anything else raises :class:`UnsafePathError`. The root itself may be a link:
the caller chose that path.

Reads come in batches (:meth:`Storage.read_ranges`): the local backend runs positioned reads on
a few threads; the fsspec backend asks for byte ranges with ``cat_ranges``, which an async file
system such as s3fs sends concurrently, never through fsspec's buffered files (they read ahead
whole blocks). Object stores have no rename (fsspec's ``mv`` copies, then deletes), so the
fsspec backend says ``atomic_rename = False`` and writers put files under their final names.
Every failure of the storage library (no credentials, an unreachable endpoint, permission
denied, no such bucket, a timeout, ...) becomes one
:class:`~shardwise.errors.CheckpointStorageError` naming the URL and the cause in words;
``FileNotFoundError`` and ``FileExistsError`` stay what they are, since callers act on them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import inspect
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol, TypeVar

from shardwise.errors import CheckpointError, CheckpointStorageError

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "RangeRequest",
    "Reader",
    "Storage",
    "TemporaryBytes",
    "UnsafePathError",
    "Writer",
    "batches",
    "describe_storage_error",
    "open_shared_storage",
    "open_storage",
    "run_concurrently",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# Reads are I/O bound (the GIL is released in preadv, hashing and copies); a few threads
# overlap them.
_THREADS = 4
# Work smaller than this runs inline: on a thread pool it costs more in GIL hand-offs
# (measured: 10,000 small reads took 2.1 s on 4 threads and 0.45 s on one).
_INLINE = 1 << 20
# One request to a remote store reads at most this many bytes, so a large read becomes
# several concurrent requests; one cat_ranges call asks for at most _BATCH bytes, which it
# holds in memory before they are copied out.
_PIECE = 8 << 20
_BATCH = 64 << 20
# fsspec protocols of object stores: no directories (a "directory" is a key prefix) and the
# first path component is a bucket (or container), which a save never creates.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


class UnsafePathError(OSError):
    """A path below the storage root is a symbolic link, or not the regular file or directory
    it should be."""


class Writer(Protocol):
    """A file being written sequentially."""

    def write(self, data: memoryview | bytes | bytearray) -> None:
        """Append ``data``."""

    def close(self, sync: bool) -> None:
        """Finish the file; with ``sync``, make it durable (fsync) first."""

    def abort(self) -> None:
        """Give the file up after a failure: nothing of it stays (errors are logged, not
        raised: the write has already failed)."""


class Reader(Protocol):
    """A regular file opened for positioned reads (safe to share between threads)."""

    #: The file's path in its storage.
    path: str
    #: The file's size in bytes when it was opened.
    size: int

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` into ``buffer``; returns the count read."""

    def close(self) -> None:
        """Release the file."""


#: ``then(number, data)`` of :meth:`Storage.read_ranges`.
Finish = Callable[[int, memoryview], None]


@dataclass(frozen=True, slots=True)
class RangeRequest:
    """One positioned read: ``length`` bytes of ``reader``'s file from ``offset``.

    Attributes:
        buffer: Where the bytes go (``length`` bytes); None: into a new buffer, made by the
            thread that reads (a worker thread's allocator reuses its memory read after read,
            where the main thread's maps new pages for every large buffer).
    """

    reader: Reader
    offset: int
    length: int
    buffer: memoryview | None = None

    @classmethod
    def into(cls, reader: Reader, offset: int, buffer: memoryview) -> RangeRequest:
        """A read that fills ``buffer``."""
        view = buffer.cast("B")
        return cls(reader, offset, len(view), view)


class Storage(Protocol):
    """The operations the checkpoint layer needs from a file system."""

    root: str
    #: Whether only this process sees the files (``memory://``): no use to a group.
    process_local: bool
    #: Whether :meth:`rename` atomically replaces its target (a local file system). Where it
    #: does not (object stores: a copy, then a delete), writers put each file under its final
    #: name, where it appears complete when it is closed.
    atomic_rename: bool
    #: Whether a read is a request to a remote service (latency, cost per request): readers
    #: keep bytes they have verified rather than request them again.
    remote: bool

    def join(self, *parts: str) -> str:
        """``root`` joined with ``parts``."""

    def url(self, path: str) -> str:
        """``path`` as the user would write it (with its protocol, for messages)."""

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

    def read_ranges(
        self, requests: Sequence[RangeRequest], then: Finish | None = None
    ) -> list[int]:
        """Perform every read of ``requests``, concurrently where the backend can; returns the
        count read for each (short only at the end of a file).

        Args:
            requests: The reads.
            then: Called as ``then(number, data)`` once request ``number`` is complete, with
                the bytes read (a view of its buffer, or the new buffer; shorter than asked
                only at the end of the file), on the thread that read them where there are
                threads: work on bytes just read, while they are in the cache. What it raises
                propagates.

        Raises:
            OSError: A read failed (its ``filename`` names the file, where known).
        """

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


# How often a small file written aside is written again when another save's cleanup removed
# it before it was linked or renamed into place (see LocalStorage.create_exclusive).
_ASIDE_ATTEMPTS = 5
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


_pool_lock = threading.Lock()
_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    """The I/O threads of this process, made on first use (starting threads for every batch
    costs more than small batches take), and made again in a forked child, which has none."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = concurrent.futures.ThreadPoolExecutor(
                _THREADS, thread_name_prefix="shardwise-io"
            )
            _pool = (os.getpid(), pool)
        return _pool[1]


def run_concurrently(
    items: Sequence[T], size: Callable[[T], int], work: Callable[[T], R]
) -> list[R]:
    """``work`` of every item, in order: small items inline, large ones on a few threads.

    Returns only once every item's work has ended; the first exception raised (in the order
    of ``items``) then propagates.
    """
    large = [number for number, item in enumerate(items) if size(item) >= _INLINE]
    if len(large) <= 1:
        return [work(item) for item in items]
    chosen = set(large)
    pool = _threads()
    futures = {number: pool.submit(work, items[number]) for number in large}
    results: dict[int, R] = {}
    try:
        for number, item in enumerate(items):
            if number not in chosen:
                results[number] = work(item)
    finally:
        # No thread may still be writing into a buffer once the caller moves on.
        concurrent.futures.wait(futures.values())
    for number in large:
        results[number] = futures[number].result()
    return [results[number] for number in range(len(items))]


def batches(items: Sequence[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """``items`` in order, cut into consecutive lists of at most ``limit`` total ``size`` (an
    item larger than ``limit`` alone)."""
    batch: list[T] = []
    total = 0
    for item in items:
        if batch and total + size(item) > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size(item)
    if batch:
        yield batch


class _LocalWriter:
    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage = storage
        self._path = path
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

    def abort(self) -> None:
        try:
            os.close(self._fd)
            self._storage.remove(self._path)
        except OSError as err:  # left for the next save's cleanup
            logger.warning("could not remove %s after a failed write: %s", self._path, err)


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


class TemporaryBytes:
    """Bytes parked in a temporary local file, unlinked from the start
    (``tempfile.TemporaryFile``, in ``TMPDIR``): the system frees it when it is closed or the
    process dies. Created on the first :meth:`append`."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        #: Bytes appended so far.
        self.size = 0

    def append(self, data: memoryview) -> int:
        """Append ``data``; returns the offset it starts at.

        Raises:
            OSError: The file cannot be created or written (a full disk).
        """
        if self._file is None:
            # Open across calls, closed by close(): no context manager fits.
            self._file = tempfile.TemporaryFile(prefix="shardwise-")  # noqa: SIM115
        offset = self.size
        view = data.cast("B")
        written = 0
        while written < len(view):
            written += os.pwrite(self._file.fileno(), view[written:], offset + written)
        self.size += len(view)
        return offset

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes appended at ``offset``."""
        assert self._file is not None and offset + len(buffer) <= self.size
        if _pread_into(self._file.fileno(), offset, buffer) != len(buffer):
            raise OSError(errno.EIO, "the temporary file is shorter than what was written")

    def close(self) -> None:
        """Delete the file (nothing is kept)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.size = 0


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a link (False when it does not exist)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


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
        return _LocalWriter(self, path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        reader = self.open_reader(path)
        try:
            return reader.read_into(offset, buffer)
        finally:
            reader.close()

    def read_ranges(
        self, requests: Sequence[RangeRequest], then: Finish | None = None
    ) -> list[int]:
        def read(number: int) -> int:
            request = requests[number]
            buffer = request.buffer
            if buffer is None:
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
        for attempt in range(_ASIDE_ATTEMPTS):
            temporary = self._written_aside(path, data)
            try:
                os.link(temporary, path, follow_symlinks=False)
            except FileExistsError:
                return False
            except FileNotFoundError:
                # The save holding the lock removed this temporary as a leftover: write again.
                if attempt + 1 == _ASIDE_ATTEMPTS:
                    raise
                continue
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)
            return True
        raise AssertionError("unreachable")

    def replace_small(self, path: str, data: bytes) -> None:
        for attempt in range(_ASIDE_ATTEMPTS):
            try:
                self.rename(self._written_aside(path, data), path)
                return
            except FileNotFoundError:  # as in create_exclusive: removed as a leftover
                if attempt + 1 == _ASIDE_ATTEMPTS:
                    raise

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


# Cause names of storage-library exceptions, matched by class name: the libraries are optional
# (botocore comes with s3fs, google-auth with gcsfs, ...) and share no base class.
_NO_CREDENTIALS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",
    }
)
_UNREACHABLE = frozenset(
    {
        "ConnectionError",
        "EndpointConnectionError",
        "ClientConnectorError",
        "ServerDisconnectedError",
    }
)
# Error codes of an S3-style service answer (``err.response["Error"]["Code"]``).
_REFUSED_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_DENIED = frozenset({"AccessDenied", "AllAccessDisabled", "Forbidden", "403"})
_MAX_DETAIL = 300


def _error_code(err: BaseException) -> str | None:
    """The service's error code of ``err`` or of the exception it was translated from."""
    for candidate in (err, err.__cause__, err.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
    return None


def _no_such_bucket(err: BaseException) -> bool:
    # s3fs turns NoSuchBucket into FileNotFoundError, sometimes without the cause attached.
    return _error_code(err) == "NoSuchBucket" or "bucket does not exist" in str(err)


def describe_storage_error(err: BaseException) -> str:
    """The cause of a storage library's ``err`` in words, its own message after it (one line).

    Example: ``no credentials found (NoCredentialsError: Unable to locate credentials); give
    them in storage_options, or where the storage library looks for them``.
    """
    names = {cls.__name__ for cls in type(err).__mro__}
    code = _error_code(err)
    hint = ""
    if names & _NO_CREDENTIALS:
        cause = "no credentials found"
        hint = "give them in storage_options, or where the storage library looks for them"
    elif _no_such_bucket(err):
        cause = "no such bucket"
        hint = "create it first (a save never creates buckets)"
    elif code in _REFUSED_CREDENTIALS:
        cause = "permission denied: the credentials were refused"
    elif isinstance(err, PermissionError) or code in _DENIED:
        cause = "permission denied"
    elif names & _UNREACHABLE:
        cause = "cannot reach the endpoint"
        hint = "check the URL, endpoint_url in storage_options, and the network"
    elif isinstance(err, TimeoutError) or any("Timeout" in name for name in names):
        cause = "the request timed out"
    else:
        cause = "the storage failed"
    detail = " ".join(str(err).split())
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    text = f"{cause} ({type(err).__name__}{': ' + detail if detail else ''})"
    return f"{text}; {hint}" if hint else text


class _FsspecWriter:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        with storage.errors("write", path):
            self._file = storage.fs.open(path, "wb")

    def write(self, data: memoryview | bytes | bytearray) -> None:
        with self._storage.errors("write", self._path):
            self._file.write(memoryview(data).cast("B"))

    def close(self, sync: bool) -> None:
        # Object stores make a file visible atomically when it is closed; there is no fsync.
        with self._storage.errors("write", self._path):
            self._file.close()

    def abort(self) -> None:
        from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

        try:
            if isinstance(self._file, AbstractBufferedFile):
                # Closing would upload what was written: discard it instead (an object
                # store's multipart upload is aborted), and mark the file closed so that it
                # is not uploaded when it is collected either. Nothing became visible.
                self._file.discard()
                self._file.closed = True
                return
            self._file.close()
            self._storage.remove(self._path)
        # Any failure of the storage library: the write failed already, and whatever is left
        # is removed by the next save's cleanup.
        except Exception as err:
            logger.warning("could not discard %s after a failed write: %s", self._path, err)


class _FsspecReader:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self.path = path
        with storage.errors("look up", path):
            info = storage.fs.info(path)
        if info.get("type") != "file":
            raise UnsafePathError(errno.EINVAL, "it is not a regular file", path)
        self.size = int(info["size"])

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return self._storage.read_into(self.path, offset, buffer)

    def close(self) -> None:
        return None


def _has_create_mode(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"`` (s3fs: a PUT with If-None-Match)."""
    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):  # no signature to inspect
        return False


@dataclass(frozen=True, slots=True)
class _Piece:
    """A part of a :class:`RangeRequest` of at most :data:`_PIECE` bytes."""

    request: int
    path: str
    start: int
    end: int


class FsspecStorage:
    """Any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...).

    Args:
        url: The checkpoint's URL.
        storage_options: Passed to the fsspec file system (credentials, ``endpoint_url``,
            ...).

    Attributes:
        bucket: The bucket (or container) of an object store, None for other file systems.
    """

    atomic_rename = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError as err:  # pragma: no cover - fsspec is a test dependency
            raise ImportError(
                f"reading or writing {url!r} needs fsspec: pip install 'shardwise[remote]'"
            ) from err
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self._url = url.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.process_local = "memory" in protocols
        self.remote = not self.process_local
        self.bucket: str | None = (
            self.root.split("/", 1)[0] if _OBJECT_STORES.intersection(protocols) else None
        )
        self._conditional_create = _has_create_mode(self.fs)

    def url(self, path: str) -> str:
        """``path`` as a URL, with its protocol (for messages): below the root, as the user
        wrote the root."""
        if path == self.root or path.startswith(f"{self.root}/"):
            return self._url + path[len(self.root) :]
        return str(self.fs.unstrip_protocol(path))

    @contextlib.contextmanager
    def errors(self, doing: str, path: str) -> Iterator[None]:
        """Turn a failure of the storage library while ``doing`` something to ``path`` into a
        :class:`CheckpointStorageError` (``FileNotFoundError`` and ``FileExistsError``, which
        callers act on, pass unchanged, unless the bucket is missing)."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, UnsafePathError, CheckpointError) as err:
            if isinstance(err, FileNotFoundError) and _no_such_bucket(err):
                raise self.failure(err, doing, path) from err
            raise
        # The storage library's exceptions share no base class (botocore, aiohttp,
        # google-auth, ...): at this boundary any other one means the storage failed.
        except Exception as err:
            raise self.failure(err, doing, path) from err

    def failure(self, err: BaseException, doing: str, path: str) -> CheckpointStorageError:
        """The one-line error for ``err``, raised while ``doing`` something to ``path``."""
        return CheckpointStorageError(
            f"cannot {doing} {self.url(path)}: {describe_storage_error(err)}"
        )

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def exists(self, path: str) -> bool:
        with self.errors("look up", path):
            return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        with self.errors("look up", path):
            return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        if self.bucket is not None:
            # An object store has no directories, only key prefixes; and a missing bucket is
            # an error to report, not something a save creates.
            return
        with self.errors("create", path):
            self.fs.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> Writer:
        return _FsspecWriter(self, path)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        view = buffer.cast("B")
        if not view:
            return 0
        with self.errors("read", path):
            data = self.fs.cat_file(path, start=offset, end=offset + len(view))
        view[: len(data)] = data
        return len(data)

    def read_ranges(
        self, requests: Sequence[RangeRequest], then: Finish | None = None
    ) -> list[int]:
        pieces = []
        remaining = [0] * len(requests)  # pieces of each request not read yet
        for number, request in enumerate(requests):
            # Never past the end of the file: a short count, which the caller reports.
            end = min(request.offset + request.length, request.reader.size)
            for start in range(request.offset, end, _PIECE):
                stop = min(start + _PIECE, end)
                pieces.append(_Piece(number, request.reader.path, start, stop))
                remaining[number] += 1
        counts = [0] * len(requests)
        # A request without a buffer that is one piece gets that piece's bytes as they came.
        buffers: list[memoryview | None] = [
            request.buffer
            if request.buffer is not None or remaining[number] == 1
            else memoryview(bytearray(request.length))
            for number, request in enumerate(requests)
        ]
        if then is not None:  # requests with nothing to read are complete already
            for number in range(len(requests)):
                if not remaining[number]:
                    then(number, memoryview(b""))
        for batch in batches(pieces, lambda piece: piece.end - piece.start, _BATCH):
            for piece, data in zip(batch, self._read_batch(batch), strict=True):
                number = piece.request
                buffer = buffers[number]
                if buffer is None:
                    buffers[number] = buffer = memoryview(data)
                else:
                    at = piece.start - requests[number].offset
                    buffer[at : at + len(data)] = data
                counts[number] += len(data)
                remaining[number] -= 1
                if then is not None and not remaining[number]:
                    then(number, buffer[: counts[number]])
        return counts

    def _read_batch(self, batch: list[_Piece]) -> list[bytes]:
        """One ``cat_ranges`` call for ``batch`` (concurrent requests in an async file system
        such as s3fs): the bytes of each piece."""
        with self.errors("read", batch[0].path):
            results = self.fs.cat_ranges(
                [piece.path for piece in batch],
                [piece.start for piece in batch],
                [piece.end for piece in batch],
            )
        for piece, data in zip(batch, results, strict=True):
            if isinstance(data, BaseException):  # cat_ranges returns per-range errors
                with self.errors("read", piece.path):
                    raise data
        return list(results)

    def open_reader(self, path: str) -> Reader:
        return _FsspecReader(self, path)

    def read(self, path: str) -> bytes:
        with self.errors("read", path):
            return bytes(self.fs.cat_file(path))

    def rename(self, source: str, target: str) -> None:
        with self.errors("rename", source):
            self.fs.mv(source, target)

    def remove(self, path: str) -> None:
        with self.errors("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def listdir(self, path: str) -> list[str]:
        with self.errors("list", path):
            # Listings are cached by some file systems (s3fs), and a cached listing answers
            # later lookups of the files below it: other processes write there, so a listing
            # is taken fresh and not kept.
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            finally:
                self.fs.invalidate_cache(path)
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def check_directory(self, path: str) -> None:
        # Object stores have no links; a "directory" is a key prefix.
        return None

    def create_exclusive(self, path: str, data: bytes) -> bool:
        with self.errors("create", path):
            # Checked first even where the create is conditional: a store that ignores the
            # condition (some S3-compatible servers) still refuses a lock it can see.
            if self.fs.exists(path):
                return False
            if not self._conditional_create:
                # No conditional create in this backend: the check and this write can race.
                self.fs.pipe_file(path, data)
                return True
            try:
                # s3fs sends If-None-Match: "*": the store refuses the PUT if the object exists.
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
        return True

    def replace_small(self, path: str, data: bytes) -> None:
        with self.errors("write", path):
            self.fs.pipe_file(path, data)  # one PUT replaces an object atomically

    def read_small(self, path: str, limit: int) -> bytes:
        reader = _FsspecReader(self, path)
        if reader.size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
        data = bytearray(reader.size)
        return bytes(data[: reader.read_into(0, memoryview(data))])

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
    storage = open_storage(path, storage_options)
    if storage.process_local and world_size > 1:
        raise CheckpointError(
            f"{path} is in a store that only this process sees (memory://), but {world_size} "
            "processes save or load it together: each would have its own copy. Use a shared "
            "file system or object store, or one process",
            file=path,
        )
    return storage
