"""The save protocol of ``docs/design/archive/scale.md`` §2 in real process groups: ranks send the
coordinator a digest (or their table), the coordinator plans and sends each rank only what it
writes, and no rank but the coordinator receives anything O(other ranks' entries)."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint import tuning as tuning_module
from shardwise.checkpoint.loading.reader import CheckpointReader
from tests.harness import distributed

tables_module = importlib.import_module("shardwise.checkpoint.planning.tables")
exchange_module = importlib.import_module("shardwise.collectives.exchange")
outcome_module = importlib.import_module("shardwise.checkpoint.saving.outcome")
data_writer_module = importlib.import_module("shardwise.checkpoint.saving.writer")

WORLD = 4


def _full(rows: int, cols: int, shift: float = 0.0) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + shift


def _chunks(path: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]]:
    with CheckpointReader.open(path) as reader:
        return {
            key: sorted((c.offsets, c.sizes, c.file) for c in record.chunks)
            for key, record in reader.index.tensors.items()
        }


class _Patched:
    """Set attributes for the body of a ``with`` (the pooled workers live on: undo them)."""

    def __init__(self, *changes: tuple[Any, str, Any]) -> None:
        self._changes = changes
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        for owner, name, value in self._changes:
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)


@distributed(world_size=WORLD, timeout=90)
@pytest.mark.parametrize("failing", [0, 2], ids=["coordinator", "other"])
def test_a_rank_whose_layout_check_fails_describes_the_key_as_local(
    failing: int, tmp_path: Path
) -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    flat = init_device_mesh("cpu", (WORLD,))
    state = {
        "fsdp": distribute_tensor(_full(10, 3), flat, [Shard(0)]),  # rank 3: 1 row
        "hsdp": distribute_tensor(_full(6, 5, 100.0), mesh, [Replicate(), Shard(0)]),
        "plain": torch.arange(7.0),
    }
    reference = tmp_path / "reference"
    ckpt.save(state, reference)
    real = tables_module._mesh_row

    def refused(*args: Any) -> Any:
        return None  # as when this rank's boxes are not what the rule gives it

    plans: list[Any] = []
    planner = tables_module.plan_from_tables

    def recorded(*args: Any) -> Any:
        plans.append(planner(*args))
        return plans[-1]

    patch = (tables_module, "_mesh_row", refused if rank == failing else real)
    with _Patched(patch, (tables_module, "plan_from_tables", recorded)):
        ckpt.save(state, tmp_path / "c")
    if rank == 0:
        # The two DTensors became `local` keys: boxes of the ranks that checked out come
        # from the rule, the failing rank's from its own boxes.
        (plan,) = plans
        assert set(plan.plan.chunks) == {"fsdp", "hsdp"} and set(plan.plan.whole) == {"plain"}
    # The same chunks as when every rank checks out, each written once; the values load back.
    assert _chunks(tmp_path / "c").keys() == _chunks(reference).keys()
    for key, chunks in _chunks(tmp_path / "c").items():
        assert [(o, s) for o, s, _ in chunks] == [(o, s) for o, s, _ in _chunks(reference)[key]]
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "fsdp"), _full(10, 3))
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "hsdp"), _full(6, 5, 100.0))
    fresh = {
        "fsdp": distribute_tensor(torch.zeros(10, 3), mesh, [Shard(1), Shard(0)]),
        "hsdp": distribute_tensor(torch.zeros(6, 5), flat, [Shard(1)]),
        "plain": torch.zeros(7),
    }
    ckpt.load(fresh, tmp_path / "c")
    assert torch.equal(fresh["fsdp"].full_tensor(), _full(10, 3))
    assert torch.equal(fresh["hsdp"].full_tensor(), _full(6, 5, 100.0))
    assert torch.equal(fresh["plain"], torch.arange(7.0))


class _Counted:
    """Bytes of JSON this process decodes from the coordinator-shaped collectives (gather,
    scatter, broadcast all end in ``exchange._decode``), and calls of the all-gather."""

    def __init__(self) -> None:
        self.received = 0
        self.all_gathers = 0
        self._decode = exchange_module._decode
        self._all_gather = exchange_module.all_gather_json

    def decode(self, buffer: torch.Tensor) -> Any:
        self.received += buffer.numel()
        return self._decode(buffer)

    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        self.all_gathers += 1
        return self._all_gather(*args, **kwargs)

    def patches(self) -> _Patched:
        return _Patched(
            (exchange_module, "_decode", self.decode),
            (exchange_module, "all_gather_json", self.all_gather),
        )


def _fsdp_state(keys: int) -> dict[str, Any]:
    flat = init_device_mesh("cpu", (WORLD,))
    state: dict[str, Any] = {}
    for number in range(keys):
        state[f"layer{number:04d}.weight"] = distribute_tensor(
            _full(8, 4, float(number)), flat, [Shard(0)]
        )
        state[f"layer{number:04d}.step"] = torch.tensor(float(number))
    state["epoch"] = 3
    return state


@distributed(world_size=WORLD, timeout=120)
def test_a_rank_receives_bytes_of_its_own_entries_only(tmp_path: Path) -> None:
    rank = dist.get_rank()
    received = {}
    for keys in (20, 80):
        counted = _Counted()
        # The index is not sent with the outcome (it is for small saves): each rank's return
        # value reads it from storage when walked.
        unsent = dataclasses.replace(tuning_module.TUNING, sent_index_bytes=1)
        with counted.patches(), _Patched((tuning_module, "TUNING", unsent)):
            metadata = ckpt.save(_fsdp_state(keys), tmp_path / f"k{keys}")
        assert counted.all_gathers == 0, "no all-gather: every rank would receive every plan"
        received[keys] = counted.received
        print(f"rank {rank}, {keys} keys: received {counted.received} B")
        if rank != 0:
            # A digest, verdicts, its assignment (the `step`s it writes, ~25 bytes each: a
            # quarter of them), the outcome: a few hundred bytes, not the index.
            assert counted.received < 1024 + 25 * keys, counted.received
        # The return value is the committed checkpoint's metadata on every rank.
        assert metadata == ckpt.read_metadata(tmp_path / f"k{keys}")
        assert len(metadata.state_dict_metadata) == 2 * keys + 1
    if rank != 0:
        # 4x the keys: what a rank receives grows with the keys it writes (a quarter of the
        # `step`s, ~25 bytes each), not with what the others hold (4 ranks x 4x the entries).
        growth = received[80] - received[20]
        assert growth < 60 * 25 * 2, received
    else:
        assert received[80] > received[20]


@distributed(world_size=WORLD, timeout=120)
def test_ranks_with_different_keys_send_their_tables(tmp_path: Path) -> None:
    rank = dist.get_rank()
    # Pipeline-like: stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) hold different keys, each
    # sharded over its stage's two ranks; every rank has the step counter.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    state: dict[str, Any] = {"step": torch.tensor(5.0)}
    for layer in range(3):
        name = f"stage{stage}.layer{layer}"
        full = _full(5, 3, 10.0 * layer + 100.0 * stage)
        state[f"{name}.weight"] = distribute_tensor(full, mesh["dp"], [Shard(0)])
        state[f"{name}.bias"] = torch.full((3,), float(stage * 10 + layer))
    seen: list[list[dict[str, Any]]] = []
    real = tables_module.plan_from_tables

    def recorded(coordinator: Any, envelopes: Any, *args: Any) -> Any:
        seen.append(list(envelopes))
        return real(coordinator, envelopes, *args)

    with _Patched((tables_module, "plan_from_tables", recorded)):
        ckpt.save(state, tmp_path / "c")
    if rank == 0:
        (envelopes,) = seen
        # Rank 1 has the coordinator's table: a digest only; stage 1's ranks send theirs.
        assert ["table" in envelope for envelope in envelopes] == [False, False, True, True]
        assert envelopes[2]["digest"] == envelopes[3]["digest"] != envelopes[0]["digest"]
    else:
        assert seen == []
    chunks = _chunks(tmp_path / "c")
    assert len(chunks) == 1 + 2 * 2 * 3
    for stage_number in range(2):
        for layer in range(3):
            name = f"stage{stage_number}.layer{layer}"
            weight = chunks[f"{name}.weight"]
            assert [(o, s) for o, s, _ in weight] == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
            # Each stage's shards are in its own ranks' files.
            owners = {int(file.split("rank-")[1].split(".")[0]) for *_, file in weight}
            assert owners == {2 * stage_number, 2 * stage_number + 1}
            expected = _full(5, 3, 10.0 * layer + 100.0 * stage_number)
            assert torch.equal(ckpt.load_tensor(tmp_path / "c", f"{name}.weight"), expected)
            bias = ckpt.load_tensor(tmp_path / "c", f"{name}.bias")
            assert torch.equal(bias, torch.full((3,), float(stage_number * 10 + layer)))
    assert len(chunks["step"]) == 1
    fresh = {key: torch.zeros_like(value) for key, value in state.items()}
    ckpt.load(fresh, tmp_path / "c")
    for key, value in state.items():
        assert torch.equal(fresh[key], value), key


@distributed(world_size=WORLD, timeout=60)
def test_empty_shards_past_the_end_are_no_chunks(tmp_path: Path) -> None:
    flat = init_device_mesh("cpu", (WORLD,))
    # 5 rows over 4 ranks: 2, 2, 1 and an empty shard at the global size (DTensor's rule),
    # which is no grid cell (rank 3 holds nothing, and writes no file); a tensor with no
    # element at all is one empty cell.
    state = {
        "w": distribute_tensor(_full(5, 3), flat, [Shard(0)]),
        "none": distribute_tensor(torch.zeros(0, 3), flat, [Shard(0)]),
    }
    ckpt.save(state, tmp_path / "c")
    chunks = _chunks(tmp_path / "c")
    assert [(o, s) for o, s, _ in chunks["w"]] == [
        ((0, 0), (2, 3)),
        ((2, 0), (2, 3)),
        ((4, 0), (1, 3)),
    ]
    assert [(o, s) for o, s, _ in chunks["none"]] == [((0, 0), (0, 3))]
    files = json.loads((tmp_path / "c" / "shardwise.json").read_bytes())["files"]
    assert [row is None for row in files] == [False, False, False, True]
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w"), _full(5, 3))


@distributed(world_size=WORLD, timeout=60)
def test_chunk_sharded_tensors_are_planned_by_their_rule(tmp_path: Path) -> None:
    cols = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(WORLD)])
    full = _full(4, 6)  # 6 columns over 4 ranks: 2, 2, 2 and an empty chunk at column 6 (no cell)
    plans: list[Any] = []
    planner = tables_module.plan_from_tables

    def recorded(*args: Any) -> Any:
        plans.append(planner(*args))
        return plans[-1]

    with _Patched((tables_module, "plan_from_tables", recorded)):
        ckpt.save({"st": sw.shard_tensor(full, cols)}, tmp_path / "c")
    if dist.get_rank() == 0:
        (plan,) = plans
        assert set(plan.plan.grids) == {"st"}
    chunks = _chunks(tmp_path / "c")["st"]
    assert [(o, s) for o, s, _ in chunks] == [
        ((0, 0), (4, 2)),
        ((0, 2), (4, 2)),
        ((0, 4), (4, 2)),
    ]
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "st"), full)


@distributed(world_size=WORLD, timeout=90)
def test_a_malformed_plan_from_a_rank_fails_the_save_everywhere(tmp_path: Path) -> None:
    # Rank 2 sends a table without rows (as another shardwise version might): every rank
    # raises the same CheckpointError and nothing is committed.
    rank = dist.get_rank()
    state = {"plain": torch.arange(7.0) + rank, "w": torch.ones(3)}
    real = tables_module.rank_table

    def other_shape(*args: Any) -> Any:
        table = real(*args)
        table.digest = "0" * 32  # not the coordinator's: the table travels
        return table

    def no_rows(table: Any) -> dict[str, Any]:
        return {"meshes": []}

    changes = [
        (tables_module, "rank_table", other_shape),
        (tables_module.RankTable, "to_json", no_rows),
    ]
    with (
        _Patched(*(changes if rank == 2 else [])),
        pytest.raises(ckpt.CheckpointError, match="a rank sent a malformed save plan"),
    ):
        ckpt.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()


@distributed(world_size=WORLD, timeout=90)
def test_malformed_file_facts_from_a_rank_fail_the_save_everywhere(tmp_path: Path) -> None:
    # Rank 1 reports its data file in another shape (as another shardwise version might):
    # every rank raises the same CheckpointError and nothing is committed.
    rank = dist.get_rank()
    state = {"plain": torch.arange(7.0) + rank, "w": torch.ones(3)}
    real = data_writer_module.write_data_file

    def other_shape(*args: Any, **kwargs: Any) -> Any:
        facts = real(*args, **kwargs)
        return {"file": facts.get("file")} if facts else {"file": ["x"]}

    changes = [(data_writer_module, "write_data_file", other_shape)] if rank == 1 else []
    with (
        _Patched(*changes),
        pytest.raises(ckpt.CheckpointError, match="a rank sent malformed file facts"),
    ):
        ckpt.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()


@distributed(world_size=WORLD, timeout=120)
def test_a_ranks_return_value_is_decoded_when_first_looked_at(tmp_path: Path) -> None:
    # Every rank returns the committed checkpoint's metadata, but only the coordinator decodes
    # the index during the save (its read-back check); the others decode it (from the index
    # sent with the outcome, or from storage when it is large) only when the return value is
    # walked, so a training loop that ignores it does not pay per key.
    rank = dist.get_rank()
    decoded: list[int] = []
    real = outcome_module.decode_index

    def counting(data: bytes) -> Any:
        decoded.append(len(data))
        return real(data)

    for sent in (True, False):
        path = tmp_path / f"sent{sent}"
        decoded.clear()
        tuned = tuning_module.TUNING
        if not sent:
            tuned = dataclasses.replace(tuned, sent_index_bytes=1)
        with (
            _Patched((outcome_module, "decode_index", counting)),
            _Patched((tuning_module, "TUNING", tuned)),
        ):
            metadata = ckpt.save(_fsdp_state(12), path)
            assert decoded == []
            expected = ckpt.read_metadata(path)
            assert metadata.planner_data == expected.planner_data
            assert metadata.version == expected.version
            assert metadata.storage_meta == expected.storage_meta
            assert dict(metadata.state_dict_metadata) == dict(expected.state_dict_metadata)
            assert dict(metadata.storage_data) == dict(expected.storage_data)
            assert len(decoded) == (1 if sent and rank != 0 else 0)
