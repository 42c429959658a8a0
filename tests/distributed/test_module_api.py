"""Module-level integration on real 4-rank gloo groups: output hooks (``reshard_output``,
``collect_local_shard``), the state-dict hooks, ``shard_parameter`` with module moves, and
``shard_module`` with ``ShardingPlan`` / ``Sharder`` / ``ShardingPlanner`` (reference §15,
§17.3, §18; SPEC deviations 6, 7, 8).
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

import shardwise as sw
from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardedTensor,
    Sharder,
    ShardingPlan,
    ShardingPlanner,
    ShardMetadata,
)
from tests.harness import distributed


def _chunk(dim: int, ranks: list[int]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _shuffled(seed: int) -> list[int]:
    ranks = [0, 1, 2, 3]
    random.Random(seed).shuffle(ranks)
    return ranks


def _rows(spec: ChunkShardingSpec, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s chunk along the sharded dim (one placement per rank)."""
    split = (size + len(spec.placements) - 1) // len(spec.placements)
    index = [p.rank() for p in spec.placements].index(rank)  # type: ignore[union-attr]
    start = split * index
    return start, max(min(size, start + split) - start, 0)


class _Emit(nn.Module):
    """Returns whatever it holds: a stand-in for a layer with a sharded output."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> object:
        return self.value


class _EmitWeight(nn.Module):
    """Returns its own weight parameter, which shard_module turns into a ShardedTensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self) -> torch.Tensor:
        return self.weight


# -- output hooks ------------------------------------------------------------------------------


@distributed(world_size=4)
def test_reshard_output() -> None:
    torch.manual_seed(5)
    spec, reshard_spec = _chunk(0, _shuffled(5)), _chunk(1, _shuffled(6))
    st = sw.rand(spec, 24, 12)
    compare = sw.init_from_local_shards(copy.deepcopy(st.local_shards()), st.size())
    compare._sharding_spec = copy.deepcopy(spec)
    compare.reshard(reshard_spec)
    module = _Emit(st)
    assert sw.reshard_output(module, reshard_spec) is module
    output = module()
    # The module's own tensor, resharded in place.
    assert output is st
    assert st.sharding_spec() is reshard_spec
    assert st.local_tensor().size() == (24, 3)
    assert torch.equal(st.local_tensor(), compare.local_tensor())
    assert st.metadata() == compare.metadata()
    # Calling again reshards to the same spec: a no-op.
    local = st.local_tensor()
    assert module() is st
    assert st.local_tensor() is local


@distributed(world_size=4)
def test_reshard_output_passes_other_outputs_through() -> None:
    plain = torch.arange(6.0)
    module = sw.reshard_output(_Emit(plain), _chunk(0, [0, 1, 2, 3]))
    assert module() is plain
    pair = (plain, 3)
    module.value = pair
    assert module() is pair


@distributed(world_size=4)
def test_collect_local_shard() -> None:
    rank = dist.get_rank()
    torch.manual_seed(3)
    spec = _chunk(0, _shuffled(3))
    st = sw.rand(spec, 23, 15)
    module = _Emit(st)
    assert sw.collect_local_shard(module) is module
    output = module()
    assert type(output) is torch.Tensor
    assert output is st.local_tensor()
    # 23 rows over 4 ranks: 6, 6, 6, 5 (no unit chunk, nothing squeezed).
    start, length = _rows(spec, 23, rank)
    assert output.size() == (length, 15)
    assert length == (5 if start == 18 else 6)


