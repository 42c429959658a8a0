"""Training with ShardedTensor parameters, on real gloo groups: ``ShardedOptimizer`` and
``named_params_with_sharded_tensor`` (upstream ``torch.distributed._shard.sharded_optim``),
the ``grad`` of a sharded parameter, the refusal of plain ``torch.optim`` optimizers and of
``DistributedDataParallel`` wrapping, and optimizer state dicts saved with
``shardwise.checkpoint`` on 4 ranks and loaded on 2.

The reference for training is the unsharded model on every rank: each rank knows every
rank's batch (seeded by step and rank), so it can take the step of the sum of all ranks'
losses on its own, with no communication, and compare its shards with the matching slices.
Float64 throughout, so that the comparisons are tight.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.sharded_optim import ShardedOptimizer, named_params_with_sharded_tensor
from tests.harness import distributed, run_on_ranks

ROWS, DIM, OUT = 10, 4, 2
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _spec(world: int, dim: int = 0) -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])


class Net(nn.Module):
    """A row-wise sharded embedding feeding a replicated linear layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(ROWS, DIM).double()
        self.head = nn.Linear(DIM, OUT).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def _sharded_net(world: int, seed: int = 0) -> Net:
    net = Net(seed)
    sw.shard_parameter(net.embedding, "weight", _spec(world))
    return net


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, ROWS, (3, 4), generator=generator)
    return ids, torch.randn(3, OUT, generator=generator, dtype=torch.float64)


def _loss(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    ids, target = _batch(step, rank)
    return ((net(ids) - target) ** 2).sum()


def _reference_steps(net: Net, optim: torch.optim.Optimizer, steps: range, world: int) -> None:
    """Steps of the unsharded model on the sum of every rank's loss."""
    for step in steps:
        optim.zero_grad()
        torch.stack([_loss(net, step, r) for r in range(world)]).sum().backward()
        optim.step()


def _train(net: Net, optim: ShardedOptimizer, steps: range) -> None:
    for step in steps:
        optim.zero_grad()
        _loss(net, step, dist.get_rank()).backward()  # every rank: the backward is collective
        optim.step()


def _row_slice(weight: sw.ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    (shard,) = weight.local_shards()
    start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
    return full[start : start + rows]


def _assert_matches(net: Net, reference: Net) -> None:
    weight = net.embedding.weight
    assert isinstance(weight, sw.ShardedTensor)
    torch.testing.assert_close(
        weight.local_tensor().detach(), _row_slice(weight, reference.embedding.weight), **TOL
    )
    for name in ("weight", "bias"):
        torch.testing.assert_close(
            getattr(net.head, name).detach(), getattr(reference.head, name).detach(), **TOL
        )


def test_top_level_exports() -> None:
    import shardwise.sharded_optim

    assert sw.ShardedOptimizer is shardwise.sharded_optim.ShardedOptimizer
    assert sw.named_params_with_sharded_tensor is named_params_with_sharded_tensor


# -- named_params_with_sharded_tensor -------------------------------------------------------


class _WithAttribute(nn.Module):
    """Upstream's test model: a ShardedTensor kept as a plain attribute, and a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.rand(5, 10))
        self.sharded_param = sw.rand(_spec(4), 20, 10, requires_grad=True)


@distributed(world_size=4)
def test_named_params_with_sharded_tensor() -> None:
    model = _WithAttribute()
    named = dict(named_params_with_sharded_tensor(model))
    assert list(named) == ["sharded_param", "param"]
    assert named["sharded_param"] is model.sharded_param and named["param"] is model.param

    # Sharded parameters registered by shard_parameter are parameters: listed once.
    outer = nn.Module()
    outer.linear1, outer.linear2 = nn.Linear(17, 12), nn.Linear(12, 29)
    outer.inner = model
    sw.shard_parameter(outer.linear1, "weight", _spec(4, dim=0))
    sw.shard_parameter(outer.linear2, "weight", _spec(4, dim=1))
    names = [name for name, _ in named_params_with_sharded_tensor(outer)]
    assert sorted(names) == sorted(
        [
            "inner.sharded_param",
            "linear1.weight",
            "linear1.bias",
            "linear2.weight",
            "linear2.bias",
            "inner.param",
        ]
    )
    assert isinstance(
        dict(named_params_with_sharded_tensor(outer))["linear2.weight"], sw.ShardedTensor
    )
    # prefix and recurse apply to every name (upstream applied them to the attributes only).
    assert [name for name, _ in named_params_with_sharded_tensor(outer, prefix="m")] == [
        f"m.{name}" for name in names
    ]
    assert list(dict(named_params_with_sharded_tensor(outer, recurse=False))) == []
    own = [name for name, _ in named_params_with_sharded_tensor(outer.inner, recurse=False)]
    assert own == ["sharded_param", "param"]


# -- ShardedOptimizer ---------------------------------------------------------------------------


@distributed(world_size=4)
def test_upstream_usage_steps_local_shards_and_parameters() -> None:
    """Upstream's test: the forward uses the local shard directly, every rank the same input;
    each local tensor takes the step of its own gradient."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    local_model = _WithAttribute()
    local_model.sharded_param = nn.Parameter(torch.rand(5, 10))
    sharded_model = _WithAttribute()
    (shard,) = sharded_model.sharded_param.local_shards()
    shard.tensor = local_model.sharded_param.detach().clone().requires_grad_()
    sharded_model.param = nn.Parameter(local_model.param.detach().clone())

    local_optim = torch.optim.SGD(local_model.parameters(), lr=0.1)
    sharded_optim = ShardedOptimizer(
        dict(named_params_with_sharded_tensor(sharded_model)), torch.optim.SGD, lr=0.1
    )
    before = {name: p.detach().clone() for name, p in local_model.named_parameters()}
    inp = torch.rand(5, 10, generator=torch.Generator().manual_seed(rank))
    (local_model.sharded_param + local_model.param + inp).sum().backward()
    (shard.tensor + sharded_model.param + inp).sum().backward()
    local_optim.step()
    sharded_optim.step()

    assert not torch.equal(local_model.param.detach(), before["param"])
    torch.testing.assert_close(shard.tensor.detach(), local_model.sharded_param.detach())
    torch.testing.assert_close(sharded_model.param.detach(), local_model.param.detach())
    assert sharded_optim.named_params["sharded_param"] is sharded_model.sharded_param


@distributed(world_size=4)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW", "Adagrad"])
def test_training_equals_the_unsharded_model(optimizer: str) -> None:
    cls = getattr(torch.optim, optimizer)
    options: dict[str, Any] = {"lr": 0.05}
    if optimizer == "SGD":
        options["momentum"] = 0.9
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net), cls, sync_replicated_grads=True, **options
    )
    reference = Net()
    reference_optim = cls(reference.parameters(), **options)
    _train(net, optim, range(4))
    _reference_steps(reference, reference_optim, range(4), world=4)
    _assert_matches(net, reference)
    # The sharded parameter's gradient arrived (as a ShardedTensor) and was used.
    grad = net.embedding.weight.grad
    assert isinstance(grad, sw.ShardedTensor)
    assert grad.local_tensor() is net.embedding.weight.local_tensor().grad


