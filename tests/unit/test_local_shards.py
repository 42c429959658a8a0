"""Tests for :class:`LocalShardsWrapper` (reference §20, §20.1; error table rows 92-99).

Single process, no process group: the collectives it supports are exercised in
``tests/distributed/test_local_shards_dtensor.py``.
"""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.nn import functional

from shardwise.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from shardwise.local_shards import LocalShardsWrapper
from shardwise.metadata import TensorProperties

aten = torch.ops.aten


def _column_blocks() -> LocalShardsWrapper:
    """Two column blocks of the 2x4 matrix [[1, 2, 3, 4], [5, 6, 7, 8]]."""
    left = torch.tensor([[1.0, 2.0], [5.0, 6.0]])
    right = torch.tensor([[3.0, 4.0], [7.0, 8.0]])
    return LocalShardsWrapper([left, right], [(0, 0), (0, 2)])


def _row_blocks() -> LocalShardsWrapper:
    """Two row blocks of the vector [1, 2, 3, 4, 5, 6]."""
    return LocalShardsWrapper(
        [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])], [(0,), (3,)]
    )


@pytest.fixture
def default_float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _unsupported(op: str) -> str:
    return "^" + re.escape(f"{op} is not supported for LocalShardsWrapper!") + "$"


# -- construction and logical size ----------------------------------------------------------


def test_empty_wrapper() -> None:
    w = LocalShardsWrapper([], [])
    assert w.size() == torch.Size([0, 0])
    assert w.device == torch.device("meta")
    assert w.is_meta
    assert w.is_empty_shard()
    assert w.local_shards() == []
    assert w.local_sizes() == [torch.Size([0, 0])]
    assert w.local_offsets() == [torch.Size([0, 0])]
    assert w.storage_metadata() == TensorStorageMetadata(
        properties=TensorProperties(),
        size=torch.Size([0, 0]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([0, 0]))],
    )
    assert w._get_tensor_size_bytes() == 0


def test_empty_wrapper_properties_take_the_default_dtype_of_the_moment(
    default_float64: None,
) -> None:
    w = LocalShardsWrapper([], [])
    assert w.storage_metadata().properties.dtype == torch.float64
    assert w.dtype == torch.float64


def test_single_shard_size_is_the_shard_size() -> None:
    shard = torch.zeros(3, 4, 5)
    w = LocalShardsWrapper([shard], [(2, 0, 0)])
    assert w.size() == torch.Size([3, 4, 5])
    assert w.local_sizes() == [torch.Size([3, 4, 5])]
    assert w.local_offsets() == [torch.Size([2, 0, 0])]
    assert w.storage_metadata().size == torch.Size([3, 4, 5])
    assert not w.is_empty_shard()


def test_several_2d_shards_add_up_dim_1() -> None:
    w = LocalShardsWrapper(
        [torch.zeros(4, 2), torch.zeros(4, 3), torch.zeros(4, 1)], [(0, 0), (0, 2), (0, 5)]
    )
    assert w.size() == torch.Size([4, 6])
    assert w.storage_metadata().size == torch.Size([4, 6])
    assert w.local_sizes() == [torch.Size([4, 2]), torch.Size([4, 3]), torch.Size([4, 1])]


def test_several_1d_shards_add_up_dim_0() -> None:
    w = LocalShardsWrapper([torch.zeros(3), torch.zeros(5)], [(0,), (3,)])
    assert w.size() == torch.Size([8])


def test_several_3d_shards_report_the_first_shard_size() -> None:
    w = LocalShardsWrapper([torch.zeros(2, 3, 4), torch.zeros(5, 3, 4)], [(0, 0, 0), (2, 0, 0)])
    assert w.size() == torch.Size([2, 3, 4])


def test_keyword_construction() -> None:
    w = LocalShardsWrapper(local_shards=[torch.zeros(2, 3)], local_offsets=[(6, 0)])
    assert w.local_offsets() == [torch.Size([6, 0])]


