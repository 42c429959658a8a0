"""What a save and a load log: one INFO line each, with the path, the bytes (binary units),
the time and the throughput."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise._progress import human_bytes
from shardwise.checkpoint.report import log_done


def _records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == name]


def test_a_save_logs_its_size_files_time_and_throughput(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c"
    with caplog.at_level(logging.INFO, logger="shardwise.checkpoint"):
        ckpt.save({"w": torch.ones(1000), "b": b"x" * 100, "step": 3}, path)
    (record,) = _records(caplog, "shardwise.checkpoint.save")
    assert record.levelno == logging.INFO
    on_disk = (path / "shardwise.json").stat().st_size + sum(
        entry.stat().st_size for entry in (path / "data").iterdir()
    )
    message = record.getMessage()
    assert message.startswith(f"saved {os.fspath(path)}: {human_bytes(on_disk)} in 1 data file ")
    assert re.search(r" in [0-9]+\.[0-9]{2} s \([0-9.]+ (B|KiB|MiB|GiB)/s\)$", message), message


def test_a_load_logs_its_bytes_and_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt.save({"w": torch.arange(1000.0), "step": 3}, tmp_path / "c")
    target = {"w": torch.zeros(1000), "step": 0}
    with caplog.at_level(logging.INFO, logger="shardwise.checkpoint"):
        ckpt.load(target, tmp_path / "c")
    (record,) = _records(caplog, "shardwise.checkpoint.load")
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert message.startswith(f"loaded {os.fspath(tmp_path / 'c')}: {human_bytes(4000)} in ")
    assert re.search(r" in [0-9]+\.[0-9]{2} s \(", message), message


def test_a_failed_save_logs_no_success(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shardwise.checkpoint"), pytest.raises(TypeError):
        ckpt.save({"s": {1}}, tmp_path / "c")
    assert not _records(caplog, "shardwise.checkpoint.save")


def test_the_summary_line_without_time() -> None:
    logger = logging.getLogger("shardwise.test_summary")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_done(logger, "saved", "/ckpt", 3 << 30, 0.0, " in 2 data files")
        log_done(logger, "loaded", "/ckpt", 3 << 20, 2.0)
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == [
        "saved /ckpt: 3.0 GiB in 2 data files in 0.00 s (-/s)",
        "loaded /ckpt: 3.0 MiB in 2.00 s (1.5 MiB/s)",
    ]