@distributed(world_size=4)
def test_without_sync_each_rank_uses_its_own_gradient() -> None:
    rank = dist.get_rank()
    net = _sharded_net(4)
    optim = ShardedOptimizer(named_params_with_sharded_tensor(net), torch.optim.SGD, lr=0.1)
    before = net.head.weight.detach().clone()
    _train(net, optim, range(1))
    reference = Net()
    _loss(reference, 0, rank).backward()
    assert reference.head.weight.grad is not None
    torch.testing.assert_close(
        net.head.weight.detach(), before - 0.1 * reference.head.weight.grad, **TOL
    )


@distributed(world_size=4)
def test_lr_scheduler_and_closure() -> None:
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net), torch.optim.SGD, lr=0.1, sync_replicated_grads=True
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    reference = Net()
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optim, step_size=1, gamma=0.5)
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            optim.zero_grad()
            loss = _loss(net, step, dist.get_rank())
            loss.backward()
            return loss

        assert isinstance(optim.step(closure), torch.Tensor)
        scheduler.step()
        _reference_steps(reference, reference_optim, range(step, step + 1), world=4)
        reference_scheduler.step()
    assert optim.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    _assert_matches(net, reference)


def _save_from_ranks_without_shards(path: str) -> None:
    """Ranks 0 and 3 hold no shard of ``w`` (placements on ranks 2 and 1)."""
    rank = dist.get_rank()
    spec = sw.ChunkShardingSpec(0, ["rank:2/cpu", "rank:1/cpu"])
    weight = sw.zeros(spec, 6, 2, dtype=torch.float64, requires_grad=True)
    bias = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optim = ShardedOptimizer({"w": weight, "b": bias}, torch.optim.Adagrad, lr=0.5)
    for shard in weight.local_shards():
        shard.tensor.grad = torch.full_like(shard.tensor, 1.0 + shard.metadata.shard_offsets[0])
    bias.grad = torch.ones(2, dtype=torch.float64)
    optim.step()
    state = optim.state_dict()["state"]
    assert ("w" in state) == (rank in (1, 2))
    ckpt.save({"optim": optim}, path)


