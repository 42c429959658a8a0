"""The local tier's directory on one node: its job marker, its step and part directories, what
it holds, pruning, free space (``docs/local-tier.md``, *On the node*).

Layout::

    <directory>/job.json                  {"format": "shardwise-local-tier", "version": 1,
                                           "job": "<job id>"}: whose directory this is
    <directory>/step_<N>/rank_<R>/        the part of saved rank R of local step N: a shardwise
                                          checkpoint part (written by the save code), and
    <directory>/step_<N>/rank_<R>/part.json  its part record, written last: "committed"
    <directory>/restore_<R>/              rank R's checkpoint assembled from parts during a
                                          restore (removed after it, and before the next)
    <directory>/spare/<R>.<token>         a data file of a pruned step (of saved rank R), kept
                                          for the save that pruned it to write into instead of
                                          a new file (removed at the next prune if unused)

Safety: the directory itself must be a real directory (not a link) owned by this user; one
whose marker names another job, or that holds anything without a marker, is ignored: never
written, listed or deleted. Below it, every entry is opened relative to its parent's
descriptor, links are never followed, and only names of exactly the forms above count (a link
or a file named like a step, ``step_007``, ``step_1.old``: ignored and never deleted).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardwise._codec import strict_json
from shardwise.checkpoint.index.names import is_data_file_name
from shardwise.checkpoint.local_tier.agreement import MAX_STEP, MAX_WORLD_SIZE
from shardwise.errors import CheckpointStorageError

__all__ = [
    "JOB_FILE",
    "PART_FILE",
    "SPARE_DIR",
    "PartRecord",
    "Space",
    "TierDirectory",
    "parse_rank_name",
    "parse_step_name",
    "rank_name",
    "restore_name",
    "step_name",
]

logger = logging.getLogger(__name__)

JOB_FILE = "job.json"
PART_FILE = "part.json"
_JOB_FORMAT = "shardwise-local-tier"
_PART_FORMAT = "shardwise-local-part"
_VERSION = 1
# Both records are a few hundred bytes; a larger file is no record of ours.
_RECORD_LIMIT = 4096
# ASCII digits, no leading zero: one name per number, so no two directories hold one step.
_STEP = re.compile(r"step_(0|[1-9][0-9]{0,18})")
_RANK = re.compile(r"rank_(0|[1-9][0-9]{0,7})")
# Temporary names of records being written (random, so concurrent writers never share one).
_TEMPORARY = re.compile(r"\.(job|part)\.json\.[0-9a-f]{16}\.tmp")
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A spare file taken, opened to be written over (never a link, never waiting on a FIFO).
_REUSE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
SPARE_DIR = "spare"
# A spare's name: the saved rank whose data file it was, and a random token.
_SPARE = re.compile(r"(0|[1-9][0-9]{0,7})\.[0-9a-f]{16}")


def step_name(step: int) -> str:
    """The directory name of local step ``step``."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"a step is an int from 0 to {MAX_STEP}, not {step!r}")
    return f"step_{step}"


def parse_step_name(name: str) -> int | None:
    """The step ``name`` is the directory of (exactly :func:`step_name`'s form), else None."""
    match = _STEP.fullmatch(name)
    if match is None or int(match[1]) > MAX_STEP:
        return None
    return int(match[1])


def restore_name(rank: int) -> str:
    """The directory name of live rank ``rank``'s restore directory."""
    return "restore_" + rank_name(rank).removeprefix("rank_")


def rank_name(rank: int) -> str:
    """The directory name of the part of saved rank ``rank``."""
    if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"a saved rank is an int from 0 to {MAX_WORLD_SIZE - 1}, not {rank!r}")
    return f"rank_{rank}"


def parse_rank_name(name: str) -> int | None:
    """The saved rank ``name`` is the part directory of, else None."""
    match = _RANK.fullmatch(name)
    if match is None or int(match[1]) >= MAX_WORLD_SIZE:
        return None
    return int(match[1])


