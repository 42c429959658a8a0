"""Arguments and validation of the sharded ``F.embedding`` and ``F.embedding_bag``.

Validation happens before any data moves and every rank reaches the same verdict: the
upstream checks (with their exact messages), the unsharded op's own checks (run on a stand-in
weight, see :func:`_stand_in`), and an agreement check that every rank passed the same input
shape and options (:func:`agree`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec

__all__ = [
    "MODES",
    "agree",
    "bind",
    "jsonable",
    "mode_of",
    "norm_type_of",
    "validate_embedding",
    "validate_embedding_bag",
]

MODES = ("sum", "mean", "max")


def bind(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    # F.embedding forwards everything after (input, weight) as keywords, but a direct call of
    # the registered function (or a future torch) may pass them positionally.
    bound = inspect.signature(op).bind(*args, **(kwargs or {}))
    bound.apply_defaults()
    return bound.arguments


def _check_ids_in_range(ids: torch.Tensor, weight_size: torch.Size) -> None:
    if ids.numel() == 0:
        return
    # Upstream passes the values as extra exception arguments (not %-formatted) and reports
    # the number of columns; both kept so that messages match.
    lowest = int(torch.min(ids).item())
    if lowest < 0:
        raise ValueError("Index out of range in Input %d %d", lowest, weight_size[1])
    highest = int(torch.max(ids).item())
    if highest >= weight_size[0]:
        raise ValueError("Index out of range in Input %d %d", highest, weight_size[1])


def _check_unsupported_flags(params: Any) -> None:
    if params["scale_grad_by_freq"]:
        raise RuntimeError(
            'nn.Embedding weight sharded with flag on "scale_grad_by_freq" not supported!'
        )
    if params["sparse"]:
        raise RuntimeError('nn.Embedding weight sharded with flag on "sparse" not supported!')


def _check_max_norm(max_norm: float | None) -> None:
    if max_norm and max_norm <= 0.0:
        raise ValueError('"max_norm" must be larger than zero!')


def _check_weight_layout(weight: Any) -> None:
    if not isinstance(weight.sharding_spec(), ChunkShardingSpec):
        raise ValueError("Only ChunkShardingSpec supported for ShardedTensor ops!")
    if len(weight.local_shards()) != 1:
        raise ValueError("Only one local shard supported!")


def _sharding_dim(weight: Any, module_name: str) -> int:
    spec_dim = weight.sharding_spec().dim
    # A 2-D weight: -2/-1 name the same dims as 0/1 (upstream only accepted 0 and 1).
    dim = spec_dim + 2 if isinstance(spec_dim, int) and -2 <= spec_dim < 0 else spec_dim
    if dim not in (0, 1):
        raise RuntimeError(f"nn.{module_name} weight sharded on dim {spec_dim} not supported!")
    return int(dim)


def validate_embedding(params: Any) -> int:
    ids, weight = params["input"], params["weight"]
    if not isinstance(ids, torch.Tensor):
        raise TypeError("input need to be torch.Tensor")
    if not isinstance(weight, ShardedTensor):
        raise TypeError("weight needs to be ShardedTensor")
    weight_size = weight.size()
    if len(weight_size) != 2:
        raise ValueError("Weight needs to have exactly 2 dims")
    _check_ids_in_range(ids, weight_size)
    _check_unsupported_flags(params)
    _check_max_norm(params["max_norm"])
    _check_weight_layout(weight)
    dim = _sharding_dim(weight, "Embedding")
    # The unsharded op's own checks (ids dtype, padding_idx range), with torch's messages.
    F.embedding(ids, _stand_in(weight), padding_idx=params["padding_idx"])
    return dim


def validate_embedding_bag(params: Any) -> int:
    ids, weight = params["input"], params["weight"]
    offsets, per_sample_weights = params["offsets"], params["per_sample_weights"]
    if not isinstance(ids, torch.Tensor):
        raise TypeError("input need to be torch.Tensor")
    if offsets is not None and not isinstance(offsets, torch.Tensor):
        raise TypeError("offsets need to be torch.Tensor")
    if per_sample_weights is not None and not isinstance(per_sample_weights, torch.Tensor):
        raise TypeError("per_sample_weights need to be torch.Tensor")
    if not isinstance(weight, ShardedTensor):
        raise TypeError("weight needs to be ShardedTensor")
    if ids.dim() > 2:
        raise ValueError("Input more than 2 dims not supported")
    weight_size = weight.size()
    if len(weight_size) != 2:
        raise ValueError("Weight needs to have exactly 2 dims")
    _check_ids_in_range(ids, weight_size)
    if offsets is not None and ids.dim() != 1:
        raise ValueError("Input dimension needs to be exactly 1 dim")
    if ids.dim() == 1 and offsets is None:
        raise ValueError("offsets is required for 1D input")
    if per_sample_weights is not None and per_sample_weights.size() != ids.size():
        raise ValueError(
            f"per_sample_weights size {per_sample_weights.size()} not equal to input size "
            f"{ids.size()}"
        )
    mode = mode_of(params)
    if mode not in MODES:
        raise ValueError(f"mode '{mode}' is not supported")
    _check_unsupported_flags(params)
    if params["include_last_offset"]:
        if offsets is None:
            raise ValueError('offsets is required for flag "include_last_offset"!')
        if offsets.numel() == 0 or int(offsets[-1].item()) != ids.size(0):
            raise ValueError(
                "offsets need to have the input size in the end when the flag "
                '"include_last_offset" is on!'
            )
    _check_max_norm(params["max_norm"])
    _check_weight_layout(weight)
    dim = _sharding_dim(weight, "EmbeddingBag")
    # The unsharded op's own checks (dtypes, offsets, per_sample_weights with the mode,
    # padding_idx range), with torch's messages.
    F.embedding_bag(
        ids,
        _stand_in(weight),
        offsets,
        mode=mode,
        per_sample_weights=per_sample_weights,
        include_last_offset=params["include_last_offset"],
        padding_idx=params["padding_idx"],
    )
    return dim


def _stand_in(weight: Any) -> torch.Tensor:
    """A weight with the sharded weight's rows, dtype and device, for the unsharded op's checks.

    One column broadcast from a single element (strides 0, 0): no memory per row, and a
    shape the kernels handle like any real table. Not zero columns: see the docstring of
    :mod:`shardwise.ops.embedding`.
    """
    local = weight.local_tensor()
    return torch.zeros((), dtype=local.dtype, device=local.device).expand(weight.size(0), 1)


def mode_of(params: Any) -> Any:
    return "mean" if params["mode"] is None else params["mode"]


def norm_type_of(params: Any) -> float:
    return 2.0 if params["norm_type"] is None else float(params["norm_type"])


def jsonable(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def agree(
    op_name: str,
    group: ProcessGroup,
    validate: Callable[[], int],
    describe: Callable[[], dict[str, object]],
) -> int:
    """Validate on every rank and check that the ranks called the op alike.

    Returns the sharding dim. Every rank raises (the same error) if any rank fails.
    """
    if not collectives.is_member(group):
        validate()  # raises: a rank outside the group holds no shard
        raise ValueError("Only one local shard supported!")
    dims: list[int] = []

    def local() -> dict[str, object]:
        dims.append(validate())
        return {"sharding dim": dims[0], **describe()}

    _, everyone = collectives.exchange_or_raise(group, local)
    ranks = collectives.global_ranks(group)
    for key, value in everyone[0].items():
        for rank, entry in zip(ranks[1:], everyone[1:], strict=True):
            if entry[key] != value:
                raise ValueError(
                    f"{op_name} with a sharded weight needs the same {key} on every rank, "
                    f"found {value} on rank {ranks[0]} and {entry[key]} on rank {rank}"
                )
    return dims[0]
