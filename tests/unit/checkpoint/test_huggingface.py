"""Hugging Face safetensors in one process (issue 27): the pure rules (index names, headers
agreed with the index, key mapping, the save plan), ``load_safetensors`` (which files a path
means, keys, dtypes, targets of every memory layout, the reads a row band and a column band
make, files outside the directory) and ``save_safetensors`` (what it refuses, what it
replaces). Multi-rank behaviour: ``tests/distributed/checkpoint/test_huggingface.py``;
hostile headers fuzzed: ``test_huggingface_fuzz.py``; one attack per test:
``test_huggingface_hostile.py``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.huggingface import load as hf_load
from shardwise.checkpoint.huggingface.files import parse_index_json
from shardwise.checkpoint.huggingface.headers import catalog
from shardwise.checkpoint.huggingface.keys import Names
from shardwise.checkpoint.huggingface.save import plan_files
from shardwise.local_shards import LocalShardsWrapper
from tests import _hostile as h


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "model.embed.weight": torch.randn(6, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(5, 8, generator=g),
        "model.ids": torch.arange(12).reshape(3, 4),
    }


def _directory(path: Path, split: bool = True) -> Path:
    """A model directory written by the safetensors library (split in two, with an index)."""
    path.mkdir()
    tensors = _tensors()
    if not split:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    files = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


# -- index and headers (pure) --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../model.safetensors", "sub/model.safetensors", ".hidden.safetensors", "/etc/passwd",
     "model.bin", "model.safetensors\x00", "..", "a\\b.safetensors"],
)  # fmt: skip
def test_an_index_naming_anything_but_a_plain_weight_file_is_refused(name: str) -> None:
    data = json.dumps({"weight_map": {"w": name}}).encode()
    with pytest.raises(ckpt.CheckpointFormatError, match="refusing to open it") as caught:
        parse_index_json(data, "index.json")
    assert caught.value.key == "w"


@pytest.mark.parametrize(
    ("data", "says"),
    [(b"\xff", "not UTF-8"), (b"[1]", "weight_map"), (b'{"weight_map": [1]}', "weight_map"),
     (b'{"weight_map": {"w": 3}}', "not a file name"), (b"{" * 100_000, "nested too deeply|JSON"),
     (b"{", "not valid JSON")],
)  # fmt: skip
def test_a_malformed_index_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(ckpt.CheckpointFormatError, match=says):
        parse_index_json(data, "index.json")


def _header(entries: dict[str, Any]) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


def test_headers_must_agree_with_the_index() -> None:
    one = _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    two = _header({"b": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]}})
    headers = {"x.safetensors": (one, len(one) + 8), "y.safetensors": (two, len(two) + 3)}
    found = catalog(headers, {"a": "x.safetensors", "b": "y.safetensors"}, str)
    assert found.tensors["b"].dtype == torch.int8 and found.tensors["b"].begin == len(two)
    assert found.sizes == {"x.safetensors": len(one) + 8, "y.safetensors": len(two) + 3}
    with pytest.raises(ckpt.CheckpointFormatError, match=r"'y\.safetensors' holds it") as caught:
        catalog(headers, {"a": "x.safetensors", "b": "x.safetensors"}, str)
    assert caught.value.key == "b"
    with pytest.raises(ckpt.CheckpointFormatError, match="the index does not name it"):
        catalog(headers, {"a": "x.safetensors"}, str)
    with pytest.raises(ckpt.CheckpointFormatError, match="two weight files hold this tensor"):
        catalog(
            {"x.safetensors": headers["x.safetensors"], "z.safetensors": headers["x.safetensors"]},
            None,
            str,
        )


def test_key_names_by_prefix_and_key_map() -> None:
    names = Names.of("model", {"a.w": "x.w"}.get)
    assert names.name_of("model.a.w") == "x.w"
    assert names.name_of("model.b") is None  # the key map leaves it out
    assert names.name_of("optim.a.w") is None  # not under the prefix
    assert Names.of(None, None).name_of("a.b") == "a.b"
    with pytest.raises(ckpt.CheckpointKeyError, match="key_map raised KeyError"):
        Names.of(None, {}.__getitem__).name_of("a")
    with pytest.raises(ckpt.CheckpointKeyError, match="must return a name"):
        Names.of(None, lambda key: 3).name_of("a")  # type: ignore[arg-type,return-value]


def test_the_save_plan_splits_names_and_ties_as_consolidate_does() -> None:
    # One rank's table: key, name, dtype, size, boxes, the earlier key of the same memory.
    table = [
        ["m.a", "a", "float32", [4, 4], [[[0, 0], [4, 4]]], None],
        ["m.b", "b", "int64", [3], [[[0], [3]]], None],
        ["m.tied", "tied", "float32", [4, 4], [[[0, 0], [4, 4]]], "m.a"],
        ["m.c", "c", "float32", [10, 4], [[[0, 0], [10, 4]]], None],
    ]
    plan = plan_files([table], torch.bfloat16, max_bytes=40)
    assert plan.tied == {"m.tied": "m.a"}
    assert {k: (t.name, t.dtype) for k, t in plan.tensors.items()} == {
        "m.a": ("a", torch.bfloat16),
        "m.b": ("b", torch.int64),  # only floating point is cast
        "m.c": ("c", torch.bfloat16),
    }
    # 32 + 24 bytes > 40: a file each; c (80 bytes) above the limit gets its own right
    # away, while b's file stays open for what follows.
    assert [(f.name, sorted(f.starts)) for f in plan.files] == [
        ("model-00001-of-00003.safetensors", ["m.a"]),
        ("model-00002-of-00003.safetensors", ["m.c"]),
        ("model-00003-of-00003.safetensors", ["m.b"]),
    ]
    gappy = [["m.a", "a", "float32", [4, 4], [[[0, 0], [2, 4]]], None]]
    with pytest.raises(ckpt.CheckpointMismatchError, match="do not make up the tensor"):
        plan_files([gappy], None, 100)
    other = [["m.a", "a", "float32", [4, 5], [[[0, 0], [4, 5]]], None]]
    with pytest.raises(ckpt.CheckpointMismatchError, match="rank 1 has name 'a'"):
        plan_files([table[:1], other], None, 100)


# -- load ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [True, False], ids=["index", "single"])
def test_load_a_directory_or_one_file_as_load_file_reads_it(
    tmp_path: Path, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _directory(tmp_path / "hf", split)
    # Weight files are opened by name inside the opened directory (openat), which the audit
    # hook records as a bare name: resolved from the working directory.
    monkeypatch.chdir(path)
    reference = {
        k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()
    }
    target = _zeros_like(reference)
    with h.confined_opens(path):
        assert ckpt.load_safetensors(target, path) == ([], [])
    h.assert_same_values(target, reference)
    first = sorted(path.glob("*.safetensors"))[0]
    one = _zeros_like(load_file(str(first)))
    assert ckpt.load_safetensors(one, str(first)) == ([], [])
    h.assert_same_values(one, load_file(str(first)))


def test_which_files_a_directory_means(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no safetensors weights"):
        ckpt.load_safetensors({}, tmp_path / "missing")
    (tmp_path / "two").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"w": torch.ones(2)}, str(tmp_path / "two" / name))
    with pytest.raises(ckpt.CheckpointNotFoundError, match="several sets of weights"):
        ckpt.load_safetensors({}, tmp_path / "two")
    os.remove(tmp_path / "two" / "b.safetensors")  # the only weight file: it is the model
    target = {"w": torch.zeros(2)}
    ckpt.load_safetensors(target, tmp_path / "two")
    assert target["w"].tolist() == [1.0, 1.0]


def _load_part(state: dict[str, Any], path: Path, **options: Any) -> ckpt.LoadResult:
    """``load_safetensors`` of a few of the files' tensors (the others named in a warning)."""
    with pytest.warns(UserWarning, match="in the safetensors files but not in the state dict"):
        return ckpt.load_safetensors(state, path, strict=False, **options)


