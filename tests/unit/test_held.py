"""``collectives._held``: a collective's tensors are let go only after the backend lets go of
them, or parked until the next collective when it keeps them longer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardwise.collectives import _held
from shardwise.collectives._held import WAIT_SECONDS, held


def test_tensors_are_kept_until_the_backend_drops_them() -> None:
    tensor = torch.zeros(4)
    backend: list[torch.Tensor] = []
    with held(tensor, [torch.ones(1)], None):
        # What a worker thread holds while the collective runs: a reference on the C++ side
        # (a view holds its base; more Python names of one tensor would not count).
        backend.append(tensor.view(2, 2))

        def finish() -> None:  # ...and drops a moment after the caller's wait returned
            time.sleep(WAIT_SECONDS / 5)
            backend.clear()

        worker = threading.Thread(target=finish)
        worker.start()
    # held() returned only once the worker had dropped the tensor.
    assert not backend
    worker.join()
    assert not _held._parked


def test_tensors_held_longer_are_parked_until_the_next_collective() -> None:
    tensor = torch.zeros(4)
    kept = []
    began = time.monotonic()
    with held(tensor):
        kept.append(tensor.view(2, 2))  # a reference the "backend" keeps past the wait
    assert time.monotonic() - began >= WAIT_SECONDS
    assert len(_held._parked) == 1 and _held._parked[0] is tensor
    with held(torch.zeros(1)):
        pass
    assert not _held._parked


def test_a_collective_that_raised_waits_for_nothing() -> None:
    tensor = torch.zeros(4)
    kept = []
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="peer died"), held(tensor):
        kept.append(tensor.view(2, 2))
        raise RuntimeError("peer died")
    assert time.monotonic() - began < WAIT_SECONDS
    assert not _held._parked
