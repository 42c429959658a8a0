"""``examples/train_sharded.py`` on pooled gloo groups: 4 ranks train with a checkpoint
after step 6; the loss goes down; 2 ranks (another sharding of every weight) resume from the
checkpoint with the uninterrupted run's losses, and 4 ranks resume with exactly them.

The example's per-rank functions run in the pools (its ``main`` spawns fresh processes,
which takes longer and checks nothing more).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"


def _example() -> ModuleType:
    name = "shardwise_examples_train_sharded"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _uninterrupted(path: str) -> list[float]:
    losses: list[float] = _example().run_uninterrupted(path)
    return losses


def _resumed(path: str) -> list[float]:
    losses: list[float] = _example().run_resumed(path)
    return losses


@pytest.mark.distributed(world_size=4, fresh=False, rpc=False)
def test_training_resumes_on_2_ranks_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    example = _example()
    path = str(tmp_path / "step-6")
    per_rank = run_on_ranks(_uninterrupted, 4, args=(path,))
    uninterrupted = per_rank[0]
    assert all(losses == uninterrupted for losses in per_rank)
    assert len(uninterrupted) == example.STEPS
    assert uninterrupted[-1] < 0.5 * uninterrupted[0], uninterrupted  # it learns

    resumed = run_on_ranks(_resumed, 2, args=(path,))
    assert resumed[0] == resumed[1]
    # The same steps on another world size: the sums add up in another order, nothing more.
    assert resumed[0] == pytest.approx(uninterrupted[example.SAVE_AT :], rel=1e-5)

    # On the saving world size the resumed run is the uninterrupted one, bit for bit: the
    # checkpoint holds everything the training depends on.
    again = run_on_ranks(_resumed, 4, args=(path,))
    assert again[0] == uninterrupted[example.SAVE_AT :]