@dataclass(frozen=True, slots=True)
class PartRecord:
    """What ``part.json`` says of a part: which save it belongs to."""

    step: int
    rank: int
    world_size: int
    save_id: str

    def __post_init__(self) -> None:
        step_name(self.step)
        rank_name(self.rank)
        if type(self.world_size) is not int or not 0 < self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size {self.world_size!r} is not from 1 to {MAX_WORLD_SIZE}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if type(self.save_id) is not str or _SAVE_ID.fullmatch(self.save_id) is None:
            raise ValueError(f"save_id {self.save_id!r} is not 16 lowercase hex digits")

    def encode(self, job_id: str) -> bytes:
        """The record's file content for job ``job_id``."""
        body = {"format": _PART_FORMAT, "version": _VERSION, "job": job_id}
        body.update(step=self.step, rank=self.rank, world_size=self.world_size)
        body["save_id"] = self.save_id
        return _dump(body)

    @classmethod
    def decode(cls, data: bytes, job_id: str) -> PartRecord:
        """The record in ``data``, of job ``job_id``.

        Raises:
            ValueError: ``data`` is not such a record (another job's, another format).
        """
        body = _load(data, "a part record", _PART_FORMAT)
        if set(body) != {"format", "version", "job", "step", "rank", "world_size", "save_id"}:
            raise ValueError(f"a part record has keys {sorted(body)}")
        if body["job"] != job_id:
            raise ValueError(f"a part record of job {body['job']!r}, not {job_id!r}")
        return cls(
            step=body["step"],
            rank=body["rank"],
            world_size=body["world_size"],
            save_id=body["save_id"],
        )


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def _load(data: bytes, what: str, kind: str) -> dict[str, Any]:
    body = strict_json(data, what)
    if not isinstance(body, dict) or body.get("format") != kind:
        raise ValueError(f"{what} is not a {kind} record")
    if type(body.get("version")) is not int or body["version"] != _VERSION:
        raise ValueError(f"{what} is of version {body.get('version')!r}, not {_VERSION}")
    return body


@dataclass(frozen=True, slots=True)
class Space:
    """Whether a local save fits: :meth:`TierDirectory.check_space`'s answer."""

    free_bytes: int
    needed_bytes: int
    min_free_bytes: int

    @property
    def fits(self) -> bool:
        """Whether writing ``needed_bytes`` leaves at least ``min_free_bytes`` free."""
        return self.free_bytes - self.needed_bytes >= self.min_free_bytes

    def describe(self, path: str) -> str:
        """In words, for the warning of a skipped save."""
        return (
            f"the local tier's save needs {self.needed_bytes} bytes in {path}, which has "
            f"{self.free_bytes} free, and must leave {self.min_free_bytes} free"
        )


def _read_small(parent: int, name: str) -> bytes:
    """The regular file ``name`` in directory ``parent`` (FileNotFoundError; OSError if it is
    a link, not a regular file, or larger than a record)."""
    fd = os.open(name, _READ_FLAGS, dir_fd=parent)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size > _RECORD_LIMIT:
            raise OSError(errno.EINVAL, "not a small regular file", name)
        return os.read(fd, _RECORD_LIMIT + 1)
    finally:
        os.close(fd)


def _write_small(parent: int, name: str, data: bytes, *, replace: bool) -> bool:
    """Write ``data`` to ``name`` in ``parent`` whole or not at all (a temporary file, synced,
    then renamed, or, without ``replace``, linked: False if ``name`` exists)."""
    kind = "job" if name == JOB_FILE else "part"
    temporary = f".{kind}.json.{secrets.token_hex(8)}.tmp"
    fd = os.open(temporary, _CREATE_FLAGS, 0o600, dir_fd=parent)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
            return True
        try:
            os.link(temporary, name, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=parent)


def _subdirectory(parent: int, name: str, *, create: bool) -> int:
    """A descriptor of the real directory ``name`` in ``parent`` (made if ``create``)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointStorageError(
                f"{name} in the local tier's directory is a link or not a directory", file=name
            ) from err
        raise


def _part_directories(step_fd: int) -> list[tuple[int, str]]:
    """``(saved rank, name)`` of the real part directories in a step directory, by rank."""
    with os.scandir(step_fd) as entries:
        return sorted(
            (rank, entry.name)
            for entry in entries
            if (rank := parse_rank_name(entry.name)) is not None
            and entry.is_dir(follow_symlinks=False)
        )


def _set_aside(fd: int, step: str, spare_fd: int) -> None:
    """Move the data files of step directory ``step`` into the spare directory: only regular
    files of a data file's name with no other name, in real directories (nothing followed);
    what cannot be moved is left for the step's removal."""
    try:
        step_fd = os.open(step, _DIRECTORY_FLAGS, dir_fd=fd)
    except OSError:
        return
    try:
        for rank, name in _part_directories(step_fd):
            with contextlib.suppress(OSError):  # a link or a file on the way: left as it is
                rank_fd = _subdirectory(step_fd, name, create=False)
                try:
                    data_fd = _subdirectory(rank_fd, "data", create=False)
                finally:
                    os.close(rank_fd)
                try:
                    _set_aside_files(data_fd, rank, spare_fd)
                finally:
                    os.close(data_fd)
    finally:
        os.close(step_fd)


