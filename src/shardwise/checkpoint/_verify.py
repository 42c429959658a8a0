"""The first pass of every read of a checkpoint: read each checksummed block it touches and
check it, before a single byte is copied anywhere (:func:`verify`).

Blocks are read in *runs*: adjacent blocks (and gaps between them smaller than
``TUNING.read_gap_bytes``) read together, up to ``TUNING.read_run_bytes``. How a run is read
depends on where it is and what happens to its bytes next:

- **Local, not kept**: in cache-sized pieces (:data:`~._data_files.HOT_BYTES`) into one buffer
  per thread, reused run after run, each block hashed right after its piece is read, while it
  is in the cache. No memory is allocated or faulted in per run, and the memory of the pass
  is one such buffer per thread, however large the load (measured on 300 MiB from tmpfs:
  28 ms, against 49 ms reading each 8 MiB run into a new buffer).
- **Kept** for the second pass (on an object store, where reading again means requesting
  again; locally, a load whose blocks fit ``TUNING.keep_in_memory_bytes``), or on an object
  store at all: whole, as one request, into a new buffer made by the thread that reads it;
  kept once every block of it matched (:class:`~._kept.KeptBytes`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from shardwise.checkpoint._data_files import HOT_BYTES, DataFiles, Read, hot_buffer
from shardwise.checkpoint.index import Index
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.storage import batches, run_concurrently
from shardwise.checkpoint.tuning import TUNING
from shardwise.errors import ChecksumError

__all__ = ["Block", "chunk_blocks", "file_blocks", "section_blocks", "verify"]

_HEX = 16


@dataclass(slots=True, unsafe_hash=True)
class Block:
    """One checksummed block to read and check. Treated as immutable (and hashed by value);
    not frozen because a load builds one per block it verifies, and frozen construction
    costs four times as much."""

    file: str
    begin: int  # absolute, in the file
    end: int
    checksum: str
    key: str
    chunk: SavedChunk
    number: int


def chunk_blocks(block_size: int, key: str, chunk: SavedChunk, begin: int, end: int) -> list[Block]:
    """The blocks (of ``block_size``) of ``chunk`` that its bytes ``[begin, end)``
    (relative to the chunk) touch."""
    if end <= begin:
        return []
    sums, file, first, last = chunk.checksums, chunk.file, chunk.begin, chunk.end
    blocks = []
    for number in range(begin // block_size, (end - 1) // block_size + 1):
        start = first + number * block_size
        blocks.append(
            Block(
                file,
                start,
                min(start + block_size, last),
                sums[number * _HEX : (number + 1) * _HEX],
                key,
                chunk,
                number,
            )
        )
    return blocks


def file_blocks(index: Index, key: str, chunk: SavedChunk, begin: int, end: int) -> Iterator[Block]:
    """Version 4: the blocks of ``chunk.file``'s data section that its bytes ``[begin, end)``
    (absolute, in the file) touch; blocks are counted from the data section's start, and the
    last one ends at the file's end (:meth:`~shardwise.checkpoint.index.Index.blocks_of`)."""
    if end <= begin:
        return
    first, sums = index.blocks_of(chunk.file, begin, end)
    yield from _file_section(index, key, chunk, first, sums)


