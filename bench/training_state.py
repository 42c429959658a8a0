"""shardwise.checkpoint against torch.distributed.checkpoint (DCP) on a real training state.

Run ``python bench/training_state.py`` (``--quick`` for a smoke run of about two minutes; see
``--help``). The state is what torchtitan checkpoints: a GPT-like decoder of about 106M
parameters (vocab 32,000, d_model 768, 8 Llama-style blocks with SwiGLU width 2,048, no biases,
untied input embedding and output projection), each block and the root sharded with FSDP2
(``fully_shard``) over 4 gloo ranks on CPU, AdamW after two real steps, and
``{"model": ..., "optim": ...}`` from ``get_state_dict(model, optim)``: 300 tensors, 1.18 GiB
(parameters, ``exp_avg``, ``exp_avg_sq``; ``step`` scalars; the param groups as values).

Cases, every method interleaved in the same run (the order rotates every repetition), on tmpfs:

* save, and load back into the same state dict (same world);
* async save: the time until the call returns, next to a plain copy (``clone``) of every local
  tensor of the rank — the least staging can cost;
* many small: the same model shape with 222 thin blocks (d_model 64), 8,004 tensors, saved and
  loaded;
* 4 -> 2 resharded load: after the 4-rank world, a second launch of 2 ranks builds the model
  for 2 ranks with FSDP2, takes ``get_state_dict`` and loads what 4 ranks saved (load timed).

Each shardwise load (same world, many small, 4 -> 2) also runs with ``verify=False``, shown on
a line under its row: the same load without checking a block. The same-world load's verified
time must stay within 1.2x of it (the one verified pass reads each block once). Like every
other same-world load (raw, DCP, verified), the unverified one is the first read of files its
save just wrote (an untimed save before it): on tmpfs a second read of the same fresh pages is
10-20% faster, which once made the unverified load look faster than the raw limit.

"raw" is the limit: each rank writes its local bytes into one file with ``os.writev`` and
fsyncs it, and reads them back with ``os.preadv`` into the same tensors. DCP runs with
``FileSystemWriter``/``FileSystemReader`` defaults, shardwise with its defaults (both fsync).
Times are collective (barrier to barrier, slowest rank), the median of ``--reps`` repetitions
after one warm-up; the warm-up overwrites every value before each load and checks every loaded
value after it (and what each async save wrote), so a fast wrong load cannot pass. Peak memory
is the largest rank's resident high-water mark above its resident size before the operation.
``--profile`` then runs each shardwise operation (save, load, many-small save and load, 4 -> 2
load; ``--profile-dcp``: DCP's too) once to warm up and once per tool watching rank 0: timers
around shardwise's phases (inclusive wall time, no profiler overhead), cProfile (top functions by
cumulative and by own time) and a stack sampler (little overhead; biased towards calls that
release the GIL). ``--profile-only`` skips the timed repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from _launch import free_port, run_world, work_dir
from _training import worker
from _training.model import BIG, MANY_SMALL, QUICK_BIG, QUICK_SMALL
from checkpoint import _fs_type, _source_state

MIB = 1 << 20
# The bound on peak extra memory of a save or load (plus staging for async_save).
MEMORY_LIMIT_MIB = 64
GIB = 1 << 30
MAIN_WORLD = 4
RESHARD_WORLD = 2


def _run_world(config: worker.Config) -> dict[str, Any]:
    return run_world(worker.main, config, config.world_size)


# -- report -------------------------------------------------------------------------------------

# A verified load's time / the same load's with verify=False (issue 24).
VERIFY_COST = 1.2

# (label, case, the target for DCP time / shardwise time)
ROWS = [
    ("save", "save", 2.0),
    ("load", "load", 2.5),
    ("load 4->2 ranks", "reshard-load", 2.0),
    ("many-small save", "small-save", 10.0),
    ("many-small load", "small-load", 10.0),
]


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


class Report:
    """The tables, from the records of both worlds; every line also goes to ``lines``."""

    def __init__(self, records: list[dict[str, Any]], states: dict[str, Any]) -> None:
        self.states = states
        self.by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for record in records:
            if record["rep"] > 0:
                self.by_key[record["case"], record["method"]].append(record)
        self.lines: list[str] = []
        self.verdicts: list[tuple[str, bool, str]] = []

    def out(self, line: str = "") -> None:
        print(line)
        self.lines.append(line)

    def median(self, case: str, method: str, field: str = "seconds") -> float | None:
        items = self.by_key.get((case, method))
        if not items:
            return None
        if field == "total":
            return statistics.median(r["extra"]["total"] for r in items)
        return statistics.median(r[field] for r in items)

    def per_rep_ratios(self, case: str, over: str, under: str) -> list[float]:
        """``over`` time / ``under`` time of each repetition (both ran in it)."""
        top = {r["rep"]: r["seconds"] for r in self.by_key.get((case, over), [])}
        bottom = {r["rep"]: r["seconds"] for r in self.by_key.get((case, under), [])}
        return [top[rep] / bottom[rep] for rep in sorted(top) if rep in bottom]

    def spread(self, case: str, method: str) -> str:
        times = [r["seconds"] for r in self.by_key.get((case, method), [])]
        return f"{max(times) / min(times):.2f}" if times else "-"

    def verdict(self, name: str, ok: bool, detail: str) -> str:
        self.verdicts.append((name, ok, detail))
        return "PASS" if ok else "MISS"

    def memory_verdict(self, label: str, case: str, limit: float) -> str:
        """The verdict on shardwise's peak memory above the state in ``case``."""
        mem = self.median(case, worker.SHARDWISE, "mem_mib") or 0.0
        name = f"{label} peak memory <= {limit:.0f} MiB"
        return self.verdict(name, mem <= limit, f"{mem:.0f} MiB")

    def table(self, control: bool) -> None:
        header = (
            f"{'case':<17}{'shardwise':>10}{'DCP':>10}{'DCP/sw':>8}{'per rep':>12}"
            f"{'raw':>9}{'raw/sw':>8}{'DCP max/min':>12}{'sw MiB':>8}{'DCP MiB':>8}"
            f"  {'target':<16}verdict (speed/memory)"
        )
        self.out(header)
        self.out("-" * len(header))
        for label, case, goal in ROWS:
            sw_s = self.median(case, worker.SHARDWISE)
            dcp_s = self.median(case, worker.DCP)
            if sw_s is None or dcp_s is None:
                continue
            raw_s = self.median(case, worker.RAW)
            ratios = self.per_rep_ratios(case, worker.DCP, worker.SHARDWISE)
            ratio = dcp_s / sw_s
            verdict = self.verdict(f"{label} >= {goal:g}x DCP", ratio >= goal, f"{ratio:.2f}x")
            verdict += "/" + self.memory_verdict(label, case, MEMORY_LIMIT_MIB)
            self.out(
                f"{label:<17}{_time(sw_s):>10}{_time(dcp_s):>10}{ratio:>7.2f}x"
                f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>12}"
                f"{_time(raw_s):>9}{(f'{raw_s / sw_s:.0%}' if raw_s else '-'):>8}"
                f"{self.spread(case, worker.DCP):>12}"
                f"{self.median(case, worker.SHARDWISE, 'mem_mib') or 0:>8.0f}"
                f"{self.median(case, worker.DCP, 'mem_mib') or 0:>8.0f}"
                f"  {f'>={goal:g}x':<16}{verdict}"
            )
            if (unverified := self.median(case, worker.UNVERIFIED)) is not None:
                cost = sw_s / unverified
                check = (
                    self.verdict(
                        f"{label} verified <= {VERIFY_COST:g}x verify=False",
                        cost <= VERIFY_COST,
                        f"{cost:.2f}x",
                    )
                    if case == "load"
                    else "informational"
                )
                self.out(
                    f"{'  verify=False':<17}{_time(unverified):>10}{'':>10}"
                    f"{dcp_s / unverified:>7.2f}x{'':>12}{'':>9}"
                    f"{(f'{raw_s / unverified:.0%}' if raw_s else '-'):>8}"
                    f"   (verified = {cost:.2f}x this; target <= {VERIFY_COST:g}x: {check})"
                )
            if control and (ctl := self.median(case, worker.DCP_CONTROL)) is not None:
                ctl_ratios = self.per_rep_ratios(case, worker.DCP_CONTROL, worker.DCP)
                pooled = statistics.median(
                    r["seconds"]
                    for method in (worker.DCP, worker.DCP_CONTROL)
                    for r in self.by_key[case, method]
                )
                self.out(
                    f"{'  DCP vs DCP':<17}{'':>10}{_time(ctl):>10}{ctl / dcp_s:>7.2f}x"
                    f"{f'{min(ctl_ratios):.2f}-{max(ctl_ratios):.2f}':>12}"
                    f"   (the same DCP calls again: the noise of a ratio; both DCP runs "
                    f"pooled: {_time(pooled)}, {pooled / sw_s:.2f}x shardwise)"
                )
        self.async_rows()

    def async_rows(self) -> None:
        memcpy = self.median("async", worker.MEMCPY)
        sw_s = self.median("async", worker.SHARDWISE)
        dcp_s = self.median("async", worker.DCP)
        if memcpy is None or sw_s is None or dcp_s is None:
            return
        ratio = sw_s / memcpy
        verdict = self.verdict("async blocking <= 1.5x memcpy", ratio <= 1.5, f"{ratio:.2f}x")
        staging = self.states["big"]["local_bytes"] / MIB
        verdict += "/" + self.memory_verdict("async save", "async", MEMORY_LIMIT_MIB + staging)
        ratios = self.per_rep_ratios("async", worker.DCP, worker.SHARDWISE)
        self.out(
            f"{'async blocking':<17}{_time(sw_s):>10}{_time(dcp_s):>10}{dcp_s / sw_s:>7.2f}x"
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>12}"
            f"{'memcpy ' + _time(memcpy):>17}{self.spread('async', worker.DCP):>12}"
            f"{self.median('async', worker.SHARDWISE, 'mem_mib') or 0:>8.0f}"
            f"{self.median('async', worker.DCP, 'mem_mib') or 0:>8.0f}"
            f"  {'<=1.5x memcpy':<16}{verdict}"
        )
        self.out(
            f"{'':<17}shardwise blocking = {ratio:.2f}x memcpy, DCP blocking = "
            f"{dcp_s / memcpy:.2f}x memcpy (memcpy peak "
            f"{self.median('async', worker.MEMCPY, 'mem_mib') or 0:.0f} MiB)"
        )
        if (ctl := self.median("async", worker.DCP_CONTROL)) is not None:
            ctl_ratios = self.per_rep_ratios("async", worker.DCP_CONTROL, worker.DCP)
            self.out(
                f"{'  DCP vs DCP':<17}{'':>10}{_time(ctl):>10}{ctl / dcp_s:>7.2f}x"
                f"{f'{min(ctl_ratios):.2f}-{max(ctl_ratios):.2f}':>12}"
                "   (the same DCP calls again: the noise of a ratio)"
            )
        sw_total = self.median("async", worker.SHARDWISE, "total")
        dcp_total = self.median("async", worker.DCP, "total")
        self.out(
            f"{'async total':<17}{_time(sw_total):>10}{_time(dcp_total):>10}"
            "   (call to future done; informational)"
        )

    def per_tensor(self) -> None:
        """Time per tensor of the many-small cases (the fixed cost the issue bounds)."""
        count = self.states["small"]["tensors"]
        parts = []
        for case in ("small-save", "small-load"):
            for method in (worker.SHARDWISE, worker.DCP):
                seconds = self.median(case, method)
                if seconds is not None:
                    parts.append(f"{case} {method} {seconds / count * 1e6:.0f} us")
        if parts:
            self.out(f"per tensor ({count:,} tensors): " + ", ".join(parts))

    def summary(self) -> None:
        missed = sum(not ok for _, ok, _ in self.verdicts)
        self.out(f"\n## Targets: {len(self.verdicts) - missed} PASS, {missed} MISS")
        for name, ok, detail in self.verdicts:
            self.out(f"  {'PASS' if ok else 'MISS'}  {name}: {detail}")


