"""Run test bodies on real gloo process groups (CPU, loopback) in spawned worker processes.

Usage::

    import torch, torch.distributed as dist
    from tests.harness import distributed, run_on_ranks

    @distributed(world_size=4)                 # body runs on every rank of a pooled 4-rank group
    def test_allreduce():
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        assert t.item() == 6

    @distributed(world_size=2, timeout=20)
    @pytest.mark.parametrize("n", [1, 3])      # params and fixtures (tmp_path...) are forwarded
    def test_param(n, tmp_path): ...

    @distributed(world_size=3, fresh=True)     # dedicated processes, torn down after the test
    def test_fresh(): ...

    @distributed(world_size=2, rpc=True)       # dedicated processes, also rpc.init_rpc with
    def test_rpc(): ...                        # names "worker{rank}", rpc.shutdown() after

    def body(x):                               # module level: workers import it by name
        return dist.get_rank() + x

    def test_values():                         # a plain test wanting each rank's return value
        assert run_on_ranks(body, 2, args=(1,)) == [1, 2]

Decorator order: both orders work. ``@distributed`` copies the function's ``__dict__`` (where
``pytest.mark.*`` keeps its marks) onto its wrapper and exposes the original signature through
``__wrapped__``, so marks applied below it are seen by pytest, and marks applied above it land
on the wrapper directly. The convention in this repository is ``@distributed(...)`` on top and
pytest marks below it. Do not stack two ``@distributed``; other call-changing decorators must go
above it (the workers call the undecorated body).

Semantics:

* Pooled groups (the default): one set of ``world_size`` processes per world size, spawned on
  first use and kept for the whole session; ``init_process_group("gloo")`` runs once per pool.
  After a passing test the pool is health-checked (sub-groups the test created are destroyed,
  then an ``all_gather`` checks that every rank is still in step); a test that leaves the group
  unusable fails and the pool is replaced. Tests must therefore not destroy or re-initialise
  the default group: use ``fresh=True`` for that.
* The body is sent by reference (module + qualname; the worker imports the test module, with
  pytest's assertion rewriting) together with its pickled arguments, so bodies must be
  module-level functions or methods of module-level test classes (a fresh instance is created
  in each worker; setup methods do not run there), and arguments and return values must
  pickle.
* Failure: any rank raising fails the test with every failing rank's traceback
  (:class:`DistributedTestError`). The other ranks get a short grace period
  (:data:`GRACE_PERIOD`); ranks still running after it (typically blocked in a collective the
  failing rank never joined) are reported as stuck, with their stacks, and the pool is killed
  and lazily restarted. A body that has not finished within ``timeout`` seconds is handled the
  same way.
* Inside workers: ``torch.set_num_threads(1)``, gloo timeout 120 s, fds 1/2 go to a log that is
  copied to the test's captured stdout, and warnings attributed to ``shardwise`` (or to the
  test module, where a ``stacklevel=2`` warning from shardwise lands) are errors; torch's own
  warnings are only printed. ``pytest.skip()`` in a body skips the test.
* Module-level state of test modules lives on in pooled workers from one test to the next,
  as it does in the pytest process; a few globals are reset before each body (working
  directory, default dtype, grad mode).
* Workers exit on their own when the pytest process disappears (parent-pid watchdog), and the
  pools are shut down at session end (``tests/conftest.py``) and at interpreter exit.
* ``@distributed`` also marks the test ``distributed`` (``pytest -m "not distributed"`` skips
  every multi-process test) and sets a ``pytest.mark.timeout`` larger than the harness's own
  timeouts, so that pytest-timeout (``timeout = 300`` in pyproject.toml) stays a backstop and a
  hang is reported by the harness, with the stuck ranks' stacks.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import pytest

from tests._harness_worker import BODY_ATTR, WORKER_ENV, find_body, resolve, worker_main

__all__ = [
    "DEFAULT_TIMEOUT",
    "GRACE_PERIOD",
    "DistributedTestError",
    "HarnessError",
    "distributed",
    "pool_pids",
    "run_on_ranks",
    "shutdown_pools",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Default per-test timeout, seconds, for the body to finish on every rank.
DEFAULT_TIMEOUT = 60.0
#: After the first rank fails, how long the other ranks get to finish before they are declared
#: stuck and the pool is killed.
GRACE_PERIOD = 2.0
#: Spawning a pool (importing torch in each worker) and joining the group.
STARTUP_TIMEOUT = 120.0
#: The post-test health check of a pooled group.
HEALTH_TIMEOUT = 10.0
#: Graceful shutdown of a pool (rpc.shutdown, destroy_process_group) before it is killed.
STOP_TIMEOUT = 20.0
#: Failure messages keep at most this many characters of each traceback or stack dump.
_MAX_SECTION = 20_000


class HarnessError(RuntimeError):
    """The harness could not run the body at all: bad reference, unpicklable arguments, or a
    pool that failed to start."""


class DistributedTestError(AssertionError):
    """A body failed on some ranks, hung, or left its pooled group unusable.

    Attributes: ``world_size``; ``errors`` maps each failing rank to its formatted traceback
    (or to a description such as "process died"); ``stuck`` lists the ranks that did not finish
    and were killed; ``timed_out`` is True when the failure is the timeout itself (no rank
    failed first).
    """

    def __init__(
        self,
        message: str,
        *,
        world_size: int,
        errors: dict[int, str] | None = None,
        stuck: Sequence[int] = (),
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.errors = dict(errors or {})
        self.stuck = list(stuck)
        self.timed_out = timed_out


# ---------------------------------------------------------------------------------------------
# Pools of worker processes.
# ---------------------------------------------------------------------------------------------

_FAILED = frozenset({"error", "died", "unhealthy", "fatal"})


class _Pool:
    """``world_size`` spawned workers that share one default gloo group (and maybe RPC)."""

    def __init__(self, world_size: int, *, use_rpc: bool, label: str) -> None:
        self.world_size = world_size
        self.use_rpc = use_rpc
        self.label = label
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.pids: list[int] = []
        self.dir = tempfile.mkdtemp(prefix=f"shardwise-harness-ws{world_size}-")
        self._log_offsets = [0] * world_size
        self._health_seq = 0
        self.alive = False

    def _log_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.log")

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.stack")

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(
                        rank,
                        self.world_size,
                        child_end,
                        os.getpid(),
                        self._log_path(rank),
                        self._stack_path(rank),
                        self.use_rpc,
                    ),
                    name=f"shardwise-harness-ws{self.world_size}-rank{rank}",
                    daemon=False,  # workers may start processes of their own
                )
                proc.start()
                child_end.close()  # so that a dead worker shows up as EOF on parent_end
                self.procs.append(proc)
                self.conns.append(parent_end)
            deadline = time.monotonic() + STARTUP_TIMEOUT
            replies, missing = self._collect([0], deadline)
            reply = replies.get(0)
            if reply is None or reply[0] != "port":
                self._startup_failed(replies, missing)
            for rank in range(self.world_size):
                self._send(rank, ("init", reply[1]))
            replies, missing = self._collect(range(self.world_size), deadline, fail_fast=True)
            if missing or any(msg[0] != "ready" for msg in replies.values()):
                self._startup_failed(replies, missing)
            self.pids = [replies[rank][1] for rank in range(self.world_size)]
            self.alive = True
        except BaseException:
            self.kill()
            raise

    def _startup_failed(self, replies: dict[int, tuple[Any, ...]], missing: list[int]) -> None:
        parts = [f"could not start the {self.label} (world_size={self.world_size})"]
        for rank, msg in sorted(replies.items()):
            if msg[0] in _FAILED:
                parts.append(_section(f"rank {rank}: {msg[0]}", msg[1]))
        if missing:
            parts.append(f"ranks {missing} did not answer within {STARTUP_TIMEOUT:g} s")
        for rank, text in self.take_output().items():
            parts.append(_section(f"rank {rank} output", text))
        raise HarnessError("\n".join(parts))

    def is_usable(self) -> bool:
        return self.alive and all(proc.is_alive() for proc in self.procs)

    def stop(self) -> str | None:
        """Ask every worker to tear down and exit; kill whatever is left. Returns a description
        of the problems (None if the shutdown was clean)."""
        problems: list[str] = []
        if self.alive:
            self.alive = False
            for rank in range(self.world_size):
                self._send(rank, ("stop",))
            deadline = time.monotonic() + STOP_TIMEOUT
            replies, missing = self._collect(range(self.world_size), deadline)
            for rank, msg in sorted(replies.items()):
                if msg[0] != "stopped":
                    problems.append(_section(f"rank {rank}: {msg[0]}", str(msg[1])))
                elif msg[1] is not None:
                    problems.append(_section(f"rank {rank}: shutdown raised", msg[1]))
            if missing:
                problems.append(
                    f"ranks {missing} did not shut down within {STOP_TIMEOUT:g} s (killed)"
                )
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        return "\n".join(problems) or None

    def kill(self) -> None:
        """Kill every worker at once (no graceful teardown) and release the pool's files."""
        self.alive = False
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if proc.exitcode is not None:
                proc.close()
        self.procs, self.conns = [], []
        _ALL_POOLS.discard(self)
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- messaging -------------------------------------------------------------------------

    def _send(self, rank: int, message: tuple[Any, ...]) -> bool:
        try:
            self.conns[rank].send(message)
        except OSError:
            return False  # dead; _collect reports it
        return True

    def _exitcode(self, rank: int) -> int | None:
        proc = self.procs[rank]
        proc.join(timeout=1)
        return proc.exitcode

    def _collect(
        self, ranks: Iterable[int], deadline: float, *, fail_fast: bool = False
    ) -> tuple[dict[int, tuple[Any, ...]], list[int]]:
        """One message from each of ``ranks``, until ``deadline``; with ``fail_fast``, only
        until :data:`GRACE_PERIOD` after the first failure. Returns (replies, missing)."""
        pending = {self.conns[rank]: rank for rank in ranks}
        replies: dict[int, tuple[Any, ...]] = {}
        cutoff = deadline
        while pending:
            remaining = cutoff - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), remaining):
                rank = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("died", f"the worker process died (exit code {self._exitcode(rank)})")
                except Exception as exc:
                    msg = ("error", f"its reply could not be unpickled here: {exc!r}")
                replies[rank] = msg
                if fail_fast and msg[0] in _FAILED:
                    cutoff = min(cutoff, time.monotonic() + GRACE_PERIOD)
        return replies, sorted(pending.values())

    # -- running ---------------------------------------------------------------------------

    def run(
        self, spec: dict[str, Any], timeout: float
    ) -> tuple[dict[int, tuple[Any, ...]], list[int]]:
        deadline = time.monotonic() + timeout
        for rank in range(self.world_size):
            self._send(rank, ("run", spec))
        return self._collect(range(self.world_size), deadline, fail_fast=True)

    def health_check(self) -> str | None:
        self._health_seq += 1
        for rank in range(self.world_size):
            self._send(rank, ("health", self._health_seq))
        deadline = time.monotonic() + HEALTH_TIMEOUT
        replies, missing = self._collect(range(self.world_size), deadline, fail_fast=True)
        problems = [
            f"rank {rank}: {msg[1]}" for rank, msg in sorted(replies.items()) if msg[0] != "healthy"
        ]
        if missing:
            problems.append(f"ranks {missing} did not complete the check (a collective hung)")
        return "\n".join(problems) or None

    def dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """The Python stacks of ``ranks`` (faulthandler, on SIGUSR1), before they are killed."""
        for rank in ranks:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        for rank in ranks:
            while time.monotonic() < deadline and not _read_text(self._stack_path(rank)):
                time.sleep(0.02)
        time.sleep(0.1)  # faulthandler writes thread after thread; let it finish
        for rank in ranks:
            text = _read_text(self._stack_path(rank))
            stacks[rank] = _strip_harness_threads(text) or "(no stack dump available)"
        return stacks

    def take_output(self) -> dict[int, str]:
        """What each rank printed since the last call."""
        output: dict[int, str] = {}
        for rank in range(self.world_size):
            try:
                with open(self._log_path(rank), "rb") as f:
                    f.seek(self._log_offsets[rank])
                    data = f.read()
            except OSError:
                continue
            self._log_offsets[rank] += len(data)
            if data.strip():
                output[rank] = data.decode("utf-8", "replace")
        return output


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _strip_harness_threads(dump: str) -> str:
    """Drop the watchdog thread from a faulthandler dump (threads are separated by blank
    lines)."""
    kept = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        if any(_is_harness_frame(line, "watch") for line in lines):
            continue
        # Frames below the body (the worker's loop, multiprocessing's bootstrap) are noise.
        for i, line in enumerate(lines):
            if _is_harness_frame(line, "_run_body"):
                lines = lines[:i]
                break
        if lines:
            kept.append("\n".join(lines))
    return "\n\n".join(kept)


