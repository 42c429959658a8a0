"""The sharded-tensor layer and the layers around it are connected once, on import, whichever
module a program imports first: the op registry becomes ShardedTensor's ``__torch_function__``,
the spec layer gets its scatter engine, and the built-in ops and safe globals are registered.

Each probe runs in a fresh interpreter, since an import order can only be tried once per
process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_CONNECTED = (
    "import torch\n"
    "from shardwise.ops import registry\n"
    "from shardwise.sharded_tensor import api as st_api\n"
    "from shardwise.sharding_spec import api as spec_api\n"
    "from shardwise.sharded_tensor.scatter import scatter\n"
    "safe = {getattr(g, '__name__', '') for g in torch.serialization.get_safe_globals()}\n"
    "print(st_api._torch_function_handler is registry.dispatch,\n"
    "      spec_api._tensor_layer is not None and spec_api._tensor_layer.scatter is scatter,\n"
    "      torch.add in registry._SHARDED_OPS and torch.nn.functional.embedding in\n"
    "      registry._CUSTOM_SHARDING_SPEC_OPS['ChunkShardingSpec'],\n"
    "      'ShardedTensor' in safe)\n"
)


def _run(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize(
    "module",
    [
        "shardwise.ops",
        "shardwise.ops.embedding",
        "shardwise.sharded_tensor",
        "shardwise.sharded_tensor.api",
        "shardwise.api",
        "shardwise.sharded_optim",
    ],
)
def test_importing_any_layer_first_connects_all_of_them(module: str) -> None:
    code = f"import sys\nimport {module}\nassert 'torch' in sys.modules\n" + _CONNECTED
    assert _run(code) == ["True", "True", "True", "True"]


def test_a_spec_shards_when_only_the_spec_layer_was_imported(tmp_path: Path) -> None:
    # ``import shardwise`` before torch leaves every layer unloaded; a spec's shard() must
    # still find the scatter engine of the sharded-tensor layer above it.
    code = (
        "import sys\n"
        "from shardwise.sharding_spec import ChunkShardingSpec\n"
        "assert 'shardwise.sharded_tensor' not in sys.modules\n"
        "import torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}',"
        " rank=0, world_size=1)\n"
        "st = ChunkShardingSpec(0, ['rank:0/cpu', 'rank:0/cpu']).shard(torch.arange(5.0))\n"
        "print(type(st).__name__, [s.tensor.tolist() for s in st.local_shards()])\n"
        "print(float((st * 2).sum()))\n"
        "dist.destroy_process_group()\n"
    ) + _CONNECTED
    assert _run(code) == [
        "ShardedTensor",
        "[[0.0,",
        "1.0,",
        "2.0],",
        "[3.0,",
        "4.0]]",
        "20.0",
        "True",
        "True",
        "True",
        "True",
    ]
