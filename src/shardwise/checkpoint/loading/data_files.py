"""Data files opened safely and read: :class:`SourceFiles` (any source of data files: a read
comes back whole or raises a ``CheckpointDataError`` naming the file, the entry and the rank)
and :class:`DataFiles`, those of one checkpoint."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Sequence

from shardwise.checkpoint.index import Index, is_data_file_name
from shardwise.checkpoint.index.names import parse_reference
from shardwise.checkpoint.storage import RangeRequest, Reader, Storage, UnsafePathError
from shardwise.errors import CheckpointDataError, CheckpointError, CheckpointStorageError

__all__ = ["DataFiles", "SourceFiles"]


class SourceFiles:
    """Data files of one source, for reads by ``rank``: a subclass says where file ``name``
    is (:meth:`path`), how it is opened (:meth:`open`) and what size it must have
    (:meth:`declared_size`)."""

    #: How errors name where :meth:`declared_size` comes from.
    declared_by = "the index says"

    def __init__(self, storage: Storage, rank: int | None) -> None:
        self.storage = storage
        self.rank = rank
        self.bytes_read = 0
        self.lock = threading.Lock()
        self._handles: dict[str, Reader] = {}

    def path(self, name: str) -> str:
        """The storage path of data file ``name``."""
        raise NotImplementedError

    def open(self, name: str) -> Reader:
        """Data file ``name`` opened for reads (``FileNotFoundError``, ``UnsafePathError``)."""
        return self.storage.open_reader(self.path(name))

    def declared_size(self, name: str) -> int:
        """The size data file ``name`` must have."""
        raise NotImplementedError

    def close(self) -> None:
        """Close every file opened."""
        with self.lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()

    def shown(self, name: str) -> str:
        """The path of data file ``name`` as errors show it (a URL on an object store)."""
        return self.storage.url(self.path(name))

    def error(self, message: str, file: str, key: str | None) -> CheckpointDataError:
        """The error of a read of ``key`` from ``file``."""
        return CheckpointDataError(message, key=key, file=self.shown(file), rank=self.rank)

    def handle(self, name: str, key: str | None = None) -> Reader:
        """Data file ``name``, opened once: a regular file of its declared size."""
        with self.lock:
            handle = self._handles.get(name)
            if handle is not None:
                return handle
            try:
                handle = self.open(name)
            except FileNotFoundError as err:
                raise self.error("data file is missing", name, key) from err
            except UnsafePathError as err:
                raise self.error(
                    f"data file is not a regular file inside the checkpoint: {err.strerror}; "
                    "refusing to read it",
                    name,
                    key,
                ) from err
            except CheckpointStorageError:
                raise
            except OSError as err:
                raise self.error(f"cannot open data file: {err}", name, key) from err
            declared = self.declared_size(name)
            if handle.size != declared:
                handle.close()
                what = "is truncated" if handle.size < declared else "has the wrong size"
                raise self.error(
                    f"data file {what}: it has {handle.size} bytes, {self.declared_by} {declared}",
                    name,
                    key,
                )
            self._handles[name] = handle
            return handle

    def read_vector(
        self, file: str, offset: int, buffers: Sequence[memoryview], key: str | None
    ) -> None:
        """Fill ``buffers`` in turn with the bytes of ``file`` from ``offset`` (locally one
        ``preadv``); :class:`CheckpointDataError` if it fails or comes back short."""
        length = sum(len(buffer) for buffer in buffers)
        handle = self.handle(file, key)
        try:
            if len(buffers) == 1:
                count = handle.read_into(offset, buffers[0])
            else:
                count = handle.read_vector(offset, buffers)
        except CheckpointError:
            raise
        except OSError as err:
            raise self.error(f"cannot read data file: {err}", file, key) from err
        if count != length:
            raise self._truncated(file, offset, length, count, key)
        with self.lock:
            self.bytes_read += count

    def _truncated(
        self, file: str, offset: int, length: int, count: int, key: str | None
    ) -> CheckpointDataError:
        return self.error(
            f"data file is truncated: read {count} of {length} bytes at offset {offset}",
            file,
            key,
        )

    def read_ranges(
        self,
        requests: Sequence[RangeRequest],
        names: Sequence[tuple[str, str | None]],
        then: Callable[[int, memoryview], None],
    ) -> None:
        """Perform ``requests`` as one batch (:meth:`.Storage.read_ranges`), calling
        ``then(number, data)`` with each one's bytes; ``names`` are each request's data file
        and entry, for errors."""

        def complete(number: int, data: memoryview) -> None:
            request = requests[number]
            if len(data) != request.length:
                file, key = names[number]
                raise self._truncated(file, request.offset, request.length, len(data), key)
            then(number, data)

        try:
            counts = self.storage.read_ranges(requests, complete)
        except CheckpointError:  # a truncated file, the storage failing: said already
            raise
        except OSError as err:
            number = next((n for n, r in enumerate(requests) if r.reader.path == err.filename), 0)
            raise self.error(f"cannot read data file: {err}", *names[number]) from err
        with self.lock:
            self.bytes_read += sum(counts)


class DataFiles(SourceFiles):
    """The data files of a checkpoint whose index is ``index``, for reads by ``rank``: its
    own, and (an incremental checkpoint) those of sibling checkpoints it references, opened
    below the series root (the checkpoint's parent) one component at a time, no link followed."""

    def __init__(self, storage: Storage, index: Index, rank: int | None) -> None:
        super().__init__(storage, rank)
        self.index = index
        self._series: Storage | None = None

    def series(self) -> Storage:
        """The series root: the directory holding the checkpoint."""
        if self._series is None:
            self._series = self.storage.parent()
        return self._series

    def path(self, name: str) -> str:
        """The storage path of data file ``name`` (validated: ``data/rank-*.safetensors``, or
        ``../<checkpoint>/data/rank-*.safetensors``)."""
        reference = parse_reference(name)
        if reference is not None:
            return self.series().join(*reference)
        assert name.startswith("data/") and is_data_file_name(name[5:]), name
        return self.storage.join("data", name[5:])

    def open(self, name: str) -> Reader:
        reference = parse_reference(name)
        if reference is None:
            return super().open(name)
        try:
            series = self.series()
        except ValueError as err:
            raise FileNotFoundError(errno.ENOENT, str(err), name) from err
        return series.open_below("/".join(reference))

    def shown(self, name: str) -> str:
        if parse_reference(name) is None:
            return super().shown(name)
        try:
            return self.series().url(self.path(name))
        except ValueError:
            return name

    def error(self, message: str, file: str, key: str | None) -> CheckpointDataError:
        if parse_reference(file) is not None and "missing" in message:
            message += (
                " (a file of an earlier checkpoint of the series that this incremental checkpoint "
                "reads: was it deleted, or the checkpoint copied away from its series? Copy a "
                "checkpoint alone only after `shardwise materialize`)"
            )
        return super().error(message, file, key)

    def declared_size(self, name: str) -> int:
        """The size the index gives data file ``name``."""
        return self.index.files.get(name) or 0
