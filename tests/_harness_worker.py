"""Worker side of the multi-process test harness; the parent side and the docs are in
``tests/harness.py``.

This module is imported by every spawned worker before anything else, so its top-level imports
stay in the standard library: ``torch`` is imported inside :func:`worker_main`, after the
environment (thread counts, loopback interfaces) has been set up.

Protocol (one duplex pipe per rank, every message a tuple whose first item is its kind)::

    parent -> worker   ("init", port)          rank 0 announced the store port, join the group
                       ("run", spec)           run one body, answer with one message
                       ("health", seq)         check the default group, answer with one message
                       ("stop",)               tear down (rpc.shutdown, destroy group) and exit
    worker -> parent   ("port", port)          rank 0 only, during start-up
                       ("ready", pid)          start-up done
                       ("fatal", text)         start-up failed; the worker exits
                       ("ok", value)           the body returned ``value``
                       ("error", text)         the body raised; ``text`` is the traceback
                       ("skip", reason)        the body called ``pytest.skip``
                       ("healthy",) / ("unhealthy", text)
                       ("stopped", text_or_None)
"""

from __future__ import annotations

import ast
import faulthandler
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["BODY_ATTR", "WORKER_ENV", "find_body", "resolve", "worker_main"]

#: Attribute that ``@distributed`` sets on its wrapper, pointing at the undecorated body.
BODY_ATTR = "__shardwise_body__"
#: Set in the environment of every worker (value: the rank).
WORKER_ENV = "SHARDWISE_HARNESS_WORKER"

#: Timeout of the gloo groups and of the store: a backstop only, the parent's timeouts are
#: far shorter and kill the workers first.
GROUP_TIMEOUT = timedelta(seconds=120)
#: How often the watchdog thread checks that the parent process is still alive.
WATCHDOG_INTERVAL = 0.5


# ---------------------------------------------------------------------------------------------
# Finding the body: a module attribute reached by qualname, unwrapped to the undecorated body.
# Shared with the parent, which checks that the reference resolves before sending it.
# ---------------------------------------------------------------------------------------------


def find_body(obj: Any) -> Any:
    """Return the body under ``@distributed`` (following ``__wrapped__``), or ``obj`` itself."""
    current = obj
    for _ in range(100):
        if current is None:
            break
        body = getattr(current, BODY_ATTR, None)
        if body is not None:
            return body
        current = getattr(current, "__wrapped__", None)
    return obj


def resolve(module: Any, qualname: str) -> tuple[Any, type | None]:
    """Look ``qualname`` up in ``module``: ``(body, cls)``, where ``cls`` is the class whose
    instance the body needs as ``self`` (None for functions, static and class methods)."""
    parts = qualname.split(".")
    container: Any = module
    for part in parts[:-1]:
        container = getattr(container, part)
    obj = getattr(container, parts[-1])
    needs_self: type | None = None
    if inspect.isclass(container) and inspect.isfunction(
        inspect.getattr_static(container, parts[-1])
    ):
        needs_self = container
    return find_body(obj), needs_self


# ---------------------------------------------------------------------------------------------
# Importing test modules with pytest's assertion rewriting, so ``assert a == b`` failing in a
# worker reports the values, as it would in the pytest process.
# ---------------------------------------------------------------------------------------------


class _RewritingLoader(importlib.abc.Loader):
    def __init__(self, path: str) -> None:
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        from _pytest.assertion.rewrite import rewrite_asserts

        with open(self.path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=self.path)
        rewrite_asserts(tree, source, self.path)
        code = compile(tree, self.path, "exec", dont_inherit=True)
        exec(code, module.__dict__)


