"""Scale: today's save and load metadata path of a 1,024-rank FSDP job, simulated in one process.

What each of R ranks would send is built in this process (its ``_plan_entries``-style entries
for a GPT-like training state, every tensor sharded along dim 0 over all ranks, plus one
replicated ``step`` per parameter: see ``_scale/model.py``); then every metadata step of
``save`` and ``load`` runs on one core through the real shardwise functions, the collectives
replaced by what they amount to (``json.dumps`` once, ``json.loads`` of every rank's payload on
each receiver). See ``_scale/simulate.py`` for how the state is cut into slices of whole tensors
so that a thousand ranks' worth fits in memory.

Reported per rank count: the time of each step (and who runs it today: "every rank" means each
rank of the job repeats it over the whole job's metadata), the metadata bytes each rank sends
and receives, the index size, and each step's growth with the rank count (the exponent ``b`` of
``time ∝ R^b`` between the last two rank counts, at a fixed tensor count).

    python bench/scale.py                # 1,024 ranks x 10,000 sharded tensors (1-2 minutes)
    python bench/scale.py --sample 0     # the same, every step on all tensors (about 8 minutes)
    python bench/scale.py --quick        # 64 ranks x 1,000 (seconds)
    python bench/scale.py --ranks 256 --ladder 64,128 --layouts

By default the global steps run on 1,000 of the sharded tensors (``--sample``) and are scaled
to all of them: every step is a loop over tensors whose cost per tensor depends on the rank
count, not on the other tensors (``--sample 0`` at 1,024 ranks gave every step's time within
10 %, about the run-to-run spread on a shared machine, and the index size within 2 %).
``--layouts`` adds the figures of the path ``save`` takes today (``_scale/layouts.py``): planning
from tables of layouts and the version-4 index, through shardwise's own code (``save`` writes
version 4 above ``TUNING.layout_index_chunks`` chunks; the first table is the version-2 path of
earlier releases, which smaller saves still take).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from _scale import layouts
from _scale.model import Tensor, check_against_torch, gpt_state
from _scale.simulate import Result, index_memory, own_work, scaled, simulate
from shardwise._progress import human_bytes

# (step, who runs it today); indented steps are parts of the step above.
_SAVE = (
    ("own: _plan_entries", "each rank, own"),
    ("own: plan json.dumps", "each rank, own"),
    ("plan exchange: parse all", "every rank, all"),
    ("merge_tensor_plans", "every rank, all"),
    ("agree_aliases", "every rank, all"),
    ("assign_writers", "every rank, all"),
    ("own: layout_file", "each rank, own"),
    ("results exchange: parse all", "every rank, all"),
    ("_build_index", "every rank, all"),
    ("  encode_index", "(part of it)"),
    ("decode_index (self-check)", "coordinator, all"),
    ("index.to_metadata", "every rank, all"),
)
_LOAD = (
    ("index broadcast: encode (rank 0)", "rank 0, all"),
    ("index broadcast: parse (every rank)", "every rank, all"),
    ("decode_index", "every rank, all"),
    ("load plan: CheckpointReader.plan", "each rank"),
    ("  load plan: ChunkLookup builds", "(part of it)"),
    ("load plan: plan_reads, no lookup", "(instead)"),
    ("load: reader._extent (first open)", "every rank, all"),
)
_PARTS = {"  encode_index": "encode_index", "decode_index (self-check)": "decode_index"}
# Steps one rank of today's code does not run (another rank, a part, an alternative).
_NOT_A_RANKS = ("rank 0, all", "coordinator, all", "(part of it)", "(instead)")


def _name(step: str) -> str:
    return _PARTS.get(step, step.strip())


def _seconds(result: Result, step: str) -> float:
    return result.seconds.get(_name(step), math.nan)


def _total(result: Result, steps: Sequence[tuple[str, str]], coordinator: bool = False) -> float:
    """What one rank (the coordinator, with ``coordinator``) runs of ``steps``."""
    skip = tuple(who for who in _NOT_A_RANKS if not (coordinator and who == "coordinator, all"))
    return sum(_seconds(result, step) for step, who in steps if who not in skip)


def _growth(small: Result, large: Result, seconds_small: float, seconds_large: float) -> str:
    if not (seconds_small > 0 and seconds_large > 0) or small.ranks == large.ranks:
        return ""
    return f"{math.log(seconds_large / seconds_small) / math.log(large.ranks / small.ranks):.2f}"


def _time(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds >= 10:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    if seconds >= 0.001:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _table(results: Sequence[Result]) -> None:
    header = " | ".join(f"R={r.ranks}" for r in results)
    print(f"| step | who (today) | {header} | growth b |")
    print("|---|---|" + "---|" * len(results) + "---|")

    def row(label: str, values: list[float], who: str) -> None:
        cells = " | ".join(_time(v) for v in values)
        growth = _growth(results[-2], results[-1], *values[-2:]) if len(values) > 1 else ""
        print(f"| {label} | {who} | {cells} | {growth} |")

    for title, steps in (("save", _SAVE), ("load", _LOAD)):
        for step, who in steps:
            row(step.replace("  ", "↳ "), [_seconds(r, step) for r in results], who)
        row(f"**{title}: a rank's metadata work**", [_total(r, steps) for r in results], "")
        if title == "save":
            totals = [_total(r, steps, coordinator=True) for r in results]
            row("**save: the coordinator's**", totals, "")


def _sizes(results: Sequence[Result], memory: tuple[float, float, float]) -> None:
    """The bytes each rank sends, receives and holds; ``memory``: Python bytes per chunk of
    the decoded index (held, peak while decoding) and of ``to_metadata()``."""
    held, peak, metadata = memory
    header = " | ".join(f"R={r.ranks}" for r in results)
    print(f"| bytes | {header} |")
    print("|---|" + "---|" * len(results))
    rows = [
        ("chunks in the index", lambda r: f"{r.chunks:,}"),
        ("save: plan payload a rank sends (mean / max)", _payload("plan_bytes")),
        ("save: plan exchange, received per rank (R x max)", _received("plan_bytes")),
        ("save: parsed plans held per rank (Python objects)", _parsed),
        ("save: results payload a rank sends (mean / max)", _payload("result_bytes")),
        ("save: results exchange, received per rank (R x max)", _received("result_bytes")),
        ("index (shardwise.json)", lambda r: human_bytes(r.index_bytes)),
        ("index per chunk", lambda r: f"{r.index_bytes / max(r.chunks, 1):.0f} B"),
        ("load: index broadcast, received per rank", lambda r: human_bytes(r.broadcast_bytes)),
        (
            f"decoded index held per rank ({held:.0f} B/chunk; peak while decoding)",
            lambda r: (
                f"{human_bytes(round(held * r.chunks))} ({human_bytes(round(peak * r.chunks))})"
            ),
        ),
        (
            f"save's return value, index.to_metadata() ({metadata:.0f} B/chunk)",
            lambda r: human_bytes(round(metadata * r.chunks)),
        ),
        ("load: the measured rank's boxes / reads", _boxes),
    ]
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(r) for r in results) + " |")


def _payload(name: str) -> Callable[[Result], str]:
    def cell(result: Result) -> str:
        values = getattr(result, name)
        return f"{human_bytes(round(statistics.fmean(values)))} / {human_bytes(max(values))}"

    return cell


def _received(name: str) -> Callable[[Result], str]:
    def cell(result: Result) -> str:
        return human_bytes(result.ranks * max(getattr(result, name)))

    return cell


def _boxes(result: Result) -> str:
    return f"{result.load_boxes:,} / {result.load_reads:,}"


def _parsed(result: Result) -> str:
    return human_bytes(result.ranks * result.parsed_plan_bytes)


def _layouts(tensors: Sequence[Tensor], counts: Sequence[int], load_ranks: int) -> None:
    """The new path (format version 4, planning from layouts) through shardwise's code."""
    print(
        "The path save takes above TUNING.layout_index_chunks chunks: layouts, version-4 index "
        "(shardwise code):"
    )
    print()
    print("| new path | " + " | ".join(f"R={ranks}" for ranks in counts) + " |")
    print("|---|" + "---|" * len(counts))
    same = [layouts.measure(tensors, ranks, ranks, 1) for ranks in counts]
    other = [
        layouts.measure(tensors, ranks, load_ranks or max(1, ranks // 2), 1) for ranks in counts
    ]
    rows = [
        (
            "table a rank sends (JSON, once per distinct table)",
            [human_bytes(m.table_bytes) for m in same],
        ),
        (
            "assignment a rank receives (mean / max)",
            [f"{m.assignment_bytes[0]:.0f} B / {m.assignment_bytes[1]} B" for m in same],
        ),
        ("coordinator: plan_save", [_time(m.plan_seconds) for m in same]),
        ("index (version 4)", [human_bytes(m.index_bytes) for m in same]),
        ("coordinator: encode_v4 + seal", [_time(m.encode_seconds) for m in same]),
        ("decode_index, every check (every rank)", [_time(m.decode_seconds) for m in same]),
        ("index.to_metadata (lazy)", [_time(m.metadata_seconds) for m in same]),
        (
            "one rank's load plan, same layout (files / reads)",
            [f"{_time(m.load_seconds)} ({m.files_read} / {m.reads:,})" for m in same],
        ),
        (
            f"one rank's load plan, to {load_ranks or 'R/2'} ranks (files / reads)",
            [f"{_time(m.load_seconds)} ({m.files_read} / {m.reads:,})" for m in other],
        ),
    ]
    for label, cells in rows:
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=10_000, help="sharded tensors")
    parser.add_argument(
        "--ladder",
        default="64,256",
        help="smaller rank counts measured too, for the growth of each step",
    )
    parser.add_argument(
        "--load-ranks",
        type=int,
        default=0,
        help="ranks of the loading job (default: the saving job's): a resharded load",
    )
    parser.add_argument(
        "--slice-entries",
        type=int,
        default=600_000,
        help="rank entries held at once (memory: about 2.5 KiB each)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=1000,
        help="sharded tensors the global steps run on, scaled to --tensors (0: all of them)",
    )
    parser.add_argument("--no-steps", action="store_true", help="no replicated step tensors")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="also time the new path: layouts and the version-4 index (_scale/layouts.py)",
    )
    parser.add_argument("--quick", action="store_true", help="64 ranks x 1,000 tensors")
    parser.add_argument("--verbose", action="store_true", help="print each slice")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.tensors, args.ladder, args.sample = 64, 1000, "16,32", 0
    counts = sorted({int(n) for n in args.ladder.split(",") if n} | {args.ranks})
    tensors = gpt_state(args.tensors, steps=not args.no_steps)
    sharded = sum(not t.replicated for t in tensors)
    print(
        f"state: {sharded:,} tensors sharded on dim 0 over every rank and "
        f"{len(tensors) - sharded:,} replicated 0-d steps (GPT-2-medium shapes, "
        f"{human_bytes(sum(t.nbytes for t in tensors))}); one core, python "
        f"{sys.version.split()[0]}"
    )
    check_against_torch(tensors, args.ranks)
    sample = tensors
    if 0 < args.sample < sharded:
        sample = gpt_state(args.sample, steps=not args.no_steps)
        print(
            f"the global steps run on {len(sample):,} of the {len(tensors):,} tensors (the same "
            f"shapes, fewer blocks), their times and sizes scaled "
            f"x{len(tensors) / len(sample):.2f}; --sample 0 runs all"
        )

    def note(text: str) -> None:
        if args.verbose:
            print(f"  {text}", file=sys.stderr, flush=True)

    results = []
    for ranks in counts:
        load_ranks = args.load_ranks or ranks
        started = time.perf_counter()
        load_rank = min(1, load_ranks - 1)
        result = simulate(sample, ranks, load_ranks, load_rank, args.slice_entries, note)
        result = scaled(result, len(tensors) / len(sample))
        result.seconds.update(own_work(tensors, ranks, 1))
        results.append(result)
        print(
            f"R={ranks}: simulated in {time.perf_counter() - started:.0f} s "
            f"({result.slices} slices)",
            file=sys.stderr,
            flush=True,
        )
    # Memory per chunk of a decoded index: traced on a small state (tracemalloc is slow).
    small = simulate(gpt_state(150, steps=not args.no_steps), counts[-1], 1, 0, 10**9)
    memory = index_memory(small.last_index)
    print()
    _table(results)
    print()
    _sizes(results, memory)
    if args.layouts:
        print()
        _layouts(tensors, counts, args.load_ranks)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\npeak memory of this process: {human_bytes(peak)}")


if __name__ == "__main__":
    main()