def test_keys_tied_weights_and_strictness(tmp_path: Path) -> None:
    path = _directory(tmp_path / "hf")
    embed = torch.zeros(6, 8)
    state: dict[str, Any] = {
        "model": {"model.embed.weight": embed, "lm_head.weight": torch.zeros(5, 8)},
        "extra": {"bias": torch.zeros(2)},
        "step": 7,
    }
    before = h.snapshot(state)
    with pytest.raises(ckpt.CheckpointKeyError, match="missing from the safetensors") as caught:
        ckpt.load_safetensors(state, path, key_map=lambda key: key.removeprefix("model."))
    assert caught.value.key == "extra.bias"
    h.assert_unchanged(state, before)
    # "model" keeps the keys under it, named without it.
    result = _load_part(state, path, prefix="model")
    assert result == ([], ["model.norm.weight", "model.ids"])
    reference = _tensors()
    assert torch.equal(embed, reference["model.embed.weight"])
    assert torch.equal(state["model"]["lm_head.weight"], reference["lm_head.weight"])
    assert state["step"] == 7 and not state["extra"]["bias"].any()
    # The memory of a filled key under a key the files lack (a tied head) counts as filled.
    state["model"]["head"] = embed
    assert _load_part(state["model"], path).missing_keys == []
    state["model"]["head"] = torch.zeros(6, 8)
    assert _load_part(state["model"], path).missing_keys == ["head"]
    # A key map may give two keys one tensor.
    two = {"a": torch.zeros(5, 8), "b": torch.zeros(5, 8)}
    _load_part(two, path, key_map=lambda key: "lm_head.weight")
    assert torch.equal(two["a"], reference["lm_head.weight"])
    assert torch.equal(two["b"], reference["lm_head.weight"])


