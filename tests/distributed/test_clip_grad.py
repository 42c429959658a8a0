"""``shardwise.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the same model
unsharded: in one process with no process group, and on 1, 2 and 4 gloo ranks with row-wise
and column-wise sharded weights (5 rows over 4 ranks leaves an empty trailing shard) beside
plain parameters.

Every rank builds the same whole gradients from one seed, gives its shards their slices and
the plain parameters the whole gradient (the replicated case the function assumes), and runs
torch's clipping on the unsharded copy itself, so each rank checks its own shards.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from tests.harness import distributed, run_on_ranks

NORM_TYPES = [2.0, 1.0, 3.0, 0.5, float("inf")]
#: The sharded parameters: name, size and the dim they are chunked along.
SHARDED: list[tuple[str, tuple[int, ...], int]] = [("rows", (5, 3), 0), ("cols", (4, 7), 1)]
#: Plain (replicated) parameters; "frozen" never gets a gradient.
PLAIN: list[tuple[str, tuple[int, ...]]] = [("bias", (3,)), ("bias2", (7,)), ("frozen", (2,))]

NONFINITE = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot "
    "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
    "set `error_if_nonfinite=False`"
)


def _close(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    """Equal up to float32 rounding (the ranks add their parts in another order)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def _spec(world: int, dim: int) -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])


def _whole_grads(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [(name, size) for name, size, _ in SHARDED] + PLAIN[:2]
    return {name: torch.randn(size, generator=generator) * 3 for name, size in sizes}


def _box(whole: torch.Tensor, shard: sw.Shard) -> torch.Tensor:
    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    return whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _models(seed: int, group: Any = None) -> tuple[dict[str, torch.Tensor], list[nn.Parameter]]:
    """The sharded model's parameters (gradients set) and the unsharded reference's."""
    grads = _whole_grads(seed)
    world = dist.get_world_size(group)
    sharded: dict[str, torch.Tensor] = {}
    reference: list[nn.Parameter] = []
    for name, size, dim in SHARDED:
        param = sw.zeros(_spec(world, dim), *size, requires_grad=True, process_group=group)
        for shard in param.local_shards():
            shard.tensor.grad = _box(grads[name], shard).clone()
        sharded[name] = param
        reference.append(nn.Parameter(torch.zeros(size)))
        reference[-1].grad = grads[name].clone()
    for name, size in PLAIN:
        sharded[name] = nn.Parameter(torch.zeros(size))
        reference.append(nn.Parameter(torch.zeros(size)))
        if name in grads:
            sharded[name].grad = grads[name].clone()
            reference[-1].grad = grads[name].clone()
    return sharded, reference


def _check_grads(sharded: dict[str, torch.Tensor], reference: list[nn.Parameter]) -> None:
    for (name, param), ref in zip(sharded.items(), reference, strict=True):
        assert ref.grad is not None or param.grad is None, name
        if isinstance(param, sw.ShardedTensor):
            assert ref.grad is not None
            for shard in param.local_shards():
                assert shard.tensor.grad is not None
                _close(shard.tensor.grad, _box(ref.grad, shard))
        elif ref.grad is not None:
            assert param.grad is not None
            _close(param.grad, ref.grad)


def _matches_torch() -> list[float]:
    norms = []
    for seed, norm_type in enumerate(NORM_TYPES):
        for foreach in (None, False):
            sharded, reference = _models(seed)
            expected = torch.nn.utils.clip_grad_norm_(reference, 1.5, norm_type)
            total = sw.clip_grad_norm_(sharded.values(), 1.5, norm_type, foreach=foreach)
            assert total.dtype == expected.dtype and total.shape == expected.shape == ()
            _close(total, expected)
            assert expected > 1.5  # so the gradients were clipped
            _check_grads(sharded, reference)
            norms.append(float(total))
    # The inf norm given as a string, as torch accepts it.
    sharded, reference = _models(0)
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.1, "inf")  # type: ignore[arg-type]
    torch.testing.assert_close(sw.clip_grad_norm_(sharded.values(), 0.1, "inf"), expected)  # type: ignore[arg-type]
    _check_grads(sharded, reference)
    return norms


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_norm_and_clipped_gradients_match_torch(world_size: int) -> None:
    norms = run_on_ranks(_matches_torch, world_size)
    # Every rank returned the same total norms.
    assert all(rank_norms == norms[0] for rank_norms in norms)


