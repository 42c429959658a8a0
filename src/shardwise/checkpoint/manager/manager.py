"""``CheckpointManager``: a training run's checkpoints under one root (``docs/manager.md``).

Every public method is collective over the manager's process group, like ``save`` and
``load``: the decisions one rank takes (is this step due, which checkpoint is the latest) reach
every rank in one exchange, and a failure anywhere is raised on every rank. Storage work of the
series itself (step records, retention, deletion) is done by group rank 0 alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from shardwise import collectives
from shardwise._warnings import warn_at_caller
from shardwise.checkpoint.index import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    decode_index,
)
from shardwise.checkpoint.loading.load import load
from shardwise.checkpoint.local_tier.node import TierNode
from shardwise.checkpoint.local_tier.tier import LocalTier
from shardwise.checkpoint.manager.arguments import (
    as_step,
    check_policies,
    plain_metrics,
    save_failure,
    storage_failure,
    warn_if_unranked,
)
from shardwise.checkpoint.manager.deletion import apply_retention
from shardwise.checkpoint.manager.policy import RetentionPolicy, SavePolicy
from shardwise.checkpoint.manager.preemption import PreemptionNotice
from shardwise.checkpoint.manager.series import (
    REJECTED_NAME,
    open_series,
    rejection_record,
    restorable,
    step_name,
    step_record,
    write_step_record,
)
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.saving.save import async_save as _async_save
from shardwise.checkpoint.saving.save import save as _save
from shardwise.checkpoint.storage import Storage, UnsafePathError, open_storage
from shardwise.collectives.failures import bounded
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    ChecksumError,
    RestoreFallbackWarning,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CheckpointManager"]

logger = logging.getLogger("shardwise.checkpoint.manager")

#: What makes a restore fall back to the checkpoint before: the checkpoint itself is bad
#: (corrupt bytes, a missing or short data file, a malformed index, its index gone). Anything
#: else (a key missing from the state dict, a storage outage) is the caller's to fix: raised.
_FALLBACK_ERRORS = (CheckpointDataError, CheckpointFormatError, CheckpointNotFoundError)
# The step as the agreement carries it (an int64; a larger step is rare, and only compared).
_MAX_AGREED_STEP = 2**63 - 1


class _NotGiven:
    """The default of ``restore``'s arguments: not given (None is a value, the latest step)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()


