"""``clip_grad_norm_``: torch's gradient-norm clipping over plain and ShardedTensor parameters.

``torch.nn.utils.clip_grad_norm_`` reads ``param.grad`` of every parameter as one whole
tensor, which a ShardedTensor parameter is not: its gradient lives in its local shards, each
rank holding different ones. Here the norm is global:

* each shard of a sharded parameter counts once, on the rank that holds it: every rank adds
  ``|g|^p`` over its local shards' gradients, and one all-reduce (a sum; a max for the inf
  norm) over the sharded parameters' process group adds the ranks;
* a plain (replicated) parameter counts once too, *without* communication: its gradient is
  assumed to be the same on every rank (as after ``DistributedDataParallel``'s averaging, or
  after :class:`~shardwise.ShardedOptimizer`'s ``sync_replicated_grads`` sum). Adding it on
  every rank would count it world-size times.

The result is the norm ``torch.nn.utils.clip_grad_norm_`` returns for the same model
unsharded, on every rank alike, and every gradient (local shards and plain) is scaled in place
by the same coefficient, ``min(max_norm / (total_norm + 1e-6), 1)``, as torch scales them.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["clip_grad_norm_"]

#: torch's fused per-tensor kernels (``torch._foreach_*``) run on these device types.
_FOREACH_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def _foreach_error(device: torch.device) -> RuntimeError:
    return RuntimeError(
        f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
    )


def _use_foreach(device: torch.device, foreach: bool | None) -> bool:
    supported = device.type in _FOREACH_DEVICE_TYPES
    if foreach and not supported:
        raise _foreach_error(device)
    return supported if foreach is None else foreach


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each non-empty one of ``grads`` (in no particular order).

    Empty gradients (an empty trailing chunk's shard) add nothing to a sum or a max, and
    torch refuses their inf norm.
    """
    norms: list[torch.Tensor] = []
    non_empty = [grad for grad in grads if grad.numel()]
    for (device, _), group in _by_device_and_dtype(non_empty).items():
        if _use_foreach(device, foreach):
            norms.extend(torch._foreach_norm(group, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(grad, norm_type) for grad in group)
    return norms


def _partial(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``[sum of norm**p (max for inf), nan flag]`` of ``norms``, in float64 on ``device``.

    The nan flag travels beside the value because a max all-reduce need not propagate nan.
    """
    if not norms:
        return torch.zeros(2, dtype=torch.float64, device=device)
    stacked = torch.stack([norm.to(device=device, dtype=torch.float64) for norm in norms])
    value = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()
    return torch.stack([value, stacked.isnan().any().to(torch.float64)])


def _sharded_group(sharded: list[tuple[int, ShardedTensor]]) -> ProcessGroup | None:
    """The one process group of the sharded parameters (``None`` when there are none)."""
    if not sharded:
        return None
    first_index, first = sharded[0]
    for index, param in sharded[1:]:
        if param._process_group is not first._process_group:
            raise ValueError(
                "clip_grad_norm_ needs every ShardedTensor parameter on one process group (the "
                "norm is all-reduced over it): parameter "
                f"{first_index} (size {list(first.size())}) and parameter {index} (size "
                f"{list(param.size())}) use different groups; clip each group's parameters "
                "with a call of its own"
            )
    return first._process_group


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the global norm of the gradients of plain and ShardedTensor parameters, in place.

    ``torch.nn.utils.clip_grad_norm_``'s signature and result, for models whose parameters
    include ShardedTensors: the norm is that of all gradients viewed as one vector, each
    shard of a sharded parameter counted once across the ranks of its process group (one
    all-reduce of a float64 pair) and each plain parameter counted once, assuming every rank
    holds the same plain gradient (no communication for those). Collective when there are
    sharded parameters: every rank of their group must call it with the same parameters.

    Args:
        parameters: A tensor or an iterable of tensors (e.g. ``model.parameters()``); those
            without a gradient are skipped.
        max_norm: The largest norm the gradients keep.
        norm_type: The p of the p-norm: any ``p > 0``, or ``inf`` (``float("inf")`` or
            ``"inf"``) for the largest absolute value.
        error_if_nonfinite: Raise when the total norm is nan or infinite (on every rank: the
            total is the same everywhere), instead of scaling by it.
        foreach: Use torch's fused per-tensor kernels (``None``: where the device has them).

    Returns:
        The total norm of the gradients, a 0-dim tensor on the first gradient's device, the
        same on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive (a 0 or negative "norm" of the concatenated
            gradients is not a sum or a max of the ranks' parts), or the ShardedTensor
            parameters are on different process groups.
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or infinite, or
            ``foreach=True`` on a device without fused kernels.

    Example:
        >>> loss.backward()
        >>> shardwise.clip_grad_norm_(model.parameters(), 1.0)
        >>> optim.step()
    """
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
        if isinstance(parameters, types.GeneratorType) and not params:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=2,
            )
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"clip_grad_norm_ needs a norm_type > 0 or inf, got {norm_type}: the total norm of "
            "sharded gradients is built from the ranks' sums of |g|^p (or maxima)"
        )
    sharded = [(i, p) for i, p in enumerate(params) if isinstance(p, ShardedTensor)]
    group = _sharded_group(sharded)

    plain_grads: list[torch.Tensor] = []
    shard_grads: list[torch.Tensor] = []
    for param in params:
        if isinstance(param, ShardedTensor):
            shard_grads.extend(
                shard.tensor.grad for shard in param.local_shards() if shard.tensor.grad is not None
            )
        elif param.grad is not None:
            plain_grads.append(param.grad)
    grads = plain_grads + shard_grads
    if not grads and group is None:
        return torch.tensor(0.0)

    # The result's dtype and device as torch gives them (the gradients' norms promoted, on the
    # first gradient's device); a sharded parameter's dtype counts whether or not this rank
    # holds a shard of it, so that every rank returns the same dtype.
    dtypes = [grad.dtype.to_real() for grad in plain_grads]
    dtypes += [param.dtype.to_real() for _, param in sharded]
    result_dtype = dtypes[0]
    for dtype in dtypes[1:]:
        result_dtype = torch.promote_types(result_dtype, dtype)
    result_device = grads[0].device if grads else sharded[0][1].device

    # Every local step that can fail (foreach on a device without it) runs before the
    # all-reduce, so that no rank raises while the others wait in it.
    shard_norms = _norms(shard_grads, norm_type, foreach)
    plain_norms = _norms(plain_grads, norm_type, foreach)
    sharded_part = _partial(shard_norms, norm_type, result_device)
    if (
        group is not None
        and collectives.is_member(group)
        and collectives.group_world_size(group) > 1
    ):
        op = "max" if math.isinf(norm_type) else "sum"
        collectives.all_reduce(sharded_part, op, group)
    plain_part = _partial(plain_norms, norm_type, result_device)

    if math.isinf(norm_type):
        total = torch.maximum(sharded_part[0], plain_part[0])
    else:
        total = (sharded_part[0] + plain_part[0]).pow(1.0 / norm_type)
    if sharded_part[1] > 0 or plain_part[1] > 0:
        total = torch.full_like(total, math.nan)
    total_norm = total.to(result_dtype)

    if error_if_nonfinite and not bool(total_norm.isfinite()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )

    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for (device, _), group_grads in _by_device_and_dtype(grads).items():
        on_device = coefficient.to(device)
        if _use_foreach(device, foreach):
            torch._foreach_mul_(group_grads, on_device)
        else:
            for grad in group_grads:
                grad.mul_(on_device)
    return total_norm
