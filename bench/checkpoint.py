"""shardwise.checkpoint against torch.distributed.checkpoint (DCP), on tmpfs and on disk.

Run ``python bench/checkpoint.py`` (``--quick`` for a smoke check under a minute; see
``--help``). Two ranks (gloo on 127.0.0.1, one compute thread each) run, interleaved in the
same process pair, every repetition of:

* big: a float32 tensor of ``--size-mib`` MiB, row-sharded over the two ranks — shardwise saves
  a ``ShardedTensor`` (``ChunkShardingSpec(dim=0)``), DCP a ``DTensor`` with ``Shard(0)`` on a
  1-D CPU mesh (its native sharded type), both over the same local memory; then each loads it
  back row-sharded, column-sharded (rows -> columns) and into one plain tensor in one process
  (2 -> 1 ranks: shardwise over a one-rank group, DCP with ``no_dist=True``). The "raw" method
  is the limit: each rank ``os.write``s its bytes into one file and fsyncs it, then
  ``os.preadv``s them back into the same target memory;
* small: ``--small`` small tensors (0.25-4 KiB, replicated on both ranks) saved and loaded;
* async: ``async_save`` of the big tensor; the time the caller is blocked, next to a plain
  copy of each rank's state dict into fresh memory (what staging costs at least).

DCP runs with its FileSystemWriter defaults (``thread_count=1``, ``sync_files=True``) and with
every ``--dcp-threads`` count; shardwise with its defaults (``sync_files=True``). Loads read
what the save just wrote, so on disk they come from the page cache (dropping it needs root).
Times are collective (barrier to barrier, slowest rank), the median over ``--reps``
repetitions after one warm-up (which also checks every loaded value). Peak memory is each
rank's resident high-water mark above its resident size before the operation (the state dict
and load targets are already resident), the largest rank, median over repetitions. The
checksum throughput of crc32c and xxh3 is measured at the end, in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

from _ckpt import worker
from _launch import free_port, run_world

MIB = 1 << 20
GIB = 1 << 30


def _fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as file:
        for line in file:
            _, mount, fstype, *_ = line.split()
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _source_state() -> str:
    """The commit of the working tree and whether shardwise's checkpoint code differs from it
    (read-only git commands)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "src/shardwise/checkpoint"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "source: unknown (no git)"
    changed = [name.rsplit("/", 1)[-1] for name in dirty if name.endswith(".py")]
    return f"source: {head}" + (f" + uncommitted {', '.join(changed)}" if changed else "")


def _run_world(config: worker.Config) -> dict[str, Any]:
    return run_world(worker.main, config, worker.WORLD_SIZE)


# -- checksums ----------------------------------------------------------------------------------


def checksum_throughput(nbytes: int, reps: int) -> dict[str, float]:
    """GiB/s of each checksum (and of a plain copy) over one ``nbytes`` buffer, one thread."""
    torch.set_num_threads(1)
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    target = torch.empty_like(buffer)
    functions: dict[str, Callable[[], object]] = {
        "xxh3_64 (xxhash)": lambda: xxhash.xxh3_64_intdigest(view),
        "xxh3_128 (xxhash)": lambda: xxhash.xxh3_128_intdigest(view),
        "zlib.crc32": lambda: zlib.crc32(view),
        "memcpy (torch copy_)": lambda: target.copy_(buffer),
    }
    try:
        import crc32c  # type: ignore[import-not-found]

        hardware = "hw" if getattr(crc32c, "hardware_based", False) else "sw"
        functions[f"crc32c (crc32c pkg, {hardware})"] = lambda: crc32c.crc32c(view)
    except ImportError:
        print("crc32c package not installed: skipping crc32c", file=sys.stderr)
    result = {}
    for name, function in functions.items():
        function()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        result[name] = nbytes / GIB / statistics.median(times)
    return result


# -- report --------------------------------------------------------------------------------------

BIG_CASES = ["save", "load", "reshard-cols", "reshard-2to1", "load-whole"]
SMALL_CASES = ["small-save", "small-load"]
CASE_LABEL = {
    "save": "save",
    "load": "load",
    "reshard-cols": "load rows->cols",
    "reshard-2to1": "load 2->1 ranks",
    "load-whole": "load all, each",
    "small-save": "small save",
    "small-load": "small load",
    "async": "async blocked",
}


