"""ShardwiseCheckpointManager.Config: torchtitan's validation of the shared fields, ours of
our own (a ValueError naming the field), and the one-line switch of a trainer's config."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer import BaseCheckpointManager

from shardwise.integrations.torchtitan import ShardwiseCheckpointManager

Config = ShardwiseCheckpointManager.Config


def _build(config: Any, dump_folder: str) -> Any:
    """``config`` built as the trainer builds it, around nothing to save."""
    return config.build(
        dataloader=None,
        model_parts=[],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=dump_folder,
    )


def test_is_a_torchtitan_checkpoint_config_that_builds_our_manager() -> None:
    config = Config(enable=False)
    assert isinstance(config, BaseCheckpointManager.Config)
    assert issubclass(ShardwiseCheckpointManager, BaseCheckpointManager)
    manager = _build(config, "/nowhere")
    assert type(manager) is ShardwiseCheckpointManager
    assert manager.load() is False and manager.save(10) is False  # disabled: nothing happens
    manager.close()


def test_defaults() -> None:
    config = Config()
    assert (config.async_save, config.incremental, config.verify) == (True, False, True)
    assert config.keep_latest_k == 10 and config.interval == 500  # torchtitan's


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"keep_every": 0}, "keep_every"),
        ({"keep_every": True}, "keep_every"),
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": 2}, "keep_best requires best_metric"),
        ({"best_metric": "loss"}, "best_metric"),
        ({"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"}, "best_mode"),
        ({"preemption_signals": ["SIGNOPE"]}, "preemption_signals"),
        ({"preemption_signals": "SIGTERM"}, "preemption_signals"),
        ({"storage_options": "anon"}, "storage_options"),
        ({"local_interval": -1}, "local_interval must be an int >= 0"),
        ({"local_interval": True}, "local_interval"),
        ({"local_interval": "50"}, "local_interval"),
        ({"local_replicas": 2}, "local_replicas has no effect without local_interval"),
        ({"local_directory": "/dev/shm/x"}, "local_directory has no effect without"),
        ({"local_job_id": "job-1"}, "local_job_id has no effect without"),
        (
            {
                "initial_load_path": "/w",
                "initial_load_in_hf": True,
                "initial_load_in_hf_quantized": True,
            },
            "initial_load_in_hf_quantized",
        ),
        # torchtitan's own checks of the shared fields still run
        ({"keep_latest_k": 1}, "at least 2"),
        ({"interval": 0}, "interval"),
        ({"initial_load_path": "relative/dir"}, "initial_load_path"),
        ({"last_save_in_hf": True, "last_save_model_only": False}, "last_save_in_hf"),
    ],
)
def test_invalid_fields_raise_value_error_naming_them(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**fields)


def test_valid_own_fields() -> None:
    config = Config(
        keep_every=1000,
        keep_best=2,
        best_metric="loss",
        best_mode="max",
        preemption_signals=["SIGTERM", "SIGUSR1"],
        storage_options={"anon": True},
        incremental=True,
        async_save=False,
    )
    assert config.preemption_signals == ["SIGTERM", "SIGUSR1"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"local_replicas": -1}, "LocalTier.replicas must be >= 0"),
        ({"local_keep": 3}, "LocalTier.keep must be from 1 to 2"),
        ({"local_job_id": "../up"}, "not a portable name"),
        (
            {"local_directory": "s3://bucket/tier", "local_job_id": "job-1"},
            "LocalTier.directory must be a local path",
        ),
        ({}, "pass job_id= .* or start torchrun with --rdzv-id"),  # no job id anywhere
    ],
)
def test_local_tier_settings_are_checked_where_the_job_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], message: str
) -> None:
    # The job id defaults to torchrun's, in the job's environment: the tier is made when the
    # trainer builds the manager, and its settings are checked there.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    config = Config(enable=True, async_save=False, local_interval=50, **fields)
    with pytest.raises(ValueError, match=message) as raised:
        _build(config, str(tmp_path))
    assert "local_* settings" in str(raised.value)
