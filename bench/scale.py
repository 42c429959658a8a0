"""Scale: the save and load metadata path of a 1,024-rank FSDP job, in one process.

The state is a GPT-like training state (``_scale/model.py``): every tensor sharded along dim 0
over all ranks, plus one replicated ``step`` per parameter. Every rank's table of layouts is
the same (FSDP); the coordinator plans from it (``planning.save_plan.plan_save``), the index is
encoded, decoded with every check and viewed as ``Metadata``, and one rank of the loading job
plans its reads from the layouts, through shardwise's own code (``_scale/layouts.py``).

Reported per rank count: the table a rank sends, the assignment it receives, the
coordinator's planning, the index size, its encoding and decoding, the lazy ``Metadata`` view,
and one rank's load planning, for a load by the same ranks and by another number.

    python bench/scale.py                # 1,024 ranks x 10,000 sharded tensors
    python bench/scale.py --quick        # 64 ranks x 1,000 (seconds)
    python bench/scale.py --ranks 256 --ladder 64,128 --load-ranks 100
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
from collections.abc import Sequence

from _scale import layouts
from _scale.model import Tensor, check_against_torch, gpt_state
from shardwise._progress import human_bytes


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


def _layouts(tensors: Sequence[Tensor], counts: Sequence[int], load_ranks: int) -> None:
    """Planning from layouts and the index, through shardwise's code."""
    print("| step | " + " | ".join(f"R={ranks}" for ranks in counts) + " |")
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
        ("index", [human_bytes(m.index_bytes) for m in same]),
        ("coordinator: encode_index + seal", [_time(m.encode_seconds) for m in same]),
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
        "--ladder", default="64,256", help="smaller rank counts measured too, for the growth"
    )
    parser.add_argument(
        "--load-ranks",
        type=int,
        default=0,
        help="ranks of the loading job (default: half the saving job's): a resharded load",
    )
    parser.add_argument("--no-steps", action="store_true", help="no replicated step tensors")
    parser.add_argument("--quick", action="store_true", help="64 ranks x 1,000 tensors")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.tensors, args.ladder = 64, 1000, "16,32"
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
    print()
    _layouts(tensors, counts, args.load_ranks)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\npeak memory of this process: {human_bytes(peak)}")


if __name__ == "__main__":
    main()
