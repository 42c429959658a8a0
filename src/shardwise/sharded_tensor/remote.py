"""Remote shards: RPC references (``RRef``) from every rank to every other rank's shards.

Used only when a ShardedTensor is created with ``init_rrefs=True``. Each such tensor gets a
process-unique id; a registry maps ids to weak references so that peers can attach RRefs to
the right tensor, and entries disappear when the tensor is garbage collected. This is the only
module besides :mod:`shardwise.collectives` that calls ``torch.distributed`` (its RPC part),
because the callback must live at a module path every worker can import.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

from shardwise import collectives

if TYPE_CHECKING:
    from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["init_rrefs", "live_tensor_ids"]

_sharded_tensor_lock = threading.Lock()
_sharded_tensor_map: dict[int, weakref.ReferenceType[ShardedTensor]] = {}
_next_id = itertools.count()


def live_tensor_ids() -> list[int]:
    """Ids of the RRef-enabled sharded tensors alive in this process."""
    with _sharded_tensor_lock:
        return list(_sharded_tensor_map)


def _rpc_available() -> bool:
    """Whether this PyTorch build has the RPC framework at all."""
    try:
        from torch.distributed import rpc
    except ImportError:  # pragma: no cover - torch built without distributed RPC
        return False
    return bool(rpc.is_available())


def _forget(sharded_tensor_id: int) -> None:
    with _sharded_tensor_lock:
        _sharded_tensor_map.pop(sharded_tensor_id, None)


def _register_remote_shards(sharded_tensor_id: int, rrefs: list[Any], rpc_rank: int) -> None:
    """RPC target: attach ``rrefs`` (sent by ``rpc_rank``) to the tensor with that id."""
    with _sharded_tensor_lock:
        if sharded_tensor_id not in _sharded_tensor_map:
            raise RuntimeError(
                f"Could not find sharded_tensor_id: {sharded_tensor_id} in map: "
                f"{_sharded_tensor_map.keys()}"
            )
        st = _sharded_tensor_map[sharded_tensor_id]()
        if st is None:
            raise RuntimeError("ShardedTensor weakref has been deallocated")
        st._remote_shards[rpc_rank] = rrefs


def init_rrefs(st: ShardedTensor) -> None:
    """Give ``st`` an id and exchange RRefs to its shards with every rank of the default group.

    Collective over the default group and the RPC framework.
    """
    if not _rpc_available():
        raise RuntimeError(
            "init_rrefs=True needs torch.distributed.rpc, which this PyTorch build does not "
            "provide (torch.distributed.rpc.is_available() is False); create the ShardedTensor "
            "with init_rrefs=False"
        )
    if not collectives.rpc_initialized():
        raise RuntimeError(
            "RPC Framework needs to be initialized using torch.distributed.rpc.init_rpc if "
            "init_rrefs is set to True"
        )
    from torch.distributed import rpc

    pg_rank = collectives.global_rank()
    rpc_rank = rpc.get_worker_info().id
    if pg_rank != rpc_rank:
        raise ValueError(
            "Default ProcessGroup and RPC ranks must be the same for ShardedTensor, found "
            f"process group rank: {pg_rank} and RPC rank: {rpc_rank}"
        )
    with _sharded_tensor_lock:
        st._sharded_tensor_id = next(_next_id)
        _sharded_tensor_map[st._sharded_tensor_id] = weakref.ref(st)
    weakref.finalize(st, _forget, st._sharded_tensor_id)

    world = collectives.resolve_group(None)
    ids = collectives.all_gather_json(st._sharded_tensor_id, world)
    if st.local_shards():
        rrefs = [rpc.RRef(shard) for shard in st.local_shards()]
        for peer, peer_id in enumerate(ids):
            if peer == rpc_rank:
                continue
            rpc.rpc_sync(peer, _register_remote_shards, args=(peer_id, rrefs, rpc_rank))
    # Nobody may use remote_shards() before every owner has registered with it.
    collectives.barrier(world)