def _medians(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, float]]:
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record["rep"] > 0:
            grouped[record["storage"], record["case"], record["method"]].append(record)
    result = {}
    for key, items in grouped.items():
        result[key] = {
            "seconds": statistics.median(r["seconds"] for r in items),
            "mem": statistics.median(r["mem_mib"] for r in items),
            "spread": (max(r["seconds"] for r in items) - min(r["seconds"] for r in items)),
            "n": len(items),
        }
        for name in ("total", "read"):
            values = [r["extra"][name] for r in items if name in r["extra"]]
            if values:
                result[key][name] = statistics.median(values)
    return result


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _rate(nbytes: int, seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{nbytes / GIB / seconds:.2f}G/s"


class Report:
    """The tables, from the medians; every line also goes to ``lines``."""

    def __init__(self, result: dict[str, Any], config: worker.Config) -> None:
        self.config = config
        self.medians = _medians(result["records"])
        self.total_bytes = result["local_bytes"] * worker.WORLD_SIZE
        self.small_bytes = result["small_bytes"]
        self.local_bytes = result["local_bytes"]
        self.dcps = [worker.dcp_name(n) for n in config.dcp_threads]
        # The first --dcp-threads value (1 = FileSystemWriter's default) is also what loads.
        self.default_dcp = worker.dcp_name(config.dcp_threads[0])
        self.lines: list[str] = []
        self.verdicts: list[tuple[str, bool, str]] = []

    def out(self, line: str = "") -> None:
        print(line)
        self.lines.append(line)

    def get(self, storage: str, case: str, method: str) -> dict[str, float] | None:
        return self.medians.get((storage, case, method))

    def seconds(self, storage: str, case: str, method: str) -> float | None:
        entry = self.get(storage, case, method)
        return None if entry is None else entry["seconds"]

    def best_dcp(self, storage: str, case: str) -> tuple[str, float] | None:
        found = [
            (entry["seconds"], method)
            for method in self.dcps
            if (entry := self.get(storage, case, method)) is not None
        ]
        if not found:
            return None
        seconds, method = min(found)
        return method, seconds

    def verdict(self, name: str, ok: bool, detail: str) -> str:
        self.verdicts.append((name, ok, detail))
        return "PASS" if ok else "MISS"

    def time_table(self, storage: str) -> None:
        root = self.config.storages[storage]
        self.out(f"\n## {storage}: {root} ({_fs_type(root)})")
        header = (
            f"{'case':<17}{'shardwise':>19}{'DCP default':>19}{'DCP best':>24}{'raw limit':>19}"
            f"{'sw/DCPdef':>10}{'sw/DCPbest':>11}{'sw/raw':>8}  {'target':<26}verdict"
        )
        self.out(header)
        self.out("-" * len(header))
        targets = {
            "save": 2.0,
            "load": 1.5,
            "reshard-cols": 2.0,
            "reshard-2to1": 2.0,
            "small-save": 10.0,
            "small-load": 10.0,
        }
        for case in BIG_CASES + SMALL_CASES:
            nbytes = self.small_bytes if case.startswith("small") else self.total_bytes
            if case == "reshard-2to1":
                nbytes = self.total_bytes
            if case == "load-whole":  # every rank loads all of it
                nbytes = self.total_bytes * worker.WORLD_SIZE
            sw_s = self.seconds(storage, case, worker.SHARDWISE)
            if sw_s is None:
                continue
            default_s = self.seconds(storage, case, self.default_dcp)
            best = self.best_dcp(storage, case)
            raw_s = self.seconds(storage, case, worker.RAW)
            ratio_default = f"{default_s / sw_s:.2f}x" if default_s else "-"
            ratio_best = f"{best[1] / sw_s:.2f}x" if best else "-"
            fraction = f"{raw_s / sw_s:.0%}" if raw_s else "-"
            # A case without a target (a load of everything by every rank) is informational.
            goal = targets.get(case)
            target_text = "(no target)" if goal is None else f">={goal:g}x DCP best"
            verdict_parts = []
            if best and goal is not None:
                ok = best[1] / sw_s >= goal
                verdict_parts.append(
                    self.verdict(
                        f"{storage} {CASE_LABEL[case]} >= {goal:g}x DCP",
                        ok,
                        f"{best[1] / sw_s:.2f}x",
                    )
                )
            if raw_s and storage == "tmpfs" and case in ("save", "load"):
                target_text += ", >=70% raw"
                ok = raw_s / sw_s >= 0.7
                verdict_parts.append(
                    self.verdict(
                        f"{storage} {CASE_LABEL[case]} >= 70% of raw", ok, f"{raw_s / sw_s:.0%}"
                    )
                )
            best_text = (
                f"{_time(best[1])} {_rate(nbytes, best[1])} ({best[0][4:]})" if best else "-"
            )
            self.out(
                f"{CASE_LABEL[case]:<17}"
                f"{_time(sw_s) + ' ' + _rate(nbytes, sw_s):>19}"
                f"{_time(default_s) + ' ' + _rate(nbytes, default_s):>19}"
                f"{best_text:>24}"
                f"{(_time(raw_s) + ' ' + _rate(nbytes, raw_s)) if raw_s else '-':>19}"
                f"{ratio_default:>10}{ratio_best:>11}{fraction:>8}  {target_text:<26}"
                f"{'/'.join(verdict_parts)}"
            )
        self.read_row(storage)
        self.per_tensor_row(storage)
        self.async_rows(storage)

    def read_row(self, storage: str) -> None:
        entry = self.get(storage, "reshard-cols", worker.SHARDWISE)
        if entry is None or "read" not in entry:
            return
        self.out(
            f"rows->cols reads, per rank: {entry['read']:.2f}x the bytes it needs (the 1 MiB "
            "checksummed blocks its reads touch, each read once; unverified: 1.00x)"
        )

    def per_tensor_row(self, storage: str) -> None:
        """The small tensors' time per tensor on 2 ranks (the issue's fixed-cost target)."""
        count = self.config.small
        cells = []
        for case in ("small-save", "small-load"):
            seconds = self.seconds(storage, case, worker.SHARDWISE)
            if seconds is None or not count:
                return
            micro = seconds / count * 1e6
            verdict = self.verdict(
                f"{storage} {CASE_LABEL[case]} <= 20 us per tensor", micro <= 20, f"{micro:.1f} us"
            )
            cells.append(f"{case.split('-')[1]} {micro:.1f} us {verdict}")
        self.out(f"small tensors, time per tensor ({count:,} on 2 ranks): {', '.join(cells)}")

    def async_rows(self, storage: str) -> None:
        memcpy = self.get(storage, "async", "memcpy")
        sw_entry = self.get(storage, "async", worker.SHARDWISE)
        dcp_entry = self.get(storage, "async", self.default_dcp)
        if memcpy is None or sw_entry is None:
            return
        sw_blocked = sw_entry["seconds"]
        ok = sw_blocked <= 1.5 * memcpy["seconds"]
        verdict = self.verdict(
            f"{storage} async blocked <= 1.5x memcpy",
            ok,
            f"{sw_blocked / memcpy['seconds']:.2f}x memcpy",
        )
        dcp_text = _time(dcp_entry["seconds"]) if dcp_entry else "-"
        ratio = f"{dcp_entry['seconds'] / sw_blocked:.2f}x" if dcp_entry else "-"
        self.out(
            f"{'async blocked':<17}{_time(sw_blocked):>19}{dcp_text:>19}{'':>24}"
            f"{'memcpy ' + _time(memcpy['seconds']):>19}{ratio:>10}{'':>11}"
            f"{sw_blocked / memcpy['seconds']:>7.2f}m  {'<=1.5x memcpy':<26}{verdict}"
        )
        dcp_total = _time(dcp_entry.get("total")) if dcp_entry else "-"
        self.out(
            f"{'async total':<17}{_time(sw_entry.get('total')):>19}{dcp_total:>19}"
            "   (call to future done; informational)"
        )

    def memory_table(self) -> None:
        self.out("\n## Peak memory above the resident state dict (MiB, largest rank, median)")
        self.out(
            f"{'storage':<8}{'case':<17}{'shardwise':>10}"
            + "".join(f"{m:>9}" for m in self.dcps)
            + f"{'raw':>7}  {'target (shardwise)':<22}verdict"
        )
        staging = self.local_bytes / MIB
        for storage in self.config.storages:
            for case in [*BIG_CASES, *SMALL_CASES, "async"]:
                sw_entry = self.get(storage, case, worker.SHARDWISE)
                if sw_entry is None:
                    continue
                limit = 64 + (staging if case == "async" else 0)
                ok = sw_entry["mem"] <= limit
                verdict = self.verdict(
                    f"{storage} {CASE_LABEL[case]} memory <= {limit:.0f} MiB",
                    ok,
                    f"{sw_entry['mem']:.0f} MiB",
                )
                cells = []
                for method in self.dcps:
                    entry = self.get(storage, case, method)
                    cells.append("-" if entry is None else f"{entry['mem']:.0f}")
                raw = self.get(storage, case, worker.RAW)
                raw_text = "-" if raw is None else f"{raw['mem']:.0f}"
                staging_note = f" (64+{staging:.0f} staging)" if case == "async" else ""
                self.out(
                    f"{storage:<8}{CASE_LABEL[case]:<17}{sw_entry['mem']:>10.0f}"
                    + "".join(f"{cell:>9}" for cell in cells)
                    + f"{raw_text:>7}  "
                    f"{'<=' + f'{limit:.0f}' + staging_note:<22}{verdict}"
                )
            memcpy = self.get(storage, "async", "memcpy")
            if memcpy is not None:
                self.out(f"{storage:<8}{'(memcpy)':<17}{memcpy['mem']:>10.0f}")

    def summary(self) -> None:
        missed = [(name, detail) for name, ok, detail in self.verdicts if not ok]
        self.out(
            f"\n## Targets: {len(self.verdicts) - len(missed)} PASS, {len(missed)} MISS"
            " (speed targets against the best DCP thread_count)"
        )
        for name, ok, detail in self.verdicts:
            self.out(f"  {'PASS' if ok else 'MISS'}  {name}: {detail}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="big tensor size (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after 1 warm-up)")
    parser.add_argument("--small", type=int, default=10_000, help="number of small tensors")
    parser.add_argument("--dcp-threads", default="1,2,4", help="DCP thread_count values")
    parser.add_argument("--tmpfs-dir", default="/dev/shm", help="directory on tmpfs")
    parser.add_argument(
        "--disk-dir", default=tempfile.gettempdir(), help="directory on a real disk"
    )
    parser.add_argument(
        "--storages", default="tmpfs,disk", help="which of tmpfs,disk to run (comma separated)"
    )
    parser.add_argument(
        "--cases", default="big,small,async", help="which of big,small,async to run"
    )
    parser.add_argument("--checksum-mib", type=int, default=256, help="checksum buffer (MiB)")
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB, 3 reps, 1,000 small, DCP threads 1,4"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip checking loaded values")
    parser.add_argument("--json", help="also write the raw records and the tables here")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.reps, args.small, args.checksum_mib = 64, 3, 1000, 64
        args.dcp_threads = "1,4"
    return args


@contextlib.contextmanager
def _work_dirs(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    roots = {"tmpfs": args.tmpfs_dir, "disk": args.disk_dir}
    dirs = {}
    try:
        for name in args.storages.split(","):
            dirs[name] = tempfile.mkdtemp(prefix="shardwise-bench-", dir=roots[name])
        yield dirs
    finally:
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    """Run the benchmark and print the tables."""
    args = _parse()
    # On SIGTERM, unwind normally: the ranks are stopped and the work directories removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name, path in {"tmpfs": args.tmpfs_dir, "disk": args.disk_dir}.items():
        kind = _fs_type(path)
        if (name == "tmpfs") != (kind == "tmpfs"):
            print(f"warning: --{name}-dir {path} is on {kind}", file=sys.stderr)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    with _work_dirs(args) as dirs, tempfile.NamedTemporaryFile(suffix=".json") as results:
        config = worker.Config(
            size_mib=args.size_mib,
            reps=args.reps,
            small=args.small,
            storages=dirs,
            dcp_threads=[int(n) for n in args.dcp_threads.split(",")],
            results=results.name,
            port=free_port(),
            verify=not args.no_verify,
            cases=args.cases.split(","),
        )
        print(
            f"shardwise.checkpoint vs DCP (torch {torch.__version__}): {args.size_mib} MiB "
            f"float32, {args.small:,} small tensors, world size {worker.WORLD_SIZE} (gloo), "
            f"{args.reps} reps + 1 warm-up, {os.cpu_count()} CPUs",
            file=sys.stderr,
        )
        result = _run_world(config)
    world_seconds = time.perf_counter() - began
    checksums = checksum_throughput(args.checksum_mib * MIB, max(3, args.reps))

    report = Report(result, config)
    shape = "x".join(str(n) for n in result["shape"])
    report.out(
        f"# shardwise.checkpoint vs torch.distributed.checkpoint — torch {torch.__version__}, "
        f"world size {worker.WORLD_SIZE} (gloo, 1 thread/rank), {os.cpu_count()} CPUs"
    )
    report.out(
        f"big: float32 [{shape}] = {report.total_bytes / MIB:.0f} MiB row-sharded "
        f"(shardwise ShardedTensor / DCP DTensor Shard(0)); small: {args.small:,} tensors, "
        f"{report.small_bytes / MIB:.1f} MiB replicated; median of {args.reps} reps after a "
        f"warm-up; both sync_files=True (defaults). Ratios: DCP time / shardwise time "
        f"(>1 = shardwise faster); sw/raw: raw time / shardwise time. DCP loads read the "
        f"checkpoint its default writer wrote (FileSystemReader has no thread count). "
        f"{_source_state()}; 1-min load average {load_before:.1f} before the run, "
        f"{os.getloadavg()[0]:.1f} after it (the machine is shared)."
    )
    for storage in dirs:
        report.time_table(storage)
    report.memory_table()
    report.out(f"\n## Checksum throughput, one thread, {args.checksum_mib} MiB buffer (GiB/s)")
    for name, rate in sorted(checksums.items(), key=lambda item: -item[1]):
        report.out(f"  {name:<28}{rate:6.2f}")
    report.summary()
    report.out(f"\n(world run took {world_seconds:.0f} s)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {"result": result, "checksums": checksums, "lines": report.lines}, file, indent=1
            )


if __name__ == "__main__":
    main()
