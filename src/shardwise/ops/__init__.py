"""Operations on sharded tensors: the dispatch registry and the built-in implementations.

Importing this package registers the built-in ops. The ops are built on
:mod:`shardwise.sharded_tensor`, which in turn imports this package when it is imported (so
that a ShardedTensor never exists without its ops) and installs the registry as its
``__torch_function__``; the sharded-tensor package is therefore loaded first, whichever of
the two a program imports first.
"""

import shardwise.sharded_tensor  # noqa: F401 - first: the tensors these ops run on
from shardwise.ops import autograd as _autograd  # noqa: F401 - each import registers its ops
from shardwise.ops import compare as _compare  # noqa: F401
from shardwise.ops import embedding as _embedding  # noqa: F401
from shardwise.ops import pointwise as _pointwise  # noqa: F401
from shardwise.ops import properties as _properties  # noqa: F401
from shardwise.ops import reduction as _reduction  # noqa: F401
from shardwise.ops import tensor_ops as _tensor_ops  # noqa: F401
from shardwise.ops.registry import custom_sharded_op_impl, custom_sharding_spec_op

__all__ = ["custom_sharded_op_impl", "custom_sharding_spec_op"]
