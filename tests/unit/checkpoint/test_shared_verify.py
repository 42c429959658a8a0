"""The split of a load's verifying pass among the ranks of one host (``_shared_verify``):
every block that ranks of one host touch in one file is verified by exactly one of them, one
that touches it; anything that does not match (another host, another file identity, a
malformed summary) leaves each rank verifying its own blocks."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint import _shared_verify as shared_verify
from shardwise.checkpoint._shared_verify import MAX_RANGES, host_key, own_share, summary
from shardwise.checkpoint._verify import Block
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.storage import _LocalReader

FILES = {"data/rank-00000.safetensors": 10_000, "data/rank-00001.safetensors": 10_000}
A, B = sorted(FILES)
HOST = "b7c1a7a2-0000-4000-8000-000000000001"
IDENTITY = {A: [64, 1001, 10_000, 17], B: [64, 1002, 10_000, 18]}


def _block(file: str, begin: int, end: int) -> Block:
    chunk = SavedChunk((), (), file, begin, end, "")
    return Block(file, begin, end, "0" * 16, "k", chunk, 0)


def _grid(file: str, numbers: list[int], size: int = 100) -> list[Block]:
    """Blocks ``numbers`` of ``file`` in a grid of ``size`` bytes from byte 64."""
    return [_block(file, 64 + n * size, 64 + (n + 1) * size) for n in numbers]


def _summaries(per_rank: list[list[Block]], hosts: list[str] | None = None) -> list[Any]:
    hosts = hosts or [HOST] * len(per_rank)
    return [
        summary(blocks, IDENTITY.get, host) for blocks, host in zip(per_rank, hosts, strict=True)
    ]


def _shares(per_rank: list[list[Block]], summaries: list[Any]) -> list[list[Block]]:
    return [own_share(blocks, summaries, rank, FILES) for rank, blocks in enumerate(per_rank)]


def test_summary_merges_adjacent_blocks_per_file_and_skips_empty_ones() -> None:
    blocks = [*_grid(A, [3, 0, 1, 1, 5]), *_grid(B, [2]), _block(A, 9_000, 9_000)]
    assert summary(blocks, IDENTITY.get, HOST) == {
        "host": HOST,
        "files": {
            A: [IDENTITY[A], [[64, 264], [364, 464], [564, 664]]],
            B: [IDENTITY[B], [[264, 364]]],
        },
    }
    # No host, no file identity (an object store), nothing to share, too many ranges: None.
    assert summary(blocks, IDENTITY.get, None) is None
    assert summary(blocks, lambda _: None, HOST) is None
    assert summary([], IDENTITY.get, HOST) is None
    scattered = _grid(A, list(range(0, 2 * MAX_RANGES + 2, 2)), size=1)
    assert summary(scattered, IDENTITY.get, HOST) is None


def test_two_ranks_reading_the_same_blocks_each_verify_half() -> None:
    blocks = _grid(A, list(range(10)))
    shares = _shares([blocks, blocks], _summaries([blocks, blocks]))
    assert [b.begin for b in shares[0]] == [64 + 100 * n for n in range(5)]
    assert [b.begin for b in shares[1]] == [64 + 100 * n for n in range(5, 10)]


def test_blocks_only_one_rank_touches_stay_with_it() -> None:
    first = _grid(A, [0, 1, 2, 3])
    second = _grid(A, [2, 3, 4, 5])
    shares = _shares([first, second], _summaries([first, second]))
    # Blocks 2-3 are shared, one each (the segment is the file's second: its turn starts at
    # rank 1); 0-1 and 4-5 have one reader.
    assert [b.begin for b in shares[0]] == [64, 164, 364]
    assert [b.begin for b in shares[1]] == [264, 464, 564]


def test_files_of_one_block_each_spread_over_the_ranks() -> None:
    per_file = [_grid(A, [0]), _grid(B, [0])]
    both = [*per_file[0], *per_file[1]]
    shares = _shares([both, both], _summaries([both, both]))
    assert shares == per_file


def test_other_hosts_identities_and_malformed_summaries_do_not_share() -> None:
    blocks = _grid(A, list(range(6)))
    # Another host: each verifies all.
    summaries = _summaries([blocks, blocks], [HOST, HOST.replace("1", "2")])
    assert _shares([blocks, blocks], summaries) == [blocks, blocks]
    # Another identity of the same name (a file rewritten between the ranks' opens).
    other = summary(blocks, lambda _: [64, 1001, 10_000, 99], HOST)
    assert _shares([blocks, blocks], [_summaries([blocks])[0], other]) == [blocks, blocks]
    good = _summaries([blocks])[0]
    malformed: list[Any] = [
        None,
        "text",
        {"host": HOST},
        {**good, "extra": 1},
        {"host": "", "files": good["files"]},
        {"host": HOST * 10, "files": good["files"]},
        {"host": HOST, "files": {"data/../../etc/passwd": good["files"][A]}},
        {"host": HOST, "files": {A: [IDENTITY[A]]}},
        {"host": HOST, "files": {A: [[], [[64, 664]]]}},
        {"host": HOST, "files": {A: [[1.5], [[64, 664]]]}},
        {"host": HOST, "files": {A: [[True], [[64, 664]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[64, 64]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[-1, 664]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[64, 364], [364, 664]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[364, 664], [64, 164]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[64, 664, 1]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [["64", 664]]]}},
        {"host": HOST, "files": {A: [IDENTITY[A], [[64, 10_001]]]}},  # past the file's end
        {"host": HOST, "files": {A: [IDENTITY[A], [[2 * i, 2 * i + 1] for i in range(70_000)]]}},
    ]
    for bad in malformed:
        # The sender of a malformed summary verifies all of its blocks, and so does its peer.
        assert _shares([blocks, blocks], [good, bad]) == [blocks, blocks], bad
        assert _shares([blocks, blocks], [bad, good]) == [blocks, blocks], bad
    # A rank outside the list (never expected) verifies everything.
    assert own_share(blocks, [good], 3, FILES) == blocks


@st.composite
def _loads(draw: st.DrawFn) -> tuple[list[list[Block]], list[str]]:
    """2-5 ranks on 1-2 hosts, each touching any blocks of two files of irregular blocks."""
    bounds = {
        file: sorted(draw(st.sets(st.integers(65, 9_999), min_size=1, max_size=12)))
        for file in FILES
    }
    grids = {
        file: list(zip([64, *cuts], [*cuts, 10_000], strict=True)) for file, cuts in bounds.items()
    }
    ranks = draw(st.integers(2, 5))
    per_rank = []
    for _ in range(ranks):
        blocks = []
        for file, grid in grids.items():
            chosen = draw(st.sets(st.integers(0, len(grid) - 1), max_size=len(grid)))
            blocks += [_block(file, *grid[n]) for n in sorted(chosen)]
        per_rank.append(blocks)
    hosts = [draw(st.sampled_from([HOST, HOST.replace("1", "2")])) for _ in range(ranks)]
    return per_rank, hosts


@settings(max_examples=300, deadline=None)
@given(_loads())
def test_every_block_a_host_touches_is_verified_once_by_a_rank_that_touches_it(
    load: tuple[list[list[Block]], list[str]],
) -> None:
    per_rank, hosts = load
    shares = _shares(per_rank, _summaries(per_rank, hosts))
    for rank, (blocks, share) in enumerate(zip(per_rank, shares, strict=True)):
        assert set(map(_place, share)) <= set(map(_place, blocks)), f"rank {rank} got others'"
    for host in set(hosts):
        on_host = [r for r, h in enumerate(hosts) if h == host]
        touched = {_place(b) for r in on_host for b in per_rank[r]}
        verified = [_place(b) for r in on_host for b in shares[r]]
        assert sorted(verified) == sorted(touched), "a block verified twice or not at all"


def _place(block: Block) -> tuple[str, int, int]:
    return block.file, block.begin, block.end


def test_the_host_key_is_the_boot_id_and_the_checkpoint_s_real_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.setattr(shared_verify, "boot_id", lambda: HOST)
    key = host_key(str(tmp_path / "a"))
    assert key is not None and len(key) == 32
    # The same directory by another path shares; a copy elsewhere does not.
    assert host_key(str(tmp_path / "link")) == key
    assert host_key(str(tmp_path / "b")) != key
    monkeypatch.setattr(shared_verify, "boot_id", lambda: HOST.replace("1", "2"))
    assert host_key(str(tmp_path / "a")) != key
    monkeypatch.setattr(shared_verify, "boot_id", lambda: None)
    assert host_key(str(tmp_path / "a")) is None


def test_a_local_file_without_an_inode_number_has_no_identity(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    status = os.fstat(fd)
    reader = _LocalReader(str(path), fd, status)
    try:
        assert reader.shared_identity == [
            status.st_dev,
            status.st_ino,
            10,
            status.st_mtime_ns,
        ]
        fields = list(status)
        fields[stat.ST_INO] = 0
        assert _LocalReader(str(path), fd, os.stat_result(fields)).shared_identity is None
    finally:
        reader.close()