def test_offsets_are_not_checked_against_the_size() -> None:
    w = LocalShardsWrapper([torch.zeros(2, 2)], [(100, 7)])
    assert w.local_offsets() == [torch.Size([100, 7])]


def test_extra_offsets_or_shards_are_dropped() -> None:
    w = LocalShardsWrapper([torch.zeros(2), torch.zeros(2)], [(2, 0)])
    assert w.local_offsets() == [torch.Size([2, 0])]
    assert w.local_sizes() == [torch.Size([2])]
    assert len(w.local_shards()) == 2
    w = LocalShardsWrapper([torch.zeros(2)], [(0,), (2,), (4,)])
    assert w.local_offsets() == [torch.Size([0])]


def test_shards_on_different_devices_raise_a_bare_assertion_error() -> None:
    with pytest.raises(AssertionError) as info:
        LocalShardsWrapper([torch.zeros(2), torch.zeros(2, device="meta")], [(0,), (2,)])
    assert str(info.value) == ""


def test_properties_come_from_the_first_shard() -> None:
    first = torch.zeros(2, 2, dtype=torch.int64)
    w = LocalShardsWrapper([first, torch.zeros(2, 2, dtype=torch.int64)], [(0, 0), (0, 2)])
    assert w.storage_metadata().properties == TensorProperties(dtype=torch.int64)
    grad = LocalShardsWrapper([torch.zeros(2, requires_grad=True)], [(0,)])
    assert grad.storage_metadata().properties.requires_grad


def test_wrapper_dtype_is_the_default_dtype_not_the_shards() -> None:
    w = LocalShardsWrapper([torch.zeros(2, dtype=torch.int64)], [(0,)])
    assert w.dtype == torch.get_default_dtype()
    assert w.local_shards()[0].dtype == torch.int64


def test_wrapper_dtype_follows_the_default_dtype(default_float64: None) -> None:
    assert LocalShardsWrapper([torch.zeros(2, dtype=torch.int8)], [(0,)]).dtype == torch.float64


def test_storage_metadata_uses_the_shared_classes() -> None:
    w = _column_blocks()
    meta = w.storage_metadata()
    assert type(meta) is TensorStorageMetadata
    assert type(meta.properties) is TensorProperties
    assert all(type(chunk) is ChunkStorageMetadata for chunk in meta.chunks)
    assert w.local_chunks is meta.chunks
    assert w.local_chunks == [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
        ChunkStorageMetadata(torch.Size([0, 2]), torch.Size([2, 2])),
    ]


def test_is_empty_shard_of_an_empty_1d_size_raises_index_error() -> None:
    w = LocalShardsWrapper([torch.zeros(0)], [(0,)])
    with pytest.raises(IndexError):
        w.is_empty_shard()


def test_device_and_meta() -> None:
    assert _column_blocks().device == torch.device("cpu")
    assert not _column_blocks().is_meta
    meta = LocalShardsWrapper([torch.empty(2, 2, device="meta")], [(0, 0)])
    assert meta.device == torch.device("meta")
    assert meta.is_meta


def test_is_pinned_reads_the_properties() -> None:
    w = _column_blocks()
    assert w.is_pinned() is False
    w.storage_metadata().properties.pin_memory = True
    assert w.is_pinned() is True


def test_requires_grad_sets_shards_and_properties() -> None:
    w = _column_blocks()
    assert w.requires_grad_() is w
    assert all(shard.requires_grad for shard in w.local_shards())
    assert w.storage_metadata().properties.requires_grad
    assert w.requires_grad_(False) is w
    assert not any(shard.requires_grad for shard in w.local_shards())
    assert not w.storage_metadata().properties.requires_grad


def test_tensor_size_bytes() -> None:
    w = LocalShardsWrapper(
        [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)],
        [(0, 0), (0, 3)],
    )
    assert w._get_tensor_size_bytes() == 8 * 8