def test_ranks_without_shards_save_and_reload_on_fewer_ranks(tmp_path: Path) -> None:
    run_on_ranks(_save_from_ranks_without_shards, 4, args=(str(tmp_path / "ckpt"),))
    # The sums of squared gradients Adagrad keeps, rows 0-2 from rank 2, rows 3-5 from rank 1.
    state_sum = ckpt.load_tensor(tmp_path / "ckpt", "optim.state.w.sum")
    expected = torch.tensor([[1.0] * 2] * 3 + [[16.0] * 2] * 3, dtype=torch.float64)
    torch.testing.assert_close(state_sum, expected)


@distributed(world_size=4)
def test_sync_needs_the_same_replicated_parameters_everywhere() -> None:
    rank = dist.get_rank()
    net = _sharded_net(4)
    named = dict(named_params_with_sharded_tensor(net))
    if rank == 2:
        named["extra"] = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optim = ShardedOptimizer(named, torch.optim.SGD, lr=0.1, sync_replicated_grads=True)
    _loss(net, 0, rank).backward()
    with pytest.raises(ValueError, match=r"same replicated parameters .* on every rank"):
        optim.step()


def test_argument_errors() -> None:
    weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="needs tensors or ShardedTensors, got list"):
        ShardedOptimizer({"w": [1.0]}, torch.optim.SGD, lr=0.1)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'w' is given twice"):
        ShardedOptimizer(
            [("w", weight), ("w", nn.Parameter(torch.zeros(1)))], torch.optim.SGD, lr=1
        )
    # A tied tensor is stepped once, under its first name.
    optim = ShardedOptimizer({"a": weight, "b": weight}, torch.optim.SGD, lr=1.0)
    assert list(optim.named_params) == ["a"]
    optim.add_param_group({"params": {"c": nn.Parameter(torch.ones(1))}, "lr": 0.5})
    assert [group["lr"] for group in optim.param_groups] == [1.0, 0.5]
    assert optim.state_dict()["param_groups"][1]["params"] == ["c"]
    with pytest.raises(ValueError, match=re.escape("already in the optimizer: ['a']")):
        optim.add_param_group({"params": {"a": nn.Parameter(torch.ones(1))}})


# -- plain optimizers, grad, DDP ------------------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_a_plain_optimizer_refuses_sharded_parameters(optimizer: str) -> None:
    net = _sharded_net(4)
    plain = getattr(torch.optim, optimizer)(net.parameters(), lr=0.1)
    _loss(net, 0, dist.get_rank()).backward()
    before = net.embedding.weight.local_tensor().detach().clone()
    message = (
        f"torch.optim.{optimizer} cannot step a ShardedTensor parameter "
        "(param_groups[0]['params'][0], size [10, 4])"
    )
    with pytest.raises(TypeError, match=re.escape(message)) as info:
        plain.step()
    assert "shardwise.ShardedOptimizer" in str(info.value)
    assert torch.equal(net.embedding.weight.local_tensor(), before)
    # Optimizers without sharded parameters are not affected.
    unsharded = Net()
    other = getattr(torch.optim, optimizer)(unsharded.parameters(), lr=0.1)
    _loss(unsharded, 0, 0).backward()
    other.step()


@distributed(world_size=4)
def test_grad_of_a_sharded_parameter() -> None:
    net = _sharded_net(4)
    weight = net.embedding.weight
    assert isinstance(weight, sw.ShardedTensor)
    assert weight.grad is None
    _loss(net, 0, dist.get_rank()).backward()
    grad = weight.grad
    assert isinstance(grad, sw.ShardedTensor)
    assert grad.size() == weight.size() and grad.dtype == weight.dtype
    assert grad.requires_grad is False
    assert grad.local_tensor() is weight.local_tensor().grad
    assert [s.metadata for s in grad.local_shards()] == [s.metadata for s in weight.local_shards()]

    # nn.Module.zero_grad and an optimizer's zero_grad reach the shards.
    net.zero_grad(set_to_none=False)
    assert weight.local_tensor().grad is grad.local_tensor()
    assert not grad.local_tensor().any()
    net.zero_grad()
    assert weight.grad is None and weight.local_tensor().grad is None
    weight.grad = grad
    assert weight.local_tensor().grad is grad.local_tensor()
    optim = ShardedOptimizer(named_params_with_sharded_tensor(net), torch.optim.SGD, lr=0.1)
    optim.zero_grad()
    assert weight.grad is None

    with pytest.raises(TypeError, match="must be None or a ShardedTensor with the same sharding"):
        weight.grad = torch.zeros(ROWS, DIM, dtype=torch.float64)
    other = sw.zeros(_spec(4, dim=1), ROWS, DIM, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="same local shards"):
        weight.grad = other
    # A non-leaf ShardedTensor has no grad (and reading it does not warn).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (weight * 2).grad is None


