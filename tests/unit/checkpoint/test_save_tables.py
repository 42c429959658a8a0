"""The two halves of the scale save protocol, pure: a rank's table and the writes it derives
from its assignment, and the coordinator's plan from every rank's envelope."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.checkpoint.entries.items import describe_tensor
from shardwise.checkpoint.planning import tables as _save_tables
from shardwise.checkpoint.planning.save_plan import TableRow
from shardwise.local_shards import LocalShardsWrapper

WORLD = 2


def _table(state: dict[str, torch.Tensor], rank: int = 0) -> _save_tables.RankTable:
    tensors = {key: describe_tensor(key, value) for key, value in state.items()}
    return _save_tables.rank_table(tensors, rank, lambda r: r if r < WORLD else -1)


def _envelope(table: _save_tables.RankTable, coordinator: str, **extra: Any) -> dict[str, Any]:
    sent: dict[str, Any] = {"digest": table.digest, "local": table.local, **extra}
    if table.digest != coordinator:
        sent["table"] = table.to_json()
    return sent


def test_plain_tensors_are_whole_and_wrappers_local() -> None:
    wrapper = LocalShardsWrapper([torch.ones(2, 3)], [(2, 0)])
    table = _table({"w": torch.zeros(4), "lsw": wrapper})
    assert [row.layout for row in table.rows] == [("whole",), ("local", "bounds")]
    assert table.local == {"lsw": [[[2, 0], [2, 3]]]}
    # The digest covers the rows: another size, another digest; the same table, the same one.
    assert _table({"w": torch.zeros(4), "lsw": wrapper}).digest == table.digest
    assert _table({"w": torch.zeros(5), "lsw": wrapper}).digest != table.digest


def test_equal_tables_plan_replicated_tensors_once_and_balanced() -> None:
    state = {f"t{i}": torch.zeros(10 + i) for i in range(6)}
    table = _table(state)
    envelopes = [_envelope(table, table.digest) for _ in range(WORLD)]
    planned = _save_tables.plan_from_tables(table, envelopes, WORLD, {0: 0})
    assert all("table" not in envelope for envelope in envelopes)
    whole = [assignment["whole"] for assignment in planned.assignments]
    assert sorted(key for keys in whole for key in keys) == sorted(state)
    loads = [sum(4 * (10 + int(key[1:])) for key in keys) for keys in whole]
    assert abs(loads[0] - loads[1]) <= 4 * 15 and planned.total == sum(loads)
    # Each rank writes exactly its keys, sorted (the order inside its file).
    for rank in range(WORLD):
        tensors = {key: describe_tensor(key, value) for key, value in state.items()}
        writes, _ = _save_tables.own_file_writes(table, tensors, planned.assignments[rank], rank)
        assert [w.fqn for w in writes] == sorted(whole[rank])


def test_disagreeing_ranks_are_named_as_before() -> None:
    first = _table({"v": torch.zeros(2)})
    second = _table({"v": torch.zeros(3)})
    envelopes = [_envelope(first, first.digest), _envelope(second, first.digest)]
    with pytest.raises(ValueError) as caught:
        _save_tables.plan_from_tables(first, envelopes, WORLD, {})
    assert str(caught.value) == (
        "cannot save 'v': rank 0 has dtype float32 and size [2], rank 1 has dtype float32 "
        "and size [3]"
    )


def test_a_key_whole_on_one_rank_and_local_on_another_is_planned_from_boxes() -> None:
    # Rank 0 has the plain tensor (all of it); rank 1 a wrapper of its second half.
    first = _table({"w": torch.arange(4.0)})
    second = _table({"w": LocalShardsWrapper([torch.arange(2.0, 4.0)], [(2,)])}, rank=1)
    second.rows[0] = TableRow("w", "float32", 4, (4,), second.rows[0].properties, ("local",))
    second.digest = "other"
    envelopes = [_envelope(first, first.digest), _envelope(second, first.digest)]
    with pytest.raises(ValueError, match="do not tile"):
        # [0, 4) and [2, 4) overlap: refused, as the merge of every rank's boxes refused it.
        _save_tables.plan_from_tables(first, envelopes, WORLD, {})


def test_ties_need_every_rank_holding_elements() -> None:
    state = {"a": torch.zeros(3), "b": torch.zeros(3)}
    table = _table(state)
    tied = {"aliases": {"b": "a"}}
    both = [_envelope(table, table.digest, **tied) for _ in range(WORLD)]
    planned = _save_tables.plan_from_tables(table, both, WORLD, {})
    assert planned.aliases == {"b": "a"}
    assert [a["whole"] for a in planned.assignments] in (
        [["a"], []],
        [[], ["a"]],
    )
    assert all(a["aliases"] == ["b"] for a in planned.assignments)
    assert set(planned.plan.whole) == {"a"}  # "b" is not written
    # Rank 1 sees two tensors: both are written.
    one = [_envelope(table, table.digest, **tied), _envelope(table, table.digest)]
    assert _save_tables.plan_from_tables(table, one, WORLD, {}).aliases == {}