def test_repr_and_str() -> None:
    w = _column_blocks()
    expected = f"LocalShardsWrapper:{w.local_shards()} {w.storage_metadata()}"
    assert repr(w) == expected
    assert str(w) == expected
    assert repr(LocalShardsWrapper([], [])).startswith(
        "LocalShardsWrapper:[] TensorStorageMetadata(properties=TensorProperties("
        "dtype=torch.float32"
    )
    assert "ChunkStorageMetadata(offsets=torch.Size([0, 2]), sizes=torch.Size([2, 2]))" in expected


def test_hash_is_identity() -> None:
    a, b = _column_blocks(), _column_blocks()
    assert hash(a) == id(a)
    assert len({a, b, a}) == 2


def test_pickle_and_deepcopy_keep_shards_and_offsets() -> None:
    w = _column_blocks()
    for copied in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w)):
        assert isinstance(copied, LocalShardsWrapper)
        assert copied.local_offsets() == w.local_offsets()
        assert all(
            torch.equal(a, b) for a, b in zip(copied.local_shards(), w.local_shards(), strict=True)
        )


# -- supported and unsupported ops -----------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "op"),
    [
        (lambda w: w + 1, "aten.add.Tensor"),
        (lambda w: w.sum(), "aten.sum.default"),
        (lambda w: torch.mul(w, w), "aten.mul.Tensor"),
        (lambda w: w.view(torch.int32), "aten.view.dtype"),
        (lambda w: w.t(), "aten.t.default"),
        (lambda w: w.zero_(), "aten.zero_.default"),
    ],
)
def test_unsupported_op_raises(call: Callable[[LocalShardsWrapper], object], op: str) -> None:
    w = LocalShardsWrapper([torch.zeros(2, 4)], [(0, 0)])
    with pytest.raises(NotImplementedError, match=_unsupported(op)):
        call(w)


def test_unsupported_op_called_directly() -> None:
    with pytest.raises(NotImplementedError, match=_unsupported("aten.add.Tensor")):
        aten.add.Tensor(_column_blocks(), 1)


def test_to_copy_converts_every_shard_and_keeps_offsets() -> None:
    w = _column_blocks()
    converted = w.to(torch.float64)
    assert isinstance(converted, LocalShardsWrapper)
    assert converted is not w
    assert [s.dtype for s in converted.local_shards()] == [torch.float64, torch.float64]
    assert converted.local_offsets() == w.local_offsets()
    assert converted.storage_metadata().properties.dtype == torch.float64
    assert all(
        torch.equal(a, b.double())
        for a, b in zip(converted.local_shards(), w.local_shards(), strict=True)
    )


def test_to_the_dtype_the_wrapper_claims_returns_the_wrapper_itself() -> None:
    # The wrapper claims the default dtype, so torch's `to` sees nothing to do (upstream quirk).
    w = LocalShardsWrapper([torch.zeros(2, dtype=torch.float64)], [(0,)])
    assert w.to(torch.float32) is w
    assert w.local_shards()[0].dtype == torch.float64


def test_to_copy_called_directly() -> None:
    w = _row_blocks()
    converted = aten._to_copy.default(w, dtype=torch.int32)
    assert [s.dtype for s in converted.local_shards()] == [torch.int32, torch.int32]
    assert converted.local_offsets() == [torch.Size([0]), torch.Size([3])]


def test_view_of_a_single_shard_views_the_shard() -> None:
    shard = torch.arange(6.0).view(2, 3)
    w = LocalShardsWrapper([shard], [(4, 0)])
    viewed = w.view(3, 2)
    assert isinstance(viewed, LocalShardsWrapper)
    assert viewed.size() == torch.Size([3, 2])
    assert viewed.local_offsets() == [torch.Size([4, 0])]
    assert viewed.local_shards()[0].data_ptr() == shard.data_ptr()
    assert torch.equal(viewed.local_shards()[0], shard.view(3, 2))