def test_dtypes_are_cast_only_between_floating_point_and_only_when_asked(tmp_path: Path) -> None:
    path = _directory(tmp_path / "hf")
    norm = {"model.norm.weight": torch.zeros(8)}  # bf16 in the file
    with pytest.raises(ckpt.CheckpointMismatchError, match="pass allow_dtype_cast=True") as caught:
        ckpt.load_safetensors(norm, path, strict=False)
    assert caught.value.key == "model.norm.weight" and not norm["model.norm.weight"].any()
    _load_part(norm, path, allow_dtype_cast=True)
    assert torch.equal(norm["model.norm.weight"], _tensors()["model.norm.weight"].float())
    ids = {"model.ids": torch.zeros(3, 4)}  # int64 in the file
    with pytest.raises(ckpt.CheckpointMismatchError, match="only floating-point dtypes are cast"):
        ckpt.load_safetensors(ids, path, strict=False, allow_dtype_cast=True)
    wrong = {"model.ids": torch.zeros(4, 3, dtype=torch.int64)}
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"file has size \[3, 4\]"):
        ckpt.load_safetensors(wrong, path, strict=False)


def test_targets_of_any_memory_layout(tmp_path: Path) -> None:
    path = _directory(tmp_path / "hf")
    reference = _tensors()["model.embed.weight"]
    wide = torch.zeros(6, 20)
    transposed = torch.zeros(8, 6).t()  # not contiguous
    shards = LocalShardsWrapper([torch.zeros(6, 3), torch.zeros(6, 5)], [(0, 0), (0, 3)])
    for target in (wide[:, 4:12], transposed, shards):
        _load_part({"model.embed.weight": target}, path)
    assert torch.equal(wide[:, 4:12], reference) and not wide[:, :4].any()
    assert torch.equal(transposed, reference)
    assert torch.equal(torch.cat(shards.local_shards(), dim=1), reference)


def test_a_row_band_is_one_read_and_a_column_band_one_read_per_row(tmp_path: Path) -> None:
    # Rows of 128 KiB: reading through the other columns would cost more than a read per row.
    full = torch.arange(8 * 32768, dtype=torch.float32).reshape(8, 32768)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    storage = hf_load.open_shared_storage(str(tmp_path), None, 1)
    survey = hf_load._survey(storage, str(tmp_path), None)
    tensors = hf_load._decode_survey(storage, survey)
    start = tensors.tensors["w"].begin
    rows = LocalShardsWrapper([torch.zeros(3, 32768)], [(2, 0)])
    plan = hf_load._plan({"w": rows}, tensors, Names(), False)
    assert [(j.read.file_offset, j.read.nbytes) for j in plan.jobs] == [
        (start + 2 * 131072, 3 * 131072)
    ]
    columns = LocalShardsWrapper([torch.zeros(8, 8192)], [(0, 16384)])
    plan = hf_load._plan({"w": columns}, tensors, Names(), False)
    assert [(j.read.file_offset, j.read.nbytes) for j in plan.jobs] == [
        (start + row * 131072 + 16384 * 4, 8192 * 4) for row in range(8)
    ]
    ckpt.load_safetensors({"w": columns}, tmp_path)
    assert torch.equal(columns.local_shards()[0], full[:, 16384:24576])


