"""Device and dtype moves of a ShardedTensor: ``cpu``, ``cuda`` and ``to`` (reference §16;
SPEC deviations 1 and 6), in real gloo groups. CUDA paths are marked and skip on CPU hosts."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from shardwise import ChunkShardingSpec, ShardedTensor
from tests.distributed.sharded_tensor.test_gather import _chunk_boxes, _sharded, _source
from tests.harness import distributed

ROW_RANKS = [0, 1, 2, 3]


def _rows(
    size: tuple[int, int] = (10, 4),
    ranks: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, ShardedTensor]:
    full = _source(size, dtype=dtype, seed=sum(size)).requires_grad_(requires_grad)
    return full, _sharded(full, _chunk_boxes(size, 0, ranks or ROW_RANKS))


def _assert_converted(new: ShardedTensor, old: ShardedTensor, dtype: torch.dtype) -> None:
    """``new`` is a separate ShardedTensor holding ``old``'s values as ``dtype``, same layout."""
    assert isinstance(new, ShardedTensor)
    assert new is not old
    assert new.dtype == dtype
    assert new.size() == old.size()
    assert new.metadata().tensor_properties.dtype == dtype
    assert new.metadata().shards_metadata == old.metadata().shards_metadata
    assert new.sharding_spec() == old.sharding_spec()
    assert len(new.local_shards()) == len(old.local_shards())
    for after, before in zip(new.local_shards(), old.local_shards(), strict=True):
        assert after.metadata == before.metadata
        assert after.tensor.dtype == dtype
        assert after.tensor.device == torch.device("cpu")
        assert torch.equal(after.tensor.detach(), before.tensor.detach().to(dtype))


# ---------------------------------------------------------------------------------------------
# cpu()
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_cpu_returns_self_when_everything_is_on_cpu() -> None:
    _, st = _rows()
    assert st.cpu() is st
    assert st.cpu(memory_format=torch.contiguous_format) is st
    assert st.cpu(process_group=dist.group.WORLD) is st
    message = "Only `torch.contiguous_format` or `torch.preserve_format` is supported!"
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        st.cpu(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------------------------
# to(): argument forms
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_to_returns_self_when_nothing_changes() -> None:
    _, st = _rows()
    assert st.to(torch.float32) is st
    assert st.to("cpu") is st
    assert st.to(torch.device("cpu")) is st
    assert st.to(torch.zeros(1)) is st
    assert st.to("cpu", torch.float32) is st
    assert st.to(None, torch.float32, False) is st
    assert st.to(dtype=torch.float32, device="cpu") is st
    assert st.to() is st
    # As upstream, a process group alone is no reason to copy.
    assert st.to(process_group=dist.group.WORLD) is st


@distributed(world_size=4)
def test_to_dtype_in_every_argument_form() -> None:
    _, st = _rows()
    forms = {
        "positional dtype": lambda: st.to(torch.float64),
        "tensor": lambda: st.to(torch.zeros(2, dtype=torch.float64)),
        "device and dtype": lambda: st.to("cpu", torch.float64),
        "torch.device and dtype": lambda: st.to(torch.device("cpu"), torch.float64),
        # SPEC 6: nn.Module.to's (device, dtype, non_blocking) form converts.
        "module form": lambda: st.to(None, torch.float64, False),
        "keywords": lambda: st.to(dtype=torch.float64),
        "keywords with device": lambda: st.to(device="cpu", dtype=torch.float64),
        "device positional, dtype keyword": lambda: st.to("cpu", dtype=torch.float64),
    }
    for name, convert in forms.items():
        new = convert()
        assert new.dtype == torch.float64, name
        _assert_converted(new, st, torch.float64)
    # The source is untouched.
    assert st.dtype == torch.float32
    assert st.metadata().tensor_properties.dtype == torch.float32
    assert all(shard.tensor.dtype == torch.float32 for shard in st.local_shards())


@distributed(world_size=4)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_to_other_dtypes(dtype: torch.dtype) -> None:
    _, st = _rows((6, 3), ranks=[1, 1, 3, 0])
    _assert_converted(st.to(dtype), st, dtype)


@distributed(world_size=4)
def test_to_copy_returns_a_new_object_with_new_memory() -> None:
    _, st = _rows()
    for copied in (st.to(copy=True), st.to("cpu", copy=True), st.to(torch.float32, copy=True)):
        _assert_converted(copied, st, torch.float32)
        for after, before in zip(copied.local_shards(), st.local_shards(), strict=True):
            assert after.tensor.data_ptr() != before.tensor.data_ptr()
        # The global metadata is a copy too: editing it leaves the source alone.
        copied.metadata().shards_metadata[0].shard_sizes[0] += 1
        assert st.metadata().shards_metadata[0].shard_sizes[0] == 3


@distributed(world_size=4)
def test_to_wrong_arguments() -> None:
    _, st = _rows()
    message = "ShardedTensor.to() have wrong arguments: ([1],)"
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        st.to([1])
    message = "ShardedTensor.to() have wrong arguments: (None,)"
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        st.to(None)


@distributed(world_size=4)
def test_to_another_process_group() -> None:
    gloo = dist.new_group(backend="gloo")
    _, st = _rows()
    new = st.to(torch.float64, process_group=gloo)
    _assert_converted(new, st, torch.float64)
    assert new._process_group is gloo
    assert st._process_group is dist.group.WORLD
    copied = st.to(device="cpu", copy=True, process_group=gloo)
    assert copied._process_group is gloo
    # The new tensor works on its group: gather through it.
    out = torch.empty(10, 4, dtype=torch.float64) if dist.get_rank() == 1 else None
    new.gather(1, out)
    if out is not None:
        assert torch.equal(out, _source((10, 4), seed=14).double())


# ---------------------------------------------------------------------------------------------
# to(): requires_grad, layouts
# ---------------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_to_keeps_requires_grad_like_tensor_to() -> None:
    _, st = _rows(requires_grad=True)
    assert st.requires_grad

    new = st.to(torch.float64)
    assert new.requires_grad
    assert new.metadata().tensor_properties.requires_grad
    # Like Tensor.to: the copy is tracked by autograd (not a leaf).
    assert new.local_tensor().requires_grad
    assert new.local_tensor().grad_fn is not None

    with torch.no_grad():
        untracked = st.to(torch.float64)
    assert not untracked.requires_grad
    assert not untracked.metadata().tensor_properties.requires_grad
    assert not untracked.local_tensor().requires_grad

    # Integer tensors cannot require grad.
    as_int = st.to(torch.int64)
    assert not as_int.requires_grad
    assert not as_int.local_tensor().requires_grad


@distributed(world_size=4)
@pytest.mark.parametrize(
    "ranks", [[0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 3], [2, 0]], ids=["even", "several", "partial"]
)
def test_to_layouts_including_empty_trailing_chunks(ranks: list[int]) -> None:
    # SPEC 1: 5 rows over 4 ranks has an empty chunk at offset 6; to() must still work.
    _, st = _rows((5, 3), ranks=ranks)
    new = st.to(torch.float64)
    _assert_converted(new, st, torch.float64)
    assert len(new.local_shards()) == ranks.count(dist.get_rank())
    if ranks == [0, 1, 2, 3]:
        assert new.metadata().shards_metadata[3].shard_offsets == [6, 0]
        assert new.sharding_spec() == ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ranks])


