"""Index cost: bytes per chunk, and encode / decode-and-validate time per chunk.

Builds the index of N small tensors (one chunk each) and of one tensor of N chunks, in format
version 2 (what ``save`` writes) and in version 1 (the first release's one-object-per-chunk
JSON), and times :func:`shardwise.checkpoint.index.decode_index` — the whole of a reader's work
on the index: seal check, parse, and every validation of docs/format.md — median of 5.

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
    ObjectRecord,
    SaveFacts,
    TensorRecord,
    block_checksums,
    decode_index,
    encode_index,
)
from shardwise.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from shardwise.checkpoint.planner import SavedChunk
from shardwise.metadata import TensorProperties

_FILE = "data/rank-00000.0123456789abcdef.safetensors"
_SUM = block_checksums(b"x")


def _records(num_tensors: int, chunks_per_tensor: int) -> tuple[list[TensorRecord], dict[str, int]]:
    properties = TensorProperties(dtype=torch.float32)
    position = 64
    tensors = []
    for t in range(num_tensors):
        chunks = []
        for c in range(chunks_per_tensor):
            nbytes = 16 * 4
            chunks.append(SavedChunk((c, 0), (1, 16), _FILE, position, position + nbytes, _SUM))
            position += nbytes
        tensors.append(
            TensorRecord(
                f"model.layers.{t}.weight", properties, (chunks_per_tensor, 16), tuple(chunks)
            )
        )
    return tensors, {_FILE: position}


def _v1(tensors: list[TensorRecord]) -> bytes:
    entries = {}
    storage = {}
    for tensor in tensors:
        entries[tensor.fqn] = TensorStorageMetadata(
            tensor.properties,
            torch.Size(tensor.size),
            [ChunkStorageMetadata(c.offsets, c.sizes) for c in tensor.chunks],
        )
        for c in tensor.chunks:
            storage[MetadataIndex(tensor.fqn, c.offsets)] = {
                "file": c.file,
                "begin": c.begin,
                "end": c.end,
                "checksum": c.checksums,
            }
    metadata = Metadata(
        entries,
        planner_data={
            "writer": "bench",
            "torch": torch.__version__,
            "world_size": 1,
            "checksum_algorithm": "xxh3_64",
        },
        storage_data=storage,
        version="1",
    )
    return metadata.to_json().encode()


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
    print(
        f"{'case':<28}{'format':>8}{'index':>12}{'B/chunk':>10}{'encode':>10}{'decode':>10}"
        f"{'µs/chunk':>10}"
    )
    for label, shape in ((f"{n} tensors x 1 chunk", (n, 1)), (f"1 tensor x {n} chunks", (1, n))):
        tensors, files = _records(*shape)

        def encode(tensors: list[TensorRecord] = tensors, files: dict[str, int] = files) -> bytes:
            return encode_index(facts, files, tensors, objects)

        for version, make in (("2", encode), ("1", lambda tensors=tensors: _v1(tensors))):
            data = make()
            encode_ms = _median_ms(make)
            decode_ms = _median_ms(lambda data=data: decode_index(data))
            print(
                f"{label:<28}{version:>8}{len(data) / 1e6:>10.2f}MB{len(data) / n:>10.0f}"
                f"{encode_ms:>8.1f}ms{decode_ms:>8.1f}ms{decode_ms * 1000 / n:>10.2f}"
            )


if __name__ == "__main__":
    main()
