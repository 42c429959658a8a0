"""The one package that talks to ``torch.distributed``.

Everything that crosses ranks goes through here: group and rank bookkeeping, JSON metadata
exchange (never pickles), verdict agreement before a collective, and the point-to-point moves
of shard bytes. Keeping it in one place makes the rest of shardwise testable without processes
and keeps the rank/group-rank translation (a classic source of bugs) in one spot.

Every collective is bounded by its process group's timeout: the backend raises once it passes.
For the checkpoint layer (:class:`Comm`, and the ``operation`` keyword of the JSON exchanges:
:func:`exchange_or_raise`, :func:`agree_or_raise`, :func:`gather_or_raise`,
:func:`scatter_or_raise`, :func:`broadcast_or_raise`, :func:`all_gather_json`,
:func:`gather_json`, :func:`scatter_json`, :func:`broadcast_json`) that failure becomes a
:class:`~shardwise.errors.CheckpointTimeoutError` that names the call, the timeout and the
ranks that did not arrive; elsewhere the backend's own error propagates.

The package's modules, by concept: :mod:`.groups` (groups and ranks), :mod:`.failures`
(timeouts and errors shared across ranks), :mod:`.exchange` (JSON and verdicts),
:mod:`.transfer` (tensor bytes), :mod:`.comm` (the checkpoint layer's view of a group).
"""

from shardwise.collectives.comm import Comm, SharedCounter
from shardwise.collectives.exchange import (
    agree_or_raise,
    all_gather_json,
    broadcast_json,
    broadcast_or_raise,
    exchange_or_raise,
    gather_json,
    gather_or_raise,
    scatter_json,
    scatter_or_raise,
)
from shardwise.collectives.failures import RemoteError, describe_error, rebuild_error
from shardwise.collectives.groups import (
    comm_device,
    global_rank,
    global_ranks,
    group_rank,
    group_timeout,
    group_world_size,
    is_initialized,
    is_member,
    new_gloo_group_like,
    resolve_group,
    rpc_initialized,
    rpc_worker_id,
    to_group_rank,
)
from shardwise.collectives.transfer import (
    all_gather_tensor,
    all_reduce,
    all_reduce_sum_int,
    all_to_all,
    barrier,
    send_recv_bytes,
)

__all__ = [
    "Comm",
    "RemoteError",
    "SharedCounter",
    "agree_or_raise",
    "all_gather_json",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_sum_int",
    "all_to_all",
    "barrier",
    "broadcast_json",
    "broadcast_or_raise",
    "comm_device",
    "describe_error",
    "exchange_or_raise",
    "gather_json",
    "gather_or_raise",
    "global_rank",
    "global_ranks",
    "group_rank",
    "group_timeout",
    "group_world_size",
    "is_initialized",
    "is_member",
    "new_gloo_group_like",
    "rebuild_error",
    "resolve_group",
    "rpc_initialized",
    "rpc_worker_id",
    "scatter_json",
    "scatter_or_raise",
    "send_recv_bytes",
    "to_group_rank",
]