def test_view_of_several_2d_shards_needs_the_wrapper_shape() -> None:
    w = _column_blocks()
    viewed = w.view(2, 4)
    assert viewed.local_sizes() == w.local_sizes()
    assert viewed.local_offsets() == w.local_offsets()
    assert w.view_as(w).size() == torch.Size([2, 4])
    with pytest.raises(AssertionError) as info:
        w.view(4, 2)
    assert str(info.value) == ""
    with pytest.raises(AssertionError):
        w.view(8)


def test_view_of_several_1d_shards_needs_the_wrapper_length() -> None:
    w = _row_blocks()
    assert w.view(6).local_sizes() == [torch.Size([3]), torch.Size([3])]
    with pytest.raises(AssertionError):
        w.view(3, 2)


def test_view_of_several_3d_shards_is_not_supported() -> None:
    w = LocalShardsWrapper([torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)], [(0, 0, 0), (1, 0, 0)])
    with pytest.raises(NotImplementedError, match=r"^No support for view on tensors ndim > 2$"):
        w.view(1, 2, 2)


def test_equal_compares_shards_and_offsets() -> None:
    assert torch.equal(_column_blocks(), _column_blocks())
    other_values = _column_blocks()
    other_values.local_shards()[1][0, 0] = 99.0
    assert not torch.equal(_column_blocks(), other_values)
    shards = _column_blocks().local_shards()
    moved = LocalShardsWrapper(shards, [(0, 0), (0, 3)])
    assert not torch.equal(_column_blocks(), moved)
    fewer = LocalShardsWrapper(shards[:1], [(0, 0)])
    assert not torch.equal(_column_blocks(), fewer)
    assert aten.equal.default(_row_blocks(), _row_blocks()) is True


def test_equal_with_a_plain_tensor_is_false() -> None:
    w = LocalShardsWrapper([torch.ones(2)], [(0,)])
    assert not torch.equal(w, torch.ones(2))


def test_detach_replaces_the_shards_in_place() -> None:
    w = LocalShardsWrapper([torch.ones(2, requires_grad=True)], [(0,)])
    original = w.local_shards()[0]
    assert w.storage_metadata().properties.requires_grad
    detached = w.detach()
    assert detached is w
    assert w.local_shards()[0] is not original
    assert not w.local_shards()[0].requires_grad
    assert w.local_shards()[0].data_ptr() == original.data_ptr()
    assert not w.storage_metadata().properties.requires_grad


def test_clone_copies_the_shards() -> None:
    w = _column_blocks()
    for cloned in (w.clone(), w.clone(memory_format=torch.preserve_format)):
        assert isinstance(cloned, LocalShardsWrapper)
        assert cloned is not w
        assert torch.equal(cloned, w)
        assert all(
            a.data_ptr() != b.data_ptr()
            for a, b in zip(cloned.local_shards(), w.local_shards(), strict=True)
        )


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_clone_with_another_memory_format_raises(memory_format: torch.memory_format) -> None:
    w = LocalShardsWrapper([torch.zeros(1, 2, 2, 2)], [(0, 0, 0, 0)])
    with pytest.raises(NotImplementedError, match=_unsupported(str(memory_format))):
        w.clone(memory_format=memory_format)


def test_new_empty_mirrors_the_shards_whatever_the_size() -> None:
    w = LocalShardsWrapper(
        [torch.zeros(2, 3, dtype=torch.int16), torch.zeros(2, 1, dtype=torch.int16)],
        [(0, 0), (0, 3)],
    )
    empty = w.new_empty((7,))
    assert isinstance(empty, LocalShardsWrapper)
    assert empty.local_sizes() == w.local_sizes()
    assert empty.local_offsets() == w.local_offsets()
    assert [s.dtype for s in empty.local_shards()] == [torch.int16, torch.int16]


# -- padding (§20.1) -------------------------------------------------------------------------


