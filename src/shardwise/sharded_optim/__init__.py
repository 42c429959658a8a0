"""Training with ShardedTensor parameters: :class:`ShardedOptimizer` and
:func:`named_params_with_sharded_tensor` (upstream's ``torch.distributed._shard.sharded_optim``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shardwise.sharded_optim.api import ShardedOptimizer
from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["ShardedOptimizer", "named_params_with_sharded_tensor"]


def named_params_with_sharded_tensor(
    module: nn.Module, prefix: str = "", recurse: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``module`` with its name, ShardedTensors included; each once.

    First the ShardedTensors kept as plain attributes of the module (and of its submodules
    when ``recurse``), then ``module.named_parameters()`` — which already holds the
    ShardedTensor parameters that :func:`~shardwise.shard_parameter` and
    :func:`~shardwise.shard_module` register. Typically passed to :class:`ShardedOptimizer`.

    Unlike upstream, ``prefix`` and ``recurse`` also apply to the plain parameters (upstream
    gave them neither).

    Args:
        module: The module to list.
        prefix: Prepended, with a dot, to every name.
        recurse: Include the submodules' parameters; else only ``module``'s own.

    Yields:
        ``(name, parameter)``: a ``torch.Tensor`` or a ShardedTensor.

    Example:
        >>> shardwise.shard_parameter(model.embedding, "weight", spec)
        >>> dict(named_params_with_sharded_tensor(model)).keys()
        dict_keys(['embedding.weight', 'head.weight', 'head.bias'])
    """
    modules = module.named_modules(prefix=prefix) if recurse else iter([(prefix, module)])
    seen: set[int] = set()
    for module_prefix, submodule in modules:
        for name, value in vars(submodule).items():
            if isinstance(value, ShardedTensor) and id(value) not in seen:
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value
    for name, param in module.named_parameters(prefix=prefix, recurse=recurse):
        if id(param) not in seen:
            seen.add(id(param))
            yield name, param
