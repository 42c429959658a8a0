"""Imported at start-up by every Python process whose ``PYTHONPATH`` holds this directory
(``tests/_commit_kill.py`` puts it there for an ``async_save`` writer process): with
``SHARDWISE_TEST_KILL_AT`` set, the process SIGKILLs itself at that point of a save's commit.

* ``before-commit``: right before the index is renamed into place (nothing committed);
* ``after-commit``: right after that rename (committed; the cleanup and the reply not done);
* ``after-cleanup``: right after the leftovers of earlier saves were removed (no reply yet).

Only the coordinator renames the index and removes leftovers, so only its writer dies.
Nothing of this is in the library: the storage method and the save's function are wrapped here.
"""

from __future__ import annotations

import os

_POINT = os.environ.get("SHARDWISE_TEST_KILL_AT")

if _POINT:
    import functools
    import signal
    from typing import Any

    from shardwise.checkpoint.index import INDEX_NAME
    from shardwise.checkpoint.saving import save as _save
    from shardwise.checkpoint.storage import LocalStorage

    if _POINT not in ("before-commit", "after-commit", "after-cleanup"):
        raise ValueError(f"SHARDWISE_TEST_KILL_AT={_POINT!r} is not a point this file knows")

    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    _rename = LocalStorage.rename

    @functools.wraps(_rename)
    def _rename_then_maybe_die(self: LocalStorage, source: str, target: str) -> None:
        commits = os.path.basename(target) == INDEX_NAME
        if commits and _POINT == "before-commit":
            _die()
        _rename(self, source, target)
        if commits and _POINT == "after-commit":
            _die()

    _remove_leftovers = _save.remove_leftovers

    @functools.wraps(_remove_leftovers)
    def _remove_leftovers_then_maybe_die(*args: Any, **kwargs: Any) -> None:
        _remove_leftovers(*args, **kwargs)
        if _POINT == "after-cleanup":
            _die()

    LocalStorage.rename = _rename_then_maybe_die  # type: ignore[method-assign]
    _save.remove_leftovers = _remove_leftovers_then_maybe_die
