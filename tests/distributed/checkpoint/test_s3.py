"""Checkpoints through ``s3://`` on real ranks: moto's S3 server runs in the pytest process
(``tests/_s3.py``), the ranks of the gloo pool reach it with the storage options they are
given.

A save on 2 ranks (ShardedTensor rows, DTensor rows, plain tensors, objects) loads on 1
process and on 2 ranks with another sharding, through ``load_tensor``, ``read_metadata`` and
the command line (``verify``, ``consolidate``). The commit needs no rename: the index, written
last, never names a data object that is not there, whoever looks; a save that fails before it
leaves the previous checkpoint, on every rank; storage failures raise on every rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.cli import main
from shardwise.errors import CheckpointStorageError
from tests._s3 import S3Bucket, record_s3_calls, s3_bucket, s3_server  # noqa: F401 (fixtures)
from tests.harness import distributed, run_on_ranks

WORLD = 2
ROWS = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(WORLD)])
COLS = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in (1, 0)])
INDEX = "shardwise.json"


def _matrix() -> torch.Tensor:
    return torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)


def _embedding() -> torch.Tensor:
    return torch.randn(96, 1024, generator=torch.Generator().manual_seed(3))


def _saved() -> dict[str, Any]:
    """This rank's part of the saved state dict (collective: builds sharded tensors)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    return {
        "model": {
            "matrix": sw.shard_tensor(_matrix(), ROWS),
            "embedding": distribute_tensor(_embedding(), mesh, [Shard(0)]),
            "bias": torch.arange(7, dtype=torch.float64),
        },
        "step": 11,
        "config": {"lr": 0.5, "names": ["a", "b"]},
        "blob": io.BytesIO(b"opaque payload"),
    }


def _save_on_ranks(s3: S3Bucket, prefix: str) -> str:
    metadata = ckpt.save(_saved(), s3.url(prefix), storage_options=s3.options)
    return str(metadata.storage_meta.save_id)


def _load_on_ranks_resharded(s3: S3Bucket, prefix: str) -> None:
    # Columns (in the other rank order) and a DTensor sharded by columns.
    mesh = init_device_mesh("cpu", (WORLD,))
    matrix = sw.zeros(COLS, 13, 6)
    embedding = distribute_tensor(torch.zeros(96, 1024), mesh, [Shard(1)])
    state: dict[str, Any] = {
        "model": {
            "matrix": matrix,
            "embedding": embedding,
            "bias": torch.zeros(7, dtype=torch.float64),
        },
        "step": 0,
        "config": {"lr": 0.0, "names": []},
        "blob": None,
    }
    result = ckpt.load(state, s3.url(prefix), storage_options=s3.options)
    assert result.missing_keys == [] and result.unexpected_keys == []
    full = torch.zeros(13, 6) if dist.get_rank() == 0 else None
    matrix.gather(dst=0, out=full)
    if dist.get_rank() == 0:
        assert torch.equal(full, _matrix())
    assert torch.equal(embedding.full_tensor(), _embedding())
    assert torch.equal(state["model"]["bias"], torch.arange(7, dtype=torch.float64))
    assert state["step"] == 11 and state["config"] == {"lr": 0.5, "names": ["a", "b"]}
    assert state["blob"].getvalue() == b"opaque payload"