def _pad(w: LocalShardsWrapper, pad: list[int], value: float) -> LocalShardsWrapper:
    result = aten.constant_pad_nd.default(w, pad, value)
    assert isinstance(result, LocalShardsWrapper)
    return result


def test_padding_an_empty_wrapper_is_not_supported() -> None:
    with pytest.raises(
        NotImplementedError, match=r"^Padding empty LocalShardsWrapper is not supported\.$"
    ):
        _pad(LocalShardsWrapper([], []), [1, 2, 3, 4], 5.0)


@pytest.mark.parametrize(
    ("shard", "pad"),
    [
        (torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [1, 2, 3, 4]),
        (torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [0, 1]),
        (torch.tensor([1.0, 2.0, 3.0]), [2, 1]),
        (torch.arange(24.0).view(2, 3, 4), [1, 1, 1, 1, 1, 1]),
    ],
)
def test_single_shard_pads_like_f_pad(shard: torch.Tensor, pad: list[int]) -> None:
    w = LocalShardsWrapper([shard], [tuple([3] * shard.ndim)])
    result = _pad(w, pad, -1.0)
    expected = functional.pad(shard, pad, mode="constant", value=-1.0)
    assert len(result.local_shards()) == 1
    assert torch.equal(result.local_shards()[0], expected)
    assert result.local_offsets() == w.local_offsets()
    assert result.size() == expected.size()


def test_f_pad_reaches_the_wrapper() -> None:
    result = functional.pad(_column_blocks(), [1, 1], value=0.0)
    assert isinstance(result, LocalShardsWrapper)
    assert result.size() == torch.Size([2, 6])


def test_2d_top_padding_pads_every_shard() -> None:
    w = _column_blocks()
    result = _pad(w, [0, 0, 2, 0], 0.0)
    for padded, original in zip(result.local_shards(), w.local_shards(), strict=True):
        assert padded.shape == (4, 2)
        assert torch.equal(padded[:2], torch.zeros(2, 2))
        assert torch.equal(padded[2:], original)
    assert result.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 2])]


def test_2d_bottom_padding_pads_every_shard() -> None:
    w = _column_blocks()
    result = _pad(w, [0, 0, 0, 1], -1.0)
    for padded, original in zip(result.local_shards(), w.local_shards(), strict=True):
        assert torch.equal(padded[:2], original)
        assert torch.equal(padded[2:], torch.full((1, 2), -1.0))


def test_2d_left_padding_pads_the_first_shard_only() -> None:
    w = _column_blocks()
    result = _pad(w, [3, 0, 0, 0], 2.0)
    first, second = result.local_shards()
    assert first.shape == (2, 5)
    assert torch.equal(first[:, :3], torch.full((2, 3), 2.0))
    assert torch.equal(first[:, 3:], w.local_shards()[0])
    assert torch.equal(second, w.local_shards()[1])
    assert result.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 5])]


def test_2d_right_padding_pads_the_last_shard_only() -> None:
    w = _column_blocks()
    expected_second = torch.tensor([[3.0, 4.0, 3.0, 3.0], [7.0, 8.0, 3.0, 3.0]])
    for pad in ([0, 2, 0, 0], [0, 2]):  # a 2-element spec pads the last dim
        first, second = _pad(w, pad, 3.0).local_shards()
        assert torch.equal(first, w.local_shards()[0])
        assert torch.equal(second, expected_second)


def test_2d_mixed_padding() -> None:
    first, second = _pad(_column_blocks(), [1, 2, 1, 1], 0.0).local_shards()
    assert torch.equal(
        first, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 5.0, 6.0], [0.0, 0.0, 0.0]])
    )
    assert torch.equal(
        second,
        torch.tensor(
            [[0.0, 0.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0], [7.0, 8.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
        ),
    )


def test_2d_padding_offsets_and_storage_metadata() -> None:
    result = _pad(_column_blocks(), [1, 1, 0, 0], 0.0)
    assert result.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 3])]
    meta = result.storage_metadata()
    assert meta.size == torch.Size([2, 6])
    assert meta.chunks == [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([0, 3]), torch.Size([2, 3])),
    ]
    assert _pad(_column_blocks(), [1, 2, 3, 4], 0.0).size() == torch.Size([9, 7])