def _large_max_norm_leaves_gradients_unchanged() -> None:
    for norm_type in NORM_TYPES:
        sharded, reference = _models(7)
        before = {
            name: [s.tensor.grad.clone() for s in p.local_shards()]  # type: ignore[union-attr]
            if isinstance(p, sw.ShardedTensor)
            else p.grad
            if p.grad is None
            else p.grad.clone()
            for name, p in sharded.items()
        }
        expected = torch.nn.utils.clip_grad_norm_(reference, 1e6, norm_type)
        total = sw.clip_grad_norm_(list(sharded.values()), 1e6, norm_type)
        _close(total, expected)
        for name, param in sharded.items():
            if isinstance(param, sw.ShardedTensor):
                for shard, old in zip(param.local_shards(), before[name], strict=True):  # type: ignore[arg-type]
                    assert torch.equal(shard.tensor.grad, old)  # type: ignore[arg-type]
            elif before[name] is None:
                assert param.grad is None
            else:
                assert torch.equal(param.grad, before[name])  # type: ignore[arg-type]


@distributed(world_size=4)
def test_max_norm_above_the_norm_leaves_gradients_unchanged() -> None:
    _large_max_norm_leaves_gradients_unchanged()


def _nonfinite(norm_type: float, bad: float) -> None:
    sharded, reference = _models(3)
    # Only the last rank's shard of "cols" holds the bad value: every rank must see it.
    cols = sharded["cols"]
    assert isinstance(cols, sw.ShardedTensor)
    if dist.get_rank() == dist.get_world_size() - 1:
        grad = cols.local_shards()[0].tensor.grad
        assert grad is not None
        grad[0, 0] = bad
    assert reference[1].grad is not None
    reference[1].grad[0, -1] = bad
    message = NONFINITE.format(norm_type)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        sw.clip_grad_norm_(sharded.values(), 1.0, norm_type, error_if_nonfinite=True)
    # Without the check, the total is the same non-finite value as torch's, on every rank.
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type)
    total = sw.clip_grad_norm_(sharded.values(), 1.0, norm_type)
    assert not total.isfinite()
    torch.testing.assert_close(total, expected, equal_nan=True)


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("norm_type", "bad"), [(2.0, float("inf")), (float("inf"), float("nan")), (1.0, float("nan"))]
)
def test_error_if_nonfinite_raises_on_every_rank(norm_type: float, bad: float) -> None:
    _nonfinite(norm_type, bad)


@distributed(world_size=2)
def test_sharded_parameters_on_different_groups_are_refused() -> None:
    other = dist.new_group(ranks=[0, 1])
    first = sw.zeros(_spec(2, 0), 4, 2, requires_grad=True)
    second = sw.zeros(_spec(2, 0), 6, 2, requires_grad=True, process_group=other)
    message = (
        "clip_grad_norm_ needs every ShardedTensor parameter on one process group (the norm is "
        "all-reduced over it): parameter 0 (size [4, 2]) and parameter 2 (size [6, 2]) use "
        "different groups"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        sw.clip_grad_norm_([first, nn.Parameter(torch.ones(1)), second], 1.0)
    # One group of its own works.
    sharded, reference = _models(5, group=other)
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    _close(sw.clip_grad_norm_(sharded.values(), 1.0), expected)
    _check_grads(sharded, reference)


@distributed(world_size=4)
def test_a_single_sharded_tensor_and_a_rank_without_gradients() -> None:
    whole = _whole_grads(11)["rows"]
    param = sw.zeros(_spec(4, 0), 5, 3, requires_grad=True)
    for shard in param.local_shards():
        shard.tensor.grad = _box(whole, shard).clone()
    reference = nn.Parameter(torch.zeros(5, 3))
    reference.grad = whole.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, 3.0)
    # A single tensor, as torch accepts; rank 3's shard is empty.
    _close(sw.clip_grad_norm_(param, 0.5, 3.0), expected)
    for shard in param.local_shards():
        _close(shard.tensor.grad, _box(reference.grad, shard))
    # A rank whose shards got no gradient still joins the all-reduce.
    if dist.get_rank() == 0:
        param.local_shards()[0].tensor.grad = None
    reference.grad[:2] = 0
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, float("inf"))
    _close(sw.clip_grad_norm_([param], 0.5, float("inf")), expected)


def _sum_of_losses(model: nn.Module, world: int) -> torch.Tensor:
    total = torch.zeros(())
    for rank in range(world):
        generator = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 10, (6,), generator=generator)
        output: torch.Tensor = model(ids)
        total = total + output.square().sum()
    return total


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(self.embedding(ids))
        return output


