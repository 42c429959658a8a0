"""Tests for the curated top-level API: ``shardwise.__all__`` (STYLE.md rule 2, SPEC.md surface).

Two rules keep it honest as the package grows:

* the names that exist so far are hard-coded below (``EXPECTED_NAMES``): extend it as SPEC.md's
  import-surface names land;
* every public class exported by the ``__all__`` of a ``shardwise`` module that
  ``shardwise/__init__.py`` imports from must be re-exported at top level. This rule covers
  names added later (sharding specs, sharded tensors, ...) automatically: a class added to a
  submodule's ``__all__`` but forgotten in ``shardwise/__init__.py`` fails
  ``test_public_classes_of_imported_modules_are_reexported``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import shardwise

#: Names of SPEC.md's import-surface table that exist so far, plus the error they raise.
EXPECTED_NAMES = {
    "MetadataFormatError",
    "RemoteDevice",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "clip_grad_norm_",
}

#: Public classes that deliberately stay in their submodule, with the reason.
SUBMODULE_ONLY = {
    # Part of TensorProperties' pickle form; upstream keeps it in the metadata submodule and
    # SPEC.md's import surface does not list it.
    "MEM_FORMAT_ENCODING",
}


def _modules_imported_by_init() -> list[ModuleType]:
    """The ``shardwise.*`` modules that ``shardwise/__init__.py`` imports names from."""
    init = Path(inspect.getfile(shardwise))
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names.add(f"shardwise.{node.module}")
            elif node.level == 0 and (node.module or "").startswith("shardwise."):
                names.add(str(node.module))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("shardwise."))
    return [importlib.import_module(name) for name in sorted(names)]


def test_all_is_sorted_without_duplicates() -> None:
    names = list(shardwise.__all__)
    assert names == sorted(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", shardwise.__all__)
def test_every_exported_name_is_importable(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from shardwise import {name}", namespace)
    assert namespace[name] is getattr(shardwise, name)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from shardwise import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(shardwise.__all__)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_names_that_exist_so_far_are_exported(name: str) -> None:
    assert name in shardwise.__all__


def test_init_imports_at_least_the_known_modules() -> None:
    # Guards the AST scan below against silently finding nothing.
    modules = {module.__name__ for module in _modules_imported_by_init()}
    assert {"shardwise.errors", "shardwise.metadata", "shardwise.placement"} <= modules


@pytest.mark.parametrize("module", _modules_imported_by_init(), ids=lambda module: module.__name__)
def test_public_classes_of_imported_modules_are_reexported(module: ModuleType) -> None:
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    missing = []
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ lists undefined {name!r}"
        value = getattr(module, name)
        if not inspect.isclass(value) or not value.__module__.startswith("shardwise"):
            continue
        if name in SUBMODULE_ONLY:
            continue
        if name not in shardwise.__all__ or getattr(shardwise, name, None) is not value:
            missing.append(name)
    assert not missing, (
        f"public classes of {module.__name__} missing from shardwise.__all__: {missing}; "
        "re-export them in shardwise/__init__.py (or list them in SUBMODULE_ONLY with a reason)"
    )


def test_submodule_only_names_exist() -> None:
    # A stale exemption would hide nothing, but would mislead the next reader.
    exported = {
        name for module in _modules_imported_by_init() for name in getattr(module, "__all__", [])
    }
    assert exported >= SUBMODULE_ONLY


def test_checkpoint_all_is_sorted_and_exports_the_hugging_face_functions() -> None:
    import shardwise.checkpoint as checkpoint

    names = list(checkpoint.__all__)
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in ("load_safetensors", "save_safetensors"):
        assert name in names
        assert callable(getattr(checkpoint, name))