def test_nothing_outside_the_directory_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, str(outside))
    path = tmp_path / "hf"
    path.mkdir()
    (path / "model.safetensors").symlink_to(outside)
    monkeypatch.chdir(path)  # (as above: names opened inside the directory)
    with (
        h.confined_opens(path),
        pytest.raises(ckpt.CheckpointDataError, match="not a regular file"),
    ):
        ckpt.load_safetensors({"w": torch.zeros(2)}, path)
    os.remove(path / "model.safetensors")
    (path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "../outside.safetensors"}}'
    )
    with h.confined_opens(path), pytest.raises(ckpt.CheckpointFormatError, match="refusing"):
        ckpt.load_safetensors({"w": torch.zeros(2)}, path)


def test_load_from_memory_url() -> None:
    import fsspec  # type: ignore[import-untyped]

    fs = fsspec.filesystem("memory")
    data = _header({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}) + struct.pack(
        "<3f", 1, 2, 3
    )
    fs.pipe("/hf27/model.safetensors", data)
    target = {"w": torch.zeros(3)}
    ckpt.load_safetensors(target, "memory://hf27")
    assert target["w"].tolist() == [1.0, 2.0, 3.0]
    fs.rm("/hf27", recursive=True)


# -- save ------------------------------------------------------------------------------------------


def test_save_refusals(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "c": torch.ones(2, dtype=torch.complex128)}
    with pytest.raises(ckpt.CheckpointError, match="object stores cannot"):
        ckpt.save_safetensors(state, "memory://out27")
    # A bad argument: a ValueError, not a CheckpointError (no checkpoint is involved).
    with pytest.raises(ValueError, match="not a floating-point dtype") as refused:
        ckpt.save_safetensors(state, tmp_path / "a", dtype=torch.int8)
    assert not isinstance(refused.value, ckpt.CheckpointError)
    with pytest.raises(
        ckpt.CheckpointMismatchError, match="cannot store dtype complex128"
    ) as caught:
        ckpt.save_safetensors(state, tmp_path / "b")
    assert caught.value.key == "c"
    with pytest.raises(ckpt.CheckpointKeyError, match="would both be written as 'x'"):
        ckpt.save_safetensors(
            {"v": torch.ones(1), "w": torch.ones(1)}, tmp_path / "c", key_map=lambda key: "x"
        )
    assert not any((tmp_path / name).exists() for name in "abc")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ckpt.CheckpointStorageError, match="cannot create the files in"):
        ckpt.save_safetensors({"w": torch.ones(2)}, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "not a directory"


def test_save_replaces_an_earlier_save_and_writes_what_load_file_reads(tmp_path: Path) -> None:
    tensors = _tensors()
    out = tmp_path / "out"
    written = ckpt.save_safetensors(tensors, out, max_shard_size=100)
    assert len(written) == 5 and written[-1] == "model.safetensors.index.json"
    (out / "config.json").write_text("{}")
    assert ckpt.save_safetensors(tensors, out, dtype=torch.float16) == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    for key, value in tensors.items():
        expected = value.half() if value.is_floating_point() else value
        assert torch.equal(got[key], expected), key


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_targets_and_sources(tmp_path: Path) -> None:
    # Staged through pinned host memory on load (cast on the way), written from device memory.
    path = _directory(tmp_path / "hf")
    reference = _tensors()
    target = {"model.norm.weight": torch.zeros(8, device="cuda")}  # bf16 in the file
    _load_part(target, path, allow_dtype_cast=True)
    assert torch.equal(target["model.norm.weight"].cpu(), reference["model.norm.weight"].float())
    on_device = {k: v.cuda() for k, v in reference.items()}
    ckpt.save_safetensors(on_device, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    h.assert_same_values(got, reference)
