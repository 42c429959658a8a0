"""Writing a Hugging Face model directory: the one writer behind
:func:`~shardwise.checkpoint.save_safetensors` and
:func:`~shardwise.checkpoint.consolidate` (``shardwise consolidate``).

What a directory holds (``docs/huggingface.md``): the weight files, ``model.safetensors``
alone or ``model-00001-of-0000N.safetensors`` and so on with ``model.safetensors.index.json``
(:func:`weight_files` names and lays them out by the rules of :mod:`.files`), and maybe
``config.json``. How :class:`DirectoryWriter` puts them there:

* Nothing is written before every name the commit replaces or removes is known to be no
  directory (:meth:`DirectoryWriter.prepare`).
* Locally every file is written under a temporary name (``.NAME.TOKEN.tmp``, which
  :data:`~.files.LEFTOVER_NAME` matches) and renamed by :meth:`DirectoryWriter.commit` once
  all were written. The old index and the weight files of an earlier write that this one does
  not replace are removed *before* the renames: removed last, a write stopped between its
  renames would leave the old index (or ``model.safetensors``) beside new files, a model of old
  and new tensors that loads without a word; removed first, a stopped write leaves several
  weight files and no index, which no loader takes for a model. What killed writes left under
  temporary names is removed last.
* Object stores have no rename (fsspec copies): files are written under their final names in
  the order given (weights, then the index and the config) and the stale weight files are
  removed after them.
* After a failure :meth:`DirectoryWriter.discard` removes what was written (and the directory,
  if this write made it).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardwise.checkpoint.huggingface.files import (
    LEFTOVER_NAME,
    METADATA,
    OUTPUT_NAME,
    WEIGHT_INDEX_NAME,
    OutTensor,
    check_header_size,
    file_names,
    index_json,
)
from shardwise.checkpoint.index.data_file import FileEntry, layout_file
from shardwise.checkpoint.storage import LocalStorage, PartWriter, Storage, Writer
from shardwise.errors import CheckpointStorageError

__all__ = ["CONFIG_NAME", "DirectoryWriter", "WeightFile", "index_document", "weight_files"]

#: The model config beside the weights (what ``from_pretrained`` reads first).
CONFIG_NAME = "config.json"


@dataclass(frozen=True, slots=True)
class WeightFile:
    """One weight file of the directory, laid out.

    Attributes:
        name: Its name (``model.safetensors``, ``model-00001-of-00003.safetensors``).
        tensors: Its tensors, in the order of their data.
        header: Its header, the 8-byte length prefix included.
        size: Its size in bytes.
        starts: Where the data of each tensor starts in the file, by source key.
    """

    name: str
    tensors: tuple[OutTensor, ...]
    header: bytes
    size: int
    starts: dict[str, int]


def weight_files(groups: Sequence[Sequence[OutTensor]]) -> list[WeightFile]:
    """The weight files of ``groups`` (``files.split_files``' output), named as
    ``save_pretrained`` names them and laid out as shardwise's own data files (metadata
    ``{"format": "pt"}``, the data 64-byte aligned, so 8-byte aligned as safetensors writes it).

    Raises:
        CheckpointMismatchError: A file's header would be over what safetensors reads (named
            by the key of its first tensor).
    """
    files = []
    for name, group in zip(file_names(len(groups)), groups, strict=True):
        entries = [FileEntry(t.name, t.dtype, t.shape, t.nbytes) for t in group]
        layout = layout_file(entries, METADATA)
        if group:
            check_header_size(layout.header, name, group[0].source)
        starts = {t.source: begin for t, (begin, _) in zip(group, layout.ranges, strict=True)}
        files.append(WeightFile(name, tuple(group), layout.header, layout.size, starts))
    return files


def index_document(files: Sequence[WeightFile]) -> bytes | None:
    """The text of ``model.safetensors.index.json`` for ``files``, or None for one file (an
    unsplit model has no index)."""
    if len(files) <= 1:
        return None
    weight_map = {tensor.name: file.name for file in files for tensor in file.tensors}
    return index_json(weight_map, sum(t.nbytes for file in files for t in file.tensors))


class DirectoryWriter:
    """The files of one write of a model directory into ``storage``: all or nothing locally,
    removed again after a failure on object stores (the module's docstring tells how).

    Args:
        storage: The directory.
        token: What makes this write's temporary names its own: a random token of 16 hex
            digits (``save_safetensors``, shared by its ranks) or a process id (``consolidate``).
        actor: Who writes, for the messages (``"the save"``, ``"consolidate"``).
        retreat: What else to do, for the messages (``"save elsewhere"``).
    """

    def __init__(self, storage: Storage, token: str, actor: str, retreat: str) -> None:
        self.storage = storage
        self.local = isinstance(storage, LocalStorage)
        self._token = token
        self._actor = actor
        self._retreat = retreat
        self._created = False
        self._committed = False
        self._written: dict[str, str] = {}  # final name: the path written

    def temporary(self, name: str) -> str:
        """The path the file ``name`` is written at until the commit (its final path on an
        object store)."""
        if self.local:
            return self.storage.join(f".{name}.{self._token}.tmp")
        return self.storage.join(name)

    def prepare(self) -> None:
        """Make the directory, and refuse (locally) a directory under a name the commit
        replaces or removes, before any file is written (else the commit would fail with some
        files in place).

        Raises:
            CheckpointStorageError: Naming the directory in the way.
        """
        self._created = not self.storage.exists(self.storage.root)
        self.storage.makedirs(self.storage.root)
        if not self.local:
            return
        for name in self.storage.listdir(self.storage.root):
            path = self.storage.join(name)
            if OUTPUT_NAME.fullmatch(name) and stat.S_ISDIR(os.lstat(path).st_mode):
                raise CheckpointStorageError(
                    f"{path} is a directory, where {self._actor} puts or removes a weight "
                    f"file: remove it, or {self._retreat}",
                    file=path,
                )

    def create(self, file: WeightFile, sync: bool) -> None:
        """Create ``file`` (locally only) at its temporary name, at its final size with its
        header, for every rank to write its parts into (``storage.open_parts`` of
        :meth:`temporary`). An entry already at that name is refused, never written through
        (the token is random: only someone who read it could have put it there)."""
        assert isinstance(self.storage, LocalStorage), "positioned writes need a file system"
        path = self.temporary(file.name)
        self._written[file.name] = path  # removed by discard, even if the create fails
        writer: PartWriter = self.storage.open_parts(path, file.size)
        try:
            writer.write_at(0, [file.header])
        finally:
            writer.close(sync=sync)

    @contextlib.contextmanager
    def open(self, name: str, sync: bool = True) -> Iterator[Writer]:
        """A writer for the file ``name``, written in order: closed (durable, locally, with
        ``sync``) when the block ends, given up (nothing of it stays) when it raises. What a
        killed write of the same token (a process id, reused) left at the name goes first."""
        path = self.temporary(name)
        if self.local:
            self.storage.remove(path)
        writer = self.storage.open_write(path)
        self._written[name] = path
        try:
            yield writer
        except BaseException:
            # Given up, not closed: closing would upload what an object store has so far.
            writer.abort()
            raise
        writer.close(sync=sync and self.local)

    def write(self, name: str, data: bytes, sync: bool = True) -> None:
        """Write the small file ``name`` (the index, the config) whole."""
        with self.open(name, sync) as writer:
            writer.write(data)

    def write_index(self, files: Sequence[WeightFile], sync: bool = True) -> None:
        """Write ``model.safetensors.index.json`` for ``files`` (none for one file)."""
        document = index_document(files)
        if document is not None:
            self.write(WEIGHT_INDEX_NAME, document, sync)

    def commit(self, sync: bool = True) -> list[str]:
        """Put every file written in place, in the order written; the names placed.

        Locally: the old index and the stale weight files out of the way first, the renames,
        what killed writes left, then (with ``sync``) the directory synced. On an object store
        the files are in place already; the stale weight files are removed after them.
        """
        names = list(self._written)
        storage = self.storage
        if not self.local:
            self._committed = True
            self._remove_stale(keep_index=True)
            return names
        self._remove_stale(keep_index=False)
        for name, path in self._written.items():
            storage.rename(path, storage.join(name))
        self._committed = True
        for name in storage.listdir(storage.root):
            if LEFTOVER_NAME.fullmatch(name):
                with contextlib.suppress(OSError):  # best effort: the write is done
                    storage.remove(storage.join(name))
        if sync:
            storage.sync_dir(storage.root)
        return names

    def _remove_stale(self, keep_index: bool) -> None:
        """Remove the weight files (and, unless ``keep_index``, the index) of an earlier write
        that this one does not write: they would mix with the new ones."""
        for name in self.storage.listdir(self.storage.root):
            if not OUTPUT_NAME.fullmatch(name):
                continue
            if name not in self._written or (name == WEIGHT_INDEX_NAME and not keep_index):
                self.storage.remove(self.storage.join(name))

    def discard(self) -> None:
        """Remove every file this write wrote (and the directory, if it made it); nothing once
        committed."""
        if self._committed:
            return
        for path in self._written.values():
            with contextlib.suppress(OSError):
                self.storage.remove(path)
        if self.local and self._created:
            with contextlib.suppress(OSError):
                self.storage.remove_directory(self.storage.root)