@distributed(world_size=4)
def test_gradients_of_a_sharded_backward() -> None:
    """The gradients a sharded op's backward delivers, with the replicated ones summed over
    the ranks (as sync_replicated_grads does), clip like the unsharded model's gradient of the
    sum of the ranks' losses."""
    world, rank = dist.get_world_size(), dist.get_rank()
    net, reference = _Net(), _Net()
    sw.shard_parameter(net.embedding, "weight", _spec(world, 0))
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 10, (6,), generator=generator)
    output: torch.Tensor = net(ids)
    output.square().sum().backward()  # type: ignore[no-untyped-call]
    for param in net.head.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)
    _sum_of_losses(reference, world).backward()  # type: ignore[no-untyped-call]
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    total = sw.clip_grad_norm_(net.parameters(), 1.0)
    _close(total, expected)
    assert expected > 1.0
    weight = net.embedding.weight
    assert isinstance(weight, sw.ShardedTensor) and reference.embedding.weight.grad is not None
    for shard in weight.local_shards():
        assert shard.tensor.grad is not None
        expected_box = _box(reference.embedding.weight.grad, shard)
        _close(shard.tensor.grad, expected_box)
    for param, ref in zip(net.head.parameters(), reference.head.parameters(), strict=True):
        _close(param.grad, ref.grad)


# -- one process, no process group ----------------------------------------------------------


def test_plain_parameters_without_a_process_group() -> None:
    assert not dist.is_initialized()
    for norm_type in NORM_TYPES:
        torch.manual_seed(0)
        model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
        reference.load_state_dict(model.state_dict())
        for m in (model, reference):
            m(torch.ones(2, 4) * 5).sum().backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.7, norm_type)
        total = sw.clip_grad_norm_(model.parameters(), 0.7, norm_type)
        _close(total, expected)
        assert expected > 0.7
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            _close(param.grad, ref.grad)
    # A single tensor; one without a gradient is skipped.
    single = nn.Parameter(torch.zeros(3))
    single.grad = torch.tensor([3.0, 4.0, 0.0])
    torch.testing.assert_close(sw.clip_grad_norm_(single, 1.0), torch.tensor(5.0))
    torch.testing.assert_close(single.grad, torch.tensor([3.0, 4.0, 0.0]) / (5.0 + 1e-6))
    assert torch.equal(sw.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0), torch.tensor(0.0))


def test_empty_generator_warns_as_torch_does() -> None:
    message = "`parameters` is an empty generator, no gradient clipping will occur."
    with pytest.warns(UserWarning, match=re.escape(message)):
        total = sw.clip_grad_norm_((p for p in list[torch.Tensor]()), 1.0)
    assert torch.equal(total, torch.tensor(0.0))


@pytest.mark.parametrize("norm_type", [0.0, -1.0, float("-inf"), float("nan")])
def test_norm_types_that_do_not_add_up_over_ranks_are_refused(norm_type: float) -> None:
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"needs a norm_type > 0 or inf"):
        sw.clip_grad_norm_(param, 1.0, norm_type)
    assert torch.equal(param.grad, torch.ones(2))


def _sync_then_clip(seed: int) -> dict[str, Any]:
    """Each rank's plain gradient differs (its own loss); ``ShardedOptimizer.sync_grads``
    sums them before the clip, so the norm is the reference's and the step sums nothing again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded, reference = _models(seed)
    params = {name: value for name, value in sharded.items()}
    # This rank's share of the plain gradients: their sum over the ranks is the reference's.
    for name, _ in PLAIN[:2]:
        whole = params[name].grad
        assert whole is not None
        params[name].grad = whole * (rank + 1) / (world * (world + 1) / 2)
    optim = sw.ShardedOptimizer(params, torch.optim.SGD, lr=1.0, sync_replicated_grads=True)
    optim.sync_grads()
    for name, _ in PLAIN[:2]:
        _close(params[name].grad, dict(zip(sharded, reference, strict=True))[name].grad)
    norm = sw.clip_grad_norm_(list(params.values()), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    _close(norm, expected)
    _check_grads(sharded, reference)
    before = {name: params[name].detach().clone() for name, _ in PLAIN[:2]}
    optim.step()  # plain parameters move by the clipped summed gradient, once
    for (name, _), ref in zip(PLAIN[:2], reference[len(SHARDED) :], strict=False):
        assert ref.grad is not None
        _close(params[name].detach(), before[name] - ref.grad)
    return {"norm": norm.item()}


@pytest.mark.parametrize("world", [2, 4])
def test_sync_grads_before_the_clip_counts_replicated_gradients_once(world: int) -> None:
    results = run_on_ranks(_sync_then_clip, world, args=(7,))
    assert len({result["norm"] for result in results}) == 1
