"""``Index.to_metadata``: the index as DCP-style ``Metadata`` whose entries and storage infos
are built on first lookup (a save of millions of chunks returns it on every rank), and which
reads, compares, mutates and pickles exactly like the dicts an eager build gives."""

from __future__ import annotations

import pickle

import pytest
import torch

from shardwise.checkpoint.index import (
    FileFacts,
    Index,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    decode_index,
    encode_index,
)
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from shardwise.metadata import TensorProperties

F0 = "data/rank-00000.0123456789abcdef.safetensors"
F1 = "data/rank-00001.0123456789abcdef.safetensors"
SUM = "0" * 16  # the one block of each file's data section, from byte 64
FILES = [(F0, FileFacts(1 << 20, 64, SUM)), (F1, FileFacts(1 << 20, 64, SUM))]
FACTS = SaveFacts("shardwise test", "2.13.0", 2, "0123456789abcdef", "/ckpt")
FLOAT = TensorProperties(dtype=torch.float32)


def _index() -> Index:
    """Two row chunks of ``w``, a whole ``b``, two keys with one dotted name (``{0: x,
    "0": y}``), a JSON object, a blob, and a tie."""
    tensors = [
        LayoutRecord(
            "w",
            FLOAT,
            (4, 2),
            (
                SavedChunk((0, 0), (2, 2), F0, 64, 80),
                SavedChunk((2, 0), (2, 2), F1, 64, 80),
            ),
        ),
        LayoutRecord("b", FLOAT, (3,), (SavedChunk((0,), (3,), F0, 80, 92),)),
        LayoutRecord("s.0", FLOAT, (), (SavedChunk((), (), F0, 92, 96),)),
        LayoutRecord("s.0\x001", FLOAT, (), (SavedChunk((), (), F0, 96, 100),)),
    ]
    objects = [
        ObjectRecord("step", "json", text="7"),
        ObjectRecord("rng", "bytes", blob=SavedChunk((), (), F1, 80, 100)),
    ]
    data = encode_index(FACTS, FILES, tensors, objects, aliases={"head": "w"})
    return decode_index(data)


def _eager(index: Index) -> tuple[dict[str, object], dict[MetadataIndex, object]]:
    """What the view must equal, written out for ``_index()``."""
    w = index.tensors["w"].chunks
    entries: dict[str, object] = {}
    storage: dict[MetadataIndex, object] = {}

    def info(chunk: SavedChunk) -> dict[str, object]:
        return {
            "file": chunk.file,
            "begin": chunk.begin,
            "end": chunk.end,
            "checksums": [SUM],
            "block_scope": "file",
            "blocks_begin": 64,
        }

    # The second key of one dotted name keeps its internal key.
    for name, key in [("w", "w"), ("b", "b"), ("s.0", "s.0"), ("s.0\x001", "s.0\x001")]:
        record = index.tensors[key]
        entries[name] = TensorStorageMetadata(
            FLOAT,
            torch.Size(record.size),
            [ChunkStorageMetadata(c.offsets, c.sizes) for c in record.chunks],
        )
        for position, chunk in enumerate(record.chunks):
            storage[MetadataIndex(name, chunk.offsets, position)] = info(chunk)
    entries["head"] = entries["w"]
    for position, chunk in enumerate(w):
        storage[MetadataIndex("head", chunk.offsets, position)] = info(chunk)
    entries["step"] = BytesStorageMetadata()
    entries["rng"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = {"encoding": "json", "text": "7"}
    blob = index.objects["rng"].blob
    assert blob is not None
    storage[MetadataIndex("rng")] = {"encoding": "bytes", **info(blob)}
    return entries, storage


def test_view_equals_the_eager_metadata() -> None:
    index = _index()
    metadata = index.to_metadata()
    entries, storage = _eager(index)
    assert dict(metadata.state_dict_metadata) == entries
    assert metadata.state_dict_metadata == entries and entries == metadata.state_dict_metadata
    assert dict(metadata.storage_data) == storage
    assert len(metadata.storage_data) == len(storage)
    assert metadata.planner_data == {
        "writer": "shardwise test",
        "torch": "2.13.0",
        "world_size": 2,
        "checksum_algorithm": "xxh3_64",
        "block_size": 1 << 20,
    }
    assert metadata.storage_meta == StorageMeta("/ckpt", "0123456789abcdef")
    assert metadata.version == "4"
    # Key order: tensors in save order, aliases, objects (as the eager build gave them).
    assert list(metadata.state_dict_metadata) == [
        "w",
        "b",
        "s.0",
        "s.0\x001",
        "head",
        "step",
        "rng",
    ]


def test_view_builds_only_what_is_looked_up() -> None:
    index = _index()
    metadata = index.to_metadata()
    entries, storage_data = metadata.state_dict_metadata, metadata.storage_data
    assert len(entries) == 7 and len(storage_data) == 9
    assert not entries._built and not storage_data._built  # type: ignore[attr-defined]
    w = entries["w"]
    assert entries["w"] is w  # kept once built
    assert list(entries._built) == ["w"]  # type: ignore[attr-defined]
    # A lookup without the position hint searches the tensor's chunks; a wrong hint too.
    assert storage_data[MetadataIndex("w", (2, 0))]["file"] == F1
    assert storage_data[MetadataIndex("w", (2, 0), 0)]["file"] == F1
    assert len(storage_data._built) == 1  # type: ignore[attr-defined]


def test_view_misses_raise_key_error() -> None:
    metadata = _index().to_metadata()
    for missing in [MetadataIndex("w", (1, 0)), MetadataIndex("nope"), MetadataIndex("w")]:
        with pytest.raises(KeyError):
            metadata.storage_data[missing]
        assert missing not in metadata.storage_data
    with pytest.raises(KeyError):
        metadata.state_dict_metadata["nope"]
    assert "nope" not in metadata.state_dict_metadata
    assert "w" in metadata.state_dict_metadata
    assert metadata.state_dict_metadata.get("nope") is None


def test_view_mutates_like_a_dict() -> None:
    index = _index()
    metadata = index.to_metadata()
    entries, storage = _eager(index)
    view = metadata.state_dict_metadata
    view["extra"] = BytesStorageMetadata()
    del view["b"]
    entries["extra"] = BytesStorageMetadata()
    del entries["b"]
    assert view == entries and list(view) == list(entries)
    assert "b" not in view and len(view) == len(entries)
    metadata.storage_data.pop(MetadataIndex("step"))
    del storage[MetadataIndex("step")]
    assert metadata.storage_data == storage
    # A built entry's chunk list is the one kept (planners append to it).
    entry = view["w"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.chunks.append(ChunkStorageMetadata((4, 0), (0, 2)))
    assert len(view["w"].chunks) == 3  # type: ignore[union-attr]


def test_view_pickles_serializes_and_converts_like_the_eager_metadata() -> None:
    index = _index()
    metadata = index.to_metadata()
    entries, storage = _eager(index)
    eager = Metadata(
        state_dict_metadata=entries,  # type: ignore[arg-type]
        planner_data=metadata.planner_data,
        storage_data=storage,
        storage_meta=metadata.storage_meta,
        version=metadata.version,
    )
    copied = pickle.loads(pickle.dumps(metadata))
    assert type(copied.state_dict_metadata) is dict and type(copied.storage_data) is dict
    assert copied == eager
    assert metadata.to_dict() == eager.to_dict()
    assert repr(metadata.state_dict_metadata) == repr(entries)
