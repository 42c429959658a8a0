"""Autograd-related ops: ``detach`` and ``requires_grad_``."""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardwise.ops._common import rebuild, sharded_input
from shardwise.ops.registry import builtin_op, disabled_torch_function


@builtin_op(torch.Tensor.detach)
def _detach(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    from shardwise.sharded_tensor.shard import Shard

    st = sharded_input(args)
    shards = [Shard(shard.tensor.detach(), shard.metadata) for shard in st.local_shards()]
    metadata = copy.deepcopy(st.metadata())
    metadata.tensor_properties.requires_grad = False
    return rebuild(st, shards, metadata)


@builtin_op(torch.Tensor.requires_grad_)
def _requires_grad_(types: Any, args: Any, kwargs: Any, process_group: Any) -> Any:
    st = sharded_input(args)
    requires_grad = args[1] if len(args) > 1 else (kwargs or {}).get("requires_grad", True)
    if requires_grad == st.requires_grad:
        return st
    for shard in st.local_shards():
        shard.tensor.requires_grad_(requires_grad)
    disabled_torch_function(torch.Tensor.requires_grad_, (st, requires_grad), None)
    st.metadata().tensor_properties.requires_grad = requires_grad
    return st
