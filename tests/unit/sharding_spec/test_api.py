"""The spec base classes, DevicePlacementSpec and the package's import surface."""

from __future__ import annotations

import copy
import importlib
import pickle
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import shardwise.sharding_spec as sharding_spec
from shardwise.api import scatter
from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    PlacementSpec,
    ShardingSpec,
    check_tensor,
)

PARSE_ERROR = (
    "Could not parse remote_device: {}. The valid format is '<workername>/<device>' or "
    "'rank:<rank>/<device>' or '<device>'"
)


def test_all_is_sorted_and_importable() -> None:
    assert sharding_spec.__all__ == sorted(sharding_spec.__all__)
    for name in sharding_spec.__all__:
        assert getattr(sharding_spec, name) is not None


def test_upstream_import_paths() -> None:
    # Code migrating from torch.distributed._shard imports these from the same places.
    internals = importlib.import_module("shardwise.sharding_spec._internals")
    for name in (
        "check_tensor",
        "validate_non_overlapping_shards_metadata",
        "get_split_size",
        "get_chunked_dim_size",
        "get_chunk_sharding_params",
        "_check_shard_metadata_pair_overlap",
        "_find_1d_overlapping_shards",
        "_find_nd_overlapping_shards",
    ):
        assert callable(getattr(internals, name))
    assert callable(sharding_spec._infer_sharding_spec_from_shards_metadata)
    assert sharding_spec.ShardMetadata is ShardMetadata


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("rank:0/cpu", "rank:0/cpu"),
        ("rank:0", "rank:0/cpu"),
        ("worker0/cpu", "worker0/cpu"),
        ("cpu", "cpu"),
        ("cuda:0", "cuda:0"),
        ("rank:1/cuda:1", "rank:1/cuda:1"),
        (torch.device("cpu"), "cpu"),
        (torch.device("cuda", 1), "cuda:1"),
    ],
)
def test_device_placement_spec_converts(device: str | torch.device, expected: str) -> None:
    spec = DevicePlacementSpec(device)
    assert isinstance(spec.device, RemoteDevice)
    assert str(spec.device) == expected
    assert isinstance(spec, PlacementSpec)


def test_device_placement_spec_keeps_remote_device_object() -> None:
    device = RemoteDevice("rank:2/cpu")
    assert DevicePlacementSpec(device).device is device


def test_device_placement_spec_dataclass() -> None:
    spec = DevicePlacementSpec("rank:0/cpu")
    assert spec == DevicePlacementSpec(RemoteDevice("rank:0/cpu"))
    assert spec != DevicePlacementSpec("rank:1/cpu")
    assert repr(spec) == "DevicePlacementSpec(device=rank:0/cpu)"
    assert copy.deepcopy(spec) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize("device", ["cuda:foo", "foo:0", "rank:foo", "rank:-1/cpu", "a/b/c"])
def test_device_placement_spec_parse_errors(device: str) -> None:
    with pytest.raises(ValueError, match=re.escape(PARSE_ERROR.format(device))):
        DevicePlacementSpec(device)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("rank:0/cuda:foo", "Invalid device string: 'cuda:foo'"),
        ("rank:0/cpu2", "Invalid device string: 'cpu2'"),
        ("rank:0/foo", "Expected one of cpu, cuda"),
        ("worker0/", "Device string must not be empty"),
    ],
)
def test_device_placement_spec_device_errors(device: str, message: str) -> None:
    with pytest.raises(RuntimeError, match=re.escape(message)):
        DevicePlacementSpec(device)


def test_device_placement_spec_type_error() -> None:
    with pytest.raises(TypeError, match=re.escape("Invalid type for remote_device: <class 'int'>")):
        DevicePlacementSpec(3)  # type: ignore[arg-type]


def test_sharding_spec_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        ShardingSpec()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):

        class Incomplete(ShardingSpec):
            pass

        Incomplete()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract method shard"):

        class NoShard(ShardingSpec):
            def build_metadata(
                self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
            ) -> ShardedTensorMetadata:
                return ShardedTensorMetadata()

        NoShard()  # type: ignore[abstract]


@dataclass
class GridShardingSpec(ShardingSpec):
    """A user-defined spec, as upstream's tests write one: square cells of a 2-D tensor."""

    grid_size: int
    placements: list[RemoteDevice | str]

    def build_metadata(
        self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        rows, cols = (n // self.grid_size for n in tensor_sizes)
        shards = [
            ShardMetadata(
                [row * self.grid_size, col * self.grid_size],
                [self.grid_size, self.grid_size],
                self.placements[row * cols + col],
            )
            for row in range(rows)
            for col in range(cols)
        ]
        return ShardedTensorMetadata(shards, tensor_sizes, tensor_properties)

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group: Any = None) -> Any:
        # Delegate to the built-in scatter engine, as a user spec may.
        return scatter(tensor, self, src_rank=src_rank, process_group=process_group)


def test_user_defined_sharding_spec() -> None:
    spec = GridShardingSpec(4, [f"rank:{r}/cpu" for r in range(4)])
    metadata = spec.build_metadata(torch.Size([8, 8]), TensorProperties())
    check_tensor(metadata.shards_metadata, torch.Size([8, 8]))
    assert [s.shard_offsets for s in metadata.shards_metadata] == [[0, 0], [0, 4], [4, 0], [4, 4]]
    assert isinstance(spec, ShardingSpec)


def test_builtin_specs_are_sharding_specs() -> None:
    assert isinstance(ChunkShardingSpec(0, ["rank:0/cpu"]), ShardingSpec)
    assert isinstance(EnumerableShardingSpec([ShardMetadata([0], [2], "rank:0/cpu")]), ShardingSpec)
    assert not isinstance(DevicePlacementSpec("cpu"), ShardingSpec)
