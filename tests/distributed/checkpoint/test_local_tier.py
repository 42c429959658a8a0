"""``CheckpointManager(local_tier=...)`` on 4 real gloo ranks as 2 simulated nodes of 2 ranks
(each node its own tier directory under the test's directory): the local saves hold every
part on both nodes; a restore takes the newest local step from the node's own copies or the
peers' replicas, and equals that step saved to durable storage; a corrupt copy counts as
absent (one that the load reads, by a second round that checks every block); one node's
copies gone and the other's corrupt, or both nodes' copies gone, falls back to the durable
tier; a restart on 3 ranks (3 nodes, two of them new) restores from the tier written by 4; a
full directory skips the local save on every rank, one with room for its own parts only holds
no replicas (and the step is still complete); a manager over a subgroup makes its tier's
group among its own ranks, and the world's later groups still meet."""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint.local_tier import parts as part_files
from tests.harness import distributed

WORLD = 4
LOCAL = 2
SHAPE = (12, 5)


def _full(step: int) -> torch.Tensor:
    return torch.arange(12 * 5, dtype=torch.float32).reshape(SHAPE) + 1000 * step


def _state(step: int, world: int = WORLD, group: Any = None) -> dict[str, Any]:
    """This rank's state at ``step``, rows sharded over ``world`` ranks (no communication)."""
    spec = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(world)])
    metadata = spec.build_metadata(torch.Size(SHAPE), sw.TensorProperties(dtype=torch.float32))
    full, rank = _full(step), dist.get_rank()
    local = [
        sw.Shard(full[md.shard_offsets[0] : md.shard_offsets[0] + md.shard_sizes[0]].clone(), md)
        for md in metadata.shards_metadata
        if md.placement is not None and md.placement.rank() == rank
    ]
    sharded = sw.init_from_local_shards_and_global_metadata(local, metadata, process_group=group)
    return {"model": {"sharded": sharded, "bias": torch.full((3,), float(step))}, "step": step}


def _values(state: dict[str, Any]) -> list[torch.Tensor]:
    shards = [shard.tensor for shard in state["model"]["sharded"].local_shards()]
    return [*shards, state["model"]["bias"], torch.tensor(state["step"])]


def _shared_dir(tmp_path: Path) -> Path:
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


def _tier(base: Path, node: int, local: int = LOCAL, **options: Any) -> ckpt.LocalTier:
    return ckpt.LocalTier(
        every_steps=2,
        job_id="job-36",
        directory=base / f"node{node}",
        local_world_size=local,
        **options,
    )


def _train(base: Path) -> None:
    """Steps 1 to 6: durable every 4 (step 4), local every 2 (steps 4 and 6 kept); and a
    durable reference copy of step 6."""
    node = dist.get_rank() // LOCAL
    policy = ckpt.SavePolicy(every_steps=4)
    with ckpt.CheckpointManager(
        base / "run", save_policy=policy, async_save=False, local_tier=_tier(base, node)
    ) as manager:
        for step in range(1, 7):
            manager.save(step, _state(step))
    ckpt.save(_state(6), base / "reference-6")


