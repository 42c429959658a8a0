"""Helpers shared by the op implementations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["is_sharded", "sharded_input", "unsupported"]


def is_sharded(value: object) -> bool:
    """Whether ``value`` is a ShardedTensor."""
    return isinstance(value, ShardedTensor)


def sharded_input(args: Any) -> ShardedTensor:
    """The op's first argument, which must be a ShardedTensor."""
    if not args or not isinstance(args[0], ShardedTensor):
        raise TypeError("input needs to be a ShardedTensor")
    return args[0]


def unsupported(func: Callable[..., Any], args: Any, kwargs: Any) -> RuntimeError:
    """Upstream's error for a torch function that has no sharded implementation."""
    name = getattr(func, "__name__", str(func))
    return RuntimeError(
        f"torch function '{name}', with args: {args} and kwargs: {kwargs} not supported for "
        "ShardedTensor!"
    )