@distributed(world_size=2)
def test_ddp_wrap_says_what_to_do() -> None:
    net = _sharded_net(2)
    message = (
        "DistributedDataParallel cannot wrap a module with ShardedTensor parameters "
        "['embedding.weight']"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        DistributedDataParallel(net)
    text = str(info.value)
    assert "_set_params_and_buffers_to_ignore_for_model(module, ['embedding.weight'])" in text
    assert "ShardedOptimizer" in text
    # Other uses from C++ keep upstream's message.
    with (
        pytest.raises(RuntimeError, match=r"^A ShardedTensor object is being used from c\+\+"),
        torch._C.DisableTorchFunctionSubclass(),
    ):
        torch.ops.aten.view.default(net.embedding.weight, [-1])


@distributed(world_size=2)
def test_ddp_trains_the_replicated_parameters_when_told_to_ignore_the_sharded_ones() -> None:
    """What the wrap error advises: DDP averages the replicated gradients, the sharded
    parameters get the sum over ranks from their ops, ShardedOptimizer steps both."""
    rank = dist.get_rank()
    net = _sharded_net(2, seed=rank)  # replicas differ: DDP broadcasts rank 0's
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["embedding.weight"])
    ddp = DistributedDataParallel(net)
    optim = ShardedOptimizer(named_params_with_sharded_tensor(net), torch.optim.SGD, lr=0.1)
    reference = Net(seed=0)
    for step in range(3):
        optim.zero_grad()
        ids, target = _batch(step, rank)
        ((ddp(ids) - target) ** 2).sum().backward()
        optim.step()
        # Reference: the sharded weight takes the summed gradient, the head the average.
        reference.zero_grad()
        torch.stack([_loss(reference, step, r) for r in range(2)]).sum().backward()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                assert param.grad is not None
                scale = 1.0 if name == "embedding.weight" else 0.5
                param -= 0.1 * scale * param.grad
    _assert_matches(net, reference)
    del ddp


# -- state dicts and checkpoints ------------------------------------------------------------


@distributed(world_size=4)
def test_state_dict_is_keyed_by_name_and_sharded() -> None:
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net),
        torch.optim.AdamW,
        lr=0.05,
        sync_replicated_grads=True,
    )
    _train(net, optim, range(2))
    sd = optim.state_dict()
    assert list(sd["state"]) == ["embedding.weight", "head.weight", "head.bias"]
    assert sd["param_groups"][0]["params"] == ["embedding.weight", "head.weight", "head.bias"]
    assert sd["param_groups"][0]["lr"] == 0.05
    moments = sd["state"]["embedding.weight"]
    for key in ("exp_avg", "exp_avg_sq"):
        st = moments[key]
        assert isinstance(st, sw.ShardedTensor)
        assert st.size() == net.embedding.weight.size()
        assert st.sharding_spec() == net.embedding.weight.sharding_spec()
        # The live state, not a copy.
        assert st.local_tensor() is optim.state[net.embedding.weight.local_tensor()][key]
    assert float(moments["step"]) == 2.0
    assert type(sd["state"]["head.bias"]["exp_avg"]) is torch.Tensor

    # Against the unsharded reference's state.
    reference = Net()
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _reference_steps(reference, reference_optim, range(2), world=4)
    reference_state = reference_optim.state[reference.embedding.weight]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            moments[key].local_tensor(), _row_slice(moments[key], reference_state[key]), **TOL
        )


@distributed(world_size=4)
def test_a_fresh_optimizer_creates_its_state_without_changing_parameters() -> None:
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net), torch.optim.AdamW, lr=0.05, weight_decay=0.1
    )
    before = {
        name: p.detach().clone()
        for name, p in net.named_parameters()
        if type(p) is not sw.ShardedTensor
    }
    shard_before = net.embedding.weight.local_tensor().detach().clone()
    _loss(net, 0, dist.get_rank()).backward()
    grad = net.head.weight.grad
    sd = optim.state_dict()
    assert isinstance(sd["state"]["embedding.weight"]["exp_avg"], sw.ShardedTensor)
    assert float(sd["state"]["head.weight"]["step"]) == 1.0
    assert optim.param_groups[0]["lr"] == 0.05
    assert torch.equal(net.embedding.weight.local_tensor(), shard_before)
    for name, value in before.items():
        assert torch.equal(dict(net.named_parameters())[name], value)
    assert net.head.weight.grad is grad  # the pending gradient is left as it was