def _is_harness_frame(line: str, function: str) -> bool:
    return "_harness_worker.py" in line and line.rstrip().endswith(f" in {function}")


def _section(title: str, text: str) -> str:
    text = text.rstrip()
    if len(text) > _MAX_SECTION:
        text = "[...]\n" + text[-_MAX_SECTION:]
    return f"----- {title} -----\n{textwrap.indent(text, '  ')}"


_POOLS: dict[int, _Pool] = {}
_ALL_POOLS: set[_Pool] = set()


def _pooled(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None and pool.is_usable():
        return pool
    if pool is not None:
        pool.kill()
    return _new_pool(world_size, use_rpc=False, label="pooled group", register=True)


def _new_pool(world_size: int, *, use_rpc: bool, label: str, register: bool) -> _Pool:
    pool = _Pool(world_size, use_rpc=use_rpc, label=label)
    _ALL_POOLS.add(pool)
    pool.start()
    if register:
        _POOLS[world_size] = pool
    return pool


def shutdown_pools() -> None:
    """Shut every worker pool down (called at session end and at exit; safe to call twice)."""
    for pool in list(_ALL_POOLS):
        pool.stop()


atexit.register(shutdown_pools)


def pool_pids(world_size: int) -> list[int] | None:
    """PIDs of the live pooled group of ``world_size`` ranks, or None if there is none."""
    pool = _POOLS.get(world_size)
    return list(pool.pids) if pool is not None and pool.is_usable() else None


# ---------------------------------------------------------------------------------------------
# Running a body.
# ---------------------------------------------------------------------------------------------


def _make_spec(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    body = find_body(getattr(fn, "__func__", fn))
    module_name = getattr(body, "__module__", None)
    qualname = getattr(body, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname or module_name == "__main__":
        raise HarnessError(
            f"{fn!r} cannot run on ranks: the workers import the body by name, so it must be a "
            f"module-level function (or a method of a module-level class) of an importable "
            f"module; got {module_name}.{qualname}"
        )
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    try:
        resolved, _ = resolve(module, qualname)
    except AttributeError:
        resolved = None
    if resolved is not body:
        raise HarnessError(f"{module_name}.{qualname} does not resolve to {fn!r} in its module")
    try:
        payload = pickle.dumps((tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        bad = [f"argument {i}" for i, a in enumerate(args) if not _picklable(a)]
        bad += [repr(k) for k, v in kwargs.items() if not _picklable(v)]
        raise HarnessError(
            f"the arguments of {module_name}.{qualname} must pickle to reach the workers; "
            f"these do not: {', '.join(bad) or '?'} ({exc!r})"
        ) from exc
    return {
        "module": module_name,
        "qualname": qualname,
        "file": getattr(module, "__file__", None),
        # Rewrite asserts in the worker iff pytest rewrote them here.
        "rewrite": type(getattr(module, "__loader__", None)).__name__ == "AssertionRewritingHook",
        "payload": payload,
    }


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _check_options(world_size: int, timeout: float) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")


def _execute(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    timeout: float,
    fresh: bool,
    rpc: bool,
) -> list[Any]:
    __tracebackhide__ = True
    if WORKER_ENV in os.environ:
        raise HarnessError("the harness cannot be used from inside a worker")
    _check_options(world_size, timeout)
    spec = _make_spec(fn, args, kwargs)
    dedicated = fresh or rpc
    if dedicated:
        label = "fresh group with RPC" if rpc else "fresh group"
        pool = _new_pool(world_size, use_rpc=rpc, label=label, register=False)
    else:
        pool = _pooled(world_size)
    try:
        replies, stuck = pool.run(spec, timeout)
        stacks = pool.dump_stacks(stuck) if stuck else {}
        _forward_output(pool)
        problem = None
        died = any(msg[0] == "died" for msg in replies.values())
        if stuck or died:
            pool.kill()
        elif dedicated:
            problem = pool.stop()
        else:
            problem = pool.health_check()
            if problem is not None:
                _forward_output(pool)
                pool.kill()
    except BaseException:
        pool.kill()  # interrupted (pytest-timeout, ^C) or harness bug: state unknown
        raise
    errors = {rank: msg[1] for rank, msg in sorted(replies.items()) if msg[0] in _FAILED}
    if errors or stuck:
        raise _failure(pool, errors, stuck, stacks, replies, timeout, problem)
    if problem is not None:
        what = "shut down cleanly" if dedicated else "pass the post-test health check"
        hint = "" if dedicated else " (tests that destroy or re-create groups need fresh=True)"
        raise DistributedTestError(
            f"the body passed on all {world_size} ranks, but the {pool.label} did not {what}"
            f"{hint}; its processes were killed:\n{textwrap.indent(problem, '  ')}",
            world_size=world_size,
        )
    skips = [msg[1] for _, msg in sorted(replies.items()) if msg[0] == "skip"]
    if skips:
        pytest.skip(skips[0])
    return [replies[rank][1] for rank in range(world_size)]


def _forward_output(pool: _Pool) -> None:
    for rank, text in pool.take_output().items():
        sys.stdout.write(f"----- {pool.label} (world_size={pool.world_size}) rank {rank} -----\n")
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _failure(
    pool: _Pool,
    errors: dict[int, str],
    stuck: list[int],
    stacks: dict[int, str],
    replies: dict[int, tuple[Any, ...]],
    timeout: float,
    problem: str | None,
) -> DistributedTestError:
    world_size = pool.world_size
    timed_out = bool(stuck) and not errors
    passed = [rank for rank, msg in sorted(replies.items()) if msg[0] in ("ok", "skip")]
    if timed_out:
        head = f"distributed test timed out after {timeout:g} s"
    else:
        head = "distributed test failed"
    lines = [f"{head} ({pool.label}, world_size={world_size})"]
    if errors:
        lines.append(f"failed ranks: {sorted(errors)}")
    if stuck:
        why = (
            f"still running after the {timeout:g} s timeout"
            if timed_out
            else f"still running {GRACE_PERIOD:g} s after the first failure"
        )
        then = "killed" if pool.label != "pooled group" else "killed, the pool restarts on next use"
        lines.append(f"stuck ranks: {stuck} ({why}; {then})")
    if passed:
        lines.append(f"passed ranks: {passed}")
    for rank, text in sorted(errors.items()):
        lines.append(_section(f"rank {rank} raised", text))
    for rank in stuck:
        lines.append(_section(f"rank {rank} stuck, stack when killed", stacks.get(rank, "")))
    if problem is not None:
        lines.append(_section("afterwards", problem))
    return DistributedTestError(
        "\n".join(lines), world_size=world_size, errors=errors, stuck=stuck, timed_out=timed_out
    )


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    fresh: bool = False,
    rpc: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group; return the
    per-rank return values (index = rank). Raises :class:`DistributedTestError` if a rank
    raises or the run exceeds ``timeout`` seconds, :class:`HarnessError` if ``fn`` cannot be sent.
    ``fresh``/``rpc`` as for :func:`distributed`."""
    __tracebackhide__ = True
    return _execute(fn, world_size, args, kwargs or {}, timeout=timeout, fresh=fresh, rpc=rpc)


def distributed(
    world_size: int, *, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False, rpc: bool = False
) -> Callable[[F], F]:
    """Decorate a test so that its body runs on every rank of a gloo group of ``world_size``.

    ``timeout`` (seconds) bounds the body; ``fresh=True`` uses dedicated processes (a default
    group of its own) torn down after the test; ``rpc=True`` also runs ``rpc.init_rpc`` (names
    ``worker{rank}``) in those dedicated processes and ``rpc.shutdown()`` after the body. The
    test's arguments (parameters, fixtures) are pickled and passed to the body on every rank.
    """
    _check_options(world_size, timeout)

    def decorate(fn: F) -> F:
        if not inspect.isfunction(fn):
            raise TypeError(f"@distributed decorates functions, got {fn!r}")
        if getattr(fn, BODY_ATTR, None) is not None:
            raise TypeError(f"{fn.__qualname__}: @distributed is applied twice")
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
            raise TypeError(f"{fn.__qualname__}: the body must be a plain function")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            if len(args) > 1:  # pytest passes everything by keyword (bar a method's self)
                raise TypeError(f"{fn.__qualname__}: pass the test's arguments by keyword")
            _execute(fn, world_size, (), kwargs, timeout=timeout, fresh=fresh, rpc=rpc)

        setattr(wrapper, BODY_ATTR, fn)
        wrapper = pytest.mark.distributed(world_size=world_size, fresh=fresh, rpc=rpc)(wrapper)
        # pytest-timeout stays a backstop: give it room for the harness's own timeouts (pool
        # start-up, body, teardown) so that a hang is reported by the harness, with stacks.
        budget = STARTUP_TIMEOUT + timeout + max(HEALTH_TIMEOUT, STOP_TIMEOUT) + 60
        return pytest.mark.timeout(budget)(wrapper)  # type: ignore[no-any-return]

    return decorate
