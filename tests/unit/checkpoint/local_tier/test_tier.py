"""``LocalTier``: defaults, the steps it wants, the job id's precedence, validation naming the
field."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

import shardwise.checkpoint
from shardwise.checkpoint.local_tier import LocalTier, job_id_from_environment


@pytest.fixture(autouse=True)
def _no_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_defaults() -> None:
    tier = LocalTier(every_steps=50, job_id="job-7")
    assert (tier.replicas, tier.keep, tier.min_free_bytes) == (1, 2, 1 << 30)
    assert tier.resolved_job_id == "job-7"
    assert tier.resolved_directory == "/dev/shm/shardwise-job-7"


def test_wants_the_multiples_of_every_steps() -> None:
    tier = LocalTier(every_steps=50, job_id="job-7")
    assert [step for step in range(0, 201) if tier.wants(step)] == [0, 50, 100, 150, 200]
    assert all(LocalTier(every_steps=1, job_id="j").wants(step) for step in range(5))


def test_every_steps_is_required() -> None:
    with pytest.raises(TypeError, match="every_steps"):
        LocalTier(job_id="j")  # type: ignore[call-arg]


def test_job_id_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-42")
    tier = LocalTier(every_steps=1)
    assert tier.job_id is None
    assert tier.resolved_job_id == "rdzv-42"
    assert tier.resolved_directory == "/dev/shm/shardwise-rdzv-42"


def test_explicit_job_id_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-42")
    assert LocalTier(every_steps=1, job_id="slurm-9").resolved_job_id == "slurm-9"


@pytest.mark.parametrize("value", [None, "", "none"])
def test_no_job_id_is_refused(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is not None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
    with pytest.raises(ValueError, match=r"job_id.*--rdzv-id"):
        LocalTier(every_steps=1)
    assert job_id_from_environment(os.environ) is None


def test_relative_directory_is_made_absolute(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tier = LocalTier(every_steps=1, job_id="j", directory="tier")
    monkeypatch.chdir("/")
    assert tier.resolved_directory == str(tmp_path / "tier")
    assert tier.directory == "tier"


def test_path_and_file_url(tmp_path: pathlib.Path) -> None:
    assert LocalTier(every_steps=1, job_id="j", directory=tmp_path).resolved_directory == str(
        tmp_path
    )
    url = LocalTier(every_steps=1, job_id="j", directory=f"file://{tmp_path}/t")
    assert url.resolved_directory == f"{tmp_path}/t"


@pytest.mark.parametrize(
    ("changes", "error", "field"),
    [
        ({"every_steps": 0}, ValueError, "every_steps"),
        ({"every_steps": -5}, ValueError, "every_steps"),
        ({"every_steps": True}, TypeError, "every_steps"),
        ({"every_steps": 2.0}, TypeError, "every_steps"),
        ({"replicas": -1}, ValueError, "replicas"),
        ({"replicas": "1"}, TypeError, "replicas"),
        ({"keep": 0}, ValueError, "keep"),
        ({"keep": 3}, ValueError, "keep"),
        ({"keep": False}, TypeError, "keep"),
        ({"min_free_bytes": -1}, ValueError, "min_free_bytes"),
        ({"job_id": 7}, TypeError, "job_id"),
        ({"job_id": "a/b"}, ValueError, "job id"),
        ({"job_id": ".."}, ValueError, "job id"),
        ({"job_id": "-x"}, ValueError, "job id"),
        ({"job_id": "jöb"}, ValueError, "job id"),
        ({"directory": 5}, TypeError, "directory"),
        ({"directory": "s3://bucket/tier"}, ValueError, "directory"),
        ({"directory": ""}, ValueError, "directory"),
    ],
)
def test_validation_names_the_field(
    changes: dict[str, object], error: type[Exception], field: str
) -> None:
    arguments: dict[str, object] = {"every_steps": 10, "job_id": "j", **changes}
    with pytest.raises(error, match=field):
        LocalTier(**arguments)  # type: ignore[arg-type]


def test_frozen_slotted_kw_only() -> None:
    tier = LocalTier(every_steps=1, job_id="j")
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.keep = 1  # type: ignore[misc]
    assert not hasattr(tier, "__dict__")
    with pytest.raises(TypeError):
        LocalTier(1)  # type: ignore[misc]
    assert tier == LocalTier(every_steps=1, job_id="j")


def test_exported_from_checkpoint() -> None:
    assert shardwise.checkpoint.LocalTier is LocalTier
    assert {"LocalTier", "LocalTierWarning"} <= set(shardwise.checkpoint.__all__)


def test_local_world_size_is_checked() -> None:
    assert LocalTier(every_steps=1, job_id="j").local_world_size is None
    assert LocalTier(every_steps=1, job_id="j", local_world_size=8).local_world_size == 8
    with pytest.raises(ValueError, match="local_world_size"):
        LocalTier(every_steps=1, job_id="j", local_world_size=0)
    with pytest.raises(TypeError, match="local_world_size"):
        LocalTier(every_steps=1, job_id="j", local_world_size="2")  # type: ignore[arg-type]