def test_1d_top_padding_pads_the_first_shard_only() -> None:
    first, second = _pad(_row_blocks(), [2, 0], 0.0).local_shards()
    assert torch.equal(first, torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0]))
    assert torch.equal(second, torch.tensor([4.0, 5.0, 6.0]))


def test_1d_bottom_padding_pads_the_last_shard_only() -> None:
    first, second = _pad(_row_blocks(), [0, 1], -1.0).local_shards()
    assert torch.equal(first, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(second, torch.tensor([4.0, 5.0, 6.0, -1.0]))


def test_1d_mixed_padding_offsets_and_storage_metadata() -> None:
    w = LocalShardsWrapper([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [(0,), (2,)])
    assert w.storage_metadata().size == torch.Size([4])
    result = _pad(w, [1, 2], 5.0)
    first, second = result.local_shards()
    assert torch.equal(first, torch.tensor([5.0, 1.0, 2.0]))
    assert torch.equal(second, torch.tensor([3.0, 4.0, 5.0, 5.0]))
    assert result.local_offsets() == [torch.Size([0]), torch.Size([3])]
    assert result.storage_metadata().size == torch.Size([7])
    assert result.local_sizes() == [torch.Size([3]), torch.Size([4])]


def test_padding_keeps_the_properties() -> None:
    w = LocalShardsWrapper(
        [torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)], [(0,), (2,)]
    )
    w.storage_metadata().properties.pin_memory = True  # as if the shards had been pinned
    result = _pad(w, [1, 1], 7)
    assert result.storage_metadata().properties == w.storage_metadata().properties
    assert result.storage_metadata().properties is not w.storage_metadata().properties
    assert torch.equal(result.local_shards()[0], torch.tensor([7, 1, 1]))


@pytest.mark.parametrize("pad", [[1, 2, 3], [1], [1, 2, 3, 4, 5, 6]])
def test_2d_padding_spec_must_have_4_elements(pad: list[int]) -> None:
    message = f"^Padding spec must be of length 4 for 2D tensors, got {len(pad)}$"
    with pytest.raises(ValueError, match=message):
        _pad(_column_blocks(), pad, 5.0)


@pytest.mark.parametrize("pad", [[1], [1, 2, 3, 4]])
def test_1d_padding_spec_must_have_2_elements(pad: list[int]) -> None:
    w = LocalShardsWrapper([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [(2, 0)])
    message = f"^Padding spec must be of length 2 for 1D tensors, got {len(pad)}$"
    with pytest.raises(ValueError, match=message):
        _pad(w, pad, 5.0)


def test_padding_several_3d_shards_is_not_supported() -> None:
    shard = torch.rand(2, 3, 4)
    w = LocalShardsWrapper([shard, shard], [(0, 0, 0), (2, 0, 0)])
    message = (
        "^Padding for 3D tensors is not supported. Only 1D and 2D tensors are currently supported.$"
    )
    with pytest.raises(NotImplementedError, match=message):
        _pad(w, [1, 1, 1, 1, 1, 1], 0.0)


# -- DCP checkpoint protocol -------------------------------------------------------------------


def test_create_write_items_returns_dcp_types() -> None:
    w = LocalShardsWrapper(
        [torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16)],
        [(4, 0), (4, 2)],
    )
    items = w.__create_write_items__("emb", w)
    properties = dcp_metadata.TensorProperties(dtype=torch.bfloat16)
    assert items == [
        WriteItem(
            index=dcp_metadata.MetadataIndex("emb", [4, 0]),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=dcp_metadata.ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([2, 2])),
                properties=properties,
                size=torch.Size([2, 5]),
            ),
        ),
        WriteItem(
            index=dcp_metadata.MetadataIndex("emb", [4, 2]),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=dcp_metadata.ChunkStorageMetadata(torch.Size([4, 2]), torch.Size([2, 3])),
                properties=properties,
                size=torch.Size([2, 5]),
            ),
        ),
    ]
    assert all(type(item.tensor_data.properties) is dcp_metadata.TensorProperties for item in items)  # type: ignore[union-attr]


