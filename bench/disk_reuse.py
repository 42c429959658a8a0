"""Why saving to the same path is slower on some disks: new files against files overwritten.

Run ``python bench/disk_reuse.py [--dir DIR]``. No checkpoint code runs: 4 processes each
write 300 MiB with ``os.write`` and ``fsync``, three ways, each repeated:

* ``overwrite``: the same file each time, truncated and rewritten (what DCP's
  ``FileSystemWriter`` does when it saves to the same path again);
* ``new file``: a new file each time, the one before removed once the new one is durable
  (what an atomic commit does: the previous checkpoint stays whole until the new one is);
* ``new file, first``: the first repetitions of ``new file``, which land on blocks no file
  used recently.

On a thin-provisioned virtual disk mounted with ``discard`` (this project's machines), a
block the file system freed and discarded costs the host an allocation on its next write;
a truncated file's blocks are rewritten before that happens. The ratio is what a save pays
for not overwriting the previous checkpoint in place, on this disk, before any checkpoint
code runs (``docs/dcp.md``, *Benchmark*).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import time

WRITERS = 4
MIB = 1 << 20


def _write(path: str, mebibytes: int) -> None:
    block = os.urandom(MIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(mebibytes):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)


def _round(paths: list[str], mebibytes: int) -> float:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_write, args=(path, mebibytes)) for path in paths]
    start = time.perf_counter()
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"a writer failed (exit code {process.exitcode})")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.getcwd(), help="the disk directory (default: cwd)")
    parser.add_argument("--mib", type=int, default=300, help="MiB per writer (default 300)")
    parser.add_argument("--reps", type=int, default=4, help="repetitions (default 4)")
    args = parser.parse_args()
    root = os.path.join(os.path.abspath(args.dir), "disk-reuse-bench")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    try:
        same = [os.path.join(root, f"same-{n}") for n in range(WRITERS)]
        overwrite = [_round(same, args.mib) for _ in range(args.reps + 1)][1:]
        for path in same:
            os.remove(path)
        new: list[float] = []
        for repetition in range(args.reps + 2):
            paths = [os.path.join(root, f"new-{n}.{repetition}") for n in range(WRITERS)]
            new.append(_round(paths, args.mib))
            if repetition:
                for n in range(WRITERS):
                    os.remove(os.path.join(root, f"new-{n}.{repetition - 1}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first, later = new[:2], new[2:]
    print(f"{WRITERS} writers x {args.mib} MiB with fsync, in {root}; seconds per round")
    print(f"overwrite          {' '.join(f'{t:.2f}' for t in overwrite)}")
    print(f"new file, first    {' '.join(f'{t:.2f}' for t in first)}")
    print(f"new file           {' '.join(f'{t:.2f}' for t in later)}")
    overwritten, renewed = statistics.median(overwrite), statistics.median(new)
    print(
        f"median: overwrite {overwritten:.2f} s, new file {renewed:.2f} s "
        f"(overwrite / new file: {overwritten / renewed:.2f}x)"
    )


if __name__ == "__main__":
    main()
