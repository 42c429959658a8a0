"""Several machines: ``torchrun`` on two nodes saves, three nodes and one plain process load.

Each "node" is its own ``torchrun`` launcher on this machine, as on a cluster: the launchers of
a job meet through the c10d rendezvous on 127.0.0.1 (a free port, a fresh ``--rdzv-id``; the
first launcher hosts the rendezvous store), and each starts its own workers
(``tests/_multinode_worker.py``), gloo on CPU. A temporary directory stands for the file
system that every node mounts.

1. 2 nodes x 2 processes save a training-like state dict: DTensors sharded by rows over the 4
   ranks and over a 2-D (node, process) mesh, a replicated DTensor, plain replicated tensors,
   an optimizer-like nested dict and a Python int step. Every rank of both nodes writes its own
   data file; one index names them all. They save it again with ``async_save``, whose writer
   processes meet through the store of torchrun's rendezvous.
2. 3 nodes x 1 process load it with another sharding (mostly by columns over 3 ranks) into a
   target holding none of the saved values, and check every value exactly against the values
   each worker recomputes from the seed.
3. This process loads it into plain tensors, with no process group, and checks the same.

The launchers run without the harness's pool (torchrun starts its own processes) and with an
environment cleaned of the variables torchrun sets or reads, each launch within
:data:`LAUNCH_TIMEOUT`; a failure or a hang shows every launcher's output (its workers'
included, with their stacks on a hang).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
import tests
from tests._multinode_worker import blank_state, check_loaded, expected_state, leaves

REPO = Path(tests.__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_multinode_worker.py"
#: One launch, from starting its launchers to all of them having exited.
LAUNCH_TIMEOUT = 120.0
#: Once a launcher has failed, how long the others get to exit on their own.
FAILURE_GRACE = 15.0
#: After SIGTERM, how long a launcher gets to stop its workers before SIGKILL.
STOP_GRACE = 10.0
#: A launch whose rendezvous port was taken meanwhile is retried this often, with another.
PORT_ATTEMPTS = 3
#: Each launcher's output is shown up to this many characters (its end).
LOG_TAIL = 12_000

#: Set by torchrun for its workers; inherited by a launcher (a test run under torchrun), they
#: would confuse it or its workers.
_LAUNCH_VARIABLES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "NODE_RANK",
    }
)
#: torchrun reads ``PET_<OPTION>`` as the default of each of its options, and torchelastic's
#: agent state lives in ``TORCHELASTIC_*``.
_LAUNCH_PREFIXES = ("PET_", "TORCHELASTIC_")


def _environment() -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith(_LAUNCH_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
    )
    env["PYTHONUNBUFFERED"] = "1"  # output in order, and complete when a launch is killed
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    if "lo" in {name for _, name in socket.if_nameindex()}:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class _Launcher:
    """One node's ``torchrun``, its own process group (session)."""

    node: int
    proc: subprocess.Popen[bytes]
    log: Path

    def describe(self) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = "<no output>"
        if len(text) > LOG_TAIL:
            text = f"...\n{text[-LOG_TAIL:]}"
        return f"--- node {self.node} (pid {self.proc.pid}, exit {self.proc.returncode}):\n{text}"


def _describe(launchers: list[_Launcher]) -> str:
    return "\n".join(launcher.describe() for launcher in launchers)


def _start(
    mode: str,
    num_nodes: int,
    per_node: int,
    path: Path,
    reports: Path,
    logs: Path,
    worker: Path = WORKER,
    rdzv_id: str | None = None,
) -> list[_Launcher]:
    endpoint = f"127.0.0.1:{_free_port()}"
    rdzv_id = rdzv_id or f"shardwise-{mode}-{uuid.uuid4().hex}"
    env = _environment()
    launchers: list[_Launcher] = []
    try:
        for node in range(num_nodes):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={num_nodes}",
                f"--nproc-per-node={per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={rdzv_id}",
                # Node 0 hosts the rendezvous store; the others only connect to it (all
                # launchers are on this host, so none may guess from the endpoint's name).
                f"--rdzv-conf=is_host={int(node == 0)},join_timeout={int(LAUNCH_TIMEOUT)}",
                "--local-addr=127.0.0.1",
                "--max-restarts=0",
                f"--log-dir={logs / 'torchelastic'}",  # not a fresh directory in /tmp
                str(worker),
                mode,
                str(path),
                str(reports),
            ]
            log = logs / f"{mode}-node{node}.{time.monotonic_ns()}.log"
            with open(log, "wb") as output:
                proc = subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            launchers.append(_Launcher(node, proc, log))
    except BaseException:
        _stop(launchers, reports)
        raise
    return launchers