def test_create_write_items_takes_the_size_of_the_object() -> None:
    w = _row_blocks()
    items = w.__create_write_items__("x", torch.zeros(10))
    assert [item.tensor_data.size for item in items] == [torch.Size([10])] * 2  # type: ignore[union-attr]


def test_empty_wrapper_writes_nothing() -> None:
    w = LocalShardsWrapper([], [])
    assert w.__create_write_items__("x", w) == []
    assert w.__create_chunk_list__() == [
        dcp_metadata.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 0]))
    ]


def test_create_chunk_list_returns_dcp_chunks() -> None:
    chunks = _column_blocks().__create_chunk_list__()
    assert chunks == [
        dcp_metadata.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
        dcp_metadata.ChunkStorageMetadata(torch.Size([0, 2]), torch.Size([2, 2])),
    ]
    assert all(type(chunk) is dcp_metadata.ChunkStorageMetadata for chunk in chunks)


def test_get_tensor_shard_by_offset_and_hint() -> None:
    w = _column_blocks()
    first, second = w.local_shards()
    index = dcp_metadata.MetadataIndex
    assert w.__get_tensor_shard__(index("x", [0, 2])) is second
    assert w.__get_tensor_shard__(index("x", [0, 2], index=1)) is second  # good hint
    assert w.__get_tensor_shard__(index("x", [0, 2], index=0)) is second  # wrong hint
    assert w.__get_tensor_shard__(index("x", [0, 2], index=9)) is second  # broken hint
    assert w.__get_tensor_shard__(index("x", [0, 0])) is first


def test_get_tensor_shard_miss_raises() -> None:
    w = _column_blocks()
    index = dcp_metadata.MetadataIndex
    message = "^" + re.escape("Could not find shard at 'torch.Size([1, 1])' for FQN: 'emb'") + "$"
    with pytest.raises(ValueError, match=message):
        w.__get_tensor_shard__(index("emb", [1, 1]))
    with pytest.raises(
        ValueError, match=re.escape("Could not find shard at 'None' for FQN: 'emb'")
    ):
        w.__get_tensor_shard__(index("emb"))


def test_get_tensor_shard_of_an_empty_wrapper() -> None:
    found = LocalShardsWrapper([], []).__get_tensor_shard__(dcp_metadata.MetadataIndex("x", [3]))
    assert found.shape == torch.Size([0])


def test_dcp_finds_shards_through_the_protocol() -> None:
    w = _column_blocks()
    found = find_state_dict_object({"w": w}, dcp_metadata.MetadataIndex("w", [0, 2]))
    assert found is w.local_shards()[1]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_save_and_load_in_one_process(tmp_path: Path) -> None:
    # Without a process group DCP runs in-process: save two column blocks of a 3x6 matrix,
    # load into three other column blocks.
    full = torch.arange(18.0).view(3, 6)
    saved = LocalShardsWrapper([full[:, :2].clone(), full[:, 2:].clone()], [(0, 0), (0, 2)])
    dcp.save({"m": saved}, checkpoint_id=tmp_path, no_dist=True)
    targets = [torch.zeros(3, 1), torch.zeros(3, 4), torch.zeros(3, 1)]
    loaded = LocalShardsWrapper(targets, [(0, 0), (0, 1), (0, 5)])
    dcp.load({"m": loaded}, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(torch.cat(targets, dim=1), full)