@distributed(world_size=4)
def test_collect_local_shard_squeezes_a_unit_chunk_dim() -> None:
    rank = dist.get_rank()
    full = torch.arange(60.0).view(4, 15)
    # One row per rank along dim 0: the row dim goes away.
    module = sw.collect_local_shard(_Emit(sw.shard_tensor(full, _chunk(0, [0, 1, 2, 3]))))
    assert torch.equal(module(), full[rank])
    # Along dim 1 (negative spelling): 5 columns over 4 ranks are 2, 2, 1, 0 wide.
    narrow = torch.arange(20.0).view(4, 5)
    module.value = sw.shard_tensor(narrow, _chunk(-1, [0, 1, 2, 3]))
    out = module()
    expected = [narrow[:, 0:2], narrow[:, 2:4], narrow[:, 4], narrow[:, 5:5]][rank]
    assert out.shape == expected.shape
    assert torch.equal(out, expected)
    # An enumerable spec is never squeezed.
    rows = EnumerableShardingSpec(
        [ShardMetadata([r, 0], [1, 15], f"rank:{r}/cpu") for r in range(4)]
    )
    module.value = sw.shard_tensor(full, rows)
    assert module().shape == (1, 15)
    # Non-ShardedTensor outputs are left alone.
    plain = torch.ones(1, 3)
    module.value = plain
    assert module() is plain


# -- state-dict hooks --------------------------------------------------------------------------


class _Inner(nn.Module):
    def __init__(self, spec: ChunkShardingSpec | None) -> None:
        super().__init__()
        self.sharded_tensor2 = None if spec is None else sw.rand(spec, 10, 20)
        self.random_tensor2 = nn.Parameter(torch.rand(2, 2))


class _Model(nn.Module):
    """Like upstream's MyShardedModel1: ShardedTensors as plain attributes, at two levels."""

    def __init__(self, spec: ChunkShardingSpec | None) -> None:
        super().__init__()
        self.sharded_tensor1 = None if spec is None else sw.rand(spec, 10, 20)
        self.random_tensor1 = nn.Parameter(torch.rand(2, 2))
        self.submodule = _Inner(spec)


def _hooked(model: nn.Module) -> nn.Module:
    model._register_state_dict_hook(sw.state_dict_hook)
    model._register_load_state_dict_pre_hook(sw.pre_load_state_dict_hook, True)
    return model


@distributed(world_size=4)
def test_state_dict_hook_keys() -> None:
    model = _hooked(_Model(_chunk(0, [0, 1, 2, 3])))
    state = model.state_dict()
    assert list(state) == [
        "random_tensor1",
        "submodule.random_tensor2",
        "sharded_tensor1",
        "submodule.sharded_tensor2",
    ]
    assert state["sharded_tensor1"] is model.sharded_tensor1
    assert state["submodule.sharded_tensor2"] is model.submodule.sharded_tensor2
    # A non-empty prefix: never a double dot (SPEC deviation 8; upstream wrote "p..x").
    prefixed = model.state_dict(prefix="p.")
    assert sorted(prefixed) == [
        "p.random_tensor1",
        "p.sharded_tensor1",
        "p.submodule.random_tensor2",
        "p.submodule.sharded_tensor2",
    ]
    # Nested under a parent that does not register the hook itself.
    outer = nn.Sequential(nn.Linear(2, 2), model)
    keys = list(outer.state_dict())
    assert "1.sharded_tensor1" in keys and "1.submodule.sharded_tensor2" in keys
    assert not [key for key in keys + list(prefixed) if ".." in key or key.startswith(".")]


@distributed(world_size=4)
def test_hooks_leave_modules_without_sharded_tensors_alone() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    expected = {k: v.clone() for k, v in linear.state_dict().items()}
    _hooked(linear)
    state = linear.state_dict()
    assert list(state) == ["weight", "bias"]
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    fresh = _hooked(nn.Linear(3, 2))
    assert fresh.load_state_dict(state, strict=True).missing_keys == []
    assert torch.equal(fresh.weight, linear.weight)


