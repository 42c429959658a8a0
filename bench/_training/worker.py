"""Rank-side half of ``bench/training_state.py``: the measurements, run on each rank of a gloo
world on CPU.

Two worlds run one after the other. The *main* world (4 ranks) times, interleaved in every
repetition, the save and load of the big and of the many-small training state with the raw
limit, shardwise and DCP, and the async save's blocking time next to a plain copy; at the end it
saves the big state once more with shardwise and with DCP and leaves both checkpoints for the
*reshard* world (2 ranks), which builds the same model for 2 ranks and times loading them.

Timing and memory follow ``bench/_ckpt/worker.py`` (whose :func:`measure` and
:func:`measure_async` are used): all ranks meet at a barrier, run the operation, meet again; the
time is the slowest rank's, the peak memory the largest rank's high-water mark above its
resident size before the operation.
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import io
import os
import pstats
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import shardwise.checkpoint as swckpt
from _ckpt.worker import measure, measure_async
from _launch import freeze_gc, fresh_dir, remove_dir, rotate, run_rank
from _training import state as training
from _training.model import ModelShape

RAW = "raw"
SHARDWISE = "shardwise"
DCP = "dcp"
# The same DCP calls again under another name (--dcp-control): DCP against itself.
DCP_CONTROL = "dcp-control"
MEMCPY = "memcpy"
# shardwise's load with verify=False: what the checksum pass costs (informational).
UNVERIFIED = "shardwise-unverified"
# The reshard world loads what the main world's last save of each method left here.
RESHARD_DIRS = {SHARDWISE: "reshard-shardwise", DCP: "reshard-dcp"}


@dataclass
class Config:
    """What one world runs; pickled to its ranks."""

    phase: str  # "main" or "reshard"
    world_size: int
    big: ModelShape
    small: ModelShape
    reps: int
    root: str
    results: str
    port: int
    verify: bool = True
    dcp_control: bool = False
    cases: list[str] = field(default_factory=lambda: ["big", "async", "small"])
    # Which of "shardwise", "dcp" to run once more under the profiler (rank 0), after the reps.
    profile: list[str] = field(default_factory=list)
    profile_top: int = 25
    # Skip the timed repetitions (only the profiles).
    profile_only: bool = False


@dataclass
class Record:
    """One timed operation on all ranks."""

    case: str
    method: str
    rep: int
    seconds: float
    mem_mib: float
    extra: dict[str, float] = field(default_factory=dict)


# -- the raw limit ------------------------------------------------------------------------------

_IOV_MAX = 1024


def _views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [
        memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()
    ]


def raw_save(tensors: list[torch.Tensor], path: str, rank: int) -> None:
    """The limit for a save: this rank's bytes written into one file (``os.writev`` of the
    tensors' memory) and fsynced."""
    os.makedirs(path, exist_ok=True)
    views = _views(tensors)
    fd = os.open(f"{path}/rank-{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while views:
            batch, views = views[:_IOV_MAX], views[_IOV_MAX:]
            written = os.writev(fd, batch)
            # A short write: put back what is left of the batch.
            for index, view in enumerate(batch):
                if written < len(view):
                    views = [view[written:], *batch[index + 1 :], *views]
                    break
                written -= len(view)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(tensors: list[torch.Tensor], path: str, rank: int) -> None:
    """The limit for a load: this rank's bytes read back with ``os.preadv`` straight into the
    tensors' memory."""
    views = _views(tensors)
    fd = os.open(f"{path}/rank-{rank}.bin", os.O_RDONLY)
    try:
        offset = 0
        while views:
            batch, views = views[:_IOV_MAX], views[_IOV_MAX:]
            count = os.preadv(fd, batch, offset)
            if count == 0:
                raise OSError(f"{path}/rank-{rank}.bin is shorter than this rank's state")
            offset += count
            for index, view in enumerate(batch):
                if count < len(view):
                    views = [view[count:], *batch[index + 1 :], *views]
                    break
                count -= len(view)
    finally:
        os.close(fd)


# -- the operations -----------------------------------------------------------------------------


@dataclass
class Step:
    """One named operation of a method, and how to check what a load left."""

    case: str
    run: Callable[[], object]
    loads: bool = False
    # Recorded as this method instead of the one that wrote the checkpoint.
    method: str | None = None
    # Untimed, before ``run``: so that every timed load is the first read of what its save
    # wrote (on tmpfs the first read of fresh pages costs 10-20% more than a second one).
    prepare: Callable[[], object] | None = None


def save_load_steps(
    method: str, state: training.TrainingState, path: str, rank: int, prefix: str
) -> list[Step]:
    """Save of ``state`` with ``method``, then a load of it back into the same state dict."""
    tensors = state.local_tensors
    if method == RAW:
        return [
            Step(f"{prefix}save", lambda: raw_save(tensors, path, rank)),
            Step(f"{prefix}load", lambda: raw_load(tensors, path, rank), loads=True),
        ]
    if method == SHARDWISE:
        return [
            Step(f"{prefix}save", lambda: swckpt.save(state.state, path)),
            Step(f"{prefix}load", lambda: swckpt.load(state.state, path), loads=True),
            Step(
                f"{prefix}load",
                lambda: swckpt.load(state.state, path, verify=False),
                loads=True,
                method=UNVERIFIED,
                prepare=lambda: swckpt.save(state.state, path),
            ),
        ]
    return [
        Step(f"{prefix}save", lambda: dcp_save(state.state, path)),
        Step(f"{prefix}load", lambda: dcp_load(state.state, path), loads=True),
    ]


def dcp_save(state_dict: dict[str, Any], path: str) -> None:
    """DCP's save with FileSystemWriter's defaults."""
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))


