"""The local tier at work on one rank: its local saves and its restores, collective over the
manager's process group (``docs/local-tier.md``, *Save path*, *Restore protocol*).

:class:`TierNode` is what ``CheckpointManager`` holds when given a :class:`LocalTier`. Both
of its operations never fail the training step for the tier's sake: a local save that cannot
be made is skipped (every rank agrees, and warns), and a restore that cannot be made from the
tier returns None on every rank, so that the manager restores from the durable tier. Only
the user's own mistakes (a state dict that cannot be saved or loaded) are raised.

A local save runs in the background (:meth:`TierNode.start_save`, the manager's default with
``async_save=True``): the training thread stages the state into host memory and returns; a
thread of its own writes the part and sends the replicas over a gloo group of its own, every
step of which (file writes, checksums, gloo) runs without the GIL (``docs/local-tier.md``,
*Save path*, says why not in the async writer process). :meth:`TierNode.save` is the same
save run to its end in the caller's thread. Only data files travel at a save, from a
mapping of the sender's file into a mapping of the holder's new one (every part holds the
same index).

A restore takes two rounds at most: the first trusts the layout of the parts held and
leaves their blocks to the load, which checks every block it reads; a failure after the
agreement starts the second, which checks every block first. Each rank gets only the byte
ranges its load reads (planned without reading, by the load's own planner, which is what
makes a restore on another world size work: it reshards), its node's copies hard-linked,
the rest received into memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardwise import collectives
from shardwise._warnings import warn_at_caller
from shardwise.checkpoint.index import INDEX_NAME, Index, data_file_name, decode_index
from shardwise.checkpoint.loading.load import load_from_storage, ranges_read, report_load
from shardwise.checkpoint.local_tier import parts as part_files
from shardwise.checkpoint.local_tier.agreement import (
    HeldStep,
    Holdings,
    Needs,
    TransferPlan,
    Verdict,
    choose_step,
    needs_to_json,
    parse_gathered,
    parse_needs,
    plan_transfers,
)
from shardwise.checkpoint.local_tier.directory import PartRecord, TierDirectory
from shardwise.checkpoint.local_tier.placement import (
    Topology,
    local_world_size_from_environment,
    place_replicas,
)
from shardwise.checkpoint.local_tier.tier import LocalTier
from shardwise.checkpoint.local_tier.transport import Place, exchange_buffers
from shardwise.checkpoint.options import LoadOptions
from shardwise.checkpoint.saving.save import save_parts
from shardwise.checkpoint.saving.snapshot import Snapshot, describe_or_error
from shardwise.checkpoint.saving.staging import StagingArea, open_views
from shardwise.checkpoint.storage import LocalStorage
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    LocalTierWarning,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["TierNode"]

logger = logging.getLogger("shardwise.checkpoint.local_tier")

#: What makes a restore from the tier fall back to the durable tier: the assembled checkpoint
#: is bad (as for the manager's own fallback), or the tier's storage failed.
_FALLBACK_ERRORS = (CheckpointDataError, CheckpointFormatError, CheckpointNotFoundError, OSError)


class _Again:
    """What a restore round returns when the next one is to check every block and agree
    again."""


_AGAIN = _Again()

#: Says what went wrong with a local save: a warning now, or one kept for the training thread.
Report = Callable[[str], None]


def _data_files(index: Index, save_id: str) -> dict[int, str]:
    """The data files of the save of ``index`` (id ``save_id``), by saved rank: those of the
    ranks that wrote one."""
    names = (data_file_name(rank, save_id) for rank in range(index.save.world_size))
    return {rank: name for rank, name in enumerate(names) if name in index.files}


def _snapshot_bytes(snapshot: Snapshot) -> int:
    """What a rank's part of ``snapshot`` takes, at most (a replicated tensor counted on every
    rank, though one writes it), before the headers and the index."""
    tensors = sum(
        box.tensor.numel() * box.tensor.element_size()
        for value in snapshot.tensors.values()
        for box in value.boxes
    )
    return tensors + sum(len(value.payload) for value in snapshot.objects.values())


def _index_margin(snapshot: Snapshot) -> int:
    # Headers and the index: a few hundred bytes per entry, by judgment.
    return (1 << 20) + 512 * (len(snapshot.tensors) + len(snapshot.objects))


class TierNode:
    """The local tier of ``tier`` on this rank of ``comm`` (the manager's group)."""

    def __init__(
        self, tier: LocalTier, comm: collectives.Comm, process_group: ProcessGroup | None
    ) -> None:
        self.tier = tier
        self.comm = comm
        self._process_group = process_group
        local = tier.local_world_size
        if local is None:
            local = local_world_size_from_environment(os.environ, comm.world_size)
        self.topology = Topology(world_size=comm.world_size, local_world_size=local)
        self.placement = place_replicas(self.topology, tier.replicas)
        if self.placement.degraded:
            warn_at_caller(
                f"the local tier holds {self.placement.replicas} replica(s) of each part, not "
                f"the {tier.replicas} asked for: the job has {self.topology.num_nodes} node(s), "
                "and a part's replicas are on other nodes than its own",
                LocalTierWarning,
            )
        self.directory = TierDirectory(tier.resolved_directory, tier.resolved_job_id)
        self._refusal: str | None = None  # why this node's directory is not usable
        self._claimed = False
        self._gloo: ProcessGroup | None = None
        # The background save: its thread, what it reported, its staging area and its group.
        self._job: threading.Thread | None = None
        self._reports: list[str] = []
        self._staging: StagingArea | None = None
        self._save_comm: collectives.Comm | None = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _usable(self, report: Report | None = None) -> str | None:
        """None if this node's directory is usable, else why not (asked once)."""
        if not self._claimed:
            self._claimed = True
            self._refusal = self.directory.claim()
            if self._refusal is not None:
                (report or self._warn)(
                    f"the local tier is off on rank {self.rank}: {self._refusal}"
                )
        return self._refusal

    @staticmethod
    def _warn(message: str) -> None:
        warn_at_caller(message, LocalTierWarning)

    def _group(self) -> ProcessGroup:
        """The group parts travel over: the manager's when it is gloo, else a gloo group over
        the same ranks, made at the first transfer by the group's ranks alone."""
        if self._gloo is None:
            group = self.comm.group
            assert group is not None, "a world of one sends no part"
            if collectives.comm_device(group).type == "cpu":
                self._gloo = group
            else:  # pragma: no cover - needs a GPU
                gloo = collectives.new_gloo_group_like(group)
                assert gloo is not None
                self._gloo = gloo
        return self._gloo

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, state_dict: Mapping[str, Any]) -> bool:
        """Write this rank's part of ``step`` into its node's directory and send it to its
        holders (collective); whether the local save was made. A local save that cannot be
        made is skipped on every rank with a :class:`LocalTierWarning`.
        """
        self.finish_save()
        snapshot, error = describe_or_error(state_dict, False)
        return self._save(step, snapshot, error, self.comm, self._group, self._warn)

    def start_save(self, step: int, state_dict: Mapping[str, Any]) -> None:
        """:meth:`save` in the background (collective): wait for the local save before it,
        copy this rank's state into host memory (from GPUs: issued on a side stream, as
        ``async_save`` stages), and return; a thread writes the part and sends the replicas
        over a gloo group of its own (made at the first call, by the manager's ranks alone).
        What it reports comes as :class:`LocalTierWarning` at the next call (or
        :meth:`finish_save`)."""
        self.finish_save()
        snapshot, error = describe_or_error(state_dict, False)
        events: list[Any] = []
        if error is None:
            try:
                snapshot, events = self._stage(snapshot)
            except Exception as err:  # e.g. no memory left for the staging buffer
                error = CheckpointError(f"cannot stage the state dict: {type(err).__name__}: {err}")
                snapshot = Snapshot({}, {}, {})
        if self._save_comm is None:
            group = collectives.new_gloo_group_like(self._process_group)
            self._save_comm = collectives.Comm(group, operation="local tier save")
        comm = self._save_comm
        reports = self._reports

        def run() -> None:
            try:
                for event in events:  # the copies from GPUs are done
                    event.synchronize()
                self._save(step, snapshot, error, comm, lambda: comm.group, reports.append)
            except BaseException as err:  # never the training step's failure
                reports.append(f"the local save of step {step} failed: {err}")

        # A daemon: a training process leaving on an error does not wait for a peer that
        # never comes (a part left without its part.json is not held, and pruned later).
        self._job = threading.Thread(target=run, name="shardwise-local-tier-save", daemon=True)
        self._job.start()

    def finish_save(self) -> None:
        """Wait for the background local save, if any; warn what it reported (this rank)."""
        job, self._job = self._job, None
        if job is not None:
            job.join()
        reports, self._reports = self._reports, []
        for message in reports:
            warn_at_caller(message, LocalTierWarning)

    def _stage(self, snapshot: Snapshot) -> tuple[Snapshot, list[Any]]:
        """``snapshot`` copied into this node's staging area (reused by every local save)."""
        if self._staging is None:
            self._staging = StagingArea()
        staged, _, events = self._staging.stage(snapshot)
        assert self._staging.buffer is not None
        tensors = open_views(staged, self._staging.buffer.bytes)
        return Snapshot(tensors, staged.objects, staged.aliases), events

    def _save(
        self,
        step: int,
        snapshot: Snapshot,
        error: BaseException | None,
        comm: collectives.Comm,
        group: Callable[[], ProcessGroup | None],
        report: Report,
    ) -> bool:
        """The local save of ``snapshot`` as step ``step`` over ``comm``, the replicas over
        ``group()``; whether it was made (what went wrong goes to ``report``)."""
        me, topology = self.rank, self.topology
        reason = self._usable(report)
        if reason is None and me % topology.local_world_size == 0:
            try:  # the node's: its first local rank prunes, before any rank of it writes
                self.directory.prune(self.tier.keep, writing=step)
            except (CheckpointError, OSError) as err:
                reason = f"pruning {self.directory.path} failed ({err})"
        sizes = comm.all_gather_json(_snapshot_bytes(snapshot) + _index_margin(snapshot))
        hold = True  # whether this rank takes the replicas it holds, this time
        if reason is None:
            ranks = topology.ranks_of(topology.node_of(me))
            own = sum(sizes[rank] for rank in ranks)
            held = sum(sizes[owner] for rank in ranks for owner in self.placement.held_by(rank))
            try:
                space = self.directory.check_space(
                    own + held, min_free_bytes=self.tier.min_free_bytes
                )
                alone = self.directory.check_space(
                    own, min_free_bytes=self.tier.min_free_bytes, free_bytes=space.free_bytes
                )
            except OSError as err:
                reason = f"the free space of {self.directory.path} is unknown ({err})"
            else:
                if not alone.fits:  # not even the node's own parts: no complete step
                    reason = alone.describe(self.directory.path)
                elif not space.fits and held:  # its own parts, and the replicas elsewhere
                    hold = False
                    report(
                        f"the local save of step {step} holds no replicas on rank {me}: "
                        f"{space.describe(self.directory.path)}; the parts it would hold are "
                        "kept by their owners only"
                    )
        reasons = comm.all_gather_json(reason)
        refused = [(rank, why) for rank, why in enumerate(reasons) if why is not None]
        if refused:
            rank, why = refused[0]
            more = f" (and {len(refused) - 1} more ranks)" if len(refused) > 1 else ""
            report(f"skipped the local save of step {step}: on rank {rank}{more}, {why}")
            return False
        path = ""
        try:
            path = self.directory.make_part(step, me)
        except (CheckpointError, OSError) as err:  # raised on every rank by save_parts
            error = error or CheckpointDataError(
                f"the local tier's directory {self.directory.path} cannot take the part of "
                f"rank {me} ({err})",
                rank=me,
            )
        storage = part_files.RecyclingStorage(path, self._take(me)) if path else None
        try:
            save_id = save_parts(
                snapshot, path, comm, local_error=error, sync_files=False, storage=storage
            )
        except (CheckpointError, OSError) as err:
            report(f"the local save of step {step} failed: {err}")
            return False
        world = topology.world_size
        self._commit(PartRecord(step=step, rank=me, world_size=world, save_id=save_id), report)
        self._send_replicas(step, path, save_id, group, report, hold)
        return True

    def _take(self, rank: int) -> part_files.Take:
        """Takes a spare file of this node's directory for a data file of saved rank ``rank``."""
        return functools.partial(self.directory.take_spare, rank=rank)

    def _has_room(self, sender: int, size: int) -> bool:
        """Whether a part of ``size`` bytes from ``sender`` fits this node's directory."""
        try:
            space = self.directory.check_space(size, min_free_bytes=self.tier.min_free_bytes)
        except OSError:
            return False
        if not space.fits:
            logger.warning(
                "local tier: rank %d refuses a part of rank %d: %s",
                self.rank,
                sender,
                space.describe(self.directory.path),
            )
        return space.fits

    def _commit(self, record: PartRecord, report: Report) -> None:
        try:
            self.directory.commit_part(record)
        except (CheckpointError, OSError) as err:
            report(
                f"rank {self.rank} could not commit its local copy of part {record.rank} of "
                f"step {record.step}: {err}"
            )

    def _send_replicas(
        self,
        step: int,
        path: str,
        save_id: str,
        group: Callable[[], ProcessGroup | None],
        report: Report,
        hold: bool,
    ) -> None:
        """Send this rank's data file to its holders; keep the parts it holds if ``hold``, else
        refuse them (collective over the ranks of the placement). Only data files travel,
        from a mapping of the sender's file straight into a mapping of the holder's new one:
        every part of a save holds the same index, which each holder has in its own part."""
        if not self.placement.replicas:
            return
        me = self.rank
        text, index = b"", None
        body: mmap.mmap | None = None
        try:
            text = part_files.read_index(path)
            index = decode_index(text)
            if data_file_name(me, save_id) in index.files:
                body = part_files.map_data_file(path, me, save_id)
        except (CheckpointError, OSError, ValueError) as err:
            report(f"rank {me} cannot read its local part of step {step}: {err}")
        owners = self.placement.held_by(me)
        incoming: dict[int, part_files.IncomingDataFile] = {}

        def place(owner: int) -> Place:
            def make(sender: int, size: int) -> mmap.mmap | None:
                name = data_file_name(owner, save_id)
                if not hold or index is None or index.files.get(name) != size:
                    return None
                if not self._has_room(sender, size):
                    return None
                try:
                    target = self.directory.make_part(step, owner)
                    incoming[owner] = part_files.IncomingDataFile(
                        target, name, size, self._take(owner)
                    )
                except (CheckpointError, OSError, ValueError) as err:
                    logger.warning("local tier: rank %d cannot take part %d: %s", me, owner, err)
                    return None
                return incoming[owner].buffer

            return make

        over = group()
        assert over is not None, "a world of one holds no replica"
        try:
            received = exchange_buffers(
                over,
                [(holder, body) for holder in self.placement.holders[me]],
                [(owner, place(owner)) for owner in owners],
            )
        finally:
            for file in incoming.values():
                file.close()
            if body is not None:
                with contextlib.suppress(BufferError):  # still exported after a failure
                    body.close()
        if index is None or not hold:
            return
        world = self.topology.world_size
        for owner, got in zip(owners, received, strict=True):
            try:
                if data_file_name(owner, save_id) in index.files:
                    if got is None:
                        logger.warning(
                            "local tier: no replica of part %d of step %d came", owner, step
                        )
                        continue
                    target = self.directory.part_path(step, owner)
                else:  # a rank that wrote nothing: its part is the index alone
                    target = self.directory.make_part(step, owner)
                part_files.write_part(target, {INDEX_NAME: text})
            except (CheckpointError, OSError, ValueError) as err:
                report(
                    f"rank {me} could not keep the replica of part {owner} of step {step}: {err}"
                )
                continue
            record = PartRecord(step=step, rank=owner, world_size=world, save_id=save_id)
            self._commit(record, report)

    # -- restoring -------------------------------------------------------------------------

    def holdings(self, newer_than: int | None = None, *, thorough: bool = True) -> Holdings:
        """The parts of this node's directory that are this rank's to report (saved rank
        modulo the local world size: each part read once per node), of steps after
        ``newer_than``, checked (no collective; a part that fails its checks, or a directory
        that cannot be read, counts as none): every block's checksum when ``thorough``, else
        the layout only (its index, and its data file's size), for a load that checks every
        block it reads."""
        me = self.rank
        if self._usable() is not None:
            return Holdings(rank=me, held=())
        try:
            listed = self.directory.list_parts()
        except (CheckpointError, OSError) as err:
            logger.warning("local tier: rank %d cannot list its node's parts: %s", me, err)
            return Holdings(rank=me, held=())
        local = self.topology.local_world_size
        found: dict[tuple[int, str], tuple[set[int], set[int]]] = {}
        for step, records in listed.items():
            if newer_than is not None and step <= newer_than:
                continue  # never restored: the durable tier has as new a step
            for saved, record in records.items():
                if saved % local != me % local:
                    continue
                problem = self._check_held(step, record, thorough)
                if problem is not None:
                    logger.warning(
                        "local tier: part %d of step %d in %s left out: %s",
                        saved,
                        step,
                        self.directory.path,
                        problem,
                    )
                    continue
                sizes, held = found.setdefault((step, record.save_id), (set(), set()))
                sizes.add(record.world_size)
                held.add(saved)
        entries = tuple(
            HeldStep(
                step=step, save_id=save_id, world_size=next(iter(sizes)), parts=frozenset(held)
            )
            for (step, save_id), (sizes, held) in sorted(found.items())
            if len(sizes) == 1
        )
        return Holdings(rank=me, held=entries)

    def _check_held(self, step: int, record: PartRecord, thorough: bool) -> str | None:
        path = self.directory.part_path(step, record.rank)
        try:
            return part_files.check_stored_part(
                path, record.rank, record.save_id, record.world_size, blocks=thorough
            )
        except OSError as err:
            return f"it does not read ({err})"

    def restore(
        self,
        state_dict: MutableMapping[str, Any],
        durable_step: int | None,
        load_options: Mapping[str, Any],
    ) -> int | None:
        """Load the newest step the tier holds, if newer than ``durable_step``, into
        ``state_dict`` (collective); the step, or None on every rank when the durable tier
        is to be restored (nothing newer held, or a failure anywhere: then a
        :class:`LocalTierWarning` says why, on every rank).

        Two rounds at most. The first trusts the layout of the parts held (their index and
        sizes) and leaves their blocks to the load, which checks every block it reads (the
        tier's loads always verify, whatever ``load_options`` say); if anything fails after
        the agreement, the second checks every block of every part held, so that a part
        that fails counts as absent, and agrees again (another copy, an older step, or the
        durable tier).

        Raises:
            CheckpointError: The load failed for a reason that is not the tier's (a key
                missing from the checkpoint, with ``strict``).
        """
        options = dataclasses.replace(LoadOptions(**load_options), verify=True)
        step = self._restore_round(state_dict, durable_step, options, thorough=False)
        if isinstance(step, _Again):
            step = self._restore_round(state_dict, durable_step, options, thorough=True)
        assert not isinstance(step, _Again), "the thorough round falls back"
        return step

    def _restore_round(
        self,
        state_dict: MutableMapping[str, Any],
        durable_step: int | None,
        options: LoadOptions,
        *,
        thorough: bool,
    ) -> int | _Again | None:
        """One round of :meth:`restore`: the step, None (the durable tier), or ``_AGAIN``
        (a failure after the agreement in the round that was not ``thorough``)."""
        holdings = self.holdings(durable_step, thorough=thorough)
        records = self.comm.all_gather_json(holdings.to_json())
        try:
            verdict = choose_step(parse_gathered(records), durable_step)
        except CheckpointFormatError as err:
            self._fall_back(f"a rank's holdings are malformed: {err}")
            return None
        for note in verdict.notes:
            logger.info("local tier: %s", note)
        if verdict.source != "local":
            return None
        assert verdict.world_size is not None and verdict.step is not None

        def failed(why: str) -> _Again | None:
            if thorough:
                self._fall_back(why)
                return None
            logger.warning(
                "local tier: %s; checking every block of the parts held and agreeing again", why
            )
            return _AGAIN

        me = self.rank
        assemble: Callable[[], LocalStorage]
        if self._every_node_holds_every_part(verdict):
            # A restart with no node lost: each rank loads from its node's copies, and what
            # it reads need not be known (nothing travels).
            assemble = functools.partial(self._assemble_from_node, verdict)
        else:
            found = self._needs(verdict, state_dict, options)
            if found is None:  # the same on every rank: the broadcast index decides
                return failed(f"the index of local step {verdict.step} is not to be had")
            index, text, mine = found
            assert verdict.save_id is not None
            sizes = {
                part: index.files[name]
                for part, name in _data_files(index, verdict.save_id).items()
            }
            try:
                needs = [
                    parse_needs(record, rank=rank, sizes=sizes)
                    for rank, record in enumerate(self.comm.all_gather_json(needs_to_json(mine)))
                ]
            except CheckpointFormatError as err:
                self._fall_back(f"a rank's needed parts are malformed: {err}")
                return None
            plan = plan_transfers(verdict, [frozenset(need) for need in needs], self.topology)
            received = self._transfer(verdict, plan, needs)
            assemble = functools.partial(
                self._assemble, verdict, needs[me], received, index, text, thorough
            )
        try:
            try:
                storage, _ = self.comm.agree_or_raise(assemble)
            except (CheckpointError, OSError, ValueError) as err:
                return failed(f"assembling local step {verdict.step} failed: {err}")
            try:
                comm = collectives.Comm(self._process_group, operation="load")
                started = time.monotonic()
                result, nbytes = load_from_storage(state_dict, storage, storage.root, comm, options)
                report_load(comm, storage.root, nbytes, started, result, options.strict, "it")
            except _FALLBACK_ERRORS as err:
                return failed(f"loading local step {verdict.step} failed: {err}")
        finally:
            try:
                self.directory.remove_restore(me)
            except (CheckpointError, OSError) as err:
                logger.warning("local tier: could not remove rank %d's restore files: %s", me, err)
        logger.info("restored step %d from the local tier (save %s)", verdict.step, verdict.save_id)
        return verdict.step

    def _needs(
        self,
        verdict: Verdict,
        state_dict: MutableMapping[str, Any],
        options: LoadOptions,
    ) -> tuple[Index, bytes, Needs] | None:
        """The step's index (read by the lowest rank holding a part, broadcast: untrusted
        here, decoded and checked against the verdict), its bytes, and what loading
        ``state_dict`` reads on this rank (the byte ranges of the parts' data files), planned
        as :func:`load` plans (collective); every part's data section when the plan fails
        (the load itself then says why). None on every rank when the index is not to be had."""
        assert verdict.step is not None and verdict.save_id is not None
        source = min(holders[0] for holders in verdict.holders)
        text = None
        if self.rank == source:
            part = next(p for p, holders in enumerate(verdict.holders) if source in holders)
            try:
                data = part_files.read_index(self.directory.part_path(verdict.step, part))
                text = data.decode("utf-8", "surrogateescape")
            except OSError as err:
                logger.warning(
                    "local tier: cannot read the index of step %d: %s", verdict.step, err
                )
        text = self.comm.broadcast_json(text, src=source)
        if not isinstance(text, str):
            return None
        raw = text.encode("utf-8", "surrogateescape")
        try:
            index = decode_index(raw)
        except (CheckpointError, ValueError, RecursionError):
            return None
        if (index.save.save_id, index.save.world_size) != (verdict.save_id, verdict.world_size):
            return None
        names = {name: rank for rank, name in _data_files(index, verdict.save_id).items()}
        every = {  # the data sections (a load never reads a data file's header)
            rank: ((index.data_starts[name], index.files[name]),)
            for name, rank in names.items()
            if index.data_starts[name] < index.files[name]
        }
        try:
            ranges = ranges_read(state_dict, index, options)
        except Exception:
            return index, raw, every
        if not ranges.keys() <= names.keys():
            return index, raw, every
        return index, raw, {names[name]: tuple(runs) for name, runs in ranges.items()}

    def _fall_back(self, why: str) -> None:
        warn_at_caller(
            f"not restoring from the local tier: {why}; restoring from the durable tier",
            LocalTierWarning,
        )

    def _on_my_node(self, rank: int) -> bool:
        return self.topology.node_of(rank) == self.topology.node_of(self.rank)

    def _transfer(
        self, verdict: Verdict, plan: TransferPlan, needs: Sequence[Needs]
    ) -> dict[int, list[tuple[int, memoryview | None]]]:
        """Send the byte ranges of the parts' data files the plan has this rank send to other
        nodes (each as its receiver asked, from a mapping of its node's file), and receive
        those it gets from other nodes into memory (a same-node part is read from the node's
        directory); the pieces received, by part: ``(begin, bytes or None: it did not come)``."""
        assert verdict.step is not None and verdict.save_id is not None
        step, save_id, me = verdict.step, verdict.save_id, self.rank
        maps: list[mmap.mmap] = []
        views: list[memoryview] = []
        sends: list[tuple[int, memoryview | None]] = []
        for transfer in plan.sends_from(me):
            if self._on_my_node(transfer.receiver):
                continue
            body: mmap.mmap | None
            try:
                path = self.directory.part_path(step, transfer.part)
                body = part_files.map_data_file(path, transfer.part, save_id)
            except OSError as err:
                logger.warning("local tier: cannot read part %d to send: %s", transfer.part, err)
                body = None
            whole: memoryview | None = None
            if body is not None:
                maps.append(body)
                whole = memoryview(body)
                views.append(whole)
            for begin, end in needs[transfer.receiver][transfer.part]:
                # A file shorter than the index says sends nothing (the holder checked its
                # size; the receiver would refuse another size anyway).
                piece = None if whole is None or end > len(whole) else whole[begin:end]
                if piece is not None:
                    views.append(piece)
                sends.append((transfer.receiver, piece))
        incoming = [t for t in plan.receives_at(me) if not self._on_my_node(t.sender)]
        if self.comm.group is None:
            return {}
        group = self._group()  # on every rank: it may be made here
        if not sends and not incoming:
            return {}

        def place(sender: int, size: int) -> memoryview | None:
            if not self._has_room(sender, size):
                return None
            try:  # memory the bytes touch first: not zeroed, as a bytearray would be
                return memoryview(torch.empty(size, dtype=torch.uint8).numpy())  # type: ignore[arg-type]
            except RuntimeError:  # no memory for it
                return None

        def expecting(length: int) -> Place:
            return lambda sender, size: place(sender, size) if size == length else None

        receives = [
            (t.sender, expecting(end - begin)) for t in incoming for begin, end in needs[me][t.part]
        ]
        try:
            got = iter(exchange_buffers(group, sends, receives))
        finally:
            for view in reversed(views):
                with contextlib.suppress(BufferError):  # still exported after a failure
                    view.release()
            for body in maps:
                with contextlib.suppress(BufferError):
                    body.close()
        return {t.part: [(begin, next(got)) for begin, _ in needs[me][t.part]] for t in incoming}

    def _every_node_holds_every_part(self, verdict: Verdict) -> bool:
        """Whether every live node holds every part of the verdict's step (pure: the same
        answer on every rank)."""
        topology = self.topology
        return all(
            any(topology.node_of(holder) == node for holder in holders)
            for node in range(topology.num_nodes)
            for holders in verdict.holders
        )

    def _assemble_from_node(self, verdict: Verdict) -> LocalStorage:
        """This rank's restore directory when its node holds every part of the verdict's
        step: every part hard-linked, and their index (the same on every part)."""
        assert verdict.step is not None and verdict.save_id is not None
        assert verdict.world_size is not None
        step, save_id = verdict.step, verdict.save_id
        path = self.directory.make_restore(self.rank)
        indexes = {
            part_files.link_part(self.directory.part_path(step, part), path, part, save_id)
            for part in range(verdict.world_size)
        }
        if len(indexes) != 1:
            raise CheckpointDataError(f"the parts of local step {step} hold different indexes")
        part_files.write_part(path, {INDEX_NAME: indexes.pop()})
        return LocalStorage(path)

    def _assemble(
        self,
        verdict: Verdict,
        needed: Needs,
        received: Mapping[int, list[tuple[int, memoryview | None]]],
        index: Index,
        text: bytes,
        thorough: bool,
    ) -> part_files.ReceivedParts:
        """This rank's restore directory: the step's index ``text`` (of ``index``) and the
        parts of the verdict's step it ``needed``, its node's hard-linked (their index must
        be ``text``), the others' data files read from the pieces ``received`` (every block
        of them checked when ``thorough``; else the load checks the blocks it reads)."""
        assert verdict.step is not None and verdict.save_id is not None
        step, save_id = verdict.step, verdict.save_id
        path = self.directory.make_restore(self.rank)
        in_memory: dict[str, list[tuple[int, memoryview]]] = {}
        for part in sorted(needed):
            if part in received:
                name = data_file_name(part, save_id)
                pieces = []
                for begin, data in received[part]:
                    if data is None:
                        raise CheckpointDataError(f"part {part} of local step {step} did not come")
                    pieces.append((begin, data))
                if thorough:
                    problem = part_files.verify_pieces(pieces, name, index)
                    if problem is not None:
                        raise CheckpointDataError(f"part {part} of local step {step}: {problem}")
                in_memory[name] = pieces
            else:
                source = self.directory.part_path(step, part)
                if part_files.link_part(source, path, part, save_id) != text:
                    raise CheckpointDataError(
                        f"part {part} of local step {step} holds another index than the step's"
                    )
        part_files.write_part(path, {INDEX_NAME: text})
        return part_files.ReceivedParts(path, index, in_memory)