def _save_on_4(path: str) -> None:
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net),
        torch.optim.AdamW,
        lr=0.05,
        sync_replicated_grads=True,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for step in range(3):
        _train(net, optim, range(step, step + 1))
        scheduler.step()
    ckpt.save({"model": net, "optim": optim, "sched": scheduler}, path)


def _resume_on_2(path: str) -> None:
    rank = dist.get_rank()
    net = _sharded_net(2, seed=123)  # nothing of the saved run in memory
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net), torch.optim.AdamW, lr=1.0, sync_replicated_grads=True
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    result = ckpt.load({"model": net, "optim": optim, "sched": scheduler}, path)
    assert result.missing_keys == [] and result.unexpected_keys == []

    reference = Net()
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optim, step_size=2, gamma=0.5)
    for step in range(3):
        _reference_steps(reference, reference_optim, range(step, step + 1), world=4)
        reference_scheduler.step()
    _assert_matches(net, reference)
    assert optim.param_groups[0]["lr"] == reference_optim.param_groups[0]["lr"] == 0.025
    (shard,) = net.embedding.weight.local_shards()
    state = optim.state[shard.tensor]
    expected = reference_optim.state[reference.embedding.weight]
    assert float(state["step"]) == 3.0
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            state[key], _row_slice(net.embedding.weight, expected[key]), **TOL
        )

    # Training goes on from there, now with 2 ranks' batches.
    for step in range(3, 5):
        _train(net, optim, range(step, step + 1))
        scheduler.step()
        _reference_steps(reference, reference_optim, range(step, step + 1), world=2)
        reference_scheduler.step()
    _assert_matches(net, reference)
    assert rank in (0, 1)


def test_state_saved_on_4_ranks_resumes_on_2(tmp_path: Path) -> None:
    run_on_ranks(_save_on_4, 4, args=(str(tmp_path / "ckpt"),))
    run_on_ranks(_resume_on_2, 2, args=(str(tmp_path / "ckpt"),))


@distributed(world_size=4)
def test_load_state_dict_of_whole_tensors() -> None:
    """A state dict whose sharded state is whole tensors (e.g. from an unsharded run) loads:
    each rank takes its shards' part."""
    net = _sharded_net(4)
    optim = ShardedOptimizer(
        named_params_with_sharded_tensor(net),
        torch.optim.AdamW,
        lr=0.05,
        sync_replicated_grads=True,
    )
    reference = Net()
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _reference_steps(reference, reference_optim, range(2), world=4)
    names = dict(
        zip(
            [id(p) for p in reference.parameters()],
            [n for n, _ in reference.named_parameters()],
            strict=True,
        )
    )
    whole = {
        "state": {
            names[id(p)]: {key: value.clone() for key, value in s.items()}
            for p, s in reference_optim.state.items()
        },
        "param_groups": [
            {
                **{k: v for k, v in reference_optim.param_groups[0].items() if k != "params"},
                "params": list(names.values()),
            }
        ],
    }
    with torch.no_grad():
        net.embedding.weight.local_tensor().copy_(
            _row_slice(net.embedding.weight, reference.embedding.weight)
        )
        net.head.load_state_dict(reference.head.state_dict())
    optim.load_state_dict(whole)
    _train(net, optim, range(2, 4))
    _reference_steps(reference, reference_optim, range(2, 4), world=4)
    _assert_matches(net, reference)


@distributed(world_size=4)
def test_load_state_dict_errors() -> None:
    net = _sharded_net(4)
    optim = ShardedOptimizer(named_params_with_sharded_tensor(net), torch.optim.AdamW, lr=0.05)
    sd = optim.state_dict()
    with pytest.raises(ValueError, match="has 2 parameter groups, this optimizer has 1"):
        optim.load_state_dict({**sd, "param_groups": sd["param_groups"] * 2})
    with pytest.raises(ValueError, match=re.escape("unknown parameters ['nope']")):
        optim.load_state_dict({**sd, "state": {**sd["state"], "nope": {}}})
    group = {**sd["param_groups"][0], "params": ["head.weight"]}
    with pytest.raises(ValueError, match="parameter group 0 of the state dict holds"):
        optim.load_state_dict({**sd, "param_groups": [group]})
    columns = sw.zeros(_spec(4, dim=1), ROWS, DIM, dtype=torch.float64)
    moments = {**sd["state"]["embedding.weight"], "exp_avg": columns}
    with pytest.raises(ValueError, match="must be sharded like the parameter"):
        optim.load_state_dict({**sd, "state": {**sd["state"], "embedding.weight": moments}})