def test_save_on_two_ranks_then_load_anywhere_read_and_use_the_command_line(
    s3: S3Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3.url("ckpt")
    save_ids = run_on_ranks(_save_on_ranks, WORLD, args=(s3, "ckpt"), timeout=90)
    assert save_ids[0] == save_ids[1]
    # Both ranks wrote a data object (the sharded tensors are split between them).
    data = sorted(key for key in s3.keys("ckpt") if key.startswith("ckpt/data/"))
    assert [key.split("/")[-1].split(".")[0] for key in data] == ["rank-00000", "rank-00001"]

    # One process, no group: every tensor whole.
    state: dict[str, Any] = {
        "model": {
            "matrix": torch.zeros(13, 6),
            "embedding": torch.zeros(96, 1024),
            "bias": torch.zeros(7, dtype=torch.float64),
        },
        "step": 0,
        "config": {"lr": 0.0, "names": []},
        "blob": None,
    }
    ckpt.load(state, url, storage_options=s3.options)
    assert torch.equal(state["model"]["matrix"], _matrix())
    assert torch.equal(state["model"]["embedding"], _embedding())
    assert state["step"] == 11 and state["blob"].getvalue() == b"opaque payload"

    # Two ranks, another sharding.
    run_on_ranks(_load_on_ranks_resharded, WORLD, args=(s3, "ckpt"), timeout=90)

    box = ckpt.load_tensor(
        url, "model.embedding", offsets=[40, 100], sizes=[20, 300], storage_options=s3.options
    )
    assert torch.equal(box, _embedding()[40:60, 100:400])
    metadata = ckpt.read_metadata(url, storage_options=s3.options)
    assert metadata.planner_data["world_size"] == WORLD
    assert metadata.state_dict_metadata["model.embedding"].size == torch.Size([96, 1024])
    assert metadata.storage_meta.save_id == save_ids[0]

    # The command line, with the storage options as JSON.
    options = json.dumps(s3.options)
    capsys.readouterr()
    assert main(["verify", url, "--storage-options", options]) == 0, capsys.readouterr()
    out = s3.url("hf")
    assert main(["consolidate", url, out, "--storage-options", options]) == 0, capsys.readouterr()
    consolidated = s3.filesystem().cat_file(f"{s3.name}/hf/model.safetensors")
    tensors = load_safetensors(consolidated)
    assert torch.equal(tensors["model.matrix"], _matrix())
    assert torch.equal(tensors["model.embedding"], _embedding())
    assert torch.equal(tensors["model.bias"], torch.arange(7, dtype=torch.float64))


def test_the_command_line_reports_a_storage_failure_in_one_line(
    s3: S3Bucket, capsys: pytest.CaptureFixture[str]
) -> None:
    run_on_ranks(_save_on_ranks, WORLD, args=(s3, "ckpt"), timeout=90)
    url = s3.url("ckpt")
    options = json.dumps({k: v for k, v in s3.options.items() if k not in ("key", "secret")})
    capsys.readouterr()
    for command in (["verify", url], ["consolidate", url, s3.url("hf")]):
        assert main([*command, "--storage-options", options]) == 4
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "no credentials found" in err, err
        assert "Traceback" not in err


# -- the commit ------------------------------------------------------------------------------


def _save_watching_the_commit(s3: S3Bucket) -> dict[str, int] | None:
    """Save twice; on the coordinator, return the data objects present (key: size) right
    before the second save's index PUT."""
    fs = s3.filesystem()
    watch = INDEX if dist.get_rank() == 0 else None
    ckpt.save(_saved(), s3.url("ckpt"), storage_options=s3.options)
    with record_s3_calls(fs, watch=watch) as calls:
        ckpt.save(_saved(), s3.url("ckpt"), storage_options=s3.options)
    if watch is None:
        assert calls.listings == []
        return None
    ((key, present),) = calls.listings
    assert key == f"ckpt/{INDEX}"
    return present


def test_the_index_names_only_data_objects_that_every_rank_has_written(s3: S3Bucket) -> None:
    present = run_on_ranks(_save_watching_the_commit, WORLD, args=(s3,), timeout=90)[0]
    assert present is not None
    index = json.loads(s3.filesystem().cat_file(f"{s3.name}/ckpt/{INDEX}"))
    named = {f"ckpt/{row[0]}": row[1] for row in index["files"] if row is not None}
    assert len(named) == WORLD
    assert {key: present.get(key) for key in named} == named


def _tagged(tag: int) -> dict[str, Any]:
    """This rank's part of a state dict whose values are those of ``tag``: a row-sharded
    tensor (a data object per rank) and a replicated one."""
    return {
        "rows": sw.shard_tensor(_rows(tag), ROWS),
        "plain": torch.full((64, 256), float(tag)),
        "tag": tag,
    }


def _rows(tag: int) -> torch.Tensor:
    return torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096) + tag


def _save_tags(s3: S3Bucket, tags: list[int]) -> None:
    for tag in tags:
        ckpt.save(_tagged(tag), s3.url("ckpt"), storage_options=s3.options)


