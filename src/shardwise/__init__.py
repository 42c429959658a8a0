"""shardwise: sharded tensors and distributed checkpoints for PyTorch.

The API is that of PyTorch's deprecated ``torch.distributed._shard`` (with its bugs fixed), so
code moves over by changing imports::

    import shardwise as sw

    spec = sw.ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    st = sw.shard_tensor(torch.randn(8, 4), spec)

The names below are imported from their modules on first use (PEP 562), so that
``import shardwise`` and the ``shardwise`` command line start without importing torch
(``shardwise --help`` in a fraction of a second). Importing :mod:`shardwise.sharded_tensor`
(which every name that involves a ShardedTensor does) registers the built-in sharded ops and
the classes ``torch.load(..., weights_only=True)`` needs; when torch is already imported (a
training script), ``import shardwise`` does it at once.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from shardwise.api import shard_parameter, shard_tensor
    from shardwise.clip_grad import clip_grad_norm_
    from shardwise.errors import (
        CheckpointDataError,
        CheckpointError,
        CheckpointFormatError,
        CheckpointKeyError,
        CheckpointLockedError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointStorageError,
        CheckpointTimeoutError,
        CheckpointVersionError,
        ChecksumError,
        DCPImportError,
        LocalTierWarning,
        MetadataFormatError,
        PickleNotAllowedError,
        RemoteError,
        RestoreFallbackWarning,
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
    from shardwise.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor
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

# Every public name and the module it is imported from on first use; the same as the imports
# above (tests/unit/cli/test_startup.py checks that they agree).
_SOURCES: dict[str, str] = {
    "CheckpointDataError": "shardwise.errors",
    "CheckpointError": "shardwise.errors",
    "CheckpointFormatError": "shardwise.errors",
    "CheckpointKeyError": "shardwise.errors",
    "CheckpointLockedError": "shardwise.errors",
    "CheckpointMismatchError": "shardwise.errors",
    "CheckpointNotFoundError": "shardwise.errors",
    "CheckpointStorageError": "shardwise.errors",
    "CheckpointTimeoutError": "shardwise.errors",
    "CheckpointVersionError": "shardwise.errors",
    "ChecksumError": "shardwise.errors",
    "ChunkShardingSpec": "shardwise.sharding_spec",
    "DCPImportError": "shardwise.errors",
    "DevicePlacementSpec": "shardwise.sharding_spec",
    "EnumerableShardingSpec": "shardwise.sharding_spec",
    "LocalShardsWrapper": "shardwise.local_shards",
    "MetadataFormatError": "shardwise.errors",
    "PickleNotAllowedError": "shardwise.errors",
    "PlacementSpec": "shardwise.sharding_spec",
    "RemoteDevice": "shardwise.placement",
    "RemoteError": "shardwise.errors",
    "LocalTierWarning": "shardwise.errors",
    "RestoreFallbackWarning": "shardwise.errors",
    "Shard": "shardwise.sharded_tensor",
    "ShardMetadata": "shardwise.metadata",
    "ShardedOptimizer": "shardwise.sharded_optim",
    "ShardedTensor": "shardwise.sharded_tensor",
    "ShardedTensorBase": "shardwise.sharded_tensor",
    "ShardedTensorMetadata": "shardwise.metadata",
    "Sharder": "shardwise.sharder",
    "ShardingPlan": "shardwise.sharding_plan",
    "ShardingPlanner": "shardwise.sharding_plan",
    "ShardingSpec": "shardwise.sharding_spec",
    "TensorProperties": "shardwise.metadata",
    "clip_grad_norm_": "shardwise.clip_grad",
    "collect_local_shard": "shardwise.module",
    "custom_sharded_op_impl": "shardwise.ops",
    "custom_sharding_spec_op": "shardwise.ops",
    "empty": "shardwise.sharded_tensor",
    "full": "shardwise.sharded_tensor",
    "init_from_local_shards": "shardwise.sharded_tensor",
    "init_from_local_shards_and_global_metadata": "shardwise.sharded_tensor",
    "init_from_local_tensor": "shardwise.sharded_tensor",
    "load_with_process_group": "shardwise.sharded_tensor.serialization",
    "named_params_with_sharded_tensor": "shardwise.sharded_optim",
    "ones": "shardwise.sharded_tensor",
    "pre_load_state_dict_hook": "shardwise.module",
    "rand": "shardwise.sharded_tensor",
    "randn": "shardwise.sharded_tensor",
    "reshard_output": "shardwise.module",
    "shard_module": "shardwise.module",
    "shard_parameter": "shardwise.api",
    "shard_tensor": "shardwise.api",
    "state_dict_hook": "shardwise.module",
    "zeros": "shardwise.sharded_tensor",
}

__all__ = [
    "CheckpointDataError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "CheckpointVersionError",
    "ChecksumError",
    "ChunkShardingSpec",
    "DCPImportError",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "LocalShardsWrapper",
    "LocalTierWarning",
    "MetadataFormatError",
    "PickleNotAllowedError",
    "PlacementSpec",
    "RemoteDevice",
    "RemoteError",
    "RestoreFallbackWarning",
    "Shard",
    "ShardMetadata",
    "ShardedOptimizer",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "Sharder",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingSpec",
    "TensorProperties",
    "clip_grad_norm_",
    "collect_local_shard",
    "custom_sharded_op_impl",
    "custom_sharding_spec_op",
    "empty",
    "full",
    "init_from_local_shards",
    "init_from_local_shards_and_global_metadata",
    "init_from_local_tensor",
    "load_with_process_group",
    "named_params_with_sharded_tensor",
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


#: Subpackages and modules reachable as attributes (``shardwise.checkpoint.save``) without an
#: import statement of their own, as they were when this package imported everything.
_SUBMODULES = frozenset(
    {
        "api",
        "checkpoint",
        "cli",
        "clip_grad",
        "collectives",
        "errors",
        "local_shards",
        "metadata",
        "module",
        "ops",
        "placement",
        "sharded_optim",
        "sharded_tensor",
        "sharder",
        "sharding_plan",
        "sharding_spec",
    }
)


#: Public names that keep the module defining them. A pickle names a class by its module
#: (``torch.save`` of a sharded tensor, local shards wrapper or sharding spec), and
#: ``torch.load(..., weights_only=True)`` allows a class by that name: were it renamed on first
#: use, a file written before the first use would not load after it, nor one written after it
#: in a process that never used the name. The errors keep ``shardwise.errors``, public too.
_NAMED_WHERE_DEFINED = frozenset(
    {
        "ChunkShardingSpec",
        "EnumerableShardingSpec",
        "LocalShardsWrapper",
        "RemoteDevice",
        "Shard",
        "ShardMetadata",
        "ShardedTensor",
        "ShardedTensorBase",
        "ShardedTensorMetadata",
        "TensorProperties",
    }
)


def __getattr__(name: str) -> Any:
    """Import the public ``name`` from its module on first use (PEP 562), then keep it.

    Its ``__module__`` becomes ``shardwise`` (reprs and ``help()`` show the public name), but
    for the names of :data:`_NAMED_WHERE_DEFINED` and the errors.
    """
    source = _SOURCES.get(name)
    if source is None:
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    if source != f"{__name__}.errors" and name not in _NAMED_WHERE_DEFINED:
        value.__module__ = __name__
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


# A program that imported torch before shardwise (every training script) gets what the eager
# package gave: the sharded ops registered and ShardedTensor known to
# torch.load(weights_only=True) as soon as ``import shardwise`` returns. Only a process that
# has not imported torch yet (the command line) starts lazily.
if "torch" in sys.modules:
    importlib.import_module(f"{__name__}.sharded_tensor")
