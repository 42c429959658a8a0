"""``async_save`` in one process: the write runs in a writer process fed from a shared staging
buffer that is reused across saves; a writer that dies fails the save in flight (or the next
call) naming the rank; the training process never leaves a writer behind when it exits."""

from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving import background
from shardwise.checkpoint.saving.snapshot import describe_or_error
from shardwise.checkpoint.saving.staging import StagingArea, open_views
from shardwise.errors import CheckpointError


@pytest.fixture(autouse=True)
def _fresh_writers():
    background.shutdown_writers()
    yield
    background.shutdown_writers()


def _writer() -> background.WriterProcess:
    (writer,) = background._writers.values()
    return writer


def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_the_write_runs_in_a_writer_process_that_maps_the_staged_bytes(tmp_path: Path) -> None:
    state = {"w": torch.arange(12.0).reshape(3, 4), "t": torch.arange(5), "step": 7, "b": b"x"}
    metadata = ckpt.async_save(state, tmp_path / "a").result(timeout=60)
    writer = _writer()
    assert writer.process.pid != os.getpid() and writer.process.poll() is None
    assert metadata.planner_data["world_size"] == 1
    assert metadata == ckpt.read_metadata(tmp_path / "a")
    target = {"w": torch.zeros(3, 4), "t": torch.zeros(5, dtype=torch.int64), "step": 0, "b": b""}
    ckpt.load(target, tmp_path / "a")
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["t"], state["t"])
    assert target["step"] == 7 and target["b"] == b"x"


def test_staging_packs_every_box_at_a_slot_its_dtype_can_view_and_stages_tied_data_once() -> None:
    shared = torch.arange(6.0)
    state = {
        "a": shared,
        "tied": shared,
        "half": torch.ones(3, dtype=torch.float16),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(3, dtype=torch.int8),
    }
    snapshot, error = describe_or_error(state, allow_pickle=False)
    assert error is None and snapshot.aliases == {"tied": "a"}
    area = StagingArea()
    staged, grown, events = area.stage(snapshot)
    assert grown is area.buffer and not events
    rows = {row[0]: row for row in staged.tensors}
    assert rows["tied"][5] == ()  # staged once: its target's box is its box
    slots = [(row[2], row[5][0][2], row[5][0][3]) for key, row in rows.items() if key != "tied"]
    assert all(offset % dtype.itemsize == 0 for dtype, offset, _ in slots)  # any dtype views it
    spans = sorted(
        (offset, offset + dtype.itemsize * math.prod(shape)) for dtype, offset, shape in slots
    )
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert spans[-1][1] == 6 * 4 + 3 * 2 + 12 * 4 + 1  # packed tight: no byte between them
    viewed = open_views(staged, area.buffer.bytes)
    assert viewed["tied"].boxes is viewed["a"].boxes
    for key, value in state.items():
        assert torch.equal(viewed[key].boxes[0].tensor, value), key
    state["a"].add_(100)  # the staged bytes are a copy
    assert torch.equal(viewed["a"].boxes[0].tensor, torch.arange(6.0))
    area.close()


def test_the_staging_buffer_is_reused_and_grows_only_when_the_state_grows(tmp_path: Path) -> None:
    ckpt.async_save({"w": torch.ones(1 << 20)}, tmp_path / "a").result(timeout=60)
    first = _writer().staging.buffer
    assert first is not None and first.size >= 4 << 20
    ckpt.async_save({"w": torch.full((1 << 19,), 2.0)}, tmp_path / "b").result(timeout=60)
    assert _writer().staging.buffer is first, "a smaller state reuses the buffer"
    ckpt.async_save({"w": torch.full((3 << 20,), 3.0)}, tmp_path / "c").result(timeout=60)
    grown = _writer().staging.buffer
    assert grown is not first and grown is not None and grown.size >= 12 << 20
    for name, value, numel in (("b", 2.0, 1 << 19), ("c", 3.0, 3 << 20)):
        target = {"w": torch.zeros(numel)}
        ckpt.load(target, tmp_path / name)
        assert torch.equal(target["w"], torch.full((numel,), value)), name


def test_resident_memory_does_not_grow_over_a_hundred_saves(tmp_path: Path) -> None:
    state = {f"layer{i}.weight": torch.randn(16, 1024) for i in range(16)}  # 1 MiB
    state["step"] = 0
    for step in range(10):  # warm up: the writer, the buffer, the allocator's pools
        state["step"] = step
        ckpt.async_save(state, tmp_path / f"w{step % 2}", sync_files=False).result(timeout=60)
    before = _rss_bytes()
    for step in range(100):
        state["step"] = step
        for tensor in list(state.values())[:-1]:
            tensor.add_(1.0)
        ckpt.async_save(state, tmp_path / f"s{step % 2}", sync_files=False).result(timeout=60)
    grown = _rss_bytes() - before
    assert grown < 8 << 20, f"resident memory grew by {grown >> 20} MiB over 100 saves"
    target = {key: torch.zeros_like(value) for key, value in state.items() if key != "step"}
    target["step"] = -1
    ckpt.load(target, tmp_path / "s1")
    assert target["step"] == 99 and torch.equal(target["layer3.weight"], state["layer3.weight"])


