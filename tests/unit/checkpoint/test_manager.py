"""``CheckpointManager`` in one process, without a process group: saving by policy, retention,
restore with fallback past corrupt checkpoints, crash-safe deletion, preemption, a background
save that fails, ``memory://`` storage, and ``shardwise ls``."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.manager import deletion, list_series
from shardwise.checkpoint.manager.series import REJECTED_NAME, STEP_RECORD_NAME
from shardwise.checkpoint.saving.lock import SaveLock
from shardwise.checkpoint.storage import LocalStorage
from shardwise.cli import main


def _state(value: float) -> dict[str, Any]:
    return {
        "w": torch.full((64, 64), float(value)),
        "b": torch.arange(8) * float(value),
        "step": int(value),
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(64, 64), "b": torch.zeros(8), "step": -1}


def _steps_on_disk(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir() if entry.name.startswith("step-"))


def _flip_data_byte(checkpoint: Path) -> None:
    (data_file,) = (checkpoint / "data").iterdir()
    raw = bytearray(data_file.read_bytes())
    raw[-5] ^= 0x40  # in the last tensor's bytes
    data_file.write_bytes(bytes(raw))


def test_saves_by_policy_keeps_by_retention_and_restores_the_latest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    policy = ckpt.SavePolicy(every_steps=3, last_step=10)
    retention = ckpt.RetentionPolicy(keep_last=2, keep_every=6)
    with ckpt.CheckpointManager(root, save_policy=policy, retention=retention) as manager:
        assert manager.restore(_blank()) is None  # a fresh run
        saved = [step for step in range(1, 11) if manager.save(step, _state(step))]
        assert manager.save(11, _state(11), force=True)
    assert saved == [3, 6, 9, 10]
    # 6 kept for ever, 10 and 11 the last two; 3 and 9 deleted once newer ones committed.
    assert _steps_on_disk(root) == ["step-00000006", "step-00000010", "step-00000011"]
    manager = ckpt.CheckpointManager(root)
    assert manager.steps() == [6, 10, 11]
    assert manager.latest_step() == 11
    state = _blank()
    assert manager.restore(state) == 11
    assert torch.equal(state["w"], torch.full((64, 64), 11.0)) and state["step"] == 11
    assert manager.restore(state, step=6) == 6 and state["step"] == 6
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(12, _state(12))


def test_only_exact_step_names_are_the_series(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(5, _state(5))
        (root / "step-5").mkdir()
        (root / "step-00000007.old").mkdir()
        (root / "step-00000008").write_text("a file, not a directory")
        (root / "notes.txt").write_text("mine")
        assert manager.steps() == [5]
        manager.save(9, _state(9))
    assert sorted(os.listdir(root)) == [
        "notes.txt",
        "step-00000005",
        "step-00000007.old",
        "step-00000008",
        "step-00000009",
        "step-5",
    ]


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate the index", "lose a data file"])
def test_restore_falls_back_past_a_corrupt_latest(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    latest = root / "step-00000003"
    if damage == "flip a data byte":
        _flip_data_byte(latest)
        expected: type[ckpt.CheckpointError] = ckpt.ChecksumError
    elif damage == "truncate the index":
        index = latest / "shardwise.json"
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
        expected = ckpt.CheckpointFormatError
    else:
        for data_file in (latest / "data").iterdir():
            data_file.unlink()
        expected = ckpt.CheckpointDataError
    manager = ckpt.CheckpointManager(root, async_save=False)
    state = _blank()
    with pytest.warns(ckpt.RestoreFallbackWarning, match=r"step-00000003") as caught:
        assert manager.restore(state) == 2
    assert len(caught) == 1
    assert caught[0].filename == __file__  # at the line that called restore
    # The step is refilled from scratch: every value is checkpoint 2's, none of 3's.
    assert torch.equal(state["w"], torch.full((64, 64), 2.0))
    assert torch.equal(state["b"], torch.arange(8) * 2.0) and state["step"] == 2
    with pytest.raises(expected):
        ckpt.load(_blank(), latest)
    # Marked rejected: no longer the latest, shown by ls, never chosen again without a warning.
    assert json.loads((latest / REJECTED_NAME).read_text())["reason"]
    assert manager.latest_step() == 2
    assert manager.restore(_blank()) == 2
    # Saving that step again replaces it, and clears the mark.
    manager.save(3, _state(3))
    assert manager.latest_step() == 3 and not (latest / REJECTED_NAME).exists()
    manager.close()


def test_restore_raises_when_no_checkpoint_loads(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
        _flip_data_byte(root / "step-00000001")
        with (
            pytest.warns(ckpt.RestoreFallbackWarning),
            pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .* could be restored"),
        ):
            manager.restore(_blank())
        # A key missing from the state dict is the caller's mistake: no fallback.
        manager.save(2, _state(2))
        with pytest.raises(ckpt.CheckpointKeyError):
            manager.restore({**_blank(), "extra": torch.zeros(1)})


def test_a_restore_after_every_checkpoint_was_rejected_says_so(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
        _flip_data_byte(root / "step-00000001")
        with pytest.warns(ckpt.RestoreFallbackWarning), pytest.raises(ckpt.CheckpointError):
            manager.restore(_blank())
        # Was: None in silence, as on a fresh run.
        with pytest.warns(
            ckpt.RestoreFallbackWarning, match=r"rejected 1 committed checkpoint"
        ) as caught:
            assert manager.restore(_blank()) is None
        assert caught[0].filename == __file__
    with (
        ckpt.CheckpointManager(tmp_path / "fresh", async_save=False) as manager,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        assert manager.restore(_blank()) is None  # a fresh series: nothing to say


class _KilledError(Exception):
    """Stands for a kill in the middle of a deletion (a real kill: the kill tests)."""


def test_an_interrupted_deletion_is_uncommitted_and_finished_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    real_remove = LocalStorage.remove

    def dies_after_the_index(self: LocalStorage, path: str) -> None:
        real_remove(self, path)
        if path.endswith("shardwise.json"):
            raise _KilledError

    storage = LocalStorage(str(root))
    monkeypatch.setattr(LocalStorage, "remove", dies_after_the_index)
    with pytest.raises(_KilledError):
        deletion.delete_checkpoint(
            storage, 1, lambda step: LocalStorage(str(root / f"step-0000000{step}"))
        )
    monkeypatch.undo()
    # Half deleted: the data is there, but nothing reads it as a checkpoint.
    assert (root / "step-00000001" / "data").is_dir()
    assert [info.committed for info in list_series(storage)] == [False, True]
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(_blank(), root / "step-00000001")
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        assert manager.steps() == [2]
        manager.save(3, _state(3))  # the next commit finishes the deletion
    assert _steps_on_disk(root) == ["step-00000002", "step-00000003"]


def test_a_checkpoint_whose_save_lock_is_live_is_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        (root / "step-00000001" / "shardwise.json").unlink()  # uncommitted, older than 2
        lock = SaveLock(LocalStorage(str(root / "step-00000001")), "0123456789abcdef")
        lock.acquire()  # a save of this live process writes it
        try:
            manager.save(3, _state(3))
            assert (root / "step-00000001" / "data").is_dir()
        finally:
            lock.release()
        manager.save(4, _state(4))
    assert "step-00000001" not in _steps_on_disk(root)


def test_a_failed_background_save_raises_at_the_next_call(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / "data").write_text("not a directory: the save must fail")
    manager = ckpt.CheckpointManager(root)
    assert manager.save(2, _state(2))  # started in the background
    with pytest.raises(ckpt.CheckpointDataError, match="not a real directory"):
        manager.save(3, _state(3))
    assert manager.save(4, _state(4))
    manager.wait()
    assert manager.steps() == [4]
    manager.close()


def test_a_preemption_signal_makes_the_next_call_save(tmp_path: Path) -> None:
    root = tmp_path / "run"
    before = signal.getsignal(signal.SIGUSR1)
    manager = ckpt.CheckpointManager(
        root, save_policy=ckpt.SavePolicy(every_steps=100), preemption_signals=[signal.SIGUSR1]
    )
    assert not manager.save(1, _state(1))
    os.kill(os.getpid(), signal.SIGUSR1)  # handled here: only a flag is set
    assert manager.save(2, _state(2))
    assert manager.preempted
    assert manager.steps() == [2]  # saved synchronously: committed on return
    assert not manager.save(3, _state(3))  # the notice was acted on
    manager.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_should_save_errors_and_bad_metrics_raise(tmp_path: Path) -> None:
    def broken(step: int) -> bool:
        raise ZeroDivisionError("policy bug")

    with ckpt.CheckpointManager(
        tmp_path / "a", save_policy=ckpt.SavePolicy(should_save=broken)
    ) as manager:
        with pytest.raises(ZeroDivisionError, match="policy bug"):
            manager.save(1, _state(1))
        with pytest.raises(TypeError, match="metric 'loss'"):
            manager.save(2, _state(2), metrics={"loss": "low"}, force=True)
        with pytest.raises(ValueError, match="step must be an int"):
            manager.save(-1, _state(1))
    with pytest.raises(TypeError, match="save_policy must be a SavePolicy"):
        ckpt.CheckpointManager(tmp_path / "b", save_policy={"every_steps": 3})  # type: ignore[arg-type]


def test_keep_best_by_metric_on_memory_storage() -> None:
    root = f"memory://manager-test-{os.getpid()}"
    retention = ckpt.RetentionPolicy(keep_last=1, keep_best=2, best_metric="loss")
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: float("nan"), 5: 2.0, 6: 3.0}
    # Synchronous: memory:// is private to this process, async_save writes from another.
    with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
        for step, loss in losses.items():
            manager.save(step, _state(step), metrics={"loss": torch.tensor(loss)})
        assert manager.steps() == [2, 5, 6]
        state = _blank()
        assert manager.restore(state, step=2) == 2 and state["step"] == 2


def _ls(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["ls", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_the_series(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    retention = ckpt.RetentionPolicy(keep_last=1, keep_every=2)
    with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step), metrics={"loss": 1.0 / step})
        (root / "step-00000009" / "data").mkdir(parents=True)  # a killed save's directory
    _flip_data_byte(root / "step-00000003")
    with pytest.warns(ckpt.RestoreFallbackWarning):
        ckpt.CheckpointManager(root).restore(_blank())
    code, out, err = _ls(capsys, str(root), "--json")
    assert code == 0 and err == ""
    summary = json.loads(out)
    assert summary["retention"]["keep_every"] == 2
    rows = {row["step"]: row for row in summary["checkpoints"]}
    assert sorted(rows) == [2, 3, 9]
    assert rows[2]["state"] == "committed" and rows[2]["kept"] is True
    assert rows[2]["metrics"] == {"loss": 0.5} and rows[2]["bytes"] > 64 * 64 * 4
    assert rows[3]["state"] == "rejected" and "checksum" in rows[3]["rejected"].lower()
    assert rows[9]["state"] == "uncommitted" and rows[9]["time"] is None
    assert rows[2]["path"] == str(root / "step-00000002")
    code, out, _ = _ls(capsys, str(root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "step",
        "state",
        "own",
        "shared",
        "saved",
        "(UTC)",
        "kept",
        "metrics",
    ]
    assert lines[1].split()[:2] == ["2", "committed"] and "loss=0.5" in lines[1]
    assert lines[3].split()[:2] == ["9", "uncommitted"]
    assert "step 3 rejected:" in out and "keep_last=1, keep_every=2" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _ls(capsys, str(empty))[:2] == (0, f"no checkpoints under {empty}\n")
    code, out, err = _ls(capsys, str(tmp_path / "missing"))
    assert code == 3 and out == "" and err.startswith("shardwise ls: error: no series at")
    assert len(err.splitlines()) == 1
    assert (root / "step-00000002" / STEP_RECORD_NAME).is_file()


def test_a_linked_root_works_and_no_link_below_it_is_followed(tmp_path: Path) -> None:
    real, outside = tmp_path / "real", tmp_path / "outside"
    real.mkdir()
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "precious.bin").write_bytes(b"not the series'")
    (tmp_path / "run").symlink_to(real)  # the user chose the link: it is followed
    (real / "step-00000003").symlink_to(outside)  # below the root: never followed
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(tmp_path / "run", retention=retention) as manager:
        for step in (1, 2, 4):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.steps() == [4]
    assert _steps_on_disk(real) == ["step-00000003", "step-00000004"]
    assert (real / "step-00000003").is_symlink()
    assert (outside / "data" / "precious.bin").read_bytes() == b"not the series'"


def test_every_seconds_counts_from_the_last_save(tmp_path: Path) -> None:
    policy = ckpt.SavePolicy(every_seconds=0.5)
    with ckpt.CheckpointManager(tmp_path / "run", save_policy=policy, async_save=False) as manager:
        assert not manager.save(1, _state(1))  # 0.5 s have not passed since it was made
        time.sleep(0.55)
        assert manager.save(2, _state(2))
        assert not manager.save(3, _state(3))  # counted again from that save
        time.sleep(0.55)
        assert manager.save(4, _state(4))
        assert manager.steps() == [2, 4]


def test_a_relative_root_stays_where_it_was_when_the_directory_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with ckpt.CheckpointManager("run") as manager:
        manager.save(1, _state(1))
        monkeypatch.chdir(tmp_path / "b")  # a training script may chdir (a data loader...)
        manager.save(2, _state(2))
        manager.wait()
        assert manager.steps() == [1, 2]
        assert manager.path(2) == str(tmp_path / "a" / "run" / "step-00000002")
    assert _steps_on_disk(tmp_path / "a" / "run") == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "b" / "run").exists()
