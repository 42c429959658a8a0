"""Ranks of one host share the verifying pass of a load (``_shared_verify``): on real gloo
ranks of this machine, a replicated load checks each block once in all, a block only a peer
checked still stops every rank before anything is copied, and ``verify_share = 0`` turns the
sharing off."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt
import shardwise.checkpoint.load  # noqa: F401 (the module, patched below)
from tests._verified import everyones, recorded_blocks
from tests.harness import distributed

WORLD = 2
MIB = 1 << 20


def _state(fill: float | None = None) -> dict[str, torch.Tensor]:
    """Four replicated 3 MiB tensors (each rank writes two: four 1 MiB blocks per file)."""
    generator = torch.Generator().manual_seed(5)
    state = {f"w{n}": torch.randn(3 * MIB // 4, generator=generator) for n in range(4)}
    if fill is not None:
        state = {key: torch.full_like(value, fill) for key, value in state.items()}
    return state


@distributed(world_size=WORLD, timeout=60)
def test_a_replicated_load_verifies_each_block_once_per_host(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save(_state(), path)
    target = _state(fill=-1.0)
    with recorded_blocks() as seen:
        ckpt.load(target, path)
    for key, value in _state().items():
        assert torch.equal(target[key], value), key
    gathered = everyones(seen)
    shares = [set(blocks) for blocks in gathered]
    assert [len(share) for share in shares] == [len(blocks) for blocks in gathered]
    assert not shares[0] & shares[1], "a block verified by both ranks"
    every = shares[0] | shares[1]
    # Both files, every 1 MiB block of their 6 MiB of data: each rank checks half.
    assert len({file for file, _, _ in every}) == 2
    assert sum(end - begin for _, begin, end in every) == 12 * MIB
    assert [len(share) for share in shares] == [6, 6]


@distributed(world_size=WORLD, timeout=60)
def test_a_block_only_a_peer_verified_stops_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save(_state(), path)
    with recorded_blocks() as seen:
        ckpt.load(_state(fill=-1.0), path)
    theirs = everyones(seen)[1]
    file, begin, _ = max(theirs)  # a block rank 1 verifies and rank 0 reads unverified
    assert (file, begin) not in {(f, b) for f, b, _ in everyones(seen)[0]}
    if dist.get_rank() == 0:
        data = path / file
        raw = bytearray(data.read_bytes())
        raw[begin + 10] ^= 0x01
        data.write_bytes(bytes(raw))
    dist.barrier()
    target = _state(fill=-1.0)
    with pytest.raises(ckpt.ChecksumError) as caught:
        ckpt.load(target, path)
    assert caught.value.rank == 1 and caught.value.file == str(path / file)
    assert str(caught.value).startswith("checksum mismatch for ")
    # Nothing was copied on either rank.
    for key, value in target.items():
        assert torch.all(value == -1.0), key


@distributed(world_size=WORLD, timeout=60)
def test_verify_share_zero_makes_every_rank_verify_all_it_reads(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save(_state(), path)
    module = sys.modules["shardwise.checkpoint.load"]  # the package exports a function `load`
    original = module.TUNING
    module.TUNING = dataclasses.replace(original, verify_share=0)
    try:
        with recorded_blocks() as seen:
            ckpt.load(_state(fill=-1.0), path)
    finally:
        module.TUNING = original
    first, second = (set(blocks) for blocks in everyones(seen))
    assert first == second and len(first) == 12


@distributed(world_size=WORLD, timeout=60)
def test_a_malformed_summary_makes_both_ranks_verify_all_they_read(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save(_state(), path)
    module = sys.modules["shardwise.checkpoint.load"]
    original = module.summary

    def malformed(*args: Any) -> Any:
        made = original(*args)
        # Rank 1 names a file of no checkpoint: its summary does not count, on either rank.
        return {**made, "files": {"data/../x": 1}} if dist.get_rank() == 1 else made

    module.summary = malformed
    try:
        target = _state(fill=-1.0)
        with recorded_blocks() as seen:
            ckpt.load(target, path)
    finally:
        module.summary = original
    first, second = (set(blocks) for blocks in everyones(seen))
    assert first == second and len(first) == 12
    for key, value in _state().items():
        assert torch.equal(target[key], value), key