def test_a_reader_polling_during_saves_never_sees_an_index_before_its_data(
    s3: S3Bucket,
) -> None:
    # The pytest process reads the checkpoint over and over while 2 ranks save it again and
    # again. Every read gets a complete checkpoint of one save. A data object may only be
    # missing when a newer save replaced the index in the meantime (and removed it).
    url = s3.url("ckpt")
    tags = list(range(1, 13))
    stop = threading.Event()
    problems: list[str] = []
    conclusive = [0]
    index_path = f"{s3.name}/ckpt/{INDEX}"
    fs = s3.filesystem()

    def current_index() -> bytes | None:
        try:
            return bytes(fs.cat_file(index_path))
        except FileNotFoundError:
            return None

    def poll() -> None:
        while not stop.is_set():
            before = current_index()
            state: dict[str, Any] = {
                "rows": torch.zeros(8, 4096),
                "plain": torch.zeros(64, 256),
                "tag": 0,
            }
            try:
                ckpt.load(state, url, storage_options=s3.options)
            except ckpt.CheckpointNotFoundError:
                if before is not None:
                    problems.append("the index disappeared")
                continue
            except ckpt.CheckpointDataError as err:
                if current_index() == before:  # no newer save: the index named a missing object
                    problems.append(f"{err} (index unchanged)")
                continue
            tag = state["tag"]
            if not (
                tag in tags
                and torch.equal(state["rows"], _rows(tag))
                and torch.equal(state["plain"], torch.full((64, 256), float(tag)))
            ):
                problems.append(f"a mix of saves, or a wrong value (tag {tag})")
            conclusive[0] += 1

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        run_on_ranks(_save_tags, WORLD, args=(s3, tags), timeout=120)
    finally:
        stop.set()
        poller.join(timeout=60)
    assert problems == []
    assert conclusive[0] > 0
    plain = ckpt.load_tensor(url, "plain", storage_options=s3.options)
    assert int(plain[0, 0]) == tags[-1]


def _fail_the_commit_once(s3: S3Bucket) -> None:
    url = s3.url("ckpt")
    ckpt.save(_tagged(1), url, storage_options=s3.options)
    fs = s3.filesystem()
    with contextlib.ExitStack() as stack:
        if dist.get_rank() == 0:
            pipe_file = fs.pipe_file

            def failing(path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> Any:
                if path.endswith(INDEX):
                    raise PermissionError(13, "Access Denied")
                return pipe_file(path, value, mode=mode, **kwargs)

            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(fs, "pipe_file", failing)
        with pytest.raises(CheckpointStorageError) as caught:
            ckpt.save(_tagged(2), url, storage_options=s3.options)
    message = str(caught.value)
    assert message.startswith(f"cannot write {url}/{INDEX}: permission denied"), message
    if dist.get_rank() == 1:
        assert caught.value.rank == 0
    state: dict[str, Any] = {
        "rows": sw.zeros(ROWS, 8, 4096),
        "plain": torch.zeros(64, 256),
        "tag": 0,
    }
    ckpt.load(state, url, storage_options=s3.options)
    assert state["tag"] == 1 and torch.equal(state["plain"], torch.full((64, 256), 1.0))
    dist.barrier()
    ckpt.save(_tagged(3), url, storage_options=s3.options)


def test_a_save_failing_at_its_commit_raises_on_every_rank_and_leaves_the_previous(
    s3: S3Bucket,
) -> None:
    run_on_ranks(_fail_the_commit_once, WORLD, args=(s3,), timeout=90)
    # The failed save's objects (one per rank) were removed by the next save.
    index = json.loads(s3.filesystem().cat_file(f"{s3.name}/ckpt/{INDEX}"))
    assert sorted(s3.keys("ckpt")) == sorted(
        [f"ckpt/{INDEX}", *(f"ckpt/{row[0]}" for row in index["files"] if row is not None)]
    )
    assert json.loads(dict((k, v) for k, _, v in index["objects"])["tag"]) == 3


@distributed(world_size=WORLD, timeout=60)
def test_an_unreachable_endpoint_raises_on_every_rank() -> None:
    options = {
        "endpoint_url": "http://127.0.0.1:9",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    url = "s3://shardwise-nowhere/ckpt"
    with pytest.raises(CheckpointStorageError) as caught:
        ckpt.save({"w": torch.ones(4)}, url, storage_options=options)
    assert "cannot reach the endpoint" in str(caught.value)
    assert caught.value.rank == (None if dist.get_rank() == 0 else 0)
    with pytest.raises(CheckpointStorageError, match="cannot reach the endpoint"):
        ckpt.load({"w": torch.zeros(4)}, url, storage_options=options)
