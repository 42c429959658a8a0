"""Groups and ranks: the default group, group ranks and global ranks (a classic source of
bugs, kept in one spot), the device and timeout of a group's collectives, and RPC workers."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "comm_device",
    "global_rank",
    "global_ranks",
    "group_rank",
    "group_timeout",
    "group_world_size",
    "is_initialized",
    "is_member",
    "new_gloo_group_like",
    "resolve_group",
    "rpc_initialized",
    "rpc_worker_id",
    "to_group_rank",
]


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def resolve_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """``process_group``, or the default group when it is ``None``."""
    if process_group is not None:
        return process_group
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return group


def global_rank() -> int:
    """This process's rank in the default group."""
    return dist.get_rank()


def group_rank(process_group: ProcessGroup) -> int:
    """This process's rank in ``process_group`` (-1 when not a member)."""
    return dist.get_rank(process_group)


def is_member(process_group: ProcessGroup) -> bool:
    """Whether this process belongs to ``process_group``."""
    return group_rank(process_group) >= 0


def group_world_size(process_group: ProcessGroup) -> int:
    """Number of ranks in ``process_group``."""
    return dist.get_world_size(process_group)


def global_ranks(process_group: ProcessGroup) -> list[int]:
    """Global ranks of ``process_group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(process_group))


def to_group_rank(process_group: ProcessGroup, rank: int) -> int:
    """The group rank of global ``rank`` in ``process_group``."""
    if process_group is dist.group.WORLD:
        return rank
    return dist.get_group_rank(process_group, rank)


def group_timeout(process_group: ProcessGroup) -> timedelta | None:
    """The timeout of ``process_group``'s collectives (``None`` when its backend does not say).

    It is the ``timeout`` given to ``init_process_group``/``new_group`` (or set since), read
    from the backend that runs the group's collectives on :func:`comm_device`.
    """
    try:
        timeout = process_group._get_backend(comm_device(process_group)).options._timeout
    except (AttributeError, RuntimeError, TypeError):  # a backend without options, or fake
        return None
    return timeout if isinstance(timeout, timedelta) else None


def comm_device(process_group: ProcessGroup) -> torch.device:
    """The device collectives of ``process_group`` run on: CPU for gloo, else the accelerator."""
    backend = str(dist.get_backend(process_group))
    if "gloo" in backend.split(":") or "gloo" in backend:
        return torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rpc_initialized() -> bool:
    """Whether ``torch.distributed.rpc`` has an agent in this process."""
    try:
        from torch.distributed import rpc
    except ImportError:  # pragma: no cover - torch built without distributed RPC
        return False
    return bool(rpc.is_available() and rpc._is_current_rpc_agent_set())  # type: ignore[attr-defined]


def rpc_worker_id(worker_name: str) -> int:
    """The RPC id of the worker called ``worker_name``.

    Raises:
        RuntimeError: RPC is not initialized.
        ValueError: No worker has that name.
    """
    if not rpc_initialized():
        raise RuntimeError(
            f"RPC framework needs to be initialized for using worker names: {worker_name}"
        )
    from torch.distributed import rpc

    for info in rpc._get_current_rpc_agent().get_worker_infos():  # type: ignore[attr-defined]
        if info.name == worker_name:
            return int(info.id)
    raise ValueError(f"Invalid worker name: {worker_name}")


def new_gloo_group_like(process_group: ProcessGroup | None) -> ProcessGroup | None:
    """A new gloo group over the same ranks, with the same timeout, made by those ranks alone
    (collective over ``process_group``, not the default group).

    Background checkpoint writes use it so that they never interleave with the training
    job's own collectives on the original group; they wait for a missing rank no longer than
    the original group would (not torch's default of 30 minutes).

    Over a subgroup the other ranks neither take part nor count the new group (torch's
    ``use_local_synchronization``): they may be busy elsewhere, and the groups that the whole
    world makes later still meet, which a group made the default way by some ranks only
    breaks (it numbers the groups of its members only). Its name is torch's hash of the ranks
    and of how many groups each of them knows, so they must have made the same groups before
    (as SPMD code does).
    """
    if process_group is None and not is_initialized():
        return None
    original = resolve_group(process_group)
    ranks = global_ranks(original)
    group: ProcessGroup | None = dist.new_group(
        ranks=ranks,
        timeout=group_timeout(original),
        backend="gloo",
        use_local_synchronization=len(ranks) < dist.get_world_size(),
    )
    return group
