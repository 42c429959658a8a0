"""A progress bar on rank 0 counts the whole job's bytes, not rank 0's share."""

from __future__ import annotations

import io
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise.checkpoint as ckpt
from tests.harness import distributed

ROWS = 4 * 64  # 4 ranks x 64 rows of 4 KiB: 1 MiB in all, 256 KiB per rank


def _bar_text(run) -> str:
    captured = io.StringIO()
    stderr = sys.stderr
    sys.stderr = captured
    try:
        run()
    finally:
        sys.stderr = stderr
    return captured.getvalue()


def _final(text: str) -> str:
    return [part for part in text.split("\r") if part.strip()][-1]


@distributed(world_size=4)
def test_save_and_load_bars_count_every_rank(tmp_path):
    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(ROWS * 1024, dtype=torch.float32).reshape(ROWS, 1024)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    # Only rank 0 asks: the others count for its bar all the same.
    text = _bar_text(lambda: ckpt.save(state, tmp_path / "c", progress=dist.get_rank() == 0))
    if dist.get_rank() == 0:
        assert re.search(r"saving .*1\.0/1\.0 MiB", _final(text)), text
    else:
        assert text == ""

    target = {"w": distribute_tensor(torch.zeros(ROWS, 1024), mesh, [Shard(0)])}
    text = _bar_text(lambda: ckpt.load(target, tmp_path / "c", progress=dist.get_rank() == 0))
    if dist.get_rank() == 0:
        assert re.search(r"loading .*1\.0/1\.0 MiB", _final(text)), text
    assert torch.equal(target["w"].full_tensor(), full)
