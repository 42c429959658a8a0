"""Remote shards (reference §19, SPEC deviation 12): ``init_rrefs=True`` exchanges RPC
references to every rank's shards; worker-name placements resolve through RPC.

RPC tests need dedicated processes (``rpc=True`` starts a fresh 4-rank group with
``rpc.init_rpc``), so their checks are grouped into few bodies; the error cases without RPC
run on the pooled group.
"""

from __future__ import annotations

import gc
import io
import re
import weakref

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import ChunkShardingSpec, Shard, ShardedTensor, ShardMetadata
from shardwise.sharded_tensor import remote
from tests.harness import distributed

INIT_RRREFS_WITHOUT_RPC = (
    "RPC Framework needs to be initialized using torch.distributed.rpc.init_rpc if init_rrefs "
    "is set to True"
)
NO_RREFS = "ShardedTensor created with init_rrefs=False, no RRefs to remote shards available"


def _chunk(dim: int, placements: list[str]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=placements)


def _ranks(ranks: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in ranks]


def _filled_by_rank(owners: list[int], rows: int = 3, cols: int = 4) -> ShardedTensor:
    """Rows ``rows * i ...`` on rank ``owners[i]``, every element equal to the owner's rank."""
    me = dist.get_rank()
    shards = [
        Shard(
            torch.full((rows, cols), float(me)),
            ShardMetadata([rows * i, 0], [rows, cols], f"rank:{me}/cpu"),
        )
        for i, owner in enumerate(owners)
        if owner == me
    ]
    return sw.init_from_local_shards(shards, rows * len(owners), cols, init_rrefs=True)


def _check_remote(st: ShardedTensor, owners: list[int], rows: int = 3, cols: int = 4) -> None:
    me = dist.get_rank()
    remote_shards = st.remote_shards()
    # Every other owner, never this rank, never a rank that owns nothing.
    assert sorted(remote_shards) == sorted({r for r in owners if r != me})
    for owner, rrefs in remote_shards.items():
        assert len(rrefs) == owners.count(owner)
        for rref in rrefs:
            assert rref.owner().id == owner
            shard = rref.to_here()
            assert isinstance(shard, Shard)
            assert str(shard.metadata.placement) == f"rank:{owner}/cpu"
            assert shard.metadata.shard_sizes == [rows, cols]
            assert shard.metadata.shard_offsets[0] // rows in [
                i for i, r in enumerate(owners) if r == owner
            ]
            assert torch.equal(shard.tensor, torch.full((rows, cols), float(owner)))


# -- with RPC ----------------------------------------------------------------------------------