def touched_file_blocks(
    index: Index, reads: Iterable[tuple[str, SavedChunk, int, int]]
) -> list[Block]:
    """Version 4: the blocks that ``reads`` (``(key, chunk, begin, end)``, absolute bytes of
    ``chunk.file``) touch, each once, attributed to the last read that touches it (as
    :func:`file_blocks` of each read, deduplicated by :func:`verify`, would be). Many small
    tensors share a block: a block is made once, not once per read."""
    assert index.block_size is not None
    size = index.block_size
    latest: dict[tuple[str, int], tuple[str, SavedChunk]] = {}
    starts = index.data_starts
    for key, chunk, begin, end in reads:
        if end <= begin:
            continue
        file = chunk.file
        start = starts[file]
        for number in range((begin - start) // size, (end - 1 - start) // size + 1):
            latest[file, number] = (key, chunk)
    return [
        _section_block(index, key, chunk, number) for (_, number), (key, chunk) in latest.items()
    ]


def section_blocks(index: Index, name: str, key: str) -> Iterator[Block]:
    """Version 4: every block of data file ``name``'s data section, attributed to ``key`` (an
    empty section has one block of zero bytes)."""
    start = index.data_starts[name]
    sums = index.file_checksums[name]
    whole = SavedChunk((), (), name, start, index.files[name] or start, "")
    yield from _file_section(
        index, key, whole, start, [sums[i : i + _HEX] for i in range(0, len(sums), _HEX)]
    )


def _file_section(
    index: Index, key: str, chunk: SavedChunk, first: int, sums: Sequence[str]
) -> Iterator[Block]:
    """The blocks with checksums ``sums`` of ``chunk.file`` from its byte ``first``."""
    assert index.block_size is not None
    number = (first - index.data_starts[chunk.file]) // index.block_size
    for position, checksum in enumerate(sums):
        yield _section_block(index, key, chunk, number + position, checksum)


def _section_block(
    index: Index, key: str, chunk: SavedChunk, number: int, checksum: str | None = None
) -> Block:
    """Block ``number`` of ``chunk.file``'s data section (counted from its start; the last
    one ends at the file's end), attributed to ``key`` and ``chunk``; its checksum taken
    from the index unless given."""
    assert index.block_size is not None
    file = chunk.file
    begin = index.data_starts[file] + number * index.block_size
    if checksum is None:
        checksum = index.file_checksums[file][number * _HEX : (number + 1) * _HEX]
    end = min(begin + index.block_size, index.files[file] or 0)
    return Block(file, begin, end, checksum, key, chunk, number)


def verify(
    files: DataFiles,
    blocks: Iterable[Block],
    problems: list[ChecksumError] | None = None,
    progress: Callable[[int], object] | None = None,
    keep: bool | None = None,
) -> None:
    """Read and check every block of ``blocks`` (each once; adjacent ones in one run).

    Args:
        files: The data files.
        blocks: The blocks to check.
        problems: Collect mismatches here instead of raising the first.
        progress: Called with the bytes of the blocks checked, batch after batch.
        keep: Keep the verified bytes for the reads that follow, in ``files.kept``. Default:
            unless ``problems`` are collected (an audit, which reads nothing afterwards): on
            remote storage all of them (in memory, then a temporary file), on a local one all
            of them if they fit ``TUNING.keep_in_memory_bytes``, else none (locally, the
            bytes an earlier read kept are dropped first).

    Raises:
        ChecksumError: A block does not match its checksum (unless ``problems``).
        CheckpointDataError: A data file is missing, unsafe, or shorter than the index says.
    """
    runs = _runs(blocks)
    for run in runs:  # open every file first: a missing one fails before any read
        files.handle(run[0].file, run[0].key)
    remote = files.storage.remote
    if keep is None:
        if not remote:  # what an earlier read kept locally was for that read
            files.kept.close()
        keep = problems is None and (remote or sum(map(_span, runs)) <= files.kept.room)
    found: list[ChecksumError] = []
    hot = not keep and not remote
    run_bytes = TUNING.read_run_bytes
    # Where runs are read whole, a block larger than a run (a version-1 chunk, one block
    # however large) is read in pieces of a run, hashed in order.
    huge = [] if hot else [run[0] for run in runs if _span(run) > run_bytes]
    regular = runs if hot else [run for run in runs if _span(run) <= run_bytes]
    # Batches bound the buffers in flight of whole runs, and pace the progress reports; runs
    # read into the threads' own buffers need neither without progress, and go in one batch
    # (no thread waits at the end of each batch for the slowest run of the batch).
    limit = sys.maxsize if hot and progress is None else TUNING.read_batch_bytes
    for batch in batches(regular, _span, limit):
        checked = _check_hot(files, batch) if hot else _check_whole(files, batch, keep)
        for mismatches in checked:
            found.extend(mismatches)
        count = sum(block.end - block.begin for run in batch for block in run)
        _verified(files, count, found, problems)
        if progress is not None:
            progress(count)
    for block in huge:
        found.extend(_check_streamed(files, block, keep))
        _verified(files, block.end - block.begin, found, problems)
        if progress is not None:
            progress(block.end - block.begin)
    if problems is not None:
        problems.extend(found)


def _runs(blocks: Iterable[Block]) -> list[list[Block]]:
    """``blocks`` without repeats, in file order, grouped into runs read together."""
    unique = {(block.file, block.begin): block for block in blocks}
    gap, run_bytes = TUNING.read_gap_bytes, TUNING.read_run_bytes
    runs: list[list[Block]] = []
    run: list[Block] = []
    file, start, end = "", 0, 0  # of the current run: its file, first byte, last block's end
    for place in sorted(unique):  # file order
        block = unique[place]
        if (
            run
            and block.file == file
            and block.begin - end <= gap
            and block.end - start <= run_bytes
        ):
            run.append(block)
        else:
            run = [block]
            runs.append(run)
            file, start = block.file, block.begin
        end = block.end
    return runs


def _span(run: list[Block]) -> int:
    """The bytes of a run of blocks, gaps included."""
    return run[-1].end - run[0].begin


def _verified(
    files: DataFiles, count: int, found: list[ChecksumError], problems: list[ChecksumError] | None
) -> None:
    """Account ``count`` verified bytes; raise the first mismatch unless collecting."""
    with files.lock:
        files.bytes_verified += count
    if found and problems is None:
        raise found[0]


def _check_hot(files: DataFiles, runs: list[list[Block]]) -> list[list[ChecksumError]]:
    """The mismatches of each run, read in pieces into a reused buffer per thread."""

    def check(run: list[Block]) -> list[ChecksumError]:
        found: list[ChecksumError] = []
        piece: list[Block] = []
        for block in run:
            if piece and block.end - piece[0].begin > HOT_BYTES:
                found.extend(_check_piece(files, piece))
                piece = []
            if block.end - block.begin > HOT_BYTES:
                found.extend(_check_streamed(files, block, False))
            else:
                piece.append(block)
        if piece:
            found.extend(_check_piece(files, piece))
        return found

    return run_concurrently(runs, _span, check)


def _check_piece(files: DataFiles, piece: list[Block]) -> list[ChecksumError]:
    """Read the blocks of ``piece`` (at most :data:`HOT_BYTES` in all) into this thread's
    buffer and check them."""
    begin = piece[0].begin
    view = hot_buffer()[: _span(piece)]
    files.read_into(piece[0].file, begin, view, piece[0].key)
    return _check_run(files, piece, view)


def _check_run(files: DataFiles, run: list[Block], data: memoryview) -> list[ChecksumError]:
    """The mismatches of the blocks of ``run``, whose bytes are ``data``."""
    begin = run[0].begin
    found = []
    for block in run:
        digest = xxhash.xxh3_64_hexdigest(data[block.begin - begin : block.end - begin])
        if digest != block.checksum:
            found.append(_mismatch(files, block, digest))
    return found


def _check_whole(
    files: DataFiles, runs: list[list[Block]], keep: bool
) -> list[list[ChecksumError]]:
    """Read ``runs`` whole and return the mismatches of each; keep the runs that match, with
    ``keep``."""
    checked: list[list[ChecksumError]] = [[] for _ in runs]

    def check(number: int, data: memoryview) -> None:
        # On the thread that read the run, while its bytes are in the cache.
        run = runs[number]
        checked[number] = _check_run(files, run, data)
        if keep and not checked[number]:
            files.kept.keep(run[0].file, run[0].begin, data)

    # No buffers given: each run is read into a new one by the thread that reads it.
    files.read_all([Read(run[0].file, run[0].begin, _span(run), run[0].key) for run in runs], check)
    return checked


def _check_streamed(files: DataFiles, block: Block, keep: bool) -> list[ChecksumError]:
    """Check a block larger than a piece (or, read whole, than a run): read and hashed in
    order, in pieces; kept, with ``keep``, only once the whole block matched."""
    hasher = xxhash.xxh3_64()
    if not keep and not files.storage.remote:
        for start in range(block.begin, block.end, HOT_BYTES):
            view = hot_buffer()[: min(HOT_BYTES, block.end - start)]
            files.read_into(block.file, start, view, block.key)
            hasher.update(view)
        digest = hasher.hexdigest()
        return [] if digest == block.checksum else [_mismatch(files, block, digest)]
    run_bytes = TUNING.read_run_bytes
    starts = range(block.begin, block.end, run_bytes)
    kept: list[tuple[int, memoryview]] = []
    for batch in batches(
        starts, lambda start: min(run_bytes, block.end - start), TUNING.read_batch_bytes
    ):
        pieces = _read_pieces(files, block, batch)
        for piece in pieces:  # in order: one hash over the whole block
            hasher.update(piece)
        if keep:
            kept.extend(zip(batch, pieces, strict=True))
    digest = hasher.hexdigest()
    if digest != block.checksum:
        return [_mismatch(files, block, digest)]
    for start, piece in kept:  # only once the whole block matched
        files.kept.keep(block.file, start, piece)
    return []


def _read_pieces(files: DataFiles, block: Block, starts: Sequence[int]) -> list[memoryview]:
    """The pieces of ``block`` (of at most ``TUNING.read_run_bytes`` bytes) from ``starts``."""
    pieces = [memoryview(b"")] * len(starts)

    def got(number: int, data: memoryview) -> None:
        pieces[number] = data

    run_bytes = TUNING.read_run_bytes
    reads = [
        Read(block.file, start, min(run_bytes, block.end - start), block.key) for start in starts
    ]
    files.read_all(reads, got)
    return pieces


def _mismatch(files: DataFiles, block: Block, digest: str) -> ChecksumError:
    chunk = block.chunk
    blob = block.key in files.index.objects
    what = "a stored object" if blob else f"the chunk at offsets {list(chunk.offsets)}"
    if files.index.block_scope == "file":  # version 4: blocks of the file's data section
        if not block.key:
            what = "the data"
        what += f" in block {block.number} of the file (bytes {block.begin}-{block.end})"
        if block.key and not chunk.begin <= block.begin < block.end <= chunk.end:
            # The block is checked once, under the first entry it holds: a checksum cannot
            # tell which of its entries' bytes changed.
            what += ", which also holds bytes of other entries (the changed bytes may be theirs)"
    elif not blob or files.index.block_size is not None:
        what += f" in block {block.number} (bytes {block.begin}-{block.end})"
    return ChecksumError(
        f"checksum mismatch for {what}: expected {block.checksum}, got {digest} — the data "
        "file is corrupt",
        key=block.key,
        file=files.shown(block.file),
        rank=files.rank,
    )