def _worker_pids(reports: Path) -> list[int]:
    """The workers that are still running (each wrote its pid at start; a pid that now names
    another program is left alone)."""
    pids = []
    for file in reports.glob("pid-*"):
        pid = int(file.name.removeprefix("pid-"))
        with contextlib.suppress(OSError):
            if b"_worker.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def _signal_all(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _stop(launchers: list[_Launcher], reports: Path) -> None:
    """Stop every launcher still running and its workers: SIGTERM to each launcher's process
    group (torchrun then stops its workers, which run in sessions of their own), SIGKILL to
    whatever is left after :data:`STOP_GRACE`; reap the launchers."""
    running = [launcher for launcher in launchers if launcher.proc.poll() is None]
    for launcher in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for launcher in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for launcher in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.proc.pid, signal.SIGKILL)
        launcher.proc.wait()
    _signal_all(_worker_pids(reports), signal.SIGKILL)


def _wait(launchers: list[_Launcher], reports: Path, killed: bool = False) -> None:
    """Wait for every launcher to exit; stop them all and fail, with their output, if one
    fails or the launch takes longer than :data:`LAUNCH_TIMEOUT` (``killed``: the workers kill
    themselves, and every launcher is to fail)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    failed = False
    while any(launcher.proc.poll() is None for launcher in launchers):
        if (
            not killed
            and not failed
            and any(launcher.proc.returncode not in (None, 0) for launcher in launchers)
        ):
            failed = True
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        if time.monotonic() > deadline:
            # Every worker's stacks into its launcher's output (faulthandler on SIGUSR1).
            _signal_all(_worker_pids(reports), signal.SIGUSR1)
            time.sleep(1.0)
            _stop(launchers, reports)
            what = (
                f"a node failed and the others did not exit within {FAILURE_GRACE:.0f} s"
                if failed
                else f"hang: the launch did not finish within {LAUNCH_TIMEOUT:.0f} s"
            )
            raise AssertionError(
                f"{what}; every node's output follows (stacks of the workers still running "
                "included)\n" + _describe(launchers)
            )
        time.sleep(0.1)
    if killed:
        if any(launcher.proc.returncode == 0 for launcher in launchers):
            raise AssertionError(
                "a node whose workers were killed succeeded\n" + _describe(launchers)
            )
        return
    if any(launcher.proc.returncode != 0 for launcher in launchers):
        raise AssertionError("a node failed; every node's output follows\n" + _describe(launchers))


def _port_taken(launchers: list[_Launcher]) -> bool:
    text = _describe(launchers).lower()
    return "address already in use" in text or "eaddrinuse" in text


def _launch(
    mode: str,
    num_nodes: int,
    per_node: int,
    path: Path,
    workdir: Path,
    worker: Path = WORKER,
    rdzv_id: str | None = None,
    killed: bool = False,
) -> list[dict[str, Any]]:
    """Run the worker in ``mode`` on ``num_nodes`` nodes of ``per_node`` processes; return
    every rank's report, by rank, after checking that the ranks are the nodes' processes."""
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    for attempt in range(PORT_ATTEMPTS):
        reports = workdir / f"reports-{mode}-{attempt}"
        reports.mkdir()
        launchers = _start(mode, num_nodes, per_node, path, reports, logs, worker, rdzv_id)
        try:
            _wait(launchers, reports, killed)
            break
        except AssertionError:
            if attempt + 1 < PORT_ATTEMPTS and _port_taken(launchers):
                continue
            raise
        finally:
            _stop(launchers, reports)
    found = [json.loads(file.read_text()) for file in sorted(reports.glob(f"{mode}-rank*.json"))]
    found.sort(key=lambda report: report["rank"])
    world = num_nodes * per_node
    context = f"{mode} reports {found}\n{_describe(launchers)}"
    assert [report["rank"] for report in found] == list(range(world)), context
    assert all(report["world_size"] == world for report in found), context
    # Each launcher ran per_node ranks of one node; the nodes are numbered 0 .. num_nodes - 1.
    by_launcher: dict[int, list[dict[str, Any]]] = {}
    for report in found:
        by_launcher.setdefault(report["launcher"], []).append(report)
    assert by_launcher.keys() == {launcher.proc.pid for launcher in launchers}, context
    nodes = set()
    for ranks in by_launcher.values():
        assert sorted(report["local_rank"] for report in ranks) == list(range(per_node)), context
        assert len({report["node"] for report in ranks}) == 1, context
        nodes.add(ranks[0]["node"])
    assert nodes == set(range(num_nodes)), context
    return found


def _chunk_offsets(path: Path, key: str) -> list[list[int]]:
    metadata = ckpt.read_metadata(path).state_dict_metadata[key]
    return sorted(list(chunk.offsets) for chunk in metadata.chunks)  # type: ignore[union-attr]


@pytest.mark.distributed
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_two_nodes_save_three_nodes_and_one_process_load(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "step-7"  # the file system every node mounts

    saved = _launch("save", num_nodes=2, per_node=2, path=path, workdir=tmp_path)

    save_id = ckpt.read_metadata(path).storage_meta.save_id  # type: ignore[union-attr]
    assert {report["save_id"] for report in saved} == {save_id}, saved
    # Every rank of both nodes wrote its own data file.
    data = sorted(os.listdir(path / "data"))
    assert data == [f"rank-{rank:05d}.{save_id}.safetensors" for rank in range(4)], data
    # The saved layout: 13 rows over 4 ranks; 12 x 10 over (node, process).
    assert _chunk_offsets(path, "model.embed.weight") == [[0, 0], [4, 0], [8, 0], [12, 0]]
    assert _chunk_offsets(path, "grid") == [[0, 0], [0, 5], [6, 0], [6, 5]]

    loaded = _launch("load", num_nodes=3, per_node=1, path=path, workdir=tmp_path)

    want = dict(leaves(expected_state()))
    elements = sum(value.numel() for value in want.values() if isinstance(value, torch.Tensor))
    for report in loaded:
        assert (report["leaves"], report["elements"]) == (len(want), elements), report

    # One process, no process group: plain tensors, every value checked the same way, of the
    # save and of the async_save the writer processes of both nodes wrote.
    for saved in (path, Path(f"{path}-async")):
        target = blank_state()
        result = ckpt.load(target, saved)
        assert not result.missing_keys and not result.unexpected_keys, result
        assert check_loaded(target, expected_state(), layout={}) == (len(want), elements)


@pytest.mark.distributed
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_local_tier_restores_a_lost_nodes_parts_from_its_peers(tmp_path: Path) -> None:
    # 2 nodes x 2 train to step 6 (durable step 4; local steps 4 and 6, each part on both
    # nodes), then every worker is killed; node 1 is lost with its memory (its tier directory
    # deleted). The restart of the job (same --rdzv-id: the tier's job id) restores step 6
    # from node 0's own copies and its replicas of node 1's parts.
    base = tmp_path / "job"
    worker = REPO / "tests" / "_local_tier_worker.py"
    job = f"shardwise-tier-{uuid.uuid4().hex}"
    trained = _launch("train", 2, 2, base, tmp_path, worker, job, killed=True)
    assert {report["job"] for report in trained} == {job}
    for node in (0, 1):
        held = sorted(p.name for p in (base / f"node{node}" / "step_6").iterdir())
        assert held == [f"rank_{rank}" for rank in range(4)]
    shutil.rmtree(base / "node1")
    restored = _launch("restore", 2, 2, base, tmp_path, worker, job)
    for report in restored:
        assert (report["step"], report["source"], report["equal"]) == (6, "local", True), report
