"""shardwise: sharded tensors and distributed checkpoints for PyTorch.

The API is that of PyTorch's deprecated ``torch.distributed._shard`` (with its bugs fixed), so
code moves over by changing imports::

    import shardwise as sw

    spec = sw.ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    st = sw.shard_tensor(torch.randn(8, 4), spec)
"""

# Set before the imports below: submodules read it while the package is initializing.
__version__ = "0.1.0"

from shardwise.api import shard_parameter, shard_tensor
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ChecksumError,
    DCPImportError,
    MetadataFormatError,
    PickleNotAllowedError,
)
from shardwise.local_shards import LocalShardsWrapper
from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.module import (
    collect_local_shard,
    pre_load_state_dict_hook,
    reshard_output,
    shard_module,
    state_dict_hook,
)
from shardwise.ops import custom_sharded_op_impl, custom_sharding_spec_op
from shardwise.placement import RemoteDevice
from shardwise.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorBase,
    empty,
    full,
    init_from_local_shards,
    init_from_local_shards_and_global_metadata,
    init_from_local_tensor,
    ones,
    rand,
    randn,
    zeros,
)
from shardwise.sharded_tensor.serialization import load_with_process_group
from shardwise.sharder import Sharder
from shardwise.sharding_plan import ShardingPlan, ShardingPlanner
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    PlacementSpec,
    ShardingSpec,
)

__all__ = [
    "CheckpointDataError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ChecksumError",
    "ChunkShardingSpec",
    "DCPImportError",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "LocalShardsWrapper",
    "MetadataFormatError",
    "PickleNotAllowedError",
    "PlacementSpec",
    "RemoteDevice",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "Sharder",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingSpec",
    "TensorProperties",
    "collect_local_shard",
    "custom_sharded_op_impl",
    "custom_sharding_spec_op",
    "empty",
    "full",
    "init_from_local_shards",
    "init_from_local_shards_and_global_metadata",
    "init_from_local_tensor",
    "load_with_process_group",
    "ones",
    "pre_load_state_dict_hook",
    "rand",
    "randn",
    "reshard_output",
    "shard_module",
    "shard_parameter",
    "shard_tensor",
    "state_dict_hook",
    "zeros",
]
