"""The settings of the local tier: where its copies live, how often, how many
(``docs/local-tier.md``).

Pure: the environment is read once, when the settings are made (every rank of a job reads the
same one, so ranks agree without exchanging it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardwise.checkpoint.index.names import PORTABLE_RULE, is_portable_name
from shardwise.checkpoint.storage import local_path

__all__ = [
    "DEFAULT_PARENT",
    "JOB_ID_VARIABLE",
    "LocalTier",
    "job_id_from_environment",
]


#: The environment variable torchrun sets to the run's rendezvous id (``--rdzv-id``).
JOB_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
#: What torchrun sets it to when no ``--rdzv-id`` was given: shared by every such job, so
#: never a job id (two jobs would take each other's copies).
_NO_RUN_ID = "none"
#: Where the default directory goes: memory, which survives a process but not the machine.
DEFAULT_PARENT = "/dev/shm"
_DEFAULT_PREFIX = "shardwise-"


def job_id_from_environment(environ: Mapping[str, str]) -> str | None:
    """The job id torchrun gives (``TORCHELASTIC_RUN_ID``), or None when it gives none (unset,
    empty, or torchrun's ``"none"`` for a run started without ``--rdzv-id``)."""
    value = environ.get(JOB_ID_VARIABLE, "")
    return None if value in ("", _NO_RUN_ID) else value


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if type(value) is not int:
        raise TypeError(f"LocalTier.{name} must be an int, not {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"LocalTier.{name} must be {bound}, not {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTier:
    """A fast second tier of a :class:`CheckpointManager`: frequent copies of every rank's part
    in node-local memory, each also held by ``replicas`` ranks on other nodes.

    Example: ``LocalTier(every_steps=50)`` under torchrun (``--rdzv-id`` names the job), or
    ``LocalTier(every_steps=50, job_id=os.environ["SLURM_JOB_ID"])``.

    Raises:
        TypeError: A field of the wrong type (the message names the field).
        ValueError: A field out of range, a directory that is a URL, or no job id (the message
            names the field and the fix).
    """

    every_steps: int
    """Write a local copy at the steps that are multiples of this (independent of the durable
    tier's ``SavePolicy``)."""

    replicas: int = 1
    """How many ranks on other nodes hold a copy of each rank's part (0: only the node's own
    copy, which survives a restart of the processes, not the loss of the node). Degraded to
    the number of other nodes where the job has fewer (``placement.effective_replicas``)."""

    keep: int = 2
    """How many of the newest local steps are kept: 2 always holds a complete step while the
    next is written; 1 halves the memory but holds none during each local save."""

    job_id: str | None = None
    """The job's id, written into the directory's ``job.json``: a directory naming another job
    is never used nor deleted. None: ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``); an
    explicit id wins. A portable name (``A-Z a-z 0-9 . _ -``)."""

    directory: str | os.PathLike[str] | None = None
    """The node-local directory of the tier. None: ``/dev/shm/shardwise-<job id>``. Made
    absolute when the settings are made; never a link, never a URL."""

    min_free_bytes: int = 1 << 30
    """A local save is skipped (with a warning) unless it leaves this much free in the
    directory's file system: ``/dev/shm`` is also what NCCL's shared-memory transport and data
    loader workers allocate from, and filling it fails them, not the save. A margin by
    judgment, not a measurement."""

    local_world_size: int | None = None
    """Ranks per node. None: ``LOCAL_WORLD_SIZE`` (torchrun's), or one node when it is unset.
    Given, it wins (for launchers that set no ``LOCAL_WORLD_SIZE``, and for tests that
    simulate nodes on one machine)."""

    resolved_job_id: str = dataclasses.field(init=False)
    """The job id in use: ``job_id``, else the environment's."""

    resolved_directory: str = dataclasses.field(init=False)
    """The absolute directory in use: ``directory``, else the default under ``/dev/shm``."""

    def __post_init__(self) -> None:
        _check_int("every_steps", self.every_steps, 1)
        _check_int("replicas", self.replicas, 0)
        _check_int("keep", self.keep, 1, 2)
        _check_int("min_free_bytes", self.min_free_bytes, 0)
        if self.local_world_size is not None:
            _check_int("local_world_size", self.local_world_size, 1)
        job = self.job_id
        if job is None:
            job = job_id_from_environment(os.environ)
            if job is None:
                raise ValueError(
                    "LocalTier.job_id is None and TORCHELASTIC_RUN_ID names no job (unset, or "
                    "torchrun's 'none' without --rdzv-id): pass job_id= (e.g. the scheduler's "
                    "job id) or start torchrun with --rdzv-id, so that no other job's copies "
                    "are taken for this one's"
                )
        elif type(job) is not str:
            raise TypeError(f"LocalTier.job_id must be a str or None, not {type(job).__name__}")
        if not is_portable_name(job):
            raise ValueError(f"LocalTier job id {job!r} is not a portable name: {PORTABLE_RULE}")
        if self.directory is None:
            directory = os.path.join(DEFAULT_PARENT, _DEFAULT_PREFIX + job)
        elif isinstance(self.directory, (str, os.PathLike)):
            text = os.fspath(self.directory)
            local = local_path(text)
            if local is None or not local:
                raise ValueError(
                    f"LocalTier.directory must be a local path (node-local memory or disk), "
                    f"not {text!r}"
                )
            directory = os.path.abspath(local)
        else:
            raise TypeError(
                f"LocalTier.directory must be a path or None, not {type(self.directory).__name__}"
            )
        object.__setattr__(self, "resolved_job_id", job)
        object.__setattr__(self, "resolved_directory", directory)

    def wants(self, step: int) -> bool:
        """Whether ``step`` is a local save's: a multiple of :attr:`every_steps` (a rule of the
        step alone, so every rank gives the same answer without exchanging it)."""
        return step % self.every_steps == 0
