"""Writer processes of ``async_save`` that SIGKILL themselves at a point of the commit
(``tests/_commit_kill_site/sitecustomize.py``): the tests of what a killed writer's save
yields (``tests/*/checkpoint/test_async_commit_truth.py``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from shardwise.checkpoint.saving import background

#: The points of the commit, in order.
POINTS = ("before-commit", "after-commit", "after-cleanup")
#: Where the save has committed.
COMMITTED = {"before-commit": False, "after-commit": True, "after-cleanup": True}
_SITE = str(Path(__file__).resolve().parent / "_commit_kill_site")
_VARIABLES = ("PYTHONPATH", "SHARDWISE_TEST_KILL_AT")


@contextlib.contextmanager
def writers_killed_at(point: str) -> Iterator[None]:
    """The writer processes started inside (by the first ``async_save`` of a group) kill
    themselves at ``point`` of a commit; writers running before are stopped first, so the
    next ``async_save`` starts one."""
    assert point in POINTS, point
    background.shutdown_writers()
    saved = {name: os.environ.get(name) for name in _VARIABLES}
    os.environ["SHARDWISE_TEST_KILL_AT"] = point
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