def _restore(base: Path) -> tuple[int | None, str | None, dict[str, Any]]:
    node = dist.get_rank() // LOCAL
    manager = ckpt.CheckpointManager(base / "run", local_tier=_tier(base, node))
    state = _state(0)
    step = manager.restore(None, state)
    manager.close()
    return step, manager.restored_from, state


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logged to ``name`` (warnings and above) in the block."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _corrupt(part: Path) -> None:
    """One bit of the part's data file flipped, near its end (in its last block)."""
    data = next((part / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-2] ^= 0x01
    data.write_bytes(bytes(raw))


def _barrier_then(action: Any) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


@distributed(world_size=WORLD, timeout=60)
def test_restore_from_own_copies_peers_and_durable(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    _train(base)
    for node in (0, 1):  # every part on both nodes: its owner's and its replica
        for step in (4, 6):
            held = sorted(p.name for p in (base / f"node{node}" / f"step_{step}").iterdir())
            assert held == [f"rank_{r}" for r in range(WORLD)]
    assert not (base / "node0" / "step_2").exists()  # keep=2
    for node in (0, 1):  # step 2's data files, own and replicas, became step 6's
        assert list((base / f"node{node}" / "spare").iterdir()) == []
    reference = _state(0)
    ckpt.load(reference, base / "reference-6")

    step, source, state = _restore(base)
    assert (step, source) == (6, "local")
    for got, want in zip(_values(state), _values(reference), strict=True):
        assert torch.equal(got, want)

    # Node 0's copy of part 2 (a replica) corrupt: no load reads it there, node 1's is used.
    _barrier_then(lambda: _corrupt(base / "node0" / "step_6" / "rank_2"))
    step, source, state = _restore(base)
    assert (step, source) == (6, "local")
    for got, want in zip(_values(state), _values(reference), strict=True):
        assert torch.equal(got, want)

    # Node 1's copy of part 3, which rank 3's load reads there: the first round trusts its
    # layout, the load finds the bad block, the second round checks every block, counts it
    # as absent and fetches node 0's copy.
    _barrier_then(lambda: _corrupt(base / "node1" / "step_6" / "rank_3"))
    with _logged("shardwise.checkpoint.local_tier") as messages:
        step, source, state = _restore(base)
    assert (step, source) == (6, "local")
    assert any("checking every block" in message for message in messages)
    for got, want in zip(_values(state), _values(reference), strict=True):
        assert torch.equal(got, want)

    # Node 1 lost (its directory gone): part 2 of step 6 is only on node 0, corrupt; step 4
    # is complete on node 0 but not newer than the durable step 4.
    _barrier_then(lambda: shutil.rmtree(base / "node1"))
    step, source, state = _restore(base)
    assert (step, source) == (4, "durable")
    for got, want in zip(_values(state), _values(_state(4)), strict=True):
        assert torch.equal(got, want)

    # Both nodes' directories gone: the durable tier, as without a local tier.
    _barrier_then(lambda: [shutil.rmtree(base / f"node{node}") for node in (0, 1)])
    step, source, state = _restore(base)
    assert (step, source) == (4, "durable")
    for got, want in zip(_values(state), _values(_state(4)), strict=True):
        assert torch.equal(got, want)


@distributed(world_size=WORLD, timeout=60)
def test_node_lost_restores_from_peers_and_then_on_three_ranks(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    _train(base)
    # Node 0 lost: its ranks restart with empty directories, parts come from node 1: only
    # those their loads read (their own rows, and rank 0's, which holds the replicated bias).
    _barrier_then(lambda: shutil.rmtree(base / "node0"))
    received: dict[str, int] = {}  # the data files this rank received: bytes of them
    sizes: dict[str, int] = {}
    kept = part_files.ReceivedParts

    def counted(root: str, index: Any, pieces: Any) -> Any:
        for name, got in pieces.items():
            received[name] = sum(len(data) for _, data in got)
            sizes[name] = index.files[name]
        return kept(root, index, pieces)

    part_files.ReceivedParts = counted  # type: ignore[misc]
    try:
        step, source, state = _restore(base)
    finally:
        part_files.ReceivedParts = kept  # type: ignore[misc]
    assert (step, source) == (6, "local")
    assert len(received) == {0: 1, 1: 2, 2: 0, 3: 0}[dist.get_rank()]  # not the 4 parts
    assert all(received[name] <= sizes[name] for name in received)
    for got, want in zip(_values(state), _values(_state(6)), strict=True):
        assert torch.equal(got, want)
    assert not any(p.name.startswith("restore_") for p in (base / "node1").iterdir())

    # A restart on 3 ranks, one node each: node 1's directory, and two new ones.
    group = dist.new_group([0, 1, 2], backend="gloo")
    if dist.get_rank() == 3:
        return
    node = {0: 1, 1: 2, 2: 3}[dist.get_rank()]
    manager = ckpt.CheckpointManager(
        base / "run", process_group=group, local_tier=_tier(base, node, local=1)
    )
    state = _state(0, world=3, group=group)
    assert manager.restore(None, state) == 6
    assert manager.restored_from == "local"
    manager.close()
    for shard in state["model"]["sharded"].local_shards():
        first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        assert torch.equal(shard.tensor, _full(6)[first : first + count])
    assert torch.equal(state["model"]["bias"], torch.full((3,), 6.0))


@distributed(world_size=WORLD, timeout=60)
def test_a_full_directory_skips_the_local_save_on_every_rank(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    node = dist.get_rank() // LOCAL
    # Node 1 "full": its save would leave less than min_free_bytes.
    tier = _tier(base, node, min_free_bytes=1 << 62 if node == 1 else 0)
    manager = ckpt.CheckpointManager(base / "run", async_save=False, local_tier=tier)
    with pytest.warns(ckpt.LocalTierWarning, match="skipped the local save of step 2"):
        assert manager.save(2, _state(2))  # the durable save is made
    manager.close()
    assert not (base / "node0" / "step_2").exists()
    manager = ckpt.CheckpointManager(base / "run", local_tier=_tier(base, node))
    state = _state(0)
    assert manager.restore(None, state) == 2
    assert manager.restored_from == "durable"
    manager.close()
    fresh = ckpt.CheckpointManager(base / "fresh", local_tier=_tier(base, node))
    assert fresh.restore(None, _state(0)) is None
    assert fresh.restored_from is None
    fresh.close()


@distributed(world_size=WORLD, timeout=60)
def test_a_node_with_room_for_its_own_parts_only_holds_no_replicas(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    node = dist.get_rank() // LOCAL
    never = ckpt.SavePolicy(every_steps=10**9)
    tier = _tier(base, node, min_free_bytes=0)
    manager = ckpt.CheckpointManager(
        base / "run", save_policy=never, async_save=False, local_tier=tier
    )
    if node == 1:  # 3 MiB free: its own two parts fit (about 1 MiB each), not with replicas
        assert manager._tier is not None
        directory = manager._tier.directory
        check = directory.check_space

        def three_mib(needed: int, *, min_free_bytes: int, free_bytes: int | None = None) -> Any:
            return check(needed, min_free_bytes=min_free_bytes, free_bytes=3 << 20)

        directory.check_space = three_mib  # type: ignore[method-assign]
        with pytest.warns(ckpt.LocalTierWarning, match="holds no replicas"):
            manager.save(2, _state(2))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ckpt.LocalTierWarning)
            manager.save(2, _state(2))
    manager.close()
    held = {n: sorted(p.name for p in (base / f"node{n}" / "step_2").iterdir()) for n in (0, 1)}
    assert held == {0: [f"rank_{r}" for r in range(WORLD)], 1: ["rank_2", "rank_3"]}
    # The step is complete: node 1 lost, node 0 holds every part.
    _barrier_then(lambda: shutil.rmtree(base / "node1"))
    step, source, state = _restore(base)
    assert (step, source) == (2, "local")
    for got, want in zip(_values(state), _values(_state(2)), strict=True):
        assert torch.equal(got, want)


def _fill(state: dict[str, Any], step: int) -> None:
    """``state`` (made by ``_state``) set to step ``step``'s values, in place."""
    for got, want in zip(_values(state)[:-1], _values(_state(step))[:-1], strict=True):
        got.copy_(want)
    state["step"] = step


@distributed(world_size=WORLD, timeout=60)
def test_background_local_saves_keep_the_state_of_their_step(tmp_path: Path) -> None:
    # async_save (the default): save() returns once the state is staged; the tensors are then
    # changed in place at once, as the optimizer's next step would, while the thread writes.
    base = _shared_dir(tmp_path)
    node = dist.get_rank() // LOCAL
    policy = ckpt.SavePolicy(every_steps=4)
    state = _state(0)
    with ckpt.CheckpointManager(
        base / "run", save_policy=policy, local_tier=_tier(base, node)
    ) as manager:
        for step in range(1, 7):
            _fill(state, step)
            manager.save(step, state)
            for tensor in _values(state)[:-1]:
                tensor.fill_(-1.0)
    for node_dir in ("node0", "node1"):
        held = sorted(p.name for p in (base / node_dir / "step_6").iterdir())
        assert held == [f"rank_{r}" for r in range(WORLD)]
    step, source, restored = _restore(base)
    assert (step, source) == (6, "local")
    for got, want in zip(_values(restored), _values(_state(6)), strict=True):
        assert torch.equal(got, want)


@distributed(world_size=WORLD, timeout=60)
def test_a_background_local_save_skipped_warns_at_the_next_call(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    node = dist.get_rank() // LOCAL
    tier = _tier(base, node, min_free_bytes=1 << 62 if node == 1 else 0)
    manager = ckpt.CheckpointManager(base / "run", local_tier=tier)
    assert manager.save(2, _state(2))  # returns at once: the verdict is the thread's
    with pytest.warns(ckpt.LocalTierWarning, match="skipped the local save of step 2"):
        manager.wait()
    manager.close()
    assert not (base / "node0" / "step_2").exists()
    assert (base / "run").is_dir() and ckpt.CheckpointManager(base / "run").latest_step() == 2


@distributed(world_size=WORLD, timeout=60)
def test_a_manager_over_a_subgroup_makes_its_groups_among_its_own_ranks(tmp_path: Path) -> None:
    # Each pair of ranks runs a job of its own over a subgroup (one rank per node), while the
    # other pair is busy elsewhere and does not call: the tier's own gloo group (made at the
    # first background save) is made by the pair alone, and the groups the whole world makes
    # afterwards still meet.
    base = _shared_dir(tmp_path)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    never = ckpt.SavePolicy(every_steps=100)  # the local tier alone

    def state(step: int, mesh: DeviceMesh) -> dict[str, Any]:
        full = _full(step)
        return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}

    for turn, group in enumerate(pairs):
        if rank // 2 == turn:
            mesh = DeviceMesh.from_group(group, "cpu")
            job = base / f"pair{turn}"
            tier = ckpt.LocalTier(
                every_steps=1,
                job_id=f"pair-{turn}",
                directory=job / f"node{rank % 2}",
                local_world_size=1,
                min_free_bytes=0,
            )
            with ckpt.CheckpointManager(
                job / "run", process_group=group, save_policy=never, local_tier=tier
            ) as manager:
                for step in (1, 2):
                    manager.save(step, state(step, mesh))
            manager = ckpt.CheckpointManager(job / "run", process_group=group, local_tier=tier)
            restored = state(0, mesh)
            assert manager.restore(None, restored) == 2
            assert manager.restored_from == "local"
            manager.close()
            assert torch.equal(restored["w"].full_tensor(), _full(2))
            assert sorted(p.name for p in (job / f"node{rank % 2}" / "step_2").iterdir()) == [
                "rank_0",
                "rank_1",
            ]
        everyone = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
        total = torch.ones(1)
        dist.all_reduce(total, group=everyone)
        assert total.item() == WORLD