def test_a_writer_killed_while_idle_fails_the_next_call_then_a_new_one_starts(
    tmp_path: Path,
) -> None:
    ckpt.async_save({"w": torch.ones(4)}, tmp_path / "a").result(timeout=60)
    pid = _writer().process.pid
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    deadline = time.monotonic() + 10
    while not _writer().dead and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match=r"writer process of rank 0 was killed by SIGKILL"):
        ckpt.async_save({"w": torch.ones(4)}, tmp_path / "b")
    assert not (tmp_path / "b" / "shardwise.json").exists()
    ckpt.async_save({"w": torch.full((4,), 2.0)}, tmp_path / "b").result(timeout=60)
    assert _writer().process.pid != pid
    target = {"w": torch.zeros(4)}
    ckpt.load(target, tmp_path / "b")
    assert torch.equal(target["w"], torch.full((4,), 2.0))


def test_a_writer_killed_mid_save_fails_the_future_and_commits_nothing(tmp_path: Path) -> None:
    ckpt.async_save({"w": torch.ones(4)}, tmp_path / "a").result(timeout=60)
    pid = _writer().process.pid
    os.kill(pid, signal.SIGSTOP)  # the save handed over below cannot progress
    try:
        future = ckpt.async_save({"w": torch.full((4,), 5.0)}, tmp_path / "a")
        time.sleep(0.2)
        assert not future.done()
    finally:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"rank 0 was killed by SIGKILL.*was not commit"):
        future.result(timeout=30)
    target = {"w": torch.zeros(4)}
    ckpt.load(target, tmp_path / "a")  # the previous save to the same path still loads
    assert torch.equal(target["w"], torch.ones(4))
    ckpt.async_save({"w": torch.full((4,), 6.0)}, tmp_path / "a").result(timeout=60)
    ckpt.load(target, tmp_path / "a")
    assert torch.equal(target["w"], torch.full((4,), 6.0))


_SCRIPT = """
import os, sys, torch
import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving import background
state = {{"w": torch.arange(1 << 20, dtype=torch.float32)}}
ckpt.async_save({{"w": torch.ones(1)}}, {path!r} + "-first").result()
print(next(iter(background._writers.values())).process.pid, flush=True)
future = ckpt.async_save(state, {path!r})  # never waited for by the script itself
how = sys.argv[1]
if how == "exception":
    raise RuntimeError("the training loop failed")
if how == "kill":
    sys.stdin.read()  # wait to be killed
"""