@distributed(world_size=4)
def test_state_dict_round_trip_into_a_fresh_module(tmp_path: Path) -> None:
    torch.manual_seed(dist.get_rank())
    model = _hooked(_Model(_chunk(0, [3, 1, 0, 2])))
    path = tmp_path / f"rank{dist.get_rank()}.pt"
    torch.save(model.state_dict(), path)
    fresh = _hooked(_Model(None))
    result = fresh.load_state_dict(torch.load(path, weights_only=True), strict=False)
    assert result.missing_keys == []
    assert isinstance(fresh.sharded_tensor1, ShardedTensor)
    assert isinstance(fresh.submodule.sharded_tensor2, ShardedTensor)
    assert torch.equal(fresh.sharded_tensor1, model.sharded_tensor1)
    assert torch.equal(fresh.submodule.sharded_tensor2, model.submodule.sharded_tensor2)
    assert torch.equal(fresh.random_tensor1, model.random_tensor1)
    # Straight from one module to another (no pickling), under a prefix and a parent.
    outer_src = nn.ModuleDict({"m": model})
    outer_dst = nn.ModuleDict({"m": _hooked(_Model(None))})
    outer_dst.load_state_dict(outer_src.state_dict(), strict=False)
    assert outer_dst["m"].sharded_tensor1 is model.sharded_tensor1
    assert outer_dst["m"].submodule.sharded_tensor2 is model.submodule.sharded_tensor2


# -- shard_parameter and module moves ----------------------------------------------------------


@distributed(world_size=4)
def test_sharded_parameter_survives_module_moves() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fc = nn.Linear(12, 12)
    weight = fc.weight.detach().clone()
    sw.shard_parameter(fc, "weight", _chunk(0, [0, 1, 2, 3]))
    assert isinstance(fc.weight, ShardedTensor)
    assert isinstance(fc.weight, nn.Parameter)
    assert torch.equal(fc.weight.local_tensor(), weight[3 * rank : 3 * rank + 3])
    # module.to(dtype) reaches ShardedTensor.to as (device, dtype, non_blocking) (SPEC 6).
    fc.to(torch.float64)
    assert isinstance(fc.weight, ShardedTensor)
    assert fc.weight.dtype == torch.float64
    assert fc.weight.local_tensor().dtype == torch.float64
    assert fc.weight.metadata().tensor_properties.dtype == torch.float64
    assert fc.bias.dtype == torch.float64
    assert torch.equal(fc.weight.local_tensor(), weight[3 * rank : 3 * rank + 3].double())
    assert "weight" in dict(fc.named_parameters())
    assert fc.weight.requires_grad
    assert fc.weight.local_tensor().requires_grad
    # Already on the CPU: unchanged.
    fc.to("cpu")
    assert isinstance(fc.weight, ShardedTensor)
    assert fc.weight.device == torch.device("cpu")
    assert torch.equal(fc.weight.local_tensor(), weight[3 * rank : 3 * rank + 3].double())
    fc.to(torch.device("cpu"), torch.float32)
    assert fc.weight.local_tensor().dtype == torch.float32
    assert torch.equal(fc.weight.local_tensor(), weight[3 * rank : 3 * rank + 3])


# -- shard_module ------------------------------------------------------------------------------