def _set_aside_files(data_fd: int, rank: int, spare_fd: int) -> None:
    with os.scandir(data_fd) as entries:
        for entry in entries:
            if not is_data_file_name(entry.name):
                continue
            with contextlib.suppress(OSError):
                status = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(status.st_mode) and status.st_nlink == 1:
                    spare = f"{rank}.{secrets.token_hex(8)}"
                    os.rename(entry.name, spare, src_dir_fd=data_fd, dst_dir_fd=spare_fd)


def _list_spares(spare_fd: int) -> list[tuple[int, os.stat_result, str]]:
    """``(saved rank, status, name)`` of the regular files of a spare's name in ``spare/``."""
    found = []
    with os.scandir(spare_fd) as entries:
        for entry in entries:
            match = _SPARE.fullmatch(entry.name)
            if match is None:
                continue
            with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                status = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(status.st_mode):
                    found.append((int(match[1]), status, entry.name))
    return found


def _spares_by_preference(spare_fd: int, rank: int, size: int | None) -> list[str]:
    """The spares' names, best first (:meth:`TierDirectory.take_spare`)."""

    def preference(spare: tuple[int, os.stat_result, str]) -> tuple[bool, bool, int]:
        owner, status, _ = spare
        fits = size is not None and status.st_size >= size
        # Saved rank ``rank``'s first; then the smallest that holds ``size``, else the largest.
        return owner != rank, not fits, status.st_size if fits else -status.st_size

    return [name for *_, name in sorted(_list_spares(spare_fd), key=preference)]


def _take(spare_fd: int, spare: str, parent: int, name: str) -> int | None:
    """``spare`` claimed, checked and moved to ``name`` in ``parent``, opened; None if it was
    taken or removed meanwhile, or is no regular file of one name (then removed).

    Raises:
        FileExistsError: ``name`` is there already.
    """
    claimed = f".taken.{secrets.token_hex(8)}"
    try:
        os.rename(spare, claimed, src_dir_fd=spare_fd, dst_dir_fd=spare_fd)
    except FileNotFoundError:  # another rank took it
        return None
    fd = -1
    try:
        # No link is followed (ELOOP), and no FIFO waited on; it may vanish meanwhile (a
        # prune empties the spares), and then it is simply not had.
        fd = os.open(claimed, _REUSE_FLAGS, dir_fd=spare_fd)
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
            raise OSError(errno.EMLINK, "not a regular file of one name", spare)
        os.link(claimed, name, src_dir_fd=spare_fd, dst_dir_fd=parent, follow_symlinks=False)
    except FileExistsError:
        if fd >= 0:
            os.close(fd)
        raise
    except OSError as err:
        logger.debug("local tier: spare %s not taken: %s", spare, err)
        if fd >= 0:
            os.close(fd)
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(claimed, dir_fd=spare_fd)
    if os.fstat(fd).st_nlink != 1:  # given a second name meanwhile: never written
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return None
    return fd


def _ignore_vanished(function: Callable[..., Any], path: str, info: Any) -> None:
    # Another rank of the node pruned the same directory meanwhile.
    if not isinstance(info[1], FileNotFoundError):
        raise info[1]