def dcp_load(state_dict: dict[str, Any], path: str) -> None:
    """DCP's load with FileSystemReader."""
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path))


def load_step(method: str, state: training.TrainingState, path: str) -> Step:
    """A load of the checkpoint at ``path`` into ``state`` with ``method``."""
    if method == SHARDWISE:
        return Step("reshard-load", lambda: swckpt.load(state.state, path), loads=True)
    if method == UNVERIFIED:
        return Step(
            "reshard-load",
            lambda: swckpt.load(state.state, path, verify=False),
            loads=True,
            method=UNVERIFIED,
        )
    return Step("reshard-load", lambda: dcp_load(state.state, path), loads=True)


# -- profiling ----------------------------------------------------------------------------------


class Sampler:
    """Samples the calling thread's Python stack every ``interval`` seconds from a background
    thread: where the wall time goes, with little overhead (cProfile's per-call cost inflates
    exactly the many small Python calls this benchmark is about). A sample lands when the
    sampling thread gets the GIL, i.e. at the interpreter's switch interval or when the
    profiled thread releases the GIL (I/O, a torch kernel)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.inclusive: Counter[str] = Counter()
        self.own: Counter[str] = Counter()
        self.samples = 0
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            if frame is None:
                continue
            self.samples += 1
            self.own[_where(frame)] += 1
            seen = set()
            while frame is not None:
                name = _where(frame)
                # The benchmark's own frames (and the process's) are on every sample.
                if name not in seen and not name.startswith(_HARNESS):
                    seen.add(name)
                    self.inclusive[name] += 1
                frame = frame.f_back

    def report(self, top: int) -> str:
        """The top functions by inclusive and by own samples, as percentages."""
        lines = [f"{self.samples} samples of the calling thread"]
        for title, counter in (("inclusive (on the stack)", self.inclusive), ("own", self.own)):
            lines.append(f"  by {title}:")
            for name, count in counter.most_common(top):
                lines.append(f"    {100 * count / max(1, self.samples):5.1f}%  {name}")
        return "\n".join(lines)


def _where(frame: Any) -> str:
    code = frame.f_code
    return f"{_short(code.co_filename)}:{code.co_firstlineno}({code.co_name})"


_HARNESS = ("bench/", "multiprocessing/", "<string>")


def _short(filename: str) -> str:
    """``filename`` from its package (``shardwise/...``, ``torch/...``, ``json/...``)."""
    shorter = re.sub(r"^.*/(site-packages|src|lib/python3\.\d+)/", "", filename)
    return re.sub(r"^.*/(bench/)", r"\1", shorter)


# Functions of shardwise (and the torch helper it calls per DTensor) timed by :class:`Phases`:
# (module, attribute, label). Names a version of shardwise lacks are skipped.
_TORCH_OFFSETS = (
    "torch.distributed.tensor._utils",
    "compute_local_shape_and_global_offset",
    "    torch compute_local_shape_and_global_offset",
)
SAVE_PHASES = [
    (
        "shardwise.checkpoint.saving.save",
        "describe_or_error",
        "describe (flatten, describe_tensor)",
    ),
    ("shardwise.checkpoint.saving.snapshot", "describe_tensor", "  describe_tensor"),
    _TORCH_OFFSETS,
    (
        "shardwise.checkpoint.planning.tables",
        "rank_table",
        "rank table (layouts, own boxes checked)",
    ),
    ("shardwise.collectives.Comm", "gather_or_raise", "gather to coordinator (+ wait for ranks)"),
    ("shardwise.checkpoint.planning.tables", "plan_from_tables", "coordinator plan from tables"),
    ("shardwise.checkpoint.planning.planner", "agree_aliases", "  planner.agree_aliases"),
    ("shardwise.collectives.Comm", "scatter_or_raise", "scatter assignments"),
    ("shardwise.checkpoint.planning.tables", "own_file_writes", "own writes (grid cells)"),
    ("shardwise.checkpoint.saving.writer", "write_data_file", "write data file (+hash, fsync)"),
    ("shardwise.checkpoint.saving.build_index", "build_index", "build index (layouts + encode)"),
    (
        "shardwise.checkpoint.saving.build_index",
        "decode_index",
        "  decode it back (coordinator check)",
    ),
    ("shardwise.checkpoint.saving.writer", "check_visible", "check data files visible"),
    ("shardwise.checkpoint.saving.save", "_commit", "commit (index write, fsync, rename)"),
    ("shardwise.collectives.Comm", "broadcast_or_raise", "broadcast the outcome"),
    ("shardwise.checkpoint.saving.save", "_remove_leftovers", "remove leftovers"),
    ("shardwise.checkpoint.index.Index", "to_metadata", "Index.to_metadata (return value)"),
]
LOAD_PHASES = [
    ("shardwise.checkpoint.loading.load", "read_index_bytes", "read index bytes (rank 0)"),
    ("shardwise.collectives.Comm", "broadcast_json", "broadcast index text"),
    ("shardwise.checkpoint.loading.load", "decode", "decode index (every rank)"),
    ("shardwise.checkpoint.loading.load", "flatten", "flatten state dict"),
    ("shardwise.checkpoint.loading.load", "_plan_load", "plan load (match, describe, plan reads)"),
    ("shardwise.checkpoint.loading.load", "_match", "  match keys"),
    ("shardwise.checkpoint.loading.load", "describe_tensor", "  describe_tensor"),
    _TORCH_OFFSETS,
    (
        "shardwise.checkpoint.loading.reader.CheckpointReader",
        "plan",
        "  reader.plan (reads per box)",
    ),
    ("shardwise.checkpoint.loading.reader.CheckpointReader", "check_files", "check data files"),
    ("shardwise.collectives", "all_gather_json", "all_gather_json (JSON + wait for ranks)"),
    (
        "shardwise.checkpoint.loading.reader.CheckpointReader",
        "fill",
        "the verified pass: read, check, use",
    ),
    ("shardwise.checkpoint.loading.load", "_decode", "decode objects"),
    ("shardwise.checkpoint.loading.load", "restore", "restore objects into the state dict"),
]


class Phases:
    """Wall time spent inside chosen functions during one call (their inclusive time, on
    this rank; nested phases are indented): a breakdown with no profiler overhead beyond
    one timer per call."""

    def __init__(self, phases: list[tuple[str, str, str]]) -> None:
        self.phases = phases
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Phases:
        for where, name, label in self.phases:
            owner = _resolve(where)
            original = getattr(owner, name, None) if owner is not None else None
            if original is None:
                continue
            self.seconds.setdefault(label, 0.0)
            self.calls.setdefault(label, 0)
            setattr(owner, name, self._timed(original, label))
            self._restore.append((owner, name, original))
        return self

    def __exit__(self, *_: object) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)

    def _timed(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - began
                self.calls[label] += 1

        return timed

    def report(self, total: float) -> str:
        lines = [f"{'phase (inclusive, rank 0)':<52}{'calls':>7}{'ms':>9}{'share':>8}"]
        for label, seconds in self.seconds.items():
            if self.calls[label]:
                lines.append(
                    f"{label:<52}{self.calls[label]:>7}{seconds * 1000:>9.0f}"
                    f"{seconds / total:>8.0%}"
                )
        lines.append(f"{'the whole call':<52}{1:>7}{total * 1000:>9.0f}{1:>8.0%}")
        return "\n".join(lines)


def _resolve(where: str) -> Any:
    """The module, or the class in a module, that ``where`` names (dotted)."""
    parts = where.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            owner = getattr(owner, attribute, None)
        return owner
    return None


def phase_times(operation: Callable[[], object], phases: list[tuple[str, str, str]]) -> str:
    """``operation`` run once with :class:`Phases` timers: the breakdown as text."""
    with Phases(phases) as timers:
        began = time.perf_counter()
        operation()
        seconds = time.perf_counter() - began
    return f"--- phases ---\n{timers.report(seconds)}"


def cprofiled(operation: Callable[[], object], top: int) -> str:
    """``operation`` run once under cProfile, this thread only (threads that only wait, such
    as a lock's heartbeat, would swamp the cumulative listing; shardwise's read threads live
    in a pool started earlier): the top ``top`` functions by cumulative and by own time."""
    main = cProfile.Profile()
    began = time.perf_counter()
    main.enable()
    try:
        operation()
    finally:
        main.disable()
    seconds = time.perf_counter() - began
    stream = io.StringIO()
    stats = pstats.Stats(main, stream=stream)
    stats.strip_dirs()
    for order in ("cumulative", "tottime"):
        stream.write(f"\n--- cProfile, by {order} ---\n")
        stats.sort_stats(order).print_stats(top)
    text = "\n".join(
        line[:160]
        for line in stream.getvalue().splitlines()
        if line.strip() and not line.startswith(("   Ordered", "   List reduced"))
    )
    return f"wall time under cProfile {seconds * 1000:.0f} ms\n{text}"


def sampled(operation: Callable[[], object], top: int) -> str:
    """``operation`` run once under the :class:`Sampler`: its report as text."""
    interval = sys.getswitchinterval()
    # The sampler gets the GIL at least this often while the profiled thread runs Python.
    sys.setswitchinterval(0.0005)
    try:
        with Sampler() as sampler:
            began = time.perf_counter()
            operation()
            seconds = time.perf_counter() - began
    finally:
        sys.setswitchinterval(interval)
    return f"--- sampling (wall time {seconds * 1000:.0f} ms) ---\n{sampler.report(top)}"


# -- driver -------------------------------------------------------------------------------------


class Runner:
    """Runs the interleaved repetitions on one rank; rank 0 collects the records."""

    def __init__(self, config: Config, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.records: list[Record] = []
        self.checks: list[str] = []
        self.profiles: dict[str, str] = {}
        self.dcps = [DCP, DCP_CONTROL] if config.dcp_control else [DCP]

    def _fresh_dir(self, name: str) -> str:
        return fresh_dir(os.path.join(self.config.root, name), self.rank)

    def _remove(self, path: str) -> None:
        remove_dir(path, self.rank)

    def _run(self, method: str, rep: int, step: Step, state: training.TrainingState) -> None:
        method = step.method or method
        checking = rep == 0 and self.config.verify and step.loads
        # The raw limit moves tensor bytes only.
        objects = method != RAW
        if step.prepare is not None:
            step.prepare()
        if checking:
            state.clear(objects)
        seconds, mem = measure(step.run)
        if checking:
            state.check(f"{method} {step.case}", objects)
            self.checks.append(f"{method} {step.case}")
        self.records.append(Record(step.case, method, rep, seconds, mem))

    def save_load(self, state: training.TrainingState, rep: int, prefix: str) -> None:
        for method in rotate([RAW, SHARDWISE, *self.dcps], rep):
            path = self._fresh_dir(f"{prefix}{method}")
            for step in save_load_steps(method, state, path, self.rank, prefix):
                self._run(method, rep, step, state)
            self._remove(path)

    def asynchronous(self, state: training.TrainingState, rep: int) -> None:
        tensors = state.local_tensors
        for method in rotate([MEMCPY, SHARDWISE, *self.dcps], rep):
            if method == MEMCPY:
                # What staging must at least cost: a fresh copy of every local tensor.
                seconds, mem = measure(lambda: [t.clone() for t in tensors])
                self.records.append(Record("async", MEMCPY, rep, seconds, mem))
                continue
            path = self._fresh_dir(f"async-{method}")
            if method == SHARDWISE:
                blocked, total, mem = measure_async(
                    lambda: swckpt.async_save(state.state, path)  # noqa: B023
                )
            else:
                blocked, total, mem = measure_async(
                    lambda: dcp.async_save(
                        state.state,
                        storage_writer=dcp.FileSystemWriter(path),  # noqa: B023
                    )
                )
            if rep == 0 and self.config.verify:
                # What the background save wrote must load back (checked, untimed).
                state.clear()
                if method == SHARDWISE:
                    swckpt.load(state.state, path)
                else:
                    dcp_load(state.state, path)
                state.check(f"{method} async_save, loaded back")
                self.checks.append(f"{method} async_save")
            self.records.append(Record("async", method, rep, blocked, mem, {"total": total}))
            self._remove(path)

    def _progress(self, label: str, began: float) -> None:
        if self.rank == 0:
            print(
                f"  [{self.config.phase}] {label} done at {time.perf_counter() - began:6.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def main_world(self, mesh: Any) -> dict[str, Any]:
        config = self.config
        began = time.perf_counter()
        big = training.build(config.big, mesh, per_layer=True, steps=2)
        big.fill()
        small = training.build(config.small, mesh, per_layer=False, steps=2)
        small.fill()
        freeze_gc()
        self._progress("building the models", began)
        for rep in range(0 if config.profile_only else config.reps + 1):
            # rep 0 is the warm-up (and checks every value)
            if "big" in config.cases:
                self.save_load(big, rep, "")
            if "async" in config.cases:
                self.asynchronous(big, rep)
            if "small" in config.cases:
                self.save_load(small, rep, "small-")
            self._progress("warm-up" if rep == 0 else f"rep {rep}/{config.reps}", began)
        if "reshard" in config.cases:
            # Left for the reshard world (removed by bench/training_state.py).
            for method, name in RESHARD_DIRS.items():
                path = self._fresh_dir(name)
                if method == SHARDWISE:
                    swckpt.save(big.state, path)
                else:
                    dcp_save(big.state, path)
        self._profile_main(big, small)
        return {
            "big": _describe(big, config.big),
            "small": _describe(small, config.small),
        }

    def _profile_main(self, big: training.TrainingState, small: training.TrainingState) -> None:
        for method in self.config.profile:
            for state, prefix in ((big, ""), (small, "small-")):
                name = f"profile-{prefix}{method}"
                path = os.path.join(self.config.root, name)
                save, load = save_load_steps(method, state, path, self.rank, prefix)[:2]
                # Every save goes to a fresh directory, as the timed saves do (overwriting
                # adds the removal of the old files).
                fresh = functools.partial(self._fresh_dir, name)
                self._profile(f"{method} {save.case}", save.run, fresh)
                self._profile(f"{method} {load.case}", load.run)
                self._remove(path)

    def _profile(
        self,
        title: str,
        operation: Callable[[], object],
        prepare: Callable[[], object] | None = None,
    ) -> None:
        """Run ``operation`` on every rank once to warm up, then once for each tool, which
        watches rank 0: phase timers, cProfile, the sampler."""
        phases = SAVE_PHASES if title.endswith("save") else LOAD_PHASES
        top = self.config.profile_top
        tools: list[Callable[[], str] | None] = [
            None,
            lambda: phase_times(operation, phases),
            lambda: cprofiled(operation, top),
            lambda: sampled(operation, top),
        ]
        texts = []
        for tool in tools:
            if prepare is not None:
                prepare()
            dist.barrier()
            if tool is None or self.rank != 0:
                operation()
            else:
                texts.append(tool())
            dist.barrier()
        if self.rank == 0:
            self.profiles[title] = "\n\n".join(texts)

    def reshard_world(self, mesh: Any) -> dict[str, Any]:
        config = self.config
        began = time.perf_counter()
        big = training.build(config.big, mesh, per_layer=True, steps=0)
        freeze_gc()
        self._progress("building the model", began)
        paths = {method: os.path.join(config.root, name) for method, name in RESHARD_DIRS.items()}
        for rep in range(0 if config.profile_only else config.reps + 1):
            for method in rotate([SHARDWISE, DCP, UNVERIFIED], rep):
                path = paths[SHARDWISE if method == UNVERIFIED else method]
                self._run(method, rep, load_step(method, big, path), big)
            self._progress("warm-up" if rep == 0 else f"rep {rep}/{config.reps}", began)
        for method in config.profile:
            self._profile(f"{method} reshard-load", load_step(method, big, paths[method]).run)
        if config.verify:
            self._check_round_trip(big, paths[SHARDWISE])
        return {"big": _describe(big, config.big)}

    def _check_round_trip(self, state: training.TrainingState, path: str) -> None:
        """What shardwise loads is what the job continues from: loaded, handed to the model
        and optimizer with ``set_state_dict``, and taken again with ``get_state_dict``."""
        state.clear()
        swckpt.load(state.state, path)
        set_state_dict(
            state.model,
            state.optim,
            model_state_dict=state.state["model"],
            optim_state_dict=state.state["optim"],
        )
        model_state, optim_state = get_state_dict(state.model, state.optim)
        again = training.TrainingState(
            state.model, state.optim, {"model": model_state, "optim": optim_state}
        )
        again.check("shardwise reshard-load, set_state_dict, get_state_dict")
        self.checks.append("shardwise reshard-load, set_state_dict, get_state_dict")


def _describe(state: training.TrainingState, shape: ModelShape) -> dict[str, Any]:
    return {
        "shape": asdict(shape),
        "tensors": len(state.leaves),
        "global_bytes": state.global_bytes,
        "local_bytes": state.local_bytes,
    }


def main(rank: int, config: Config) -> None:
    """Entry point of one rank (spawned by ``bench/training_state.py``)."""

    def body() -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (config.world_size,))
        runner = Runner(config, rank)
        if config.phase == "main":
            described = runner.main_world(mesh)
        else:
            described = runner.reshard_world(mesh)
        return {
            "records": [asdict(record) for record in runner.records],
            "states": described,
            "checks": runner.checks,
            "profiles": runner.profiles,
        }

    run_rank(rank, config, config.world_size, 900, body)
