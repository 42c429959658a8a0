"""Self-tests of the multi-process harness (tests/harness.py).

Worker processes are the expensive part (each imports torch), so the tests are ordered to
reuse pools: the ones that kill a pool on purpose come last for their world size.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import DistributedTestError, HarnessError, distributed, run_on_ranks

# Also the tests that call run_on_ranks directly: `-m "not distributed"` skips the whole file.
pytestmark = pytest.mark.distributed

# -- bodies run through run_on_ranks: module level, since the workers import them by name -----


def _rank_info() -> tuple[int, int, float, str]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), dist.get_backend()


def _pid() -> int:
    return os.getpid()


def _fail_on_rank_1(expected: int) -> int:
    actual = dist.get_rank() * 10
    if dist.get_rank() == 1:
        assert actual == expected, "rank-1 specific message"
    return actual


def _raise_while_others_wait() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins


def _rank0_waits_alone() -> int:
    if dist.get_rank() == 0:
        dist.barrier()  # the other ranks never join
    return dist.get_rank()


def _fresh_info() -> tuple[int, int, int]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid(), dist.get_world_size(), int(t.item())


def _warn_as(module: str) -> str:
    warnings.warn_explicit("deprecated thing", DeprecationWarning, "fake.py", 1, module=module)
    return "no error"


def _skip_on_all_ranks() -> None:
    pytest.skip("not today")


def _print_rank() -> None:
    print(f"hello from rank {dist.get_rank()}")


def _destroy_default_group() -> None:
    dist.destroy_process_group()


def _unpicklable_result() -> object:
    return lambda: None


# -- no worker needed --------------------------------------------------------------------------


def test_bodies_that_cannot_be_sent_are_rejected_before_spawning() -> None:
    def local_body() -> None:
        pass

    with pytest.raises(HarnessError, match="module-level"):
        run_on_ranks(local_body, 2)
    with pytest.raises(HarnessError, match="'lock'"):
        run_on_ranks(_pid, 2, kwargs={"lock": __import__("threading").Lock()})
    with pytest.raises(ValueError, match="world_size"):
        distributed(world_size=0)


def test_decorator_keeps_signature_and_adds_marks() -> None:
    import inspect

    test = test_params_and_tmp_path_are_forwarded
    assert list(inspect.signature(test).parameters) == ["n", "tmp_path"]
    marks = {mark.name: mark for mark in test.pytestmark}
    assert marks["parametrize"].args == ("n", [1, 3])
    assert marks["distributed"].kwargs == {"world_size": 2, "fresh": False, "rpc": False}
    assert marks["timeout"].args[0] > harness.DEFAULT_TIMEOUT  # pytest-timeout is a backstop


# -- pooled groups -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_on_each_world_size(world_size: int) -> None:
    infos = run_on_ranks(_rank_info, world_size)
    total = float(sum(range(world_size)))
    assert infos == [(rank, world_size, total, "gloo") for rank in range(world_size)]


@distributed(world_size=4)
def test_decorated_body_runs_on_every_rank() -> None:
    rank = dist.get_rank()
    t = torch.ones(1) * rank
    dist.all_reduce(t)
    assert t.item() == 6
    gathered = [torch.zeros(2) for _ in range(4)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank], dtype=torch.float32))
    assert [g.tolist() for g in gathered] == [[r, r * r] for r in range(4)]
    assert torch.get_num_threads() == 1


@distributed(world_size=4)
@pytest.mark.parametrize("members", [[1, 2], [0, 3]])
def test_subgroup(members: list[int]) -> None:
    rank = dist.get_rank()
    group = dist.new_group(members)
    t = torch.tensor([float(rank + 1)])
    if rank in members:
        dist.all_reduce(t, group=group)
        assert t.item() == sum(m + 1 for m in members)
        assert dist.get_world_size(group) == 2
        assert dist.get_rank(group) == members.index(rank)
    else:
        assert group is dist.GroupMember.NON_GROUP_MEMBER
        assert t.item() == rank + 1  # non-members are unaffected
    everyone = torch.ones(1)
    dist.all_reduce(everyone)  # the default group still works for all
    assert everyone.item() == 4


def test_pool_is_reused() -> None:
    first = run_on_ranks(_pid, 2)
    second = run_on_ranks(_pid, 2)
    assert first == second == harness.pool_pids(2)
    assert len(set(first)) == 2
    assert os.getpid() not in first


@distributed(world_size=2)
@pytest.mark.parametrize("n", [1, 3])
def test_params_and_tmp_path_are_forwarded(n: int, tmp_path: Path) -> None:
    rank = dist.get_rank()
    (tmp_path / f"rank{rank}.txt").write_text(str(n * (rank + 1)))
    dist.barrier()
    if rank == 0:
        values = sorted(int(p.read_text()) for p in tmp_path.glob("rank*.txt"))
        assert values == [n, 2 * n]
    dist.barrier()  # rank 1's file must outlive rank 0's read


@pytest.mark.parametrize("word", ["ab", "cde"])
@distributed(world_size=2)
def test_marks_above_the_decorator_work_too(word: str) -> None:
    lengths = torch.tensor([len(word) * (dist.get_rank() + 1)])
    dist.all_reduce(lengths)
    assert lengths.item() == 3 * len(word)


class TestInAClass:
    @distributed(world_size=2)
    def test_method(self, tmp_path: Path) -> None:
        assert isinstance(self, TestInAClass)
        assert os.path.isdir(tmp_path)


def test_assertion_on_one_rank_names_it_with_its_traceback() -> None:
    pids = run_on_ranks(_pid, 3)
    with pytest.raises(DistributedTestError) as info:
        run_on_ranks(_fail_on_rank_1, 3, args=(7,))
    failure = info.value
    assert sorted(failure.errors) == [1]
    assert failure.stuck == []
    assert not failure.timed_out
    message = str(failure)
    assert "failed ranks: [1]" in message
    assert "passed ranks: [0, 2]" in message
    assert "rank 1 raised" in message
    assert "rank 0 raised" not in message
    assert "Traceback (most recent call last)" in message
    assert "in _fail_on_rank_1" in message
    assert "rank-1 specific message" in message
    assert "assert 10 == 7" in message  # asserts are rewritten in the workers too
    # The other ranks finished and the group is consistent: the pool was kept.
    assert harness.pool_pids(3) == pids


def test_unpicklable_return_value_is_reported() -> None:
    with pytest.raises(DistributedTestError, match="cannot be pickled"):
        run_on_ranks(_unpicklable_result, 1)


def test_shardwise_warnings_are_errors_in_workers_but_torch_warnings_are_not() -> None:
    with pytest.raises(DistributedTestError, match="DeprecationWarning: deprecated thing"):
        run_on_ranks(_warn_as, 1, args=("shardwise.sharded_tensor",))
    assert run_on_ranks(_warn_as, 1, args=("torch.distributed",)) == ["no error"]


def test_skip_in_body_skips() -> None:
    with pytest.raises(pytest.skip.Exception, match="not today"):
        run_on_ranks(_skip_on_all_ranks, 1)


def test_worker_output_reaches_captured_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    run_on_ranks(_print_rank, 2)
    out = capsys.readouterr().out
    for rank in (0, 1):
        header = f"----- pooled group (world_size=2) rank {rank} -----\n"
        assert header in out
        assert f"hello from rank {rank}\n" in out.split(header, 1)[1]


# -- dedicated processes -----------------------------------------------------------------------


def test_fresh_group_uses_its_own_processes() -> None:
    pooled = run_on_ranks(_pid, 2)
    fresh = run_on_ranks(_fresh_info, 2, fresh=True)
    assert [(size, total) for _, size, total in fresh] == [(2, 2), (2, 2)]
    fresh_pids = {pid for pid, _, _ in fresh}
    assert len(fresh_pids) == 2
    assert fresh_pids.isdisjoint(pooled)
    assert harness.pool_pids(2) == pooled  # the pool is untouched
    for pid in fresh_pids:  # and the fresh processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@distributed(world_size=2, rpc=True)
def test_rpc() -> None:
    from torch.distributed import rpc

    rank = dist.get_rank()
    assert rpc.get_worker_info().name == f"worker{rank}"
    if rank == 0:
        result = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        assert result.tolist() == [2.0, 2.0]
    t = torch.ones(1)
    dist.all_reduce(t)  # the default gloo group exists alongside RPC
    assert t.item() == 2


# -- failures that kill a pool (last for their world size) -------------------------------------


def test_hang_times_out_names_stuck_rank_and_pool_restarts() -> None:
    old_pids = run_on_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_on_ranks(_rank0_waits_alone, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 10
    failure = info.value
    assert failure.timed_out
    assert failure.stuck == [0]
    assert failure.errors == {}
    message = str(failure)
    assert "timed out after 3 s" in message
    assert "stuck ranks: [0]" in message
    assert "passed ranks: [1]" in message
    assert "in barrier" in message  # rank 0's stack when it was killed
    assert "in _rank0_waits_alone" in message
    assert harness.pool_pids(2) is None  # killed
    # The next run on that world size gets a new, working pool.
    assert run_on_ranks(_rank_info, 2) == [(0, 2, 1.0, "gloo"), (1, 2, 1.0, "gloo")]
    assert set(run_on_ranks(_pid, 2)).isdisjoint(old_pids)


def test_body_that_breaks_the_pooled_group_fails_the_health_check() -> None:
    with pytest.raises(DistributedTestError, match="health check") as info:
        run_on_ranks(_destroy_default_group, 1)
    assert "fresh=True" in str(info.value)
    assert harness.pool_pids(1) is None


def test_exception_while_others_wait_in_a_collective_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_on_ranks(_raise_while_others_wait, 3, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 15
    failure = info.value
    assert not failure.timed_out
    assert sorted(failure.errors) == [1]
    assert failure.stuck == [0, 2]
    message = str(failure)
    assert "RuntimeError: rank 1 gives up" in message
    assert "stuck ranks: [0, 2]" in message
    assert "rank 0 stuck" in message
    assert "rank 2 stuck" in message
    assert "in all_reduce" in message
    assert harness.pool_pids(3) is None
