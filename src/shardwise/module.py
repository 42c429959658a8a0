"""Module-level integration: sharding a whole ``nn.Module`` by plan, output hooks, and the
state-dict hooks that expose ShardedTensor attributes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise.api import shard_parameter
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharder import Sharder
from shardwise.sharding_plan import ShardingPlan, ShardingPlanner
from shardwise.sharding_spec import ChunkShardingSpec, ShardingSpec

__all__ = [
    "collect_local_shard",
    "pre_load_state_dict_hook",
    "reshard_output",
    "shard_module",
    "state_dict_hook",
]


def _state_key(prefix: str, submodule_name: str, attr_name: str) -> str:
    # Join only the non-empty parts: no double dot whatever the prefix (SPEC deviation 8).
    parts = [part for part in (prefix.rstrip("."), submodule_name, attr_name) if part]
    return ".".join(parts)


def state_dict_hook(
    module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict hook adding every ShardedTensor attribute of ``module`` and its submodules.

    Register with ``module._register_state_dict_hook(state_dict_hook)``.
    """
    for submodule_name, submodule in module.named_modules():
        for attr_name, attr in submodule.__dict__.items():
            if isinstance(attr, ShardedTensor):
                destination[_state_key(prefix, submodule_name, attr_name)] = attr


def pre_load_state_dict_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook restoring ShardedTensor attributes from ``state_dict``.

    Register with ``module._register_load_state_dict_pre_hook(pre_load_state_dict_hook, True)``.
    """
    for submodule_name, submodule in module.named_modules():
        for attr_name in list(submodule.__dict__):
            key = _state_key(prefix, submodule_name, attr_name)
            if key in state_dict and isinstance(state_dict[key], ShardedTensor):
                setattr(submodule, attr_name, state_dict[key])


def reshard_output(module: nn.Module, resharding_spec: ShardingSpec) -> nn.Module:
    """Reshard ``module``'s ShardedTensor output to ``resharding_spec`` after every forward."""

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        if isinstance(output, ShardedTensor):
            return output.reshard(resharding_spec)
        return output

    module.register_forward_hook(hook)
    return module


def collect_local_shard(module: nn.Module) -> nn.Module:
    """Replace ``module``'s ShardedTensor output by this rank's local tensor after forward.

    With a chunk spec, the chunk dim is squeezed away when the local size along it is 1.
    """

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        if not isinstance(output, ShardedTensor):
            return None
        local: torch.Tensor = output.local_tensor()
        spec = output.sharding_spec()
        if isinstance(spec, ChunkShardingSpec) and local.size(int(spec.dim)) == 1:
            local = local.squeeze(int(spec.dim))
        return local

    module.register_forward_hook(hook)
    return module


def shard_module(
    module: nn.Module,
    plan: ShardingPlan | ShardingPlanner,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> None:
    """Shard ``module`` in place according to ``plan`` (collective over ``process_group``).

    Parameters named by a :class:`ShardingSpec` are scattered from ``src_rank``
    (:func:`shard_parameter`); a submodule named by a :class:`Sharder` is replaced by the
    module its ``shard`` returns; ``output_plan`` and ``return_local_tensor`` install
    :func:`reshard_output` and :func:`collect_local_shard` hooks.

    Raises:
        RuntimeError: A parameter lies inside a submodule that a Sharder handles.
        KeyError: A Sharder is given for the empty path.
        TypeError: A plan value is neither a ShardingSpec nor a Sharder.
    """
    if isinstance(plan, ShardingPlanner):
        plan = plan.build_plan(module)
    sharder_paths = [name for name, spec in plan.plan.items() if isinstance(spec, Sharder)]
    for name, spec in plan.plan.items():
        if isinstance(spec, ShardingSpec):
            module_path, _, param_name = name.rpartition(".")
            for sharder_path in sharder_paths:
                # A path prefix match only counts at a module boundary ("fc" is not "fc1").
                if module_path == sharder_path or module_path.startswith(sharder_path + "."):
                    raise RuntimeError(
                        f"ShardingPlan is in-valid, trying to shard a parameter: {name}, but "
                        f"there's already a Sharder entry for module {sharder_path}, parameter "
                        "sharding should not conflict with the submodule tree that a Sharder "
                        "is working with!"
                    )
            shard_parameter(
                module.get_submodule(module_path),
                param_name,
                spec,
                src_rank=src_rank,
                process_group=process_group,
            )
        elif isinstance(spec, Sharder):
            if not name:
                raise KeyError("Module path must not be empty for custom sharder!")
            sharded = spec.shard(module.get_submodule(name))
            parent_path, _, child_name = name.rpartition(".")
            module.get_submodule(parent_path).register_module(child_name, sharded)
        else:
            raise TypeError(f"Only `ShardingSpec` and `Sharder` are supported to shard '{name}'")
    for path, output_spec in (plan.output_plan or {}).items():
        if not isinstance(output_spec, ShardingSpec):
            raise TypeError(f"Only `ShardingSpec` is supported as output_plan for '{path}'")
        reshard_output(module.get_submodule(path), output_spec)
    for path in plan.return_local_tensor or []:
        collect_local_shard(module.get_submodule(path))