class _RewritingFinder(importlib.abc.MetaPathFinder):
    """Imports the modules named in ``names`` (test modules the parent imported through
    pytest's rewriting hook) with their asserts rewritten; everything else is left alone."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            return spec
        return importlib.util.spec_from_file_location(
            fullname,
            spec.origin,
            loader=_RewritingLoader(spec.origin),
            submodule_search_locations=spec.submodule_search_locations,
        )


_FINDER = _RewritingFinder()
#: Objects that must live as long as the worker process.
_KEEP_ALIVE: list[Any] = []


def _import_module(name: str, path: str | None, rewrite: bool) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    if rewrite:
        try:
            import _pytest.assertion.rewrite  # noqa: F401
        except ImportError:
            pass
        else:
            _FINDER.names.add(name)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if path is None or exc.name not in (name, name.partition(".")[0]):
            raise
    # Not importable by name here (e.g. a test file outside any package): load it from its file.
    spec = importlib.util.spec_from_file_location(
        name, path, loader=_RewritingLoader(path) if rewrite else None
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---------------------------------------------------------------------------------------------
# The worker process.
# ---------------------------------------------------------------------------------------------


def _redirect_output(log_path: str) -> None:
    """Send fds 1 and 2 (Python and C++ output alike) to this rank's log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def _start_watchdog(parent_pid: int, pool_dir: str) -> None:
    """Exit as soon as the parent (the pytest process) is gone, even if the main thread is
    blocked in a collective: an orphan would otherwise wait for the gloo timeout or forever."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                shutil.rmtree(pool_dir, ignore_errors=True)  # the parent can no longer do it
                os._exit(3)
            time.sleep(WATCHDOG_INTERVAL)

    threading.Thread(target=watch, name="harness-watchdog", daemon=True).start()


def _setup_environment(rank: int, world_size: int) -> None:
    os.environ[WORKER_ENV] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    # Keep gloo and TensorPipe on the loopback interface whatever the host name resolves to.
    interfaces = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    if "lo" in interfaces:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ["TP_SOCKET_IFNAME"] = "lo"
    # For code that reads the usual launcher variables.
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world_size)


def _format_exception(exc: BaseException) -> str:
    # Drop the frame of _run_body itself: the traceback starts in the test body.
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_body.__code__ and tb.tb_next is not None:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_skip(exc: BaseException) -> bool:
    outcomes = sys.modules.get("_pytest.outcomes")
    return outcomes is not None and isinstance(exc, outcomes.Skipped)


def _run_body(spec: dict[str, Any]) -> tuple[Any, ...]:
    module = _import_module(spec["module"], spec["file"], spec["rewrite"])
    body, cls = resolve(module, spec["qualname"])
    args, kwargs = pickle.loads(spec["payload"])
    if cls is not None:
        args = (cls(), *args)
    with warnings.catch_warnings():
        # A warning attributed to shardwise, or to the test module (where a shardwise warning
        # with stacklevel=2 lands), fails the test; torch's own warnings only get printed.
        pattern = rf"(shardwise(\..*)?|{re.escape(spec['module'])})\Z"
        warnings.filterwarnings("error", module=pattern)
        try:
            value = body(*args, **kwargs)
        except BaseException as exc:
            if _is_skip(exc):
                return ("skip", str(exc))
            return ("error", _format_exception(exc))
    return ("ok", value)


def _reset_state(cwd: str) -> None:
    """Undo the cheap-to-undo global state a body may have changed."""
    import torch

    if os.getcwd() != cwd:
        os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _subgroups() -> set[Any]:
    """The process groups other than the default one (empty if torch's private bookkeeping,
    ``_world.pg_map``, is not where it used to be)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if not isinstance(pg_map, dict):
        return set()
    return {pg for pg in pg_map if pg is not dist.group.WORLD}


