"""Operations on sharded tensors: the dispatch registry and the built-in implementations.

Importing this package registers the built-in ops.
"""

from shardwise.ops import autograd as _autograd  # noqa: F401 - registers the ops
from shardwise.ops import properties as _properties  # noqa: F401
from shardwise.ops.registry import custom_sharded_op_impl, custom_sharding_spec_op

__all__ = ["custom_sharded_op_impl", "custom_sharding_spec_op"]