def _describe_state(name: str, state: dict[str, Any], world: int) -> str:
    shape = state["shape"]
    params = (
        2 * shape["vocab"] * shape["dim"]
        + shape["layers"]
        * (4 * shape["dim"] ** 2 + 3 * shape["dim"] * shape["hidden"] + 2 * shape["dim"])
        + shape["dim"]
    )
    return (
        f"{name}: {params / 1e6:.1f}M params (vocab {shape['vocab']}, d_model {shape['dim']}, "
        f"{shape['layers']} layers, SwiGLU {shape['hidden']}, untied), "
        f"{state['tensors']:,} tensors, {state['global_bytes'] / GIB:.2f} GiB "
        f"({state['local_bytes'] / MIB:.0f} MiB per rank on {world} ranks)"
    )


# -- driver -------------------------------------------------------------------------------------


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after 1 warm-up)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a 7M-parameter model, 2,028 small tensors, 2 reps",
    )
    parser.add_argument("--tmpfs-dir", default="/dev/shm", help="directory on tmpfs")
    parser.add_argument(
        "--cases",
        default="big,async,small,reshard",
        help="which of big,async,small,reshard to run (comma separated)",
    )
    parser.add_argument(
        "--dcp-control",
        action="store_true",
        help="also run every DCP save and load a second time: DCP against itself",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the reps, profile shardwise's save, load and 4->2 load on rank 0",
    )
    parser.add_argument("--profile-dcp", action="store_true", help="profile DCP's as well")
    parser.add_argument(
        "--profile-only",
        action="store_true",
        help="only the profiles (implies --profile): no timed repetitions, no table",
    )
    parser.add_argument("--profile-top", type=int, default=25, help="functions per listing")
    parser.add_argument("--no-verify", action="store_true", help="skip checking loaded values")
    parser.add_argument("--json", help="also write the records, tables and profiles here")
    args = parser.parse_args()
    if args.quick:
        args.reps = min(args.reps, 2)
    if args.profile_only:
        args.profile = True
    return args


