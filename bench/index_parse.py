"""Index cost: bytes per chunk, and encode / decode-and-validate time per chunk.

Builds the index of N small tensors (one ``whole`` layout each) and of one tensor of N chunks
(a ``chunks`` layout: a grid would be one row whatever N), and times
:func:`shardwise.checkpoint.index.decode_index` — the whole of a reader's work on the index:
seal check, parse, and every validation of docs/format.md — median of 5.

    python bench/index_parse.py [--tensors 10000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from shardwise.checkpoint.index import (
    BLOCK_SIZE,
    FileFacts,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    block_checksums,
    decode_index,
    encode_index,
    num_blocks,
)
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.metadata import TensorProperties

_FILE = "data/rank-00000.0123456789abcdef.safetensors"
_START = 64


def _records(
    num_tensors: int, chunks_per_tensor: int
) -> tuple[list[LayoutRecord], list[tuple[str, FileFacts] | None]]:
    properties = TensorProperties(dtype=torch.float32)
    position = _START
    tensors = []
    for t in range(num_tensors):
        chunks = []
        for c in range(chunks_per_tensor):
            nbytes = 16 * 4
            chunks.append(SavedChunk((c, 0), (1, 16), _FILE, position, position + nbytes))
            position += nbytes
        tensors.append(
            LayoutRecord(
                f"model.layers.{t}.weight", properties, (chunks_per_tensor, 16), tuple(chunks)
            )
        )
    sums = block_checksums(b"x") * num_blocks(position - _START, BLOCK_SIZE)
    return tensors, [(_FILE, FileFacts(position, _START, sums))]


def _median_ms(work: Callable[[], object]) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    args = parser.parse_args()
    n = args.tensors
    facts = SaveFacts("bench", torch.__version__, 1, "0123456789abcdef", None)
    objects = [ObjectRecord("step", "json", text="100")]
    print(f"block size {BLOCK_SIZE >> 20} MiB; median of 5 runs")
    print(f"{'case':<28}{'index':>12}{'B/chunk':>10}{'encode':>10}{'decode':>10}{'µs/chunk':>10}")
    for label, shape in ((f"{n} tensors x 1 chunk", (n, 1)), (f"1 tensor x {n} chunks", (1, n))):
        tensors, files = _records(*shape)

        def encode(
            tensors: list[LayoutRecord] = tensors,
            files: list[tuple[str, FileFacts] | None] = files,
        ) -> bytes:
            return encode_index(facts, files, tensors, objects)

        data = encode()
        encode_ms = _median_ms(encode)
        decode_ms = _median_ms(lambda data=data: decode_index(data))
        print(
            f"{label:<28}{len(data) / 1e6:>10.2f}MB{len(data) / n:>10.0f}"
            f"{encode_ms:>8.1f}ms{decode_ms:>8.1f}ms{decode_ms * 1000 / n:>10.2f}"
        )


if __name__ == "__main__":
    main()
