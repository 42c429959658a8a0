"""The verifying pass of a load, shared by the ranks of one host (pure: no I/O, no collective).

Ranks of one host that read one data file read it through one page cache, and the second pass
of a load reads every byte again after the first has checked it (:mod:`._verify`). A block
that one rank of the host has verified is therefore exactly as trustworthy to the others as if
each had verified it: each block that several ranks of a host touch is verified by one of them.
A load in which every rank reads the whole state (DDP-style replicated tensors, a resharded
load whose reads cross the saved chunks) then hashes each block once per host instead of once
per rank.

The protocol (``docs/architecture.md``, *Load*):

1. Each rank summarizes the blocks it will verify (:func:`summary`): a key of its host and
   checkpoint (:func:`host_key`: the host's boot id and the checkpoint directory's real path)
   and, per data file, the file's identity on the host (device, inode, size, modification
   time, read from the descriptor it reads through) and the merged byte ranges of its
   blocks.
2. The summaries travel with the load plans (one ``all_gather`` that already exists), so every
   rank holds the same list.
3. Each rank keeps the blocks it is the verifier of (:func:`own_share`): ranks whose summaries
   name the same host key, file name and identity form a group; the byte ranges of a file are cut
   at every endpoint of the group's ranges into segments, each touched by the same ranks
   throughout; a segment touched by ``k`` ranks is split into ``k`` slices of equal bytes, and
   a block belongs to the rank of the slice its first byte lies in. The ranks take the slices
   in rank order, rotated by the file's number (in name order) plus the segment's number (in
   the group's cuts), so that files of one block each spread over the ranks. Every rank
   derives the same split from the same list, and a rank is only ever given blocks it touches.
4. The verdicts of the first pass are exchanged before any byte is copied, as before: a block
   that fails on the rank that verifies it fails the load on every rank.

A summary comes from another rank and is not trusted: one that is not well formed counts as a
rank that does not share (every rank sees the same list and so agrees, the sender too, which
then verifies all of its blocks itself). Only local files share (an object store gives no
identity), and only with ``TUNING.verify_share`` on.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import xxhash

from shardwise.checkpoint._verify import Block

__all__ = ["MAX_RANGES", "boot_id", "host_key", "own_share", "summary"]

#: A rank with more separate byte ranges than this does not share (its summary would be large
#: and the split slow, for blocks scattered so thinly that sharing buys little).
MAX_RANGES = 1 << 16
_MAX_TEXT = 128  # a boot id is 36 characters
_MAX_IDENTITY = 8  # ints of a file identity


@functools.cache
def boot_id() -> str | None:
    """This host's boot id (Linux): equal for two processes exactly when they run on one
    kernel, and so read one page cache. ``None`` where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            text = file.read(_MAX_TEXT).strip()
    except OSError:
        return None
    return text or None


def host_key(path: str) -> str | None:
    """What ranks that may share the checking of the checkpoint at local ``path`` have in
    common: the xxh3-128 of this host's boot id and the directory's real path (ranks that load
    copies of one checkpoint from different directories check their own, even where a file
    system reports the same identities for the copies). ``None`` without a boot id."""
    host = boot_id()
    if host is None:
        return None
    text = f"{host}\0{os.path.realpath(path)}".encode("utf-8", "surrogateescape")
    return str(xxhash.xxh3_128_hexdigest(text))


def summary(
    blocks: Iterable[Block], identity_of: Callable[[str], list[int] | None], host: str | None
) -> dict[str, Any] | None:
    """What this rank tells the others of the blocks it would verify: ``{"host": host,
    "files": {name: [identity, [[begin, end], ...]]}}`` with each file's byte ranges merged
    and in order, or ``None`` (nothing to share: no host, no file with an identity, or more
    than :data:`MAX_RANGES` ranges)."""
    if host is None:
        return None
    unique = {(block.file, block.begin): block.end for block in blocks if block.end > block.begin}
    ranges: dict[str, list[list[int]]] = {}
    count = 0
    for file, begin in sorted(unique):
        end = unique[file, begin]
        merged = ranges.setdefault(file, [])
        if merged and merged[-1][1] >= begin:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
            count += 1
    if count > MAX_RANGES:
        return None
    files: dict[str, list[Any]] = {}
    for file, merged in ranges.items():
        identity = identity_of(file)
        if identity is not None:
            files[file] = [list(identity), merged]
    return {"host": host, "files": files} if files else None


