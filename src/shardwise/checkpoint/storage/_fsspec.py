"""The fsspec backend of the storage layer: any fsspec file system (``s3://``, ``memory://``, ...).

Byte ranges go through ``cat_ranges``, never fsspec's buffered files (they read ahead whole
blocks). Object stores have no rename (``mv`` copies, then deletes): ``atomic_rename = False``.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.checkpoint import tuning
from shardwise.checkpoint.storage._errors import describe_storage_error, no_such_bucket
from shardwise.checkpoint.storage._protocol import (
    Finish,
    RangeRequest,
    Reader,
    UnsafePathError,
    Writer,
)
from shardwise.checkpoint.storage._threads import batches
from shardwise.errors import CheckpointError, CheckpointStorageError

__all__ = ["FsspecStorage"]

logger = logging.getLogger(__name__)

# fsspec protocols of object stores: no directories (a "directory" is a key prefix) and the
# first path component is a bucket (or container), which a save never creates.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


class _FsspecWriter:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        with storage.errors("write", path):
            self._file = storage.fs.open(path, "wb")

    def write(self, data: memoryview | bytes | bytearray) -> None:
        with self._storage.errors("write", self._path):
            self._file.write(memoryview(data).cast("B"))

    def write_vector(self, parts: Sequence[memoryview | bytes | bytearray]) -> None:
        for part in parts:
            self.write(part)

    def close(self, sync: bool) -> None:
        # Object stores make a file visible atomically when it is closed; there is no fsync.
        with self._storage.errors("write", self._path):
            self._file.close()

    def abort(self) -> None:
        from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

        try:
            if isinstance(self._file, AbstractBufferedFile):
                # Closing would upload what was written: discard it (a multipart upload is
                # aborted), and mark it closed so that collecting it does not upload it either.
                self._file.discard()
                self._file.closed = True
                return
            self._file.close()
            self._storage.remove(self._path)
        except Exception as err:  # any storage failure: what is left, the next save removes
            logger.warning("could not discard %s after a failed write: %s", self._path, err)


class _FsspecReader:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self.path = path
        with storage.errors("look up", path):
            info = storage.fs.info(path)
        if info.get("type") != "file":
            err = UnsafePathError(errno.EINVAL, "it is not a regular file", path)
            err.found, err.expected = f"a {info.get('type')}", "a regular file"
            raise err
        self.size = int(info["size"])
        self.identity = path

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return self._storage.read_into(self.path, offset, buffer)

    def read_vector(self, offset: int, buffers: Sequence[memoryview]) -> int:
        # One ranged request for them all, then copied out: no scatter reads over HTTP.
        views = [buffer.cast("B") for buffer in buffers]
        data = memoryview(bytearray(sum(map(len, views))))
        count = self.read_into(offset, data)
        position = 0
        for view in views:
            part = data[position : min(count, position + len(view))]
            view[: len(part)] = part
            position += len(view)
        return count

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
    """A part of a :class:`RangeRequest` of at most ``TUNING.request_bytes`` bytes."""

    request: int
    path: str
    start: int
    end: int


class FsspecStorage:
    """Any fsspec file system (``s3://``, ``gs://``, ``memory://``, ...).

    Args:
        storage_options: For the fsspec file system (credentials, ``endpoint_url``, ...).

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
        self._options = storage_options
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
        """``path`` as a URL with its protocol (below the root, as the user wrote the root)."""
        if path == self.root or path.startswith(f"{self.root}/"):
            return self._url + path[len(self.root) :]
        return str(self.fs.unstrip_protocol(path))

    def parent(self) -> FsspecStorage:
        head, _, name = self._url.rpartition("/")
        if not name or "/" not in self.root or head.endswith(("/", ":")):
            raise ValueError(f"{self._url} has no parent directory")
        return FsspecStorage(head, self._options)

    @contextlib.contextmanager
    def errors(self, doing: str, path: str) -> Iterator[None]:
        """Turn a failure of the storage library while ``doing`` something to ``path`` into a
        :class:`CheckpointStorageError` (``FileNotFoundError`` and ``FileExistsError``, which
        callers act on, pass unless the bucket is missing)."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, UnsafePathError, CheckpointError) as err:
            if isinstance(err, FileNotFoundError) and no_such_bucket(err):
                raise self.failure(err, doing, path) from err
            raise
        # Storage libraries' exceptions share no base class (botocore, aiohttp, ...): at this
        # boundary any other one means the storage failed.
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
            return  # no directories, only key prefixes; and a save never creates a bucket
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
        piece_bytes = tuning.TUNING.request_bytes
        pieces = []
        remaining = [0] * len(requests)  # pieces of each request not read yet
        for number, request in enumerate(requests):
            # Never past the end of the file: a short count, which the caller reports.
            end = min(request.offset + request.length, request.reader.size)
            for start in range(request.offset, end, piece_bytes):
                stop = min(start + piece_bytes, end)
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
        for batch in batches(
            pieces, lambda piece: piece.end - piece.start, tuning.TUNING.storage_batch_bytes
        ):
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
        """The bytes of each piece of ``batch``, from one ``cat_ranges`` call (which an async
        file system such as s3fs sends concurrently)."""
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

    def open_below(self, relative: str) -> Reader:
        # An object store has no links, and its "directories" are key prefixes.
        return _FsspecReader(self, self.join(relative))

    def rename(self, source: str, target: str) -> None:
        with self.errors("rename", source):
            self.fs.mv(source, target)

    def remove(self, path: str) -> None:
        with self.errors("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_directory(self, path: str) -> None:
        if self.bucket is not None:
            return  # a key prefix: gone with its last object
        with self.errors("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        with self.errors("list", path):
            # s3fs caches listings and answers later lookups below them from the cache; other
            # processes write there, so a listing is taken fresh and not kept.
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            finally:
                self.fs.invalidate_cache(path)
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

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
