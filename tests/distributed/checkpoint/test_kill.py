"""``kill -9`` at random points of a save over an existing checkpoint: no hangs, no lost
checkpoints (docs/checkpoints.md, *What a crash or a race can and cannot do*; ``docs/format.md``).

Each trial: the path holds checkpoint A; real processes (``tests/_kill_worker.py``: one
process with no group, or two gloo ranks joined through ``env://``) save checkpoint B over it
and are SIGKILLed (one random rank or both) after a delay drawn from a seeded RNG over the
whole duration of a save, measured first by an uninterrupted one. Then, in this process:

* loading gives exactly A or exactly B, or raises a ``CheckpointError``: never a mix, never
  another exception; a rank that returned from ``save`` means B was committed;
* a rank whose peer was killed exits on its own (no hang);
* the next save (C) takes over the killed save's lock (its process is gone), loads back exactly
  C, and leaves only C's data files: no temporary file, no lock.

Three trials per mode run by default; ``SHARDWISE_SLOW_TESTS=1`` adds twenty more per mode.
``SHARDWISE_KILL_SEED`` changes the seed (it is printed with every trial).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
import shardwise.errors
import tests
from tests._kill_worker import expected_state

SLOW = os.environ.get("SHARDWISE_SLOW_TESTS") == "1"
SEED = int(os.environ.get("SHARDWISE_KILL_SEED", "20261123"))
CI_TRIALS = 3
SLOW_TRIALS = 20
#: Kill delays are drawn from [0, KILL_SPAN times the measured save time): past the end too, so
#: some kills land after the commit (during the cleanup, or once the process is exiting).
KILL_SPAN = 1.15
#: From launch to every rank's "saving" (importing torch on a busy 2-core machine).
STARTUP_TIMEOUT = 90.0
#: An uninterrupted save, from "saving" to exit.
SAVE_TIMEOUT = 60.0
#: A rank whose peer was killed must have exited on its own within this.
SURVIVOR_TIMEOUT = 30.0
#: Waiting for a process that was sent SIGKILL to be reaped.
REAP_TIMEOUT = 10.0

REPO = Path(tests.__file__).resolve().parent.parent
TAG_A, TAG_B, TAG_C = 1, 2, 3
LOCK_NAME = "shardwise.lock"


@functools.cache
def _expected(tag: int) -> dict[str, Any]:
    return expected_state(tag)


def _leaves(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in state.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _blank(state: Mapping[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``state`` holding none of any checkpoint's values."""
    blank: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            blank[key] = _blank(value)
        elif isinstance(value, torch.Tensor):
            blank[key] = torch.full_like(value, -1)
        elif isinstance(value, bytes):
            blank[key] = b""
        else:
            blank[key] = -1
    return blank


