"""Tied tensors (one tensor under several keys, as ``model.state_dict()`` gives tied weights)
are written once: the index names the other keys as aliases, and every key loads, tied or
not, into any destination."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import (
    FileFacts,
    LayoutRecord,
    decode_index,
    encode_index,
    seal,
)
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.planning import planner
from shardwise.errors import CheckpointFormatError


def _tied_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(32, 8)
    head = torch.nn.Linear(8, 32, bias=False)
    head.weight = embed.weight
    return torch.nn.ModuleDict({"embed": embed, "norm": torch.nn.LayerNorm(8), "head": head})


def _index(path: os.PathLike[str] | str):
    with CheckpointReader.open(path) as reader:
        return reader.index


def _data_bytes(path: os.PathLike[str] | str) -> int:
    data = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(data, name)) for name in os.listdir(data))


def test_tied_weights_are_written_once_and_named_as_alias(tmp_path):
    model = _tied_model(0)
    ckpt.save({"model": model.state_dict()}, tmp_path / "tied")
    index = _index(tmp_path / "tied")
    # The first key in state-dict order is the one stored; the later one names it.
    assert index.aliases == {"model.head.weight": "model.embed.weight"}
    assert index.tensors["model.head.weight"].chunks == index.tensors["model.embed.weight"].chunks

    untied = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    ckpt.save(untied, tmp_path / "untied")
    assert _index(tmp_path / "untied").aliases == {}
    assert b'"aliases"' not in (tmp_path / "untied" / "shardwise.json").read_bytes()
    saved_once = _data_bytes(tmp_path / "tied")
    assert _data_bytes(tmp_path / "untied") - saved_once >= 32 * 8 * 4


def test_tied_checkpoint_loads_into_tied_and_untied_destinations(tmp_path):
    model = _tied_model(0)
    ckpt.save({"model": model.state_dict(), "step": 7}, tmp_path / "c")

    fresh = _tied_model(1)
    state = {"model": fresh.state_dict(), "step": 0}
    result = ckpt.load(state, tmp_path / "c")
    assert result.missing_keys == [] and result.unexpected_keys == []
    fresh.load_state_dict(state["model"])
    assert fresh.head.weight is fresh.embed.weight
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    plain = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "step": 0}
    ckpt.load(plain, tmp_path / "c")
    assert torch.equal(plain["model"]["head.weight"], model.embed.weight)
    assert torch.equal(plain["model"]["embed.weight"], model.embed.weight)
    assert torch.equal(
        ckpt.load_tensor(tmp_path / "c", "model.head.weight", offsets=[3, 0], sizes=[2, 8]),
        model.embed.weight[3:5],
    )


def test_equal_but_distinct_tensors_and_disjoint_views_are_not_tied(tmp_path):
    base = torch.arange(20.0)
    state = {
        "a": torch.ones(4),
        "b": torch.ones(4),  # equal values, other memory
        "first": base[:10],
        "second": base[10:],  # one storage, other offset
        "t": base.view(4, 5),
        "tt": base.view(4, 5).t(),  # one storage, other strides and size
        "empty1": torch.empty(0),
        "empty2": torch.empty(0),
        "same": base[:10],  # the same view again: tied to "first"
    }
    ckpt.save(state, tmp_path / "c")
    assert _index(tmp_path / "c").aliases == {"same": "first"}
    fresh = {key: torch.zeros_like(value) for key, value in state.items()}
    ckpt.load(fresh, tmp_path / "c")
    for key, value in state.items():
        assert torch.equal(fresh[key], value), key


def test_a_tied_tensor_changed_between_keys_cannot_be_tied(tmp_path):
    # The same tensor object under two keys with different requires_grad views: the
    # properties differ, so both are written.
    weight = torch.nn.Parameter(torch.randn(3, 3))
    ckpt.save({"p": weight, "d": weight.detach()}, tmp_path / "c")
    index = _index(tmp_path / "c")
    assert index.aliases == {}
    assert index.tensors["p"].properties.requires_grad
    assert not index.tensors["d"].properties.requires_grad


def test_async_save_of_tied_weights_stages_them_once(tmp_path):
    model = _tied_model(0)
    future = ckpt.async_save({"model": model.state_dict()}, tmp_path / "c")
    future.result(timeout=60)
    assert _index(tmp_path / "c").aliases == {"model.head.weight": "model.embed.weight"}
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    ckpt.load(state, tmp_path / "c")
    assert torch.equal(state["model"]["head.weight"], model.embed.weight)


# -- the agreement of the ranks (pure) --------------------------------------------------------


def _plan(holders: dict, size=(4,), dtype="float32") -> planner.TensorPlan:
    return planner.TensorPlan(dtype, size, {"dtype": dtype}, holders)


def _merged(**holders: dict) -> dict[str, planner.TensorPlan]:
    return {fqn: _plan(boxes) for fqn, boxes in holders.items()}


ROWS = {((0,), (2,)): [0], ((2,), (2,)): [1]}
EVERYWHERE = {((0,), (4,)): [0, 1]}


def test_agreement_needs_every_rank_holding_elements():
    merged = _merged(a=ROWS, b=ROWS)
    assert planner.agree_aliases([{"b": "a"}, {"b": "a"}], merged) == {"b": "a"}
    # Rank 1 holds elements of both and sees other memory: not tied.
    assert planner.agree_aliases([{"b": "a"}, {}], merged) == {}
    # Ranks that disagree on the target: not tied.
    assert planner.agree_aliases([{"b": "a"}, {"b": "c"}], {**merged, **_merged(c=ROWS)}) == {}


def test_agreement_ignores_ranks_without_elements():
    only_rank0 = {((0,), (4,)): [0], ((4,), (0,)): [1]}
    merged = _merged(a=only_rank0, b=only_rank0)
    assert planner.agree_aliases([{"b": "a"}, {}], merged) == {"b": "a"}
    # Nobody holds an element: nothing to tie.
    nobody = {((0,), (0,)): [0, 1]}
    empty = {"a": _plan(nobody, (0,)), "b": _plan(nobody, (0,))}
    assert planner.agree_aliases([{"b": "a"}, {"b": "a"}], empty) == {}


def test_agreement_needs_equal_global_facts_and_no_chains():
    merged = {"a": _plan(EVERYWHERE), "b": _plan(EVERYWHERE, dtype="float16")}
    assert planner.agree_aliases([{"b": "a"}, {"b": "a"}], merged) == {}
    merged = _merged(a=EVERYWHERE, b=EVERYWHERE, c=EVERYWHERE)
    views = [{"b": "a", "c": "b"}, {"b": "a", "c": "b"}]
    assert planner.agree_aliases(views, merged) == {"b": "a"}
    assert planner.agree_aliases([{"b": "zzz"}, {"b": "zzz"}], merged) == {}


# -- the index's aliases ----------------------------------------------------------------------


def _saved_index(tmp_path) -> bytes:
    ckpt.save({"model": _tied_model(0).state_dict()}, tmp_path / "c")
    return (tmp_path / "c" / "shardwise.json").read_bytes()


def _resealed(data: bytes, change) -> bytes:
    import json

    document = json.loads(data)
    del document["index_checksum"]
    change(document)
    return seal(document)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(aliases=[]), "non-empty list"),
        (lambda d: d.update(aliases={"x": "y"}), "non-empty list"),
        (lambda d: d.update(aliases=[["model.head.weight"]]), "aliases entry"),
        (lambda d: d.update(aliases=[["x", "nope"]]), "not a saved tensor"),
        (lambda d: d.update(aliases=[["model.embed.weight", "model.norm.weight"]]), "twice"),
        (lambda d: d.update(aliases=[["x", "y"], ["y", "model.embed.weight"]]), "not a saved"),
        (lambda d: d.update(aliases=[["x", "model.embed.weight"]] * 2), "twice"),
        (lambda d: d.update(aliases=[["x", 3]]), "string"),
        (lambda d: d.update(aliases=[["x\x00zz", "model.embed.weight"]]), "NUL"),
        # The aliases come last, before the seal.
        (lambda d: d.update(objects=d.pop("objects")), "exactly the keys"),
    ],
)
def test_malformed_aliases_are_refused(tmp_path, change, message):
    data = _resealed(_saved_index(tmp_path), change)
    with pytest.raises(CheckpointFormatError, match=message):
        decode_index(data)


def test_an_index_with_aliases_round_trips(tmp_path):
    index = decode_index(_saved_index(tmp_path))
    tensors = [
        LayoutRecord(key, record.properties, record.size, tuple(record.chunks))
        for key, record in index.tensors.items()
        if key not in index.aliases
    ]
    files = [
        (name, FileFacts(size, index.data_starts[name], index.file_checksums[name]))
        for name, size in index.files.items()
    ]
    again = encode_index(index.save, files, tensors, index.objects.values(), aliases=index.aliases)
    assert decode_index(again) == index
