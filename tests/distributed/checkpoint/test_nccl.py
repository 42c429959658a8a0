"""Checkpoints over an NCCL group, CUDA tensors throughout: a save and a load, an
``async_save``, and a ``CheckpointManager`` restoring from its local tier and from its durable
tier (``tests/_nccl_worker.py``, in a process of its own: an NCCL group of one, as one GPU
allows). Skipped without a GPU and NCCL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
CHECKS = ["save and load", "async_save", "local tier", "durable tier", "ok"]


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs a GPU and NCCL"
)
def test_save_load_async_save_and_both_tiers_over_nccl(tmp_path: Path) -> None:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)  # a group of one of its own, whatever launched the tests
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), str(REPO / "src"), env.get("PYTHONPATH", "")) if part
    )
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_nccl_worker.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    lines = result.stdout.splitlines()  # NCCL_DEBUG, if set, prints there too
    assert [line for line in lines if line in CHECKS] == CHECKS, result.stdout