@distributed(world_size=4)
def test_to_updates_every_placement_device_string() -> None:
    _, st = _rows()
    new = st.to(torch.float64)
    assert [str(md.placement) for md in new.metadata().shards_metadata] == [
        f"rank:{r}/cpu" for r in ROW_RANKS
    ]
    assert new.metadata().shards_metadata[0] is not st.metadata().shards_metadata[0]
    assert new.metadata().size == st.metadata().size


# ---------------------------------------------------------------------------------------------
# CUDA (written for completeness; skipped on CPU-only hosts)
# ---------------------------------------------------------------------------------------------


@distributed(world_size=2)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moves_local_shards_to_the_current_device() -> None:  # pragma: no cover
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    current = torch.device("cuda", torch.cuda.current_device())
    _, st = _rows((6, 2), ranks=[0, 1])
    moved = st.cuda()
    assert moved is not st
    assert moved.local_tensor().device == current
    assert torch.equal(moved.local_tensor().cpu(), st.local_tensor())
    assert all(md.placement.device().type == "cuda" for md in moved.metadata().shards_metadata)
    assert isinstance(moved.sharding_spec(), ChunkShardingSpec)
    # cuda() of a tensor already there still makes a new object, sharing the local tensors.
    again = moved.cuda()
    assert again is not moved
    assert again.local_tensor() is moved.local_tensor()
    # Back to the CPU: a new object again.
    back = moved.cpu()
    assert back is not moved
    assert back.local_tensor().device == torch.device("cpu")
    message = 'Only device without device id (e.g. "cpu" or "cuda") is expected for ShardedTensor!'
    with pytest.raises(AssertionError, match=re.escape(message)):
        st.cuda(device="cuda")
    with pytest.raises(RuntimeError, match=re.escape("Only `torch.contiguous_format`")):
        st.cuda(memory_format=torch.channels_last)


@distributed(world_size=2)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_forms() -> None:  # pragma: no cover
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    current = torch.device("cuda", torch.cuda.current_device())
    _, st = _rows((6, 2), ranks=[0, 1])
    current_str = f"cuda:{current.index}"
    for moved in (
        st.to(current_str),
        st.to(current),
        st.to(device=current),
        st.to(current_str, torch.float16),
        st.to(torch.zeros(1, device=current)),
    ):
        assert moved is not st
        assert moved.local_tensor().device == current
        assert all(md.placement.device() == current for md in moved.metadata().shards_metadata)
    assert st.to(current).to(current) is not st
    on_gpu = st.to(current)
    assert on_gpu.to(current) is on_gpu
    assert on_gpu.to(dtype=torch.float32, device=current) is on_gpu
    assert on_gpu.to("cpu").local_tensor().device == torch.device("cpu")
