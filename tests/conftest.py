"""Shared pytest configuration: the multi-process harness (``tests/harness.py``) is wired in here.

The harness itself creates its worker pools lazily, on the first ``@distributed`` test of each
world size, so sessions without distributed tests never spawn a process.
"""

from __future__ import annotations

import inspect
import re

import pytest

from tests import harness


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size, fresh, rpc): the test body runs on every rank of a real gloo "
        "group (set by tests.harness.distributed; select with -m distributed)",
    )
    # Also set by tests.harness.distributed; pytest-timeout registers it too when installed.
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's per-test timeout")


# A test body that starts a Python process itself (or through the helper that does).
_STARTS_PYTHON = re.compile(
    r"\bsys\.executable\b|\bsubprocess\.(?:run|Popen|check_\w+)\b|_run_isolated\("
)


def _starts_python(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        return function is not None and bool(_STARTS_PYTHON.search(inspect.getsource(function)))
    except (OSError, TypeError):  # no source (a generated test)
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests on the moto S3 server (they use the ``s3`` or ``s3_endpoint`` fixture)
    ``s3``, and those whose body starts a Python process ``subprocess``: ``-m "not s3"``."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "s3" in fixtures or "s3_endpoint" in fixtures:
            item.add_marker(pytest.mark.s3)
        if _starts_python(item):
            item.add_marker(pytest.mark.subprocess)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the pooled worker processes cleanly (atexit is only the backstop).
    harness.shutdown_pools()