class TierDirectory:
    """The local tier's directory of one node, for job ``job_id``.

    Nothing is touched when it is made; :meth:`claim` says whether it may be used, and every
    other method checks the marker again first (a directory that stops being this job's is
    never written or deleted).
    """

    def __init__(self, path: str, job_id: str) -> None:
        self.path = os.path.abspath(path)
        self.job_id = job_id

    def _marker(self) -> bytes:
        return _dump({"format": _JOB_FORMAT, "version": _VERSION, "job": self.job_id})

    def claim(self) -> str | None:
        """Make the directory this job's where it may be: None if it is usable, else why not
        (for a warning; the tier is then off on this node).

        Missing: made (mode 0700, parents as needed) and marked. Present: usable if its marker
        names this job, or it is empty (then marked). A link, a file, another user's directory,
        another job's marker, a marker that does not read, or entries without a marker: not
        usable, and left as they are.
        """
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path, 0o700)
            status = os.lstat(self.path)
        except OSError as err:
            return f"{self.path} cannot be made ({err})"
        if stat.S_ISLNK(status.st_mode):
            return f"{self.path} is a symbolic link (give the directory it names instead)"
        if not stat.S_ISDIR(status.st_mode):
            return f"{self.path} is not a directory"
        if status.st_uid != os.geteuid():
            return f"{self.path} belongs to another user (uid {status.st_uid})"
        try:
            with self._open(check=False) as fd:
                return self._claim_in(fd)
        except OSError as err:
            return f"{self.path} cannot be read ({err})"

    def _claim_in(self, fd: int) -> str | None:
        try:
            data = _read_small(fd, JOB_FILE)
        except FileNotFoundError:
            entries = [name for name in os.listdir(fd) if _TEMPORARY.fullmatch(name) is None]
            if entries == [JOB_FILE]:  # another rank of the node marked it meanwhile
                return self._claim_in(fd)
            if entries:
                return (
                    f"{self.path} holds {len(entries)} entries but no {JOB_FILE}: it is no "
                    "local tier directory (name an empty or new one)"
                )
            if _write_small(fd, JOB_FILE, self._marker(), replace=False):
                os.fsync(fd)
            data = _read_small(fd, JOB_FILE)
        try:
            job = _load(data, JOB_FILE, _JOB_FORMAT).get("job")
        except ValueError as err:
            return f"{self.path}/{JOB_FILE} does not read as this tier's marker ({err})"
        if job != self.job_id:
            return f"{self.path} is the local tier of another job ({job!r}, not {self.job_id!r})"
        return None

    @contextlib.contextmanager
    def _open(self, *, check: bool = True) -> Iterator[int]:
        """A descriptor of the directory; with ``check``, refused unless it is this job's."""
        try:
            fd = os.open(self.path, _DIRECTORY_FLAGS)
        except OSError as err:
            raise CheckpointStorageError(
                f"the local tier's directory cannot be opened ({err.strerror})", file=self.path
            ) from err
        try:
            if check:
                try:
                    data = _read_small(fd, JOB_FILE)
                    job = _load(data, JOB_FILE, _JOB_FORMAT).get("job")
                except (OSError, ValueError) as err:
                    raise CheckpointStorageError(
                        f"the local tier's directory has no marker of this job ({err})",
                        file=self.path,
                    ) from err
                if job != self.job_id:
                    raise CheckpointStorageError(
                        f"the local tier's directory is another job's ({job!r})", file=self.path
                    )
            yield fd
        finally:
            os.close(fd)

    def part_path(self, step: int, rank: int) -> str:
        """The path of a part's directory (no file touched)."""
        return os.path.join(self.path, step_name(step), rank_name(rank))

    def make_part(self, step: int, rank: int) -> str:
        """Make the (empty) directory of saved rank ``rank``'s part of ``step``, for the save
        code to write the part into; its path.

        Raises:
            CheckpointStorageError: The directory is not this job's, or a link or a file is
                where a directory goes.
            FileExistsError: The part directory exists (prune a step before writing it again).
        """
        with self._open() as fd:
            step_fd = _subdirectory(fd, step_name(step), create=True)
            try:
                os.mkdir(rank_name(rank), 0o700, dir_fd=step_fd)
            finally:
                os.close(step_fd)
        return self.part_path(step, rank)

    def make_restore(self, rank: int) -> str:
        """Make live rank ``rank``'s (empty) restore directory, where a restore assembles the
        checkpoint it loads from parts; its path. One left by an earlier restore is removed
        first (only a real directory of that name; nothing inside it is followed).

        Raises:
            CheckpointStorageError: The directory is not this job's, or a link or a file is
                where the restore directory goes.
        """
        name = restore_name(rank)
        with self._open() as fd:
            self._remove_restore_in(fd, name)
            os.mkdir(name, 0o700, dir_fd=fd)
        return os.path.join(self.path, name)

    def remove_restore(self, rank: int) -> None:
        """Remove live rank ``rank``'s restore directory, if there is one.

        Raises:
            CheckpointStorageError: The directory is not this job's, or a link or a file is
                where the restore directory goes.
        """
        with self._open() as fd:
            self._remove_restore_in(fd, restore_name(rank))

    def _remove_restore_in(self, fd: int, name: str) -> None:
        try:
            status = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(status.st_mode):
            raise CheckpointStorageError(
                f"{name} in the local tier's directory is a link or not a directory", file=name
            )
        shutil.rmtree(name, dir_fd=fd, onerror=_ignore_vanished)

    def commit_part(self, record: PartRecord) -> None:
        """Write the part's record, last: from then on the part is listed as held.

        Raises:
            CheckpointStorageError: The directory is not this job's, or a link is on the way.
        """
        with self._open() as fd:
            step_fd = _subdirectory(fd, step_name(record.step), create=False)
            try:
                rank_fd = _subdirectory(step_fd, rank_name(record.rank), create=False)
                try:
                    _write_small(rank_fd, PART_FILE, record.encode(self.job_id), replace=True)
                    os.fsync(rank_fd)
                finally:
                    os.close(rank_fd)
            finally:
                os.close(step_fd)

    def _step_directories(self, fd: int) -> dict[int, str]:
        steps = {}
        with os.scandir(fd) as entries:
            for entry in entries:
                step = parse_step_name(entry.name)
                if step is not None and entry.is_dir(follow_symlinks=False):
                    steps[step] = entry.name
        return steps

    def list_parts(self) -> dict[int, dict[int, PartRecord]]:
        """Step -> saved rank -> record of every committed part held here (not yet verified:
        the restore checks each part's bytes before it counts). A part directory without a
        record that reads, of other names, or whose record names another step or rank, is
        left out.

        Raises:
            CheckpointStorageError: The directory is not this job's.
        """
        held: dict[int, dict[int, PartRecord]] = {}
        with self._open() as fd:
            for step, name in sorted(self._step_directories(fd).items()):
                try:
                    step_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    parts = self._parts_in(step_fd, step)
                finally:
                    os.close(step_fd)
                if parts:
                    held[step] = parts
        return held

    def _parts_in(self, step_fd: int, step: int) -> dict[int, PartRecord]:
        parts = {}
        for rank, name in _part_directories(step_fd):
            try:
                rank_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=step_fd)
            except OSError:
                continue
            try:
                record = PartRecord.decode(_read_small(rank_fd, PART_FILE), self.job_id)
            except (OSError, ValueError) as err:
                logger.debug("local tier: step %d part %d left out: %s", step, rank, err)
                continue
            finally:
                os.close(rank_fd)
            if (record.step, record.rank) == (step, rank):
                parts[rank] = record
        return parts

    def prune(self, keep: int, *, writing: int | None = None) -> list[int]:
        """Remove all but the newest ``keep`` step directories; the steps removed.

        With ``writing`` (the step about to be written), it counts as one of the ``keep``, and
        every step directory from it on is removed first: a run writes a step only after
        restoring an older one, so those are of a run the restore abandoned. Then the data
        files of the steps removed are not freed but kept as spares, for that save to write
        into (:meth:`take_spare`: freeing a file and reserving the memory of a new one cost
        more CPU than writing it; ``docs/local-tier.md``, *Save path*), except those of the
        newest step before ``writing`` (with ``keep=1``: the save before may still be sending
        them from a mapping, which a file written over or truncated would fault); spares an
        earlier save left unused are removed first (a link or a file at ``spare/``: no spares,
        a warning). Only real directories of :func:`step_name`'s form are counted and
        removed, only regular data files with no other name become spares, and nothing
        inside them is followed (``shutil.rmtree`` on a descriptor removes a link as
        a link).

        Raises:
            CheckpointStorageError: The directory is not this job's.
            OSError: A removal failed (what was removed stays removed).
        """
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be an int >= 1, not {keep!r}")
        if writing is not None:
            step_name(writing)
        with self._open() as fd:
            steps = sorted(self._step_directories(fd), reverse=True)
            if writing is None:
                kept = steps[:keep]
            else:
                kept = [step for step in steps if step < writing][: keep - 1]
            removed = sorted(step for step in steps if step not in kept)
            # The newest step before the one written may still be sent or received by a rank
            # of this node (a rank is at most one save behind another): removed (keep=1),
            # its files are unlinked only, never written over while mapped.
            recycled: list[int] = []
            if writing is not None:
                last = max((step for step in steps if step < writing), default=None)
                recycled = [step for step in removed if step != last]
            try:
                self._remove_spares(fd)
                if recycled:
                    spare_fd = _subdirectory(fd, SPARE_DIR, create=True)
                    try:
                        for step in recycled:
                            _set_aside(fd, step_name(step), spare_fd)
                    finally:
                        os.close(spare_fd)
            except CheckpointStorageError as err:  # a link or a file at spare/: none kept
                logger.warning("local tier: no spare files in %s: %s", self.path, err)
            for step in removed:
                shutil.rmtree(step_name(step), dir_fd=fd, onerror=_ignore_vanished)
            os.fsync(fd)
        return removed

    def _remove_spares(self, fd: int) -> None:
        """Empty the spare directory, if there is one (a link there is refused, untouched)."""
        try:
            spare_fd = _subdirectory(fd, SPARE_DIR, create=False)
        except FileNotFoundError:
            return
        try:
            with os.scandir(spare_fd) as entries:
                names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
            for name, is_directory in names:
                with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                    if is_directory:
                        shutil.rmtree(name, dir_fd=spare_fd, onerror=_ignore_vanished)
                    else:
                        os.unlink(name, dir_fd=spare_fd)
        finally:
            os.close(spare_fd)

    def spare_bytes(self) -> int:
        """The bytes of the spares held (what :meth:`take_spare` gives back to a save; none
        where ``spare/`` is missing, a link or a file).

        Raises:
            CheckpointStorageError: The directory is not this job's.
        """
        with self._open() as fd:
            try:
                spare_fd = _subdirectory(fd, SPARE_DIR, create=False)
            except (FileNotFoundError, CheckpointStorageError):
                return 0
            try:
                spares = _list_spares(spare_fd)
            finally:
                os.close(spare_fd)
        # Their blocks (a sparse file frees no more than it holds); one of several names is
        # never taken.
        return sum(status.st_blocks * 512 for _, status, _ in spares if status.st_nlink == 1)

    def take_spare(self, parent: int, name: str, size: int | None, *, rank: int) -> int | None:
        """A spare file moved to ``name`` in the directory ``parent`` (a descriptor) and opened
        to be written over from its start, or None when no spare can be had (the caller then
        creates the file). Preferred: a spare of saved rank ``rank`` (a part keeps its size
        from save to save), then the smallest holding ``size`` bytes, then the largest. Its
        old bytes are still in it: the caller writes every byte and truncates the file to
        what it wrote. Several ranks may take at once: a spare is claimed by renaming it to a
        name of the taker's own; only a regular file with no other name is taken (a link,
        or a file with a second name, hard-linked from elsewhere or meanwhile, is removed
        here, never written).

        Raises:
            FileExistsError: ``name`` exists in ``parent`` (as a new file's creation would).
        """
        try:
            with self._open() as fd:
                spare_fd = _subdirectory(fd, SPARE_DIR, create=False)
        except OSError as err:  # none there, a link there, or no longer this job's
            logger.debug("local tier: no spare file (%s)", err)
            return None
        try:
            candidates = _spares_by_preference(spare_fd, rank, size)
        except OSError as err:
            logger.debug("local tier: the spares cannot be listed (%s)", err)
            candidates = []
        try:
            for candidate in candidates:
                taken = _take(spare_fd, candidate, parent, name)
                if taken is not None:
                    return taken
            return None
        finally:
            os.close(spare_fd)

    def check_space(
        self, needed_bytes: int, *, min_free_bytes: int, free_bytes: int | None = None
    ) -> Space:
        """Whether ``needed_bytes`` more (this node's part and the replicas it receives, after
        :meth:`prune`) fit, leaving ``min_free_bytes``; the free space is the file system's
        (``shutil.disk_usage``) and the spares' (the save writes into them), or
        ``free_bytes``, for tests.

        Raises:
            OSError: The file system cannot be asked.
        """
        if free_bytes is None:
            free_bytes = shutil.disk_usage(self.path).free
            with contextlib.suppress(CheckpointStorageError):  # no longer this job's: none
                free_bytes += self.spare_bytes()
        return Space(
            free_bytes=free_bytes, needed_bytes=needed_bytes, min_free_bytes=min_free_bytes
        )