def _health(seq: int, known_groups: set[Any]) -> tuple[Any, ...]:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        return ("unhealthy", "the default process group was destroyed")
    # Sub-groups created by the test: destroy them (a local operation) so that threads and
    # sockets do not pile up over a long session.
    for pg in _subgroups() - known_groups:
        dist.destroy_process_group(pg)
    group_count = int(getattr(getattr(c10d, "_world", None), "group_count", -1))
    mine = torch.tensor([seq, group_count, dist.get_world_size()], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    for other, theirs in enumerate(gathered):
        if not torch.equal(theirs, mine):
            return (
                "unhealthy",
                f"rank {dist.get_rank()} saw (seq, group_count, world_size)={mine.tolist()}, "
                f"rank {other} {theirs.tolist()}",
            )
    return ("healthy",)


def _send(conn: Any, message: tuple[Any, ...]) -> None:
    try:
        conn.send(message)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
        # The return value of the body could not be pickled.
        kind = type(message[1]).__qualname__
        conn.send(("error", f"the body's return value ({kind}) cannot be pickled: {exc!r}"))


def worker_main(
    rank: int,
    world_size: int,
    conn: Any,
    parent_pid: int,
    log_path: str,
    stack_path: str,
    use_rpc: bool,
) -> None:
    """Entry point of a spawned worker: join the group, then serve the parent's requests."""
    _redirect_output(log_path)
    _start_watchdog(parent_pid, os.path.dirname(log_path))
    # ^C in a terminal reaches the whole process group; the parent decides when workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # On SIGUSR1 (sent by the parent before killing a stuck rank) dump every thread's stack.
    stack_file = open(stack_path, "w")  # noqa: SIM115 - kept open for the process lifetime
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _setup_environment(rank, world_size)
    cwd = os.getcwd()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        if rank == 0:
            # Rank 0 hosts the store on a socket bound here, to loopback only (TCPStore would
            # listen on every interface) and to a port the kernel picks (no race for a "free"
            # port). multi_tenant lets init_rpc's tcp:// rendezvous reuse this very server.
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            _KEEP_ALIVE.append(listener)  # the store uses its fd: never let it be closed
            store = dist.TCPStore(
                "127.0.0.1",
                listener.getsockname()[1],
                world_size,
                is_master=True,
                multi_tenant=True,
                wait_for_workers=False,
                timeout=GROUP_TIMEOUT,
                master_listen_fd=listener.fileno(),
            )
            conn.send(("port", store.port))
        message = conn.recv()
        if message[0] != "init":
            raise RuntimeError(f"unexpected message during start-up: {message!r}")
        port = message[1]
        if rank != 0:
            store = dist.TCPStore(
                "127.0.0.1", port, world_size, is_master=False, timeout=GROUP_TIMEOUT
            )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        if use_rpc:
            from torch.distributed import rpc

            with warnings.catch_warnings():
                # init_rpc's own internals trip this torch deprecation warning (torch 2.x).
                warnings.filterwarnings("ignore", message="You are using a Backend")
                rpc.init_rpc(
                    f"worker{rank}",
                    rank=rank,
                    world_size=world_size,
                    rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                        init_method=f"tcp://127.0.0.1:{port}",
                        rpc_timeout=GROUP_TIMEOUT.total_seconds(),
                    ),
                )
        known_groups = _subgroups()
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        _exit(1)
    conn.send(("ready", os.getpid()))
    _serve(conn, cwd, known_groups, use_rpc)


def _serve(conn: Any, cwd: str, known_groups: set[Any], use_rpc: bool) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _exit(0)  # the parent went away
        kind = message[0]
        if kind == "run":
            try:
                _reset_state(cwd)
                reply = _run_body(message[1])
            except BaseException:
                reply = ("error", "the harness failed to run the body:\n" + traceback.format_exc())
            _send(conn, reply)
        elif kind == "health":
            try:
                reply = _health(message[1], known_groups)
            except BaseException:
                reply = ("unhealthy", traceback.format_exc())
            _send(conn, reply)
        elif kind == "stop":
            problem = _teardown(use_rpc)
            conn.send(("stopped", problem))
            _exit(0)
        else:
            conn.send(("error", f"unknown request {kind!r}"))


def _teardown(use_rpc: bool) -> str | None:
    try:
        import torch.distributed as dist

        if use_rpc:
            from torch.distributed import rpc

            rpc.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        return traceback.format_exc()
    return None


def _exit(code: int) -> None:
    # os._exit: never wait on non-daemon threads (gloo, TensorPipe) or atexit handlers.
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(code)