@distributed(world_size=4, rpc=True, timeout=90)
def test_remote_shards_with_rpc() -> None:
    me = dist.get_rank()
    assert remote.live_tensor_ids() == []

    # Four owners: three entries, one RRef each, holding the owner's data.
    everyone = _filled_by_rank([0, 1, 2, 3])
    assert len(everyone.remote_shards()) == 3
    _check_remote(everyone, [0, 1, 2, 3])

    # Owners {2, 3}: ranks 2/3 see one entry, ranks 0/1 (no shards) see two.
    two = _filled_by_rank([2, 3])
    assert len(two.remote_shards()) == (1 if me in (2, 3) else 2)
    _check_remote(two, [2, 3])

    # Several shards on one owner: one RRef per shard.
    doubled = _filled_by_rank([1, 1, 3])
    _check_remote(doubled, [1, 1, 3])

    # A factory on a sub-group: the RRef exchange runs over the whole world, so rank 0 (not a
    # member) also sees every owner.
    group = dist.new_group([1, 2, 3])
    sub = sw.empty(_chunk(0, _ranks([1, 2, 3])), 9, 5, process_group=group, init_rrefs=True)
    assert sorted(sub.remote_shards()) == sorted({1, 2, 3} - {me})
    for owner, (rref,) in sub.remote_shards().items():
        assert rref.to_here().metadata == sub.metadata().shards_metadata[owner - 1]

    # Worker-name placements resolve to the RPC ids (equal to the ranks here).
    named = sw.empty(_chunk(0, [f"worker{r}/cpu" for r in range(4)]), 8, 2, init_rrefs=True)
    assert len(named.local_shards()) == 1
    assert str(named.local_shards()[0].metadata.placement) == f"worker{me}/cpu"
    assert named.local_shards()[0].metadata.shard_offsets == [2 * me, 0]
    assert sorted(named.remote_shards()) == sorted({0, 1, 2, 3} - {me})
    for owner, (rref,) in named.remote_shards().items():
        assert rref.owner().id == owner
        assert str(rref.to_here().metadata.placement) == f"worker{owner}/cpu"
    # Without init_rrefs, worker names still resolve (RPC is up).
    plain = sw.zeros(_chunk(1, ["worker3/cpu", "worker2/cpu", "worker1/cpu", "worker0/cpu"]), 2, 8)
    assert plain.local_shards()[0].metadata.shard_offsets == [0, 2 * (3 - me)]
    with pytest.raises(RuntimeError, match=f"^{re.escape(NO_RREFS)}$"):
        plain.remote_shards()

    with pytest.raises(ValueError, match=f"^{re.escape('Invalid worker name: workerfoo')}$"):
        sw.empty(_chunk(0, ["workerfoo/cpu", "worker1/cpu"]), 4, 4, init_rrefs=True)

    # Pickling keeps init_rrefs: loading (collective here) exchanges fresh RRefs.
    buffer = io.BytesIO()
    torch.save(everyone, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded._sharded_tensor_id is not None
    assert loaded._sharded_tensor_id != everyone._sharded_tensor_id
    _check_remote(loaded, [0, 1, 2, 3])

    # The registry forgets tensors once they are garbage collected.
    tensors = [everyone, two, doubled, sub, named, loaded]
    ids = sorted(t._sharded_tensor_id for t in tensors)  # type: ignore[type-var]
    assert sorted(remote.live_tensor_ids()) == ids
    assert plain._sharded_tensor_id is None
    probe = weakref.ref(everyone)
    del everyone, two, doubled, sub, named, loaded, tensors, rref
    gc.collect()
    assert probe() is None
    assert remote.live_tensor_ids() == []
    # Nobody tears RPC down while another rank still resolves its RRefs.
    dist.barrier()


# -- without RPC -------------------------------------------------------------------------------


@distributed(world_size=4)
def test_rpc_errors_without_rpc() -> None:
    names = _chunk(0, ["worker1/cpu", "worker0/cpu", "worker2/cpu", "worker3/cpu"])
    message = "RPC framework needs to be initialized for using worker names: worker1"
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        sw.empty(names, 10, 5)
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        sw.shard_tensor(torch.zeros(10, 5), names)
    spec = _chunk(0, _ranks([0, 1, 2, 3]))
    # Capital F: upstream's other message, for init_rrefs=True.
    with pytest.raises(RuntimeError, match=f"^{re.escape(INIT_RRREFS_WITHOUT_RPC)}$"):
        sw.empty(spec, 10, 5, init_rrefs=True)
    # A PyTorch build without RPC at all gets a message saying so (SPEC deviation 12).
    available = remote._rpc_available
    remote._rpc_available = lambda: False
    try:
        with pytest.raises(RuntimeError, match=re.escape("this PyTorch build does not provide")):
            sw.empty(spec, 10, 5, init_rrefs=True)
    finally:
        remote._rpc_available = available
    st = sw.empty(spec, 10, 5)
    assert st._sharded_tensor_id is None
    with pytest.raises(RuntimeError, match=f"^{re.escape(NO_RREFS)}$"):
        st.remote_shards()
    assert remote.live_tensor_ids() == []


@distributed(world_size=4)
def test_registry_errors() -> None:
    with pytest.raises(
        RuntimeError,
        match=f"^{re.escape('Could not find sharded_tensor_id: -1 in map: dict_keys([])')}$",
    ):
        remote._register_remote_shards(-1, [], 0)
    st = sw.empty(_chunk(0, _ranks([0, 1, 2, 3])), 4, 4)
    key = -2
    with remote._sharded_tensor_lock:
        remote._sharded_tensor_map[key] = weakref.ref(st)
    try:
        del st
        gc.collect()
        with pytest.raises(
            RuntimeError, match=f"^{re.escape('ShardedTensor weakref has been deallocated')}$"
        ):
            remote._register_remote_shards(key, [], 0)
    finally:
        remote._forget(key)
    assert remote.live_tensor_ids() == []
