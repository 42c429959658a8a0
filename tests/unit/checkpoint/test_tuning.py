"""The tunables and their environment overrides."""

from __future__ import annotations

import dataclasses
import os

import pytest

from shardwise.checkpoint.tuning import TUNING, Tuning, from_environment


def test_defaults_without_environment() -> None:
    assert from_environment({}) == Tuning()
    assert Tuning().io_threads == min(4, os.cpu_count() or 1)
    assert Tuning().read_batch_bytes == 32 << 20


def test_every_field_has_its_variable() -> None:
    for field in dataclasses.fields(Tuning):
        variable = "SHARDWISE_" + field.name.upper()
        default = getattr(Tuning(), field.name)
        value = default * 2
        tuned = from_environment({variable: str(value)})
        assert getattr(tuned, field.name) == value, variable


def test_byte_suffixes() -> None:
    tuned = from_environment(
        {
            "SHARDWISE_READ_GAP_BYTES": "128KiB",
            "SHARDWISE_STAGING_BYTES": " 1 gib ",
            "SHARDWISE_WRITE_PIECE_BYTES": "8MiB",
            "SHARDWISE_IO_THREADS": "",  # empty means unset
        }
    )
    assert tuned.read_gap_bytes == 128 << 10
    assert tuned.staging_bytes == 1 << 30
    assert tuned.write_piece_bytes == 8 << 20
    assert tuned.io_threads == Tuning().io_threads


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SHARDWISE_IO_THREADS", "four", "SHARDWISE_IO_THREADS must be an integer, got 'four'"),
        ("SHARDWISE_IO_THREADS", "0", "SHARDWISE_IO_THREADS must be positive, got 0"),
        ("SHARDWISE_READ_RUN_BYTES", "8MB", "SHARDWISE_READ_RUN_BYTES must be a byte count"),
        ("SHARDWISE_LOCK_STALE_SECONDS", "soon", "must be a number of seconds, got 'soon'"),
        ("SHARDWISE_LOCK_STALE_SECONDS", "-1", "SHARDWISE_LOCK_STALE_SECONDS must be positive"),
        ("SHARDWISE_WRITE_PIECE_BYTES", "1000", "must be a multiple of 1 MiB"),
        ("SHARDWISE_LOCK_STALE_SECONDS", "inf", "must be finite, got inf"),
        ("SHARDWISE_LOCK_HEARTBEAT_SECONDS", "nan", "must be finite, got nan"),
        ("SHARDWISE_READ_BATCH_BYTES", "yes", "SHARDWISE_READ_BATCH_BYTES must be a byte count"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_environment({variable: value})


def test_the_process_values_are_a_tuning() -> None:
    assert isinstance(TUNING, Tuning)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TUNING.io_threads = 1  # type: ignore[misc]
