"""CheckpointManager(incremental=True) in one process: each save builds on the one before,
retention counts references, a deletion interrupted anywhere leaves every kept checkpoint
loadable, and ``shardwise ls`` shows own and shared bytes."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import decode_index
from shardwise.checkpoint.manager import deletion, list_series
from shardwise.checkpoint.storage import LocalStorage
from shardwise.cli import main


def _state(step: int, base: float = 1.0) -> dict[str, Any]:
    return {
        "base": torch.full((128, 64), base),  # 32 KiB that only a "new base" changes
        "adapter": torch.full((4, 64), float(step)),
        "step": step,
    }


def _blank() -> dict[str, Any]:
    return {"base": torch.zeros(128, 64), "adapter": torch.zeros(4, 64), "step": -1}


def _loads_as(path: Path | str, expected: dict[str, Any]) -> None:
    state = _blank()
    ckpt.load(state, path)
    assert state["step"] == expected["step"]
    assert torch.equal(state["base"], expected["base"])
    assert torch.equal(state["adapter"], expected["adapter"])


def _dirs(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir() if entry.name.startswith("step-"))


def _manager(root: Path, keep_last: int | None = 2, **kwargs: Any) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        root, retention=ckpt.RetentionPolicy(keep_last=keep_last), incremental=True, **kwargs
    )


def test_retention_keeps_the_bytes_kept_checkpoints_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with _manager(root, async_save=False) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
    # Steps 4 and 5 are kept; they read the base weights from step 1's file, so step 1 stays,
    # retired (no index), holding only that file. Steps 2 and 3 are gone.
    assert _dirs(root) == ["step-00000001", "step-00000004", "step-00000005"]
    assert not (root / "step-00000001" / "shardwise.json").exists()
    assert [p.name for p in (root / "step-00000001").iterdir()] == ["data"]
    _loads_as(root / "step-00000005", _state(5))
    _loads_as(root / "step-00000004", _state(4))
    index = decode_index((root / "step-00000005" / "shardwise.json").read_bytes())
    assert [name.split("/")[1] for name in index.references] == ["step-00000001"]
    assert main(["ls", str(root), "--json"]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[1]["state"] == "retired" and rows[1]["bytes"] > 32 * 1024
    assert rows[5]["state"] == "committed" and rows[5]["bytes"] < 8 * 1024
    assert rows[5]["shared_bytes"] > 32 * 1024
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["step", "state", "own", "shared"]
    assert "retired" in out

    # The base weights change: new saves reference nothing of step 1, which then goes.
    with _manager(root, async_save=False) as manager:
        for step in range(6, 9):
            manager.save(step, _state(step, base=2.0))
    assert _dirs(root) == ["step-00000006", "step-00000007", "step-00000008"]
    _loads_as(root / "step-00000008", _state(8, base=2.0))
    index = decode_index((root / "step-00000008" / "shardwise.json").read_bytes())
    assert [name.split("/")[1] for name in index.references] == ["step-00000006"]


def test_async_saves_build_on_each_other_and_restore_sets_the_base(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with _manager(root, keep_last=None) as manager:  # async_save: the writer process
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        manager.wait()
    for step in (2, 3):
        index = decode_index((root / f"step-{step:08d}" / "shardwise.json").read_bytes())
        assert [name.split("/")[1] for name in index.references] == ["step-00000001"]
    with _manager(root, keep_last=None, async_save=False) as manager:
        state = _blank()
        assert manager.restore(state, step=2) == 2
        manager.save(4, _state(4))
    index = decode_index((root / "step-00000004" / "shardwise.json").read_bytes())
    assert index.save.checkpoint_id == str(root / "step-00000004")
    assert "adapter" in index.digests
    _loads_as(root / "step-00000004", _state(4))


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs (no cleanup catches a BaseException)."""


class _DyingStorage(LocalStorage):
    """Local storage whose ``budget``-th removal (file or directory) never happens."""

    def __init__(self, root: str, budget: int) -> None:
        super().__init__(root)
        self.budget = budget

    def _spend(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise _Killed

    def remove(self, path: str) -> None:
        self._spend()
        super().remove(path)

    def remove_directory(self, path: str) -> None:
        self._spend()
        super().remove_directory(path)


def test_a_deletion_killed_anywhere_leaves_every_kept_checkpoint_loadable(
    tmp_path: Path,
) -> None:
    template = tmp_path / "template"
    with _manager(template, keep_last=None, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    removals = 0
    while True:
        root = tmp_path / f"run-{removals}"
        shutil.copytree(template, root)
        storage = _DyingStorage(str(root), removals)
        listing = list_series(storage)

        def open_step(step: int, root: Path = root) -> LocalStorage:
            return LocalStorage(str(root / f"step-{step:08d}"))

        try:
            # Retention drops steps 1 and 2 (their files protected for step 3), as _tidy does.
            protected = deletion.protected_files(storage, listing, [1, 2])
            for step in (1, 2):
                deletion.delete_checkpoint(storage, step, open_step, protected)
            finished = True
        except _Killed:
            finished = False
        _loads_as(root / "step-00000003", _state(3))
        # The next run finishes what the kill left, and step 3 still loads.
        with _manager(root, keep_last=1, async_save=False) as manager:
            assert manager.steps()[-1] == 3
            manager.save(4, _state(4))
        _loads_as(root / "step-00000004", _state(4))
        assert _dirs(root) == ["step-00000001", "step-00000004"]
        assert [p.name for p in (root / "step-00000001").iterdir()] == ["data"]
        if finished:
            break
        removals += 1
    assert removals > 4  # every removal of the two deletions was a kill point


def test_an_incremental_series_in_an_fsspec_store() -> None:
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://incremental-{os.getpid()}-{time.monotonic_ns()}"
    with _manager(root, keep_last=1, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        state = _blank()
        assert manager.restore(state) == 3
    assert torch.equal(state["adapter"], _state(3)["adapter"])
    fs = fsspec.filesystem("memory")
    path = root.removeprefix("memory:/")
    listed = sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    assert listed == ["step-00000001", "step-00000003"]  # 1 retired: 3 reads its base bytes
    index = decode_index(fs.cat(f"{path}/step-00000003/shardwise.json"))
    assert [name.split("/")[1] for name in index.references] == ["step-00000001"]
