"""The command line starts without torch: ``shardwise --help`` (and every ``COMMAND --help``)
imports neither torch nor the checkpoint code, which take seconds. That rests on
``shardwise/__init__.py`` importing its public names lazily (PEP 562), checked here too."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise
from shardwise.cli import _app

# Run in a fresh interpreter: this one imported torch long ago.
_PROBE = """
import sys
from shardwise.cli import main
code = main({argv!r})
heavy = sorted(name for name in ("torch", "numpy", "shardwise.checkpoint") if name in sys.modules)
print("IMPORTED", heavy, "EXIT", code)
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], *([command, "--help"] for command in _app._HANDLERS)],
    ids=" ".join,
)
def test_help_imports_no_torch(argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "IMPORTED [] EXIT 0"


def test_python_m_shardwise_help_imports_no_torch() -> None:
    # As `python -m shardwise --help` runs: the package, then its __main__.
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['shardwise', '--help']\n"
        "try:\n"
        "    runpy.run_module('shardwise', run_name='__main__')\n"
        "except SystemExit as exit_:\n"
        "    print('EXIT', exit_.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: shardwise" in result.stdout
    assert result.stdout.splitlines()[-1] == "EXIT 0 False"


def test_a_command_imports_torch_when_it_runs(tmp_path: Path) -> None:
    probe = _PROBE.format(argv=["inspect", str(tmp_path)])
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    imported = "IMPORTED ['numpy', 'shardwise.checkpoint', 'torch'] EXIT 3"
    assert result.stdout.splitlines()[-1] == imported
    assert result.stderr.startswith("shardwise inspect: error: no checkpoint at ")


def test_import_shardwise_imports_no_torch() -> None:
    probe = (
        "import sys, shardwise\n"
        "names = dir(shardwise)\n"
        "print('torch' in sys.modules, shardwise.__version__, 'ShardedTensor' in names)\n"
        "shardwise.ShardMetadata\n"  # metadata imports torch: on first use, not before
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False 0.1.0 True", "True"]


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of the imports under ``if TYPE_CHECKING:`` in shardwise/__init__.py."""
    tree = ast.parse(inspect.getsource(shardwise))
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname is None
            names[alias.name] = node.module
    return names


def test_lazy_names_agree_with_the_type_checking_imports_and_all() -> None:
    # The lazy map is what runs; the TYPE_CHECKING imports are what mypy and IDEs see.
    assert _type_checking_imports() == shardwise._SOURCES
    assert sorted(shardwise._SOURCES) == shardwise.__all__
    assert set(shardwise.__all__) <= set(dir(shardwise))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent'"):
        shardwise.nonexistent  # noqa: B018
    assert not hasattr(shardwise, "nonexistent")


def _probe(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


_SAFE = "{getattr(g, '__name__', '') for g in torch.serialization.get_safe_globals()}"


def test_import_after_torch_registers_sharded_ops_and_safe_globals_at_once() -> None:
    # A training script imports torch first: import shardwise then does what the eager
    # package did (torch.load(weights_only=True) knows ShardedTensor, the ops are registered).
    probe = (
        "import torch, shardwise\n"
        "from shardwise.ops import registry\n"
        f"print('ShardedTensor' in {_SAFE}, torch.add in registry._SHARDED_OPS)\n"
    )
    assert _probe(probe) == ["True", "True"]


def test_first_use_registers_sharded_ops_and_safe_globals() -> None:
    # Without torch loaded first (the command line), the registrations happen with the first
    # name that needs them, whichever name that is.
    probe = (
        "import sys, shardwise\n"
        "assert 'torch' not in sys.modules\n"
        "shardwise.shard_tensor\n"
        "import torch\n"
        "from shardwise.ops import registry\n"
        f"print('ShardedTensor' in {_SAFE}, torch.add in registry._SHARDED_OPS)\n"
    )
    assert _probe(probe) == ["True", "True"]