@pytest.mark.parametrize("how", ["normal", "exception", "kill"])
def test_no_writer_outlives_its_training_process(tmp_path: Path, how: str) -> None:
    path = str(tmp_path / "c")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(path=path)))
    process = subprocess.Popen(
        [sys.executable, str(script), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    if how == "kill":
        process.kill()
    _, stderr = process.communicate(timeout=60)
    assert _wait_gone(pid), f"the writer process {pid} outlived its training process"
    if how == "kill":
        assert process.returncode == -signal.SIGKILL
        return
    # Exiting, normally or by an exception, first finishes the save in flight.
    assert process.returncode == (0 if how == "normal" else 1), stderr
    target = {"w": torch.zeros(1 << 20)}
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_staged_on_a_side_stream_before_a_later_update(tmp_path: Path) -> None:
    n = 1 << 22
    state = {"w": torch.arange(n, device="cuda", dtype=torch.float32), "b": torch.ones(3).cuda()}
    future = ckpt.async_save(state, tmp_path / "a")
    state["w"].add_(1)  # queued on the training stream: it must not overtake the copy
    state["b"].zero_()
    future.result(timeout=60)
    buffer = _writer().staging.buffer
    assert buffer is not None and buffer.pinned
    target = {"w": torch.zeros(n), "b": torch.zeros(3)}
    ckpt.load(target, tmp_path / "a")
    assert torch.equal(target["w"], torch.arange(n, dtype=torch.float32))
    assert torch.equal(target["b"], torch.ones(3))


def test_a_relative_path_is_where_the_caller_is_when_it_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt.async_save({"w": torch.ones(2)}, "first").result(timeout=60)  # the writer starts here
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    metadata = ckpt.async_save({"w": torch.full((2,), 2.0)}, "second").result(timeout=60)
    assert (tmp_path / "elsewhere" / "second" / "shardwise.json").is_file()
    assert not (tmp_path / "second").exists()
    assert metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id == "second"


def test_a_store_private_to_this_process_is_refused_before_anything_is_staged() -> None:
    with pytest.raises(CheckpointError, match=r"only this process sees \(memory://\).*use save"):
        ckpt.async_save({"w": torch.ones(2)}, "memory://async/c")
    assert not background._writers


def test_a_save_of_the_same_layout_sends_no_tensor_description_and_writes_the_new_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []
    real_dumps = background.pickle.dumps

    def spy(message: Any, *args: Any, **kwargs: Any) -> bytes:
        sent.append(message[1].tensors)
        return real_dumps(message, *args, **kwargs)

    monkeypatch.setattr(background.pickle, "dumps", spy)
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(50)}
    state["step"] = 1
    ckpt.async_save(state, tmp_path / "a").result(timeout=60)
    for value in list(state.values())[:-1]:
        value.add_(100)  # same layout, new bytes
    state["step"] = 2
    ckpt.async_save(state, tmp_path / "b").result(timeout=60)
    state["new"] = torch.ones(3)  # a new key: the description is sent again
    ckpt.async_save(state, tmp_path / "c").result(timeout=60)
    assert sent[0] is not None and sent[1] is None and sent[2] is not None
    for name, shift, step in (("a", 0.0, 1), ("b", 100.0, 2), ("c", 100.0, 2)):
        target: dict[str, Any] = {f"t{i}": torch.zeros(i + 1) for i in range(50)}
        target["step"] = 0
        ckpt.load(target, tmp_path / name)
        assert target["step"] == step, name
        for i in range(50):
            assert torch.equal(target[f"t{i}"], torch.full((i + 1,), i + shift)), (name, i)


def test_parameters_lazy_conjugates_and_mixed_element_sizes_stage_exactly(tmp_path: Path) -> None:
    parameter = torch.nn.Parameter(torch.arange(6.0))
    conjugate = torch.complex(torch.arange(4.0), torch.ones(4)).conj()  # a lazy view
    state = {
        "flags": torch.tensor([True, False, True]),
        "p": parameter,
        "c": conjugate,
        "h": torch.arange(5, dtype=torch.float16),
        "d": torch.arange(3, dtype=torch.float64).reshape(3, 1).expand(3, 2),  # stride 0
    }
    ckpt.async_save(state, tmp_path / "a").result(timeout=60)
    target = {key: torch.zeros(value.shape, dtype=value.dtype) for key, value in state.items()}
    ckpt.load(target, tmp_path / "a")
    for key, value in state.items():
        assert torch.equal(target[key], value.detach().resolve_conj()), key
    assert parameter.grad is None and parameter.requires_grad


def test_a_writer_that_cannot_start_is_a_checkpoint_error_naming_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background.sys, "executable", str(tmp_path / "no-python-here"))
    with pytest.raises(CheckpointError, match=r"could not start the async_save writer .*rank 0"):
        ckpt.async_save({"w": torch.ones(2)}, tmp_path / "a")
    assert not background._writers and not (tmp_path / "a").exists()
    monkeypatch.undo()
    ckpt.async_save({"w": torch.ones(2)}, tmp_path / "a").result(timeout=60)  # then it starts


def test_a_forked_child_that_exits_leaves_its_parents_writer_alone(tmp_path: Path) -> None:
    ckpt.async_save({"w": torch.ones(2)}, tmp_path / "a").result(timeout=60)
    writer = _writer()
    pid = os.fork()
    if pid == 0:  # the child: exits through the interpreter's normal shutdown (atexit runs)
        code = 0 if not background._writers else 3
        try:
            background.shutdown_writers()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child saw its parent's writers"
    assert writer.process.poll() is None and not writer.dead
    ckpt.async_save({"w": torch.full((2,), 2.0)}, tmp_path / "b").result(timeout=60)
    assert _writer() is writer


@pytest.mark.parametrize("reason", [[1, 2], "not json", {"rank": "x", "reason": None}])
def test_an_abort_reason_of_any_shape_fails_the_save_in_flight_as_a_checkpoint_error(
    tmp_path: Path, reason: Any
) -> None:
    ckpt.async_save({"w": torch.ones(2)}, tmp_path / "a").result(timeout=60)
    writer = _writer()
    os.kill(writer.process.pid, signal.SIGSTOP)  # the save below stays in flight
    try:
        future = ckpt.async_save({"w": torch.ones(2)}, tmp_path / "b")
        writer._aborted(reason)  # what the receiver does with a reason read from the store
        with pytest.raises(CheckpointError, match="background writer of rank"):
            future.result(timeout=30)
    finally:
        os.kill(writer.process.pid, signal.SIGKILL)
    ckpt.async_save({"w": torch.full((2,), 3.0)}, tmp_path / "c").result(timeout=60)
    assert _writer() is not writer
