"""``module.double()/float()/half()/bfloat16()`` convert sharded parameters like ``to(dtype)``."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from tests.harness import distributed


@distributed(world_size=2)
def test_module_dtype_casts_convert_sharded_parameters():
    spec = sw.ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    torch.manual_seed(0)
    module = nn.Linear(3, 4)
    full = module.weight.detach().clone()
    sw.shard_parameter(module, "weight", spec)
    rank = torch.distributed.get_rank()
    expected = full[2 * rank : 2 * rank + 2]
    for cast, dtype in (
        (module.double, torch.float64),
        (module.half, torch.float16),
        (module.bfloat16, torch.bfloat16),
        (module.float, torch.float32),
    ):
        cast()
        weight = module.weight
        assert isinstance(weight, sw.ShardedTensor) and isinstance(weight, nn.Parameter)
        assert weight.dtype == dtype
        assert weight.local_tensor().dtype == dtype
        assert weight.metadata().tensor_properties.dtype == dtype
        expected = expected.to(dtype)  # the same chain of casts, unsharded
        assert torch.equal(weight.local_tensor().detach(), expected)
