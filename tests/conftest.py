"""Shared pytest configuration: the multi-process harness (``tests/harness.py``) is wired in here.

The harness itself creates its worker pools lazily, on the first ``@distributed`` test of each
world size, so sessions without distributed tests never spawn a process.
"""

from __future__ import annotations

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the pooled worker processes cleanly (atexit is only the backstop).
    harness.shutdown_pools()
