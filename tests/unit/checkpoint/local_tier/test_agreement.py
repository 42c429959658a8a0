"""Agreement on the step to restore and the transfer plan: untrusted records refused, the
verdict against a plain model (hypothesis), and the properties of the plan."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.local_tier import (
    HeldStep,
    Holdings,
    Topology,
    Verdict,
    choose_step,
    parse_gathered,
    parse_holdings,
    parse_needs,
    place_replicas,
    plan_transfers,
)
from shardwise.checkpoint.local_tier.agreement import MAX_STEP, needs_to_json
from shardwise.errors import CheckpointError, CheckpointFormatError

A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


def _held(step: int, parts: set[int], world_size: int = 4, save_id: str = A) -> HeldStep:
    return HeldStep(step=step, save_id=save_id, world_size=world_size, parts=frozenset(parts))


def _entry(**changes: Any) -> dict[str, Any]:
    return {"step": 10, "save_id": A, "world_size": 4, "parts": [0, 2], **changes}


# -- records ---------------------------------------------------------------------------------


def test_record_round_trip() -> None:
    holdings = Holdings(rank=1, held=(_held(20, {3, 1}), _held(10, {0}, save_id=B)))
    record = json.loads(json.dumps(holdings.to_json()))
    assert record["held"][0]["step"] == 10
    assert record["held"][1]["parts"] == [1, 3]
    parsed = parse_holdings(record, rank=1)
    assert set(parsed.held) == set(holdings.held)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ([], "not a JSON object"),
        ({"rank": 0}, "keys"),
        ({"rank": 0, "held": [], "extra": 1}, "keys"),
        ({0: 0, "held": []}, "keys"),
        ({"rank": 1, "held": []}, "says it is rank 1"),
        ({"rank": False, "held": []}, "says it is rank False"),
        ({"rank": 0, "held": {}}, "not a list"),
        ({"rank": 0, "held": [[]]}, "not a JSON object"),
        ({"rank": 0, "held": [_entry(step=-1)]}, "step -1"),
        ({"rank": 0, "held": [_entry(step=True)]}, "step True"),
        ({"rank": 0, "held": [_entry(step=1.0)]}, "step 1.0"),
        ({"rank": 0, "held": [_entry(step=MAX_STEP + 1)]}, "step"),
        ({"rank": 0, "held": [_entry(save_id="AAAAAAAAAAAAAAAA")]}, "save_id"),
        ({"rank": 0, "held": [_entry(save_id="abc")]}, "save_id"),
        ({"rank": 0, "held": [_entry(save_id=None)]}, "save_id"),
        ({"rank": 0, "held": [_entry(world_size=0)]}, "world_size 0"),
        ({"rank": 0, "held": [_entry(world_size="4")]}, "world_size '4'"),
        ({"rank": 0, "held": [_entry(parts=[])]}, "non-empty list"),
        ({"rank": 0, "held": [_entry(parts=(0,))]}, "non-empty list"),
        ({"rank": 0, "held": [_entry(parts=[4])]}, "part 4"),
        ({"rank": 0, "held": [_entry(parts=[-1])]}, "part -1"),
        ({"rank": 0, "held": [_entry(parts=[True])]}, "part True"),
        ({"rank": 0, "held": [_entry(parts=[1, 1])]}, "repeat"),
        ({"rank": 0, "held": [_entry(), _entry(parts=[1])]}, "twice"),
    ],
)
def test_malformed_records_are_refused(record: object, words: str) -> None:
    with pytest.raises(CheckpointFormatError, match=words) as caught:
        parse_holdings(record, rank=0)
    assert caught.value.rank == 0
    assert isinstance(caught.value, (CheckpointError, ValueError))


def test_parse_gathered_names_the_first_bad_rank() -> None:
    good = {"rank": 0, "held": [_entry()]}
    with pytest.raises(CheckpointFormatError, match=r"rank 1\)") as caught:
        parse_gathered([good, {"rank": 1, "held": None}, None])
    assert caught.value.rank == 1
    assert parse_gathered([good])[0].held[0].parts == frozenset({0, 2})


_HELD = st.builds(
    _held,
    step=st.integers(0, MAX_STEP),
    parts=st.sets(st.integers(0, 7), min_size=1),
    world_size=st.just(8),
    save_id=st.sampled_from([A, B]),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(_HELD, max_size=4, unique_by=lambda h: (h.step, h.save_id)), st.integers(0, 9))
def test_any_record_round_trips(held: list[HeldStep], rank: int) -> None:
    holdings = Holdings(rank=rank, held=tuple(held))
    parsed = parse_holdings(json.loads(json.dumps(holdings.to_json())), rank=rank)
    assert set(parsed.held) == set(held)


# -- the verdict -----------------------------------------------------------------------------


def _after_losing_node(step: int, lost_node: int) -> list[Holdings]:
    """2 nodes x 2 ranks saved ``step`` with one replica; the ranks of ``lost_node`` restart
    on a fresh node holding nothing."""
    topology = Topology(world_size=4, local_world_size=2)
    placement = place_replicas(topology, 1)
    holdings = []
    for rank in range(4):
        if topology.node_of(rank) == lost_node:
            holdings.append(Holdings(rank=rank, held=()))
            continue
        parts = {rank, *placement.held_by(rank)}
        holdings.append(Holdings(rank=rank, held=(_held(step, parts),)))
    return holdings


@pytest.mark.parametrize("lost_node", [0, 1])
def test_one_node_lost_restores_from_replicas(lost_node: int) -> None:
    verdict = choose_step(_after_losing_node(30, lost_node), durable_step=20)
    assert (verdict.source, verdict.step, verdict.save_id, verdict.world_size) == (
        "local",
        30,
        A,
        4,
    )
    alive = (2, 3) if lost_node == 0 else (0, 1)
    assert all(set(holders) <= set(alive) and holders for holders in verdict.holders)


def test_incomplete_newest_falls_back_to_an_older_local_step() -> None:
    holdings = [
        Holdings(rank=0, held=(_held(40, {0, 1}), _held(30, {0, 1}))),
        Holdings(rank=1, held=(_held(30, {2, 3}),)),
    ]
    verdict = choose_step(holdings, durable_step=None)
    assert (verdict.source, verdict.step) == ("local", 30)
    assert verdict.holders == ((0,), (0,), (1,), (1,))
    assert verdict.notes == (
        "local step 40 (save aaaaaaaaaaaaaaaa): no live rank holds the parts of saved ranks 2, 3",
    )


@pytest.mark.parametrize("durable", [30, 31])
def test_durable_wins_unless_local_is_newer(durable: int) -> None:
    verdict = choose_step(_after_losing_node(30, 0), durable_step=durable)
    assert verdict == Verdict(
        source="durable",
        step=durable,
        notes=(f"local step 30 is not newer than durable step {durable}",),
    )


def test_nothing_anywhere() -> None:
    assert choose_step([Holdings(rank=0, held=())], None) == Verdict(source="durable", step=None)
    assert choose_step([], 5).step == 5


def test_parts_of_two_saves_of_a_step_are_never_mixed() -> None:
    holdings = [
        Holdings(rank=0, held=(_held(50, {0, 1}, save_id=A),)),
        Holdings(rank=1, held=(_held(50, {2, 3}, save_id=B),)),
    ]
    assert choose_step(holdings, durable_step=None).source == "durable"


def test_two_complete_saves_of_a_step_take_the_greater_id() -> None:
    holdings = [
        Holdings(rank=0, held=(_held(50, {0, 1}, 2, A), _held(50, {0, 1}, 2, B))),
    ]
    assert choose_step(holdings, None).save_id == B


def test_holders_disagreeing_on_the_world_size() -> None:
    holdings = [
        Holdings(rank=0, held=(_held(50, {0, 1}, world_size=2),)),
        Holdings(rank=1, held=(_held(50, {0, 1, 2, 3}, world_size=4),)),
    ]
    verdict = choose_step(holdings, None)
    assert verdict.source == "durable"
    assert "disagree on the world size" in verdict.notes[0]


def test_durable_step_is_checked() -> None:
    with pytest.raises(ValueError, match="durable_step"):
        choose_step([], -1)
    with pytest.raises(ValueError, match="durable_step"):
        choose_step([], True)  # type: ignore[arg-type]


def _model(holdings: list[Holdings], durable: int | None) -> tuple[int, str] | None:
    """The verdict in words: the newest (step, save) newer than durable whose holders agree on
    one world size and together hold every part."""
    best = None
    keys = {(h.step, h.save_id) for holding in holdings for h in holding.held}
    for step, save_id in keys:
        entries = [
            h
            for holding in holdings
            for h in holding.held
            if (h.step, h.save_id) == (step, save_id)
        ]
        sizes = {h.world_size for h in entries}
        if (durable is not None and step <= durable) or len(sizes) != 1:
            continue
        if set().union(*(h.parts for h in entries)) == set(range(sizes.pop())):
            best = max(best or (step, save_id), (step, save_id))
    return best


_SMALL_HELD = st.builds(
    _held,
    step=st.integers(0, 5),
    parts=st.sets(st.integers(0, 2), min_size=1),
    world_size=st.sampled_from([3, 3, 3, 4]),
    save_id=st.sampled_from([A, B]),
)
_LIVE = st.lists(
    st.lists(_SMALL_HELD, max_size=3, unique_by=lambda h: (h.step, h.save_id)), max_size=4
).map(lambda ranks: [Holdings(rank=r, held=tuple(held)) for r, held in enumerate(ranks)])


@settings(max_examples=60, deadline=None)
@given(_LIVE, st.none() | st.integers(0, 5), st.randoms(use_true_random=False))
def test_verdict_matches_the_model(holdings: list[Holdings], durable: int | None, rnd: Any) -> None:
    verdict = choose_step(holdings, durable)
    expected = _model(holdings, durable)
    if expected is None:
        assert (verdict.source, verdict.step) == ("durable", durable)
    else:
        assert (verdict.source, verdict.step, verdict.save_id) == ("local", *expected)
        for part, holders in enumerate(verdict.holders):
            for rank in holders:
                (entry,) = [h for h in holdings[rank].held if (h.step, h.save_id) == expected]
                assert part in entry.parts
    # The same input on every rank, in any order of a rank's own entries: the same verdict.
    shuffled = [Holdings(h.rank, tuple(rnd.sample(h.held, len(h.held)))) for h in holdings]
    assert choose_step(shuffled, durable) == verdict


# -- the transfer plan -----------------------------------------------------------------------


def _local(holders: tuple[tuple[int, ...], ...]) -> Verdict:
    return Verdict(source="local", step=1, save_id=A, world_size=len(holders), holders=holders)


def test_plan_prefers_own_copies_then_balances() -> None:
    verdict = _local(((0, 1), (0, 1), (2,), (3,)))
    needs = [frozenset({0}), frozenset({1}), frozenset({0, 1, 2}), frozenset({0, 3})]
    plan = plan_transfers(verdict, needs)
    assert plan.own == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert [(t.part, t.sender, t.receiver) for t in plan.sends] == [(0, 0, 2), (0, 1, 3), (1, 0, 2)]
    assert plan.sends_from(1) == (plan.sends[1],)
    assert plan.receives_at(2) == (plan.sends[0], plan.sends[2])


def test_plan_prefers_a_holder_on_the_receivers_node() -> None:
    verdict = _local(((0, 2), (0, 2)))
    topology = Topology(world_size=4, local_world_size=2)
    plan = plan_transfers(
        verdict, [frozenset(), frozenset(), frozenset(), frozenset({0, 1})], topology
    )
    assert {t.sender for t in plan.sends} == {2}
    plan = plan_transfers(
        verdict, [frozenset(), frozenset({0, 1}), frozenset(), frozenset()], topology
    )
    assert {t.sender for t in plan.sends} == {0}


def test_plan_refusals() -> None:
    with pytest.raises(ValueError, match="local"):
        plan_transfers(Verdict(source="durable", step=3), [frozenset()])
    with pytest.raises(ValueError, match="part 2"):
        plan_transfers(_local(((0,), (0,))), [frozenset({2})])
    with pytest.raises(ValueError, match="beyond"):
        plan_transfers(_local(((3,),)), [frozenset({0})])
    with pytest.raises(ValueError, match="topology"):
        plan_transfers(_local(((0,),)), [frozenset()], Topology(world_size=2, local_world_size=1))


_SIZES = {0: 100, 3: 50}  # parts with a data file, and its size


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"0": 1}, "not a list"),
        ([[4, [[0, 1]]]], "part 4"),
        ([[1, [[0, 1]]]], "part 1 is no part"),  # no data file: never needed
        ([[-1, [[0, 1]]]], "part -1"),
        ([[True, [[0, 1]]]], "part True"),
        ([[0, [[0, 1]]], [0, [[2, 3]]]], "twice"),
        ([None], "None"),
        ([[0]], "not \\[part"),
        ([[0, [[0, 1]], 5]], "not \\[part"),
        ([[0, []]], "no byte range"),
        ([[0, [[0, 101]]]], "inside its data file of 100"),
        ([[0, [[-1, 5]]]], "not a byte range"),
        ([[0, [[5, 5]]]], "not a byte range"),  # empty
        ([[0, [[5, 9], [9, 12]]]], "not a byte range"),  # touching the one before
        ([[0, [[5, 9], [2, 3]]]], "not a byte range"),  # out of order
        ([[0, [[0, 1.5]]]], "not a byte range"),
        ([[0, [[0, 1, 2]]]], "not a byte range"),
        ([[0, [[0, False]]]], "not a byte range"),
    ],
)
def test_needs_are_untrusted(record: object, words: str) -> None:
    with pytest.raises(CheckpointFormatError, match=words):
        parse_needs(record, rank=2, sizes=_SIZES)


def test_needs_round_trip_through_json() -> None:
    needs = {3: ((0, 10), (20, 50)), 0: ((99, 100),)}
    record = json.loads(json.dumps(needs_to_json(needs)))
    assert parse_needs(record, rank=2, sizes=_SIZES) == needs
    assert parse_needs([], rank=2, sizes=_SIZES) == {}


_PLANS = st.integers(1, 6).flatmap(
    lambda live: st.tuples(
        st.lists(
            st.sets(st.integers(0, live - 1), min_size=1).map(lambda s: tuple(sorted(s))),
            min_size=1,
            max_size=6,
        ),
        st.lists(st.frozensets(st.integers(0, 5)), min_size=live, max_size=live),
        st.sampled_from([1, 2, 3]).filter(lambda local: live % local == 0) | st.none(),
    )
)


@settings(max_examples=60, deadline=None)
@given(_PLANS)
def test_plan_properties(
    case: tuple[list[tuple[int, ...]], list[frozenset[int]], int | None],
) -> None:
    holders, raw_needs, local = case
    needs = [frozenset(p for p in parts if p < len(holders)) for parts in raw_needs]
    verdict = _local(tuple(holders))
    topology = None if local is None else Topology(world_size=len(needs), local_world_size=local)
    plan = plan_transfers(verdict, needs, topology)
    assert plan == plan_transfers(verdict, needs, topology)
    served = [(rank, part) for rank, part in plan.own] + [(t.receiver, t.part) for t in plan.sends]
    assert sorted(served) == sorted(
        (rank, part) for rank, parts in enumerate(needs) for part in parts
    )
    for rank, part in plan.own:
        assert rank in holders[part]
    for transfer in plan.sends:
        assert transfer.sender in holders[transfer.part]
        assert transfer.receiver not in holders[transfer.part]
        if topology is not None:
            near = [
                h
                for h in holders[transfer.part]
                if topology.node_of(h) == topology.node_of(transfer.receiver)
            ]
            assert not near or transfer.sender in near


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 5))
def test_plan_balances_equal_holders(num_holders: int, parts: int, receivers: int) -> None:
    holders = tuple(range(num_holders))
    verdict = _local((holders,) * parts)
    needs = [frozenset()] * num_holders + [frozenset(range(parts))] * receivers
    plan = plan_transfers(verdict, needs)
    load = [len(plan.sends_from(rank)) for rank in holders]
    assert sum(load) == parts * receivers
    assert max(load) - min(load) <= 1