def _same(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return (
            isinstance(left, torch.Tensor)
            and isinstance(right, torch.Tensor)
            and left.dtype == right.dtype
            and torch.equal(left, right)
        )
    return type(left) is type(right) and left == right


def _which(loaded: Mapping[str, Any], candidates: Mapping[str, int]) -> str:
    """The name of the candidate checkpoint ``loaded`` equals exactly; fails on a mix."""
    values = dict(_leaves(loaded))
    matches: dict[str, list[str]] = {}
    for name, tag in candidates.items():
        expected = dict(_leaves(_expected(tag)))
        assert values.keys() == expected.keys()
        matches[name] = [key for key, value in expected.items() if _same(values[key], value)]
        if len(matches[name]) == len(values):
            return name
    summary = {name: len(keys) for name, keys in matches.items()}
    unmatched = [key for key in values if not any(key in keys for keys in matches.values())]
    raise AssertionError(
        f"the load gave a mix: keys equal to each candidate {summary} of {len(values)}; "
        f"equal to none: {unmatched[:10]}"
    )


# -- worker processes --------------------------------------------------------------------------


@dataclass(slots=True)
class _Worker:
    """One rank of a save, with what it has printed so far."""

    rank: int
    proc: subprocess.Popen[bytes]
    log: Path
    lines: list[str] = field(default_factory=list)
    eof: bool = False
    _partial: bytes = b""

    def pump(self) -> None:
        assert self.proc.stdout is not None
        data = os.read(self.proc.stdout.fileno(), 65536)
        if not data:
            self.eof = True
            return
        *complete, self._partial = (self._partial + data).split(b"\n")
        self.lines += [line.decode() for line in complete]

    def said(self, word: str) -> str | None:
        return next((line for line in self.lines if line.split()[:1] == [word]), None)

    def stderr_tail(self, limit: int = 4000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-limit:]

    def describe(self) -> str:
        return (
            f"--- rank {self.rank} (pid {self.proc.pid}, exit {self.proc.returncode}), "
            f"stdout {self.lines}, stderr:\n{self.stderr_tail()}"
        )


class _WorkerExitedError(Exception):
    def __init__(self, worker: _Worker) -> None:
        super().__init__(f"rank {worker.rank} exited early")
        self.worker = worker


def _wait_for(workers: list[_Worker], word: str, timeout: float) -> list[str]:
    """Each worker's line starting with ``word``, once every worker has printed one."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for worker in workers:
            if not worker.eof:
                assert worker.proc.stdout is not None
                selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        while True:
            waiting = [worker for worker in workers if worker.said(word) is None]
            if not waiting:
                return [line for worker in workers if (line := worker.said(word)) is not None]
            for worker in waiting:
                if worker.eof:
                    worker.proc.wait(timeout=REAP_TIMEOUT)
                    raise _WorkerExitedError(worker)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"hang: ranks {[worker.rank for worker in waiting]} did not print "
                    f"{word!r} within {timeout:.0f} s\n" + _dump_stacks(workers)
                )
            for key, _ in selector.select(remaining):
                worker = key.data
                worker.pump()
                if worker.eof:
                    selector.unregister(key.fileobj)


def _dump_stacks(workers: list[_Worker]) -> str:
    """Every still-running worker's stacks (faulthandler on SIGUSR1), then every log."""
    for worker in workers:
        if worker.proc.poll() is None:
            os.kill(worker.proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    return "\n".join(worker.describe() for worker in workers)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment(world_size: int, rank: int, port: int) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    }
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
    )
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    if world_size > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if "lo" in {name for _, name in socket.if_nameindex()}:
            env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _launch(path: Path, tag: int, world_size: int, logs: Path) -> list[_Worker]:
    port = _free_port()
    workers = []
    try:
        for rank in range(world_size):
            log = logs / f"rank{rank}.{time.monotonic_ns()}.log"
            with open(log, "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests._kill_worker", str(path), str(tag)],
                    cwd=REPO,
                    env=_environment(world_size, rank, port),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                )
            workers.append(_Worker(rank, proc, log))
    except BaseException:
        _stop(workers)
        raise
    return workers


def _start_save(path: Path, tag: int, world_size: int, logs: Path) -> list[_Worker]:
    """Workers that have all printed "saving" (a taken port is retried with another)."""
    for attempt in range(3):
        workers = _launch(path, tag, world_size, logs)
        try:
            _wait_for(workers, "saving", STARTUP_TIMEOUT)
            return workers
        except _WorkerExitedError as exited:
            _stop(workers)
            text = exited.worker.stderr_tail().lower()
            if attempt < 2 and ("eaddrinuse" in text or "address already in use" in text):
                continue
            raise AssertionError(
                "a worker failed before its save started\n"
                + "\n".join(worker.describe() for worker in workers)
            ) from None
        except BaseException:
            _stop(workers)
            raise
    raise AssertionError("unreachable")


