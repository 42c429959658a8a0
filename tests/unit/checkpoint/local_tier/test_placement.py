"""Placement of replicas on the ring of nodes: examples, the environment, and the properties
(no replica on its owner's node, distinct nodes, even load, surviving any ``replicas`` nodes)."""

from __future__ import annotations

import ast
import itertools
import math
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.local_tier import (
    Topology,
    effective_replicas,
    local_world_size_from_environment,
    place_replicas,
)

_PACKAGE = pathlib.Path(__file__).parents[4] / "src/shardwise/checkpoint/local_tier"


def test_two_nodes_of_two() -> None:
    placement = place_replicas(Topology(world_size=4, local_world_size=2), 1)
    assert placement.holders == ((2,), (3,), (0,), (1,))
    assert placement.held_by(0) == (2,)
    assert not placement.degraded


def test_three_nodes_two_replicas() -> None:
    placement = place_replicas(Topology(world_size=6, local_world_size=2), 2)
    assert placement.holders[0] == (2, 4)
    assert placement.holders[5] == (1, 3)
    assert placement.held_by(0) == (4, 2)


@pytest.mark.parametrize(("nodes", "asked", "held"), [(1, 1, 0), (2, 3, 1), (4, 2, 2), (3, 0, 0)])
def test_degrades_to_the_other_nodes(nodes: int, asked: int, held: int) -> None:
    placement = place_replicas(Topology(world_size=nodes * 2, local_world_size=2), asked)
    assert (placement.requested, placement.replicas) == (asked, held)
    assert placement.degraded == (held < asked)
    assert all(len(holders) == held for holders in placement.holders)


def test_topology() -> None:
    topology = Topology(world_size=6, local_world_size=3)
    assert topology.num_nodes == 2
    assert [topology.node_of(rank) for rank in range(6)] == [0, 0, 0, 1, 1, 1]
    assert topology.ranks_of(1) == range(3, 6)
    with pytest.raises(ValueError, match="rank 6"):
        topology.node_of(6)
    with pytest.raises(ValueError, match="node 2"):
        topology.ranks_of(2)


@pytest.mark.parametrize(
    ("world", "local", "error"),
    [(6, 4, ValueError), (0, 1, ValueError), (4, 0, ValueError), (4, True, TypeError)],
)
def test_topology_refused(world: int, local: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        Topology(world_size=world, local_world_size=local)


def test_local_world_size_from_environment() -> None:
    assert local_world_size_from_environment({}, 8) == 8
    assert local_world_size_from_environment({"LOCAL_WORLD_SIZE": "4"}, 8) == 4
    for text in ("3", "0", "-4", " 4", "4_0", "\u0664", "", "four"):
        with pytest.raises(ValueError):
            local_world_size_from_environment({"LOCAL_WORLD_SIZE": text}, 8)


def test_effective_replicas_refuses() -> None:
    with pytest.raises(ValueError):
        effective_replicas(-1, 2)
    with pytest.raises(ValueError):
        effective_replicas(True, 2)
    with pytest.raises(ValueError):
        effective_replicas(1, 0)


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 7), local=st.integers(1, 4), asked=st.integers(0, 8))
def test_placement_properties(nodes: int, local: int, asked: int) -> None:
    topology = Topology(world_size=nodes * local, local_world_size=local)
    placement = place_replicas(topology, asked)
    assert placement == place_replicas(topology, asked)
    held = placement.replicas
    assert held == min(asked, nodes - 1)
    load = [0] * topology.world_size
    for owner, holders in enumerate(placement.holders):
        assert len(holders) == held
        node_set = {topology.node_of(holder) for holder in holders}
        assert topology.node_of(owner) not in node_set
        assert len(node_set) == held
        for holder in holders:
            load[holder] += 1
            assert owner in placement.held_by(holder)
    bound = math.ceil(held * topology.world_size / topology.world_size)
    assert all(count <= bound for count in load)
    assert all(len(placement.held_by(rank)) == load[rank] for rank in range(len(load)))
    # Any `held` nodes lost together leave every part with a copy.
    for lost in itertools.combinations(range(nodes), held):
        for owner, holders in enumerate(placement.holders):
            alive = [r for r in (owner, *holders) if topology.node_of(r) not in lost]
            assert alive


def test_pure_modules_import_no_torch() -> None:
    for name in ("placement.py", "agreement.py"):
        tree = ast.parse((_PACKAGE / name).read_text())
        imported = [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        ] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [module for module in imported if module.split(".")[0] == "torch"], name
