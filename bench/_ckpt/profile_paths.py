"""Where shardwise.checkpoint spends its time, in one process (no process group).

Run ``python bench/_ckpt/profile_paths.py`` (``--help`` for sizes). Sections:

* small: save and load of many small tensors — wall time per tensor, the index size, the
  cost of the index JSON alone, and cProfile's top functions (every thread is profiled: load
  reads on a thread pool);
* big: save and load of one large tensor against plain ``os.write``/``os.preadv``, and what
  the checksum costs when computed over the whole tensor before writing (or after reading)
  versus piece by piece interleaved with the I/O while the piece is still in cache;
* strided: ``load_tensor`` of a column block (the rows->columns reshard read pattern): how
  many reads the planner issues and what each costs;
* checksums: whether xxhash and crc32c release the GIL (two threads at once versus one).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

import shardwise.checkpoint as swckpt
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.load import read_metadata
from shardwise.checkpoint.planning import planner

MIB = 1 << 20
GIB = 1 << 30


def median_time(function: Callable[[], object], reps: int) -> float:
    """Median wall time of ``function()`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def profiled(top: int, title: str) -> Iterator[None]:
    """cProfile the block in this thread and in every thread it starts; print the top."""
    profiles: list[cProfile.Profile] = []

    def start_in_thread(*_: Any) -> None:
        # Runs as the first profile event of a new thread: replace this hook by a profiler.
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    main = cProfile.Profile()
    threading.setprofile(start_in_thread)
    main.enable()
    try:
        yield
    finally:
        main.disable()
        threading.setprofile(None)  # type: ignore[arg-type]
    stream = io.StringIO()
    stats = pstats.Stats(main, stream=stream)
    for profile in profiles:
        with contextlib.suppress(TypeError):  # a thread that recorded nothing
            stats.add(profile)
    stats.sort_stats("tottime").print_stats(top)
    print(f"--- {title}: top {top} by own time (all threads) ---")
    print(_trim(stream.getvalue()))


def _trim(text: str) -> str:
    keep = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("   Ordered", "   List reduced")):
            continue
        keep.append(line.replace(os.path.dirname(swckpt.__file__) + "/", "checkpoint/")[:150])
    return "\n".join(keep)


def small_section(root: str, count: int, top: int) -> None:
    """Save and load of ``count`` small tensors."""
    print(f"\n=== small: {count:,} tensors of 64-1024 float32 ===")
    shapes = [(64,), (256,), (16, 16), (1024,), (8, 32)]
    state = {f"layers.{i // 10}.param{i % 10}": torch.randn(shapes[i % 5]) for i in range(count)}
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    path = os.path.join(root, "small")
    swckpt.save(state, path)
    swckpt.load(target, path)
    save_s = median_time(lambda: swckpt.save(state, path), 3)
    load_s = median_time(lambda: swckpt.load(target, path), 3)
    index = os.path.getsize(os.path.join(path, "shardwise.json"))
    metadata = read_metadata(path)
    to_json = median_time(metadata.to_json, 3)
    text = metadata.to_json()
    from_json = median_time(lambda: type(metadata).from_json(text), 3)
    data_bytes = sum(v.numel() * v.element_size() for v in state.values())
    print(
        f"save {save_s * 1000:.0f} ms ({save_s / count * 1e6:.0f} us/tensor), "
        f"load {load_s * 1000:.0f} ms ({load_s / count * 1e6:.0f} us/tensor); "
        f"data {data_bytes / MIB:.1f} MiB, index {index / MIB:.2f} MiB "
        f"({index / count:.0f} B/tensor); Metadata.to_json {to_json * 1000:.0f} ms, "
        f"from_json {from_json * 1000:.0f} ms"
    )
    with profiled(top, "small save"):
        swckpt.save(state, path)
    with profiled(top, "small load"):
        swckpt.load(target, path)
    shutil.rmtree(path)


def _write_file(path: str, view: memoryview, piece: int, hasher: Any | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = piece or len(view)
        for start in range(0, len(view), step):
            chunk = view[start : start + step]
            if hasher is not None and piece:
                hasher.update(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
    finally:
        os.close(fd)


def _read_file(path: str, view: memoryview, piece: int, hasher: Any | None) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        step = piece or len(view)
        for start in range(0, len(view), step):
            chunk = view[start : start + step]
            done = 0
            while done < len(chunk):
                done += os.preadv(fd, [chunk[done:]], start + done)
            if hasher is not None and piece:
                hasher.update(chunk)
    finally:
        os.close(fd)


def big_section(root: str, size_mib: int, reps: int) -> None:
    """One large tensor: shardwise against plain I/O, and checksum placement."""
    print(f"\n=== big: one {size_mib} MiB float32 tensor, {root} (no fsync anywhere) ===")
    tensor = torch.randn(size_mib * MIB // 4)
    target = torch.zeros_like(tensor)
    view = memoryview(tensor.numpy()).cast("B")
    target_view = memoryview(target.numpy()).cast("B")
    path = os.path.join(root, "big")
    raw = os.path.join(root, "raw.bin")
    swckpt.save({"w": tensor}, path, sync_files=False)

    def write_plain() -> None:
        _write_file(raw, view, 0, None)

    def read_plain() -> None:
        _read_file(raw, target_view, 0, None)

    def hash_then_write() -> None:
        xxhash.xxh3_64_intdigest(view)
        write_plain()

    def read_then_hash() -> None:
        read_plain()
        xxhash.xxh3_64_intdigest(target_view)

    rows: list[tuple[str, Callable[[], object]]] = [
        (
            "shardwise save (sync_files=False)",
            lambda: swckpt.save({"w": tensor}, path, sync_files=False),
        ),
        ("os.write", write_plain),
        ("xxh3 whole, then os.write", hash_then_write),
    ]
    for piece in (1 * MIB, 4 * MIB, 16 * MIB):
        rows.append(
            (
                f"xxh3+os.write per {piece // MIB} MiB piece",
                lambda piece=piece: _write_file(raw, view, piece, xxhash.xxh3_64()),
            )
        )
    rows += [
        ("shardwise load (verify=True)", lambda: swckpt.load({"w": target}, path)),
        ("shardwise load (verify=False)", lambda: swckpt.load({"w": target}, path, verify=False)),
        ("os.preadv", read_plain),
        ("os.preadv, then xxh3 whole", read_then_hash),
    ]
    for piece in (1 * MIB, 4 * MIB, 16 * MIB):
        rows.append(
            (
                f"os.preadv+xxh3 per {piece // MIB} MiB piece",
                lambda piece=piece: _read_file(raw, target_view, piece, xxhash.xxh3_64()),
            )
        )
    write_plain()
    results: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(reps):  # interleaved repetitions
        for name, function in rows:
            start = time.perf_counter()
            function()
            results[name].append(time.perf_counter() - start)
    for name, _ in rows:
        seconds = statistics.median(results[name])
        print(f"  {name:<36}{seconds * 1000:8.0f} ms {size_mib / 1024 / seconds:6.2f} GiB/s")
    shutil.rmtree(path)
    os.remove(raw)


def strided_section(root: str, size_mib: int, top: int) -> None:
    """Reading a column block of a row-major chunk, as a rows->columns reshard does."""
    side = int((size_mib * MIB // 4) ** 0.5)
    print(f"\n=== strided: left half columns of a [{side}, {side}] float32 chunk ===")
    tensor = torch.randn(side, side)
    path = os.path.join(root, "strided")
    swckpt.save({"w": tensor}, path, sync_files=False)
    metadata = read_metadata(path)
    entry = metadata.state_dict_metadata["w"]
    data = metadata.storage_data or {}
    chunks = [
        SavedChunk(tuple(c.offsets), tuple(c.sizes), info["file"], info["begin"], info["end"])
        for c in entry.chunks  # type: ignore[union-attr]
        for info in [data[swckpt.MetadataIndex("w", c.offsets)]]
    ]
    box = ((0, 0), (side, side // 2))
    reads = planner.plan_reads(box, chunks, 4)
    read_bytes = sum(read.nbytes for read in reads)
    seconds = median_time(
        lambda: swckpt.load_tensor(path, "w", offsets=[0, 0], sizes=[side, side // 2]), 3
    )
    print(
        f"{len(reads):,} reads, {read_bytes / MIB:.0f} MiB read for {side * side * 2 / MIB:.0f} "
        f"MiB needed: {seconds * 1000:.0f} ms ({seconds / len(reads) * 1e6:.1f} us/read, "
        f"{side * side * 2 / GIB / seconds:.2f} GiB/s)"
    )
    with profiled(top, "strided load_tensor"):
        swckpt.load_tensor(path, "w", offsets=[0, 0], sizes=[side, side // 2])
    shutil.rmtree(path)


def _python_progress(seconds: float, busy: Callable[[], object] | None) -> int:
    """Pure-Python loop iterations this thread completes in ``seconds`` while another thread
    calls ``busy`` in a loop (or while nothing else runs)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            assert busy is not None
            busy()

    thread = threading.Thread(target=spin) if busy is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.05)
    count = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        count += 1
    stop.set()
    if thread is not None:
        thread.join()
    return count


def gil_section(size_mib: int) -> None:
    """Do the checksum functions release the GIL? Python progress of this thread while
    another thread checksums, relative to no other thread."""
    print(f"\n=== checksums and the GIL ({size_mib} MiB buffer) ===")
    buffer = memoryview(torch.randn(size_mib * MIB // 4).numpy()).cast("B")
    functions: dict[str, Callable[[memoryview], object]] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
    }
    with contextlib.suppress(ImportError):
        import crc32c  # type: ignore[import-not-found]

        functions["crc32c"] = crc32c.crc32c
    alone = _python_progress(1.0, None)
    for name, function in functions.items():
        during = _python_progress(1.0, lambda f=function: f(buffer))
        share = during / alone
        verdict = "releases the GIL" if share > 0.2 else "holds the GIL"
        print(f"  {name:<8} Python progress beside it: {share:4.0%} of alone ({verdict})")


def main() -> None:
    """Run the sections."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm", help="where to write (tmpfs by default)")
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--sections", default="small,big,strided,gil")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    root = tempfile.mkdtemp(prefix="shardwise-profile-", dir=args.dir)
    try:
        if "small" in sections:
            small_section(root, args.small, args.top)
        if "big" in sections:
            big_section(root, args.size_mib, args.reps)
        if "strided" in sections:
            strided_section(root, args.size_mib, args.top)
        if "gil" in sections:
            gil_section(64)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