def own_share(
    blocks: Sequence[Block],
    summaries: Sequence[object],
    rank: int,
    known: Mapping[str, int | None],
) -> list[Block]:
    """The blocks of ``blocks`` (this rank's, as summarized in ``summaries[rank]``) that this
    rank verifies, given every rank's summary (``None`` or malformed: a rank that does not
    share). ``known``: the data files of the checkpoint with their declared sizes (``None``:
    not declared); a summary naming another file, or bytes past a declared size, is
    malformed."""
    checked = [_checked(entry, known) for entry in summaries]
    mine = checked[rank] if 0 <= rank < len(checked) else None
    if mine is None:
        return list(blocks)
    host, files = mine
    numbers = {name: number for number, name in enumerate(sorted(known))}
    segments: dict[str, tuple[list[int], list[_Segment]]] = {}
    for file, (identity, ranges) in files.items():
        group: list[tuple[int, list[tuple[int, int]]]] = []
        for other, entry in enumerate(checked):
            if entry is None or entry[0] != host:
                continue
            theirs = entry[1].get(file)
            if theirs is not None and theirs[0] == identity:
                group.append((other, theirs[1]))
        if len(group) > 1:
            found = _segments(group, ranges, numbers[file])
            segments[file] = ([segment[0] for segment in found], found)
    kept = []
    for block in blocks:
        split = segments.get(block.file)
        if split is None or block.end <= block.begin:
            kept.append(block)
            continue
        starts, found = split
        place = bisect.bisect_right(starts, block.begin) - 1
        if place < 0 or not found[place][0] <= block.begin < found[place][1]:
            kept.append(block)  # outside every range summarized (not expected): verify it
            continue
        begin, end, ranks, turn = found[place]
        count = len(ranks)
        if ranks[((block.begin - begin) * count // (end - begin) + turn) % count] == rank:
            kept.append(block)
    return kept


#: ``(begin, end, ranks, turn)``: bytes of a file that ``ranks`` all touch; the slice of
#: number ``s`` goes to ``ranks[(s + turn) % len(ranks)]``.
_Segment = tuple[int, int, tuple[int, ...], int]


def _segments(
    group: Sequence[tuple[int, Sequence[tuple[int, int]]]],
    mine: Sequence[tuple[int, int]],
    file_number: int,
) -> list[_Segment]:
    """The segments of one file inside this rank's ranges ``mine``, in file order, each with
    the ranks of ``group`` (``(rank, its ranges)``, in rank order) whose ranges hold all of
    it, and its turn: ``file_number`` plus its number in the group's cuts (the same for
    every rank of the group)."""
    cuts = sorted({point for _, ranges in group for span in ranges for point in span})
    covering: list[_Segment] = []
    for begin, end in mine:
        first = bisect.bisect_left(cuts, begin)
        last = bisect.bisect_left(cuts, end)
        for number in range(first, last):
            left, right = cuts[number], cuts[number + 1]
            ranks = tuple(rank for rank, ranges in group if _covers(ranges, left, right))
            covering.append((left, right, ranks, file_number + number))
    return covering


def _covers(ranges: Sequence[tuple[int, int]], begin: int, end: int) -> bool:
    """Whether one of the sorted, disjoint ``ranges`` holds all of ``[begin, end)``."""
    place = bisect.bisect_right(ranges, (begin, float("inf"))) - 1
    return place >= 0 and ranges[place][0] <= begin and end <= ranges[place][1]


def _checked(
    entry: object, known: Mapping[str, int | None]
) -> tuple[str, dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]]] | None:
    """A summary as ``(host, {file: (identity, ranges)})``, or ``None`` unless it is exactly
    what :func:`summary` makes: a host of at most 128 characters; known file names; an
    identity of at most 8 ints; sorted, disjoint, non-empty ranges of ints >= 0 inside the
    file's declared size, at most :data:`MAX_RANGES` in all."""
    if not isinstance(entry, dict) or set(entry) != {"host", "files"}:
        return None
    host, files = entry["host"], entry["files"]
    if not isinstance(host, str) or not 0 < len(host) <= _MAX_TEXT or not isinstance(files, dict):
        return None
    result: dict[str, tuple[tuple[int, ...], list[tuple[int, int]]]] = {}
    count = 0
    for file, value in files.items():
        if not isinstance(file, str) or file not in known:
            return None
        if not isinstance(value, list) or len(value) != 2:
            return None
        identity, ranges = value
        if (
            not isinstance(identity, list)
            or not 0 < len(identity) <= _MAX_IDENTITY
            or not all(type(part) is int for part in identity)
            or not isinstance(ranges, list)
        ):
            return None
        count += len(ranges)
        if count > MAX_RANGES:
            return None
        size = known[file]
        spans: list[tuple[int, int]] = []
        last = -1
        for span in ranges:
            if (
                not isinstance(span, list)
                or len(span) != 2
                or type(span[0]) is not int
                or type(span[1]) is not int
                or not last < span[0] < span[1]
                or (size is not None and span[1] > size)
            ):
                return None
            spans.append((span[0], span[1]))
            last = span[1]
        result[file] = (tuple(identity), spans)
    return host, result
