"""``CheckpointManager(local_tier=...)`` in one process (one node, no replicas): the local
rule beside the save policy, ``restored_from``, pruning to ``keep``, a corrupt own copy
falling back to the durable tier, the warning when placement degrades, settings checked."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

import shardwise.checkpoint as ckpt


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((4, 3), float(step)), "step": step}


def _tier(tmp_path: pathlib.Path, **options: object) -> ckpt.LocalTier:
    settings: dict[str, object] = {"job_id": "job", **options}
    return ckpt.LocalTier(
        every_steps=2,
        replicas=0,
        directory=tmp_path / "shm",
        min_free_bytes=0,
        **settings,  # type: ignore[arg-type]
    )


def _manager(tmp_path: pathlib.Path, **options: object) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        tmp_path / "run",
        save_policy=ckpt.SavePolicy(every_steps=3),
        async_save=False,
        local_tier=_tier(tmp_path, **options),
    )


def test_local_saves_beside_the_policy_and_restore(tmp_path: pathlib.Path) -> None:
    with _manager(tmp_path) as manager:
        saved = [step for step in range(1, 8) if manager.save(step, _state(step))]
    assert saved == [3, 6]  # the durable policy's; the local rule is its own
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == [
        "job.json",
        "spare",  # step 2's data file, pruned, became step 6's
        "step_4",
        "step_6",
    ]
    assert list((tmp_path / "shm" / "spare").iterdir()) == []
    state = _state(0)
    manager = _manager(tmp_path)
    assert manager.restored_from is None
    assert manager.restore(None, state) == 6  # local 6 is not newer than durable 6
    assert manager.restored_from == "durable"
    with manager:
        manager.save(8, _state(8))  # local only
    state = _state(0)
    manager = _manager(tmp_path)
    assert manager.restore(None, state) == 8
    assert manager.restored_from == "local"
    assert torch.equal(state["w"], torch.full((4, 3), 8.0))  # type: ignore[arg-type]
    assert state["step"] == 8
    assert manager.restore(6, state) == 6  # an explicit step: the series'
    assert manager.restored_from == "durable"
    manager.close()
    assert not any(p.name.startswith("restore_") for p in (tmp_path / "shm").iterdir())


def test_restore_local_takes_only_a_local_step_newer_than_the_series(
    tmp_path: pathlib.Path,
) -> None:
    with _manager(tmp_path) as manager:
        for step in range(1, 7):  # durable 3 and 6, local 4 and 6
            manager.save(step, _state(step))
    state = _state(0)
    with _manager(tmp_path) as manager:
        assert manager.restore_local(state) is None  # local 6 is not newer than durable 6
        assert manager.restored_from is None
        assert torch.equal(state["w"], torch.zeros(4, 3))  # type: ignore[arg-type]
        manager.save(8, _state(8))  # local only
    with _manager(tmp_path) as manager:
        assert manager.restore_local(state) == 8
        assert manager.restored_from == "local"
    assert torch.equal(state["w"], torch.full((4, 3), 8.0))  # type: ignore[arg-type]
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:  # no tier
        assert manager.restore_local(_state(0)) is None
        assert manager.restored_from is None


def _data_file(tmp_path: pathlib.Path, step: int) -> pathlib.Path:
    [data] = (tmp_path / "shm" / f"step_{step}" / "rank_0" / "data").iterdir()
    return data


def test_a_save_writes_into_the_files_of_the_step_it_prunes(tmp_path: pathlib.Path) -> None:
    with _manager(tmp_path) as manager:
        manager.save(2, {"w": torch.arange(5000.0), "step": 2})
        # Held open, step 2's file keeps its inode: a new file could not get its number.
        with _data_file(tmp_path, 2).open("rb") as first:
            status = os.fstat(first.fileno())
            inode, size = status.st_ino, status.st_size
            manager.save(4, {"w": torch.arange(5000.0), "step": 4})
            manager.save(8, {"w": torch.arange(1000.0) + 8, "step": 8})  # a shorter file
            reused = _data_file(tmp_path, 8)
            assert reused.stat().st_ino == inode
            assert reused.stat().st_size < size  # truncated where the writes ended
    assert list((tmp_path / "shm" / "spare").iterdir()) == []
    state = {"w": torch.zeros(1000), "step": 0}
    with _manager(tmp_path) as manager:
        assert manager.restore(None, state) == 8  # every block checked: not one old byte
        assert manager.restored_from == "local"
    assert torch.equal(state["w"], torch.arange(1000.0) + 8)  # type: ignore[arg-type]


def test_a_corrupt_own_copy_falls_back_to_durable(tmp_path: pathlib.Path) -> None:
    with _manager(tmp_path) as manager:
        for step in range(1, 5):
            manager.save(step, _state(step))
    data = next((tmp_path / "shm" / "step_4" / "rank_0" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    state = _state(0)
    manager = _manager(tmp_path)
    assert manager.restore(None, state) == 3  # step 4's only part fails its checksums
    assert manager.restored_from == "durable"
    manager.close()


def _contents(path: pathlib.Path) -> dict[str, bytes | None]:
    """Every entry below ``path``: a file's bytes, None for a directory."""
    return {
        str(p.relative_to(path)): None if p.is_dir() else p.read_bytes()
        for p in sorted(path.rglob("*"))
    }