def main() -> None:
    """Run both worlds and print the table (and the profiles, if asked)."""
    args = _parse()
    # On SIGTERM, unwind normally: the ranks are stopped and the work directory removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if _fs_type(args.tmpfs_dir) != "tmpfs":
        print(f"warning: --tmpfs-dir {args.tmpfs_dir} is not on tmpfs", file=sys.stderr)
    cases = args.cases.split(",")
    profile = (["shardwise"] if args.profile else []) + (["dcp"] if args.profile_dcp else [])
    big, small = (QUICK_BIG, QUICK_SMALL) if args.quick else (BIG, MANY_SMALL)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(
        f"training state, shardwise vs DCP (torch {torch.__version__}): "
        f"{big.num_params() / 1e6:.0f}M params and {small.num_tensors():,} small tensors, "
        f"{MAIN_WORLD} ranks then "
        f"{RESHARD_WORLD} (gloo), {args.reps} reps + 1 warm-up, {os.cpu_count()} CPUs",
        file=sys.stderr,
    )
    with (
        work_dir(args.tmpfs_dir, "shardwise-bench-training-") as root,
        tempfile.NamedTemporaryFile(suffix=".json") as out,
    ):
        common = {
            "big": big,
            "small": small,
            "reps": args.reps,
            "root": root,
            "results": out.name,
            "verify": not args.no_verify,
            "dcp_control": args.dcp_control,
            "cases": cases,
            "profile": profile,
            "profile_top": args.profile_top,
            "profile_only": args.profile_only,
        }
        main_result = _run_world(
            worker.Config(phase="main", world_size=MAIN_WORLD, port=free_port(), **common)
        )
        reshard_result: dict[str, Any] = {"records": [], "checks": [], "profiles": {}}
        if "reshard" in cases:
            reshard_result = _run_world(
                worker.Config(phase="reshard", world_size=RESHARD_WORLD, port=free_port(), **common)
            )
    seconds = time.perf_counter() - began

    states = main_result["states"]
    report = Report(main_result["records"] + reshard_result["records"], states)
    report.out(
        f"# Training state: shardwise.checkpoint vs torch.distributed.checkpoint — torch "
        f"{torch.__version__}, FSDP2 on {MAIN_WORLD} gloo ranks (1 thread each), "
        f"{os.cpu_count()} CPUs, tmpfs {args.tmpfs_dir}"
    )
    report.out(_describe_state("big", states["big"], MAIN_WORLD))
    report.out(_describe_state("many-small", states["small"], MAIN_WORLD))
    report.out(
        f"Median of {args.reps} reps after a warm-up. DCP/sw: DCP time / shardwise time (>1 = "
        f"shardwise faster); per rep: that ratio's range over the reps; raw/sw: the raw limit's "
        f"time / shardwise time (shardwise's fraction of raw); DCP max/min: DCP's spread over "
        f"the reps; MiB: peak memory above the state, largest rank. {_source_state()}; 1-min "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (shared "
        f"machine)."
    )
    if not args.profile_only:
        report.out()
        report.table(args.dcp_control)
        report.per_tensor()
        checks = main_result["checks"] + reshard_result["checks"]
        if checks:
            report.out(f"values checked after: {'; '.join(checks)}")
        report.summary()
    report.out(f"\n(both worlds took {seconds:.0f} s)")
    profiles = {**main_result["profiles"], **reshard_result["profiles"]}
    for title, text in profiles.items():
        report.out(f"\n## Profile of {title} (rank 0)\n{text}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {
                    "main": main_result,
                    "reshard": reshard_result,
                    "lines": report.lines,
                },
                file,
                indent=1,
            )


if __name__ == "__main__":
    main()
