"""Clear errors where whole-tensor training machinery meets a ShardedTensor parameter.

A ShardedTensor's data and gradients live in its local shards. Two pieces of torch would
otherwise misbehave with one:

* A ``torch.optim`` optimizer given a ShardedTensor parameter never sees the shards' gradients
  and would leave the parameter unchanged, silently. :func:`install_optimizer_guard` registers
  a global step pre-hook (once, when ``shardwise.sharded_tensor`` is imported) that raises a
  ``TypeError`` naming :class:`~shardwise.sharded_optim.ShardedOptimizer` instead. It looks at
  the types of the parameters of the optimizer being stepped (about 30 µs per 1,000).
* ``DistributedDataParallel`` broadcasts and all-reduces whole parameters; on a ShardedTensor
  that ends in torch's C++ code with upstream's generic "being used from c++" error.
  :func:`dispatch_error` recognises that it happens while DDP is being constructed and says
  what to do instead.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["dispatch_error", "install_optimizer_guard"]

_installed = False


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"{module}.{cls.__qualname__}"


def _refuse_sharded_params(
    sharded_type: type[torch.Tensor], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
) -> None:
    # The distinct types of the parameters first: about 30 ns per parameter, where an
    # isinstance per parameter costs 200 (a step over 1,000 small parameters takes ~4 ms).
    types = {type(param) for group in optimizer.param_groups for param in group["params"]}
    if not any(issubclass(cls, sharded_type) for cls in types):
        return
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if isinstance(param, sharded_type):
                name = _optimizer_name(optimizer)
                raise TypeError(
                    f"{name} cannot step a ShardedTensor parameter (param_groups[{group_index}]"
                    f"['params'][{param_index}], size {list(param.size())}): its data and "
                    "gradient live in its local shards, which a torch.optim optimizer never "
                    "sees, so the parameter would silently stay unchanged. Use "
                    "shardwise.ShardedOptimizer, which steps the local shards: "
                    "ShardedOptimizer(shardwise.named_params_with_sharded_tensor(model), "
                    f"{name}, lr=...)"
                )


def install_optimizer_guard(sharded_type: type[torch.Tensor]) -> None:
    """Register the global optimizer step pre-hook that refuses ``sharded_type`` parameters
    (``ShardedTensor``, passed in by the package that defines it)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(functools.partial(_refuse_sharded_params, sharded_type))
        _installed = True


def _module_being_wrapped_by_ddp() -> nn.Module | None:
    """The module a ``DistributedDataParallel`` constructor on the call stack is wrapping."""
    constructor = nn.parallel.DistributedDataParallel.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is constructor:
            module = frame.f_locals.get("module")
            return module if isinstance(module, nn.Module) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _sharded_names(module: nn.Module, sharded_type: type[torch.Tensor]) -> list[str]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, value in named if isinstance(value, sharded_type)]


def dispatch_error(class_name: str, func: Any, sharded_type: type[torch.Tensor]) -> RuntimeError:
    """The error for an aten op reaching a ShardedTensor (no storage to run it on).

    Upstream's message, unless ``DistributedDataParallel`` is wrapping a module with
    parameters of ``sharded_type`` (``ShardedTensor``, passed in by its own module): then a
    message that names them and says what to do.
    """
    module = _module_being_wrapped_by_ddp()
    names = [] if module is None else _sharded_names(module, sharded_type)
    if names:
        return RuntimeError(
            "DistributedDataParallel cannot wrap a module with ShardedTensor parameters "
            f"{names}: it broadcasts every parameter from one rank and averages every "
            "gradient, but each rank holds different shards of a ShardedTensor (and the "
            "sharded ops already deliver every rank's gradient to the shards' owners). "
            "Either make DDP leave them alone before wrapping, "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, "
            f"{names}), and step them with shardwise.ShardedOptimizer; or do without DDP: "
            "ShardedOptimizer(..., sync_replicated_grads=True) also keeps the replicated "
            "parameters in step by summing their gradients over the ranks."
        )
    return RuntimeError(
        f"A {class_name} object is being used from c++ while calling "
        f"{func.__module__}.{func.__name__} but the there is no custom __torch_dispatch__ "
        "implementation for it."
    )
