"""``loading.ranges_read``: the bytes a load would read, planned without reading (the local
tier fetches only these): whole blocks from the data section on, merged, covering every read,
and nothing of what the load does not read."""

from __future__ import annotations

import pathlib

import pytest
import torch

from shardwise import collectives
from shardwise.checkpoint import save
from shardwise.checkpoint.index import INDEX_NAME, decode_index
from shardwise.checkpoint.loading.load import load_from_storage, ranges_read, report_load
from shardwise.checkpoint.local_tier.parts import ReceivedParts
from shardwise.checkpoint.options import LoadOptions
from shardwise.errors import CheckpointDataError

MIB = 1 << 20


def test_the_ranges_are_the_whole_blocks_of_what_is_read(tmp_path: pathlib.Path) -> None:
    state = {
        "a": torch.arange(3 * MIB // 4, dtype=torch.float32),  # 3 MiB: three blocks
        "b": torch.arange(10, dtype=torch.float32),
        "note": "hello",
    }
    save(state, tmp_path / "ckpt")
    index = decode_index((tmp_path / "ckpt" / INDEX_NAME).read_bytes())
    (name,) = index.files
    start, size, block = index.data_starts[name], index.files[name], index.block_size
    assert block == MIB

    everything = ranges_read(dict(state), index, LoadOptions())
    assert everything == {name: [(start, size)]}  # every block, merged into one range

    # "b" alone: the blocks its bytes touch, nothing of the blocks only "a" holds.
    only_b = ranges_read({"b": torch.zeros(10)}, index, LoadOptions(strict=False))
    (b_chunk,) = index.tensors["b"].chunks
    ((begin, end),) = only_b[name]
    assert begin <= b_chunk.begin and b_chunk.end <= end
    assert (begin - start) % block == 0 and ((end - start) % block == 0 or end == size)
    assert end - begin <= 2 * block < size - start

    # A load of "b" from those bytes alone (the tier's storage of received pieces, which
    # refuses any byte it did not receive) succeeds: the ranges cover every read.
    data = (tmp_path / "ckpt" / name).read_bytes()
    restore = tmp_path / "restore"
    restore.mkdir()
    (restore / INDEX_NAME).write_bytes((tmp_path / "ckpt" / INDEX_NAME).read_bytes())
    pieces = [(b, memoryview(data[b:e])) for b, e in only_b[name]]
    storage = ReceivedParts(str(restore), index, {name: pieces})
    state_b = {"b": torch.zeros(10)}
    with pytest.warns(UserWarning, match="not in the state dict"):
        result, _ = load_from_storage(
            state_b, storage, str(restore), collectives.Comm(None), LoadOptions(strict=False)
        )
        report_load(collectives.Comm(None), str(restore), 0, 0.0, result, False, "it")
    assert torch.equal(state_b["b"], state["b"])
    with pytest.raises(CheckpointDataError, match="not received"):  # "a" was not
        load_from_storage(
            {"a": torch.zeros(3 * MIB // 4)},
            storage,
            str(restore),
            collectives.Comm(None),
            LoadOptions(strict=False),
        )