@dataclass(slots=True)
class _Agreement:
    """What every rank learns at each :meth:`CheckpointManager.save` call: one all-reduce
    (MAX) of these fields as integers, in this order, so a flag is the OR over the ranks."""

    #: A preemption signal arrived on some rank.
    notice: bool = False
    #: Some rank saw its background save fail.
    failed: bool = False
    #: Group rank 0's save policy finds the step due (its rules decide for every rank).
    due: bool = False
    #: Some rank passed ``force=True``.
    force: bool = False
    #: The save policy raised on group rank 0.
    policy_failed: bool = False
    #: Some rank's ``step`` is not a step.
    bad_step: bool = False
    #: The largest step (capped at the largest int64).
    step: int = 0
    #: The largest negated step: the ranks were called with one step when it is ``-step``.
    negated_step: int = 0

    def to_ints(self) -> list[int]:
        """The fields as the all-reduce carries them."""
        return [int(getattr(self, field.name)) for field in fields(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> _Agreement:
        """The record of the all-reduced integers (:meth:`to_ints`)."""
        notice, failed, due, force, policy_failed, bad_step, step, negated_step = values
        return cls(
            notice=bool(notice),
            failed=bool(failed),
            due=bool(due),
            force=bool(force),
            policy_failed=bool(policy_failed),
            bad_step=bool(bad_step),
            step=step,
            negated_step=negated_step,
        )

    @property
    def one_step(self) -> bool:
        """Whether every rank was called with the same step."""
        return self.step == -self.negated_step

    @property
    def saves(self) -> bool:
        """Whether this call saves: due, forced, or preempted."""
        return self.due or self.force or self.notice


def _restore_arguments(
    positional: tuple[Any, ...], step: Any, state_dict: Any
) -> tuple[object, MutableMapping[str, Any]]:
    """The step (None: the newest) and the state dict of a :meth:`CheckpointManager.restore`
    call, given positionally or by keyword: ``restore(step, state_dict)``, or the form
    before 1.0, a mapping first, ``restore(state_dict, step)``.

    Raises:
        TypeError: No state dict, more than two positional arguments, or the step or the
            state dict given twice.
    """
    if len(positional) > 2:
        raise TypeError(f"restore() takes at most 2 positional arguments ({len(positional)} given)")
    first, second = (*positional, _NOT_GIVEN, _NOT_GIVEN)[:2]
    if isinstance(first, Mapping):  # the form before 1.0
        first, second = second, first
    for name, given, keyword in (("step", first, step), ("state_dict", second, state_dict)):
        if given is not _NOT_GIVEN and keyword is not _NOT_GIVEN:
            raise TypeError(f"restore() got multiple values for argument {name!r}")
    wanted = first if step is _NOT_GIVEN else step
    target = second if state_dict is _NOT_GIVEN else state_dict
    if target is _NOT_GIVEN:
        raise TypeError(
            "restore() missing the state dict to load into: restore(step, state_dict), "
            "step None for the newest checkpoint"
        )
    return (None if wanted is _NOT_GIVEN else wanted), target


class CheckpointManager:
    """Saves, keeps, deletes and restores the checkpoints of one training run under ``root``.

    Each checkpoint is a directory ``root/step-NNNNNNNN`` written by :func:`async_save` (or
    :func:`save`). Every method is collective over ``process_group``: call it on every rank,
    :meth:`save` at every step.

    Args:
        root: Directory or fsspec URL of the series (``s3://bucket/run-7``).
        save_policy: When :meth:`save` saves (default: every call).
        retention: Which checkpoints are kept (default: all).
        async_save: Write in the background (:func:`async_save`), at most one save in flight;
            False saves synchronously.
        preemption_signals: Signals (e.g. ``[signal.SIGTERM, signal.SIGUSR1]``) that make the
            next :meth:`save` save on every rank, synchronously; then :attr:`preempted` is
            True. The manager must be made in the main thread; :meth:`close` restores the
            previous handlers.
        process_group: The ranks saving together (default: the default group, if any).
        storage_options: fsspec options for URLs (every rank must be given the same).
        sync_files: As for :func:`save`.
        incremental: Each save builds on the checkpoint before it (the last one this manager
            saved or restored, else the newest of the series): a chunk whose bytes did not
            change is referenced, not written (``docs/manager.md``, *Incremental saves*).
        local_tier: A second, fast tier (:class:`LocalTier`): every ``every_steps`` steps,
            each rank's part in node-local memory and on ranks of other nodes; a restore
            takes its newest step when it is newer than the series' (``docs/manager.md``,
            *Local tier*). With ``async_save`` the local save runs in the background too
            (the state staged, the rest in a thread of its own); else it finishes in
            :meth:`save`.

    Example:
        >>> with CheckpointManager("ckpt", save_policy=SavePolicy(every_steps=100),
        ...                        retention=RetentionPolicy(keep_last=3)) as manager:
        ...     start = manager.restore(None, state) or 0
        ...     for step in range(start + 1, 1001):
        ...         train_one_step()
        ...         manager.save(step, state, metrics={"loss": loss})
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        retention: RetentionPolicy | None = None,
        async_save: bool = True,
        preemption_signals: Iterable[int | signal.Signals] = (),
        process_group: ProcessGroup | None = None,
        storage_options: dict[str, Any] | None = None,
        sync_files: bool = True,
        incremental: bool = False,
        local_tier: LocalTier | None = None,
    ) -> None:
        check_policies(save_policy, retention)
        if local_tier is not None and not isinstance(local_tier, LocalTier):
            raise TypeError(f"local_tier must be a LocalTier, not {type(local_tier).__name__}")
        self.root = os.path.expanduser(os.fspath(root))
        self.save_policy = save_policy or SavePolicy()
        self.retention = retention or RetentionPolicy()
        self._async = async_save
        self._process_group = process_group
        self._storage_options = storage_options
        self._sync_files = sync_files
        self.incremental = incremental
        #: The step an incremental save builds on (the last saved or restored; None: unknown).
        self._base_step: int | None = None
        self._comm = collectives.Comm(process_group, operation="CheckpointManager")
        self._storage = open_series(self.root, storage_options, self._comm.world_size)
        self._in_flight: concurrent.futures.Future[Metadata] | None = None
        self._in_flight_step: int | None = None
        #: The step of this manager's last save known to have committed: kept by the retention
        #: whatever the listing holds (a newer checkpoint of another run, or a bogus one).
        self._committed_step: int | None = None
        self._untidy = False  # a save committed since rank 0 last applied the retention
        self._tidied_after: concurrent.futures.Future[Metadata] | None = None
        self._last_save = time.monotonic()
        self._warned_unranked = False  # warn_if_unranked: once per manager
        self._closed = False
        #: True once a preemption notice made :meth:`save` save: stop training and exit.
        self.preempted = False
        self._notice = PreemptionNotice(preemption_signals)
        self.local_tier = local_tier
        self._tier = None if local_tier is None else TierNode(local_tier, self._comm, process_group)
        #: Where the last :meth:`restore` took the state from: ``"local"`` (the local tier),
        #: ``"durable"`` (the series root), or None (nothing restored: a fresh start).
        self.restored_from: Literal["local", "durable"] | None = None

    # -- paths and listings --------------------------------------------------------------

    def path(self, step: int) -> str:
        """The checkpoint directory (or URL) of ``step``: ``root/step-00000100``."""
        return self._storage.url(self._storage.join(step_name(as_step(step))))

    def _checkpoint_path(self, step: int) -> str:
        """:meth:`path` of ``step``, once group rank 0 has found there a real directory of the
        series, or nothing (collective: every rank agrees, and raises alike).

        ``load`` follows a link at the path it is given (the caller chose it), so a link (or a
        file) named like a step below the root is refused here: nothing of a series is read
        through a link out of it.

        Raises:
            CheckpointNotFoundError: The entry of that name is a link or not a directory.
            CheckpointStorageError: The storage failed.
        """
        path = self.path(step)

        def check() -> None:
            try:
                self._storage.listdir(self._storage.join(step_name(step)))
            except UnsafePathError as err:
                raise CheckpointNotFoundError(
                    f"no checkpoint of the series at {path}: it is not a real directory (a "
                    "symbolic link, or a file named like a step), and a series follows no link "
                    "below its root",
                    file=path,
                ) from err
            except OSError as err:
                raise storage_failure(err, f"cannot list {path}") from err

        self._comm.broadcast_or_raise(check, src=0)
        return path

    def _open_step(self, step: int) -> Storage:
        return open_storage(self.path(step), self._storage_options)

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints that a restore may choose, oldest first.

        One listing, on group rank 0, sent to every rank: all get the same answer.
        """
        self._check_open()
        return list(self._comm.broadcast_or_raise(self._listed_steps, src=0))

    def _listed_steps(self) -> list[int]:
        """:meth:`steps` from a listing of this rank's own (no collective)."""
        return self._restorable()[0]

    def _restorable(self) -> tuple[list[int], int]:
        """:func:`restorable` of the series (no collective)."""
        try:
            return restorable(self._storage)
        except OSError as err:  # the root is a file, unreadable, ...
            raise storage_failure(err, f"cannot list the series at {self.root}") from err

    def latest_step(self) -> int | None:
        """The step of the newest committed checkpoint (None when there is none)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------------------

    def _local_agreement(
        self, step: int | None, force: bool
    ) -> tuple[_Agreement, Exception | None]:
        """This rank's part of the agreement (``step`` None: this rank's step is invalid), and
        the error of the save policy when it raised here."""
        mine = _Agreement(notice=bool(self._notice.pending), force=force, bad_step=step is None)
        previous = self._in_flight
        if previous is not None and previous.done() and not previous.cancelled():
            mine.failed = previous.exception() is not None
        # MAX of the step and of its negation: the ranks called with one step when they match.
        mine.step = min(step or 0, _MAX_AGREED_STEP)
        mine.negated_step = -mine.step
        policy_error: Exception | None = None
        if self._comm.rank == 0 and not force and step is not None:  # its rules decide for all
            try:
                elapsed = time.monotonic() - self._last_save
                mine.due = bool(self.save_policy.wants(step, seconds_since_save=elapsed))
            except Exception as err:  # the user's should_save: raised on every rank below
                policy_error = err
                mine.policy_failed = True
        return mine, policy_error

    def _agree(self, mine: _Agreement) -> _Agreement:
        """Each field's maximum over the ranks: one all-reduce of a few integers."""
        if self._comm.group is None:
            return mine
        tensor = torch.tensor(mine.to_ints(), dtype=torch.int64)
        with bounded(self._comm.group, "CheckpointManager.save"):
            collectives.all_reduce(tensor, "max", self._comm.group)
        return _Agreement.from_ints([int(value) for value in tensor.tolist()])

    def _agreed_call(self, given: object, force: bool) -> tuple[int, _Agreement]:
        """``save``'s step, and what the ranks agreed at this call (collective), once every
        failure that any rank saw is raised on every rank: a background save that failed, a
        step that is not one or differs between ranks, a save policy that raised."""
        try:
            step: int | None = as_step(given)
        except ValueError as err:  # raised below, once every rank knows (no rank waits alone)
            bad_step: ValueError | None = err
            step = None
        else:
            bad_step = None
        mine, policy_error = self._local_agreement(step, force)
        agreed = self._agree(mine)
        if agreed.failed:
            self._raise_background_failure()
        if agreed.bad_step:
            if bad_step is not None:
                raise bad_step
            raise ValueError(
                f"step must be an int >= 0: another rank called save with one that is not "
                f"(this rank: {given!r})"
            )
        assert step is not None
        if not agreed.one_step:
            raise CheckpointError(
                f"the ranks called save with different steps (from {-agreed.negated_step} to "
                f"{agreed.step}; this rank: {step}): save is collective, every rank saves "
                "the same step"
            )
        if agreed.policy_failed:
            if policy_error is not None:
                raise policy_error
            raise CheckpointError(
                f"the save policy raised on rank 0 at step {step} (should_save); see rank 0's error"
            )
        return step, agreed

    def save(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        *,
        metrics: Mapping[str, object] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state_dict`` as step ``step`` when it is due (collective: call it every step).

        Due: the save policy fires on group rank 0, ``force`` is True on any rank, or a
        preemption signal reached any rank. A due save first waits for the one in flight; it
        then starts in the background (returns once the state is copied), or, when preempted
        or not async, finishes before returning.

        Args:
            metrics: Numbers recorded with the checkpoint (``keep_best`` ranks by one); rank
                0's are recorded.

        Returns:
            Whether it saved.

        Raises:
            CheckpointError: The save, or the background save before it, failed (on every
                rank, at this call or the next).
            TypeError: A metric is not a number.
            ValueError: ``step`` is not an int >= 0 on some rank (on every rank).
        """
        self._check_open()
        step, agreed = self._agreed_call(step, bool(force))
        if self._tier is not None and self._tier.tier.wants(step):  # beside the save policy
            if self._async:
                self._tier.start_save(step, state_dict)
            else:
                self._tier.save(step, state_dict)
        if not agreed.saves:
            self._tidy_if_done()
            return False
        preempting = agreed.notice
        self._prepare_save(step, metrics)
        if self._comm.rank == 0 and not self._warned_unranked:  # its metrics are recorded
            self._warned_unranked = warn_if_unranked(self.retention, metrics, step, self.root)
        self._start_save(step, state_dict, synchronous=preempting or not self._async)
        if preempting:
            if self._comm.rank == 0:
                logger.warning(
                    "saved %s after a preemption notice; stop training now", self.path(step)
                )
            self.preempted = True
            self._notice.clear()
        return True

    def _prepare_save(self, step: int, metrics: Mapping[str, object] | None) -> None:
        """Before a due save (collective): finish the save in flight (at most one; its failure
        reaches every rank), then rank 0 applies the retention and writes the step record."""

        def prepare() -> None:
            self._finish_in_flight()
            if self._comm.rank == 0:
                self._tidy()
                record = step_record(step, plain_metrics(metrics), self.retention)
                write_step_record(self._storage, step, record, self.path(step))

        self._comm.agree_or_raise(prepare)
        self._last_save = time.monotonic()

    def _save_options(self, step: int) -> dict[str, Any]:
        """The keywords of ``save``/``async_save`` for ``step`` (the base of an incremental
        save included: collective when the series is asked for it)."""
        options: dict[str, Any] = {
            "process_group": self._process_group,
            "storage_options": self._storage_options,
            "sync_files": self._sync_files,
        }
        if self.incremental:
            options["incremental"] = True
            base = self._base_step if self._base_step is not None else self._series_base()
            if base is not None and base != step:
                options["base"] = self.path(base)
        return options

    def _start_save(self, step: int, state_dict: Mapping[str, Any], *, synchronous: bool) -> None:
        """Start the save of ``step`` in the background, or (``synchronous``) run it to its
        commit and apply the retention."""
        path = self.path(step)
        options = self._save_options(step)
        self._base_step = None  # until this save is known to have started (or committed)
        try:
            if synchronous:
                _save(state_dict, path, **options)
            else:
                self._in_flight = _async_save(state_dict, path, **options)
                self._in_flight_step = step
        except OSError as err:
            raise save_failure(err, path)  # noqa: B904 (its cause is err, or it is err)
        if synchronous:
            self._untidy = True
            self._committed_step = step
            if self._comm.rank == 0:
                self._tidy()
        self._base_step = step

    def _series_base(self) -> int | None:
        """The newest good checkpoint of the series whose index decodes: the base of an
        incremental save when this manager has none (collective: rank 0 reads, all agree).

        One whose index does not decode (junk named like a checkpoint, a corrupt index) is
        passed over: a save building on it would fail, and so would every save after it.
        """

        def newest() -> int | None:
            for step in reversed(self._listed_steps()):
                path = self._storage.join(step_name(step), INDEX_NAME)
                try:
                    decode_index(self._storage.read_small(path, MAX_INDEX_BYTES))
                except (CheckpointError, OSError, ValueError, RecursionError) as err:
                    logger.warning("not building on %s: %s", self.path(step), err)
                    continue
                return step
            return None

        return self._comm.broadcast_or_raise(newest, src=0)  # type: ignore[no-any-return]

    def _finish_in_flight(self) -> None:
        """Wait for the save in flight and raise its error (this rank's own)."""
        step = self._in_flight_step
        future, self._in_flight, self._in_flight_step = self._in_flight, None, None
        if future is not None:
            try:
                future.result()
            except BaseException as err:
                self._base_step = None  # it did not commit: the next save asks the series
                raise save_failure(err, self.path(step or 0))  # noqa: B904 (as above)
            self._untidy = self._untidy or future is not self._tidied_after  # once a commit
            self._committed_step = step

    def _raise_background_failure(self) -> None:
        """Raise the failure of the background save that some rank saw fail (every rank)."""
        step = self._in_flight_step
        future, self._in_flight, self._in_flight_step = self._in_flight, None, None
        self._base_step = None  # it did not commit: the next save asks the series
        assert future is not None, "a rank reported a failed save that no rank started"
        error = future.exception()  # waits: the save is collective, it ends on every rank
        if error is not None:
            raise save_failure(error, self.path(step or 0))
        raise CheckpointError(
            f"the background save of step {step} to {self.path(step or 0)} failed on another "
            "rank (its error is raised there); this rank's part finished"
        )

    def wait(self) -> None:
        """Finish the save in flight (collective); raise its failure on every rank."""
        self._check_open()
        if self._tier is not None:
            self._tier.finish_save()
        self._comm.agree_or_raise(self._finish_in_flight)
        if self._comm.rank == 0:
            self._tidy()

    # -- retention -------------------------------------------------------------------------

    def _tidy_if_done(self) -> None:
        """Rank 0: :meth:`_tidy` once the save in flight has committed (no waiting)."""
        if self._comm.rank != 0:
            return
        future = self._in_flight
        if future is not None and future is not self._tidied_after:
            if not future.done() or future.cancelled() or future.exception() is not None:
                return  # running, or failed: reported to every rank at the next call
            self._tidied_after = future
            self._untidy = True
            self._committed_step = self._in_flight_step
        self._tidy()

    def _tidy(self) -> None:
        """Rank 0, after a commit: delete what the retention policy drops, and finish
        interrupted deletions. Failures are logged: the next commit tries again."""
        if not self._untidy:
            return
        self._untidy = False
        writing = self._in_flight_step
        # Being written, and this manager's last commit: the newest of this run, even where
        # the series holds newer ones (an abandoned run's, or a bogus one).
        own = [step for step in (writing, self._committed_step) if step is not None]
        apply_retention(self._storage, self.retention, own, writing, self._open_step, self.path)

    # -- restoring -------------------------------------------------------------------------

    @overload
    def restore(
        self,
        step: int | None = None,
        state_dict: MutableMapping[str, Any] = ...,
        *,
        strict: bool = True,
        verify: bool = True,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
        progress: bool = False,
    ) -> int | None: ...

    @overload
    def restore(  # the form before 1.0, accepted: restore(state_dict, step=None)
        self,
        state_dict: MutableMapping[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        verify: bool = True,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
        progress: bool = False,
    ) -> int | None: ...

    def restore(
        self,
        *positional: Any,
        step: Any = _NOT_GIVEN,
        state_dict: Any = _NOT_GIVEN,
        strict: bool = True,
        verify: bool = True,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
        progress: bool = False,
    ) -> int | None:
        """Load the newest committed checkpoint (or ``step``'s) into ``state_dict``, in place:
        ``restore(step, state_dict)``, or ``restore(None, state_dict)`` for the newest.

        With a ``local_tier``, ``restore(None, state_dict)`` first takes the tier's newest
        step when it is newer than the series' newest checkpoint (:meth:`restore_local`);
        :attr:`restored_from` says which tier the state came from.

        A checkpoint that turns out corrupt or incomplete (:class:`ChecksumError`,
        :class:`CheckpointDataError`, :class:`CheckpointFormatError`, its index gone) is
        skipped with a :class:`RestoreFallbackWarning` on every rank naming it and why, marked
        rejected (``shardwise ls`` shows it; it is no longer the latest), and the one before it
        is loaded into the same state dict: every tensor is filled again from the start.

        The form before 1.0, ``restore(state_dict)`` and ``restore(state_dict, step)`` (a
        mapping first), is accepted as well and means the same.

        Args:
            step: Restore exactly this step (no fallback); None: the newest, with fallback.
            state_dict: The state to fill, as for :func:`load`.
            strict: As for :func:`load`.
            verify: As for :func:`load`.
            allow_pickle: As for :func:`load`.
            allow_dtype_cast: As for :func:`load`.
            progress: As for :func:`load`.

        Returns:
            The step restored, or None when the series has no committed checkpoint.

        Raises:
            CheckpointError: ``step``'s checkpoint cannot be loaded, every checkpoint failed,
                or a load failed for a reason that is not the checkpoint's (a missing key).
            TypeError: No state dict is given, or ``step`` or ``state_dict`` twice.
            ValueError: ``step`` is not an int >= 0 on some rank (on every rank).

        Example:
            >>> start = manager.restore(None, state) or 0
        """
        wanted, target = _restore_arguments(positional, step, state_dict)
        return self._restore(
            wanted,
            target,
            strict=strict,
            verify=verify,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
            progress=progress,
        )

    def _restore(
        self, step: object, state_dict: MutableMapping[str, Any], **load_options: bool
    ) -> int | None:
        """:meth:`restore` of its arguments sorted out (``load_options``: :func:`load`'s)."""
        step = self._agreed_restore_step(step)
        self.wait()
        options: dict[str, Any] = {
            "process_group": self._process_group,
            "storage_options": self._storage_options,
            **load_options,
        }
        self.restored_from = None
        if step is not None:
            load(state_dict, self._checkpoint_path(step), **options)
            self._base_step = step
            self.restored_from = "durable"
            return step
        failed: list[str] = []
        self._check_open()
        good, rejected = self._comm.broadcast_or_raise(self._restorable, src=0)
        local = self._restore_local(state_dict, good, load_options)
        if local is not None:
            return local
        candidate: int
        for candidate in reversed(good):
            path = self.path(candidate)
            try:
                # Listed as a directory, but checked again: it may be a link by now.
                result = load(state_dict, self._checkpoint_path(candidate), **options)
            except _FALLBACK_ERRORS as err:
                if self._storage_failed(err):  # not the checkpoint's fault: nothing rejected
                    raise
                failed.append(f"{path}: {err}")
                # Another shardwise's format is not corruption: kept for a version that reads it.
                unread = isinstance(err, CheckpointVersionError)
                self._reject(candidate, str(err), record=not unread)
                continue
            if failed and result.missing_keys:
                raise CheckpointError(
                    f"restored {path} after skipping {len(failed)} checkpoint(s), but it lacks "
                    f"keys {result.missing_keys[:5]} that a failed load may have partly "
                    "filled; restore with strict=True, or from a checkpoint that has them"
                )
            self._base_step = candidate
            self.restored_from = "durable"
            return candidate
        if failed:
            raise CheckpointError(
                f"no checkpoint under {self.root} could be restored: " + "; ".join(failed)
            )
        if rejected:  # a fresh start, but not a fresh series: say so
            warn_at_caller(
                f"no checkpoint under {self.root} can be restored: earlier restores rejected "
                f"{rejected} committed checkpoint(s) (`shardwise ls` says why); starting "
                "from scratch",
                RestoreFallbackWarning,
            )
        return None

    def restore_local(
        self,
        state_dict: MutableMapping[str, Any],
        *,
        strict: bool = True,
        verify: bool = True,
        allow_pickle: bool = False,
        allow_dtype_cast: bool = False,
        progress: bool = False,
    ) -> int | None:
        """Load the local tier's newest step into ``state_dict``, in place, if it is newer than
        the series' newest committed checkpoint (collective): the first half of
        ``restore(None, state_dict)``, for a caller that restores the series' checkpoint its
        own way (torchtitan's seed checkpoint: the model alone).

        Args:
            state_dict: The state to fill, as for :func:`load`.
            strict: As for :func:`load`.
            verify: As for :func:`load` (the local tier's loads always verify).
            allow_pickle: As for :func:`load`.
            allow_dtype_cast: As for :func:`load`.
            progress: As for :func:`load`.

        Returns:
            The step restored (then :attr:`restored_from` is ``"local"``), or None on every
            rank (no local tier, no newer local step held, or the tier failed: a
            :class:`LocalTierWarning` says why, and ``state_dict`` may then hold part of
            the step: restore it from the series).

        Raises:
            CheckpointError: The load failed for a reason that is not the tier's (a key
                missing from the checkpoint, with ``strict``).
        """
        self.wait()
        good, _ = self._comm.broadcast_or_raise(self._restorable, src=0)
        options = {
            "strict": strict,
            "verify": verify,
            "allow_pickle": allow_pickle,
            "allow_dtype_cast": allow_dtype_cast,
            "progress": progress,
        }
        self.restored_from = None
        return self._restore_local(state_dict, good, options)

    def _restore_local(
        self, state_dict: MutableMapping[str, Any], good: list[int], load_options: dict[str, Any]
    ) -> int | None:
        """The local tier's step newer than ``good[-1]`` (the series' newest restorable
        checkpoint), loaded into ``state_dict``; None when there is none (collective)."""
        if self._tier is None:
            return None
        local = self._tier.restore(state_dict, good[-1] if good else None, load_options)
        if local is not None:
            self._base_step = None  # not a checkpoint of the series: the next asks it
            self.restored_from = "local"
        return local

    def _agreed_restore_step(self, step: object) -> int | None:
        """``step`` of :meth:`restore` (None: the latest), once every rank has found it valid and
        the same (collective: a rank given a bad one does not raise alone)."""

        def checked() -> int | None:
            return None if step is None else as_step(step)

        mine, every = self._comm.exchange_or_raise(checked)
        if any(value != every[0] for value in every):
            raise CheckpointError(
                f"the ranks called restore with different steps ({', '.join(map(str, every))} "
                "by rank; None: the latest): restore is collective, every rank restores the "
                "same checkpoint"
            )
        return mine

    def _storage_failed(self, err: CheckpointError) -> bool:
        """Whether the storage failed the load on some rank (a permission refused, an I/O
        error, too many open files: an outage, maybe passing), rather than the checkpoint
        being bad (a missing or short file, a corrupt byte, a malformed index). Collective:
        only the rank that failed knows the cause (the others raise a copy of its error), and
        every rank must take the same branch."""
        cause = err.__cause__
        mine = (
            isinstance(cause, OSError)
            and not isinstance(cause, (FileNotFoundError, UnsafePathError, CheckpointError))
            and not isinstance(err, ChecksumError)
        )
        _, (failed,) = self._comm.agree_or_raise(lambda: None, lambda _: [int(mine)], 1)
        return failed > 0

    def _reject(self, step: int, reason: str, record: bool = True) -> None:
        """Warn that ``step`` is skipped, and (``record``) mark it rejected on rank 0."""
        warn_at_caller(
            f"cannot restore {self.path(step)}: {reason}; restoring the checkpoint before it",
            RestoreFallbackWarning,
        )
        if self._comm.rank != 0 or not record:
            return
        try:
            self._storage.replace_small(
                self._storage.join(step_name(step), REJECTED_NAME), rejection_record(reason)
            )
        except OSError as err:
            logger.warning("could not mark %s rejected: %s", self.path(step), err)

    # -- lifetime --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.root} is closed")

    def close(self) -> None:
        """Finish the save in flight (collective) and restore the signal handlers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._notice.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error, maybe on this rank alone: no collective, only this rank's wait.
        self._closed = True
        self._notice.close()
        if self._in_flight is not None:
            concurrent.futures.wait([self._in_flight])
