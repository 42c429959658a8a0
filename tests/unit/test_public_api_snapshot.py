"""The public surface as a snapshot: every name of ``shardwise``, ``shardwise.checkpoint`` and
``shardwise.errors`` (their exact ``__all__``), its kind, the module it shows and its signature,
and the public methods of the checkpoint package's classes. Any change to the surface fails
here until ``tests/unit/public_api.json`` is updated on purpose:

    SHARDWISE_UPDATE_API_SNAPSHOT=1 pytest tests/unit/test_public_api_snapshot.py

and the diff of that file reviewed as the change of the API that it is."""

from __future__ import annotations

import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).with_name("public_api.json")
PACKAGES = ("shardwise", "shardwise.checkpoint", "shardwise.errors")
#: Packages whose classes' public methods are part of the snapshot too.
WITH_METHODS = ("shardwise.checkpoint",)


def _signature(value: Any) -> str | None:
    try:
        return str(inspect.signature(value))
    except ValueError:  # a built-in's (an exception class without an __init__ of its own)
        return None


def _kind(value: Any) -> str:
    if inspect.isclass(value):
        if issubclass(value, Warning):
            return "warning"
        return "exception" if issubclass(value, BaseException) else "class"
    return "function" if callable(value) else type(value).__name__


def _methods(cls: type) -> dict[str, str | None]:
    methods = {}
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            methods[name] = "property"
        elif inspect.isfunction(member):
            methods[name] = _signature(member)
    return methods


def _surface() -> dict[str, Any]:
    surface: dict[str, Any] = {}
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names: dict[str, Any] = {}
        for name in sorted(package.__all__):
            value = getattr(package, name)
            entry = {
                "kind": _kind(value),
                "module": getattr(value, "__module__", None),
                "signature": _signature(value) if callable(value) else None,
            }
            if package_name in WITH_METHODS and entry["kind"] == "class":
                entry["methods"] = _methods(value)
            names[name] = entry
        surface[package_name] = {"__all__": list(package.__all__), "names": names}
    return surface


def test_the_public_surface_matches_its_snapshot() -> None:
    surface = _surface()
    if os.environ.get("SHARDWISE_UPDATE_API_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    snapshot = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    for package_name in PACKAGES:
        # The order of __all__ too: sorted, as STYLE.md asks.
        assert surface[package_name]["__all__"] == snapshot[package_name]["__all__"], package_name
        for name, entry in surface[package_name]["names"].items():
            assert entry == snapshot[package_name]["names"][name], f"{package_name}.{name}"
    assert surface == snapshot


@pytest.mark.parametrize("package_name", PACKAGES)
def test_every_name_shows_a_public_module(package_name: str) -> None:
    # Reprs and help() name where a user imports it from, not a private module; the sharded
    # tensor classes keep their defining module, which their pickles name (shardwise/__init__).
    package = importlib.import_module(package_name)
    kept = importlib.import_module("shardwise")._NAMED_WHERE_DEFINED
    for name in package.__all__:
        module = getattr(package, name).__module__
        if name in kept:
            continue
        assert module in {package_name, "shardwise.errors"}, (name, module)
