"""Which step a restart restores from the local tier, and which rank sends which part to whom.
Pure: no I/O, no collectives.

Every live rank says what it holds, verified (its :class:`Holdings`, sent to every rank as
JSON); every rank parses every record the same way (:func:`parse_gathered`: a malformed one is
a :class:`CheckpointFormatError` on every rank), then computes the same :class:`Verdict`
(:func:`choose_step`) and, from what each rank needs, the same :class:`TransferPlan`
(:func:`plan_transfers`). Functions of their arguments only, so every rank reaches the same
answer from the same gathered input (``docs/local-tier.md``, *Restore*).

A record, as JSON::

    {"rank": 3,
     "held": [{"step": 1300, "save_id": "3de232f5f19841ef", "world_size": 4, "parts": [2, 3]}]}

``rank`` is the live rank that sends it (its place in the gathered list); each ``held`` entry
is one local save of a step (its ``save_id``: two saves of one step, by runs before and after
a fallback, are never mixed), the world size that saved it, and the saved ranks whose parts
this rank holds and verified against their checksums (a part that fails counts as absent).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shardwise.checkpoint.local_tier.placement import Topology
from shardwise.errors import CheckpointFormatError

__all__ = [
    "MAX_STEP",
    "Needs",
    "needs_to_json",
    "MAX_WORLD_SIZE",
    "HeldStep",
    "Holdings",
    "Transfer",
    "TransferPlan",
    "Verdict",
    "choose_step",
    "parse_gathered",
    "parse_holdings",
    "parse_needs",
    "plan_transfers",
]

#: The largest step (the series' bound: ``docs/manager.md``, *When to save*).
MAX_STEP = 10**19 - 1
#: The largest saved world size a record may name.
MAX_WORLD_SIZE = 1 << 24
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_RECORD_KEYS = frozenset({"rank", "held"})
_HELD_KEYS = frozenset({"step", "save_id", "world_size", "parts"})


@dataclass(frozen=True, slots=True)
class HeldStep:
    """The parts of one local save that one rank holds, verified."""

    step: int
    save_id: str
    world_size: int
    """The world size that saved the step (its parts are numbered from 0 to it)."""
    parts: frozenset[int]
    """The saved ranks whose parts are held."""

    def to_json(self) -> dict[str, Any]:
        """The entry of a record (parts sorted)."""
        return {
            "step": self.step,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "parts": sorted(self.parts),
        }


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one live rank holds of the local tier."""

    rank: int
    held: tuple[HeldStep, ...]

    def to_json(self) -> dict[str, Any]:
        """The record to send (:func:`parse_holdings` reads it back)."""
        held = sorted(self.held, key=lambda entry: (entry.step, entry.save_id))
        return {"rank": self.rank, "held": [entry.to_json() for entry in held]}


def _refuse(rank: int, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"malformed local tier holdings: {problem}", rank=rank)


