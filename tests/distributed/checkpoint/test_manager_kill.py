"""``kill -9`` of a training run on 2 ranks in the middle of a retention deletion and in the
middle of a save, then resumes (``tests/_manager_worker.py``): the half-deleted and the
half-saved checkpoints never look committed, every resume restores exactly the newest complete
step, and a later run finishes the deletion and replaces the killed save, leaving only what the
retention policy keeps and no lock or temporary file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

import shardwise.checkpoint as ckpt
from tests._manager_worker import full
from tests.distributed.checkpoint.test_kill import REPO, _environment, _free_port

WORLD = 2
#: Importing torch and joining the group on a busy 2-core machine, then a few small saves.
RUN_TIMEOUT = 120.0


def _run(
    root: Path, last_step: int, logs: Path, kill_at: str | None = None, *options: str
) -> list[str]:
    """One run of every rank; with ``kill_at``, rank 0 kills itself there and the test kills
    the other rank (the job dies). ``options``: more of the worker's. Returns rank 0's stdout
    lines."""
    port = _free_port()
    command = [sys.executable, "-m", "tests._manager_worker", str(root), str(last_step), *options]
    if kill_at is not None:
        command += ["--kill-at", kill_at]
    procs, logs_of = [], []
    for rank in range(WORLD):
        log = logs / f"{kill_at or 'run'}.{rank}.log".replace(":", "-")
        logs_of.append(log)
        with open(log, "wb") as stderr:
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=_environment(WORLD, rank, port),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                )
            )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        if kill_at is not None:
            procs[0].wait(timeout=RUN_TIMEOUT)
            for proc in procs[1:]:
                proc.kill()
        outputs = [
            proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode()
            for proc in procs
        ]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    logs_text = "\n".join(f"rank {n}: {log.read_text()[-3000:]}" for n, log in enumerate(logs_of))
    expected = [-9] * WORLD if kill_at is not None else [0] * WORLD
    assert codes == expected, f"exit codes {codes}, expected {expected}\n{logs_text}"
    return outputs[0].splitlines()


def _tree(root: Path) -> dict[str, list[str]]:
    return {
        step.name: sorted(
            str(path.relative_to(step)) for path in step.rglob("*") if not path.is_dir()
        )
        for step in sorted(root.iterdir())
    }


def test_killed_in_a_deletion_and_in_a_save_then_resumed(tmp_path: Path) -> None:
    root, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()

    # Killed once step 3 committed, while retention deletes step 1 (its index just removed).
    lines = _run(root, 3, logs, kill_at="delete")
    assert lines == ["restored none", "saved 1", "saved 2"]  # "saved 3" never printed
    tree = _tree(root)
    assert "shardwise.json" not in tree["step-00000001"]
    assert any(name.startswith("data/") for name in tree["step-00000001"])  # half deleted
    assert ckpt.CheckpointManager(root).steps() == [2, 3]

    # Resumed from 3; killed in the save of step 5 after rank 0's data file was in place.
    lines = _run(root, 6, logs, kill_at="save:5")
    assert lines == ["restored 3", "saved 4"]
    tree = _tree(root)
    assert sorted(tree) == ["step-00000003", "step-00000004", "step-00000005"]  # 1, 2 gone
    assert "shardwise.json" not in tree["step-00000005"]
    assert "shardwise.lock" in tree["step-00000005"]  # the killed save's lock
    assert ckpt.CheckpointManager(root).steps() == [3, 4]

    # Resumed from 4 (exactly: the worker checks every value), to the end.
    lines = _run(root, 6, logs)
    assert lines == ["restored 4", "saved 5", "saved 6"]
    tree = _tree(root)
    assert sorted(tree) == ["step-00000005", "step-00000006"]
    for step, files in tree.items():
        data = [name for name in files if name.startswith("data/")]
        assert len(data) == WORLD, (step, files)  # the killed save's file was replaced
        assert sorted(set(files) - set(data)) == ["shardwise-step.json", "shardwise.json"]
    weight = torch.empty(64, 8)
    ckpt.load({"weight": weight}, root / "step-00000006")
    assert torch.equal(weight, full(6))