class _MegatronLM(nn.Module):
    def __init__(self, sizes: list[list[int]]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(*sizes[0])
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(*sizes[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gelu(self.fc1(x)))


@distributed(world_size=4)
def test_shard_module_parameter_specs() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _MegatronLM([[17, 12], [12, 29]])
    fc1_weight = model.fc1.weight.detach().clone()
    fc2_weight = model.fc2.weight.detach().clone()
    plan = ShardingPlan(
        plan={"fc1.weight": _chunk(0, [0, 1, 2, 3]), "fc2.weight": _chunk(1, [3, 2, 1, 0])}
    )
    assert sw.shard_module(model, plan) is None
    assert isinstance(model.fc1.weight, ShardedTensor)
    assert isinstance(model.fc2.weight, ShardedTensor)
    assert not isinstance(model.fc1.bias, ShardedTensor)
    assert torch.equal(model.fc1.weight.local_tensor(), fc1_weight[3 * rank : 3 * rank + 3])
    # 12 columns over placements 3, 2, 1, 0: rank r owns chunk 3 - r.
    chunk = 3 - rank
    assert torch.equal(model.fc2.weight.local_tensor(), fc2_weight[:, 3 * chunk : 3 * chunk + 3])
    assert model.fc2.weight.sharding_spec() == _chunk(1, [3, 2, 1, 0])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _ShardedBlock(nn.Module):
    """What the Sharder below turns a block into: its weight split by rows, output gathered."""

    def __init__(self, block: _Block) -> None:
        super().__init__()
        self.weight = block.lin.weight.detach().clone()
        self.bias = block.lin.bias.detach().clone()
        self.local = sw.shard_tensor(self.weight, _chunk(0, [0, 1, 2, 3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        part = functional.linear(x, self.local.local_tensor(), self.bias[2 * rank : 2 * rank + 2])
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=-1)


class _BlockSharder(Sharder):
    def shard(self, module: nn.Module) -> nn.Module:
        assert isinstance(module, _Block)
        return _ShardedBlock(module)


class _InPlaceSharder(Sharder):
    """Upstream's style: shards the submodule's parameters and returns the same module."""

    def shard(self, module: nn.Module) -> nn.Module:
        sw.shard_module(module, ShardingPlan({"lin.weight": _chunk(1, [0, 1, 2, 3])}))
        return module


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Module()
        self.a.b = _Block()
        self.c = _Block()
        self.fc = nn.Linear(3, 3)


@distributed(world_size=4)
def test_sharder_replaces_the_submodule_at_its_path() -> None:
    torch.manual_seed(0)
    net = _Net()
    reference = copy.deepcopy(net)
    sw.shard_module(
        net,
        ShardingPlan(
            {"a.b": _BlockSharder(), "c": _InPlaceSharder(), "fc.weight": _chunk(0, [0, 1, 2, 3])}
        ),
    )
    # SPEC deviation 7: the submodule itself is replaced, no attribute named after the path.
    assert isinstance(net.a.b, _ShardedBlock)
    assert net.get_submodule("a.b") is net.a.b
    assert "a.b" not in net._modules and "a.b" not in net.a._modules
    assert not hasattr(net, "a.b")
    assert list(net.a._modules) == ["b"]
    x = torch.arange(8.0).view(2, 4)
    assert torch.allclose(net.a.b(x), reference.a.b(x))
    # A Sharder returning the module it was given keeps it, changed in place.
    assert isinstance(net.c, _Block)
    assert isinstance(net.c.lin.weight, ShardedTensor)
    assert net.c.lin.weight.sharding_spec() == _chunk(1, [0, 1, 2, 3])
    assert isinstance(net.fc.weight, ShardedTensor)


@distributed(world_size=4)
def test_shard_module_errors() -> None:
    net = _Net()
    conflict = (
        "ShardingPlan is in-valid, trying to shard a parameter: a.b.lin.weight, but there's "
        "already a Sharder entry for module a.b, parameter sharding should not conflict with "
        "the submodule tree that a Sharder is working with!"
    )
    # The parameter comes first in the plan: the conflict is still found before any sharding.
    plan = ShardingPlan({"a.b.lin.weight": _chunk(0, [0, 1, 2, 3]), "a.b": _BlockSharder()})
    with pytest.raises(RuntimeError, match=f"^{re.escape(conflict)}$"):
        sw.shard_module(net, plan)
    assert not isinstance(net.a.b.lin.weight, ShardedTensor)
    with pytest.raises(
        KeyError, match=re.escape("Module path must not be empty for custom sharder!")
    ):
        sw.shard_module(net, ShardingPlan({"": _BlockSharder()}))
    with pytest.raises(
        TypeError,
        match=re.escape("Only `ShardingSpec` and `Sharder` are supported to shard 'fc.weight'"),
    ):
        sw.shard_module(net, ShardingPlan({"fc.weight": torch.randn(3, 3)}))  # type: ignore[dict-item]
    with pytest.raises(
        TypeError, match=re.escape("Only `ShardingSpec` is supported as output_plan for 'fc'")
    ):
        sw.shard_module(
            net,
            ShardingPlan(plan={}, output_plan={"fc": torch.randn(3, 3)}),  # type: ignore[dict-item]
        )
    with pytest.raises(AttributeError, match="has no attribute"):
        sw.shard_module(net, ShardingPlan({"fc3.weight": _chunk(0, [0, 1, 2, 3])}))
    with pytest.raises(AttributeError, match=re.escape("Linear has no attribute `biass`")):
        sw.shard_module(net, ShardingPlan({"fc.biass": _chunk(0, [0, 1, 2, 3])}))


@distributed(world_size=4)
def test_output_plan_and_return_local_tensor() -> None:
    rank = dist.get_rank()
    full = torch.arange(40.0).view(8, 5)
    net = nn.Module()
    net.src = _EmitWeight(full.clone())
    plan = ShardingPlan(
        plan={"src.weight": _chunk(0, [0, 1, 2, 3])},
        output_plan={"src": _chunk(1, [3, 2, 1, 0])},
        return_local_tensor=["src"],
    )
    sw.shard_module(net, plan)
    out = net.src()
    assert type(out) is torch.Tensor
    # 5 columns over placements 3, 2, 1, 0: widths 2, 2, 1, 0; the width-1 chunk is squeezed.
    chunk = 3 - rank
    expected = [full[:, 0:2], full[:, 2:4], full[:, 4], full[:, 5:5]][chunk]
    assert out.shape == expected.shape
    assert torch.equal(out, expected)
    assert net.src.weight.sharding_spec() == _chunk(1, [3, 2, 1, 0])


@distributed(world_size=4)
def test_shard_module_on_a_sub_group() -> None:
    group = dist.new_group([2, 3])
    rank = dist.get_rank()
    if rank not in (2, 3):
        return
    # Different weights on the two members: the data must come from src_rank, a group rank.
    torch.manual_seed(rank)
    model = _MegatronLM([[17, 12], [12, 29]])
    sources = {}
    for source in (2, 3):
        torch.manual_seed(source)
        sources[source] = _MegatronLM([[17, 12], [12, 29]])
    plan = ShardingPlan({"fc1.weight": _chunk(0, [2, 3]), "fc2.weight": _chunk(1, [2, 3])})
    sw.shard_module(model, plan, process_group=group)
    index = rank - 2
    assert model.fc1.weight._process_group is group
    assert torch.equal(
        model.fc1.weight.local_tensor(), sources[2].fc1.weight.detach()[6 * index : 6 * index + 6]
    )
    assert torch.equal(
        model.fc2.weight.local_tensor(),
        sources[2].fc2.weight.detach()[:, 6 * index : 6 * index + 6],
    )
    # src_rank=1 is group rank 1, global rank 3.
    torch.manual_seed(rank)
    model = _MegatronLM([[17, 12], [12, 29]])
    sw.shard_module(
        model, ShardingPlan({"fc1.bias": _chunk(0, [3, 2])}), src_rank=1, process_group=group
    )
    assert torch.equal(
        model.fc1.bias.local_tensor(),
        sources[3].fc1.bias.detach()[6 * (3 - rank) : 6 * (3 - rank) + 6],
    )


class _ChunkAllPlanner(ShardingPlanner):
    """Shards every parameter by rows over all ranks."""

    def build_plan(self, module: nn.Module) -> ShardingPlan:
        return ShardingPlan(
            plan={name: _chunk(0, [0, 1, 2, 3]) for name, _ in module.named_parameters()}
        )


@distributed(world_size=4)
def test_sharding_planner() -> None:
    rank = dist.get_rank()
    planner = _ChunkAllPlanner()
    for use_planner_directly in (False, True):
        torch.manual_seed(0)
        model = _MegatronLM([[17, 12], [12, 29]])
        plan = planner.build_plan(model)
        assert sorted(plan.plan) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        sw.shard_module(model, planner if use_planner_directly else plan)
        expected_rows = {
            "fc1.weight": [3, 3, 3, 3][rank],
            "fc1.bias": [3, 3, 3, 3][rank],
            "fc2.weight": [8, 8, 8, 5][rank],
            "fc2.bias": [8, 8, 8, 5][rank],
        }
        for name, rows in expected_rows.items():
            param = model.get_parameter(name)
            assert isinstance(param, ShardedTensor), name
            assert param.local_tensor().size(0) == rows