def _int_in(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _keys(value: object, keys: frozenset[str], what: str, rank: int) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _refuse(rank, f"{what} is a {type(value).__name__}, not a JSON object")
    if set(value) != keys or not all(type(key) is str for key in value):
        raise _refuse(rank, f"{what} has keys {sorted(map(str, value))}, not {sorted(keys)}")
    return value


def _held_step(value: object, where: str, rank: int) -> HeldStep:
    entry = _keys(value, _HELD_KEYS, where, rank)
    step, save_id, world_size = entry["step"], entry["save_id"], entry["world_size"]
    parts = entry["parts"]
    if not _int_in(step, 0, MAX_STEP):
        raise _refuse(rank, f"{where}: step {step!r} is not an int from 0 to {MAX_STEP}")
    if type(save_id) is not str or _SAVE_ID.fullmatch(save_id) is None:
        raise _refuse(rank, f"{where}: save_id {save_id!r} is not 16 lowercase hex digits")
    if not _int_in(world_size, 1, MAX_WORLD_SIZE):
        raise _refuse(
            rank, f"{where}: world_size {world_size!r} is not an int from 1 to {MAX_WORLD_SIZE}"
        )
    if type(parts) is not list or not parts:
        raise _refuse(rank, f"{where}: parts is not a non-empty list")
    held = _part_set(parts, world_size, rank, f"{where}: part", f"{where}: parts")
    return HeldStep(step=step, save_id=save_id, world_size=world_size, parts=held)


def _part_set(
    parts: list[object], world_size: int, rank: int, one: str, all_: str
) -> frozenset[int]:
    """``parts`` checked: ranks of a saved world of ``world_size``, none twice (``one`` and
    ``all_`` begin the messages about one part and about the list)."""
    for part in parts:
        if not _int_in(part, 0, world_size - 1):
            raise _refuse(rank, f"{one} {part!r} is not a rank of the saved world of {world_size}")
    if len(set(parts)) != len(parts):
        raise _refuse(rank, f"{all_} {parts} repeat a part")
    return frozenset(parts)  # type: ignore[arg-type]  # every part is an int, checked above


def parse_holdings(record: object, *, rank: int) -> Holdings:
    """The holdings that live rank ``rank`` sent as ``record`` (decoded JSON, untrusted).

    Raises:
        CheckpointFormatError: ``record`` is not a record of the module docstring, or names
            another rank; the message says what is wrong and names ``rank``.
    """
    body = _keys(record, _RECORD_KEYS, "the record", rank)
    if body["rank"] != rank or type(body["rank"]) is not int:
        raise _refuse(rank, f"the record of rank {rank} says it is rank {body['rank']!r}")
    held = body["held"]
    if type(held) is not list:
        raise _refuse(rank, f"held is a {type(held).__name__}, not a list")
    entries = tuple(_held_step(value, f"held[{n}]", rank) for n, value in enumerate(held))
    keys = [(entry.step, entry.save_id) for entry in entries]
    if len(set(keys)) != len(keys):
        raise _refuse(rank, "held lists one save of a step twice")
    return Holdings(rank=rank, held=entries)


def parse_gathered(records: Sequence[object]) -> tuple[Holdings, ...]:
    """Every live rank's holdings, ``records[r]`` sent by rank ``r``.

    Raises:
        CheckpointFormatError: A record is malformed (the first one, by rank: every rank
            raises the same error).
    """
    return tuple(parse_holdings(record, rank=rank) for rank, record in enumerate(records))


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where a restart restores from: :func:`choose_step`'s answer."""

    source: Literal["local", "durable"]
    step: int | None
    """The local step, or the newest durable step given (None: the series has none)."""
    save_id: str | None = None
    """The local save restored (None for the durable tier)."""
    world_size: int | None = None
    """The world size that saved the local step."""
    holders: tuple[tuple[int, ...], ...] = ()
    """For each part of the local step, the live ranks holding it (sorted)."""
    notes: tuple[str, ...] = ()
    """Why newer local saves were not taken, for the log (newest first)."""


def _describe(numbers: Iterable[int], limit: int = 8) -> str:
    shown = sorted(numbers)
    text = ", ".join(map(str, shown[:limit]))
    return text + (f" and {len(shown) - limit} more" if len(shown) > limit else "")


def choose_step(holdings: Sequence[Holdings], durable_step: int | None) -> Verdict:
    """The newest local save whose every part some live rank holds, if it is newer than
    ``durable_step`` (the series' newest committed step, or None); else the durable tier.

    Two complete saves of one step (left by runs before and after a fallback, which a correct
    run does not leave) are told apart by their save ids: the greater id is taken, the same on
    every rank. A save whose holders disagree on its world size is never taken.
    """
    if durable_step is not None and not _int_in(durable_step, 0, MAX_STEP):
        raise ValueError(f"durable_step must be an int from 0 to {MAX_STEP} or None")
    sizes: dict[tuple[int, str], set[int]] = {}
    holders: dict[tuple[int, str], dict[int, set[int]]] = {}
    for holding in holdings:
        for entry in holding.held:
            key = (entry.step, entry.save_id)
            sizes.setdefault(key, set()).add(entry.world_size)
            parts = holders.setdefault(key, {})
            for part in entry.parts:
                parts.setdefault(part, set()).add(holding.rank)
    notes = []
    for key in sorted(holders, reverse=True):
        step, save_id = key
        if durable_step is not None and step <= durable_step:
            notes.append(f"local step {step} is not newer than durable step {durable_step}")
            break
        if len(sizes[key]) > 1:
            notes.append(
                f"local step {step} (save {save_id}): its holders disagree on the world size "
                f"that saved it ({_describe(sizes[key])})"
            )
            continue
        (world_size,) = sizes[key]
        missing = set(range(world_size)) - set(holders[key])
        if missing:
            notes.append(
                f"local step {step} (save {save_id}): no live rank holds the parts of saved "
                f"ranks {_describe(missing)}"
            )
            continue
        return Verdict(
            source="local",
            step=step,
            save_id=save_id,
            world_size=world_size,
            holders=tuple(tuple(sorted(holders[key][part])) for part in range(world_size)),
            notes=tuple(notes),
        )
    return Verdict(source="durable", step=durable_step, notes=tuple(notes))


#: What a live rank needs of a step: by part (saved rank), the ``[begin, end)`` byte ranges of
#: its data file, in order, disjoint and not touching.
Needs = Mapping[int, tuple[tuple[int, int], ...]]


def needs_to_json(needs: Needs) -> list[list[Any]]:
    """``needs`` as the JSON :func:`parse_needs` reads: ``[[part, [[begin, end], ...]], ...]``."""
    return [[part, [list(run) for run in runs]] for part, runs in sorted(needs.items())]


def parse_needs(record: object, *, rank: int, sizes: Mapping[int, int]) -> Needs:
    """What live rank ``rank`` needs, from ``record`` (decoded JSON, untrusted: see
    :func:`needs_to_json`), where ``sizes`` are the data files' sizes by part (a part without
    one is never needed): parts of ``sizes``, none twice, each with byte ranges inside its
    file, in order, disjoint and not touching (empty ones refused).

    Raises:
        CheckpointFormatError: It is not such a record (naming ``rank``).
    """
    if type(record) is not list:
        raise _refuse(rank, f"the needed parts are a {type(record).__name__}, not a list")
    needs: dict[int, tuple[tuple[int, int], ...]] = {}
    for entry in record:
        if type(entry) is not list or len(entry) != 2 or type(entry[1]) is not list:
            raise _refuse(rank, f"a needed part {entry!r} is not [part, [[begin, end], ...]]")
        part, runs = entry
        if type(part) is not int or part not in sizes:
            raise _refuse(rank, f"needed part {part!r} is no part with a data file")
        if part in needs:
            raise _refuse(rank, f"needed part {part} is listed twice")
        end = -1  # a range must start after the one before ends
        checked = []
        for run in runs:
            if (
                type(run) is not list
                or len(run) != 2
                or not _int_in(run[0], end + 1, sizes[part] - 1)
                or not _int_in(run[1], run[0] + 1, sizes[part])
            ):
                raise _refuse(
                    rank,
                    f"needed part {part}: {run!r} is not a byte range after the one before, "
                    f"inside its data file of {sizes[part]} bytes",
                )
            checked.append((run[0], run[1]))
            end = run[1]
        if not checked:
            raise _refuse(rank, f"needed part {part} lists no byte range")
        needs[part] = tuple(checked)
    return needs


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """One part sent from one rank to another."""

    part: int
    sender: int
    receiver: int


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """How every live rank gets the parts it needs: :func:`plan_transfers`'s answer."""

    own: tuple[tuple[int, int], ...]
    """``(rank, part)``: a part its rank holds itself, read from its own copy (sorted)."""
    sends: tuple[Transfer, ...]
    """Every transfer, sorted by part, sender, receiver."""

    def sends_from(self, rank: int) -> tuple[Transfer, ...]:
        """The transfers ``rank`` sends, in plan order (every rank walks the same order)."""
        return tuple(transfer for transfer in self.sends if transfer.sender == rank)

    def receives_at(self, rank: int) -> tuple[Transfer, ...]:
        """The transfers ``rank`` receives, in plan order."""
        return tuple(transfer for transfer in self.sends if transfer.receiver == rank)


def plan_transfers(
    verdict: Verdict, needs: Sequence[frozenset[int]], topology: Topology | None = None
) -> TransferPlan:
    """Who sends each part to each live rank that needs it (``needs[r]``: rank ``r``'s, from
    :func:`parse_needs`, as a set), for a local ``verdict``.

    A rank that holds a part reads its own copy. Every other need is served by one holder: one
    on the receiver's node where ``topology`` (of the live ranks) says there is one, else any;
    among those, the one with the fewest sends so far (ties: the lower rank). The needs with
    the fewest candidate senders are placed first, so that a part only one rank holds does
    not find that rank already loaded.

    Raises:
        ValueError: ``verdict`` is not local, ``needs`` is not one set per live rank, or names
            a part the step does not have.
    """
    if verdict.source != "local" or verdict.world_size is None:
        raise ValueError("plan_transfers needs a verdict of the local tier")
    live = len(needs)
    if topology is not None and topology.world_size != live:
        raise ValueError(f"topology has {topology.world_size} ranks, needs {live}")
    for holders in verdict.holders:
        if any(not 0 <= holder < live for holder in holders):
            raise ValueError(f"the verdict names holders beyond the {live} live ranks")
    own = []
    pending = []
    for rank, parts in enumerate(needs):
        for part in sorted(parts):
            if not 0 <= part < verdict.world_size:
                raise ValueError(f"rank {rank} needs part {part}, not a part of the step")
            holders = verdict.holders[part]
            if rank in holders:
                own.append((rank, part))
                continue
            if topology is not None:
                node = topology.node_of(rank)
                near = tuple(h for h in holders if topology.node_of(h) == node)
                holders = near or holders
            pending.append((len(holders), part, rank, holders))
    load = [0] * live
    sends = []
    for _, part, rank, holders in sorted(pending):
        sender = min(holders, key=lambda holder: (load[holder], holder))
        load[sender] += 1
        sends.append(Transfer(part=part, sender=sender, receiver=rank))
    return TransferPlan(own=tuple(own), sends=tuple(sorted(sends)))