def _stop(workers: list[_Worker]) -> None:
    """SIGKILL every worker still running, reap all of them and close their pipes."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
            worker.proc.wait(timeout=REAP_TIMEOUT)
        if worker.proc.stdout is not None:
            worker.proc.stdout.close()


# -- one trial ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Kill:
    delay: float
    victims: tuple[int, ...]


@dataclass(slots=True)
class _Result:
    """What a trial saw, for the summary."""

    outcome: str = ""  # "A", "B" or "refused"
    refusal: str = ""  # the refusal's error
    # rank -> "killed", "saved" (returned from save; then maybe killed while exiting) or the
    # last line of the error it exited with
    ranks: dict[int, str] = field(default_factory=dict)
    save_seconds: float | None = None  # the uninterrupted save's time (calibration only)
    left: list[str] = field(default_factory=list)  # see _left_behind


def _survivor_error(worker: _Worker) -> str:
    """The exception a rank whose peer was killed exited with: it must be a CheckpointError
    (a failure on any rank raises one on every rank)."""
    lines = [line for line in worker.stderr_tail().splitlines() if line.strip()]
    # The last line of the traceback, "[rank0]: shardwise.errors.SomeError: message".
    match = re.fullmatch(
        r"(?:\[rank\d+\]: )?shardwise\.errors\.(\w+): (.*)", lines[-1] if lines else ""
    )
    error = getattr(shardwise.errors, match.group(1), None) if match else None
    assert isinstance(error, type) and issubclass(error, ckpt.CheckpointError), (
        "a rank whose peer was killed did not raise a CheckpointError\n" + worker.describe()
    )
    return f"{match.group(1)}: {match.group(2)[:120]}..."


def _run_save(path: Path, world_size: int, kill: _Kill | None, logs: Path) -> _Result:
    """Save B with real processes, killing ``kill.victims`` after ``kill.delay`` seconds; every
    process has exited and been reaped when this returns (a dead holder's pid is then gone,
    which is what lets the next save take its lock over)."""
    workers = _start_save(path, TAG_B, world_size, logs)
    try:
        if kill is None:
            lines = _wait_for(workers, "saved", SAVE_TIMEOUT)
            for worker in workers:
                worker.proc.wait(timeout=SAVE_TIMEOUT)
                assert worker.proc.returncode == 0, worker.describe()
            seconds = max(float(line.split()[1]) for line in lines)
            return _Result(ranks=dict.fromkeys(range(world_size), "saved"), save_seconds=seconds)
        time.sleep(kill.delay)
        for rank in kill.victims:
            workers[rank].proc.kill()  # nothing happens if it has exited already
        for worker in workers:
            if worker.rank in kill.victims:
                worker.proc.wait(timeout=REAP_TIMEOUT)
                continue
            try:
                worker.proc.wait(timeout=SURVIVOR_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"hang: rank {worker.rank} was still running {SURVIVOR_TIMEOUT:.0f} s after "
                    f"ranks {kill.victims} were killed\n" + _dump_stacks(workers)
                ) from None
        result = _Result()
        for worker in workers:
            while not worker.eof:  # the rest of its stdout: it has exited
                worker.pump()
            code = worker.proc.returncode
            if worker.said("saved") is not None:
                assert code in (0, -signal.SIGKILL), worker.describe()
                result.ranks[worker.rank] = "saved"
            elif code == -signal.SIGKILL:
                result.ranks[worker.rank] = "killed"
            else:
                assert code == 1, worker.describe()
                result.ranks[worker.rank] = _survivor_error(worker)
        return result
    finally:
        _stop(workers)


def _load_outcome(path: Path) -> tuple[str, str]:
    """("A" or "B", "") or ("refused", the error)."""
    target = _blank(_expected(TAG_A))
    try:
        ckpt.load(target, path)
    except ckpt.CheckpointError as err:
        return "refused", f"{type(err).__name__}: {err}"
    return _which(target, {"A": TAG_A, "B": TAG_B}), ""


def _check_next_save(path: Path) -> None:
    """Save C over whatever the killed save left; it must load back exactly and leave only its
    own files."""
    saved = ckpt.save(_expected(TAG_C), path, sync_files=False)
    target = _blank(_expected(TAG_C))
    ckpt.load(target, path)
    assert _which(target, {"C": TAG_C}) == "C"
    save_id = ckpt.read_metadata(path).storage_meta.save_id
    assert save_id == saved.storage_meta.save_id
    data = sorted(os.listdir(path / "data"))
    assert data, "C's data files are missing"
    assert all(save_id in name for name in data), f"not only C's ({save_id}) files: {data}"
    files = [Path(root, name) for root, _, names in os.walk(path) for name in names]
    assert not [file for file in files if file.name.endswith(".tmp")], files
    assert not (path / LOCK_NAME).exists(), files


def _left_behind(path: Path, outcome: str) -> list[str]:
    """What the next save must remove: the lock, temporary files, and data files of saves
    other than the committed one."""
    committed = "" if outcome == "refused" else ckpt.read_metadata(path).storage_meta.save_id
    left = []
    for _, _, names in os.walk(path):
        for name in names:
            stale_data = name.endswith(".safetensors") and committed not in name
            if name == LOCK_NAME or name.endswith(".tmp") or stale_data:
                left.append(name)
    return sorted(left)


def _trial(path: Path, world_size: int, kill: _Kill | None, template: Path, logs: Path) -> _Result:
    shutil.copytree(template, path)  # checkpoint A, saved once
    result = _run_save(path, world_size, kill, logs)
    result.outcome, result.refusal = _load_outcome(path)
    result.left = _left_behind(path, result.outcome)
    if "saved" in result.ranks.values():
        # A rank returned from save, and nobody returns before the commit.
        assert result.outcome == "B", f"a rank returned from save, yet B is not loaded: {result}"
    _check_next_save(path)
    return result


# -- the tests ---------------------------------------------------------------------------------


def _strata(rng: random.Random, count: int, span: float) -> list[float]:
    """``count`` delays over ``[0, span)``: one uniform draw in each of ``count`` equal slices,
    shuffled, so that even a few trials cover the beginning, the middle and the end."""
    delays = [(index + rng.random()) * span / count for index in range(count)]
    rng.shuffle(delays)
    return delays


def _run_trials(tmp_path: Path, world_size: int, num_trials: int) -> None:
    rng = random.Random(f"{SEED}-{world_size}-{num_trials}")
    logs = tmp_path / "logs"
    logs.mkdir()
    started = time.monotonic()
    template = tmp_path / "A"
    ckpt.save(_expected(TAG_A), template, sync_files=False)
    calibration = _trial(tmp_path / "calibration", world_size, None, template, logs)
    assert calibration.save_seconds is not None
    shutil.rmtree(tmp_path / "calibration")
    span = KILL_SPAN * calibration.save_seconds
    # One random rank or both, each about as often.
    choices = [(0,)] if world_size == 1 else [(0,), (1,), (0, 1)]
    victims = [choices[number % len(choices)] for number in range(num_trials)]
    rng.shuffle(victims)
    outcomes: Counter[str] = Counter()
    report = [
        f"world_size={world_size} seed={SEED} save={calibration.save_seconds * 1000:.0f} ms "
        f"kill delays over [0, {span * 1000:.0f} ms)"
    ]
    for number, delay in enumerate(_strata(rng, num_trials, span)):
        kill = _Kill(delay, victims[number])
        context = f"trial {number}: kill ranks {kill.victims} after {delay * 1000:.0f} ms"
        path = tmp_path / f"trial-{number}"
        print(f"{context} ...", flush=True)  # shown if the trial fails
        try:
            result = _trial(path, world_size, kill, template, logs)
        except AssertionError as err:
            raise AssertionError(f"{context} (seed {SEED}): {err}") from err
        outcomes[result.outcome] += 1
        report.append(
            f"{context}: loaded {result.outcome} {result.refusal}; ranks {result.ranks}; "
            f"left behind {result.left}"
        )
        shutil.rmtree(path)
    report.append(f"outcomes {dict(outcomes)} in {time.monotonic() - started:.1f} s")
    print("\n".join(report))


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "two-ranks"])
def test_a_killed_save_leaves_a_loadable_checkpoint(tmp_path: Path, world_size: int) -> None:
    _run_trials(tmp_path, world_size, CI_TRIALS)


@pytest.mark.skipif(not SLOW, reason="slow (about 3 minutes): set SHARDWISE_SLOW_TESTS=1")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "two-ranks"])
def test_many_killed_saves_leave_loadable_checkpoints(tmp_path: Path, world_size: int) -> None:
    _run_trials(tmp_path, world_size, SLOW_TRIALS)