def test_another_jobs_directory_is_never_used_nor_changed(tmp_path: pathlib.Path) -> None:
    with _manager(tmp_path) as manager:  # job "job": local steps 6 and 8, durable 3 and 6
        for step in range(1, 9):
            manager.save(step, _state(step))
    before = _contents(tmp_path / "shm")
    other = ckpt.CheckpointManager(
        tmp_path / "other-run",
        save_policy=ckpt.SavePolicy(every_steps=3),
        async_save=False,
        local_tier=_tier(tmp_path, job_id="other-job"),
    )
    state = _state(0)
    with pytest.warns(ckpt.LocalTierWarning, match="another job") as restoring:
        assert other.restore(None, state) is None  # job's step 8 is not this job's
    assert other.restored_from is None
    assert torch.equal(state["w"], torch.zeros(4, 3))  # type: ignore[arg-type]
    with pytest.warns(ckpt.LocalTierWarning, match="skipped the local save of step 2") as saving:
        other.save(2, _state(2))
    other.close()
    # In the background, the report comes at the next call (here: close).
    background = ckpt.CheckpointManager(
        tmp_path / "other-run", local_tier=_tier(tmp_path, job_id="other-job")
    )
    background.save(4, _state(4))
    with pytest.warns(ckpt.LocalTierWarning, match="another job") as closing:
        background.close()
    assert _contents(tmp_path / "shm") == before  # nothing written, pruned or recycled
    # Each warning points at the line of this file that called the manager.
    assert {w.filename for w in [*restoring, *saving, *closing]} == {__file__}
    with _manager(tmp_path) as manager:
        assert manager.restore(None, state) == 8
        assert manager.restored_from == "local"


def test_a_local_save_cut_short_is_never_restored_and_the_series_goes_on(
    tmp_path: pathlib.Path,
) -> None:
    # What a process killed while writing step 10 leaves: the part's files, its data file cut
    # short, and no part.json (written last).
    with _manager(tmp_path) as manager:
        for step in range(1, 9):
            manager.save(step, _state(step))
    shm = tmp_path / "shm"
    shutil.copytree(shm / "step_8", shm / "step_10")
    (shm / "step_10" / "rank_0" / "part.json").unlink()
    data = _data_file(tmp_path, 10)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    state = _state(0)
    with _manager(tmp_path) as manager:
        assert manager.restore(None, state) == 8  # the newest complete local step
        assert manager.restored_from == "local"
        assert torch.equal(state["w"], torch.full((4, 3), 8.0))  # type: ignore[arg-type]
        manager.save(10, _state(10))  # the part left over is replaced, not mixed in
    with _manager(tmp_path) as manager:
        assert manager.restore(None, state) == 10
        assert manager.restored_from == "local"
    assert torch.equal(state["w"], torch.full((4, 3), 10.0))  # type: ignore[arg-type]
    assert state["step"] == 10


def test_fresh_start_and_degraded_placement(tmp_path: pathlib.Path) -> None:
    with pytest.warns(ckpt.LocalTierWarning, match="1 node"):
        manager = ckpt.CheckpointManager(
            tmp_path / "run",
            local_tier=ckpt.LocalTier(every_steps=1, job_id="job", directory=tmp_path / "shm"),
        )
    assert manager.restore(None, _state(0)) is None
    assert manager.restored_from is None
    manager.close()
    with pytest.raises(TypeError, match="local_tier must be a LocalTier"):
        ckpt.CheckpointManager(tmp_path / "run", local_tier=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_world_size 3"):
        ckpt.CheckpointManager(tmp_path / "run", local_tier=_tier(tmp_path, local_world_size=3))


def test_background_local_saves_in_one_process(tmp_path: pathlib.Path) -> None:
    # async_save: the local save is staged, then written by the tier's thread; the state is
    # changed in place right after each call, as an optimizer step would.
    policy = ckpt.SavePolicy(every_steps=100)  # no durable save: the local tier alone
    state = _state(0)
    with ckpt.CheckpointManager(
        tmp_path / "run", save_policy=policy, local_tier=_tier(tmp_path)
    ) as manager:
        for step in range(1, 5):
            state["w"].fill_(float(step))  # type: ignore[union-attr]
            state["step"] = step
            assert manager.save(step, state) is False  # the durable policy's answer
            state["w"].fill_(-1.0)  # type: ignore[union-attr]
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["job.json", "step_2", "step_4"]
    restored = _state(0)
    manager = _manager(tmp_path)
    assert manager.restore(None, restored) == 4
    assert manager.restored_from == "local"
    assert torch.equal(restored["w"], torch.full((4, 3), 4.0))  # type: ignore[arg-type]
    manager.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_state_is_staged_before_a_later_update_and_restored_onto_the_gpu(
    tmp_path: pathlib.Path,
) -> None:
    # The background local save copies GPU tensors on a side stream: an update queued on the
    # training stream right after the call must not overtake the copy.
    n = 1 << 22
    policy = ckpt.SavePolicy(every_steps=100)  # the local tier alone
    state = {"w": torch.arange(n, device="cuda", dtype=torch.float32), "b": torch.ones(3).cuda()}
    with ckpt.CheckpointManager(
        tmp_path / "run", save_policy=policy, local_tier=_tier(tmp_path)
    ) as manager:
        manager.save(2, state)
        state["w"].add_(1)
        state["b"].zero_()
    restored = {"w": torch.zeros(n, device="cuda"), "b": torch.zeros(3, device="cuda")}
    manager = _manager(tmp_path)
    assert manager.restore(None, restored) == 2
    assert manager.restored_from == "local"
    manager.close()
    assert restored["w"].device.type == "cuda"
    assert torch.equal(restored["w"].cpu(), torch.arange(n, dtype=torch.float32))
    assert torch.equal(restored["b"].cpu(), torch.ones(3))
