"""The built-in ShardedTensor ops of upstream (reference §12, §13): tensor-like properties,
``type_as``, ``__deepcopy__``, ``clone``, ``detach``, ``copy_``, ``requires_grad_``,
``_has_compatible_shallow_copy_type``, the ``*_like`` creators (SPEC deviation 5), the
``nn.init`` initializers and the collective ``torch.equal`` / ``torch.allclose`` (SPEC
deviation 3: they work on CPU-only hosts).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.ops import registry
from tests.distributed.ops import assert_close, chunk_spec, from_full, grid_spec, seeded_full
from tests.harness import distributed

SAME_GROUP = "All distributed tensors should use the same ProcessGroup if used together in an op."


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# -- properties ---------------------------------------------------------------------------------


@distributed(world_size=4)
def test_properties_come_from_the_global_metadata() -> None:
    rank = dist.get_rank()
    st = sw.empty(chunk_spec(0), 10, 6, dtype=torch.float64)
    assert st.shape == torch.Size([10, 6])
    assert st.size() == torch.Size([10, 6])
    assert (st.size(0), st.size(1), st.size(-1), st.size(-2)) == (10, 6, 6, 10)
    assert (st.dim(), st.ndim, st.ndimension()) == (2, 2, 2)
    assert (st.numel(), st.nelement(), st.element_size()) == (60, 60, 8)
    assert st.dtype == torch.float64
    assert st.layout == torch.strided
    assert st.requires_grad is False
    assert st.grad is None
    assert st.grad_fn is None
    assert st.is_leaf is True
    assert st.is_contiguous() is True
    assert st.contiguous() is st
    assert st.is_floating_point() is True
    assert st.is_complex() is False
    assert st.device == torch.device("cpu")
    assert st.is_meta is False
    assert st.local_tensor().shape == (3 if rank < 3 else 1, 6)
    for dim in (2, -3):
        with pytest.raises(IndexError, match="Dimension out of range"):
            st.size(dim)

    flt = sw.zeros(chunk_spec(1), 4, 8, requires_grad=True)
    assert flt.requires_grad is True
    assert flt.is_leaf is True
    assert flt.is_floating_point() is True
    assert sw.zeros(chunk_spec(0), 4, dtype=torch.int32).is_floating_point() is False
    assert sw.zeros(chunk_spec(0), 4, dtype=torch.complex64).is_complex() is True


@distributed(world_size=4)
def test_device_and_is_meta_without_exactly_one_local_shard() -> None:
    rank = dist.get_rank()
    # Ranks 0 and 3 own nothing; ranks 1 and 2 own one chunk each.
    partial = sw.zeros(chunk_spec(0, [1, 2]), 4, 2)
    assert partial.device == torch.device("cpu")  # gloo group, no local shard: cpu
    if rank in (0, 3):
        with pytest.raises(
            NotImplementedError,
            match=_exactly("Only single local shard is supported. Number of shards: 0"),
        ):
            assert partial.is_meta
    else:
        assert partial.is_meta is False
    # Two local shards on every rank.
    double = sw.zeros(chunk_spec(0, [0, 1, 2, 3, 0, 1, 2, 3]), 8, 2)
    assert double.device == torch.device("cpu")
    with pytest.raises(
        NotImplementedError,
        match=_exactly("Only single local shard is supported. Number of shards: 2"),
    ):
        assert double.is_meta


# -- type_as ---------------------------------------------------------------------------------


@distributed(world_size=4)
def test_type_as_same_dtype_returns_the_same_object() -> None:
    st = sw.rand(chunk_spec(0), 8, 3)
    assert st.type_as(torch.ones(1)) is st
    assert st.type_as(sw.zeros(chunk_spec(1), 2, 8)) is st


@distributed(world_size=4)
def test_type_as_converts_every_local_shard() -> None:
    group = dist.new_group(list(range(4)))
    full = seeded_full((16, 3))
    st = from_full(full, chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), process_group=group)
    converted = st.type_as(torch.ones(1, dtype=torch.float64))
    assert isinstance(converted, sw.ShardedTensor)
    assert converted is not st
    assert converted.dtype == torch.float64
    assert converted.metadata().tensor_properties.dtype == torch.float64
    assert converted.metadata() is not st.metadata()
    assert converted.metadata().shards_metadata == st.metadata().shards_metadata
    assert converted.sharding_spec() is st.sharding_spec()
    assert converted._process_group is group
    assert len(converted.local_shards()) == 2
    for new, old in zip(converted.local_shards(), st.local_shards(), strict=True):
        assert new.metadata == old.metadata
        assert_close(new.tensor, old.tensor.double(), exact=True)
    # The source is untouched.
    assert st.dtype == torch.float32
    assert st.metadata().tensor_properties.dtype == torch.float32
    assert all(shard.tensor.dtype == torch.float32 for shard in st.local_shards())

    # A ShardedTensor target contributes its (only) local tensor's dtype.
    target = sw.zeros(chunk_spec(0), 4, 4, dtype=torch.int16)
    as_int = from_full(full, chunk_spec(0)).type_as(target)
    assert as_int.dtype == torch.int16
    assert_close(as_int.local_tensor(), from_full(full, chunk_spec(0)).local_tensor().short())


@distributed(world_size=4)
def test_type_as_and_clone_of_a_tensor_that_requires_grad() -> None:
    # Like the shards' own type_as/clone: recorded by autograd, except under no_grad or for an
    # integer result (where torch gives tensors that do not require grad).
    st = sw.rand(chunk_spec(0, [1, 2]), 8, 2, requires_grad=True)  # ranks 0, 3 own nothing
    double = torch.ones(1, dtype=torch.float64)
    for result in (st.type_as(double), st.clone()):
        assert result.requires_grad is True
        assert result.metadata().tensor_properties.requires_grad is True
        assert all(shard.tensor.grad_fn is not None for shard in result.local_shards())
    with torch.no_grad():
        results = [st.type_as(double), st.clone()]
    results.append(st.type_as(torch.ones(1, dtype=torch.int64)))
    for result in results:
        assert result.requires_grad is False
        assert result.metadata().tensor_properties.requires_grad is False
        assert not any(shard.tensor.requires_grad for shard in result.local_shards())
    assert results[-1].dtype == torch.int64


@distributed(world_size=4)
def test_type_as_argument_checks() -> None:
    st = sw.rand(chunk_spec(0), 8, 3)
    handler = registry._SHARDED_OPS[torch.Tensor.type_as]
    with pytest.raises(ValueError, match=_exactly("Needs to give a tensor to cast type as!")):
        handler((), (st,), None, st._process_group)
    with pytest.raises(
        ValueError, match=_exactly("Needs to give a Tensor or ShardedTensor to cast type as!")
    ):
        handler((), (st, "float64"), None, st._process_group)
    # Through the public API PyTorch's own argument parsing answers first.
    with pytest.raises(TypeError, match="must be Tensor, not str"):
        st.type_as("float64")  # type: ignore[arg-type]


# -- deepcopy, clone, detach ------------------------------------------------------------------


def _check_independent_copy(copied: Any, st: Any, group: Any) -> None:
    assert type(copied) is type(st)
    assert copied is not st
    assert copied.sharding_spec() is st.sharding_spec()
    assert copied._process_group is group
    assert copied._init_rrefs is st._init_rrefs
    assert copied.metadata() == st.metadata()
    assert copied.metadata() is not st.metadata()
    assert copied.requires_grad == st.requires_grad
    assert len(copied.local_shards()) == len(st.local_shards())
    for new, old in zip(copied.local_shards(), st.local_shards(), strict=True):
        assert new.metadata == old.metadata
        assert new.metadata is not old.metadata
        assert_close(new.tensor, old.tensor, exact=True)
        assert new.tensor.data_ptr() != old.tensor.data_ptr()
        new.tensor.detach().add_(1)  # the copy owns its data
        assert not torch.equal(new.tensor, old.tensor)


@distributed(world_size=4)
def test_deepcopy_copies_data_and_metadata_but_shares_spec_and_group() -> None:
    group = dist.new_group(list(range(4)))
    layouts = [
        (chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), (16, 3)),
        (grid_spec(8, 6), (8, 6)),
        (chunk_spec(1, [1, 2]), (8, 6)),  # ranks 0 and 3 own nothing
    ]
    for spec, size in layouts:
        st = sw.rand(spec, size, requires_grad=True, process_group=group)
        copied = copy.deepcopy(st)
        _check_independent_copy(copied, st, group)
        assert all(shard.tensor.is_leaf for shard in copied.local_shards())


@distributed(world_size=4)
def test_clone() -> None:
    group = dist.new_group(list(range(4)))
    st = sw.rand(chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), 16, 3, process_group=group)
    _check_independent_copy(st.clone(), st, group)
    _check_independent_copy(st.clone(memory_format=torch.preserve_format), st, group)

    for memory_format in (torch.contiguous_format, torch.channels_last):
        with pytest.raises(
            RuntimeError, match=_exactly("Only support torch.preserve_format for ShardedTensor!")
        ):
            st.clone(memory_format=memory_format)

    # Cloning a tensor that requires grad is recorded by autograd, shard by shard.
    leaf = sw.rand(chunk_spec(0), 8, 2, requires_grad=True)
    cloned = leaf.clone()
    assert cloned.requires_grad is True
    (cloned.local_tensor() * 3).sum().backward()
    assert_close(leaf.local_tensor().grad, torch.full((2, 2), 3.0), exact=True)


@distributed(world_size=4)
def test_detach() -> None:
    st = sw.rand(chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), 16, 3, requires_grad=True)
    assert st.requires_grad is True
    assert all(shard.tensor.requires_grad for shard in st.local_shards())
    detached = st.detach()
    assert isinstance(detached, sw.ShardedTensor)
    assert detached is not st
    assert detached.requires_grad is False
    assert detached.metadata().tensor_properties.requires_grad is False
    assert detached.sharding_spec() is st.sharding_spec()
    assert detached._process_group is st._process_group
    for new, old in zip(detached.local_shards(), st.local_shards(), strict=True):
        assert new.tensor.requires_grad is False
        assert new.tensor.data_ptr() == old.tensor.data_ptr()  # a view, as Tensor.detach
        assert new.metadata == old.metadata
    # The source keeps requiring grad.
    assert st.requires_grad is True
    assert st.metadata().tensor_properties.requires_grad is True
    assert all(shard.tensor.requires_grad for shard in st.local_shards())


# -- copy_ ---------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_copy_copies_in_place_and_returns_self() -> None:
    dest = sw.ones(chunk_spec(0), 8, 4)
    src = sw.rand(chunk_spec(0), 8, 4)
    assert not torch.equal(dest, src)
    before = dest.local_tensor().data_ptr()
    assert dest.copy_(src) is dest
    assert torch.equal(dest, src)
    assert dest.local_tensor().data_ptr() == before

    # requires_grad is not compared, only the local shards' metadata (upstream test).
    with_grad = sw.rand(chunk_spec(0), 8, 4, requires_grad=True)
    with torch.no_grad():
        assert with_grad.copy_(sw.ones(chunk_spec(0), 8, 4)) is with_grad
    assert_close(with_grad.local_tensor(), torch.ones_like(with_grad.local_tensor()), exact=True)
    assert with_grad.requires_grad is True

    # non_blocking is accepted (and meaningless on the CPU).
    assert dest.copy_(sw.zeros(chunk_spec(0), 8, 4), non_blocking=True) is dest
    assert_close(dest.local_tensor(), torch.zeros_like(dest.local_tensor()), exact=True)


@distributed(world_size=4)
def test_copy_with_different_metadata_copies_nothing() -> None:
    rank = dist.get_rank()
    message = _exactly("inplace copy can only happen between two ShardedTensor with same metadata!")
    dest = sw.ones(chunk_spec(0), 8, 8)
    with pytest.raises(RuntimeError, match=message):
        dest.copy_(sw.zeros(chunk_spec(1), 8, 8))
    assert_close(dest.local_tensor(), torch.ones(2, 8), exact=True)

    # Two local shards per rank: rows [2r, 2r+2) and [8+2r, 8+2r+2). The source's first local
    # shard has the same metadata, its second does not: the check covers every pair before the
    # first copy, so the matching first shard is left alone too.
    dest = sw.ones(chunk_spec(0, [0, 1, 2, 3, 0, 1, 2, 3]), 16, 4)
    boxes = [sw.ShardMetadata([2 * r, 0], [2, 4], f"rank:{r}/cpu") for r in range(4)]
    boxes += [sw.ShardMetadata([8, r], [8, 1], f"rank:{r}/cpu") for r in range(4)]
    src = sw.zeros(sw.EnumerableShardingSpec(boxes), 16, 4)
    assert dest.local_shards()[0].metadata == src.local_shards()[0].metadata
    assert dest.local_shards()[1].metadata != src.local_shards()[1].metadata
    with pytest.raises(RuntimeError, match=message):
        dest.copy_(src)
    for shard in dest.local_shards():
        assert_close(shard.tensor, torch.ones(2, 4), exact=True)
    assert dest.local_shards()[0].metadata.shard_offsets == [2 * rank, 0]


# -- requires_grad_ and module conversion -----------------------------------------------------


@distributed(world_size=4)
def test_requires_grad_mutates_the_shards_the_caller_holds() -> None:
    for spec in (chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0]), chunk_spec(0, [1, 2])):
        st = sw.rand(spec, 16, 3)
        local_shards = st.local_shards()
        tensors = [shard.tensor for shard in local_shards]
        assert st.requires_grad_() is st
        assert st.requires_grad is True
        assert st.metadata().tensor_properties.requires_grad is True
        assert all(shard.tensor.requires_grad for shard in local_shards)
        assert [shard.tensor for shard in st.local_shards()] == tensors  # same tensor objects
        # Unchanged value: a no-op returning self.
        assert st.requires_grad_(True) is st
        assert st.requires_grad is True
        assert st.requires_grad_(requires_grad=False) is st
        assert st.requires_grad is False
        assert st.metadata().tensor_properties.requires_grad is False
        assert not any(shard.tensor.requires_grad for shard in local_shards)


@distributed(world_size=4)
def test_module_conversion_replaces_sharded_parameters() -> None:
    assert (
        torch._has_compatible_shallow_copy_type(
            sw.zeros(chunk_spec(0), 4, 4), sw.zeros(chunk_spec(0), 4, 4)
        )
        is False
    )
    torch.manual_seed(0)
    fc = nn.Linear(4, 8)
    sw.shard_parameter(fc, "weight", chunk_spec(0))
    before = fc.weight
    local_before = before.local_tensor().detach().clone()
    fc.to(torch.float64)
    # nn.Module._apply saw incompatible shallow-copy types: it replaced the parameter object
    # instead of assigning .data to the old one.
    assert fc.weight is not before
    assert isinstance(fc.weight, sw.ShardedTensor)
    assert isinstance(fc.weight, nn.Parameter)
    assert fc.weight.dtype == torch.float64
    assert fc.weight.requires_grad is True
    assert_close(fc.weight.local_tensor(), local_before.double(), exact=True)
    assert before.dtype == torch.float32
    assert fc.bias.dtype == torch.float64


# -- *_like creators (SPEC deviation 5) -----------------------------------------------------


@distributed(world_size=4)
def test_like_creators_keep_dtype_requires_grad_and_group() -> None:
    group = dist.new_group(list(range(4)))
    spec = chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0])
    st = sw.rand(spec, 16, 3, dtype=torch.float64, requires_grad=True, process_group=group)
    shapes = [shard.tensor.shape for shard in st.local_shards()]

    def check(new: Any, dtype: torch.dtype = torch.float64, requires_grad: bool = True) -> None:
        assert isinstance(new, sw.ShardedTensor)
        assert new is not st
        assert new.size() == st.size()
        assert new.dtype == dtype
        assert new.requires_grad is requires_grad
        assert new._process_group is group
        assert new.sharding_spec() is spec
        assert new.metadata().shards_metadata == st.metadata().shards_metadata
        assert [shard.tensor.shape for shard in new.local_shards()] == shapes
        assert all(shard.tensor.dtype == dtype for shard in new.local_shards())

    constants: list[tuple[Callable[..., Any], tuple[Any, ...], float]] = [
        (torch.zeros_like, (), 0.0),
        (torch.ones_like, (), 1.0),
        (torch.full_like, (8.5,), 8.5),
    ]
    for op, extra, value in constants:
        new = op(st, *extra)
        check(new)
        for shard in new.local_shards():
            assert_close(shard.tensor, torch.full(shard.tensor.shape, value, dtype=torch.float64))
    check(torch.empty_like(st))
    # The memory format is accepted (shards are always contiguous).
    check(torch.zeros_like(st, memory_format=torch.preserve_format))

    # Random creators draw each local shard from the local generator, in local-shard order.
    for op, draw in ((torch.rand_like, torch.rand), (torch.randn_like, torch.randn)):
        torch.manual_seed(1234 + dist.get_rank())
        new = op(st)
        check(new)
        torch.manual_seed(1234 + dist.get_rank())
        for shard in new.local_shards():
            assert_close(shard.tensor, draw(shard.tensor.shape, dtype=torch.float64), exact=True)

    # Explicit keywords win; dtype=None means "keep", as for torch's own *_like.
    check(torch.zeros_like(st, dtype=torch.float32), dtype=torch.float32)
    check(torch.ones_like(st, dtype=None))
    check(torch.zeros_like(st, requires_grad=False), requires_grad=False)
    check(torch.full_like(st, 2, dtype=torch.int32, requires_grad=False), torch.int32, False)
    # requires_grad is kept only where it can hold: integer tensors cannot require grad.
    check(torch.ones_like(st, dtype=torch.int64), torch.int64, False)

    # An integer source stays integer, also for a float fill value (like torch.full_like).
    ints = sw.zeros(spec, 16, 3, dtype=torch.int64)
    filled = torch.full_like(ints, 7.9)
    assert filled.dtype == torch.int64
    assert filled.requires_grad is False
    assert filled._process_group is ints._process_group
    for shard in filled.local_shards():
        assert_close(shard.tensor, torch.full(shard.tensor.shape, 7, dtype=torch.int64))


# -- nn.init -------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_nn_init_runs_the_local_op_on_every_local_shard() -> None:
    seed = 4321 + dist.get_rank()
    # (4, 16) sharded by columns with two chunks per rank: local shards are (4, 2), so
    # kaiming's fan_in is 2 (the local shard's), not 16.
    spec = chunk_spec(1, [0, 1, 2, 3, 3, 2, 1, 0])
    inits: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (nn.init.uniform_, {"a": 10, "b": 20}),
        (nn.init.normal_, {"mean": 10, "std": 5}),
        (nn.init.kaiming_uniform_, {"a": 0, "mode": "fan_in", "nonlinearity": "leaky_relu"}),
        (nn.init.kaiming_uniform_, {}),
        (nn.init.constant_, {"val": 3.5}),
    ]
    for init, kwargs in inits:
        st = sw.empty(spec, 4, 16, dtype=torch.float64)
        torch.manual_seed(seed)
        assert init(st, **kwargs) is st
        torch.manual_seed(seed)
        for shard in st.local_shards():
            expected = init(torch.empty(4, 2, dtype=torch.float64), **kwargs)
            assert_close(shard.tensor, expected, exact=True)

    # The local fan matters: bound = sqrt(6 / fan_in) = sqrt(3) for fan_in 2, so values beyond
    # the global bound sqrt(6 / 16) appear.
    st = sw.empty(spec, 4, 16)
    torch.manual_seed(seed)
    nn.init.kaiming_uniform_(st, a=0, nonlinearity="relu")
    largest = max(shard.tensor.abs().max().item() for shard in st.local_shards())
    assert largest <= 3**0.5
    assert largest > (6 / 16) ** 0.5

    # Initializing a parameter that requires grad works (the shards are filled under no_grad).
    param = sw.zeros(chunk_spec(0), 8, 2, requires_grad=True)
    nn.init.constant_(param, 2.0)
    assert param.local_tensor().requires_grad is True
    assert_close(param.local_tensor().detach(), torch.full((2, 2), 2.0), exact=True)

    # A generator is honoured.
    st = sw.empty(chunk_spec(0), 8, 2)
    nn.init.uniform_(st, generator=torch.Generator().manual_seed(7))
    assert_close(st.local_tensor(), torch.rand(2, 2, generator=torch.Generator().manual_seed(7)))


@distributed(world_size=4)
def test_nn_init_parameter_checks() -> None:
    st = sw.empty(chunk_spec(0), 8, 2)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("a", lambda: nn.init.uniform_(st, a=None)),  # type: ignore[arg-type]
        ("b", lambda: nn.init.uniform_(st, b=None)),  # type: ignore[arg-type]
        ("mean", lambda: nn.init.normal_(st, mean=None)),  # type: ignore[arg-type]
        ("std", lambda: nn.init.normal_(st, std=None)),  # type: ignore[arg-type]
        ("a", lambda: nn.init.kaiming_uniform_(st, a=None)),  # type: ignore[arg-type]
        ("mode", lambda: nn.init.kaiming_uniform_(st, mode=None)),  # type: ignore[arg-type]
        ("nonlinearity", lambda: nn.init.kaiming_uniform_(st, nonlinearity=None)),  # type: ignore[arg-type]
        ("val", lambda: nn.init.constant_(st, None)),  # type: ignore[arg-type]
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=_exactly(f"param: {name} shouldn't be None!")):
            call()
    group = st._process_group
    for op in (nn.init.uniform_, nn.init.normal_, nn.init.kaiming_uniform_, nn.init.constant_):
        handler = registry._SHARDED_OPS[op]
        with pytest.raises(ValueError, match=_exactly("param: kwargs shouldn't be None!")):
            handler((), (st,), None, group)
        with pytest.raises(ValueError, match=_exactly("param: tensor shouldn't be None!")):
            handler((), (st,), {"tensor": None}, group)


# -- torch.equal / torch.allclose (collective) -----------------------------------------------


def _random(seed: int, spec: Any = None, size: tuple[int, ...] = (10, 10), **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    return sw.rand(spec or chunk_spec(0), size, **kwargs)


@distributed(world_size=4)
def test_equal_and_allclose_agree_on_every_rank() -> None:
    for cmp in (torch.equal, torch.allclose):
        assert cmp(_random(42), _random(42)) is True
        assert cmp(_random(42, grid_spec(10, 10)), _random(42, grid_spec(10, 10))) is True
        assert cmp(_random(42, chunk_spec(0, [1, 2])), _random(42, chunk_spec(0, [1, 2]))) is True
    assert torch.allclose(_random(42), _random(42), atol=0) is True
    assert torch.equal(_random(42), _random(43)) is False
    assert torch.allclose(_random(42), _random(43)) is False
    assert torch.allclose(_random(42), _random(43), atol=1) is True


@distributed(world_size=4)
@pytest.mark.parametrize("name", ["equal", "allclose"])
def test_equal_and_allclose_are_false_on_every_rank_for_any_difference(name: str) -> None:
    cmp = getattr(torch, name)
    spec = chunk_spec(0)
    # Data differs on rank 0 only: every rank answers False.
    first, second = _random(42), _random(42)
    if dist.get_rank() == 0:
        nn.init.uniform_(first.local_shards()[0].tensor)
    assert cmp(first, second) is False
    # Data differs on the only rank that owns a shard.
    first, second = _random(42, chunk_spec(0, [3])), _random(42, chunk_spec(0, [3]))
    if dist.get_rank() == 3:
        first.local_tensor()[0, 0] += 1
    assert cmp(first, second) is False
    # Metadata differences.
    assert cmp(_random(42), _random(42, size=(10, 5))) is False
    assert cmp(_random(42), _random(42, chunk_spec(0, [1, 0, 3, 2]))) is False
    assert cmp(sw.ones(spec, 10, 10), sw.zeros(spec, 10, 10)) is False
    assert cmp(sw.zeros(spec, 10, 10), sw.zeros(spec, 10, 10, dtype=torch.float64)) is False
    assert cmp(sw.zeros(spec, 10, 10), sw.zeros(spec, 10, 10, requires_grad=True)) is False
    # Same global layout, different order of the local shards on one rank.
    two = chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0])
    first, second = sw.zeros(two, 16, 2), sw.zeros(two, 16, 2)
    if dist.get_rank() == 1:
        second._local_shards.reverse()
    assert cmp(first, second) is False
    # ... and a different number of them.
    first, second = sw.zeros(two, 16, 2), sw.zeros(two, 16, 2)
    if dist.get_rank() == 2:
        second._local_shards.pop()
    assert cmp(first, second) is False


@distributed(world_size=4)
def test_allclose_forwards_its_keywords() -> None:
    spec = chunk_spec(0, [0, 1, 2, 3, 3, 2, 1, 0])
    ones = sw.ones(spec, 16, 2)
    close = sw.full(spec, (16, 2), 1.001)
    assert torch.allclose(ones, close) is False
    assert torch.allclose(ones, close, atol=1e-2) is True
    assert torch.allclose(ones, close, rtol=1e-2) is True
    assert torch.equal(ones, close) is False
    with_nan = sw.full(spec, (16, 2), float("nan"))
    assert torch.allclose(with_nan, with_nan) is False
    assert torch.allclose(with_nan, with_nan, equal_nan=True) is True
    assert torch.equal(with_nan, with_nan) is False


@distributed(world_size=4)
def test_equal_and_allclose_argument_checks() -> None:
    st = sw.ones(chunk_spec(0), 8, 2)
    plain = torch.ones(8, 2)
    with pytest.raises(ValueError, match=_exactly("Expected two arguments for torch.allclose")):
        torch.allclose(st, st, 1e-5)
    with pytest.raises(ValueError, match=_exactly("Expected two arguments for torch.allclose")):
        torch.allclose(st, st, 1e-5, 1e-8)
    handler = registry._SHARDED_OPS[torch.equal]
    with pytest.raises(ValueError, match=_exactly("Expected two arguments for torch.equal")):
        handler((), (st,), None, st._process_group)
    for name in ("equal", "allclose"):
        message = _exactly(f"Both arguments to torch.{name} need to be of type ShardedTensor")
        with pytest.raises(TypeError, match=message):
            getattr(torch, name)(st, plain)
        with pytest.raises(TypeError, match=message):
            getattr(torch, name)(plain, st)
        # Different group objects, even over the same ranks: an error, not False.
        for ranks in ([1, 0, 3, 2], [0, 1, 2, 3]):
            other = sw.ones(chunk_spec(0), 8, 2, process_group=dist.new_group(ranks))
            with pytest.raises(RuntimeError, match=_exactly(SAME_GROUP)):
                getattr(torch, name)(st, other)


@distributed(world_size=4)
def test_equal_on_a_sub_group_is_true_outside_it_without_communicating() -> None:
    rank = dist.get_rank()
    group = dist.new_group([2, 3])
    spec = chunk_spec(0, [2, 3])
    first, second = _random(5, spec, process_group=group), _random(5, spec, process_group=group)
    if rank in (2, 3):
        assert torch.equal(first, second) is True
        assert torch.allclose(first, second) is True
        second.local_tensor()[0, 0] += 1
        assert torch.equal(first, second) is False
    else:
        # Non-members own nothing and take no part in any collective: however often they
        # call it, nobody waits for them (the pool's health check would hang otherwise).
        for _ in range(3):
            assert torch.equal(first, second) is True
            assert torch.allclose(first, sw.zeros(spec, 10, 10, process_group=group)) is True
